"""Where the tensors of one rProgram live, and which operators share a kernel body.

Inputs: the rProgram's operators (dataflow-graph nodes) and their selected rKernels. Output: a
:class:`TensorPlan`:

* tensors read from outside stay kernel parameters, except constants, which are packed into one
  uint8 blob (a Relax constant); with the weights apart (``relay_passes.lift_weights``), weight
  parameters are packed alike, and the blob is computed by :func:`pack_func` from them (a call
  that LiftWeightTransforms moves into ``transform_params``): the same layout, the same kernel;
* tensors produced inside and read outside are kernel outputs of their own; tensors produced and
  consumed only inside live in one uint8 work arena (a kernel output nobody reads);
* an output written in place (a ``call_tir_inplace`` node, ``Node.inplace``) lives in the slot of
  the input it is written into: no slot of its own; read outside, it is listed in ``aliased``
  (the rProgram's call then aliases that output to the input argument);
* operators with the same rKernel become one dispatch entry as long as, at every parameter, they
  bind the same tensor or tensors of one arena (at offsets the program table carries); otherwise
  they are split into several entries. An unrolled LSTM's hundreds of identical cells thus share
  one kernel body, and so do the repeated blocks of a CNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relay_passes.lift_weights import weight_params

from .persistent import Binding, DispatchEntry, TensorSlot

ALIGN = 64  # bytes; every arena offset is a multiple of any dtype size


@dataclass
class TensorPlan:
    """Kernel parameters (slots), dispatch entries and per-operator arena offsets."""

    slots: list  # TensorSlot, inputs first
    num_inputs: int
    input_exprs: list  # Relax args for the non-constant input slots
    blob: np.ndarray | None  # constants, packed (the last input slot when present)
    outputs: list  # TensorRefs of the visible output slots, in order
    arena_bytes: int  # work arena size (the last output slot when > 0)
    entries: list  # DispatchEntry
    dispatch: dict  # op uid -> (entry index, arena offsets)
    where: dict = None  # TensorRef -> (slot, byte offset in its arena, or None for a slot of its own)
    packed: tuple = None  # weights apart: (blob bytes, [(TensorRef, byte offset)]), blob None
    aliased: tuple = ()  # (TensorRef read outside, input slot it was written into), in place


def _itemsize(dtype: str) -> int:
    return max(1, np.dtype(dtype).itemsize) if dtype != "bool" else 1


def _nbytes(tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * _itemsize(tensor.dtype)


def _layout(tensors) -> tuple:
    """{tensor: byte offset} with ALIGN-aligned offsets, and the total size."""
    offsets, size = {}, 0
    for t in tensors:
        offsets[t] = size
        size += -(-_nbytes(t) // ALIGN) * ALIGN
    return offsets, size


def _constant_bytes(tensor) -> np.ndarray:
    """The constant's bytes as a flat uint8 view of TVM's own buffer (no copy where DLPack can)."""
    value = tensor.expr.value
    try:
        array = np.from_dlpack(value)
    except (TypeError, RuntimeError, BufferError):
        array = value.numpy()
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def aligned_zeros(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array whose data starts on an ALIGN-byte boundary (what TVM needs to wrap
    it without a copy, ``tvm.runtime.from_dlpack``)."""
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start: start + nbytes]


def _split(groups, key):
    out = []
    for group in groups:
        parts = {}
        for op in group:
            parts.setdefault(key(op), []).append(op)
        out.extend(parts.values())
    return out


def plan_tensors(graph, node_ids: list, kernel_of: dict, blocks_of: dict | None = None) -> TensorPlan:
    """The TensorPlan of the rProgram made of ``node_ids``; ``kernel_of[op]`` is its LoweredKernel,
    ``blocks_of[op]`` the thread blocks one of its rTasks runs (default 1)."""
    blocks_of = blocks_of or {}
    members = set(node_ids)
    visible = set(graph.outputs_used_outside(members))
    for i in node_ids:  # a tuple-output binding is re-emitted whole when any part is read outside
        outs = graph.nodes[i].outputs
        if len(outs) > 1 and any(t in visible for t in outs):
            visible.update(outs)
    written_into = {}  # an output written in place -> the input tensor whose bytes it takes
    for i in node_ids:
        node = graph.nodes[i]
        for out, k in zip(node.outputs, node.inplace):
            written_into[out] = node.inputs[k]
    produced = list(dict.fromkeys(t for i in node_ids for t in graph.nodes[i].outputs
                                  if t not in written_into))
    inputs = list(dict.fromkeys(t for i in node_ids for t in graph.nodes[i].inputs
                                if t.producer not in members))
    weights = set(weight_params(graph.func))  # weights apart: packed as constants are
    constants = [t for t in inputs if t.is_constant or (t.producer is None and t.expr in weights)]
    direct_inputs = [t for t in inputs if t not in constants]
    if any(t not in direct_inputs for t in written_into.values()):
        raise ValueError("an operator writes in place into a constant or a tensor produced in its "
                         "rProgram; only a tensor passed in can be written in place")
    outputs = [t for t in produced if t in visible]
    internal = [t for t in produced if t not in visible]
    const_at, blob_bytes = _layout(constants)
    work_at, arena_bytes = _layout(internal)

    slots = [TensorSlot(f"in{k}", tuple(int(d) for d in t.shape), t.dtype)
             for k, t in enumerate(direct_inputs)]
    blob_slot = None
    if constants:
        blob_slot = len(slots)
        slots.append(TensorSlot("weights", (blob_bytes,), "uint8"))
    num_inputs = len(slots)
    slots += [TensorSlot(f"out{k}", tuple(int(d) for d in t.shape), t.dtype)
              for k, t in enumerate(outputs)]
    work_slot = None
    if internal:
        work_slot = len(slots)
        slots.append(TensorSlot("work", (arena_bytes,), "uint8"))

    direct_slot = {t: k for k, t in enumerate(direct_inputs)}
    direct_slot.update({t: num_inputs + k for k, t in enumerate(outputs)})

    def place(t):
        """(slot, byte offset or None) of a tensor."""
        t = written_into.get(t, t)
        if t in const_at:
            return blob_slot, const_at[t]
        if t in work_at:
            return work_slot, work_at[t]
        return direct_slot[t], None

    binds = {i: [*graph.nodes[i].inputs, *graph.nodes[i].outputs] for i in node_ids}
    by_kernel = {}
    for i in node_ids:
        by_kernel.setdefault((id(kernel_of[i]), blocks_of.get(i, 1)), []).append(i)
    groups = list(by_kernel.values())
    split = []
    for group in groups:
        parts = [group]
        for p in range(len(kernel_of[group[0]].params)):
            parts = _split(parts, lambda op, p=p: _class(place(binds[op][p])))
        split += parts
    groups = split

    entries, dispatch = [], {}
    for group in groups:
        kernel = kernel_of[group[0]]
        bindings, per_op = [], {op: [] for op in group}
        for p, param in enumerate(kernel.params):
            where = [place(binds[op][p]) for op in group]
            slot, offset = where[0]
            if offset is None:
                bindings.append(Binding(slot))
                continue
            size = _itemsize(str(param.dtype))
            if all(w == where[0] for w in where):
                bindings.append(Binding(slot, offset=offset // size))
                continue
            bindings.append(Binding(slot, table_pos=len(per_op[group[0]])))
            for op, (_, off) in zip(group, where):
                per_op[op].append(off // size)
        for op in group:
            dispatch[op] = (len(entries), tuple(per_op[op]))
        entries.append(DispatchEntry(kernel, tuple(bindings), blocks_of.get(group[0], 1)))

    blob, packed = None, None
    if any(not t.is_constant for t in constants):
        packed = (blob_bytes, [(t, const_at[t]) for t in constants])
    elif constants:
        blob = aligned_zeros(blob_bytes)
        for t in constants:
            raw = _constant_bytes(t)
            blob[const_at[t]: const_at[t] + raw.size] = raw
    where = {t: place(t) for ts in binds.values() for t in ts}
    aliased = tuple((t, direct_slot[source]) for t, source in written_into.items() if t in visible)
    return TensorPlan(slots, num_inputs, [t.expr for t in direct_inputs], blob, outputs,
                      arena_bytes, entries, dispatch, where, packed, aliased)


def pack_func(parts: list, nbytes: int, threads: int | None = 256):
    """The GPU-scheduled PrimFunc ``(w_0, ..., w_n, blob)`` writing each tensor's bytes into the
    uint8 ``blob`` of ``nbytes`` at its offset (zeros between): what ``plan_tensors`` puts in a
    constants blob, computed from weight parameters. ``parts``: ``[(shape, dtype, offset)]``;
    ``threads`` None: unscheduled (for a CPU build)."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import s_tir, te, tirx  # pylint: disable=import-outside-toplevel

    holders = [te.placeholder([tirx.IntImm("int64", d) for d in shape], dtype, name=f"w{k}")
               for k, (shape, dtype, _) in enumerate(parts)]

    def byte(holder, shape, dtype, j):
        size = _itemsize(dtype)
        flat, index = j // size, []
        for d in reversed(shape):
            index.append(flat % d)
            flat = flat // d
        value = holder[tuple(reversed(index))]
        if size == 1:
            return tirx.Cast("uint8", value)
        bits = tirx.reinterpret(f"uint{8 * size}", value)
        return tirx.Cast("uint8", (bits >> tirx.Cast(f"uint{8 * size}", (j % size) * 8))
                         & tirx.const(255, f"uint{8 * size}"))

    def body(k):
        value = tirx.const(0, "uint8")
        for holder, (shape, dtype, offset) in reversed(list(zip(holders, parts))):
            size = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
            inside = tirx.all(k >= offset, k < offset + size)
            value = tirx.if_then_else(inside, byte(holder, shape, dtype, k - offset), value)
        return value

    out = te.compute([tirx.IntImm("int64", nbytes)], body, name="T_pack_weights")
    if threads is None:
        return te.create_prim_func([*holders, out])
    sch = s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([*holders, out])}))
    (loop,) = sch.get_loops(sch.get_sblock("T_pack_weights"))
    bx, tx = sch.split(loop, factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _class(where) -> tuple:
    """Parameters of one entry may differ in arena offsets, never in their slot."""
    slot, offset = where
    return (slot, offset is not None)
