"""BranchPreservingFusion: which call_tirs fuse, that joins stay apart, and that results do not change."""
import numpy as np
import pytest
import tvm
from tvm import relax

import onnx_builders as ob
from relay_passes import BranchPreservingFusion, DataflowGraph, plan_groups


def graph_of(mod):
    """The DataflowGraph of mod's main."""
    return DataflowGraph.from_function(mod["main"], mod)


def fused(mod):
    """BranchPreservingFusion then FuseTIR: one PrimFunc per group."""
    return relax.transform.FuseTIR()(BranchPreservingFusion()(mod))


def kernel_names(mod):
    """Callee names of main's call_tir bindings, in order."""
    return [str(n.gvar.name_hint) for n in graph_of(mod).nodes if n.kind == "call_tir"]


def callee_groups(mod):
    """Planned groups as lists of callee names."""
    g = graph_of(mod)
    return [[str(g.nodes[i].gvar.name_hint) for i in grp] for grp in plan_groups(g)]


def test_pass_is_registered_under_its_name():
    assert BranchPreservingFusion().info.name == "BranchPreservingFusion"


def test_join_add_is_not_fused_into_either_branch():
    mod = ob.to_relax(ob.two_branch())
    assert callee_groups(mod) == [["matmul", "relu"], ["matmul", "relu"], ["add"]]
    assert kernel_names(fused(mod)) == ["fused_matmul_relu", "fused_matmul_relu", "add"]


def test_tvm_fuse_ops_serialises_the_branches_we_keep_apart():
    mod = ob.to_relax(ob.two_branch())
    theirs = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
    ours = fused(mod)
    assert [len(w) for w in graph_of(theirs).waves()] == [1, 1]
    assert [len(w) for w in graph_of(ours).waves()] == [2, 1]


def test_add_chain_fuses_into_the_first_add():
    mod = ob.to_relax(ob.parallel_branches(16, join="add_chain"))
    groups = callee_groups(mod)
    assert groups[-1] == ["add"] * 15
    assert groups[:-1] == [["matmul", "relu"]] * 16
    out = fused(mod)
    assert len(kernel_names(out)) == 17
    assert [len(w) for w in graph_of(ob.gpu_schedule(out)).waves()] == [16, 1]


def test_concat_join_stays_one_kernel_after_sixteen_branches():
    out = fused(ob.to_relax(ob.parallel_branches(16, join="concat", act="Tanh")))
    assert kernel_names(out) == ["fused_matmul_tir_tanh"] * 16 + ["concatenate"]


def test_diamond_join_mul_stays_alone():
    out = fused(ob.to_relax(ob.diamond()))
    assert kernel_names(out) == ["matmul", "fused_matmul_tir_sigmoid", "fused_matmul_tir_tanh", "multiply"]


def test_group_function_has_the_form_fuse_tir_expects():
    mod = BranchPreservingFusion()(ob.to_relax(ob.two_branch(hidden=16)))
    fn = mod["fused_matmul_relu"]
    assert bool(fn.attrs["Primitive"]) and "global_symbol" not in fn.attrs
    block = fn.body.blocks[0]
    assert isinstance(block, relax.DataflowBlock) and len(block.bindings) == 2
    assert [str(p.name) for p in fn.params] == ["x", "param_0"]
    call = mod["main"].body.blocks[0].bindings[0].value
    assert call.op.same_as(mod.get_global_var("fused_matmul_relu"))
    assert call.args[1].ty.shape.values[0].value == 16


def test_dynamic_shapes_are_fused_as_tvms_fuseops_would():
    """Symbolic shapes never become rTasks: TVM's own fusion applies to them (one kernel, not two)."""
    mod = ob.to_relax(ob.dynamic_batch())
    assert callee_groups(mod) == [["matmul"], ["relu"]]
    out = BranchPreservingFusion()(mod)
    tvm.ir.assert_structural_equal(out, relax.transform.FuseOps()(mod))
    assert kernel_names(relax.transform.FuseTIR()(out)) == ["fused_matmul_relu"]


def test_tuple_outputs_tir_vars_and_extern_calls_are_never_fused():
    mod = ob.mixed_relax_module()
    assert all(len(grp) == 1 for grp in plan_groups(graph_of(mod)))
    assert BranchPreservingFusion()(mod).same_as(mod)


def test_non_dataflow_main_falls_back_to_tvms_fuseops():
    """Without one dataflow block there are no waves to protect: TVM's own fusion applies."""
    plain = relax.transform.ToNonDataflow()(ob.to_relax(ob.two_branch(hidden=16)))
    tvm.ir.assert_structural_equal(BranchPreservingFusion()(plain),
                                   relax.transform.FuseOps()(plain))


@pytest.mark.parametrize("seed", range(6))
def test_fusion_never_delays_a_node(seed):
    """Every node's kernel sits at a level no higher than the node had before fusion."""
    mod = ob.to_relax(ob.random_dag(seed))
    before = graph_of(mod)
    after = graph_of(fused(mod))
    level_after = {n.var: after.levels()[n.index] for n in after.nodes}
    for grp in plan_groups(before, prologues=True):
        last = before.nodes[grp[-1]].var
        assert all(level_after[last] <= before.levels()[i] for i in grp)
        assert len(grp) == 1 or all(before.nodes[i].kind == "call_tir" for i in grp)


def _single_node_model(op_type, inputs, outputs, read=None, inits=(), **attrs):
    """One ONNX node; ``inputs``/``outputs``: [(name, shape)]; ``read``: the outputs the graph
    returns (default: all); ``inits``: initializers (numpy arrays by name)."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(op_type, [n for n, _ in inputs], [n for n, _ in outputs], **attrs)
    graph = helper.make_graph(
        [node], op_type.lower(),
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, sh) for n, sh in inputs
         if n not in dict(inits)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, sh) for n, sh in outputs
         if read is None or n in read],
        initializer=[numpy_helper.from_array(v, n) for n, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def batchnorm_model():
    """BatchNormalization (inference) whose graph reads only Y, not the running statistics."""
    rng = np.random.default_rng(0)
    stats = [(n, (rng.random(3) + 0.5).astype("float32")) for n in ("s", "b", "mean", "var")]
    return _single_node_model("BatchNormalization", [("x", [2, 3, 4, 5])] + [(n, [3]) for n, _ in stats],
                              [("y", [2, 3, 4, 5])], inits=stats)


def sum_model():
    """Sum of three inputs: broadcast each, stack, reduce (TVM fuses all of it into one kernel)."""
    return _single_node_model("Sum", [(f"x{i}", [3]) for i in range(3)], [("y", [3])])


def test_a_tuple_output_nobody_reads_fully_is_pruned():
    """BatchNormalization's call_tir has three outputs, two unread: the fused kernel writes one."""
    out = fused(ob.to_relax(batchnorm_model()))
    (name,) = kernel_names(out)
    callee = out[name]
    assert len(callee.params) == 5 + 1  # x, scale, bias, mean, var -> y only


def test_parameter_only_branches_join_and_a_reduction_takes_its_prologue():
    """Sum(x0, x1, x2): three broadcasts of parameters, a stack and a sum become one kernel, as in
    TVM's default pipeline (they delay nothing)."""
    mod = ob.to_relax(sum_model())
    assert len(kernel_names(mod)) == 5
    assert len(kernel_names(fused(mod))) == 1


MODELS = {
    "batchnorm": batchnorm_model,
    "sum_of_three": sum_model,
    "two_branch": lambda: ob.two_branch(),
    "add_chain_16": lambda: ob.parallel_branches(16, join="add_chain", hidden=64),
    "sum_4": lambda: ob.parallel_branches(4, join="sum", act="Sigmoid", hidden=64),
    "concat_4": lambda: ob.parallel_branches(4, join="concat", act="Tanh", hidden=64),
    "diamond": lambda: ob.diamond(),
    **{f"random_dag_{s}": (lambda s=s: ob.random_dag(s)) for s in range(4)},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_module_computes_what_onnxruntime_computes(name):
    model = MODELS[name]()
    feeds = ob.random_inputs(model)
    mod = ob.to_relax(model)
    reference = ob.run_onnxruntime(model, feeds)
    for outs in (ob.run_tvm_cpu(mod, feeds), ob.run_tvm_cpu(fused(mod), feeds)):
        assert len(outs) == len(reference)
        for got, want in zip(outs, reference):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def relu_sep_convs(channels=4, side=6, seed=0):
    """NASNet's pattern: t = conv(x) read by two ReLU -> depthwise 3x3 (+bias) -> pointwise 1x1
    branches, joined by an Add. Each ReLU's input feeds both branches, so it cannot fuse into its
    producer; its output feeds one conv only."""
    g = ob._Graph(seed)
    t = g.op("Conv", ["x", g.weight(channels, channels, 1, 1)])
    outs = []
    for _ in range(2):
        dw = g.op("Conv", [g.op("Relu", [t]), g.weight(channels, 1, 3, 3), g.weight(channels)],
                  pads=[1, 1, 1, 1], group=channels)
        outs.append(g.op("Conv", [dw, g.weight(channels, channels, 1, 1)]))
    out = g.op("Add", outs)
    shape = [1, channels, side, side]
    return g.model([("x", shape)], [(out, shape)], "relu_sep_convs")


def test_relu_fuses_in_front_of_the_conv_that_alone_reads_it():
    mod = ob.to_relax(relu_sep_convs())
    with_prologues = kernel_names(fused(mod))
    assert with_prologues.count("fused_relu_conv2d1_add") == 2
    assert "relu" not in with_prologues
    without = kernel_names(relax.transform.FuseTIR()(BranchPreservingFusion(prologues=False)(mod)))
    assert without.count("relu") == 2
    waves = lambda m: len(graph_of(m).waves())  # noqa: E731
    assert waves(fused(mod)) == waves(relax.transform.FuseTIR()(
        BranchPreservingFusion(prologues=False)(mod))) - 1


def test_prologue_is_not_pulled_behind_a_later_input():
    """relu(a) read by a matmul whose other input comes later: the merge would delay the relu."""
    g = ob._Graph(0)
    late = g.op("MatMul", [g.op("MatMul", ["x", g.weight(8, 8)]), g.weight(8, 8)])
    out = g.op("MatMul", [g.op("Relu", ["x"]), late])
    mod = ob.to_relax(g.model([("x", [8, 8])], [(out, [8, 8])], "late_input"))
    assert sorted(kernel_names(fused(mod))) == ["matmul", "matmul", "matmul", "relu"]


def test_prologue_fused_module_computes_what_onnxruntime_computes():
    model = relu_sep_convs()
    feeds = ob.random_inputs(model)
    got, = ob.run_tvm_cpu(fused(ob.to_relax(model)), feeds)
    want, = ob.run_onnxruntime(model, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
