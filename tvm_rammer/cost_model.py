"""Analytical cost model: per-rTask time and the fixed costs of an rProgram (Rammer, OSDI'20, 3.3).

The paper's policy reads rTask times from a profiler (3.3, "Compile-time profiling"). Until an rTask is
profiled, its time is estimated with a roofline on the share of the SM the rTask runs on:

    per_veu_flops = peak_tflops_fp32 * 1e12 / num_sms / veus_per_sm        (FLOP/s of one vEU)
    per_veu_bw    = mem_bw_gbps * 1e9 / num_sms / veus_per_sm              (bytes/s of one vEU)
    rtask_time_us = 1e6 * max(flops / num_rtasks / per_veu_flops,
                              bytes / num_rtasks / per_veu_bw) + per_rtask_overhead_us

i.e. the rTask's share of the operator's FLOPs and bytes against one SM's share of the device's peak
compute and bandwidth, divided evenly among the vEUs co-resident on that SM, plus a fixed per-rTask
overhead (dispatch from the rProgram table, index decoding, the final ``__syncthreads``).

The fixed costs of an rProgram come from measurements on an H100 SXM:
``launch_us`` (one kernel launch of TVM's default pipeline), ``barrier_us`` (a point-to-point
step-flag wait between two vEUs) and ``grid_sync_us`` (the one grid-wide sync a persistent kernel with
barriers needs to reset its step array).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["CostModelConfig", "rtask_time_us"]


@dataclass(frozen=True)
class CostModelConfig:
    """Device throughput and fixed costs used by the analytical model. Defaults: H100 SXM."""

    peak_tflops_fp32: float = 60.0
    mem_bw_gbps: float = 3000.0
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
            strictly = f.name in ("peak_tflops_fp32", "mem_bw_gbps", "num_sms")
            if value < 0 or (strictly and value == 0):
                raise ValueError(
                    f"CostModelConfig.{f.name} must be {'> 0' if strictly else '>= 0'}, got {value}"
                )
        if not isinstance(self.num_sms, int):
            raise TypeError(f"CostModelConfig.num_sms must be an int, got {self.num_sms!r}")


def rtask_time_us(flops: float, bytes: float, num_rtasks: int, veus_per_sm: int,
                  config: CostModelConfig = CostModelConfig()) -> float:
    """Estimated time in microseconds of one of ``num_rtasks`` rTasks sharing ``flops`` and ``bytes``,
    run on a vEU that shares its SM with ``veus_per_sm - 1`` others (formula in the module docstring)."""
    if num_rtasks < 1 or veus_per_sm < 1:
        raise ValueError(f"num_rtasks and veus_per_sm must be >= 1, got {num_rtasks} and {veus_per_sm}")
    if flops < 0 or bytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops} and {bytes}")
    per_veu_flops = config.peak_tflops_fp32 * 1e12 / config.num_sms / veus_per_sm
    per_veu_bw = config.mem_bw_gbps * 1e9 / config.num_sms / veus_per_sm
    compute_s = flops / num_rtasks / per_veu_flops
    memory_s = bytes / num_rtasks / per_veu_bw
    return 1e6 * max(compute_s, memory_s) + config.per_rtask_overhead_us
