"""BranchPreservingFusion: which call_tirs fuse, that joins stay apart, and that results do not change."""
import numpy as np
import pytest
import onnx.numpy_helper
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


# An elementwise function of one tensor (tanh-GELU, SiLU) as its producer's epilogue.

def gelu_mlp(hidden=32, returned=False, reduced=False, act="gelu", seed=0):
    """``gelu(x @ W1 + b1) @ W2`` (W1 ``[hidden, 2 hidden]``), the GELU as HF's NewGELUActivation is exported (``0.5 x``
    times ``1 + tanh(...)``: a diamond on ``h``); ``act="silu"``: ``h * sigmoid(h)``,
    ``act="erf"``: ``0.5 h (1 + erf(h / sqrt 2))`` instead.
    Controls: ``returned`` also returns ``h``; ``reduced`` also returns ``ReduceSum(h)`` (a
    reader that is no elementwise op)."""
    g = ob._Graph(seed)

    def scalar(value):
        name = g.name("s")
        g.inits.append(onnx.numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    h = g.op("Add", [g.op("MatMul", ["x", g.weight(hidden, 2 * hidden)]), g.weight(2 * hidden)])
    if act == "gelu":
        inner = g.op("Mul", [g.op("Add", [h, g.op("Mul", [g.op("Pow", [h, scalar(3.0)]),
                                                           scalar(0.044715)])]),
                             scalar(np.sqrt(2 / np.pi))])
        y = g.op("Mul", [g.op("Mul", [h, scalar(0.5)]), g.op("Add", [g.op("Tanh", [inner]),
                                                                     scalar(1.0)])])
    elif act == "erf":  # HF's exact GELU, as BERT exports it
        erf = g.op("Erf", [g.op("Div", [h, scalar(np.sqrt(2.0))])])
        y = g.op("Mul", [g.op("Mul", [h, scalar(0.5)]), g.op("Add", [erf, scalar(1.0)])])
    else:
        y = g.op("Mul", [h, g.op("Sigmoid", [h])])
    outputs = [(g.op("MatMul", [y, g.weight(2 * hidden, hidden)]), [1, hidden])]
    if returned:
        outputs.append((h, [1, 2 * hidden]))
    if reduced:
        outputs.append((g.op("ReduceSum", [h], keepdims=1), [1, 1]))
    return g.model([("x", [1, hidden])], outputs, f"{act}_mlp")


def two_sources(hidden=32, seed=0):
    """``a * sigmoid(b)`` with ``a``, ``b`` two GEMVs of x, then a GEMV: two branches."""
    g = ob._Graph(seed)
    a = g.op("MatMul", ["x", g.weight(hidden, hidden)])
    b = g.op("MatMul", ["x", g.weight(hidden, hidden)])
    y = g.op("Mul", [a, g.op("Sigmoid", [b])])
    out = g.op("MatMul", [y, g.weight(hidden, 2 * hidden)])
    return g.model([("x", [1, hidden])], [(out, [1, 2 * hidden])], "two_sources")


def _fused_callees(mod):
    """{main's callee name: names of the PrimFuncs it calls} after BranchPreservingFusion."""
    found = {}
    for binding in mod["main"].body.blocks[0].bindings:
        op = getattr(binding.value, "op", None)
        if isinstance(op, tvm.ir.GlobalVar):
            inner = [b.value.args[0].name_hint for b in mod[op].body.blocks[0].bindings]
            found[op.name_hint] = inner
        elif op is not None and op.name == "relax.call_tir":
            found[binding.value.args[0].name_hint] = [binding.value.args[0].name_hint]
    return found


def _holding(mod, callee):
    """main's callees that call the PrimFunc ``callee``."""
    return [name for name, inner in _fused_callees(mod).items() if callee in inner]


def test_tanh_gelu_is_the_epilogue_of_the_gemv_it_reads(monkeypatch):
    """The GELU (two branches on h, joined by a multiply) joins h's GEMV + bias: two operators,
    two waves (before: the GEMV, 0.5 h and the tanh branch, then the join as the next GEMV's
    prologue: three waves). Without epilogues the joined GELU is the next GEMV's prologue."""
    from relay_passes import branch_fusion

    mod = ob.to_relax(gelu_mlp())
    out = BranchPreservingFusion()(mod)
    (first,) = _holding(out, "matmul")
    assert {"add", "tir_tanh", "multiply"} <= set(_fused_callees(out)[first])
    assert len(_fused_callees(out)) == 2 and len(graph_of(relax.transform.FuseTIR()(out)).waves()) == 2
    without = BranchPreservingFusion(epilogues=False)(mod)
    assert "tir_tanh" not in _fused_callees(without)[_holding(without, "matmul")[0]]
    assert len(_fused_callees(without)) == 2 and "matmul1" in _fused_callees(without)[
        _holding(without, "tir_tanh")[0]]
    monkeypatch.setattr(branch_fusion, "_diamond_join", lambda *a: None)
    before = BranchPreservingFusion(epilogues=False)(mod)
    assert len(_fused_callees(before)) == 4
    assert len(graph_of(relax.transform.FuseTIR()(before)).waves()) == 3


def test_silu_is_the_epilogue_of_the_gemv_it_reads():
    out = BranchPreservingFusion()(ob.to_relax(gelu_mlp(act="silu")))
    assert len(_fused_callees(out)) == 2
    assert "tir_sigmoid" in _fused_callees(out)[_holding(out, "matmul")[0]]


@pytest.mark.parametrize("control", ["returned", "reduced"])
def test_a_tensor_read_elsewhere_keeps_its_elementwise_function_apart(control):
    """h also returned, or also read by a reduction: the GELU does not join h's GEMV (whoever
    else reads h would wait for the GELU too); it is still one group, the next GEMV's prologue."""
    out = BranchPreservingFusion()(ob.to_relax(gelu_mlp(**{control: True})))
    (first,) = _holding(out, "matmul")
    assert "tir_tanh" not in _fused_callees(out)[first]
    (gelu,) = _holding(out, "tir_tanh")
    assert "matmul1" in _fused_callees(out)[gelu]


def test_an_elementwise_join_of_two_sources_is_no_diamond():
    """a * sigmoid(b), a and b from two GEMVs: sigmoid joins b's GEMV (it alone reads b), the
    multiply stays apart from a's GEMV (joining it would join the two branches): it is the last
    GEMV's prologue, as before."""
    out = BranchPreservingFusion()(ob.to_relax(two_sources()))
    assert _fused_callees(out) == {"matmul": ["matmul"],
                                   "fused_matmul_tir_sigmoid": ["matmul", "tir_sigmoid"],
                                   "fused_multiply_matmul1": ["multiply", "matmul1"]}


@pytest.mark.parametrize("kwargs", [{}, {"act": "silu"}, {"returned": True}, {"reduced": True}])
def test_epilogue_fused_module_computes_what_onnxruntime_computes(kwargs):
    model = gelu_mlp(**kwargs)
    feeds = ob.random_inputs(model)
    got = ob.run_tvm_cpu(fused(ob.to_relax(model)), feeds)
    want = ob.run_onnxruntime(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _gpt2_calls(layers=1):
    """{main's callee: PrimFuncs it calls} of a reduced GPT-2 decode step after the rammer graph
    passes up to FuseTIR (the fused functions before it)."""
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes
    from tvm_rammer.models import REDUCED, get_model

    model = get_model("gpt2_decode", **{**REDUCED["gpt2_decode"], "layers": layers})
    passes = [p for p in graph_passes(RammerConfig()) if p.info.name != "FuseTIR"]
    return _fused_callees(tvm.transform.Sequential(passes)(import_onnx(model)))


def test_reduced_gpt2_gelu_is_fc1s_epilogue_and_its_step_is_gone(monkeypatch):
    """In the pipeline: fc1 (its LayerNorm fused in front by NormGEMVFusion) ends with the whole
    GELU; before this rule 0.5 x and the tanh branch were two operators of their own (one step),
    the join fc2's prologue."""
    from relay_passes import branch_fusion

    after = _gpt2_calls()
    gelu_ops = ["power", "multiply1", "add9", "multiply2", "tir_tanh", "multiply3", "add10",
                "multiply4"]
    fc1 = [name for name, inner in after.items() if "tir_tanh" in inner]
    assert len(fc1) == 1 and after[fc1[0]] == ["layer_norm", "matmul2_norm_gemv", "add8", *gelu_ops]
    assert after["fused_matmul3_add6_add7"] == ["matmul3", "add6", "add7"]  # fc2 reads gelu(h)
    monkeypatch.setattr(branch_fusion, "_diamond_join", lambda *a: None)
    monkeypatch.setattr(branch_fusion, "_source_group", lambda *a: None)
    before = _gpt2_calls()
    assert len(before) == len(after) + 2
    assert before["multiply3"] == ["multiply3"] and before[
        "fused_power_multiply1_add9_multiply2_tir_tanh_add10"] == gelu_ops[:5] + ["add10"]
    assert before["fused_multiply4_matmul3_add6_add7"][0] == "multiply4"


def swiglu_mlp(hidden=32, returned=False, seed=0):
    """Llama's MLP: ``(silu(x @ Wg) * (x @ Wu)) @ Wd`` (``returned``: the product returned too)."""
    g = ob._Graph(seed)
    gate = g.op("MatMul", ["x", g.weight(hidden, 2 * hidden)])
    up = g.op("MatMul", ["x", g.weight(hidden, 2 * hidden)])
    y = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    outputs = [(g.op("MatMul", [y, g.weight(2 * hidden, hidden)]), [1, hidden])]
    if returned:
        outputs.append((y, [1, 2 * hidden]))
    return g.model([("x", [1, hidden])], outputs, "swiglu_mlp")


def _tail_then_fusion(mod):
    from relay_passes.split_tail_fusion import SplitTailFusion

    return BranchPreservingFusion()(SplitTailFusion()(mod))


def _main_calls(mod):
    """main's calls in binding order, each as the list of PrimFuncs it calls."""
    found = []
    for binding in mod["main"].body.blocks[0].bindings:
        op = getattr(binding.value, "op", None)
        if isinstance(op, tvm.ir.GlobalVar):
            found.append([b.value.args[0].name_hint for b in mod[op].body.blocks[0].bindings])
        elif op is not None and op.name == "relax.call_tir":
            found.append([binding.value.args[0].name_hint])
    return found


def test_a_split_tails_elementwise_group_is_the_next_gemvs_prologue():
    """SplitTailFusion makes silu(gate) * up one group (a tail of gate); it becomes the down
    GEMV's prologue (its call_tirs inlined, its function gone): gate and up, then down, two
    waves instead of three. Control: the product also returned stays a group of its own."""
    from relay_passes.split_tail_fusion import SplitTailFusion

    mod = ob.to_relax(swiglu_mlp())
    silu = ["tir_sigmoid", "multiply", "multiply"]
    assert silu in _main_calls(SplitTailFusion()(mod))
    out = _tail_then_fusion(mod)
    assert _main_calls(out) == [["matmul"], ["matmul"], silu + ["matmul1"]]
    assert not [gv for gv in out.get_global_vars() if "fused_tir_sigmoid" in gv.name_hint
                and "matmul" not in gv.name_hint]
    assert len(graph_of(relax.transform.FuseTIR()(out)).waves()) == 2
    kept = _tail_then_fusion(ob.to_relax(swiglu_mlp(returned=True)))
    assert _main_calls(kept) == [["matmul"], ["matmul"], silu, ["matmul1"]]
    assert len(graph_of(relax.transform.FuseTIR()(kept)).waves()) == 3


def test_a_split_tails_function_of_one_tensor_is_its_producers_epilogue():
    """BERT's erf-GELU: SplitTailFusion groups it first (a tail of h); it still becomes the
    epilogue of h's GEMV + bias (its call_tirs inlined, its function gone). Control: h also
    returned keeps it apart (the next GEMV's prologue)."""
    from relay_passes.split_tail_fusion import SplitTailFusion

    mod = ob.to_relax(gelu_mlp(act="erf"))
    gelu = ["divide", "erf", "multiply", "add1", "multiply1"]
    assert gelu in _main_calls(SplitTailFusion()(mod))
    out = _tail_then_fusion(mod)
    assert _main_calls(out) == [["matmul", "add", *gelu], ["matmul1"]]
    assert len([gv for gv in out.get_global_vars() if "erf" in gv.name_hint]) == 2  # PrimFunc + group
    kept = _tail_then_fusion(ob.to_relax(gelu_mlp(act="erf", returned=True)))
    assert _main_calls(kept) == [["matmul", "add"], [*gelu, "matmul1"]]


@pytest.mark.parametrize("model", ["swiglu", "swiglu_returned", "erf", "erf_returned"])
def test_the_inlined_groups_compute_what_onnxruntime_computes(model):
    kind, _, returned = model.partition("_")
    model = swiglu_mlp(returned=bool(returned)) if kind == "swiglu" else gelu_mlp(
        act="erf", returned=bool(returned))
    feeds = ob.random_inputs(model)
    got = ob.run_tvm_cpu(relax.transform.FuseTIR()(_tail_then_fusion(ob.to_relax(model))), feeds)
    want = ob.run_onnxruntime(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
