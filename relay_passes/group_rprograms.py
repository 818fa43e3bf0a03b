"""RammerGroupRPrograms: replace each rProgram's operators by ONE call_tir to its persistent kernel.

Input: a Relax module whose ``main`` is one dataflow block, and the rPrograms to emit
(:class:`RProgramCall`: which bindings, the persistent PrimFunc, its arguments and outputs), as the
back end (``tvm_rammer.driver.backend``) decided them. Output: the same module with the persistent PrimFuncs
added and, in ``main``, every rProgram's bindings replaced by one ``call_tir`` whose outputs take
over the tensors read outside the rProgram; other bindings are kept unchanged; dead code removed.
An rProgram with outputs written in place into its arguments (``RProgramCall.aliased``: a KV
cache written by ``call_tir_inplace``) is one ``call_tir_inplace`` instead, those outputs first,
each aliasing its argument (``inplace_indices``), the others -1 (the PrimFunc's own outputs, in
order; the timeline buffer stays the last).

A pure graph rewrite: no kernels are built, timed or chosen here. Bindings are re-emitted by level
(an rProgram at the level of its first operator) in a topological order of the segments, so every
input, and every symbolic shape variable (a ``R.match_cast``, re-emitted as one), is defined before
it is read.
Must run after dlight and before the dataflow lowering passes (it emits dataflow bindings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import tvm
from tvm import relax, tirx

from .dataflow_graph import DataflowGraph

__all__ = ["RProgramCall", "RammerGroupRPrograms"]


@dataclass(frozen=True)
class RProgramCall:
    """One rProgram for the rewrite.

    Attributes:
        name: name hint of the persistent PrimFunc.
        func: the persistent PrimFunc.
        nodes: indices of the bindings of ``main``'s dataflow block it replaces.
        args: the call_tir arguments (expressions of the block, or constants).
        outputs: ``DataflowGraph`` tensors read outside the rProgram, one call_tir output each.
        extra_outputs: TensorTypes of the outputs nobody reads outside (work arena, step state).
        level: the dataflow level of its first operator (where it is emitted).
        packs: ``(position in args, PrimFunc, its arguments, its output TensorType)`` per argument
            computed by a call of its own, emitted just before the rProgram (weights kept apart:
            the constants blob packed from the weight parameters; the arg there is a placeholder).
        aliased: ``(tensor, position in args)`` per tensor read outside that the rProgram wrote
            in place into that argument (no parameter of the PrimFunc of its own).
    """

    name: str
    func: tirx.PrimFunc
    nodes: tuple
    args: tuple
    outputs: tuple
    extra_outputs: tuple
    level: int
    packs: tuple = ()
    aliased: tuple = ()


def _static_shape(tensor) -> tuple:
    return tuple(int(d) for d in tensor.shape)


def _emit_order(graph: DataflowGraph, calls: Sequence[RProgramCall]) -> list:
    """Segments (rPrograms and leftover bindings) in an order where every input is defined first.

    By (level, leftover before rProgram before alias, index) among the segments whose inputs are all
    defined: the plain sort by that key whenever it is already a valid order (rPrograms that follow
    the waves), and still a valid one when a policy's rProgram holds an operator of a lower level
    than an operator of an earlier rProgram (IOS stages, Opara's launch order)."""
    import heapq

    levels = graph.levels()
    owner: dict = {}
    keys, items = [], []
    for k, c in enumerate(calls):
        for i in c.nodes:
            owner[i] = len(items)
        keys.append((c.level, 1, k))
        items.append(("rprogram", c))
    for node in graph.nodes:
        if node.index in owner:
            continue
        owner[node.index] = len(items)
        keys.append((levels[node.index], 2 if node.kind == "alias" else 0, node.index))
        items.append(("node", node))
    bound_by = {node.var: node.index for node in graph.nodes}
    deps = [set() for _ in items]
    for node in graph.nodes:
        mine = owner[node.index]
        needs = set(node.preds)  # the producers, and the bindings whose vars name the tensors read
        needs.update(bound_by[t.expr] for t in node.inputs if t.expr in bound_by
                     and (t.producer is None or owner[t.producer] != mine))  # not: read inside
        deps[mine].update(owner[p] for p in needs if owner[p] != mine)
    users = [[] for _ in items]
    for seg, needs in enumerate(deps):
        for need in needs:
            users[need].append(seg)
    missing = [len(needs) for needs in deps]
    ready = [(keys[seg], seg) for seg in range(len(items)) if not missing[seg]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, seg = heapq.heappop(ready)
        order.append(items[seg])
        for user in users[seg]:
            missing[user] -= 1
            if not missing[user]:
                heapq.heappush(ready, (keys[user], user))
    if len(order) != len(items):
        raise ValueError("the rPrograms depend on each other in a cycle (one reads what a later one "
                         "writes and the other way round); give the rewrite rPrograms in an order "
                         "of the dataflow graph")
    return order


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Re-emits main's dataflow block: one call_tir per rProgram, other bindings unchanged."""

    def __init__(self, mod, graph, segments):
        super().__init__(mod)
        self.graph, self.segments = graph, segments
        self.done = False
        self.bound_aliases = set()  # alias vars an rProgram's call already bound

    def visit_var_binding_(self, binding):
        if self.done:
            return
        self.done = True
        for kind, item in self.segments:
            if kind == "rprogram":
                self._emit_rprogram(item)
            else:
                self._emit_node(item)

    def visit_match_cast_(self, binding):
        self.visit_var_binding_(binding)

    def _emit(self, var, value):
        bb = self.builder_
        new = bb.emit(value, name_hint=var.name) if isinstance(var, relax.DataflowVar) \
            else bb.emit_output(value, name_hint=var.name)
        self.set_var_remap(var, new)
        return new

    def _emit_node(self, node):
        binding = self.graph.block.bindings[node.index]
        if binding.var in self.bound_aliases:
            return
        value = self.visit_expr(binding.value)
        if isinstance(binding, relax.MatchCast):  # stays a match_cast: it defines shape variables
            self.builder_.emit_normalized(relax.MatchCast(binding.var, value, binding.ty))
            return
        self._emit(binding.var, value)

    def _emit_rprogram(self, rp: RProgramCall):
        bb = self.builder_
        gv = bb.add_func(rp.func, rp.name)
        args = [self.visit_expr(e) for e in rp.args]
        for pos, func, pack_args, out_ty in rp.packs:
            pack = bb.add_func(func, f"{rp.name}_pack_weights")
            args[pos] = bb.emit(relax.call_tir(pack, relax.Tuple([self.visit_expr(e) for e in pack_args]),
                                               out_ty), name_hint=f"{rp.name}_weights")
        out_sinfo = [relax.TensorType(_static_shape(t), t.dtype) for t, _ in rp.aliased]
        out_sinfo += [relax.TensorType(_static_shape(t), t.dtype) for t in rp.outputs]
        out_sinfo += list(rp.extra_outputs)
        new_of = {t: k for k, (t, _) in enumerate(rp.aliased)}
        new_of.update({t: len(rp.aliased) + k for k, t in enumerate(rp.outputs)})
        if rp.aliased:  # written in place: the first outputs, each one of the arguments
            inplace = [pos for _, pos in rp.aliased] + [-1] * (len(out_sinfo) - len(rp.aliased))
            value = relax.op.call_tir_inplace(gv, relax.Tuple(args), inplace, out_sinfo)
        else:
            value = relax.call_tir(gv, relax.Tuple(args), out_sinfo)
        call = bb.emit(value, name_hint=rp.name)
        new_of = {t: relax.TupleGetItem(call, k) for t, k in new_of.items()}
        for i in rp.nodes:
            node = self.graph.nodes[i]
            var = self.graph.block.bindings[i].var
            if all(t in new_of for t in node.outputs):
                items = [new_of[t] for t in node.outputs]
                self._emit(var, items[0] if len(items) == 1 else relax.Tuple(items))
                continue
            # a tuple-output operator only some of whose outputs are read outside (the rest
            # lives in the work arena): bind the vars that extract those outputs instead, and
            # skip their alias bindings (the tuple itself does not exist outside)
            for t in node.outputs:
                if t in new_of and isinstance(t.expr, relax.Var) and not t.expr.same_as(var):
                    self._emit(t.expr, new_of[t])
                    self.bound_aliases.add(t.expr)


@tvm.transform.module_pass(opt_level=0, name="RammerGroupRPrograms")
class RammerGroupRPrograms:
    """Replace the operators of each rProgram by one call_tir to its persistent kernel.

    Parameters
    ----------
    rprograms: the rPrograms to emit (no rProgram: the module is returned unchanged).
    """

    def __init__(self, rprograms: Sequence[RProgramCall]):
        self.rprograms = list(rprograms)
        seen = set()
        for rp in self.rprograms:
            if seen & set(rp.nodes):
                raise ValueError(f"rProgram {rp.name} replaces bindings {sorted(seen & set(rp.nodes))} "
                                 "that another rProgram replaces too")
            seen |= set(rp.nodes)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.rprograms:
            return mod
        graph = DataflowGraph.from_function(mod["main"], mod)
        for rp in self.rprograms:
            bad = [i for i in rp.nodes if not 0 <= i < len(graph.nodes)]
            if bad:
                raise ValueError(f"rProgram {rp.name} names bindings {bad}, but main's dataflow block "
                                 f"has {len(graph.nodes)}")
        rewriter = _Rewriter(mod, graph, _emit_order(graph, self.rprograms))
        main_gv = mod.get_global_var("main")
        new_main = rewriter.visit_expr(mod["main"])
        rewriter.builder_.update_func(main_gv, new_main)
        return relax.transform.DeadCodeElimination(["main"])(rewriter.builder_.get())
