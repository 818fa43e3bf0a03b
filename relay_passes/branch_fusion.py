"""BranchPreservingFusion: elementwise fusion that never joins two independent branches.

TVM's FuseOps fuses a branch-joining `Add(relu(x @ W0), relu(x @ W1))` into one branch, which makes
the other branch a dependency of that branch's kernel and serialises the two. Rammer wants both
branches in the same wave, so this pass fuses a consumer into its producer only when doing so
delays nothing: every other input of the consumer is ready one wave earlier.

Two cases get what TVM's default pipeline does instead, since they can never become rTasks or would
cost launches for nothing:

* bindings with symbolic shapes or tir_vars (never placeable): fused by TVM's own ``FuseOps``,
  with every static call_tir hidden from it (marked opaque for the duration) except those read by
  such bindings only;
* a tuple-output call_tir whose outputs are not all read (BatchNormalization's running mean and
  variance, Dropout's mask): it becomes a group of its own that returns only the outputs read, so
  FuseTIR drops the computation of the others, as TVM's FuseOps + FuseTIR do.
"""
import tvm
from tvm import relax

from .dataflow_graph import CALL_TIR, DataflowGraph, has_tir_vars

ELEMWISE, BROADCAST, INJECTIVE, COMM_REDUCE, OUT_EWISE_FUSABLE, OPAQUE = 0, 1, 2, 3, 4, 8
FUSABLE_PRODUCER = (ELEMWISE, BROADCAST, INJECTIVE, COMM_REDUCE, OUT_EWISE_FUSABLE)
MAX_NAME_LEN = 64


@tvm.transform.module_pass(opt_level=0, name="BranchPreservingFusion")
class BranchPreservingFusion:
    """Group call_tir bindings of `main` into fused Relax functions without joining branches.

    In: an IRModule whose `main` is one DataflowBlock of `R.call_tir` bindings to PrimFuncs that
    carry an `op_pattern` attr (after LegalizeOps, AnnotateTIROpPattern, FoldConstant).
    Out: the same module where every group of two or more call_tirs became a private Relax function
    with attr "Primitive" (its body: the group's call_tirs in a dataflow block, its params: the
    group's external inputs, constants included), called once from `main` where the group's last
    member was. FuseTIR then merges each group into one PrimFunc; dlight schedules it afterwards.

    A consumer C (op_pattern elementwise/broadcast, or injective or a reduction when the group so
    far is at most injective) joins the group of its producer P only when (a) P's output is read by
    C alone and is not a block output, and (b) every other non-constant input of C is a function
    parameter or is produced at a level strictly lower than P's group (levels are recomputed over
    the groups). One exception to (b): a C that joins two or more groups of elementwise/broadcast/
    injective operators reading only parameters and constants (each read by C alone) absorbs them
    all; they delay nothing.

    Two more joins fuse an elementwise function of ONE tensor, which no other branch feeds:

    * a diamond: a C of elementwise/broadcast pattern that reads two or more groups of
      elementwise/broadcast operators (each read by C alone) which, with C, read no produced tensor
      but one, ``x`` (besides constants and parameters), absorbs them all: tanh-GELU's
      ``(0.5 * x) * (1 + tanh(k * (x + c * x^3)))`` and SiLU's ``x * sigmoid(x)`` are one group;
    * into the source (with ``epilogues``, the default): a group of elementwise/broadcast operators
      that holds every reader of ``x`` (not a block output) joins the group whose last member
      produced ``x`` (its epilogue: the GELU after a decode step's fc1 GEMV), when every other
      produced tensor it reads comes from a level strictly lower than that group's; so does an
      earlier pass's Primitive function of elementwise call_tirs (BERT's erf-GELU, which
      SplitTailFusion groups), its call_tirs inlined.

    Both delay nothing: the merged group needs nothing the source group did not need, and nothing
    else reads ``x`` (so no branch waits on the whole group instead of ``x``).

    With ``prologues`` (the default), a group of elementwise/broadcast call_tirs whose output only a
    conv/matmul group's first member reads then joins that group in front (a prologue: NASNet's
    ReLU before each separable conv, which cannot fuse into its producer because the producer's
    output feeds several branches), under the same rule: every other non-constant input of the
    merged group is produced at a level strictly lower than the prologue's group. A call of a
    Primitive function of elementwise/broadcast call_tirs (one made before this pass: an earlier
    pass's group, SplitTailFusion's ``silu(gate) * up`` in a Llama MLP) is such a prologue too;
    its call_tirs are inlined into the merged group.

    Declines (leaves unfused): bindings that are not call_tir, call_tirs with tuple outputs,
    callees without op_pattern or with an opaque pattern. call_tirs with tir_vars or symbolic shapes
    are fused by TVM's FuseOps among themselves (never with a static call_tir). A tuple-output
    call_tir with unread outputs becomes a one-member group returning only the outputs read.
    Functions other than `main` are left alone. Must run after LegalizeOps + AnnotateTIROpPattern +
    FoldConstant and before FuseTIR and dlight; it replaces FuseOps in the rammer pipeline.
    """

    def __init__(self, prologues: bool = True, epilogues: bool = True):
        self.prologues, self.epilogues = prologues, epilogues

    def transform_module(self, mod, ctx):
        """Plan groups on main's dataflow graph and emit one fused function per group."""
        if "main" not in [str(gv.name_hint) for gv in mod.functions]:
            return mod
        try:
            graph = DataflowGraph.from_function(mod["main"], mod)
        except ValueError:  # control flow in main: no waves to protect, TVM's own fusion applies
            return tvm.relax.transform.FuseOps()(mod)
        if any(n.kind == "call_tir" and not _static_call(n) for n in graph.nodes):
            mod = _fuse_dynamic_like_tvm(mod, graph)
            graph = DataflowGraph.from_function(mod["main"], mod)
        groups = [g for g in plan_groups(graph, self.prologues, self.epilogues) if len(g) > 1 or _unread_outputs(graph, g[0])]
        if not groups:
            return mod
        return _emit_groups(mod, graph, groups)


def _static_call(node):
    """A call_tir without tir_vars whose inputs and outputs all have static shapes."""
    if node.kind != "call_tir" or has_tir_vars(node.value):
        return False
    return all(t.shape is not None and all(isinstance(d, int) for d in t.shape)
               for t in node.inputs + node.outputs)


def _feeds_only_dynamic(graph, node):
    """A static call_tir whose outputs only non-static call_tirs read (it could be an rTask, but
    its readers cannot, so TVM may as well fuse it into them)."""
    readers = [c for t in node.outputs for c in graph.consumers(t)]
    if not readers or any(graph.is_graph_output(t) for t in node.outputs):
        return False
    return all(graph.nodes[c].kind == "call_tir" and not _static_call(graph.nodes[c])
               for c in readers)


def _fuse_dynamic_like_tvm(mod, graph):
    """TVM's FuseOps over the call_tirs that are not static (and the static ones that only they
    read); the other static ones are hidden from it (op_pattern opaque while it runs, restored
    afterwards)."""
    hidden = {}
    for node in graph.nodes:
        if not _static_call(node) or _feeds_only_dynamic(graph, node):
            continue
        if node.gvar in mod.functions and node.gvar not in hidden:
            func = mod[node.gvar]
            if isinstance(func, tvm.tirx.PrimFunc):
                hidden[node.gvar] = func
    masked = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(
        dict(mod.functions_items()), attrs=mod.attrs)
    for gvar, func in hidden.items():
        masked[gvar] = func.with_attr("op_pattern", OPAQUE)
    fused = tvm.relax.transform.FuseOps()(masked)
    if {gv.name_hint for gv in fused.get_global_vars()} == {gv.name_hint for gv in mod.get_global_vars()}:
        return mod  # FuseOps made no group
    for gvar, func in hidden.items():
        if gvar in fused.functions:
            fused[gvar] = func
    return fused


def _is_read(graph, tensor):
    """Whether a block output or a non-alias binding reads ``tensor`` (aliases are looked through)."""
    return graph.is_graph_output(tensor) or any(
        graph.nodes[c].kind != "alias" for c in graph.consumers(tensor))


def _unread_outputs(graph, index):
    """For a static tuple-output call_tir whose tuple var is only read through TupleGetItem
    bindings: the positions of its outputs nobody reads (else [])."""
    node = graph.nodes[index]
    if node.kind != "call_tir" or len(node.outputs) < 2 or not _static_call(node):
        return []
    if _op_pattern(node, graph.mod) == OPAQUE:
        return []
    if not isinstance(node.var, relax.DataflowVar):
        return []
    readers = sorted({c for t in node.outputs for c in graph.consumers(t)})
    for c in readers:  # every binding naming the tuple var reads its tensors: it is among these
        value = getattr(graph.block.bindings[c], "value", None)
        direct = isinstance(value, relax.TupleGetItem) and value.tuple_value.same_as(node.var)
        if not direct and any(v.same_as(node.var) for v in relax.analysis.free_vars(value)):
            return []
    return [k for k, t in enumerate(node.outputs) if not _is_read(graph, t)]


def callee_pattern(mod, gvar):
    """The op_pattern attr of the PrimFunc ``gvar``, or OPAQUE when it has none."""
    if gvar not in mod.functions:
        return OPAQUE
    attrs = mod[gvar].attrs
    if attrs is None or "op_pattern" not in attrs:
        return OPAQUE
    return int(attrs["op_pattern"])


def _op_pattern(node, mod):
    """The callee's op_pattern attr, or OPAQUE when it has none or the node is not a call_tir."""
    return callee_pattern(mod, node.gvar) if node.kind == "call_tir" else OPAQUE


def _fusable_call(node, mod):
    """True for a call_tir with one static tensor output, no tir_vars, and a known op_pattern."""
    if node.kind != "call_tir" or len(node.outputs) != 1:
        return False
    if has_tir_vars(node.value) or isinstance(node.var.ty, relax.TupleType):
        return False
    if any(t.shape is None or not all(isinstance(d, int) for d in t.shape)
           for t in node.inputs + node.outputs):
        return False
    return _op_pattern(node, mod) != OPAQUE


class _Group:
    """A fusion group under construction: its id, members in binding order, level and pattern."""

    def __init__(self, gid, root, level, pattern):
        self.gid, self.members, self.level, self.pattern = gid, [root], level, pattern


def _can_join(consumer_pattern, group):
    """The op_pattern rule (FuseOps'): elementwise/broadcast into any fusable group, injective or a
    reduction into an elementwise/broadcast/injective group (the reduction's prologue)."""
    if group.pattern not in FUSABLE_PRODUCER:
        return False
    if consumer_pattern in (ELEMWISE, BROADCAST):
        return True
    return consumer_pattern in (INJECTIVE, COMM_REDUCE) and group.pattern <= INJECTIVE


def _cheap_join(node, graph, group_of, groups, mod):
    """The groups a join may absorb although they are separate branches: two or more groups of
    elementwise/broadcast/injective operators that read only function parameters and constants
    (level 0: they delay nothing, and data movement like Sum's broadcast-and-stack costs less
    inlined than as kernels of its own), each read by ``node`` alone. None otherwise."""
    produced = [t for t in node.inputs if t.producer is not None]
    found = []
    for t in produced:
        group = groups[group_of[t.producer]]
        if group.level != 0 or group.pattern > INJECTIVE or group.members[-1] != t.producer:
            return None
        if graph.consumers(t) != [node.index] or graph.is_graph_output(t):
            return None
        if not _fusable_call(graph.nodes[t.producer], mod) or not _can_join(_op_pattern(node, mod), group):
            return None
        if group not in found:
            found.append(group)
    return found if len(found) >= 2 else None


def _producer_group(node, graph, group_of, groups, mod):
    """The group `node` may join under rules (a) and (b), or None."""
    produced = [t for t in node.inputs if t.producer is not None]
    if not produced:
        return None
    top = max(produced, key=lambda t: groups[group_of[t.producer]].level)
    group = groups[group_of[top.producer]]
    if any(t is not top and t != top and groups[group_of[t.producer]].level >= group.level
           for t in produced):
        return None
    if graph.consumers(top) != [node.index] or graph.is_graph_output(top):
        return None
    if group.members[-1] != top.producer or not _fusable_call(graph.nodes[top.producer], mod):
        return None
    return group if _can_join(_op_pattern(node, mod), group) else None


def _outside_inputs(graph, members):
    """The produced tensors (not parameters or constants) that ``members`` read from outside."""
    inside, found = set(members), []
    for i in members:
        for t in graph.nodes[i].inputs:
            if t.producer is not None and t.producer not in inside and t not in found:
                found.append(t)
    return found


def _read_by_only(graph, tensor, readers):
    """``tensor`` is not a block output and only nodes in ``readers`` read it (no alias)."""
    return not graph.is_graph_output(tensor) and all(c in readers for c in graph.consumers(tensor))


def _diamond_join(node, graph, group_of, groups, mod):
    """The groups ``node`` may absorb as the join of a diamond on one tensor (see the class
    docstring): two or more groups of elementwise/broadcast operators, each read by ``node`` alone
    through its last member's output, which with ``node`` read one produced tensor only. None
    otherwise."""
    if _op_pattern(node, mod) > BROADCAST:
        return None
    found = []
    for t in node.inputs:
        if t.producer is None:
            continue
        group = groups[group_of[t.producer]]
        if group.pattern > BROADCAST or group.members[-1] != t.producer \
                or not _read_by_only(graph, t, {node.index}):
            return None
        if group not in found:
            found.append(group)
    if len(found) < 2:
        return None
    members = [i for g in found for i in g.members] + [node.index]
    return found if len(_outside_inputs(graph, members)) == 1 else None


def _source_group(group, graph, group_of, groups, mod):
    """The group ``group`` may join as its epilogue (see the class docstring), or None: ``group``
    is elementwise/broadcast, reads one tensor ``x`` whose readers it all holds and that the
    other group's last member produces, and its other produced inputs come from levels strictly
    lower than that group's. An earlier pass's group of elementwise call_tirs
    (``_elementwise_group_call``: SplitTailFusion's erf-GELU in BERT) counts as such a group."""
    if not group.members or (group.pattern > BROADCAST and not (
            len(group.members) == 1 and _elementwise_group_call(graph, graph.nodes[group.members[0]]))):
        return None
    members = set(group.members)
    for x in _outside_inputs(graph, group.members):
        source = groups[group_of[x.producer]]
        if source is group or source.pattern not in FUSABLE_PRODUCER \
                or source.members[-1] != x.producer \
                or not _fusable_call(graph.nodes[x.producer], mod) \
                or not _read_by_only(graph, x, members):
            continue
        others = [t for t in _outside_inputs(graph, group.members) if t != x]
        if all(groups[group_of[t.producer]].level < source.level for t in others):
            return source
    return None


def _absorb(target, other, group_of):
    """Move ``other``'s members into ``target`` (binding order kept); ``other`` is at most
    broadcast (an earlier pass's group of elementwise call_tirs counts as broadcast)."""
    target.members = sorted(target.members + other.members)
    target.pattern = max(target.pattern, min(other.pattern, BROADCAST))
    for i in other.members:
        group_of[i] = target.gid
    other.members = []


def plan_groups(graph, prologues=False, epilogues=True):
    """Fusion groups (lists of node indices, binding order) covering every non-alias node; with
    `prologues`, elementwise groups merged into the conv/matmul group that alone reads them; with
    `epilogues`, an elementwise function of one tensor merged into the tensor's producer group."""
    mod = graph.mod
    groups, group_of = [], {}
    for node in graph.nodes:
        if node.kind == "alias":
            continue
        group = _producer_group(node, graph, group_of, groups, mod) if _fusable_call(node, mod) else None
        joined = _cheap_join(node, graph, group_of, groups, mod) \
            if group is None and _fusable_call(node, mod) else None
        if group is None and joined is None and _fusable_call(node, mod):
            joined = _diamond_join(node, graph, group_of, groups, mod)
        if joined:
            group = joined[0]
            for other in joined[1:]:
                _absorb(group, other, group_of)
        if group is not None:
            group.members.append(node.index)
            group.pattern = max(group.pattern, _op_pattern(node, mod))
        else:
            level = 1 + max((groups[group_of[p]].level for p in node.preds), default=-1)
            pattern = _op_pattern(node, mod) if _fusable_call(node, mod) else OPAQUE
            group = _Group(len(groups), node.index, level, pattern)
            groups.append(group)
        group_of[node.index] = group.gid
        source = _source_group(group, graph, group_of, groups, mod) if epilogues else None
        if source is not None:
            _absorb(source, group, group_of)
    if prologues:
        _merge_prologues(graph, groups, group_of)
    return [sorted(g.members) for g in groups if g.members]


def _elementwise_group_call(graph, node):
    """The bindings of the Primitive function ``node`` calls when they are all call_tirs of
    elementwise/broadcast PrimFuncs and ``node`` has one static tensor output; else None."""
    op = getattr(node.value, "op", None)
    if node.kind != "opaque" or not isinstance(op, tvm.ir.GlobalVar) or op not in graph.mod.functions:
        return None
    func = graph.mod[op]
    if not isinstance(func, relax.Function) or func.attrs is None \
            or not bool(func.attrs.get("Primitive", False)) or len(node.outputs) != 1:
        return None
    shape = node.outputs[0].shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    bindings = [b for blk in func.body.blocks for b in blk.bindings]
    if not bindings or not all(isinstance(b.value, relax.Call) and b.value.op.same_as(CALL_TIR)
                               and callee_pattern(graph.mod, b.value.args[0]) <= BROADCAST
                               for b in bindings):
        return None
    return bindings


def _merge_prologues(graph, groups, group_of):
    """Move each elementwise group in front of the conv/matmul group that alone reads its output
    (see the class docstring); the merged group keeps the prologue's level."""
    mod = graph.mod
    for group in groups:
        if not group.members or (group.pattern > BROADCAST and not (
                len(group.members) == 1
                and _elementwise_group_call(graph, graph.nodes[group.members[0]]))):
            continue
        out = graph.nodes[group.members[-1]].outputs[0]
        readers = {group_of[c] for c in graph.consumers(out) if graph.nodes[c].kind != "alias"}
        if len(readers) != 1 or graph.is_graph_output(out) or any(
                graph.nodes[c].kind == "alias" for c in graph.consumers(out)):
            continue
        target = groups[readers.pop()]
        root = graph.nodes[target.members[0]]
        if target is group or _op_pattern(root, mod) != OUT_EWISE_FUSABLE or \
                out not in root.inputs or not _fusable_call(root, mod):
            continue
        members = set(group.members) | set(target.members)
        outside = {group_of[t.producer] for i in members for t in graph.nodes[i].inputs
                   if t.producer is not None and t.producer not in members}
        if any(groups[g].level >= group.level for g in outside):
            continue
        target.members = sorted(members)
        target.level, target.pattern = group.level, max(target.pattern, min(group.pattern, BROADCAST))
        for i in group.members:
            group_of[i] = target.gid
        group.members = []


def _group_name(graph, members):
    """FuseOps-style name: fused_ + callee names, shortened for long groups."""
    names = [str(_callee(graph.nodes[i]).name_hint).removeprefix("fused_") for i in members]
    name = "fused_" + "_".join(names)
    if len(name) > MAX_NAME_LEN:
        name = f"fused_{names[0]}_{names[-1]}_{len(names)}ops"
    return name


def _callee(node):
    """The GlobalVar a call_tir or a call of a Primitive function calls."""
    return node.gvar if node.kind == "call_tir" else node.value.op


def _emit_inlined(bb, graph, node, local, last=False):
    """Emit the call_tirs of the Primitive function ``node`` calls (``_elementwise_group_call``)
    into the block being built, its parameters bound to ``local``'s vars; returns its result
    (the block's output when ``last``)."""
    callee = graph.mod[node.value.op]
    inner = {p: local[graph.tensor_of_expr(a)] for p, a in zip(callee.params, node.value.args)}
    bindings = _elementwise_group_call(graph, node)
    for k, b in enumerate(bindings):
        args = [inner[a] if isinstance(a, relax.Var) else a for a in b.value.args[1].fields]
        call = relax.call_tir(b.value.args[0], relax.Tuple(args), out_ty=b.var.ty)
        output = last and k == len(bindings) - 1
        inner[b.var] = bb.emit_output(call) if output else bb.emit(call, str(b.var.name))
    return inner[callee.body.body]


def _external_inputs(graph, members):
    """Tensors the group reads but does not produce, in first-use order."""
    inside, ext = set(members), []
    for i in members:
        for t in graph.nodes[i].inputs:
            if t.producer not in inside and t not in ext:
                ext.append(t)
    return ext


def _emit_group_function(bb, graph, members, name, kept=None):
    """Add the private Primitive function of one group to `bb`; returns (gvar, external inputs).
    ``kept``: for a one-member group of a tuple-output call_tir, the output positions it returns."""
    ext = _external_inputs(graph, members)
    params, n_const = [], 0
    for t in ext:
        params.append(relax.Var(f"param_{n_const}" if t.is_constant else str(t.expr.name), t.ty))
        n_const += t.is_constant
    local = {t: p for t, p in zip(ext, params)}
    with bb.function(name, params, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            for pos, i in enumerate(members):
                node = graph.nodes[i]
                if node.kind != "call_tir":  # an earlier pass's group: its call_tirs inlined
                    var = _emit_inlined(bb, graph, node, local, last=pos == len(members) - 1)
                    local[node.outputs[0]] = var
                    continue
                args = relax.Tuple([local[t] for t in _arg_tensors(graph, node.value)])
                out_ty = node.var.ty
                out_ty = list(out_ty.fields) if isinstance(out_ty, relax.TupleType) else out_ty
                new_call = relax.call_tir(node.gvar, args, out_ty=out_ty)
                last = pos == len(members) - 1
                if kept is not None:
                    whole = bb.emit(new_call, str(node.var.name))
                    items = [relax.TupleGetItem(whole, k) for k in kept]
                    var = bb.emit_output(items[0] if len(items) == 1 else relax.Tuple(items))
                    break
                var = bb.emit_output(new_call) if last else bb.emit(new_call, str(node.var.name))
                local[node.outputs[0]] = var
        gvar = bb.emit_func_output(var)
    return gvar, ext


def _repoint(binding, pruned, unread_vars):
    """``binding`` with a ``TupleGetItem`` of a pruned tuple var re-pointed at the kept outputs;
    None for a binding that names a dropped output (only aliases nobody reads can: they go too)."""
    value = getattr(binding, "value", None)
    if isinstance(binding, relax.VarBinding) and unread_vars and any(
            v in unread_vars for v in relax.analysis.free_vars(value)):
        return None
    if not (isinstance(value, relax.TupleGetItem) and value.tuple_value in pruned):
        return binding
    var, kept = pruned[value.tuple_value]
    index = int(value.index)
    if index not in kept:
        return None
    new = var if len(kept) == 1 else relax.TupleGetItem(var, kept.index(index))
    return relax.VarBinding(binding.var, new)


def _arg_tensors(graph, call):
    """The TensorRefs of a call_tir's argument tuple, in argument order."""
    return [graph.tensor_of_expr(a) for a in call.args[1].fields]


def _emit_groups(mod, graph, groups):
    """Rewrite `main`: drop grouped bindings, call each group's function at its last member."""
    bb = relax.BlockBuilder(mod)
    replace, dropped, pruned = {}, set(), {}
    for members in groups:
        kept = None
        if len(members) == 1:  # a tuple-output call_tir returning only the outputs read
            unread = _unread_outputs(graph, members[0])
            kept = [k for k in range(len(graph.nodes[members[0]].outputs)) if k not in unread]
        gvar, ext = _emit_group_function(bb, graph, members, _group_name(graph, members), kept)
        last = members[-1]
        replace[last] = bb.normalize(relax.Call(gvar, [t.expr for t in ext]))
        dropped.update(members[:-1])
        if kept is not None:
            pruned[graph.nodes[last].var] = kept
    bindings, unread_vars = [], set()
    for i, b in enumerate(graph.block.bindings):
        if i in replace:
            var = b.var
            if var in pruned:
                var = relax.DataflowVar(str(b.var.name), replace[i].ty)
                pruned[b.var] = (var, pruned[b.var])
            bindings.append(relax.VarBinding(var, replace[i]))
        elif i not in dropped:
            new = _repoint(b, pruned, unread_vars)
            if new is None:
                unread_vars.add(b.var)
            else:
                bindings.append(new)
    main = graph.func
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    new_main = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    bb.update_func(mod.get_global_var("main"), new_main)
    out = bb.finalize()
    inlined = {graph.nodes[i].value.op for members in groups for i in members
               if graph.nodes[i].kind != "call_tir" and len(members) > 1}
    still_called = set()
    relax.analysis.post_order_visit(new_main, lambda e: still_called.add(e)
                                    if isinstance(e, tvm.ir.GlobalVar) else None)
    gone = inlined - still_called
    if gone:
        out = tvm.IRModule({gv: f for gv, f in out.functions_items() if gv not in gone},
                           attrs=out.attrs)
    return out
