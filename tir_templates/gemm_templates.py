"""Tiled GEMM rKernels: conv2d as implicit GEMM (grouped included), matmul/dense, small-batch dense.

Every operator whose one reduction block computes ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` after
re-indexing is a GEMM here (:func:`gemm_form`):

- conv2d (NCHW, any stride/padding/dilation): ``I`` = the output pixels ``(n, oh, ow)``, ``J`` = the
  output channels, ``K`` = ``C_in * KH * KW``: the im2col matrix is never materialised, its tiles are
  gathered from the (padded) input straight into shared memory (implicit GEMM);
- grouped conv2d: the output-channel axis is first split into ``(group, channel in group)``
  (:func:`_split_groups`), the group becomes the batch axis ``S``;
- matmul / dense / batch matmul: ``I`` = rows, ``J`` = columns, ``K`` = the reduction.

The operator is re-indexed into that form the way TVM's dlight ``Matmul`` rule does (``reindex``,
``transform_layout``, ``transform_block_layout``, ``pad_einsum`` to whole tiles); producers (padding)
are inlined into the shared-memory loads, and the elementwise epilogue (bias, ReLU, residual add,
cast) into the register-to-global store.

Schedules (each a plain function of its tile parameters returning the scheduled PrimFunc or None):

- :func:`schedule_gemm_tiled`: ``tile_m x tile_n`` outputs per rTask, ``thread_m x thread_n`` per
  thread accumulated in registers (register blocking), the reduction tiled ``tile_k`` at a time through
  shared memory; the A tile is stored k-major so a thread's ``thread_m`` operands are one contiguous
  (conflict-free) row, and the shared tiles are double-buffered. The thread mapping is interleaved
  (thread ``t`` owns rows ``t, t + T, ...``), so neighbouring threads store neighbouring outputs.
- :func:`schedule_gemm_small_batch`: dense/matmul with at most 16 rows (batch 1 to 16): each thread
  keeps all rows of ``vec`` columns in registers, ``split_k`` threads share the reduction (partial
  sums reduced across threads at the end), so the weight matrix is streamed once by many threads.

Everything here works on the *unscheduled* PrimFunc (after LegalizeOps/FuseTIR, before dlight) and
never raises for an operator it does not handle: it returns None.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (IterKind, IterTrait, auto_inline_consumer_chain,
                                         auto_inline_producers, get_reduction_blocks,
                                         make_iter_fusion_index_map)

__all__ = ["GemmForm", "gemm_form", "schedule_gemm_tiled", "schedule_gemm_small_batch",
           "MAX_THREADS", "SMALL_BATCH_ROWS"]

MAX_THREADS = 256  # the default rTask cap (RammerConfig.max_rtask_threads)
SMALL_BATCH_ROWS = 16


@dataclass
class GemmForm:
    """An operator re-indexed to ``C[S, I, J] += A[S, I, K] * B[S, J, K]``.

    ``sch`` holds the re-indexed (and padded) function, ``main`` its GEMM block with loops
    ``(s, i, j, k)``; ``batch, m, n, k`` are the *unpadded* extents. ``a_inner`` / ``b_inner`` say which
    GEMM axis ("I"/"J" or "K") is contiguous in the source of A / B (it decides the order of the
    global loads), ``c_inner`` which of "I"/"J" is contiguous in the output (the order of the stores).
    """

    sch: s_tir.Schedule
    main: object
    batch: int
    m: int
    n: int
    k: int
    a_inner: str
    b_inner: str
    c_inner: str
    in_dtype: str
    out_dtype: str
    k_dims: int = 1  # source axes fused into K (conv: C, KH, KW)


def _int(expr) -> int | None:
    return int(expr) if isinstance(expr, tirx.IntImm) else None


def _is_multiply_add(block) -> bool:
    """Whether the block's update is ``C = C + x * y`` (possibly with casts on x and y)."""
    body = block.body
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tirx.Add):
        return False
    value = body.value

    def is_self(expr):
        return isinstance(expr, tvm.ir.TensorLoad) and expr.source.same_as(body.buffer)

    def strip(expr):
        return expr.value if isinstance(expr, tirx.Cast) else expr

    other = value.b if is_self(value.a) else value.a if is_self(value.b) else None
    return other is not None and isinstance(strip(other), tirx.Mul)


def _group_split(block):
    """(iter index, group size) when a read index divides a spatial iter var by a constant (grouped
    convolution: input channel = ``ff // (F / G) * (C / G) + rc``), else None."""
    spatial = {iv.var: n for n, iv in enumerate(block.iter_vars) if iv.iter_type == tirx.IterVar.DataPar}
    found = []

    def visit(expr):
        if isinstance(expr.a, tvm.ir.Var) and expr.a in spatial and isinstance(expr.b, tirx.IntImm):
            found.append((spatial[expr.a], int(expr.b)))

    for region in block.reads:
        for rng in region.region:
            tvm_ffi.structural_walk(rng.min, (tirx.FloorDiv, visit))
    if len({f for f in found}) != 1:
        return None
    index, size = found[0]
    extent = _int(block.iter_vars[index].dom.extent)
    if extent is None or size <= 1 or extent % size or extent == size:
        return None
    return index, size


def _split_groups(sch, main):
    """Grouped conv: split the output-channel iter into (group, channel in group) and simplify, so
    the group shows up as a batch axis. Returns the (possibly new) schedule and main block."""
    split = _group_split(sch.get(main))
    if split is None:
        return sch, main
    index, size = split
    extents = [_int(iv.dom.extent) for iv in sch.get(main).iter_vars]

    def index_map(*iters):  # unit iters dropped: StmtSimplify would bind them to constants
        out = []
        for n, var in enumerate(iters):
            if n == index:
                out.extend([var // size, var % size])
            elif extents[n] != 1:
                out.append(var)
        return out

    name = sch.get(main).name_hint
    sch.transform_block_layout(main, tirx.IndexMap.from_func(index_map, ndim=len(extents)))
    mod = s_tir.transform.StmtSimplify()(sch.mod)
    sch = s_tir.Schedule(mod)
    return sch, sch.get_sblock(name)


def _operand_vars(block):
    """``(a, b, c)``: the vars indexing each element access of a block that reads two buffers and
    writes one (A, B, C), or None for another arity or an access of more than one element."""
    if len(block.reads) != 2 or len(block.writes) != 1:
        return None

    def used(region):
        found = set()
        for rng in region.region:
            if _int(rng.extent) != 1:
                return None
            found |= set(tirx.analysis.undefined_vars(rng.min))
        return found

    sets = (used(block.reads[0]), used(block.reads[1]), used(block.writes[0]))
    return None if any(v is None for v in sets) else sets


def _iter_kinds(block):
    """IterKind of each iter of a ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` block (by which of A, B
    and C its var indexes), or None when the block is not of that form. Unlike dlight's analysis a
    unit I (GEMV: one row) is allowed; J and K are required."""
    found = _operand_vars(block)
    if found is None:
        return None
    a, b, c = found
    kinds = []
    for iv in block.iter_vars:
        var, extent = iv.var, _int(iv.dom.extent)
        if extent is None:
            return None
        if extent == 1:
            kinds.append(IterKind.kIter_T)
        elif iv.iter_type == tirx.IterVar.DataPar:
            if var in a and var in b and var in c:
                kinds.append(IterKind.kIter_S)
            elif var in a and var in c:
                kinds.append(IterKind.kIter_I)
            elif var in b and var in c:
                kinds.append(IterKind.kIter_J)
            else:
                return None
        elif iv.iter_type == tirx.IterVar.CommReduce and var in a and var in b and var not in c:
            kinds.append(IterKind.kIter_K)
        else:
            return None
    if IterKind.kIter_K not in kinds or IterKind.kIter_J not in kinds:
        return None  # a depthwise conv has no J (output-only weight axis): conv_templates
    return kinds, (a, b, c)


def _index_maps(block):
    """(block map to (S, I, J, K), A map to (S, I, K), B map to (S, J, K), C map to (S, I, J)); a
    missing kind becomes a unit axis."""
    kinds, (a, b, c) = _iter_kinds(block)
    S, I, J, K = IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K
    traits = [IterTrait(k, iv.dom.extent) for k, iv in zip(kinds, block.iter_vars)]

    def of(buffer_vars):
        return [t for t, iv in zip(traits, block.iter_vars) if iv.var in buffer_vars]

    return (make_iter_fusion_index_map(traits, [S, I, J, K]), make_iter_fusion_index_map(of(a), [S, I, K]),
            make_iter_fusion_index_map(of(b), [S, J, K]), make_iter_fusion_index_map(of(c), [S, I, J]))


def _inner_kinds(block):
    """Which GEMM axis kind is contiguous in A's, B's and C's buffers: the kind of the iter vars in
    each access' last index ("K" for A/B when only reduction vars appear there)."""
    kinds, _ = _iter_kinds(block)
    kind_of = {iv.var: kind for iv, kind in zip(block.iter_vars, kinds)}

    def last_kind(region, default):
        used = tirx.analysis.undefined_vars(region.region[-1].min)
        found = {kind_of.get(v) for v in used}
        for kind, name in ((IterKind.kIter_I, "I"), (IterKind.kIter_J, "J"), (IterKind.kIter_K, "K")):
            if kind in found:
                return name
        return default

    return (last_kind(block.reads[0], "K"), last_kind(block.reads[1], "K"),
            last_kind(block.writes[0], "J"))


def gemm_form(func: tirx.PrimFunc, pad: tuple = (1, 1, 1), base: GemmForm | None = None) -> GemmForm | None:
    """``func`` re-indexed to a GEMM, its I/J/K extents padded to multiples of ``pad``; None when the
    operator is not a single multiply-add reduction with GEMM-shaped accesses. ``base``: the
    unpadded form of ``func`` made before (``gemm_form(func)``, or None when it was None): a copy
    of its schedule is padded instead of re-indexing ``func`` again (the templates ask once per
    tile configuration)."""
    if base is not None:
        return _padded(base, pad)
    if not isinstance(func, tirx.PrimFunc):
        return None
    try:
        sch = s_tir.Schedule(func)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reductions is None:
            return None
        main = reductions[0]
        if not _is_multiply_add(sch.get(main)):
            return None
        sch, main = _split_groups(sch, main)
        block = sch.get(main)
        kinds = _iter_kinds(block)
        if kinds is None:
            return None
        k_dims = kinds[0].count(IterKind.kIter_K)
        inner = _inner_kinds(block)
        in_dtype = str(block.reads[0].source.dtype)
        out_dtype = str(block.writes[0].source.dtype)
        reindex_a = sch.reindex(main, ("read", 0))
        reindex_b = sch.reindex(main, ("read", 1))
        reindex_c = sch.reindex(main, ("write", 0))
        matmul_map, a_map, b_map, c_map = _index_maps(sch.get(main))
        sch.transform_layout(reindex_a, ("write", 0), a_map)
        sch.transform_layout(reindex_b, ("write", 0), b_map)
        sch.transform_layout(reindex_c, ("read", 0), c_map)
        sch.transform_block_layout(main, matmul_map)
        batch, m, n, k = (_int(sch.get(lp).extent) for lp in sch.get_loops(main))
        pm, pn, pk = pad
        pm = 1 if m == 1 else pm  # a GEMV has no row axis to pad (pad_einsum would repeat the row)
        if m % pm or n % pn or k % pk:
            sch.pad_einsum(main, [1, pm, pn, pk])
    except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
        return None
    return GemmForm(sch, main, batch, m, n, k, *inner, in_dtype, out_dtype, k_dims)


def _padded(form: GemmForm, pad: tuple) -> GemmForm | None:
    """``form`` with its own copy of the schedule, padded to multiples of ``pad`` as
    :func:`gemm_form` pads (the original is left as it is)."""
    sch = form.sch.copy()
    pm, pn, pk = pad
    pm = 1 if form.m == 1 else pm
    if form.m % pm or form.n % pn or form.k % pk:
        try:
            sch.pad_einsum(form.main, [1, pm, pn, pk])
        except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
            return None
    return dataclasses.replace(form, sch=sch)


def _fetch_order(sch, block, inner_first: bool):
    """The copy block's two innermost loops (row, col) reordered so that the source-contiguous
    one is innermost: ``inner_first`` means the *first* of them (rows: I or J) is contiguous."""
    loops = sch.get_loops(block)
    row, col = loops[-2], loops[-1]
    if inner_first:
        sch.reorder(col, row)
        return col, row
    return row, col


def schedule_gemm_tiled(func: tirx.PrimFunc, tile_m: int, tile_n: int, thread_m: int, thread_n: int,
                        tile_k: int, double_buffer: bool = True,
                        form: GemmForm | None = None) -> tirx.PrimFunc | None:
    """Register-blocked shared-memory GEMM (see the module docstring). None when it does not apply:
    not a GEMM, tiles that do not divide into threads, more than :data:`MAX_THREADS` threads, or tiles
    far larger than the operator (more than half of the rTask would be padding)."""
    if tile_m % thread_m or tile_n % thread_n:
        return None
    threads_m, threads_n = tile_m // thread_m, tile_n // thread_n
    threads = threads_m * threads_n
    if not 32 <= threads <= MAX_THREADS or threads % 32:
        return None
    form = gemm_form(func, (tile_m, tile_n, tile_k), form)
    if form is None or 2 * form.m < tile_m or 2 * form.n < tile_n or form.k < tile_k:
        return None
    try:
        return _tiled(form, tile_m, tile_n, thread_m, thread_n, tile_k, threads_m, threads_n,
                      threads, double_buffer)
    except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
        return None


def _tiled(form, tile_m, tile_n, thread_m, thread_n, tile_k, threads_m, threads_n, threads,
           double_buffer):
    sch, main = form.sch, form.main
    s, i, j, k = sch.get_loops(main)
    bi, ti, ii = sch.split(i, [None, threads_m, thread_m])
    bj, tj, jj = sch.split(j, [None, threads_n, thread_n])
    ko, ki = sch.split(k, [None, tile_k])
    # threads: the output's contiguous axis varies fastest, so a warp's stores are coalesced
    thread_axes = (tj, ti) if form.c_inner == "I" else (ti, tj)
    sch.reorder(s, bi, bj, *thread_axes, ko, ki, ii, jj)
    bx = sch.fuse(s, bi, bj)
    tx = sch.fuse(*thread_axes)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.annotate(tx, "pragma_auto_unroll_max_step", 256)
    sch.annotate(tx, "pragma_unroll_explicit", 1)

    store = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(store, tx, preserve_unit_loops=True)

    def fetch(index, inner_first):
        block = sch.cache_read(main, index, "shared")
        sch.compute_at(block, ko, preserve_unit_loops=True)
        row, col = _fetch_order(sch, block, inner_first)
        fused = sch.fuse(row, col)
        _, t = sch.split(fused, [None, threads])
        sch.bind(t, "threadIdx.x")
        # tiles stored k-major ([k][m], [k][n]): a thread's register operands are one contiguous row
        sch.transform_layout(block, ("write", 0), lambda b, r, c: (b, c, r))
        sch.storage_align(block, 0, axis=-2, factor=32, offset=4)
        return block

    def registers(index, extent):
        block = sch.cache_read(main, index, "local")
        sch.compute_at(block, ki, preserve_unit_loops=True)
        if extent % 4 == 0:
            _, vec = sch.split(sch.get_loops(block)[-1], [None, 4])
            sch.vectorize(vec)
        return block

    a_fetch = fetch(0, form.a_inner == "I")
    b_fetch = fetch(1, form.b_inner == "J")
    registers(0, thread_m)
    registers(1, thread_n)
    auto_inline_producers(sch, a_fetch)
    auto_inline_producers(sch, b_fetch)
    auto_inline_consumer_chain(sch, store)
    sch.decompose_reduction(main, ko)
    if double_buffer:  # two shared stages: tile k+1 is loaded while tile k is computed
        sch.annotate(ko, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(ko, "software_pipeline_order", [0, 1, 2])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_gemm_small_batch(func: tirx.PrimFunc, vec: int, threads_n: int,
                              split_k: int, form: GemmForm | None = None) -> tirx.PrimFunc | None:
    """Dense/matmul with at most :data:`SMALL_BATCH_ROWS` rows: one thread owns all rows of ``vec``
    columns, ``split_k`` threads share the reduction (see the module docstring)."""
    threads = threads_n * split_k
    if not 32 <= threads <= MAX_THREADS or threads % 32:
        return None
    form = gemm_form(func, base=form)
    if form is None or form.m > SMALL_BATCH_ROWS or form.batch != 1:
        return None
    if form.n % vec or form.n < vec * threads_n // 2 or form.k < 2 * split_k:
        return None
    try:
        return _small_batch(form, vec, threads_n, split_k)
    except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
        return None


def _small_batch(form, vec, threads_n, split_k):
    sch, main = form.sch, form.main
    s, i, j, k = sch.get_loops(main)
    bj, tj, jv = sch.split(j, [None, threads_n, vec])
    ko, tk = sch.split(k, [None, split_k])
    sch.reorder(s, bj, tj, tk, ko, i, jv)
    partial = sch.rfactor(tk, 0)
    # the split of k are neighbouring lanes of a warp: the final sum is a few warp shuffles
    s, bj, tj, tk, ko, i, jv = sch.get_loops(partial)
    sch.bind(sch.fuse(s, bj), "blockIdx.x")
    sch.bind(tj, "threadIdx.y")
    sch.bind(tk, "threadIdx.x")
    sch.set_scope(partial, 0, "local")
    sch.annotate(ko, "pragma_auto_unroll_max_step", 64)
    sch.annotate(ko, "pragma_unroll_explicit", 1)
    if vec > 1:
        sch.vectorize(jv)
    auto_inline_producers(sch, partial)
    sch.reverse_compute_at(main, tj, preserve_unit_loops=True)
    sch.set_scope(main, 0, "local")
    red, *rest = sch.get_loops(main)[2:]  # (block, n threads, the split of k, s, i, vec)
    sch.reorder(*rest, red)
    sch.bind(red, "threadIdx.x")
    sch.decompose_reduction(partial, ko)
    # epilogue (out of the GEMM layout, bias, activation) inlined into one store per output
    consumers = sch.get_consumers(main)
    if len(consumers) != 1:
        return None
    auto_inline_consumer_chain(sch, consumers[0])
    (out,) = sch.get_consumers(main)
    sch.reverse_compute_at(out, tj, preserve_unit_loops=True)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
