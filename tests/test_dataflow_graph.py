"""DataflowGraph: nodes, aliases, placeability, levels and waves of main's dataflow block."""
import pytest
import tvm
from tvm import relax, topi

import onnx_builders as ob
from relay_passes import BranchPreservingFusion, DataflowGraph


def graph_of(mod):
    """The DataflowGraph of mod's main."""
    return DataflowGraph.from_function(mod["main"], mod)


def scheduled(model, fuse):
    """ONNX -> legalized Relax (-> BranchPreservingFusion + FuseTIR) -> dlight-scheduled."""
    mod = ob.to_relax(model)
    if fuse:
        mod = relax.transform.FuseTIR()(BranchPreservingFusion()(mod))
    return ob.gpu_schedule(mod)


def callees(graph, wave):
    """Callee names of the nodes of one wave."""
    return sorted(str(graph.nodes[i].gvar.name_hint) for i in wave)


def test_two_branch_unfused_has_three_waves_of_two_two_one():
    g = graph_of(scheduled(ob.two_branch(), fuse=False))
    assert [callees(g, w) for w in g.waves()] == [["matmul", "matmul"], ["relu", "relu"], ["add"]]
    assert all(n.placeable and n.kind == "call_tir" for n in g.nodes)


def test_two_branch_fused_branches_share_the_first_wave():
    g = graph_of(scheduled(ob.two_branch(), fuse=True))
    assert [callees(g, w) for w in g.waves()] == [["fused_matmul_relu"] * 2, ["add"]]


@pytest.mark.parametrize("fuse", [False, True])
def test_sixteen_gemv_branches_form_one_wave(fuse):
    g = graph_of(scheduled(ob.parallel_branches(16, act="Relu"), fuse=fuse))
    first = g.waves()[0]
    assert len(first) == 16
    assert callees(g, first) == ["fused_matmul_relu" if fuse else "matmul"] * 16
    assert all(g.nodes[i].placeable for i in first)


def test_diamond_levels():
    g = graph_of(scheduled(ob.diamond(), fuse=True))
    assert [len(w) for w in g.waves()] == [1, 2, 1]
    join = g.waves()[2][0]
    assert sorted(g.nodes[join].preds) == sorted(g.waves()[1])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fuse", [False, True])
def test_random_dag_waves_partition_nodes_and_preds_are_lower(seed, fuse):
    g = graph_of(scheduled(ob.random_dag(seed), fuse=fuse))
    levels = g.levels()
    in_waves = sorted(i for w in g.waves() for i in w)
    assert in_waves == sorted(n.index for n in g.nodes if n.kind != "alias")
    for w, wave in enumerate(g.waves()):
        assert all(levels[i] == w for i in wave)
    for n in g.nodes:
        if n.kind != "alias":
            assert levels[n.index] == 1 + max((levels[p] for p in n.preds), default=-1)
            assert all(levels[p] < levels[n.index] for p in n.preds)
    assert g.topo_order() == list(range(len(g.nodes)))


def test_consumers_and_outputs_used_outside():
    g = graph_of(scheduled(ob.two_branch(), fuse=False))
    mm0, mm1, relu0, relu1, add = range(5)
    x = g.nodes[mm0].inputs[0]
    assert x.producer is None and g.consumers(x) == [mm0, mm1]
    assert g.outputs_used_outside({mm0, relu0}) == g.nodes[relu0].outputs
    assert g.outputs_used_outside({add}) == g.nodes[add].outputs
    assert g.is_graph_output(g.nodes[add].outputs[0])
    assert g.outputs_used_outside(range(5)) == g.nodes[add].outputs
    weight = g.nodes[mm0].inputs[1]
    assert weight.is_constant and weight.shape == (256, 256) and weight.dtype == "float32"


def test_call_tir_inputs_follow_the_argument_tuple():
    mod = scheduled(ob.random_dag(3), fuse=False)
    g = graph_of(mod)
    for n in g.nodes:
        if n.kind == "call_tir":
            args = list(n.value.args[1].fields)
            assert len(n.inputs) + len(n.outputs) == len(mod[n.gvar].params)
            assert [t.expr for t in n.inputs] == args
    doubled = [n for n in g.nodes if n.kind == "call_tir" and len(set(n.inputs)) < len(n.inputs)]
    assert doubled, "random_dag(3) has an add(lv, lv)"
    assert g.consumers(doubled[0].inputs[0]).count(doubled[0].index) == 1


def test_dynamic_dimension_is_not_placeable():
    g = graph_of(scheduled(ob.dynamic_batch(), fuse=False))
    assert [n.reason for n in g.nodes] == ["dynamic shape", "dynamic shape"]
    assert not any(n.placeable for n in g.nodes)


def test_unplaceable_bindings_report_why():
    g = graph_of(ob.mixed_relax_module())
    by_name = {n.name: n for n in g.nodes}
    assert [n.kind for n in g.nodes] == ["call_tir", "call_tir", "alias", "alias", "call_tir",
                                         "opaque", "call_tir", "alias"]
    assert by_name["lv"].reason.startswith("tir_vars")
    assert by_name["lv5"].reason.startswith("not a PrimFunc (library/extern call")
    assert by_name["lv6"].reason == "PrimFunc has no thread-block schedule"
    assert not any(n.placeable for n in g.nodes)


def test_tuple_get_item_aliases_the_call_tir_output():
    g = graph_of(ob.mixed_relax_module())
    split, add = g.nodes[1], g.nodes[4]
    assert len(split.outputs) == 2
    assert add.preds == [1]
    assert add.inputs == split.outputs
    assert add.inputs[0].expr.same_as(g.nodes[2].var)
    assert g.consumers(split.outputs[0]) == [2, 4]
    assert g.outputs_used_outside({1}) == split.outputs
    assert g.levels()[4] == 1 and g.levels()[2] == 0
    assert [g.nodes[i].name for w in g.waves() for i in w] == ["lv", "lv1", "lv4", "lv5", "lv6"]


def test_tuple_output_aliases_are_graph_outputs():
    g = graph_of(ob.mixed_relax_module())
    for i in (0, 5, 6):
        assert g.is_graph_output(g.nodes[i].outputs[0])
    assert not g.is_graph_output(g.nodes[4].outputs[0])


def test_non_dataflow_main_raises_with_fix():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4], "float32"))
    with bb.function("main", [x]):
        y = bb.emit_te(topi.exp, x)
        bb.emit_func_output(y)
    mod = bb.get()
    with pytest.raises(ValueError, match="exactly one DataflowBlock.*ConvertToDataflow"):
        graph_of(mod)


def test_two_dataflow_blocks_raise():
    main = ob.to_relax(ob.two_branch(hidden=16))["main"]
    bindings = list(main.body.blocks[0].bindings)
    blocks = [relax.DataflowBlock(bindings[:2]), relax.DataflowBlock(bindings[2:])]
    split = relax.Function(main.params, relax.SeqExpr(blocks, main.body.body), main.ret_ty)
    with pytest.raises(ValueError, match=r"exactly one DataflowBlock, found \['DataflowBlock', 'DataflowBlock'\]"):
        DataflowGraph.from_function(split, tvm.IRModule({"main": split}))


def test_placeable_requires_prim_func_in_module():
    mod = ob.to_relax(ob.two_branch(hidden=16))
    g = graph_of(mod)
    assert {n.reason for n in g.nodes} == {"PrimFunc has no thread-block schedule"}
    assert isinstance(g.nodes[0].gvar, tvm.ir.GlobalVar)



def _in_place_write(read_elsewhere, returned=False):
    """main(cache, new, index): the cache written in place at ``index`` (the call_tir_inplace of
    ``cache_write.slot_write_inplace``, as CacheSlotWrite(inplace=True) emits it), then exp,
    scheduled for the GPU; with ``read_elsewhere`` the exp's input also adds the old cache (which
    the pass itself never writes in place); with ``returned`` main also returns the old cache."""
    from relay_passes.cache_write import slot_write_inplace

    cache = relax.Var("cache", relax.TensorType((1, 2, 4, 3), "float32"))
    new = relax.Var("new", relax.TensorType((1, 2, 1, 3), "float32"))
    index = relax.Var("index", relax.TensorType((1, 2, 1, 3), "int64"))
    bb = relax.BlockBuilder()
    write = bb.add_func(slot_write_inplace(cache.ty, index.ty, new.ty, axis=2, nd=False,
                                           kept_one=False), "cache_write_inplace")
    with bb.function("main", [cache, new, index]):
        with bb.dataflow():
            out = bb.emit(relax.op.call_tir_inplace(write, relax.Tuple([cache, index, new]), [0],
                                                    cache.ty))
            if read_elsewhere:
                out = bb.emit(relax.op.add(out, cache))
            out = bb.emit_output(relax.op.exp(out))
        bb.emit_func_output(relax.Tuple([out, cache]) if returned else out)
    return ob.gpu_schedule(relax.transform.LegalizeOps()(bb.get()))


def test_an_in_place_write_is_a_node_whose_output_takes_its_inputs_bytes():
    """A call_tir_inplace node: its inputs line up with the PrimFunc's parameters (no output
    parameter), its output is a tensor of its own that its reader depends on, written into
    input 0; placeable. Control: the same write with the old cache read by another binding is
    not placeable, and says why."""
    g = graph_of(_in_place_write(read_elsewhere=False))
    write = next(n for n in g.nodes if n.kind == "call_tir_inplace")
    assert write.inplace == (0,) and write.placeable, write.reason
    assert [t.expr.name for t in write.inputs] == ["cache", "index", "new"]
    assert len(g.mod[write.gvar].params) == len(write.inputs)
    reader = next(n for n in g.nodes if write.outputs[0] in n.inputs)
    assert write.index in reader.preds and write.outputs[0] != write.inputs[0]
    bad = graph_of(_in_place_write(read_elsewhere=True))
    write = next(n for n in bad.nodes if n.kind == "call_tir_inplace")
    assert not write.placeable and "read elsewhere" in write.reason


def test_an_in_place_write_into_a_cache_main_also_returns_is_not_placeable():
    """The old cache is a result of main too: written in place, that result would be the new
    contents; not placeable, and says why."""
    g = graph_of(_in_place_write(read_elsewhere=False, returned=True))
    write = next(n for n in g.nodes if n.kind == "call_tir_inplace")
    assert not write.placeable and "read elsewhere" in write.reason
