"""GEMV rKernels for a decode step's MatMuls at bandwidth (issue 34): ``[1, K] x [K, N]``.

A decode step's MatMuls read their weights once and do two FLOPs per weight: they are bound by
how fast the weights stream in. These versions make every weight load a 16-byte vector load (four
float32 or eight float16: ``float4`` / ``half2 x 4``), keep the whole row of ``x`` in the loop, and
give the policy rTask shapes for narrow and wide outputs:

- each thread owns ``vec`` adjacent output columns (``vec * itemsize = 16`` bytes of a weight row,
  loaded as one vector); ``threads_n`` column lanes side by side on ``threadIdx.x`` cover
  ``vec * threads_n`` columns, the rTask's width, so a warp's loads are whole rows' segments;
- ``split_k`` rows are in flight on ``threadIdx.y`` (each thread reads every ``split_k``-th row
  of the weight), partial sums in registers, added across ``threadIdx.y`` at the end (TVM's
  all-reduce: shuffles and a little shared memory), in the operator's own accumulation dtype
  (float32 for float16 weights where the operator accumulates in float32);
- :data:`GEMV_SHAPES`: (threads_n, split_k) from narrow rTasks (one or two 16-byte columns of
  lanes, 128 threads: the most rTasks where N is small against the vEUs; a warp then reads 16
  or 32 bytes of each of 32 or 16 rows, the neighbouring rTask the rest of each sector) to wide
  ones (``32 * vec`` columns, a warp reading 512 contiguous bytes of one row: fewer rTasks and
  dispatches where N is large).

The schedule follows :func:`gemm_templates.schedule_gemm_small_batch` (the operator re-indexed by
``gemm_form``, rfactor over the rows in flight, the column loop vectorised, the epilogue inlined
into the store) with the lanes the other way round: there neighbouring lanes split K (a warp
reads 16 bytes of each of 32 rows), here they hold neighbouring columns. Applied only where a
vector load is one: a single row (``M = 1``, one batch), the weight's columns contiguous
(``b_inner == "J"``: ``W[K, N]`` as ``torch.onnx.export`` writes a Conv1D / ``x @ W``), and N a
multiple of ``vec`` (not GPT-2's LM head: 50257 columns).
Split-K over several rTasks (a second operator summing the partial rows) is not here: an
operator's rTasks are independent in this framework, so that needs a graph rewrite.

Works on the unscheduled PrimFunc; returns None / [] for an operator it does not handle.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx

from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain, auto_inline_producers

from .gemm_templates import MAX_THREADS, gemm_form
from .templates import Template

__all__ = ["GEMV_SHAPES", "VECTOR_BYTES", "gemv_vec", "schedule_gemv", "gemv_schedules"]

VECTOR_BYTES = 16  # one float4 / half2 x 4 load per thread and weight row
GEMV_SHAPES = ((1, 128), (2, 64), (8, 32), (32, 8))  # (column lanes, rows in flight)


def gemv_vec(func: tirx.PrimFunc, form=None) -> int | None:
    """Columns per thread that make one weight row's load 16 bytes (4 float32, 8 float16), or
    None when ``func`` is not a GEMV these versions handle (module docstring)."""
    form = form if form is not None else gemm_form(func)
    if form is None or form.m != 1 or form.batch != 1 or form.b_inner != "J":
        return None
    itemsize = np.dtype(form.in_dtype).itemsize if form.in_dtype != "bool" else 0
    if itemsize not in (2, 4):
        return None
    vec = VECTOR_BYTES // itemsize
    return vec if form.n % vec == 0 and form.k >= 2 else None


def _coalesced(form, vec: int, threads_n: int, split_k: int):
    """The schedule: ``threads_n`` column lanes on ``threadIdx.x`` (a warp's lanes read
    ``threads_n * 16`` contiguous bytes of each of ``32 / threads_n`` rows), ``split_k`` rows in
    flight on ``threadIdx.y``, partial sums in registers (``vec`` of them), then one cross-thread
    sum over ``threadIdx.y`` per column (TVM's all-reduce: warp shuffles and shared memory)."""
    sch, main = form.sch, form.main
    s, i, j, k = sch.get_loops(main)
    bj, tj, jv = sch.split(j, [None, threads_n, vec])
    ko, tk = sch.split(k, [None, split_k])
    sch.reorder(s, bj, tj, tk, ko, i, jv)  # nesting; which lanes are adjacent: the bindings
    partial = sch.rfactor(tk, 0)
    s, bj, tj, tk, ko, i, jv = sch.get_loops(partial)
    sch.bind(sch.fuse(s, bj), "blockIdx.x")
    sch.bind(tk, "threadIdx.y")
    sch.bind(tj, "threadIdx.x")
    sch.set_scope(partial, 0, "local")
    sch.annotate(ko, "pragma_auto_unroll_max_step", 64)
    sch.annotate(ko, "pragma_unroll_explicit", 1)
    sch.vectorize(jv)  # the weight's 16-byte load
    auto_inline_producers(sch, partial)
    sch.reverse_compute_at(main, tj, preserve_unit_loops=True)
    sch.set_scope(main, 0, "local")
    red, *rest = sch.get_loops(main)[2:]  # (block, column lanes, split of k, s, i, vec)
    sch.reorder(*rest, red)
    sch.bind(red, "threadIdx.y")
    init = sch.decompose_reduction(partial, ko)
    # the init's copy of the column loop unrolled, not a vector: TVM's CUDA codegen writes a
    # float32x8 constant as ``make_ulonglong4`` of 8 values, which does not compile
    sch.unroll(sch.get_loops(init)[-1])
    consumers = sch.get_consumers(main)
    if len(consumers) != 1:
        return None
    auto_inline_consumer_chain(sch, consumers[0])
    (out,) = sch.get_consumers(main)
    sch.reverse_compute_at(out, tj, preserve_unit_loops=True)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_gemv(func: tirx.PrimFunc, vec: int, threads_n: int, split_k: int,
                  form=None) -> tirx.PrimFunc | None:
    """The GEMV version ``gemv_v{vec}_n{threads_n}_k{split_k}`` of ``func`` (its unscheduled
    PrimFunc), or None when it does not apply (``vec`` must be the 16-byte vector of its dtype,
    ``threads_n * split_k`` a whole number of warps within :data:`MAX_THREADS`)."""
    form = form if form is not None else gemm_form(func)
    if gemv_vec(func, form) != vec or 32 % threads_n or (threads_n * split_k) % 32 \
            or not 32 <= threads_n * split_k <= MAX_THREADS or form.k < 2 * split_k:
        return None
    try:
        return _coalesced(gemm_form(func, base=form), vec, threads_n, split_k)
    except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
        return None


def gemv_schedules(func: tirx.PrimFunc, target=None) -> list[Template]:
    """The GEMV versions of ``func`` (:data:`GEMV_SHAPES`, narrow first), [] when it is not one;
    a shape wider than half of N's vectors is left out (most of its threads would idle)."""
    del target  # the same versions for every CUDA target
    form = gemm_form(func)
    vec = gemv_vec(func, form)
    if vec is None:
        return []
    found = []
    for threads_n, split_k in GEMV_SHAPES:
        if form.n < vec * threads_n // 2:
            continue
        scheduled = schedule_gemv(func, vec, threads_n, split_k, form=form)
        if scheduled is not None:
            found.append(Template(f"gemv_v{vec}_n{threads_n}_k{split_k}", scheduled))
    return found
