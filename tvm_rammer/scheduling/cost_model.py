"""Analytical cost model: per-rTask time and the fixed costs of an rProgram (Rammer, OSDI'20, 3.3).

The paper's policy reads rTask times from a profiler (3.3, "Compile-time profiling"). Until an rTask is
profiled, its time is estimated with a roofline on the share of the SM the rTask runs on:

    per_veu_flops = peak_tflops_fp32 * 1e12 / num_sms / veus_per_sm        (FLOP/s of one vEU)
    per_veu_bw    = mem_bw_gbps * 1e9 / num_sms / veus_per_sm              (bytes/s of one vEU)
    per_veu_l2_bw = l2_bw_gbps * 1e9 / num_sms / veus_per_sm
    memory_s      = (bytes - l2_bytes) / num_rtasks / per_veu_bw + l2_bytes / num_rtasks / per_veu_l2_bw
    rtask_time_us = 1e6 * max(flops / num_rtasks / per_veu_flops, memory_s) + per_rtask_overhead_us

i.e. the rTask's share of the operator's FLOPs and bytes against one SM's share of the device's peak
compute and bandwidth, divided evenly among the vEUs co-resident on that SM, plus a fixed per-rTask
overhead (dispatch from the rProgram table, index decoding, the final ``__syncthreads``).

``bytes`` are the bytes the operator reads and writes (the regions it accesses, not the whole
tensors: ``rkernels.param_bytes``); ``l2_bytes`` the part of them that comes from the L2 cache
rather than DRAM: a weight that an earlier operator of the model already read, when all such
re-read weights fit ``l2_resident_bytes`` (an unrolled RNN reads each layer's weights once per
step, ``rkernels.resident_inputs``). Every other byte is charged at DRAM bandwidth, the first
read of a weight included.

Device figures (H100 SXM5): ``peak_tflops_fp32`` and ``mem_bw_gbps`` are rounded down from NVIDIA's
data sheet (67 TFLOP/s, 3.35 TB/s; the first GPU run measured 2.92 TB/s for a 1 GiB device copy).
``l2_resident_bytes`` is half of the 50 MB L2: the L2 is two partitions, and a line that SMs on
both sides read may be held in both. ``l2_bw_gbps`` is an assumption until the lent GPU measures
it (``benchmarks.floor``'s ``l2_bytes_per_s``, recorded by ``scripts/gpu_check.sh``): 5.5 TB/s,
about 60% of the 8,986 GB/s that Table 3 of Ultrasonics Sonochemistry 99 (2023) 106546 lists as
the L2 bandwidth of the whole GH100 (144 SMs at 1,755 MHz, i.e. 5,120 bytes per clock), a
theoretical figure that measured loads do not reach.

The fixed costs of an rProgram come from measurements on an H100 SXM:
``launch_us`` (one kernel launch of TVM's default pipeline), ``barrier_us`` (a point-to-point
step-flag wait between two vEUs) and ``grid_sync_us`` (the one grid-wide sync a persistent kernel with
barriers needs to reset its step array; measured for cooperative groups' grid sync, which the kernel
used until 2026-11-27: its own software barrier, ``codegen.cuda_helpers.GRID_SYNC_SOURCE``, is not
measured yet).

Weights read across a barrier (``weight_read_us``; Hazy Research's megakernel, issue 34): before a
vEU polls a barrier-rTask's wait list, the persistent kernel issues L2 prefetches of the share of
weights (constants, never tensors produced in the rProgram) that the rTask after the barrier reads
(``codegen.persistent``, ``RammerConfig(prefetch_weights=True)``). The policy then charges that
rTask ``max(wait, weight_read) + (time - weight_read)`` instead of ``wait + time``, where
``weight_read`` is the rTask's share of the operator's weight bytes at the vEU's share of DRAM
bandwidth (the same figures as above, nothing tuned): the wait overlaps the memory traffic, and
the rTask then finds its weights in L2. An rKernel carries it as ``RKernel.prefetch_us`` (0 where
no prefetch is emitted, and the model charges no overlap there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["CostModelConfig", "rtask_time_us", "weight_read_us"]


@dataclass(frozen=True)
class CostModelConfig:
    """Device throughput and fixed costs used by the analytical model. Defaults: H100 SXM."""

    peak_tflops_fp32: float = 60.0
    mem_bw_gbps: float = 3000.0
    l2_bw_gbps: float = 5500.0
    l2_resident_bytes: int = 25 * 1024 * 1024
    num_sms: int = 132
    per_rtask_overhead_us: float = 0.5
    barrier_us: float = 0.8
    launch_us: float = 4.0
    grid_sync_us: float = 1.4

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"CostModelConfig.{f.name} must be a finite number, got {value!r}")
            strictly = f.name in ("peak_tflops_fp32", "mem_bw_gbps", "l2_bw_gbps", "num_sms")
            if value < 0 or (strictly and value == 0):
                raise ValueError(
                    f"CostModelConfig.{f.name} must be {'> 0' if strictly else '>= 0'}, got {value}"
                )
        for name in ("num_sms", "l2_resident_bytes"):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"CostModelConfig.{name} must be an int, got {getattr(self, name)!r}")


def rtask_time_us(flops: float, bytes: float, num_rtasks: int, veus_per_sm: int,
                  config: CostModelConfig = CostModelConfig(), l2_bytes: float = 0.0) -> float:
    """Estimated time in microseconds of one of ``num_rtasks`` rTasks sharing ``flops`` and ``bytes``
    (``l2_bytes`` of them read from the L2 cache), run on a vEU that shares its SM with
    ``veus_per_sm - 1`` others (formula in the module docstring)."""
    if num_rtasks < 1 or veus_per_sm < 1:
        raise ValueError(f"num_rtasks and veus_per_sm must be >= 1, got {num_rtasks} and {veus_per_sm}")
    if flops < 0 or bytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops} and {bytes}")
    if not 0 <= l2_bytes <= bytes:
        raise ValueError(f"l2_bytes must be between 0 and bytes={bytes}, got {l2_bytes}")
    share = config.num_sms * veus_per_sm  # vEUs the device's throughput is divided among
    per_veu_flops = config.peak_tflops_fp32 * 1e12 / share
    compute_s = flops / num_rtasks / per_veu_flops
    memory_s = ((bytes - l2_bytes) / (config.mem_bw_gbps * 1e9)
                + l2_bytes / (config.l2_bw_gbps * 1e9)) * share / num_rtasks
    return 1e6 * max(compute_s, memory_s) + config.per_rtask_overhead_us


def weight_read_us(weight_bytes: float, num_rtasks: int, veus_per_sm: int,
                   config: CostModelConfig = CostModelConfig()) -> float:
    """Microseconds one of ``num_rtasks`` rTasks takes to read its share of ``weight_bytes`` from
    DRAM on a vEU sharing its SM with ``veus_per_sm - 1`` others: the memory term of
    :func:`rtask_time_us` for those bytes alone (what an L2 prefetch issued before the rTask's
    barrier-rTask overlaps with the wait; module docstring)."""
    if num_rtasks < 1 or veus_per_sm < 1:
        raise ValueError(f"num_rtasks and veus_per_sm must be >= 1, got {num_rtasks} and {veus_per_sm}")
    if weight_bytes < 0:
        raise ValueError(f"weight_bytes must be >= 0, got {weight_bytes}")
    share = config.num_sms * veus_per_sm
    return 1e6 * weight_bytes / (config.mem_bw_gbps * 1e9) * share / num_rtasks
