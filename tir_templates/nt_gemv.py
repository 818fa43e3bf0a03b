"""The rKernel of a decode step's narrow GEMV over a transposed weight (``NTGEMV``).

``relay_passes.split_k_gemv.SplitKGEMV`` (``nt=True``, the pipeline's) turns a narrow GEMV
``y = x [1, K] @ W [K, N]`` into ``call_tir(nt_gemv, [x, Wt])`` with ``Wt = W^T [N, K]`` a
constant (or a lifted weight transform), whose PrimFunc is ``y[.., n] = sum_k x[.., k] * Wt[n, k]``
(accumulated in float32 for float16) with its reduction block annotated :data:`NT_GEMV_ANNOTATION`
= ``r``, the rows of Wt per rTask the pass chose (``N / r`` rTasks, as many as fit one round of
the vEUs). FuseOps joins its elementwise epilogue (bias, residual add, cast) and prologue (the
last multiply of a GELU) as for any GEMV; FuseTIR makes one PrimFunc of them. This rule
schedules it as one operator (where the split-K form was a partial GEMV and a sum, two dependent
steps):

- ``blockIdx.x``: the rTask, ``r`` rows of Wt (output columns);
- ``threadIdx.y``: the row, ``threadIdx.x``: ``threads / r`` lanes over K, each reading ``vec``
  contiguous elements of the row (so a warp reads ``32 * vec`` contiguous elements of Wt), then
  striding by ``threads / r * vec``; partial sums in registers (float32 for float16);
- one cross-thread sum over ``threadIdx.x`` per row (TVM's all-reduce: warp shuffles, shared
  memory between the warps of a row), the epilogue inlined into its store; the prologue (an
  elementwise function of x) inlined into the GEMV's read of x.

``vec``: 16 bytes of float32 (4), 2 of float16 (``norm_gemv.HALF_VEC``: in an rProgram TVM's
codegen cannot prove a wider float16 load aligned and writes a make_uint4 of halves that does
not compile), halved until the lanes tile K exactly. A lane's ``vec`` elements of Wt are read
by one vectorized copy into registers: a vector load in a standalone kernel; in an rProgram
(the weight's offset a run-time value) TVM's codegen gathers them element by element
(``make_float4`` / ``make_half2``), the same scalar loads, still contiguous across the warp.
Wt is the GEMV block's second read (x its first) before a prologue is inlined. Applies only to
PrimFuncs with a block annotated :data:`NT_GEMV_ANNOTATION`; returns None (the reason logged at
debug level) where a primitive fails, there is no layout or the epilogue is not a chain: dlight's
rules schedule the function then.
"""
from __future__ import annotations

import numpy as np
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain

from .annotated_rule import AnnotatedRule
from .norm_gemv import HALF_VEC, VECTOR_BYTES

__all__ = ["NTGEMV", "NT_GEMV_ANNOTATION", "nt_gemv_layout", "schedule_nt_gemv"]

NT_GEMV_ANNOTATION = "rammer.nt_gemv"  # its value: r, the rows of Wt per rTask
WARP = 32


def nt_gemv_layout(k: int, rows: int, itemsize: int, threads: int = 256) -> tuple | None:
    """``(lanes, vec)`` for ``rows`` rows of K elements per rTask of ``threads`` threads:
    ``lanes = threads / rows`` threads over K, each reading ``vec`` contiguous elements (module
    docstring), with ``lanes * vec`` dividing K. None when the lanes are not whole warps or do not
    tile K."""
    if rows < 1 or threads % rows or (threads // rows) % WARP:
        return None
    lanes = threads // rows
    vec = max(1, VECTOR_BYTES // max(itemsize, 1))
    if itemsize < 4:
        vec = min(vec, HALF_VEC)
    while vec > 1 and k % (lanes * vec):
        vec //= 2
    if k % (lanes * vec):
        return None
    return lanes, vec


def _annotated(sch):
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if NT_GEMV_ANNOTATION in sch.get(block).annotations:
            return block
    return None


class NTGEMV(AnnotatedRule):
    """A dlight-style rule (``apply(func, target, tunable)``) for the transposed-weight GEMV; see
    the module docstring. Its rTasks have the target's ``max_num_threads`` (the pipeline's rKernel
    target: ``max_rtask_threads``, the threads SplitKGEMV chose ``r`` for), 256 without a target.
    Returns None for any other function (``annotated_rule.AnnotatedRule``)."""

    annotation = NT_GEMV_ANNOTATION
    schedule_name = "nt_gemv"  # default_schedule.SCHEDULED_BY_ATTR of what it schedules

    def schedule(self, func, max_threads):
        return schedule_nt_gemv(func, max_threads)


def schedule_nt_gemv(func: tirx.PrimFunc, threads: int = 256):
    """The schedule of the module docstring (an ``s_tir.Schedule``). Raises where a primitive
    fails or the layout does not exist (:func:`nt_gemv_layout`)."""
    sch = s_tir.Schedule(func)
    gemv = _annotated(sch)
    rows = int(sch.get(gemv).annotations[NT_GEMV_ANNOTATION])
    sch.unannotate(gemv, NT_GEMV_ANNOTATION)
    weight = sch.get(gemv).reads[1].source  # Wt: read second (x first) until a prologue joins
    root = sch.get_sblock("root")
    progress = True
    while progress:  # the prologue (elementwise over x) into the GEMV's read
        progress = False
        for block in sch.get_child_blocks(root):
            if sch.get(block).same_as(sch.get(gemv)):
                break
            sch.compute_inline(block)
            progress = True
            break
    *lead, n, k = sch.get_loops(gemv)
    layout = nt_gemv_layout(int(sch.get(k).extent), rows,
                            np.dtype(str(weight.dtype)).itemsize, threads)
    if layout is None or int(sch.get(n).extent) % rows:
        raise ValueError("no layout of whole warps for this GEMV")
    lanes, vec = layout
    bx, ty = sch.split(n, [None, rows])
    ko, tx, kv = sch.split(k, [None, lanes, vec])
    sch.reorder(*lead, bx, ty, tx, ko, kv)
    partial = sch.rfactor(tx, 0)
    *plead, pbx, pty, ptx, pko, pkv = sch.get_loops(partial)
    bxf = sch.fuse(*plead, pbx)
    sch.bind(bxf, "blockIdx.x")
    sch.bind(pty, "threadIdx.y")
    sch.bind(ptx, "threadIdx.x")
    sch.set_scope(partial, 0, "local")
    reads = [r.source for r in sch.get(partial).reads]
    if vec > 1 and any(r.same_as(weight) for r in reads):  # a lane's vec elements: one load
        cached = sch.cache_read(partial, [r.same_as(weight) for r in reads].index(True),
                                "local")
        sch.compute_at(cached, pko, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(cached)[-1])
    sch.unroll(pkv)
    sch.reverse_compute_at(gemv, pty, preserve_unit_loops=True)
    if not any(sch.get(gemv).writes[0].source.same_as(p) for p in func.params):
        sch.set_scope(gemv, 0, "local")
    red, *rest = sch.get_loops(gemv)[2:]  # the lanes' sum innermost, on the lanes' threads
    sch.reorder(*rest, red)
    sch.bind(red, "threadIdx.x")
    sch.decompose_reduction(partial, pko)
    consumers = sch.get_consumers(gemv)
    if len(consumers) > 1:
        raise ValueError("the GEMV's epilogue is not a chain")
    if consumers:  # the epilogue (bias add, residual add, casts) inlined into the last store
        auto_inline_consumer_chain(sch, consumers[0])
        (out,) = sch.get_consumers(gemv)
        sch.reverse_compute_at(out, pty, preserve_unit_loops=True)
    return sch
