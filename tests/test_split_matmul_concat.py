"""SplitMatMulOverConcat: matmul(concat([a, b]), W) -> a @ W_a + b @ W_b, same numbers as onnxruntime."""
import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from relay_passes.split_matmul_concat import SplitMatMulOverConcat
from relay_passes.split_to_slices import SplitToSlices
from tvm_rammer.models import REDUCED, get_model

from onnx_builders import random_inputs, run_onnxruntime, run_tvm_cpu


def tensor(*shape):
    return relax.TensorType(list(shape), "float32")


def weight(rows, cols, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype("float32")


def concat_matmul_module(w, widths, axis=1, w_is_param=False):
    """main(parts..., [W]) = matmul(concat(parts, axis), W)."""
    bb = relax.BlockBuilder()
    parts = [relax.Var(f"p{k}", tensor(1, n)) for k, n in enumerate(widths)]
    w_var = relax.Var("w", tensor(*w.shape))
    with bb.function("main", parts + ([w_var] if w_is_param else [])):
        with bb.dataflow():
            cat = bb.emit(relax.op.concat(parts, axis=axis))
            out = bb.emit_output(relax.op.matmul(cat, w_var if w_is_param else relax.const(w)))
        bb.emit_func_output(out)
    return bb.get()


def test_two_part_concat_becomes_two_matmuls_and_an_add():
    w = weight(12, 8)
    before = concat_matmul_module(w, [4, 8])
    bb = relax.BlockBuilder()
    a, b = relax.Var("p0", tensor(1, 4)), relax.Var("p1", tensor(1, 8))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            ma = bb.emit(relax.op.matmul(a, relax.const(w[:4])))
            mb = bb.emit(relax.op.matmul(b, relax.const(w[4:])))
            out = bb.emit_output(relax.op.add(ma, mb))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(SplitMatMulOverConcat()(before), bb.get())


def test_three_parts_sum_left_to_right():
    w = weight(9, 5)
    after = SplitMatMulOverConcat()(concat_matmul_module(w, [2, 3, 4]))
    text = after["main"].script()
    assert "R.concat" not in text and text.count("R.matmul") == 3 and text.count("R.add") == 2


@pytest.mark.parametrize("case", ["weight_is_a_parameter", "concat_on_rows", "already_split"])
def test_declines_what_it_cannot_split(case):
    w = weight(12, 8)
    if case == "weight_is_a_parameter":
        mod = concat_matmul_module(w, [4, 8], w_is_param=True)
    elif case == "concat_on_rows":
        bb = relax.BlockBuilder()
        a, b = relax.Var("a", tensor(2, 12)), relax.Var("b", tensor(2, 12))
        with bb.function("main", [a, b]):
            with bb.dataflow():
                cat = bb.emit(relax.op.concat([a, b], axis=0))
                out = bb.emit_output(relax.op.matmul(cat, relax.const(w)))
            bb.emit_func_output(out)
        mod = bb.get()
    else:
        mod = SplitMatMulOverConcat()(concat_matmul_module(w, [4, 8]))
    assert SplitMatMulOverConcat()(mod).same_as(mod)


def test_steps_sharing_a_weight_share_its_halves():
    """An unrolled RNN uses one W at every step: its halves are two constants, not 2 x steps."""
    model = get_model("lstm_tc", seq_len=4, input_size=8, hidden=8, layers=1)
    mod = SplitMatMulOverConcat()(SplitToSlices()(from_onnx(model, keep_params_in_input=False)))
    weights = []

    def visit(expr):
        if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.ty, relax.TensorType) \
                and [int(d) for d in expr.ty.shape.values] == [8, 32] \
                and not any(expr.same_as(w) for w in weights):
            weights.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    assert len(weights) == 2  # W_x and W_h, shared by the four steps
    assert mod["main"].script().count("R.matmul") == 2 * 4


def random_cell(seed, n_in, hidden, batch=1, parts=1):
    """One LSTM step as GraphBuilder.lstm_cell builds it: [x_1..x_parts, h] @ W + b, Split, gates."""
    rng = np.random.default_rng(seed)
    xs = [f"x{k}" for k in range(parts)]
    k_in = n_in * parts + hidden
    w = numpy_helper.from_array((rng.standard_normal((k_in, 4 * hidden)) / np.sqrt(k_in)).astype("float32"), "w")
    b = numpy_helper.from_array(rng.standard_normal(4 * hidden).astype("float32"), "b")
    nodes = [
        helper.make_node("Concat", xs + ["h"], ["xh"], axis=1),
        helper.make_node("MatMul", ["xh", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["gates"]),
        helper.make_node("Split", ["gates"], ["i", "f", "g", "o"], axis=1, num_outputs=4),
        helper.make_node("Sigmoid", ["i"], ["si"]), helper.make_node("Sigmoid", ["f"], ["sf"]),
        helper.make_node("Tanh", ["g"], ["tg"]), helper.make_node("Sigmoid", ["o"], ["so"]),
        helper.make_node("Mul", ["sf", "c"], ["fc"]), helper.make_node("Mul", ["si", "tg"], ["ig"]),
        helper.make_node("Add", ["fc", "ig"], ["c1"]), helper.make_node("Tanh", ["c1"], ["tc"]),
        helper.make_node("Mul", ["so", "tc"], ["h1"]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, n_in]) for n in xs]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, hidden]) for n in "hc"]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, hidden]) for n in ("h1", "c1")]
    graph = helper.make_graph(nodes, f"cell{seed}", inputs, outputs, [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def rewritten(model):
    """The rammer graph rewrites up to FuseTIR (SplitToSlices, SplitMatMulOverConcat,
    BatchSharedWeightMatMuls, LegalizeOps, AnnotateTIROpPattern, FoldConstant, SplitTailFusion,
    BranchPreservingFusion, FuseTIR)."""
    from relay_passes.batch_shared_matmuls import BatchSharedWeightMatMuls
    from relay_passes.branch_fusion import BranchPreservingFusion
    from relay_passes.split_tail_fusion import SplitTailFusion
    seq = [SplitToSlices(), SplitMatMulOverConcat(), BatchSharedWeightMatMuls(),
           relax.transform.LegalizeOps(),
           relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(), SplitTailFusion(),
           BranchPreservingFusion(), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(seq)(from_onnx(model, keep_params_in_input=False))


MODELS = {
    "lstm_tc": lambda: get_model("lstm_tc", **REDUCED["lstm_tc"]),
    "seq2seq": lambda: get_model("seq2seq", **REDUCED["seq2seq"]),
    "deepspeech2": lambda: get_model("deepspeech2", **REDUCED["deepspeech2"]),
    **{f"cell_{s}": (lambda s=s: random_cell(s, n_in=3 + 5 * s, hidden=4 + 4 * s, batch=1 + s % 2,
                                             parts=1 + s % 3)) for s in range(4)},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rewritten_module_built_for_llvm_matches_onnxruntime(name):
    model = MODELS[name]()
    feeds = random_inputs(model, seed=1)
    imported = SplitToSlices()(from_onnx(model, keep_params_in_input=False))
    split = SplitMatMulOverConcat()(imported)
    assert split["main"].script().count("R.matmul") > imported["main"].script().count("R.matmul")
    mod = rewritten(model)
    for got, want in zip(run_tvm_cpu(mod, feeds), run_onnxruntime(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_constant_bias_moves_onto_the_first_part():
    """matmul(concat([x, h]), W) + bias -> (x @ W_x + bias) + h @ W_h: the bias becomes the input
    half's epilogue instead of an input of the recurrent tail."""
    w, bias = weight(12, 8), np.arange(8, dtype="float32")
    bb = relax.BlockBuilder()
    x, h = relax.Var("x", tensor(1, 4)), relax.Var("h", tensor(1, 8))
    with bb.function("main", [x, h]):
        with bb.dataflow():
            mm = bb.emit(relax.op.matmul(bb.emit(relax.op.concat([x, h], axis=1)), relax.const(w)))
            out = bb.emit_output(relax.op.add(mm, relax.const(bias)))
        bb.emit_func_output(out)
    before = bb.get()
    bb = relax.BlockBuilder()
    x, h = relax.Var("x", tensor(1, 4)), relax.Var("h", tensor(1, 8))
    with bb.function("main", [x, h]):
        with bb.dataflow():
            mx = bb.emit(relax.op.matmul(x, relax.const(w[:4])))
            mh = bb.emit(relax.op.matmul(h, relax.const(w[4:])))
            mxb = bb.emit(relax.op.add(mx, relax.const(bias)))
            out = bb.emit_output(relax.op.add(mxb, mh))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(SplitMatMulOverConcat()(before), bb.get())
