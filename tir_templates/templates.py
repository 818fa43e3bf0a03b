"""Parametrised thread-block schedules: more rKernels per operator (Rammer, OSDI'20, 3.1 and 3.3).

An rOperator may have several rKernels, each breaking the operator into a different number of rTasks
with a different per-rTask time and resource use; the policy's SelectRKernels picks among them. dlight
gives one schedule per operator. These templates give others, each a plain function of its tile
parameters that returns the scheduled ``PrimFunc`` or ``None`` when it does not apply (like a dlight
rule; it never raises for an operator it does not handle):

- :func:`schedule_spatial` (any single-reduction operator after inlining: matmul, GEMV, conv2d,
  depthwise/grouped conv2d, pooling): one thread computes ``per_thread`` outputs, the reduction runs
  serially in registers. ``threads`` sets the rTask width, ``threads * per_thread`` the outputs per
  rTask, so the rTask count is ``ceil(outputs / (threads * per_thread))``.
- :func:`schedule_cross_thread` (GEMV-like: few outputs, long reduction): ``rows`` outputs per rTask,
  each reduced by ``reduce_threads`` threads (rfactor, then a cross-thread reduction that TVM lowers to
  warp shuffles); ``rows * reduce_threads`` threads per rTask.
- :func:`schedule_tiled_matmul` (matmul / batch matmul: one reduction axis, the last two spatial axes
  are the output rows and columns): ``tile_m x tile_n`` outputs per rTask, ``thread_m x thread_n`` per
  thread accumulated in registers, operands staged through shared memory ``tile_k`` at a time.

The fast families live in their own modules and are listed by :func:`fast_schedules`: implicit-GEMM
conv2d / grouped conv2d / matmul and small-batch dense (``gemm_templates``), depthwise conv2d
(``conv_templates``), tensor-core float16 GEMMs (``mma_templates``). :func:`template_schedules` lists the variants tried for one operator, by
operator kind (:func:`operator_kind`). Everything here works on the *unscheduled* PrimFunc (after LegalizeOps/FuseTIR,
before dlight).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline

from .decode_attention import schedule_of as decode_attention_versions

__all__ = ["Template", "operator_kind", "schedule_spatial", "schedule_cross_thread",
           "schedule_tiled_matmul", "fast_schedules", "template_schedules"]


@dataclass(frozen=True)
class Template:
    """One template instance: a readable name and the scheduled PrimFunc."""

    name: str
    func: tirx.PrimFunc


def _prepare(func: tirx.PrimFunc, allow_epilogue: bool = False):
    """(schedule, the one remaining block, its loops by kind) after inlining everything else; None when
    the function does not reduce to a single S*/R* block. With ``allow_epilogue`` a reduction may be
    followed by one spatial block (``mean`` = sum, then divide): it comes back as a fifth item."""
    if not isinstance(func, tirx.PrimFunc):
        return None
    try:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
    except Exception:  # pylint: disable=broad-except
        return None
    epilogue = None
    if allow_epilogue and len(infos) == 2 and all(k == "S" for k in infos[1].dom_kind()) \
            and "R" in infos[0].dom_kind():
        epilogue = infos[1].block_rv
        infos = infos[:1]
    if len(infos) != 1:
        return None
    block = infos[0].block_rv
    kinds = infos[0].dom_kind()
    loops = sch.get_loops(block)
    if len(loops) != len(kinds) or "O" in kinds:
        return None
    for loop in loops:
        if sch.get(loop).thread_binding is not None or not isinstance(sch.get(loop).extent, tirx.IntImm):
            return None
    s_loops = [lp for lp, k in zip(loops, kinds) if k == "S"]
    r_loops = [lp for lp, k in zip(loops, kinds) if k == "R"]
    if allow_epilogue:
        return sch, block, s_loops, r_loops, epilogue
    return sch, block, s_loops, r_loops


def _extent(sch, loop) -> int:
    return int(sch.get(loop).extent)


def _finish(sch) -> tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def operator_kind(func: tirx.PrimFunc) -> str | None:
    """"matmul", "gemv", "conv2d", "depthwise_conv2d", "reduction" or "elementwise" for the single
    block ``func`` reduces to after inlining; None when it has several blocks. Read from the loop nest
    (unit loops dropped): matmul/GEMV have one reduction axis (GEMV: at most 4 output rows), conv2d
    three (input channels and the window), depthwise/grouped conv two (the window)."""
    prepared = _prepare(func, allow_epilogue=True)
    if prepared is None:
        return None
    sch, _, s_loops, r_loops, _ = prepared
    if not r_loops:
        return "elementwise"
    spatial = [_extent(sch, lp) for lp in s_loops]
    if len(r_loops) == 1 and spatial:
        return "gemv" if math.prod(spatial[:-1]) <= 4 else "matmul"
    if len(r_loops) == 3 and len(s_loops) >= 2:
        return "conv2d"
    if len(r_loops) == 2 and len(s_loops) >= 2:
        return "depthwise_conv2d"
    return "reduction"


def schedule_spatial(func: tirx.PrimFunc, threads: int, per_thread: int = 1) -> tirx.PrimFunc | None:
    """Each thread computes ``per_thread`` consecutive outputs; the reduction is serial, in registers
    (no warp shuffles, so it may early-exit in any vEU). A spatial epilogue is fused per thread."""
    prepared = _prepare(func, allow_epilogue=True)
    if prepared is None:
        return None
    sch, block, s_loops, r_loops, epilogue = prepared
    if epilogue is not None and not r_loops:
        return None
    if not s_loops:
        s_loops = [sch.add_unit_loop(block)]
    sch.reorder(*s_loops, *r_loops)
    fused = sch.fuse(*s_loops)
    outputs = _extent(sch, fused)
    if outputs < threads * per_thread // 2 and (threads > 32 or per_thread > 1):
        return None  # most threads would idle; a narrower variant covers this operator
    if r_loops:
        # The write-back of each output sits in the fused output loop, next to its reduction,
        # *before* that loop is split: the split then predicates both blocks alike (an output
        # index past the end is neither computed nor stored). Placed under the thread loop after
        # the split instead, TVM's region analysis gives the write-back the bounding box of the
        # thread's outputs in the output's own dimensions: whole planes when ``per_thread`` does
        # not divide the innermost extent (4 outputs of a 7x7 plane: each thread stored the other
        # threads' outputs from its uninitialised local buffer), and with one block of more
        # threads than outputs a domain past the output's end, unpredicated (stores out of bounds).
        local = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(local, fused)
        if epilogue is not None:
            try:
                sch.reverse_compute_inline(epilogue)
            except Exception:  # pylint: disable=broad-except  (not elementwise on the output)
                return None
    bx, tx, _ = sch.split(fused, factors=[None, threads, per_thread])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if r_loops:
        sch.decompose_reduction(block, r_loops[0])
    return _finish(sch)


def schedule_cross_thread(func: tirx.PrimFunc, rows: int, reduce_threads: int) -> tirx.PrimFunc | None:
    """``rows`` outputs per rTask, each reduced by ``reduce_threads`` threads (rfactor + cross-thread
    reduction)."""
    prepared = _prepare(func)
    if prepared is None:
        return None
    sch, block, s_loops, r_loops = prepared
    if not r_loops:
        return None
    if not s_loops:
        s_loops = [sch.add_unit_loop(block)]
    sch.reorder(*s_loops, *r_loops)
    fused_s = sch.fuse(*s_loops)
    fused_r = sch.fuse(*r_loops)
    if _extent(sch, fused_r) < 2 * reduce_threads or _extent(sch, fused_s) < rows:
        return None
    ro, ri = sch.split(fused_r, factors=[None, reduce_threads])
    try:
        rf = sch.rfactor(ri, 0)
    except Exception:  # pylint: disable=broad-except  (not a commutative reduction TVM can factor)
        return None
    bx, ty = sch.split(fused_s, factors=[None, rows])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.compute_at(rf, ty)
    rf_loops = sch.get_loops(rf)
    # rf block loops: bx, ty, then its own (ri as a spatial loop, ro); bind ri to threadIdx.x
    inner = rf_loops[2:]
    spatial_ri = [lp for lp in inner if _extent(sch, lp) == reduce_threads]
    if not spatial_ri:
        return None
    sch.reorder(spatial_ri[0], *[lp for lp in inner if not lp.same_as(spatial_ri[0])])
    sch.bind(spatial_ri[0], "threadIdx.x")
    main_loops = sch.get_loops(block)
    sch.bind(main_loops[-1], "threadIdx.x")
    return _finish(sch)


def schedule_tiled_matmul(func: tirx.PrimFunc, tile_m: int, tile_n: int, thread_m: int,
                          thread_n: int, tile_k: int) -> tirx.PrimFunc | None:
    """``tile_m x tile_n`` outputs per rTask, ``thread_m x thread_n`` per thread, operands in shared
    memory ``tile_k`` columns at a time. Needs one reduction axis and tiles that divide the output."""
    prepared = _prepare(func)
    if prepared is None:
        return None
    sch, block, s_loops, r_loops = prepared
    if len(r_loops) != 1 or len(s_loops) < 2:
        return None
    *batch, i, j = s_loops
    (k,) = r_loops
    m, n, kk = _extent(sch, i), _extent(sch, j), _extent(sch, k)
    if m % tile_m or n % tile_n or kk % tile_k or tile_m % thread_m or tile_n % thread_n:
        return None
    threads = (tile_m // thread_m) * (tile_n // thread_n)
    if not 32 <= threads <= 1024:
        return None
    bi, ti, ii = sch.split(i, factors=[None, tile_m // thread_m, thread_m])
    bj, tj, jj = sch.split(j, factors=[None, tile_n // thread_n, thread_n])
    ko, ki = sch.split(k, factors=[None, tile_k])
    sch.reorder(*batch, bi, bj, ti, tj, ko, ki, ii, jj)
    bx = sch.fuse(*batch, bi, bj)
    tx = sch.fuse(ti, tj)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    local = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(local, tx)
    num_reads = len(sch.get(block).reads)
    for index in range(num_reads):
        shared = sch.cache_read(block, index, "shared")
        sch.compute_at(shared, ko)
        loops = sch.get_loops(shared)
        below = [n for n, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(ko))][0] + 1
        fused = sch.fuse(*loops[below:])
        _, t = sch.split(fused, factors=[None, threads])
        sch.bind(t, "threadIdx.x")
    sch.decompose_reduction(block, ko)
    return _finish(sch)


_SPATIAL = ((64, 1), (128, 1), (256, 1), (128, 4), (256, 4))
_CROSS = ((1, 128), (4, 64), (8, 32), (16, 16))
_TILED = ((64, 64, 4, 4, 8), (32, 32, 2, 2, 16), (32, 64, 4, 4, 16), (16, 16, 1, 2, 16), (16, 32, 2, 2, 16))
# implicit GEMM (conv2d, grouped conv2d) and matmul/dense: (tile_m, tile_n, thread_m, thread_n, tile_k)
_GEMM = ((128, 64, 8, 4, 8), (64, 128, 4, 8, 8), (64, 64, 4, 4, 16), (128, 128, 8, 8, 8),
         (32, 64, 4, 4, 16), (64, 32, 4, 4, 16), (32, 32, 4, 4, 16), (64, 16, 4, 2, 16),
         (32, 16, 2, 2, 8),
         (64, 8, 2, 2, 16), (64, 4, 2, 1, 16))  # narrow: grouped convs with few channels per group
# dense at batch 1 to 16: (columns per thread, column threads, threads splitting k)
_SMALL_BATCH = ((4, 8, 8), (4, 16, 8), (2, 16, 16), (1, 8, 32), (4, 32, 4), (1, 16, 16))
# depthwise conv2d: (tile_h, tile_w, outputs per thread)
_DEPTHWISE = ((8, 32, 4), (16, 32, 4), (8, 16, 2), (16, 16, 2), (4, 16, 1))


def _padding_waste(form, tile_m: int, tile_n: int) -> float:
    """Fraction of a GEMM's padded output tiles that is padding (0 when it is not a GEMM)."""
    if form is None:
        return 0.0
    padded = math.ceil(form.m / tile_m) * tile_m * math.ceil(form.n / tile_n) * tile_n
    return 1.0 - form.m * form.n / padded


def fast_schedules(func: tirx.PrimFunc, target=None) -> list[Template]:
    """The tiled rKernels of a conv2d / matmul: tensor-core ones for float16 operators on sm_80+
    ``target`` s (``mma_templates``), then ``gemm_templates`` (GEMM tiles with the least padding
    first) and ``conv_templates``."""
    from .conv_templates import schedule_depthwise_conv2d
    from .gemm_templates import gemm_form, schedule_gemm_small_batch, schedule_gemm_tiled
    from .mma_templates import mma_schedules

    found: list[Template] = []

    def add(name, scheduled):
        if scheduled is not None:
            found.append(Template(name, scheduled))

    form = gemm_form(func)  # re-indexed once; each tile configuration pads a copy
    for name, scheduled in mma_schedules(func, target, form=form):
        add(name, scheduled)
    for p in sorted(_GEMM, key=lambda p: (_padding_waste(form, p[0], p[1]), -p[0] * p[1])):
        add("gemm_m{}n{}_t{}x{}_k{}".format(*p), schedule_gemm_tiled(func, *p, form=form))
    for p in _SMALL_BATCH:
        add("small_batch_v{}_n{}_k{}".format(*p), schedule_gemm_small_batch(func, *p, form=form))
    for p in _DEPTHWISE:
        add("depthwise_h{}w{}_t{}".format(*p), schedule_depthwise_conv2d(func, *p))
    return found


def template_schedules(func: tirx.PrimFunc, target=None) -> list[Template]:
    """Every template variant that applies to ``func`` (its unscheduled PrimFunc), by operator kind:
    the tiled ones first (:func:`fast_schedules`; ``target`` enables the tensor-core ones); the
    naive spatial one for a convolution only when nothing tiled applies."""
    own = decode_attention_versions(func)  # the split decode attention's own variants
    if own:
        return [Template(name, f.with_attr("tirx.is_scheduled", True)) for name, f in own]
    kind = operator_kind(func)
    if kind is None:
        return []
    found: list[Template] = []

    def add(name, scheduled):
        if scheduled is not None:
            found.append(Template(name, scheduled))

    if kind in ("matmul", "gemv", "conv2d", "depthwise_conv2d"):
        found += fast_schedules(func, target)
    if kind == "matmul":
        for p in _TILED:
            add("tiled_matmul_m{}n{}_t{}x{}_k{}".format(*p), schedule_tiled_matmul(func, *p))
    if kind in ("gemv", "reduction"):
        for rows, red in _CROSS:
            add(f"cross_thread_r{rows}x{red}", schedule_cross_thread(func, rows, red))
    tiled_conv = kind in ("conv2d", "depthwise_conv2d") and found
    if kind in ("conv2d", "depthwise_conv2d", "matmul", "gemv", "reduction", "elementwise") \
            and not tiled_conv:
        for threads, per in _SPATIAL:
            add(f"spatial_t{threads}x{per}", schedule_spatial(func, threads, per))
    return found
