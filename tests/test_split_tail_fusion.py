"""SplitTailFusion: an LSTM cell's elementwise tail becomes one dependent step, nothing is delayed,
and results do not change."""
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import onnx_builders as ob
from relay_passes import DataflowGraph
from relay_passes.branch_fusion import BranchPreservingFusion
from relay_passes.split_tail_fusion import SplitTailFusion, find_tails, tail_groups
from relay_passes.split_to_slices import SplitToSlices
from tvm_rammer.models import REDUCED, get_model

H = 4


def tensor(*shape):
    return relax.TensorType(list(shape), "float32")


def lstm_cell_before():
    """One LSTM step with the MatMul already split: gates = x @ Wx + h @ Wh + b, four slices,
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g), h' = sigmoid(o) * tanh(c'); legalized."""
    bb = relax.BlockBuilder()
    x, h, c = (relax.Var(n, tensor(1, H)) for n in "xhc")
    wx, wh, b = relax.Var("wx", tensor(H, 4 * H)), relax.Var("wh", tensor(H, 4 * H)), relax.Var("b", tensor(4 * H))
    op = relax.op
    with bb.function("main", [x, h, c, wx, wh, b]):
        with bb.dataflow():
            mx = bb.emit(op.matmul(x, wx))
            mh = bb.emit(op.matmul(h, wh))
            gates = bb.emit(op.add(bb.emit(op.add(mx, mh)), b))
            i, f, g, o = (bb.emit(op.strided_slice(gates, [1], [k * H], [(k + 1) * H])) for k in range(4))
            fc = bb.emit(op.multiply(bb.emit(op.sigmoid(f)), c))
            ig = bb.emit(op.multiply(bb.emit(op.sigmoid(i)), bb.emit(op.tanh(g))))
            c1 = bb.emit(op.add(fc, ig))
            h1 = bb.emit(op.multiply(bb.emit(op.sigmoid(o)), bb.emit(op.tanh(c1))))
            out = bb.emit_output(relax.Tuple([h1, c1]))
        bb.emit_func_output(out)
    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
    return tvm.transform.Sequential(seq)(bb.get())


def lstm_cell_expected(before):
    """Both tail outputs as Primitive functions over the same four inputs; c' recomputed in h's."""
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in before.functions_items()
                                          if gv.name_hint != "main"}))
    small, wide = tensor(1, H), tensor(1, 4 * H)

    def call(name, args, out):
        return bb.emit(relax.call_tir(before.get_global_var(name), relax.Tuple(args), out))

    def tail(name, with_h):
        mx, mh = relax.Var("lv", wide), relax.Var("lv1", wide)
        b, c = relax.Var("b", tensor(4 * H)), relax.Var("c", small)
        with bb.function(name, [mx, mh, b, c], attrs={"Primitive": True}, private=True):
            with bb.dataflow():
                gates = call("add1", [call("add", [mx, mh], wide), b], wide)
                i, f, g = (call(f"strided_slice{k or ''}", [gates], small) for k in range(3))
                o = call("strided_slice3", [gates], small) if with_h else None
                fc = call("multiply", [call("tir_sigmoid", [f], small), c], small)
                ig = call("multiply", [call("tir_sigmoid", [i], small), call("tir_tanh", [g], small)], small)
                if not with_h:
                    out = bb.emit_output(relax.call_tir(before.get_global_var("add2"),
                                                        relax.Tuple([fc, ig]), small))
                else:
                    c1 = call("add2", [fc, ig], small)
                    so, tc = call("tir_sigmoid", [o], small), call("tir_tanh", [c1], small)
                    out = bb.emit_output(relax.call_tir(before.get_global_var("multiply"),
                                                        relax.Tuple([so, tc]), small))
            return bb.emit_func_output(out)

    fused_c = tail("fused_add_add2_11ops", with_h=False)
    fused_h = tail("fused_add_multiply_15ops", with_h=True)
    main = before["main"]
    x, h, c, wx, wh, b = main.params
    with bb.function("main", [x, h, c, wx, wh, b]):
        with bb.dataflow():
            mx = call("matmul", [x, wx], wide)
            mh = call("matmul", [h, wh], wide)
            c1 = bb.emit(relax.Call(fused_c, [mx, mh, b, c]))
            h1 = bb.emit(relax.Call(fused_h, [mx, mh, b, c]))
            out = bb.emit_output(relax.Tuple([h1, c1]))
        bb.emit_func_output(out)
    return bb.get()


def test_lstm_cell_tail_becomes_one_group_per_output():
    before = lstm_cell_before()
    tvm.ir.assert_structural_equal(SplitTailFusion()(before), lstm_cell_expected(before))


def test_pass_is_registered_under_its_name():
    assert SplitTailFusion().info.name == "SplitTailFusion"


def test_a_part_combined_with_a_later_branch_stays_out():
    """sigmoid(part) * tanh(y @ W) where y @ W comes later than the split: the Mul would wait for
    the other branch, so it is not pulled into the tail."""
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", tensor(1, 2 * H)), relax.Var("y", tensor(1, H))
    w = relax.Var("w", tensor(H, H))
    op = relax.op
    with bb.function("main", [x, y, w]):
        with bb.dataflow():
            a, b = (bb.emit(op.strided_slice(x, [1], [k * H], [(k + 1) * H])) for k in range(2))
            late = bb.emit(op.tanh(bb.emit(op.matmul(bb.emit(op.matmul(y, w)), w))))
            joined = bb.emit(op.multiply(bb.emit(op.sigmoid(a)), late))
            out = bb.emit_output(relax.Tuple([joined, bb.emit(op.exp(b))]))
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                    relax.transform.AnnotateTIROpPattern()])(bb.get())
    graph = DataflowGraph.from_function(mod["main"], mod)
    (tail,) = find_tails(graph)
    names = sorted(str(graph.nodes[i].gvar.name_hint) for i in tail)
    assert names == ["strided_slice", "strided_slice1", "tir_exp", "tir_sigmoid"]


def graph_of(mod):
    return DataflowGraph.from_function(mod["main"], mod)


def rewritten(model, tail=True):
    """Import, SplitToSlices, LegalizeOps, AnnotateTIROpPattern, FoldConstant, [SplitTailFusion],
    BranchPreservingFusion, FuseTIR."""
    from tvm.relax.frontend.onnx import from_onnx
    seq = [SplitToSlices(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
           relax.transform.FoldConstant(), *([SplitTailFusion()] if tail else []),
           BranchPreservingFusion(), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(seq)(from_onnx(model, keep_params_in_input=False))


MODELS = {
    "lstm_tc": lambda: get_model("lstm_tc", **REDUCED["lstm_tc"]),
    "seq2seq": lambda: get_model("seq2seq", **REDUCED["seq2seq"]),
    **{f"random_dag_{s}": (lambda s=s: ob.random_dag(s)) for s in range(3)},
}


def legalized(model):
    """Import, SplitToSlices, LegalizeOps, AnnotateTIROpPattern, FoldConstant: the pass's input."""
    from tvm.relax.frontend.onnx import from_onnx
    seq = [SplitToSlices(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
           relax.transform.FoldConstant()]
    return tvm.transform.Sequential(seq)(from_onnx(model, keep_params_in_input=False))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fusion_never_delays_a_node(name):
    """Every tail group's kernel sits at a level no higher than any of its members had before."""
    mod = legalized(MODELS[name]())
    before = graph_of(mod)
    after = graph_of(SplitTailFusion()(mod))
    level_after = {n.var: after.levels()[n.index] for n in after.nodes}
    groups = [g for tail in find_tails(before) for g in tail_groups(before, tail)]
    assert groups or name.startswith("random_dag")
    for group in groups:
        last = before.nodes[group[-1]].var
        assert all(level_after[last] <= before.levels()[i] for i in group)


def test_lstm_step_is_two_levels_after_the_rewrites():
    """lstm_tc (reduced): each step adds one GEMV level and one tail level, instead of six."""
    from tvm.relax.frontend.onnx import from_onnx

    from relay_passes.split_matmul_concat import SplitMatMulOverConcat
    kw = REDUCED["lstm_tc"]
    model = get_model("lstm_tc", **kw)
    seq = [SplitToSlices(), SplitMatMulOverConcat(), relax.transform.LegalizeOps(),
           relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(), SplitTailFusion(),
           BranchPreservingFusion(), relax.transform.FuseTIR()]
    graph = graph_of(tvm.transform.Sequential(seq)(from_onnx(model, keep_params_in_input=False)))
    diagonals = kw["layers"] + kw["seq_len"] - 1
    assert len(graph.waves()) <= 2 * diagonals + 1  # + the input slices


def block_grids(func):
    """How many loops of `func` are bound to blockIdx (kernels dlight made of it)."""
    found = []

    def on_for(loop):
        if loop.kind == tvm.tirx.ForKind.THREAD_BINDING and \
                str(loop.thread_binding.thread_tag).startswith("blockIdx"):
            found.append(loop)

    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, on_for)])
    return len(found)


def test_each_tail_group_is_one_gpu_kernel():
    """dlight schedules each fused tail as one thread-block grid: it can become rTasks."""
    mod = ob.gpu_schedule(rewritten(get_model("lstm_tc", **REDUCED["lstm_tc"])))
    tails = {str(n.gvar.name_hint) for n in graph_of(mod).nodes
             if n.kind == "call_tir" and str(n.gvar.name_hint).endswith("ops")}
    assert len(tails) == 2  # the c' and the h' group, shared by every step
    assert all(block_grids(mod[name]) == 1 for name in tails)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_module_computes_what_onnxruntime_computes(name):
    model = MODELS[name]()
    feeds = ob.random_inputs(model)
    for got, want in zip(ob.run_tvm_cpu(rewritten(model), feeds), ob.run_onnxruntime(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
