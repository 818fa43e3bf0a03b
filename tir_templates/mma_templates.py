"""Tensor-core rKernels for float16 GEMMs: conv2d (implicit GEMM, grouped too) and matmul/dense.

A float16 operator with float32 accumulation (what Relax ``ToMixedPrecision`` makes of conv2d and
matmul: ``C += f32(A) * f32(B)``) is re-indexed into ``C[S, I, J] += A[S, I, K] * B[S, J, K]``
(``gemm_templates.gemm_form``, padded to whole tiles) and computed with TVM's MMA intrinsics
(``tvm.s_tir.tensor_intrin.cuda``): ``ldmatrix`` loads 16x16 fragments from shared memory into
registers, ``mma.sync.m16n8k16`` (``MMA_f16f16f32_TRANS_B``) multiplies them on the tensor cores,
``mma_fill`` zeroes the accumulators and the accumulator tiles leave through shared memory, where the
elementwise epilogue (bias, activation, cast to float16) is fused into a coalesced store.

:func:`schedule_gemm_mma` gives one rTask a ``warps_m * warp_m x warps_n * warp_n`` output tile (in
16x16 fragments per warp), ``tile_k`` of the reduction at a time through double-buffered shared
memory; ``warps_m * warps_n`` warps per rTask (threadIdx.x = the lane, threadIdx.y = the warp, which
``tir_templates.prelower`` lowers with TVM's ``LowerWarpMemory``). Shared buffers are "shared.dyn"
like dlight's tensor-core rule, so a tile may use more than 48 KB (the persistent kernel's pool
becomes dynamic shared memory then).

MMA ``m16n8k16`` needs sm_80 or newer; :func:`mma_schedules` lists the variants that apply to a
float16 operator on such a target. Nothing here raises for an operator it does not handle.

``tvm.s_tir.tensor_intrin.cuda`` is imported only when a float16 GEMM is scheduled: importing it
registers every CUDA tensor intrinsic (~12 s of TVMScript parsing with
``intrin_import.know_frozen_import_frames``, ~36 s without), which float32 models never need (dlight's
tensor-core rule imports it the same way).
"""
from __future__ import annotations

from tvm import tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain, auto_inline_producers

from .gemm_templates import MAX_THREADS, gemm_form
from .intrin_import import know_frozen_import_frames

__all__ = ["MMA_CONFIGS", "shared_bytes", "supports_mma", "schedule_gemm_mma", "mma_schedules"]

FRAGMENT = 16  # ldmatrix / mma fragments are 16x16 (two m16n8k16 per 16x16x16 step)
WARP = 32
SCOPE = "shared.dyn"
STATIC_SHARED = 48 * 1024
# (warps_m, warps_n, fragments per warp along m, along n, tile_k); the last three need more than the
# 48 KB of static shared memory (dynamic shared memory in the vEU's pool)
# (1, 2, 1, 2, 64) and (1, 1, 1, 1, 64) have one fragment of rows: dense at batch 1 to 16
MMA_CONFIGS = ((2, 2, 2, 2, 32), (1, 2, 2, 2, 32), (2, 1, 2, 2, 32), (4, 1, 1, 2, 32), (2, 2, 1, 2, 32),
               (4, 2, 1, 1, 32), (1, 1, 2, 2, 64), (1, 2, 1, 2, 64), (1, 1, 1, 1, 64),
               (2, 2, 4, 2, 32), (2, 2, 2, 4, 32), (2, 2, 4, 4, 32))


def shared_bytes(warps_m, warps_n, frags_m, frags_n, tile_k) -> int:
    """Shared memory of a config: two stages of the A and B tiles (rows padded by 8 halves) and each
    warp's float32 accumulator tile."""
    tile_m, tile_n = warps_m * frags_m * FRAGMENT, warps_n * frags_n * FRAGMENT
    return 2 * (tile_m + tile_n) * (tile_k + 8) * 2 + tile_m * tile_n * 4


def supports_mma(target) -> bool:
    """Whether ``target`` is a CUDA target of compute capability 8.0 or newer (mma.m16n8k16)."""
    if target is None or target.kind.name != "cuda":
        return False
    arch = str(target.attrs.get("arch", ""))
    digits = "".join(ch for ch in arch.replace("sm_", "") if ch.isdigit())
    return bool(digits) and int(digits) >= 80


def _intrinsics():
    know_frozen_import_frames()
    from tvm.s_tir.tensor_intrin import cuda  # pylint: disable=import-outside-toplevel  (see module doc)

    return cuda


def _ldmatrix_layout(b, i, j):
    """(batch, row, col) of a fragment buffer -> (batch, fragment row, fragment col, lane, register):
    where ldmatrix and mma keep a 16x16 tile in a warp's registers."""
    lane, reg = _intrinsics().shared_16x16_to_ldmatrix_32x8_layout(i % FRAGMENT, j % FRAGMENT)
    return b, i // FRAGMENT, j // FRAGMENT, lane, reg


def _accumulates_f16_in_f32(block) -> bool:
    """``C(f32) += f32(a_f16) * f32(b_f16)``: the MMA_f16f16f32 computation."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "float32":
        return False
    return all(str(r.source.dtype) == "float16" for r in block.reads[:2])


def schedule_gemm_mma(func: tirx.PrimFunc, warps_m: int, warps_n: int, frags_m: int, frags_n: int,
                      tile_k: int, form=None) -> tirx.PrimFunc | None:
    """Tensor-core GEMM (see the module docstring); None when it does not apply. ``form``: the
    unpadded ``gemm_form(func)`` when the caller has it (padded on a copy)."""
    threads = warps_m * warps_n * WARP
    if threads > MAX_THREADS or tile_k % FRAGMENT:
        return None
    tile_m, tile_n = warps_m * frags_m * FRAGMENT, warps_n * frags_n * FRAGMENT
    form = gemm_form(func, (tile_m, tile_n, tile_k), form)
    if form is None or form.in_dtype != "float16" or form.out_dtype != "float32":
        return None
    if form.m == 1:
        return None  # one row (batch-1 dense): a GEMV, the small-batch template's job
    if (2 * form.m < tile_m and tile_m > FRAGMENT) or 2 * form.n < tile_n or 2 * form.k < tile_k:
        return None  # mostly padding (one fragment of rows is the least a tensor core computes)
    try:
        if not _accumulates_f16_in_f32(form.sch.get(form.main)):
            return None
        return _mma(form, warps_m, warps_n, frags_m, frags_n, tile_k, threads)
    except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
        return None


def _mma(form, warps_m, warps_n, frags_m, frags_n, tile_k, threads):
    sch, block = form.sch, form.main
    s, i, j, k = sch.get_loops(block)
    i, i_frag = sch.split(i, [None, FRAGMENT])
    j, j_frag = sch.split(j, [None, FRAGMENT])
    k, k_frag = sch.split(k, [None, FRAGMENT])
    sch.reorder(i, j, k, i_frag, j_frag, k_frag)
    inner = block
    outer = sch.blockize(i_frag)  # one 16x16x16 step: what the intrinsics compute

    i0, i1, i2 = sch.split(i, [None, warps_m, frags_m])
    j0, j1, j2 = sch.split(j, [None, warps_n, frags_n])
    k0, k1 = sch.split(k, [None, tile_k // FRAGMENT])
    sch.reorder(s, i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(sch.fuse(s, i0, j0), "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")

    tile_m, tile_n = warps_m * frags_m * FRAGMENT, warps_n * frags_n * FRAGMENT

    def to_shared(index, inner_first, padded_rows):
        copy = sch.cache_read(outer, index, SCOPE)
        sch.compute_at(copy, k0)
        loops = sch.get_loops(copy)
        row, col = loops[-2], loops[-1]
        if inner_first:  # source contiguous along the rows (conv pixels, [K, N] weights): coalesce
            sch.reorder(col, row)
            row, col = col, row
        fused = sch.fuse(row, col)
        # 8 halves (16 bytes) per thread and step when the source is contiguous along k (one source
        # axis: a conv's (C, KH, KW) does not simplify to a ramp) and no padding predicate cuts a
        # vector; otherwise TVM emits 8-lane int64 index vectors that CUDA has no type for
        vec = 8 if (not inner_first and not padded_rows and form.k % tile_k == 0
                    and form.k_dims == 1) else 1
        _, ty, tx, v = sch.split(fused, [None, warps_m * warps_n, WARP, vec])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        if vec > 1:
            sch.vectorize(v)
        sch.storage_align(copy, 0, axis=-2, factor=32, offset=8)  # ldmatrix rows hit distinct banks
        return copy

    a_copy = to_shared(0, form.a_inner == "I", form.m % tile_m != 0)
    b_copy = to_shared(1, form.b_inner == "J", form.n % tile_n != 0)
    auto_inline_producers(sch, a_copy)
    auto_inline_producers(sch, b_copy)

    a_frag = sch.cache_read(outer, 0, "warp")
    b_frag = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)
    c_shared = sch.cache_write(outer, 0, SCOPE)
    c_frag = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_frag, warp)
    sch.reverse_compute_at(c_shared, warp)

    def fragments(blk):
        r, c = sch.get_loops(blk)[-2:]
        r0, r1 = sch.split(r, [None, FRAGMENT])
        c0, c1 = sch.split(c, [None, FRAGMENT])
        sch.reorder(r0, c0, r1, c1)
        return r1

    a_loop, b_loop, c_loop = fragments(a_frag), fragments(b_frag), fragments(c_frag)
    init = sch.decompose_reduction(outer, k0)
    init_inner = sch.get_child_blocks(init)[0]
    sch.transform_layout(a_frag, ("write", 0), _ldmatrix_layout)
    sch.transform_layout(b_frag, ("write", 0), _ldmatrix_layout)
    sch.transform_layout(c_frag, ("read", 0), _ldmatrix_layout)
    group = _intrinsics().get_mma_intrin_group(load_scope=SCOPE, store_scope=SCOPE, in_dtype="float16",
                                        out_dtype="float32", trans_a=False, trans_b=True)
    sch.tensorize(a_loop, group["load_a"])
    sch.tensorize(b_loop, group["load_b"])
    sch.tensorize(sch.get_loops(inner)[-3], group["compute"])
    sch.tensorize(sch.get_loops(init_inner)[-2], group["init"])
    sch.tensorize(c_loop, group["store"])

    # the warp's accumulator tile leaves shared memory with the epilogue fused, coalesced
    auto_inline_consumer_chain(sch, c_shared)
    fused = sch.fuse(*sch.get_loops(c_shared)[-2:])
    _, tx = sch.split(fused, [None, WARP])
    sch.bind(tx, "threadIdx.x")
    # two shared stages: the next k tile is loaded while the tensor cores work on this one
    sch.annotate(k0, "software_pipeline_stage", [0, 0, 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def mma_schedules(func: tirx.PrimFunc, target, max_shared_bytes: int | None = None,
                  form=None) -> list:
    """(name, scheduled PrimFunc) of every tensor-core variant that applies to ``func`` on ``target``
    (none for targets older than sm_80 or operators that are not float16 GEMMs), within
    ``max_shared_bytes`` of shared memory per rTask (default: the target's
    ``max_shared_memory_per_block``, else 48 KB). ``form``: ``gemm_form(func)`` when the caller
    has it."""
    if not supports_mma(target):
        return []
    form = form or gemm_form(func)  # once: most operators are not float16 GEMMs
    if form is None or form.in_dtype != "float16" or form.out_dtype != "float32":
        return []
    if max_shared_bytes is None:
        max_shared_bytes = int(target.attrs.get("max_shared_memory_per_block", STATIC_SHARED))
    found = []
    for config in MMA_CONFIGS:
        if shared_bytes(*config) > max_shared_bytes:
            continue
        scheduled = schedule_gemm_mma(func, *config, form=form)
        if scheduled is not None:
            found.append(("mma_w{}x{}_f{}x{}_k{}".format(*config), scheduled))
    return found
