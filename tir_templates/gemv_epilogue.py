"""The rKernel of a GEMV with a split epilogue: an RNN cell as one kernel (``GEMVEpilogue``).

``relay_passes.gemv_epilogue.GEMVEpilogueFusion`` emits, per recurrent GEMV, one fused function:
``mh' = h @ W'`` with the weight's columns interleaved so that the P gate columns of hidden unit
``j`` are adjacent (``W'[:, j*P + p] = W[:, p*H + j]``), a block ``T_deinterleave`` that restores
the original order, and the elementwise tail (slices, activations, cell update) writing one or
more ``[1, H]`` outputs. FuseTIR makes that one PrimFunc; dlight cannot schedule it as one kernel
(its Fallback makes three, the GEMV's result through global memory). This rule does:

1. every block except the GEMV and the outputs is inlined into its readers, and the indices are
   simplified, so each output block reads ``mh'[0, j*P + p]`` for constant ``p``;
2. the GEMV's result is laid out ``[1, H, P]`` (the same order) and its reduction split: ``TR``
   threads (``threadIdx.y``) each sum ``K / TR`` products, then reduce across threads (rfactor,
   as dlight's GEMV rule does for other targets);
3. the output blocks' loops are tiled by ``U`` hidden units (:func:`cell_tiling`: 4 for an
   LSTM whose width is a multiple of 4) and merged into one loop, bound to ``blockIdx.x``; the GEMV is computed under it for exactly the ``P * U`` columns its units need
   (``threadIdx.x``, one column each: the tile's row segment of ``W'`` is contiguous), into shared
   memory; the outputs' ``U`` units run on the first ``U`` threads after one barrier.

So one thread block (one rTask) computes ``U`` hidden units from end to end: ``H / U`` rTasks, the
GEMV's work unchanged (dlight's GEMV takes 16 columns per block too), the tail's barrier wait and
rTask gone from the recurrent critical path.

Applies only to PrimFuncs holding a ``T_deinterleave`` block (made by that pass, nothing else); a
function it cannot schedule so (not one GEMV and injective blocks) is left to dlight's rules, which
make it three kernels (the pass only fuses injective tails, so this is not expected).
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

__all__ = ["GEMVEpilogue", "DEINTERLEAVE_BLOCK", "cell_tiling"]

DEINTERLEAVE_BLOCK = "T_deinterleave"
COLUMNS_PER_RTASK = 16  # threadIdx.x: one GEMV column per thread, a 64-byte row segment of W'


def cell_tiling(hidden: int, parts: int, k: int, max_threads: int) -> tuple | None:
    """``(U, TR)``: hidden units per thread block and threads splitting the K-long reduction, or
    None when no tiling fits. U divides ``hidden`` with ``P * U <= 16`` (the most such), TR is a
    power of two dividing ``k``, and the block's ``P * U * TR`` threads are at most
    ``max_threads`` and a multiple of 32 (an rTask narrower than its vEU syncs its active threads
    with a named barrier, which counts whole warps). GEMVEpilogueFusion fuses only what tiles."""
    widest = max(1, COLUMNS_PER_RTASK // parts)
    for units in sorted((u for u in range(1, widest + 1) if hidden % u == 0), reverse=True):
        columns = parts * units
        reduce_threads = 1
        while reduce_threads * 2 * columns <= max_threads and k % (reduce_threads * 2) == 0:
            reduce_threads *= 2
        while reduce_threads >= 1:
            if (columns * reduce_threads) % 32 == 0:
                return units, reduce_threads
            reduce_threads //= 2
    return None


def _is_reduction(sch, block) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(block).iter_vars)


def _block_names(func) -> set:
    names = set()
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, lambda b: names.add(str(b.name_hint)))])
    return names


def _inlined(func):
    """``func`` with every block but the reduction and the outputs inlined, simplified; with
    the reduction block's (loop extents of its spatial iters, reduction extent)."""
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    progress = True
    while progress:
        progress = False
        for block in reversed(sch.get_child_blocks(root)):
            if sch.get(block).name_hint in outputs or _is_reduction(sch, block):
                continue
            sch.compute_inline(block)
            progress = True
            break
    mod = s_tir.transform.StmtSimplify()(tvm.IRModule({"main": sch.mod["main"]}))
    return mod["main"]


class GEMVEpilogue:
    """A dlight-style rule (``apply(func, target, tunable)``) for the fused RNN cell; see the
    module docstring. Returns None for any other function."""

    schedule_name = "gemv_epilogue"  # default_schedule.SCHEDULED_BY_ATTR of what it schedules

    def apply(self, func, target, _tunable=False):
        if not isinstance(func, tirx.PrimFunc) or DEINTERLEAVE_BLOCK not in _block_names(func):
            return None
        return _schedule(func, target)


def _shape_of(sch, block, k: int) -> list:
    """Shape of the buffer a block writes (its ``k``-th write)."""
    return [int(d) for d in sch.get(block).writes[k].source.ty.shape]


def _schedule(func, target):
    """The schedule of the module docstring, or None when the shapes do not tile."""
    func = _inlined(func)
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    gemvs = [b for b in blocks if _is_reduction(sch, b)]
    outputs = list(sch.get_output_blocks(root))
    if len(gemvs) != 1 or len(blocks) != 1 + len(outputs) or not outputs:
        return None
    gemv = gemvs[0]
    loops = sch.get_loops(gemv)
    if len(loops) != 3:
        return None
    _, n_extent, k_extent = (int(sch.get(loop).extent) for loop in loops)
    widths = {tuple(_shape_of(sch, o, 0)) for o in outputs}
    if len(widths) != 1:
        return None
    (shape,) = widths
    if len(shape) != 2 or shape[0] != 1 or n_extent % shape[1]:
        return None
    hidden, parts = shape[1], n_extent // shape[1]
    max_threads = int(target.attrs.get("max_num_threads", 256)) if hasattr(target, "attrs") else 256
    tiling = cell_tiling(hidden, parts, k_extent, max_threads)
    if tiling is None:
        return None
    units, reduce_threads = tiling

    # the GEMV's result as [1, H, P]: a tile of units is one box of it
    sch.transform_layout(gemv, ("write", 0), lambda i, n: (i, n // parts, n % parts))
    i, n, k = sch.get_loops(gemv)
    k_outer, k_inner = sch.split(k, [None, reduce_threads])
    sch.reorder(i, n, k_inner, k_outer)
    partial = sch.rfactor(k_inner, factor_axis=0)

    tiles = [sch.split(sch.fuse(*sch.get_loops(o)), [None, units]) for o in outputs]
    tile = sch.merge(*[outer for outer, _ in tiles]) if len(tiles) > 1 else tiles[0][0]
    sch.compute_at(gemv, tile, preserve_unit_loops=True)
    sch.compute_at(partial, tile, preserve_unit_loops=True)
    sch.bind(tile, "blockIdx.x")
    for block in (partial, gemv):
        # under the tile the loops follow the block's iters: (k_inner, i, n[, k_outer])
        k_in, i_loop, n_loop = sch.get_loops(block)[1:4]
        column = sch.fuse(i_loop, n_loop)
        sch.reorder(column, k_in)
        sch.bind(column, "threadIdx.x")
        sch.bind(k_in, "threadIdx.y")
    sch.set_scope(partial, 0, "local")
    sch.set_scope(gemv, 0, "shared")
    sch.decompose_reduction(partial, sch.get_loops(partial)[-1])
    for o in outputs:
        thread, _ = sch.split(sch.get_loops(o)[-1], [parts * units, None])
        sch.bind(thread, "threadIdx.x")
    return sch
