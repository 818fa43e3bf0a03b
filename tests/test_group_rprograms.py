"""RammerGroupRPrograms: symbolic shape variables stay defined before they are used."""
import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.backend.cuda import pipeline as cuda_backend

from relay_passes import DataflowGraph
from relay_passes.group_rprograms import RammerGroupRPrograms, RProgramCall

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def symbolic_reshape_module():
    """main(x[4], s[2]): a = x + 1 (static: the rProgram), then a shape computed at run time,
    matched as [n, m], and x reshaped to [n, m]: the reshape reads only x (level 0) but needs n, m
    from the match_cast, which comes later in the levels of tensors."""
    bb = relax.BlockBuilder()
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType([4], "float32"))
    s = relax.Var("s", relax.TensorType([2], "int64"))
    with bb.function("main", [x, s]):
        with bb.dataflow():
            a = bb.emit_te(lambda t: topi.add(t, 1.0), x, primfunc_name_hint="add_one")
            shape = bb.emit(relax.op.tensor_to_shape(s))
            bb.match_cast(shape, relax.ShapeType([n, m]))
            r = bb.emit_te(lambda t: topi.reshape(t, (n, m)), x, primfunc_name_hint="reshape")
            out = bb.emit_output(relax.Tuple([a, r]))
        bb.emit_func_output(out)
    return bb.get()


def test_a_binding_using_a_shape_variable_depends_on_its_match_cast():
    mod = symbolic_reshape_module()
    graph = DataflowGraph.from_function(mod["main"], mod)
    bindings = graph.block.bindings
    cast = next(i for i, b in enumerate(bindings) if isinstance(b, relax.MatchCast))
    reshape = next(i for i, n in enumerate(graph.nodes) if n.gvar and n.gvar.name_hint == "reshape")
    assert cast in graph.nodes[reshape].preds
    assert graph.levels()[reshape] > graph.levels()[cast]


def _persistent():
    """A stand-in for the persistent kernel: y = x + 1 and a step-state output."""
    x = te.placeholder((4,), "float32", name="x")
    y = te.compute((4,), lambda i: x[i] + 1.0, name="y")
    state = te.compute((1,), lambda i: tirx.const(0, "int32"), name="state")
    return te.create_prim_func([x, y, state])


def _rewrite(mod):
    graph = DataflowGraph.from_function(mod["main"], mod)
    add = next(n for n in graph.nodes if n.gvar and n.gvar.name_hint == "add_one")
    call = RProgramCall(name="rammer_rprogram0", func=_persistent(), nodes=(add.index,),
                        args=(add.inputs[0].expr,), outputs=tuple(add.outputs),
                        extra_outputs=(relax.TensorType((1,), "int32"),),
                        level=graph.levels()[add.index])
    return RammerGroupRPrograms([call])(mod)


def test_match_cast_is_kept_and_emitted_before_its_users():
    out = _rewrite(symbolic_reshape_module())
    bindings = list(out["main"].body.blocks[0].bindings)
    kinds = [type(b).__name__ for b in bindings]
    cast = kinds.index("MatchCast")
    reshape = next(i for i, b in enumerate(bindings)
                   if isinstance(b.value, relax.Call) and len(b.value.args)
                   and getattr(b.value.args[0], "name_hint", "") == "reshape")
    assert cast < reshape
    assert [str(v) for v in bindings[cast].ty.values] == ["n", "m"]


def test_rewritten_module_goes_through_tvms_vm_lowering():
    """VMShapeLower fails ("has not been computed") when a shape variable is used before its
    match_cast: the rewritten module must lower."""
    out = _rewrite(symbolic_reshape_module())
    with TARGET:
        lowered = tvm.transform.Sequential([*cuda_backend.dataflow_lower_passes(TARGET),
                                            *cuda_backend.finalize_passes(TARGET)])(out)
    assert "main" in [gv.name_hint for gv in lowered.get_global_vars()]


def tuple_output_module():
    """main(x[4]): pair = (x + 1, x * 2) from one call_tir (a fused cell's c' and h'), a = pair[0]
    read only by c = a + 1, b = pair[1] returned: an rProgram of {pair, c} reads a inside and
    exports only b and c."""
    x = te.placeholder((4,), "float32", name="x")
    first = te.compute((4,), lambda i: x[i] + 1.0, name="first")
    second = te.compute((4,), lambda i: x[i] * 2.0, name="second")
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType([4], "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            two = bb.add_func(te.create_prim_func([x, first, second]), "two")
            ty = relax.TensorType([4], "float32")
            pair = bb.emit(relax.call_tir(two, relax.Tuple([xv]), [ty, ty]))
            a = bb.emit(relax.TupleGetItem(pair, 0))
            b = bb.emit(relax.TupleGetItem(pair, 1))
            c = bb.emit_te(lambda t: topi.add(t, 1.0), a, primfunc_name_hint="add_one")
            out = bb.emit_output(relax.Tuple([b, c]))
        bb.emit_func_output(out)
    return bb.get()


def test_a_tuple_output_read_inside_and_outside_its_rprogram():
    """The rProgram's inside read of pair[0] through its alias var is no dependency on that alias
    (which would be a cycle: alias after the rProgram, rProgram after the alias); b, the one
    output read outside, is bound to the rProgram's output (the tuple does not exist outside)."""
    mod = tuple_output_module()
    graph = DataflowGraph.from_function(mod["main"], mod)
    pair = next(n for n in graph.nodes if n.gvar and n.gvar.name_hint == "two")
    add = next(n for n in graph.nodes if n.gvar and n.gvar.name_hint == "add_one")
    x = te.placeholder((4,), "float32", name="x")
    outs = [te.compute((4,), lambda i: x[i] * 2.0, name="b"),
            te.compute((4,), lambda i: x[i] + 2.0, name="c"),
            te.compute((1,), lambda i: tirx.const(0, "int32"), name="state")]
    exported = (pair.outputs[1], add.outputs[0])
    call = RProgramCall(name="rammer_rprogram0", func=te.create_prim_func([x, *outs]),
                        nodes=(pair.index, add.index), args=(pair.inputs[0].expr,),
                        outputs=exported, extra_outputs=(relax.TensorType((1,), "int32"),),
                        level=graph.levels()[pair.index])
    out = RammerGroupRPrograms([call])(mod)
    bindings = list(out["main"].body.blocks[0].bindings)
    calls = [b for b in bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 1 and calls[0].value.args[0].name_hint == "rammer_rprogram0"
    with TARGET:
        lowered = tvm.transform.Sequential([*cuda_backend.dataflow_lower_passes(TARGET),
                                            *cuda_backend.finalize_passes(TARGET)])(out)
    assert "main" in [gv.name_hint for gv in lowered.get_global_vars()]
