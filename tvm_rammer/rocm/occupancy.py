"""vEUs per CU from a compiled code object's metadata (AMD's occupancy rules, CDNA).

A persistent kernel relies on every vEU being resident at once; on CUDA the cooperative launch
refuses a grid that cannot be, on ROCm nothing does (TVM's ROCm runtime has no cooperative
launch), so the vEU count must not exceed what the compiled kernel allows. Paper 4.1.2 takes "the
maximum active PTB number provided by the CUDA compiler"; here it is computed from the figures the
AMDGPU backend wrote into the code object (``codeobject.KernelMetadata``), with the CU limits of
``rocm.targets.VDEVICE_PRESETS`` (``VDevice.occupancy`` with a CU for an SM):

- waves: ``ceil(threads / 64)`` per vEU, at most 8 per SIMD, 4 SIMDs;
- VGPRs: ``vgpr_count`` (on gfx90a/gfx942 the metadata's total of the unified VGPR+AGPR file;
  ``agpr_count`` is the AGPR part of it) rounded up to 8 per lane, 512 per lane per SIMD;
- SGPRs: 800 per SIMD, ``sgpr_count`` rounded up to 16 per wave;
- LDS: ``group_segment_fixed_size`` (and any dynamic LDS) rounded up to 512 bytes, 64 KiB per CU;
- at most 16 multi-wave workgroups per CU.
"""

from __future__ import annotations

from ..abstractions.vdevice import VDevice
from .codeobject import KernelMetadata

SGPRS_PER_SIMD = 800
SGPR_GRANULE = 16
SIMDS_PER_CU = 4
MAX_WAVES_PER_SIMD = 8


def veus_per_cu(meta: KernelMetadata, threads: int, arch: str, dynamic_lds: int = 0) -> int:
    """vEUs of ``threads`` threads that one CU holds at once when they run the kernel ``meta``
    describes. Raises ValueError when the code object does not allow ``threads`` per workgroup,
    or not even one vEU fits (the resource named)."""
    if meta.max_flat_workgroup_size < threads:
        raise ValueError(f"{meta.name}: the code object allows {meta.max_flat_workgroup_size} "
                         f"threads per workgroup, the vEU has {threads}")
    vdevice = VDevice.for_arch(arch)
    registers = -(-meta.vgprs // 8) * 8
    by_vgprs = vdevice.occupancy(threads, registers, meta.lds_bytes + dynamic_lds)
    waves = -(-threads // meta.wavefront_size)
    per_simd = min(MAX_WAVES_PER_SIMD, SGPRS_PER_SIMD // (-(-meta.sgprs // SGPR_GRANULE) * SGPR_GRANULE))
    by_sgprs = per_simd * SIMDS_PER_CU // waves
    if by_sgprs < 1:
        raise ValueError(f"{meta.name}: {meta.sgprs} SGPRs per wave leave no room for a vEU of "
                         f"{waves} waves on a CU")
    return min(by_vgprs, by_sgprs)
