"""GEMVEpilogueFusion: an RNN cell's GEMV and its elementwise tail become one operator.

After SplitMatMulOverConcat and SplitTailFusion an LSTM step is two dependent operators: the
recurrent GEMV ``mh = h @ W_h`` and the tail that slices its gates and updates the cell
(``c' = f*c + i*g``, ``h' = o*tanh(c')``, one group per output). Each is an rTask behind a barrier
wait on the recurrent critical path. This pass makes the GEMV the tail's prologue: one operator
whose rTasks each compute the gate pre-activations of a few hidden units and then those units'
cell update (the issue's "epilogue into the GEMV"), so a step is one dependent rTask.

Which GEMVs. A *GEMV* is a call_tir of a plain matmul ``[1, K] x [K, N] -> [1, N]`` (one reduction
block ``C[i, j] += A[i, k] * B[k, j]``) whose weight ``B`` is a constant, or a fused group of one
and its elementwise epilogue on constants (``x @ W + b``). It may be fused when every reader of
its output is a fused group (or call_tir) of elementwise/injective operators whose outputs are
``[1, H]`` with ``N = P * H``, ``P >= 2`` (the tail of a split into P parts: an LSTM's four
gates), nothing else reads it, and the fused cell tiles into rTasks of whole warps within the
rTask thread cap (``tir_templates.gemv_epilogue.cell_tiling``; a tail that does not tile is left
as it is). A tail usually has several GEMVs (``x @ W_x + h @ W_h``): one of them is fused, the one
on the critical path, i.e. whose input is produced last (levels of the dataflow graph); among
equals, the *recurrent* one, whose weight some GEMV applies to an output of a tail that a GEMV
with that weight feeds (``h_t = tail(h_{t-1} @ W_h, ...)``). In LSTM-TC's wavefront ``h_{t-1}``
of a layer and ``h_t`` of the layer below are ready together, and the recurrent half is fused:
the input half, which depends only on the layer below, stays off the time direction's path
(SplitMatMulOverConcat's point). In Seq2Seq's decoder, whose steps are serial through its
layers, the input half (the layer below's output, or the top layer's previous output for layer 0)
is the one produced last, and it is fused.

Fusing delays nothing: the tail could not start before the GEMV's output, and the fused operator
needs only the GEMV's input on top of the tail's other inputs, which were ready no later.

What is emitted. The weight's columns are interleaved at compile time,
``W'[:, j*P + p] = W[:, p*H + j]``, so the P gate columns of hidden unit ``j`` are adjacent: a
thread block computing units ``[j0, j0 + U)`` reads one contiguous tile of ``P * U`` columns. The
fused Primitive function computes ``mh' = h @ W'``, restores the original column order with an
injective ``mh[0, p*H + j] = mh'[0, j*P + p]`` (FuseTIR inlines nothing yet; the schedule rule
``tir_templates.gemv_epilogue`` inlines it into the tail), runs the bodies of the tail's groups
with their common bindings computed once, and returns the groups' outputs as a tuple (the
output itself for a tail of one group). ``main`` calls it where the last group was called and
takes each group's output from the tuple. The function carries ``rammer.gemv_epilogue = P``;
FuseTIR keeps no function attributes, so the schedule rule recognises the fused PrimFunc by its
``T_deinterleave`` block.

With weights kept apart (``relay_passes.lift_weights``: ``main``'s parameters past ``num_input``
are weights), a weight parameter counts as a constant, and the interleave is a call_tir on it
(``interleave`` PrimFunc) at the top of ``main``, which the next LiftWeightTransforms moves into
``transform_params``.

In: an IRModule after BranchPreservingFusion (``main`` one dataflow block of call_tirs and calls
of Primitive functions). Out: the same module with each fused GEMV and its tail replaced as above;
unchanged when no GEMV qualifies. Must run before FuseTIR.
"""
from __future__ import annotations

import heapq

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, te, tirx

from tir_templates.gemv_epilogue import cell_tiling

from .branch_fusion import BROADCAST, INJECTIVE, callee_pattern
from .dataflow_graph import CALL_TIR, DataflowGraph
from .lift_weights import weight_params

__all__ = ["GEMVEpilogueFusion", "EPILOGUE_ATTR", "is_plain_matmul"]

EPILOGUE_ATTR = "rammer.gemv_epilogue"


@tvm.transform.module_pass(opt_level=0, name="GEMVEpilogueFusion")
class GEMVEpilogueFusion:
    """Fuse into each split tail the GEMV on its critical path (see the module docstring).
    ``max_threads``: the rTask thread cap the fused cell's rKernel must fit (``cell_tiling``)."""

    def __init__(self, max_threads: int = 256):
        self.max_threads = max_threads

    def transform_module(self, mod, ctx):
        """Find the fusable GEMVs of main and emit one fused function per GEMV and tail."""
        graph = DataflowGraph.of_main(mod)
        if graph is None:  # no main, or control flow in it: nothing to fuse
            return mod
        fusions = find_fusions(graph, self.max_threads)
        if not fusions:
            return mod
        return _emit(mod, graph, fusions)


def is_plain_matmul(func) -> bool:
    """True for a PrimFunc that is one block ``C[i, j] (+)= A[i, k] * B[k, j]`` over parameters
    ``(A, B, C)`` with ``A [1, K]``, ``B [K, N]``, ``C [1, N]`` (TVM's legalized ``R.matmul``)."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 3:
        return False
    a, b, c = func.params
    shapes = [[int(d) for d in p.ty.shape] if all(isinstance(d, tirx.IntImm) for d in p.ty.shape)
              else None for p in (a, b, c)]
    if None in shapes or any(len(shape) != 2 for shape in shapes) or shapes[0][0] != 1:
        return False
    (_, k), (k2, n), (one, n2) = shapes
    if k != k2 or n != n2 or one != 1:
        return False
    blocks = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, blocks.append)])
    blocks = [blk for blk in blocks if blk.iter_vars]  # the root block has none
    if len(blocks) != 1:
        return False
    block = blocks[0]
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    if sorted(kinds) != [0, 0, 2]:  # two data-parallel iters, one reduction (IterVar kinds)
        return False
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(c):
        return False
    value = store.value
    if not isinstance(value, tirx.Add) or not isinstance(value.b, tirx.Mul):
        return False
    loads = [value.a, value.b.a, value.b.b]
    if not all(isinstance(x, tvm.ir.TensorLoad) for x in loads):
        return False
    sources = [x.source for x in loads]
    if not (sources[0].same_as(c) and sources[1].same_as(a) and sources[2].same_as(b)):
        return False
    i, j = (iv.var for iv in block.iter_vars if int(iv.iter_type) == 0)
    (r,) = (iv.var for iv in block.iter_vars if int(iv.iter_type) == 2)
    want = [[i, j], [i, r], [r, j]]
    for load, idx in zip(loads, want):
        if len(load.indices) != 2 or not all(x.same_as(y) for x, y in zip(load.indices, idx)):
            return False
    return all(x.same_as(y) for x, y in zip(store.indices, [i, j]))


class _Gemv:
    """One GEMV node: its matmul PrimFunc, input tensor, weight constant, sizes and, for a fused group of a
    matmul and its elementwise epilogue (``x @ W + b``), the epilogue: ``(callee, args, type,
    name)`` per call_tir after the matmul, each arg ``("gemv", None)`` for the matmul's result,
    ``("prev", k)`` for the k-th epilogue result or ``("ext", TensorRef)`` for a tensor from
    outside (a constant bias)."""

    def __init__(self, node, matmul, input_, weight, epilogue=()):
        self.node, self.matmul, self.input, self.weight = node, matmul, input_, weight
        self.k, self.n = (int(d) for d in weight.shape)
        self.output = node.outputs[0]
        self.epilogue = list(epilogue)

    @property
    def constants(self):
        """The epilogue's tensors from outside, in first-use order."""
        found = []
        for _, args, _, _ in self.epilogue:
            found += [t for kind, t in args if kind == "ext" and t not in found]
        return found


def _plain(graph, gvar, checked):
    name = gvar.name_hint
    if name not in checked:
        checked[name] = is_plain_matmul(graph.mod[gvar])
    return checked[name]


def _group_bindings(mod, node):
    """The callee and the bindings (in order) of a call of a fused group function."""
    callee = mod[node.value.op]
    return callee, [b for blk in callee.body.blocks for b in blk.bindings]


def _is_weight(tensor, weights):
    """A constant, or one of main's weight parameters (weights kept apart)."""
    return tensor.is_constant or (tensor.producer is None and tensor.expr in weights)


def _group_gemv(graph, node, checked, weights=frozenset()):
    """The _Gemv of a fused group ``call_tir(matmul, (a, W))`` followed by elementwise or
    broadcast call_tirs on its result and constants (``x @ W_x + b``), or None."""
    if not _is_group_or_call_tir(graph, node) or node.kind == "call_tir":
        return None
    callee, bindings = _group_bindings(graph.mod, node)
    outer = {p: graph.tensor_of_expr(a) for p, a in zip(callee.params, node.value.args)}
    first = bindings[0].value if bindings else None
    if not (isinstance(first, relax.Call) and first.op.same_as(CALL_TIR)
            and _plain(graph, first.args[0], checked)):
        return None
    a, w = first.args[1].fields
    if a not in outer or w not in outer or not _is_weight(outer[w], weights):
        return None
    local = {bindings[0].var: ("gemv", None)}
    epilogue = []
    for b in bindings[1:]:
        value = b.value
        if not (isinstance(value, relax.Call) and value.op.same_as(CALL_TIR)):
            return None
        if callee_pattern(graph.mod, value.args[0]) > BROADCAST:  # an epilogue of the columns
            return None
        args = []
        for x in value.args[1].fields:
            if x in local:
                args.append(local[x])
            elif x in outer and _is_weight(outer[x], weights):
                args.append(("ext", outer[x]))
            else:
                return None
        local[b.var] = ("prev", len(epilogue))
        epilogue.append((value.args[0], args, b.var.ty, str(b.var.name)))
    if local.get(callee.body.body) != (("prev", len(epilogue) - 1) if epilogue else ("gemv", None)):
        return None
    return _Gemv(node, first.args[0], outer[a], outer[w], epilogue)


def _gemvs(graph):
    """node index -> _Gemv for every call_tir of a plain matmul with a constant weight, and every
    fused group of one and its elementwise epilogue."""
    found, checked = {}, {}
    weights = frozenset(weight_params(graph.func))
    for node in graph.nodes:
        if len(node.outputs) != 1:
            continue
        if node.kind == "call_tir":
            if len(node.inputs) == 2 and _is_weight(node.inputs[1], weights) \
                    and _plain(graph, node.gvar, checked):
                found[node.index] = _Gemv(node, node.gvar, node.inputs[0], node.inputs[1])
        elif node.kind == "opaque":
            gemv = _group_gemv(graph, node, checked, weights)
            if gemv is not None:
                found[node.index] = gemv
    return found


def _is_group_or_call_tir(graph, node):
    """A call_tir, or a call of a Primitive Relax function of call_tirs (a fused group)."""
    if node.kind == "call_tir":
        return True
    op = getattr(node.value, "op", None)
    if not isinstance(op, tvm.ir.GlobalVar) or op not in graph.mod.functions:
        return False
    func = graph.mod[op]
    return (isinstance(func, relax.Function) and func.attrs is not None
            and bool(func.attrs.get("Primitive", False)))


def _injective(graph, node):
    """Every call_tir of a reader (itself, or the members of its group) is at most injective:
    the fused rKernel inlines them all into its outputs."""
    if node.kind == "call_tir":
        calls = [node.gvar]
    else:
        _, bindings = _group_bindings(graph.mod, node)
        calls = [b.value.args[0] for b in bindings
                 if isinstance(b.value, relax.Call) and b.value.op.same_as(CALL_TIR)]
        if len(calls) != len(bindings):
            return False
    return all(callee_pattern(graph.mod, gvar) <= INJECTIVE for gvar in calls)


def _tail_of(graph, gemv):
    """(reader node indices, P) when every reader of the GEMV's output is a tail of a split into P
    parts (outputs [1, H], N = P * H, P >= 2), else None."""
    if graph.is_graph_output(gemv.output):
        return None
    readers = graph.consumers(gemv.output)
    if not readers:
        return None
    width = None
    for r in readers:
        node = graph.nodes[r]
        if node.kind == "alias" or len(node.outputs) != 1 or not _is_group_or_call_tir(graph, node) \
                or not _injective(graph, node):
            return None
        shape = node.outputs[0].shape
        if shape is None or len(shape) != 2 or shape[0] != 1 or not isinstance(shape[1], int):
            return None
        if width not in (None, shape[1]):
            return None
        width = shape[1]
    if gemv.n % width or gemv.n // width < 2:
        return None
    return sorted(readers), gemv.n // width


def _weight_key(tensor):
    """Identity of a constant weight (the same Constant object wherever it is passed)."""
    return tensor.expr.__hash__()


def find_fusions(graph, max_threads=256):
    """[(gemv, readers, P)] for every GEMV to fuse (see the module docstring), in binding order:
    per tail, the GEMV whose input is produced last, the recurrent one among equals, among those
    whose fused cell tiles into rTasks of at most ``max_threads`` threads (``cell_tiling``)."""
    gemvs = _gemvs(graph)
    tails = {i: _tail_of(graph, g) for i, g in gemvs.items()}
    tails = {i: t for i, t in tails.items() if t is not None}
    fed_by = {}  # tail output tensor -> weight keys of the GEMVs feeding that tail
    for i, (readers, _) in tails.items():
        for r in readers:
            fed_by.setdefault(graph.nodes[r].outputs[0], set()).add(_weight_key(gemvs[i].weight))
    recurrent = {_weight_key(g.weight) for g in gemvs.values()
                 if _weight_key(g.weight) in fed_by.get(g.input, ())}
    levels = graph.levels()

    def priority(i):
        gemv = gemvs[i]
        ready = -1 if gemv.input.producer is None else levels[gemv.input.producer]
        return (-ready, _weight_key(gemv.weight) not in recurrent, i)

    by_tail = {}
    for i, (readers, parts) in tails.items():
        by_tail.setdefault(tuple(readers), []).append(i)
    fusions, taken = [], set()
    for readers, candidates in sorted(by_tail.items(), key=lambda kv: min(kv[1])):
        if taken & set(readers):  # a reader of two different tails: fused once only
            continue
        parts = tails[candidates[0]][1]
        hidden = gemvs[candidates[0]].n // parts
        fits = [i for i in candidates if cell_tiling(hidden, parts, gemvs[i].k, max_threads)]
        if not fits:  # no rKernel of ours would run it as rTasks: leave the tail as it is
            continue
        taken |= set(readers)
        best = min(fits, key=priority)
        fusions.append((gemvs[best], list(readers), parts))
    return sorted(fusions, key=lambda f: f[0].node.index)


# --- emission -------------------------------------------------------------------------------

def interleave_columns(weight: np.ndarray, parts: int) -> np.ndarray:
    """``W'[:, j*P + p] = W[:, p*H + j]`` for ``W`` of shape ``[K, P*H]``."""
    k, n = weight.shape
    return np.ascontiguousarray(weight.reshape(k, parts, n // parts).transpose(0, 2, 1).reshape(k, n))


def _interleave_func(k, n, parts, dtype):
    """The PrimFunc of :func:`interleave_columns` on a ``[K, N]`` weight parameter (weights kept
    apart: it runs in ``transform_params``)."""
    width = n // parts
    shape = (tirx.IntImm("int64", k), tirx.IntImm("int64", n))
    w = te.placeholder(shape, dtype, name="w")
    out = te.compute(shape, lambda r, c: w[r, (c % parts) * width + c // parts],
                     name="T_interleave")
    func = te.create_prim_func([w, out]).without_attr("global_symbol")
    return func.with_attr("op_pattern", 2)


def _deinterleave_func(n, parts, dtype):
    """The injective PrimFunc ``out[0, p*H + j] = x[0, j*P + p]`` (``op_pattern`` injective)."""
    width = n // parts
    shape = (tirx.IntImm("int64", 1), tirx.IntImm("int64", n))  # as legalized operators' buffers
    x = te.placeholder(shape, dtype, name="x")
    out = te.compute(shape, lambda i, c: x[i, (c % width) * parts + c // width],
                     name="T_deinterleave")
    func = te.create_prim_func([x, out]).without_attr("global_symbol")
    return func.with_attr("op_pattern", 2)


class _FusedBuilder:
    """Builds one fused function: the GEMV, the de-interleave and the readers' bodies."""

    def __init__(self, bb, graph, gemv, readers, parts, weight_const, deinterleave):
        self.bb, self.graph, self.gemv = bb, graph, gemv
        self.readers, self.parts = readers, parts
        self.weight_const, self.deinterleave = weight_const, deinterleave

    def external(self):
        """Tensors from outside: the GEMV's input, its epilogue's constants, then the readers'
        inputs except the GEMV's output, in first-use order (the interleaved weight is passed
        after the GEMV's input)."""
        ext = [self.gemv.input, *[t for t in self.gemv.constants if t != self.gemv.input]]
        for r in self.readers:
            for t in self.graph.nodes[r].inputs:
                if t != self.gemv.output and t not in ext:
                    ext.append(t)
        return ext

    def emit(self, name):
        ext = self.external()
        params = [relax.Var("h" if k == 0 else f"param_{k}", t.ty) for k, t in enumerate(ext)]
        wparam = relax.Var("weight", self.weight_const.ty)
        local = {t: p for t, p in zip(ext, params)}
        memo = {}
        outputs = []
        gemv_node = self.gemv.node
        with self.bb.function(name, [params[0], wparam, *params[1:]], private=True,
                              attrs={"Primitive": True, EPILOGUE_ATTR: self.parts}):
            with self.bb.dataflow():
                out_ty = gemv_node.var.ty
                inter = self.bb.emit(relax.call_tir(self.gemv.matmul,
                                                    relax.Tuple([params[0], wparam]),
                                                    out_ty=out_ty), "interleaved")
                gates = self.bb.emit(relax.call_tir(self.deinterleave, relax.Tuple([inter]),
                                                    out_ty=out_ty), "gates")
                results = []
                for callee, args, ty, name in self.gemv.epilogue:  # x @ W + b: b after the matmul
                    actual = [gates if kind == "gemv" else results[x] if kind == "prev" else local[x]
                              for kind, x in args]
                    results.append(self._call(callee, actual, ty, name, memo))
                local[self.gemv.output] = results[-1] if results else gates
                for r in self.readers:
                    outputs.append(self._reader(self.graph.nodes[r], local, memo))
                result = self.bb.emit_output(outputs[0] if len(outputs) == 1 else relax.Tuple(outputs))
            gvar = self.bb.emit_func_output(result)
        return gvar, ext

    def _reader(self, node, local, memo):
        """Emit one reader's computation; returns the var holding its output."""
        if node.kind == "call_tir":
            args = [local[self.graph.tensor_of_expr(a)] for a in node.value.args[1].fields]
            return self._call(node.gvar, args, node.var.ty, str(node.var.name), memo)
        callee, bindings = _group_bindings(self.graph.mod, node)
        inner = {p: local[self.graph.tensor_of_expr(a)] for p, a in zip(callee.params, node.value.args)}
        for b in bindings:
            value = b.value
            if not (isinstance(value, relax.Call) and value.op.same_as(CALL_TIR)):
                raise ValueError(f"group {node.value.op.name_hint} holds a binding that is not a "
                                 "call_tir")
            args = [inner[a] if isinstance(a, relax.Var) else a for a in value.args[1].fields]
            inner[b.var] = self._call(value.args[0], args, b.var.ty, str(b.var.name), memo)
        return inner[callee.body.body]

    def _call(self, gvar, args, ty, name, memo):
        """One call_tir, computed once per (callee, arguments)."""
        key = (gvar.name_hint, tuple(a.__hash__() for a in args))
        if key not in memo:
            memo[key] = self.bb.emit(relax.call_tir(gvar, relax.Tuple(args), out_ty=ty), name)
        return memo[key]


def _emit(mod, graph, fusions):
    """Rewrite main: per fusion, one call of the fused function at the last reader; each reader's
    var becomes an item of its tuple; the GEMV's binding goes."""
    bb = relax.BlockBuilder(mod)
    interleaved, deinterleave = {}, {}
    replace, dropped = {}, set()
    first = []  # weights kept apart: their interleaves, bound first in main
    for gemv, readers, parts in fusions:
        key = _weight_key(gemv.weight)
        if key not in interleaved and not gemv.weight.is_constant:  # a weight parameter
            func = bb.add_func(_interleave_func(gemv.k, gemv.n, parts, gemv.weight.dtype),
                               "interleave")
            call = bb.normalize(relax.call_tir(func, relax.Tuple([gemv.weight.expr]),
                                               out_ty=gemv.weight.ty))
            interleaved[key] = relax.DataflowVar(f"{gemv.weight.expr.name}_interleaved", call.ty)
            first.append(relax.VarBinding(interleaved[key], call))
        if key not in interleaved:
            data = gemv.weight.expr.value.numpy()
            interleaved[key] = relax.const(interleave_columns(data, parts))
        shape_key = (gemv.n, parts, gemv.output.dtype)
        if shape_key not in deinterleave:
            deinterleave[shape_key] = bb.add_func(_deinterleave_func(*shape_key), "deinterleave")
        builder = _FusedBuilder(bb, graph, gemv, readers, parts, interleaved[key],
                                deinterleave[shape_key])
        callee = gemv.node.gvar if gemv.node.kind == "call_tir" else gemv.node.value.op
        name = f"fused_gemv_epilogue_{callee.name_hint}"
        gvar, ext = builder.emit(name)
        call = relax.Call(gvar, [ext[0].expr, interleaved[key], *[t.expr for t in ext[1:]]])
        replace[readers[-1]] = (bb.normalize(call), readers)
        dropped.add(gemv.node.index)
        dropped.update(readers[:-1])
    bindings = list(first)
    for i, b in enumerate(graph.block.bindings):
        if i in replace:
            call, readers = replace[i]
            if len(readers) == 1:  # one output: the call is bound where the reader was
                bindings.append(relax.VarBinding(b.var, call))
                continue
            tup = relax.DataflowVar(f"{b.var.name}_cell", call.ty)
            bindings.append(relax.VarBinding(tup, call))
            for k, r in enumerate(readers):
                bindings.append(relax.VarBinding(graph.nodes[r].var, relax.TupleGetItem(tup, k)))
        elif i not in dropped:
            bindings.append(b)
    bindings = _def_before_use(bindings)
    main = graph.func
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    new_main = relax.BlockBuilder().normalize(
        relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs))
    bb.update_func(mod.get_global_var("main"), new_main)
    out = bb.finalize()
    replaced = {graph.nodes[i].value.op for gemv, readers, _ in fusions
                for i in (gemv.node.index, *readers) if graph.nodes[i].kind != "call_tir"}
    still_called = set()
    relax.analysis.post_order_visit(new_main, lambda e: still_called.add(e)
                                    if isinstance(e, tvm.ir.GlobalVar) else None)
    for gvar in replaced - still_called:  # groups now inlined into the fused functions
        out = _without(out, gvar)
    return out


def _without(mod, gvar):
    """``mod`` without the function ``gvar``."""
    return tvm.IRModule({gv: f for gv, f in mod.functions_items() if not gv.same_as(gvar)},
                        attrs=mod.attrs)


def _def_before_use(bindings):
    """``bindings`` in an order where every var is bound before it is read, as close to the given
    order as possible (a reader moved to the fused call may have had readers before it)."""
    bound = {b.var for b in bindings}
    reads = [[v for v in relax.analysis.free_vars(b.value) if v in bound] for b in bindings]
    index = {b.var: k for k, b in enumerate(bindings)}
    if all(index[v] < k for k, vs in enumerate(reads) for v in vs):
        return bindings
    waiting = [len(set(vs)) for vs in reads]
    users = {}
    for k, vs in enumerate(reads):
        for v in set(vs):
            users.setdefault(index[v], []).append(k)
    ready = [k for k, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(bindings[k])
        for u in users.get(k, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(bindings):
        raise ValueError("GEMVEpilogueFusion: the rewritten bindings form a cycle")
    return order
