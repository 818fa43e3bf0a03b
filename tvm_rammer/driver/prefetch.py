"""Weights prefetched across barrier-rTasks (``RammerConfig(prefetch_weights=True)``, issue 34).

Before a vEU polls a barrier-rTask's waits, the persistent kernel issues L2 prefetches of the
weights the rTask after it reads (``codegen.persistent``, ``cuda_helpers.PREFETCH_SOURCE``), and the
cost model overlaps that read with the wait (``scheduling.cost_model.weight_read_us``). This module
decides both sides from one rule, so the model charges the overlap exactly where code issues it:

- :func:`prefetched_inputs`: which inputs of an operator are prefetched: constants (or weights
  apart: weight parameters; never a tensor an operator produces), read whole by affine accesses
  (an indirect read, a Gather's table, or a slice of a constant is not: its rows are unknown or
  few); the same whether the weights are embedded or apart, so both build the same kernel;
  where they exceed the L2-resident bytes of the cost model together (Llama-1B's gate / up /
  down projections, 33.5 MB each; an LM head), only the leading part of each rTask's share that
  keeps the total within them (:func:`prefetch_fraction`): a barrier's wait (~1 us) is far
  shorter than any rTask's whole read, so a part covers it;
- :func:`with_prefetch`: the rOperator with those positions, that fraction and each rKernel's
  ``prefetch_us`` (the prefetched part of its rTask's share at DRAM bandwidth, at most its time
  less the dispatch overhead; inputs the model already reads from L2,
  ``rkernels.resident_inputs``, not counted);
- :func:`prefetch_ranges`: for an rProgram's table (``codegen.persistent.encode_program``), each
  prefetching operator's rTask count, its constants' ``(byte offset, bytes)`` in the weights blob
  and the fraction of each share prefetched.

In: dataflow-graph nodes, scheduled PrimFuncs, rOperators, a TensorPlan. Out: rOperators, dicts.
CUDA targets only: the ROCm back end emits no prefetch, so it is charged none.
"""
from __future__ import annotations

import dataclasses
import math

import tvm

from ..scheduling import rkernels
from ..scheduling.cost_model import weight_read_us

__all__ = ["enabled", "whole_reads", "prefetched_inputs", "prefetch_fraction", "with_prefetch",
           "prefetch_ranges"]


def enabled(config, target) -> bool:
    """Whether barrier-rTasks prefetch weights for this config and target (CUDA only)."""
    return bool(config.prefetch_weights) and target is not None and target.kind.name == "cuda"


def _nbytes(tensor) -> int:
    return math.prod(int(d) for d in tensor.shape) * tvm.runtime.DataType(tensor.dtype).bits // 8


def whole_reads(func) -> list:
    """Per parameter of the scheduled PrimFunc ``func``: whether its blocks read it whole through
    affine indices only (``rkernels.whole_reads``)."""
    return rkernels.whole_reads(func)


def _is_weight(t, weights: set) -> bool:
    return t.is_constant or (t.producer is None and t.expr in weights)


def prefetched_inputs(node, boxes, weights: set) -> tuple:
    """Positions of ``node``'s inputs its rTasks prefetch (module docstring). ``boxes``: a callable
    returning :func:`whole_reads` of its scheduled PrimFunc (parameters in the order of the call's
    arguments, then outputs), called only when an input is a weight; ``weights``: the graph's weight
    parameters (weights apart)."""
    candidates = [pos for pos, t in enumerate(node.inputs) if _is_weight(t, weights)]
    if not candidates:
        return ()
    whole = boxes()
    found = []
    for pos in candidates:
        t = node.inputs[pos]
        if pos >= len(whole) or not whole[pos] or any(node.inputs[p] == t for p in found):
            continue  # indirect, or a part of the tensor: not prefetched whole
        found.append(pos)
    return tuple(found)


def prefetch_fraction(nbytes: int, l2_bytes: int) -> float:
    """The part of each rTask's share of ``nbytes`` of weights that is prefetched: all of it when
    they fit the cost model's ``l2_bytes``, else ``l2_bytes / nbytes`` (module docstring)."""
    return 1.0 if nbytes <= l2_bytes else l2_bytes / nbytes


def with_prefetch(op, node, boxes, weights: set, config, vdevice, resident: tuple = ()):
    """``op`` (an rOperator of ``node``) with its prefetched inputs (:func:`prefetched_inputs`;
    ``boxes``, ``weights`` as there) and every rKernel's ``prefetch_us``; ``op`` itself when
    nothing is prefetched."""
    cost = rkernels.cost_config(config, vdevice)
    positions = prefetched_inputs(node, boxes, weights)
    if not positions:
        return op
    fraction = prefetch_fraction(sum(_nbytes(node.inputs[p]) for p in positions),
                                 cost.l2_resident_bytes)
    # the code prefetches every one (the same kernel whether the weights are embedded or apart);
    # the model overlaps only the DRAM reads: a resident input is an L2 read already
    nbytes = fraction * sum(_nbytes(node.inputs[p]) for p in positions if p not in resident)
    kernels = []
    for k in op.kernels:
        try:
            per_sm = vdevice.occupancy(k.threads, None, k.shared_bytes)
        except ValueError:
            kernels.append(k)
            continue
        read = weight_read_us(nbytes, k.num_rtasks, max(1, per_sm), cost)
        read = min(read, k.time_us - cost.per_rtask_overhead_us)
        kernels.append(dataclasses.replace(k, prefetch_us=read) if read > 0 else k)
    return dataclasses.replace(op, kernels=kernels, prefetch_inputs=positions,
                               prefetch_fraction=fraction)


def prefetch_ranges(graph, node_ids, ops: dict, selected: dict, tensors) -> dict:
    """op uid -> (rTasks of its selected rKernel, ``((byte offset, bytes), ...)`` of its prefetched
    inputs in the weights blob, the part of each rTask's share prefetched
    (``ROperator.prefetch_fraction``)), for the operators of one rProgram whose rKernel
    prefetches."""
    found = {}
    for op in node_ids:
        kernel = ops[op].kernels[selected[op]]
        positions = getattr(ops[op], "prefetch_inputs", ())
        if not positions:
            continue
        ranges = []
        for pos in positions:
            t = graph.nodes[op].inputs[pos]
            _, offset = tensors.where[t]
            if offset is not None:
                ranges.append((int(offset), _nbytes(t)))
        if ranges:
            found[op] = (kernel.num_rtasks, tuple(ranges),
                         getattr(ops[op], "prefetch_fraction", 1.0))
    return found
