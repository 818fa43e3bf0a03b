"""The virtualized parallel device (vDevice) of an NVIDIA GPU (Rammer, OSDI'20, sections 3.2 and 4.1.2).

A vEU is one persistent thread block. All vEUs of an rProgram are identical (SIMT), so their size is
set by the most demanding rTask of the rProgram: the most threads, the most registers per thread and
the most shared memory (paper 4.1.2). The number of vEUs per SM is the number of such blocks an SM
can hold at once, computed with NVIDIA's occupancy rules (``cuda_occupancy.h``, compute capability
7.0 to 10.x):

- warps:     ``warps_per_block = ceil(threads / warp_size)``,
             blocks <= ``(max_threads_per_sm / warp_size) // warps_per_block``;
- blocks:    blocks <= ``max_blocks_per_sm``;
- registers: ``regs_per_warp = roundup(registers * warp_size, reg_alloc_unit)``; the register file is
             split over ``reg_sub_partitions`` (4) sub-partitions, so
             ``warps_per_sm = (regs_per_sm // reg_sub_partitions // regs_per_warp) * reg_sub_partitions``
             and blocks <= ``warps_per_sm // warps_per_block``; one block fits only if
             ``regs_per_warp * roundup(warps_per_block, reg_sub_partitions) <= regs_per_sm``;
- shared:    ``per_block = roundup(shared_bytes, smem_alloc_unit) + smem_reserved_per_block`` (the driver
             reserves 1 KiB per block on sm_80+), blocks <= ``smem_per_sm // per_block``.

Pure Python: TVM is touched only by :meth:`VDevice.from_tvm_device`, through the device it is given.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from ..rocm.targets import VDEVICE_PRESETS as _AMD_PRESETS
from .rtask import RKernel

__all__ = ["VDevice"]


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


# Per-architecture limits (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
# The SM counts are those of one representative product per architecture, noted on each line; build a
# VDevice with ``num_sms=...`` (or ``from_tvm_device``) for any other product.
_ARCH_PRESETS: dict[str, dict[str, int]] = {
    # V100 SXM2: 80 SMs, 96 KiB shared per SM.
    "sm_70": dict(num_sms=80, max_threads_per_sm=2048, max_blocks_per_sm=32, smem_per_sm=98304),
    # A100 SXM4: 108 SMs, 164 KiB shared per SM.
    "sm_80": dict(num_sms=108, max_threads_per_sm=2048, max_blocks_per_sm=32, smem_per_sm=167936),
    # A40 (84 SMs; the RTX 3090 has 82, the A10 72): 1536 threads, 16 blocks, 100 KiB shared per SM.
    "sm_86": dict(num_sms=84, max_threads_per_sm=1536, max_blocks_per_sm=16, smem_per_sm=102400),
    # RTX 4090 (128 SMs; the L40 has 142): 1536 threads, 24 blocks, 100 KiB shared per SM.
    "sm_89": dict(num_sms=128, max_threads_per_sm=1536, max_blocks_per_sm=24, smem_per_sm=102400),
    # H100 SXM5: 132 SMs, 228 KiB shared per SM.
    "sm_90": dict(num_sms=132, max_threads_per_sm=2048, max_blocks_per_sm=32, smem_per_sm=233472),
    # B200: 148 SMs, 228 KiB shared per SM.
    "sm_100": dict(num_sms=148, max_threads_per_sm=2048, max_blocks_per_sm=32, smem_per_sm=233472),
    # AMD CDNA (gfx90a MI210, gfx942 MI300X): a CU for an SM, a SIMD for a sub-partition, wave64
    **_AMD_PRESETS,
}


@dataclass(frozen=True)
class VDevice:
    """Per-SM limits of a GPU and the vEUs it offers (paper 3.2, 4.1.2). Defaults: H100 (sm_90).

    ``smem_per_block`` is the most shared memory one block may use (48 KiB static; kernels that opt in
    to dynamic shared memory may use more: raise it then). ``default_registers`` is assumed for an
    rKernel whose register count is unknown.
    """

    num_sms: int
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    smem_per_sm: int = 233472
    smem_per_block: int = 49152
    reg_alloc_unit: int = 256
    warp_size: int = 32
    max_threads_per_block: int = 1024
    reg_sub_partitions: int = 4
    smem_alloc_unit: int = 128
    smem_reserved_per_block: int = 1024
    default_registers: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"VDevice.{f.name} must be an int, got {value!r}")
            minimum = 0 if f.name == "smem_reserved_per_block" else 1
            if value < minimum:
                raise ValueError(f"VDevice.{f.name} must be >= {minimum}, got {value}")

    @classmethod
    def for_arch(cls, arch: str, **overrides: int) -> "VDevice":
        """The preset of an architecture: "sm_70", "sm_80", "sm_86", "sm_89", "sm_90"/"sm_90a", "sm_100"/"sm_100a",
        "gfx90a", "gfx942"."""
        key = arch.rstrip("af") if isinstance(arch, str) and arch.startswith("sm_") else arch
        if key not in _ARCH_PRESETS:
            raise ValueError(
                f"no VDevice preset for arch {arch!r}; use one of {sorted(_ARCH_PRESETS)} or build "
                "VDevice(num_sms=..., ...) with the GPU's limits"
            )
        return cls(**{**_ARCH_PRESETS[key], **overrides})

    @classmethod
    def from_tvm_device(cls, dev: object) -> "VDevice":
        """A VDevice for a live ``tvm.runtime.Device``: the preset of its compute capability, with the SM
        count and the per-block shared memory read from the device when it reports them."""
        version = getattr(dev, "compute_version", None)
        arch = "sm_" + str(version).replace(".", "") if version else "sm_90"
        overrides: dict[str, int] = {}
        sms = getattr(dev, "multi_processor_count", None)
        if isinstance(sms, int) and sms > 0:
            overrides["num_sms"] = sms
        smem = getattr(dev, "max_shared_memory_per_block", None)
        if isinstance(smem, int) and smem > 0:
            overrides["smem_per_block"] = smem
        if arch not in _ARCH_PRESETS:
            if "num_sms" not in overrides:
                raise ValueError(
                    f"device {dev!r} has compute capability {version!r} with no VDevice preset and reports no "
                    "multi_processor_count; build VDevice(num_sms=..., ...) by hand"
                )
            return cls(**overrides)
        return cls.for_arch(arch, **overrides)

    def occupancy(self, threads: int, registers: int | None, shared_bytes: int) -> int:
        """Blocks of ``threads`` threads, ``registers`` per thread and ``shared_bytes`` of shared memory
        one SM holds at once (see the module docstring). Raises ValueError naming the resource when
        not even one block fits."""
        regs = self.default_registers if registers is None else registers
        if threads < 1 or threads > self.max_threads_per_block:
            raise ValueError(
                f"threads={threads} per block is outside 1..{self.max_threads_per_block}; use an rKernel with "
                "smaller thread blocks"
            )
        if regs < 1 or regs > self.max_regs_per_thread:
            raise ValueError(
                f"registers={regs} per thread is outside 1..{self.max_regs_per_thread}; compile the rKernel with "
                "fewer registers (maxrregcount)"
            )
        if shared_bytes < 0 or shared_bytes > self.smem_per_block:
            raise ValueError(
                f"shared_bytes={shared_bytes} exceeds the {self.smem_per_block} bytes a block may use; use an "
                "rKernel with smaller tiles or raise VDevice.smem_per_block for opt-in dynamic shared memory"
            )
        warps = -(-threads // self.warp_size)
        by_warps = (self.max_threads_per_sm // self.warp_size) // warps
        regs_per_warp = _round_up(regs * self.warp_size, self.reg_alloc_unit)
        if regs_per_warp * _round_up(warps, self.reg_sub_partitions) > self.regs_per_sm:
            raise ValueError(
                f"registers: a block of {threads} threads x {regs} registers needs more than the "
                f"{self.regs_per_sm} registers of an SM; use fewer threads or fewer registers per thread"
            )
        per_partition = self.regs_per_sm // self.reg_sub_partitions
        by_regs = (per_partition // regs_per_warp) * self.reg_sub_partitions // warps
        smem = _round_up(shared_bytes, self.smem_alloc_unit) + self.smem_reserved_per_block
        by_smem = self.smem_per_sm // smem if smem else self.max_blocks_per_sm  # nothing reserved (AMD)
        blocks = min(self.max_blocks_per_sm, by_warps, by_regs, by_smem)
        if blocks < 1:
            limiting = "threads" if by_warps < 1 else "registers" if by_regs < 1 else "shared memory"
            raise ValueError(
                f"{limiting}: no block of {threads} threads, {regs} registers, {shared_bytes} shared bytes fits "
                "on one SM; use a smaller rKernel"
            )
        return blocks

    def veu_shape(self, kernels: Iterable[RKernel], registers: int | None = None) -> tuple[int, int, int]:
        """``(threads, registers, shared_bytes)`` of a vEU running every rKernel of ``kernels``: the most
        demanding value of each (paper 4.1.2). ``registers`` overrides the register count (for example
        the one ptxas reported for the persistent kernel); unknown counts count as ``default_registers``."""
        kernels = list(kernels)
        if not kernels:
            raise ValueError("a vEU needs at least one rKernel to size it; got an empty list")
        threads = max(k.threads for k in kernels)
        smem = max(k.shared_bytes for k in kernels)
        if registers is None:
            registers = max(self.default_registers if k.registers is None else k.registers for k in kernels)
        return threads, registers, smem

    def veus_per_sm(self, kernels: Iterable[RKernel], registers: int | None = None) -> int:
        """vEUs one SM holds when the vEU is sized for the most demanding rTask of ``kernels`` (paper 4.1.2)."""
        return self.occupancy(*self.veu_shape(kernels, registers))

    def num_veus(self, kernels: Iterable[RKernel], registers: int | None = None) -> int:
        """vEUs of the whole device: ``num_sms * veus_per_sm`` (all co-resident, as a persistent kernel needs)."""
        return self.num_sms * self.veus_per_sm(kernels, registers)

    def fits(self, kernels: Iterable[RKernel], registers: int | None = None) -> bool:
        """Whether one vEU sized for ``kernels`` fits on an SM."""
        try:
            self.veus_per_sm(kernels, registers)
        except ValueError:
            return False
        return True

