"""Run GPU-scheduled TIR on the CPU: every thread-bound loop made serial, built for llvm.

This checks what a schedule *computes* (its blocks, their loop nests, regions, caches and
write-backs), not how a GPU's threads share the work: the scheduled PrimFunc keeps its SBlocks, so
a cooperative load into shared memory still runs before the blocks that read it, and a reduction
bound to ``threadIdx`` becomes an ordinary serial one. Races, barriers, warp-level code and the
lowered kernel's rewrites are out of its reach (the CUDA emulator's job).

:func:`serial_threads` takes a scheduled PrimFunc and returns it with every thread-binding ``For``
serial; :func:`run_on_cpu` builds a PrimFunc for llvm and runs it on NumPy arrays (one per
parameter, in parameter order), returning every buffer after the call.
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

__all__ = ["serial_threads", "run_on_cpu"]


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
