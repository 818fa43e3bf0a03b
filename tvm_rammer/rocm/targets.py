"""AMD rammer targets: TVM ``rocm`` targets for CDNA GPUs, and their vDevice limits.

``rammer/amd-mi210`` (gfx90a, 104 CUs) and ``rammer/amd-mi300x`` (gfx942, 304 CUs) are registered
with the NVIDIA tags (``tvm_rammer.target``); any ``{"kind": "rocm", "mcpu": "gfx..."}`` becomes a
rammer target the same way. The tags allow 1024 threads per workgroup (TVM's ``rocm`` default is
256 because, without a device, its codegen marks every kernel for at most 256 threads; our build,
``tvm_rammer.rocm.build``, gives each kernel its real size) and wave64 (CDNA).

:data:`VDEVICE_PRESETS` are per-CU limits in ``tvm_rammer.abstractions.vdevice.VDevice``'s terms, with a CU for
an SM and a SIMD for a register sub-partition (AMD CDNA3 ISA and CDNA2/3 white papers; LLVM's
AMDGPU occupancy rules, ``AMDGPUBaseInfo.cpp``):

- 4 SIMDs per CU, at most 8 waves of 64 lanes per SIMD: 2048 threads per CU;
- VGPRs: 512 per lane per SIMD (gfx90a/gfx942 unified VGPR+AGPR file), allocated per wave in
  granules of 8 registers (8 x 64 lanes = 512), so ``regs_per_sm = 4 x 512 x 64``;
- LDS: 64 KiB per CU, all of it available to one workgroup, allocated in 512-byte granules;
- workgroups per CU: at most 16 when a workgroup has more than one wave (barrier resources);
- SGPRs (800 per SIMD, 102 per wave at most) are not a VDevice field: the vEUs per CU read from a
  compiled code object (``tvm_rammer.rocm.occupancy``) count them.
"""

from __future__ import annotations

AMD_TAGS = {
    "rammer/amd-mi210": {"kind": "rocm", "mcpu": "gfx90a", "max_num_threads": 1024,
                         "max_threads_per_block": 1024, "max_shared_memory_per_block": 65536,
                         "thread_warp_size": 64},
    "rammer/amd-mi300x": {"kind": "rocm", "mcpu": "gfx942", "max_num_threads": 1024,
                          "max_threads_per_block": 1024, "max_shared_memory_per_block": 65536,
                          "thread_warp_size": 64},
}

_CDNA = dict(max_threads_per_sm=2048, max_blocks_per_sm=16, regs_per_sm=4 * 512 * 64,
             max_regs_per_thread=512, smem_per_sm=65536, smem_per_block=65536,
             reg_alloc_unit=8 * 64, warp_size=64, max_threads_per_block=1024,
             reg_sub_partitions=4, smem_alloc_unit=512, smem_reserved_per_block=0)
VDEVICE_PRESETS = {
    "gfx90a": dict(num_sms=104, **_CDNA),   # MI210 (the MI250X has 2 x 110)
    "gfx942": dict(num_sms=304, **_CDNA),   # MI300X
}


def rocm_arch(target) -> str:
    """The ``mcpu`` of a rocm target ("gfx942"); ValueError when it names none (TVM would then
    compile for gfx900, older than any CDNA GPU)."""
    mcpu = target.attrs.get("mcpu", None)
    if not mcpu or not str(mcpu).startswith("gfx"):
        raise ValueError(f"target {target} names no AMD GPU; add one, e.g. "
                         "{'kind': 'rocm', 'mcpu': 'gfx942'}, or use 'rammer/amd-mi300x'")
    return str(mcpu)
