"""Run GPU-scheduled TIR on the CPU: every thread-bound loop made serial, built for llvm.

This checks what a schedule *computes* (its blocks, their loop nests, regions, caches and
write-backs), not how a GPU's threads share the work: the scheduled PrimFunc keeps its SBlocks, so
a cooperative load into shared memory still runs before the blocks that read it, and a reduction
bound to ``threadIdx`` becomes an ordinary serial one. Races, barriers, warp-level code and the
lowered kernel's rewrites are out of its reach (the CUDA emulator's job).

:func:`serial_threads` takes a scheduled PrimFunc and returns it with every thread-binding ``For``
serial; :func:`run_on_cpu` builds a PrimFunc for llvm and runs it on NumPy arrays (one per
parameter, in parameter order), returning every buffer after the call. :func:`stores_past_the_end`
finds a block iterator whose domain runs past a dimension of a buffer the block writes, a store out
of bounds that would corrupt memory when run (checked before running, so the check reports it).
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

__all__ = ["serial_threads", "run_on_cpu", "stores_past_the_end"]


def serial_threads(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every thread-bound loop a serial loop: the same blocks, runnable on the CPU
    (checks what a schedule computes, not how the GPU's threads share it)."""
    def unbind(loop):
        if loop.kind == tirx.ForKind.THREAD_BINDING:
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body)
        return loop

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, unbind)]))


def run_on_cpu(func: tirx.PrimFunc, arrays: list) -> list:
    """Build ``func`` for llvm, call it on copies of ``arrays`` (one per parameter, its shape and
    dtype) and return every buffer after the call. ``func`` must have no thread-bound loops left
    (:func:`serial_threads`). Raises ``ValueError`` when the arrays do not match the parameters."""
    if len(arrays) != len(func.params):
        raise ValueError(f"run_on_cpu: {len(arrays)} arrays for {len(func.params)} parameters")
    for param, array in zip(func.params, arrays):
        shape = tuple(int(d) for d in param.ty.shape)
        if tuple(array.shape) != shape or str(array.dtype) != str(param.ty.dtype):
            raise ValueError(f"run_on_cpu: parameter {param.name} is {shape} {param.ty.dtype}, "
                             f"got {tuple(array.shape)} {array.dtype}")
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    args = [tvm.runtime.tensor(np.array(a, copy=True)) for a in arrays]
    lib["main"](*args)
    return [a.numpy() for a in args]


def stores_past_the_end(func: tirx.PrimFunc) -> list:
    """(block, buffer, dimension) for every unpredicated block (no ``T.where``) with an iterator
    that indexes a dimension of a buffer the block writes and whose domain is larger than that
    dimension: the domain itself says the store goes past the end. (A predicated block, such as
    dlight's padded write-backs, is left to the run.)"""
    found = []

    def visit(realize):
        if not (isinstance(realize.predicate, tirx.IntImm) and int(realize.predicate) == 1):
            return
        block = realize.block
        extents = {iv.var: iv.dom.extent for iv in block.iter_vars}
        for region in block.writes:
            buffer = region.source
            for dim, (rng, size) in enumerate(zip(region.region, buffer.ty.shape)):
                extent = extents.get(rng.min) if isinstance(rng.min, tirx.Var) else None
                if isinstance(extent, tirx.IntImm) and isinstance(size, tirx.IntImm) \
                        and int(extent) > int(size):
                    found.append((block.name_hint, buffer.name, dim))

    tvm_ffi.structural_walk(func.body, [(s_tir.SBlockRealize, visit)])
    return found
