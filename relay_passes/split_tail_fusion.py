"""SplitTailFusion: the elementwise tail that follows a split becomes one dependent kernel.

An LSTM step splits its gate pre-activations into four parts and runs a tail of about a dozen
elementwise operators on them (Sigmoid/Tanh per gate, the cell update c' = f*c + i*g, then
h' = o*tanh(c')). BranchPreservingFusion only fuses single-consumer chains, so the tail stays five
dependent kernels, each an rTask behind a barrier wait on the recurrent critical path. The tail
forks from one tensor and reads nothing produced later than that tensor, so fusing all of it
delays nothing: this pass makes it one dependent step.

Which nodes form a tail. A *seed* is a tensor T read by two or more call_tirs that are all
elementwise, broadcast or injective (the parts of a split, ``SplitToSlices``'s strided slices, are
the common case). The tail grows from T's consumers:

* downwards: a fusable (elementwise/broadcast/injective) consumer of a tail member joins when every
  other input it reads is a constant, a parameter or produced at a level lower than every member's
  level (so nothing in the tail waits longer than it did before);
* upwards: the fusable producer of a tensor that only tail members read (``gates = mx + mh``
  above the split) joins under the same rule, unless it is a matmul's or conv's epilogue (an
  elementwise op on that operator's output, read by it alone, and on constants): that one fuses
  into the operator (BranchPreservingFusion), which keeps the tail's inputs fewer.

A tail is never joined to an independent branch: every input from outside the tail was ready
before the tail's first member could start, which is BranchPreservingFusion's rule (fusion must not
serialise parallel work) applied to a fan-out instead of a chain.

What is emitted. A fused function with several outputs would be one PrimFunc that dlight schedules
as one kernel per output block, which cannot be one rOperator (the reason SplitToSlices exists).
So each tensor that leaves the tail (read outside it, or a block output) gets its own fused group:
the tail members it depends on, recomputed where two outputs share them (c' inside h's group). The
groups of one tail are independent of each other and sit at the same level: the tail is one
dependent step with one operator per output. A tail whose recomputation would more than double its
operator count (``MAX_RECOMPUTE``) is left alone.

In: an IRModule whose ``main`` is one DataflowBlock of call_tirs with ``op_pattern`` attrs (after
LegalizeOps, AnnotateTIROpPattern and FoldConstant). Out: the same module where each tail group of
two or more call_tirs is a private Relax function with attr "Primitive" (as BranchPreservingFusion
emits them), called where the group's output was bound. Declines the nodes BranchPreservingFusion
declines (non-call_tir bindings, tir_vars, symbolic shapes, tuple outputs, opaque patterns) and a
main that is not one dataflow block. Must run after FoldConstant and before BranchPreservingFusion
(which fuses the single-consumer chains left over, and leaves these groups alone) and FuseTIR.
"""
import tvm
from tvm import relax

from .branch_fusion import (INJECTIVE, OUT_EWISE_FUSABLE, _emit_group_function, _fusable_call,
                            _group_name, _op_pattern)
from .dataflow_graph import DataflowGraph
from .lift_weights import weight_params
from .unused_bindings import remove_unused_bindings

MAX_RECOMPUTE = 2.0


@tvm.transform.module_pass(opt_level=0, name="SplitTailFusion")
class SplitTailFusion:
    """Fuse the elementwise/injective tail after a split into one group per tail output (see the
    module docstring)."""

    def transform_module(self, mod, ctx):
        """Find the tails of main's dataflow graph and emit one fused function per tail output."""
        graph = DataflowGraph.of_main(mod)
        if graph is None:  # no main, or control flow in it: nothing to fuse
            return mod
        groups = [g for tail in find_tails(graph) for g in tail_groups(graph, tail)]
        if all(len(g) == 1 for g in groups):
            return mod
        return _emit(mod, graph, groups)


def _tail_member(node, mod):
    """True for a call_tir that may join a tail: fusable and at most injective."""
    return _fusable_call(node, mod) and _op_pattern(node, mod) <= INJECTIVE


def _readers(graph, tensor):
    """Non-alias nodes that read `tensor` (aliases name the same TensorRef as their source)."""
    return [c for c in graph.consumers(tensor) if graph.nodes[c].kind != "alias"]


class _Tail:
    """A tail under construction: its member node indices and the levels its rule compares."""

    def __init__(self, graph, levels, members):
        self.graph, self.levels = graph, levels
        self.members = set(members)

    def external_level(self, members):
        """The highest level at which a tensor read by `members` from outside them is produced
        (-1 when they read only parameters and constants)."""
        level = -1
        for i in members:
            for t in self.graph.nodes[i].inputs:
                if t.producer is not None and t.producer not in members:
                    level = max(level, self.levels[t.producer])
        return level

    def may_add(self, index):
        """The rule: with `index` added, every outside input is produced below every member."""
        members = self.members | {index}
        return self.external_level(members) < min(self.levels[i] for i in members)


def find_tails(graph):
    """Tails (sorted lists of node indices), each grown from one seed tensor; disjoint."""
    mod, levels = graph.mod, graph.levels()
    eligible = {node.index for node in graph.nodes if _tail_member(node, mod)}  # asked again and again
    taken, tails = set(), []
    seeds = [t for node in graph.nodes if node.kind == "call_tir" for t in node.outputs]
    weights = set(weight_params(graph.func))  # weights kept apart seed nothing, as constants
    seeds = [graph.tensor_of_expr(t) for t in graph.func.params if t not in weights] + seeds
    for tensor in seeds:
        readers = _readers(graph, tensor)
        if len(readers) < 2 or any(r in taken or r not in eligible for r in readers):
            continue
        tail = _Tail(graph, levels, readers)
        if tail.external_level(tail.members) >= min(levels[i] for i in tail.members):
            continue
        _grow(tail, taken, eligible)
        taken |= tail.members
        tails.append(sorted(tail.members))
    return tails


def _is_epilogue(graph, index):
    """True for an elementwise node reading one conv/matmul output that nothing else reads, and
    otherwise constants or parameters only: it belongs to that operator (bias, activation)."""
    produced = [t for t in graph.nodes[index].inputs if t.producer is not None]
    if len(produced) != 1:
        return False
    producer = graph.nodes[produced[0].producer]
    return (_op_pattern(producer, graph.mod) == OUT_EWISE_FUSABLE
            and _readers(graph, produced[0]) == [index]
            and not graph.is_graph_output(produced[0]))


def _grow(tail, taken, eligible):
    """Add producers above and consumers below until neither rule admits another node
    (``eligible``: the indices of the nodes that may join a tail, ``_tail_member``)."""
    graph = tail.graph
    changed = True
    while changed:
        changed = False
        for i in sorted(tail.members):
            node = graph.nodes[i]
            candidates = []
            for t in node.inputs:  # upwards: a producer only the tail reads
                p = t.producer
                if p is not None and p not in tail.members and not graph.is_graph_output(t) \
                        and all(r in tail.members for r in _readers(graph, t)) \
                        and not _is_epilogue(graph, p):
                    candidates.append(p)
            for t in node.outputs:  # downwards: a consumer reading early inputs only
                candidates += [c for c in _readers(graph, t) if c not in tail.members]
            for c in candidates:
                if c in taken or c in tail.members or c not in eligible:
                    continue
                if tail.may_add(c):
                    tail.members.add(c)
                    changed = True


def _outputs(graph, members):
    """Members whose output leaves the tail (read outside it, a block output, or read by none)."""
    inside = set(members)
    outs = []
    for i in members:
        t = graph.nodes[i].outputs[0]
        readers = _readers(graph, t)
        if graph.is_graph_output(t) or not readers or any(r not in inside for r in readers):
            outs.append(i)
    return outs


def tail_groups(graph, tail):
    """One group per tail output: the members it depends on, in binding order. [] when the
    recomputation would exceed MAX_RECOMPUTE times the tail's size."""
    inside = set(tail)
    groups = []
    for out in _outputs(graph, tail):
        group, todo = {out}, [out]
        while todo:
            for p in graph.nodes[todo.pop()].preds:
                if p in inside and p not in group:
                    group.add(p)
                    todo.append(p)
        groups.append(sorted(group))
    if sum(len(g) for g in groups) > MAX_RECOMPUTE * len(tail):
        return []
    return groups


def _emit(mod, graph, groups):
    """Rewrite main: each group's function is called where its output was bound (a group of one
    call_tir stays as it is); the other members are dropped (only tail members read them), and
    so are the alias bindings (Tuple, TupleGetItem) left reading them."""
    bb = relax.BlockBuilder(mod)
    replace, members, keep = {}, set(), set()
    for group in groups:
        members.update(group)
        if len(group) == 1:
            keep.add(group[0])
            continue
        gvar, ext = _emit_group_function(bb, graph, group, _group_name(graph, group))
        replace[group[-1]] = bb.normalize(relax.Call(gvar, [t.expr for t in ext]))
    bindings = []
    for i, b in enumerate(graph.block.bindings):
        if i in replace:
            bindings.append(relax.VarBinding(b.var, replace[i]))
        elif i not in members or i in keep:
            bindings.append(b)
    main = graph.func
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    new_main = remove_unused_bindings(
        relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs))
    bb.update_func(mod.get_global_var("main"), new_main)
    return bb.finalize()
