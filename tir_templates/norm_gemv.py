"""The rKernel of a row norm fused into the GEMV that reads it (``NormGEMV``).

``relay_passes.norm_gemv.NormGEMVFusion`` makes one Primitive function of a decode step's row
norm (LayerNorm, with the cast ToMixedPrecision leaves after it) and a GEMV reading its output
(``[1, K] x [K, N]``, a weight, and the bias add / casts FuseOps put after it); FuseTIR makes it
one PrimFunc, whose matmul block carries the annotation ``rammer.norm_gemv``. dlight would make
several kernels of it (the norm's result through global memory). This rule makes one, in which
every thread block (rTask) computes the norm itself:

1. the blocks between the input row and the matmul's row are inlined into their readers (an
   upcast of the input row into the sums and the normalisation, so every rTask reads the float16
   row and casts as it reads; the mean into the variance sum and the normalisation, the
   normalisation into the cast), so what is
   left is the norm's sums (reductions over K), the block writing the matmul's row, the matmul
   and its epilogue;
2. the matmul is scheduled as ``tir_templates.gemv_templates`` does: ``vec`` adjacent columns per
   thread (one 16-byte weight load where N allows), ``threads_n`` column lanes on
   ``threadIdx.x``, ``split_k`` rows in flight on ``threadIdx.y``, partial sums in registers,
   one cross-thread sum per column, the epilogue inlined into the store;
3. under each thread block (``blockIdx.x``, ``vec * threads_n`` columns) the norm's sums are
   computed by all of its threads (a serial stride over K, then TVM's all-reduce across
   ``threadIdx.x`` and ``threadIdx.y``) into shared memory, and the normalised row (K values)
   into shared memory, before the GEMV reads it.

So the norm costs every rTask a re-read of its input row (K values, from L2) and two block-wide
sums; the norm's own operator, its rTask and the barrier before the GEMV are gone.

Applies only to PrimFuncs holding a block annotated ``rammer.norm_gemv``; returns None where the
function does not have that shape (the pass fuses only what it recognises).
"""
from __future__ import annotations

import numpy as np
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain

from .annotated_rule import AnnotatedRule

__all__ = ["NormGEMV", "NORM_GEMV_ANNOTATION", "norm_gemv_shape", "schedule_norm_gemv"]

NORM_GEMV_ANNOTATION = "rammer.norm_gemv"  # set by relay_passes.norm_gemv (a higher stage)
VECTOR_BYTES = 16
# In an rProgram a weight's offset is a run-time value (the rTask's arguments), so TVM's CUDA
# codegen cannot prove a vector load aligned and gathers it lane by lane: for float16 wider than
# 2 lanes it writes make_uint4 / make_uint2 of 8 / 4 halves, which does not compile. float32's
# make_float4 of 4 floats does.
HALF_VEC = 2
MIN_RTASKS = 512  # the widest rTask that still leaves this many (an H100's 132 SMs x 4 vEUs of 256
# threads: the cost model gives each rTask its vEU's share of bandwidth, so fewer leave it idle)


def _annotated(sch):
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if NORM_GEMV_ANNOTATION in sch.get(block).annotations:
            return block
    return None


def _is_reduction(sch, block) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(block).iter_vars)


def norm_gemv_shape(n: int, k: int, itemsize: int, max_threads: int = 256) -> tuple | None:
    """``(vec, threads_n, split_k)`` for a GEMV of N columns and K rows: ``vec`` columns per
    thread (a 16-byte weight load where N is a multiple of it, else the largest power of two
    dividing N below it), the widest ``threads_n`` in (1, 2, 8, 32) that leaves at least
    :data:`MIN_RTASKS` rTasks (else 1), ``split_k`` the rest of ``min(256, max_threads)``
    threads (dlight's GEMV width), halved until it divides K (no predicate on the weight's
    vector loads). None when the threads would not be whole warps."""
    vec = max(1, VECTOR_BYTES // max(itemsize, 1))
    if itemsize < 4:  # see HALF_VEC
        vec = min(vec, HALF_VEC)
    while vec > 1 and n % vec:
        vec //= 2
    threads = min(256, max_threads)
    threads_n = 1
    for lanes in (2, 8, 32):
        if -(-n // (vec * lanes)) >= MIN_RTASKS:
            threads_n = lanes
    split_k = threads // threads_n
    while split_k > 1 and k % split_k:
        split_k //= 2
    if (threads_n * split_k) % 32:
        return None
    return vec, threads_n, split_k


class NormGEMV(AnnotatedRule):
    """A dlight-style rule (``apply(func, target, tunable)``) for a norm fused into a GEMV; see
    the module docstring. Returns None for any other function (``annotated_rule.AnnotatedRule``)."""

    annotation = NORM_GEMV_ANNOTATION
    schedule_name = "norm_gemv"  # default_schedule.SCHEDULED_BY_ATTR of what it schedules

    def schedule(self, func, max_threads):
        return schedule_norm_gemv(func, max_threads)


def _inline_between(sch, matmul):
    """Inline every spatial block before the matmul except the one writing its row (the mean,
    the normalisation before a cast), and return that block."""
    root = sch.get_sblock("root")
    row_buf = sch.get(matmul).reads[0].source
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    progress = True
    while progress:
        progress = False
        for block in sch.get_child_blocks(root):
            stmt = sch.get(block)
            if stmt.same_as(sch.get(matmul)):
                break
            if _is_reduction(sch, block) or stmt.name_hint in outputs \
                    or stmt.writes[0].source.same_as(row_buf):
                continue
            sch.compute_inline(block)
            progress = True
            break
    (row,) = [b for b in sch.get_child_blocks(root)
              if sch.get(b).writes and sch.get(b).writes[0].source.same_as(row_buf)]
    return row


def _thread_loops(sch, loop, split_k, threads_n):
    """Split ``loop`` into (serial, threadIdx.y, threadIdx.x) of extents (rest, split_k,
    threads_n) and bind the inner two."""
    _, ty, tx = sch.split(loop, [None, split_k, threads_n])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def schedule_norm_gemv(func: tirx.PrimFunc, max_threads: int = 256, shape=None):
    """The schedule of the module docstring (an ``s_tir.Schedule``); ``shape``: ``(vec,
    threads_n, split_k)``, else :func:`norm_gemv_shape`'s. Raises where a primitive fails."""
    sch = s_tir.Schedule(func)
    matmul = _annotated(sch)
    sch.unannotate(matmul, NORM_GEMV_ANNOTATION)
    row = _inline_between(sch, matmul)
    root = sch.get_sblock("root")
    blocks = list(sch.get_child_blocks(root))
    position = [sch.get(b).same_as(sch.get(matmul)) for b in blocks].index(True)
    before = blocks[:position]
    sums = [b for b in before if _is_reduction(sch, b)]
    if len(before) != len(sums) + 1:
        raise ValueError("a block the norm GEMV rule does not place")
    *lead, j, k = sch.get_loops(matmul)
    n = int(sch.get(j).extent)
    weight = sch.get(matmul).reads[1].source
    itemsize = np.dtype(str(weight.dtype)).itemsize
    kk = int(sch.get(k).extent)
    shape = shape or norm_gemv_shape(n, kk, itemsize, max_threads)
    if shape is None:
        raise ValueError("no shape of whole warps for this GEMV")
    vec, threads_n, split_k = shape
    if n % vec:
        raise ValueError("N is not a multiple of the vector width")

    # the GEMV (gemv_templates._coalesced on the matmul's own loops)
    bj, tj, jv = sch.split(j, [None, threads_n, vec])
    ko, tk = sch.split(k, [None, split_k])
    sch.reorder(*lead, bj, tj, tk, ko, jv)
    partial = sch.rfactor(tk, 0)
    *plead, pbj, ptj, ptk, pko, pjv = sch.get_loops(partial)
    bx = sch.fuse(*plead, pbj)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ptk, "threadIdx.y")
    sch.bind(ptj, "threadIdx.x")
    sch.set_scope(partial, 0, "local")
    if vec > 1:
        sch.vectorize(pjv)
    sch.reverse_compute_at(matmul, ptj, preserve_unit_loops=True)
    if not any(sch.get(matmul).writes[0].source.same_as(p) for p in func.params):
        sch.set_scope(matmul, 0, "local")
    red, *rest = sch.get_loops(matmul)[2:]
    sch.reorder(*rest, red)
    sch.bind(red, "threadIdx.y")
    init = sch.decompose_reduction(partial, pko)
    if vec > 1:
        sch.unroll(sch.get_loops(init)[-1])
    consumers = sch.get_consumers(matmul)
    if len(consumers) > 1:
        raise ValueError("the GEMV's epilogue is not a chain")
    if consumers:  # the epilogue (bias add, casts) inlined into the last store
        auto_inline_consumer_chain(sch, consumers[0])
        (out,) = sch.get_consumers(matmul)
        sch.reverse_compute_at(out, ptj, preserve_unit_loops=True)

    # the norm, recomputed per thread block: its row into shared memory, its sums before it
    sch.compute_at(row, bx, preserve_unit_loops=True)
    sch.set_scope(row, 0, "shared")
    _thread_loops(sch, sch.fuse(*sch.get_loops(row)[1:]), split_k, threads_n)
    for block in reversed(sums):
        sch.compute_at(block, bx, preserve_unit_loops=True)
        sch.set_scope(block, 0, "shared")
        loops = sch.get_loops(block)[1:]
        _thread_loops(sch, loops[-1], split_k, threads_n)
    return sch

