"""BranchPreservingFusion: elementwise fusion that never joins two independent branches.

TVM's FuseOps fuses a branch-joining `Add(relu(x @ W0), relu(x @ W1))` into one branch, which makes
the other branch a dependency of that branch's kernel and serialises the two. Rammer wants both
branches in the same wave, so this pass fuses a consumer into its producer only when doing so
delays nothing: every other input of the consumer is ready one wave earlier.
"""
import tvm
from tvm import relax

from .dataflow_graph import DataflowGraph, has_tir_vars

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

    A consumer C (op_pattern elementwise/broadcast, or injective when the group so far is at most
    injective) joins the group of its producer P only when (a) P's output is read by C alone and is
    not a block output, and (b) every other non-constant input of C is a function parameter or is
    produced at a level strictly lower than P's group (levels are recomputed over the groups).

    With ``prologues`` (the default), a group of elementwise/broadcast call_tirs whose output only a
    conv/matmul group's first member reads then joins that group in front (a prologue: NASNet's
    ReLU before each separable conv, which cannot fuse into its producer because the producer's
    output feeds several branches), under the same rule: every other non-constant input of the
    merged group is produced at a level strictly lower than the prologue's group.

    Declines (leaves unfused): bindings that are not call_tir, call_tirs with tir_vars, symbolic
    shapes or tuple outputs, callees without op_pattern or with an opaque pattern. Functions other
    than `main` are left alone. Must run after LegalizeOps + AnnotateTIROpPattern + FoldConstant and
    before FuseTIR and dlight; it replaces FuseOps in the rammer pipeline.
    """

    def __init__(self, prologues: bool = True):
        self.prologues = prologues

    def transform_module(self, mod, ctx):
        """Plan groups on main's dataflow graph and emit one fused function per group."""
        if "main" not in [str(gv.name_hint) for gv in mod.functions]:
            return mod
        try:
            graph = DataflowGraph.from_function(mod["main"], mod)
        except ValueError:  # control flow in main: no waves to protect, TVM's own fusion applies
            return tvm.relax.transform.FuseOps()(mod)
        groups = [g for g in plan_groups(graph, self.prologues) if len(g) > 1]
        if not groups:
            return mod
        return _emit_groups(mod, graph, groups)


def _op_pattern(node, mod):
    """The callee's op_pattern attr, or OPAQUE when it has none or the node is not a call_tir."""
    if node.kind != "call_tir" or node.gvar not in mod.functions:
        return OPAQUE
    attrs = mod[node.gvar].attrs
    if attrs is None or "op_pattern" not in attrs:
        return OPAQUE
    return int(attrs["op_pattern"])


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
    """The op_pattern rule: elementwise/broadcast into any fusable group, injective into an
    elementwise/broadcast/injective group."""
    if group.pattern not in FUSABLE_PRODUCER:
        return False
    if consumer_pattern in (ELEMWISE, BROADCAST):
        return True
    return consumer_pattern == INJECTIVE and group.pattern <= INJECTIVE


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


def plan_groups(graph, prologues=False):
    """Fusion groups (lists of node indices, binding order) covering every non-alias node; with
    `prologues`, elementwise groups merged into the conv/matmul group that alone reads them."""
    mod = graph.mod
    groups, group_of = [], {}
    for node in graph.nodes:
        if node.kind == "alias":
            continue
        group = _producer_group(node, graph, group_of, groups, mod) if _fusable_call(node, mod) else None
        if group is not None:
            group.members.append(node.index)
            group.pattern = max(group.pattern, _op_pattern(node, mod))
        else:
            level = 1 + max((groups[group_of[p]].level for p in node.preds), default=-1)
            pattern = _op_pattern(node, mod) if _fusable_call(node, mod) else OPAQUE
            group = _Group(len(groups), node.index, level, pattern)
            groups.append(group)
        group_of[node.index] = group.gid
    if prologues:
        _merge_prologues(graph, groups, group_of)
    return [sorted(g.members) for g in groups if g.members]


def _merge_prologues(graph, groups, group_of):
    """Move each elementwise group in front of the conv/matmul group that alone reads its output
    (see the class docstring); the merged group keeps the prologue's level."""
    mod = graph.mod
    for group in groups:
        if not group.members or group.pattern > BROADCAST:
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
        target.level, target.pattern = group.level, max(target.pattern, group.pattern)
        for i in group.members:
            group_of[i] = target.gid
        group.members = []


def _group_name(graph, members):
    """FuseOps-style name: fused_ + callee names, shortened for long groups."""
    names = [str(graph.nodes[i].gvar.name_hint) for i in members]
    name = "fused_" + "_".join(names)
    if len(name) > MAX_NAME_LEN:
        name = f"fused_{names[0]}_{names[-1]}_{len(names)}ops"
    return name


def _external_inputs(graph, members):
    """Tensors the group reads but does not produce, in first-use order."""
    inside, ext = set(members), []
    for i in members:
        for t in graph.nodes[i].inputs:
            if t.producer not in inside and t not in ext:
                ext.append(t)
    return ext


def _emit_group_function(bb, graph, members, name):
    """Add the private Primitive function of one group to `bb`; returns (gvar, external inputs)."""
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
                args = relax.Tuple([local[t] for t in _arg_tensors(graph, node.value)])
                new_call = relax.call_tir(node.gvar, args, out_ty=node.var.ty)
                last = pos == len(members) - 1
                var = bb.emit_output(new_call) if last else bb.emit(new_call, str(node.var.name))
                local[node.outputs[0]] = var
        gvar = bb.emit_func_output(var)
    return gvar, ext


def _arg_tensors(graph, call):
    """The TensorRefs of a call_tir's argument tuple, in argument order."""
    return [graph.tensor_of_expr(a) for a in call.args[1].fields]


def _emit_groups(mod, graph, groups):
    """Rewrite `main`: drop grouped bindings, call each group's function at its last member."""
    bb = relax.BlockBuilder(mod)
    replace, dropped = {}, set()
    for members in groups:
        gvar, ext = _emit_group_function(bb, graph, members, _group_name(graph, members))
        last = members[-1]
        replace[last] = bb.normalize(relax.Call(gvar, [t.expr for t in ext]))
        dropped.update(members[:-1])
    bindings = []
    for i, b in enumerate(graph.block.bindings):
        if i in replace:
            bindings.append(relax.VarBinding(b.var, replace[i]))
        elif i not in dropped:
            bindings.append(b)
    main = graph.func
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    new_main = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    bb.update_func(mod.get_global_var("main"), new_main)
    return bb.finalize()
