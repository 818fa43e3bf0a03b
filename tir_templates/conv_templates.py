"""Depthwise conv2d rKernels: a stencil per channel, input tile staged through shared memory.

A depthwise convolution (one input channel per group; NCHW, any stride, padding, dilation) has no
GEMM form: per channel it is a ``KH x KW`` stencil over the image, ``KH * KW`` multiply-adds per
output. :func:`schedule_depthwise_conv2d` gives one rTask a ``tile_h x tile_w`` output tile of one
channel (of one image): the input tile it needs (the tile plus its halo) is loaded once into shared
memory with the padding inlined, each thread keeps the channel's ``KH x KW`` weights and
``per_thread`` neighbouring outputs of a row in registers, and the elementwise epilogue (bias,
activation, cast) is fused into the store.

Grouped convolutions with several channels per group are GEMMs (``tir_templates.gemm_templates``).
Like every template, it returns None for an operator it does not handle and never raises.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain, auto_inline_producers, get_reduction_blocks

from .gemm_templates import MAX_THREADS, _is_multiply_add, _operand_vars

__all__ = ["depthwise_axes", "schedule_depthwise_conv2d"]


def depthwise_axes(block) -> dict | None:
    """{"S": [...], "I": [...], "K": [...]} iter indices of a depthwise conv block (channel: in the
    input, the weights and the output; image: input and output; window: reductions in input and
    weights), None for anything else (pooling has one input, a GEMM has an output-only weight axis)."""
    found = _operand_vars(block)
    if found is None or not _is_multiply_add(block):
        return None
    a, b, c = found
    axes = {"S": [], "I": [], "K": [], "T": []}
    for n, iv in enumerate(block.iter_vars):
        extent = iv.dom.extent
        if not isinstance(extent, tirx.IntImm):
            return None
        var, spatial = iv.var, iv.iter_type == tirx.IterVar.DataPar
        if int(extent) == 1:
            axes["T"].append(n)
        elif spatial and var in a and var in b and var in c:
            axes["S"].append(n)
        elif spatial and var in a and var in c and var not in b:
            axes["I"].append(n)
        elif not spatial and var in a and var in b and var not in c:
            axes["K"].append(n)
        else:
            return None
    if not axes["S"] or len(axes["I"]) != 2 or not axes["K"]:
        return None
    # a window axis shifts an image axis (input row yy * s + ry); a grouped conv's input channels
    # (rc) do not: that is a GEMM (gemm_templates)
    image = {block.iter_vars[n].var for n in axes["I"]}
    shifted = set()
    for rng in block.reads[0].region:
        used = set(tirx.analysis.undefined_vars(rng.min))
        if used & image:
            shifted |= used
    if any(block.iter_vars[n].var not in shifted for n in axes["K"]):
        return None
    return axes


def schedule_depthwise_conv2d(func: tirx.PrimFunc, tile_h: int, tile_w: int,
                              per_thread: int) -> tirx.PrimFunc | None:
    """``tile_h x tile_w`` outputs of one channel per rTask, ``per_thread`` of a row per thread."""
    if tile_w % per_thread:
        return None
    threads = tile_h * tile_w // per_thread
    if not 32 <= threads <= MAX_THREADS or threads % 32:
        return None
    if not isinstance(func, tirx.PrimFunc):
        return None
    try:
        return _depthwise(func, tile_h, tile_w, per_thread, threads)
    except Exception:  # pylint: disable=broad-except  (a primitive that fails = does not apply)
        return None


def _depthwise(func, tile_h, tile_w, per_thread, threads):
    sch = s_tir.Schedule(func)
    reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if reductions is None:
        return None
    main = reductions[0]
    block = sch.get(main)
    axes = depthwise_axes(block)
    if axes is None:
        return None
    loops = sch.get_loops(main)
    if len(loops) != len(block.iter_vars):
        return None
    h, w = (loops[n] for n in axes["I"])
    out_h, out_w = int(sch.get(h).extent), int(sch.get(w).extent)
    if 2 * out_h < tile_h or 2 * out_w < tile_w:
        return None  # most of the rTask would idle; a smaller tile covers this operator
    outer = [loops[n] for n in sorted(axes["S"] + axes["T"])]
    window = [loops[n] for n in axes["K"]]
    bh, th = sch.split(h, [None, tile_h])
    bw, tw, wv = sch.split(w, [None, tile_w // per_thread, per_thread])
    sch.reorder(*outer, bh, bw, th, tw, *window, wv)
    bx = sch.fuse(*outer, bh, bw)
    tx = sch.fuse(th, tw)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.annotate(tx, "pragma_auto_unroll_max_step", 64)
    sch.annotate(tx, "pragma_unroll_explicit", 1)
    store = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
    tile = sch.cache_read(main, 0, "shared")  # the input tile and its halo, padding inlined
    sch.compute_at(tile, bx, preserve_unit_loops=True)
    _, t = sch.split(sch.fuse(*sch.get_loops(tile)[1:]), [None, threads])
    sch.bind(t, "threadIdx.x")
    weights = sch.cache_read(main, 1, "local")  # the channel's window, once per thread
    sch.compute_at(weights, tx, preserve_unit_loops=True)
    auto_inline_producers(sch, tile)
    auto_inline_consumer_chain(sch, store)
    sch.decompose_reduction(main, window[0])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
