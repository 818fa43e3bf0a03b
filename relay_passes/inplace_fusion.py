"""InPlaceWriteFusion: an in-place write and the injective group computing what it writes, one call.

``CacheSlotWrite(inplace=True)`` leaves the KV-cache write a ``R.call_tir_inplace`` of its own,
whose update (a slice, reshape and transpose of the QKV GEMV's output, as exporters write it) is
another kernel: in an rProgram that is one dependent step more per cache, in every layer. Here the
write joins the group that computes its update, so FuseTIR makes one in-place PrimFunc of both
(FuseTIR keeps ``call_tir_inplace``'s aliasing: the fused call is a ``call_tir_inplace`` of the
same argument), and the update is computed and written in one kernel.

Input: ``main`` after the fusion passes, before FuseTIR (one dataflow block of call_tirs and calls
of Primitive functions). Rewritten: ``w = call_tir_inplace(W, args, [k])`` with one output, where
an argument other than ``args[k]`` is bound in ``main`` to a call of a Primitive function (a fused
group) or a ``call_tir``, every PrimFunc of which is at most injective (``op_pattern`` <= 2: no
reduction, nothing dlight would have to schedule around the write), with one tensor result that
``w`` alone reads and that leaves ``main`` only through ``w``. Of several such arguments, the one
produced last (highest level of the dataflow graph: the one the write waits for; of equals the
later argument, the update of a cache write, not its indices). That binding
goes, and ``w`` becomes one call of a new Primitive function: the group's bindings, then the
in-place call. Nobody else waits for the group's result, so no step moves later. Output: the same
computation; other bindings unchanged.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from .dataflow_graph import CALL_TIR, CALL_TIR_INPLACE, DataflowGraph

INJECTIVE = 2  # op_pattern: elementwise 0, broadcast 1, injective 2


def _pattern(mod, gvar) -> int:
    """The PrimFunc's op_pattern (8, opaque, when it has none)."""
    func = mod[gvar] if gvar in mod.functions else None
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "op_pattern" not in func.attrs:
        return 8
    return int(func.attrs["op_pattern"])


def _simple_call_tir(value) -> bool:
    """A call_tir of a GlobalVar with a plain argument tuple (no tir_vars) and one tensor result."""
    return (isinstance(value, relax.Call) and value.op.same_as(CALL_TIR) and len(value.args) == 2
            and isinstance(value.args[1], relax.Tuple)
            and isinstance(value.ty, relax.TensorType))


def _injective_group(mod, value):
    """The Primitive function a binding calls when its every call_tir is at most injective and it
    returns one tensor, "call_tir" for such a call_tir, else None."""
    if _simple_call_tir(value):
        return "call_tir" if _pattern(mod, value.args[0]) <= INJECTIVE else None
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar)
            and value.op in mod.functions and isinstance(value.ty, relax.TensorType)):
        return None
    func = mod[value.op]
    if not isinstance(func, relax.Function) or func.attrs is None \
            or "Primitive" not in func.attrs or not isinstance(func.body, relax.SeqExpr):
        return None
    for block in func.body.blocks:
        for binding in block.bindings:
            if not (isinstance(binding, relax.VarBinding) and _simple_call_tir(binding.value)
                    and _pattern(mod, binding.value.args[0]) <= INJECTIVE):
                return None
    return func


def _fused_function(producer, group, write, source_index):
    """The Primitive function ``(producer's arguments, write's other arguments) -> write``:
    the group's bindings (or the call_tir) then the in-place call reading its result."""
    head = [relax.Var(f"p{k}", a.ty) for k, a in enumerate(producer.args)] \
        if group != "call_tir" else \
        [relax.Var(f"p{k}", a.ty) for k, a in enumerate(producer.args[1].fields)]
    rest = [(k, a) for k, a in enumerate(write.args[1].fields) if k != source_index]
    tail = [relax.Var(f"w{k}", a.ty) for k, a in rest]
    bb = relax.BlockBuilder()
    with bb.function("fused", head + tail, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            if group == "call_tir":
                update = bb.emit(relax.call_tir(producer.args[0], relax.Tuple(head), producer.ty))
            else:
                bound = dict(zip(group.params, head))
                for block in group.body.blocks:
                    for binding in block.bindings:  # each a call_tir of leaf arguments
                        call = binding.value
                        fields = [bound.get(a, a) for a in call.args[1].fields]
                        bound[binding.var] = bb.emit(relax.call_tir(call.args[0],
                                                                    relax.Tuple(fields), call.ty))
                update = bound[group.body.body]
            args = [None] * len(write.args[1].fields)
            args[source_index] = update
            for (k, _), var in zip(rest, tail):
                args[k] = var
            out = bb.emit_output(relax.op.call_tir_inplace(
                write.args[0], relax.Tuple(args), [int(i) for i in write.attrs.inplace_indices],
                write.ty))
        bb.emit_func_output(out)
    return bb.get()["fused"], [*(producer.args if group != "call_tir" else
                                 producer.args[1].fields), *(a for _, a in rest)]


@tvm.transform.module_pass(opt_level=0, name="InPlaceWriteFusion")
class InPlaceWriteFusion:
    """Fuse each in-place write of ``main`` with the injective group that computes what it
    writes (see the module docstring). No op_pattern, no Primitive group: unchanged."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        graph = DataflowGraph.of_main(mod)
        if graph is None:  # no main, or control flow in it: nothing to fuse
            return mod
        levels = graph.levels()
        plans = {}  # write node index -> (producer node index, group, argument position)
        for node in graph.nodes:
            value = node.value
            if not (isinstance(value, relax.Call) and value.op.same_as(CALL_TIR_INPLACE)
                    and len(value.args) == 2 and isinstance(value.args[1], relax.Tuple)
                    and isinstance(value.ty, relax.TensorType)):
                continue
            written = {int(i) for i in value.attrs.inplace_indices}
            found = []
            for k, arg in enumerate(value.args[1].fields):
                tensor = graph.tensor_of_expr(arg) if isinstance(arg, relax.Var) else None
                if k in written or tensor is None or tensor.producer is None \
                        or not tensor.expr.same_as(arg) or graph.is_graph_output(tensor) \
                        or graph.consumers(tensor) != [node.index]:
                    continue
                group = _injective_group(mod, graph.nodes[tensor.producer].value)
                if group is not None:
                    found.append((levels[tensor.producer], tensor.producer, group, k))
            if found:
                _, producer, group, k = max(found, key=lambda f: (f[0], f[3]))  # tie: the later
                plans[node.index] = (producer, group, k)
        if not plans:
            return mod
        return _rewrite(mod, graph, plans)


def _rewrite(mod, graph, plans):
    """``mod`` with each planned write one call of its fused function, the producers dropped."""
    bb = relax.BlockBuilder(mod)
    dropped = {producer for producer, _, _ in plans.values()}
    replaced, gone = {}, set()
    for index, (producer, group, k) in plans.items():
        prod_value = graph.nodes[producer].value
        func, args = _fused_function(prod_value, group, graph.nodes[index].value, k)
        name = "fused_" + (prod_value.args[0].name_hint if group == "call_tir"
                           else prod_value.op.name_hint).removeprefix("fused_") + "_cache_write"
        gvar = bb.add_func(func, name)
        replaced[index] = relax.Call(gvar, args)
        if group != "call_tir":
            gone.add(prod_value.op)
    bindings = []
    for i, binding in enumerate(graph.block.bindings):
        if i in dropped:
            continue
        if i in replaced:
            binding = relax.VarBinding(binding.var, replaced[i])
        bindings.append(binding)
    main = graph.func
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    bb.update_func(mod.get_global_var("main"),
                   relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs))
    out = bb.get()
    for gvar in gone:  # each fused group is called once (BranchPreservingFusion, SplitTailFusion)
        if not _called(out, gvar):
            out = _without(out, gvar)
    return relax.transform.Normalize()(out)


def _called(mod, gvar) -> bool:
    """Whether any Relax function of ``mod`` still calls ``gvar``."""
    found = []

    def visit(call):
        if call.op.same_as(gvar):
            found.append(call)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            tvm_ffi.structural_walk(func.body, (relax.Call, visit))
    return bool(found)


def _without(mod, gvar):
    """``mod`` without the function ``gvar``."""
    return tvm.IRModule({g: f for g, f in mod.functions_items() if not g.same_as(gvar)},
                        attrs=mod.attrs)
