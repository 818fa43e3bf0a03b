"""relay_passes.float16_accumulate.Float16Accumulation: a float16 model's matmuls accumulate in
float32 (issue 34), any other module unchanged; in the pipeline at precision="float32"."""
import numpy as np
import pytest
import tvm
from tvm import relax

from relay_passes.float16_accumulate import Float16Accumulation, is_float16_model
from tvm_rammer.models import REDUCED, get_model


def _import(name, dtype):
    from tvm_rammer.driver.frontend import import_onnx

    return import_onnx(get_model(name, dtype=dtype, **REDUCED[name]))


def _matmuls(mod):
    """(input dtypes, output dtype) of every matmul call in main."""
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if isinstance(call, relax.Call) and call.op.same_as(tvm.ir.Op.get("relax.matmul")):
                found.append((tuple(str(a.ty.dtype) for a in call.args),
                              str(binding.var.ty.dtype)))
    return found


def test_a_float16_export_accumulates_in_float32_and_its_caches_are_not_cast():
    before = _import("gpt2_decode", "float16")
    assert is_float16_model(before)
    assert {out for _, out in _matmuls(before)} == {"float16"}  # control: float16 sums before
    after = Float16Accumulation()(before)
    mms = _matmuls(after)
    assert mms and all(out == "float32" and ins == ("float16", "float16") for ins, out in mms)
    text = after["main"].script()
    assert 'R.astype(past_key' not in text and "dtype=\"float32\") = R.scatter" not in text


@pytest.mark.parametrize("name", ["gpt2_decode", "bert_base"])
def test_a_float32_model_is_left_as_it_is(name):
    mod = _import(name, "float32")
    assert not is_float16_model(mod)
    tvm.ir.assert_structural_equal(Float16Accumulation()(mod), mod)


def test_a_float16_module_without_matmuls_is_left_as_it_is():
    """No float16 matmul: nothing to accumulate."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    plain = bb.get()
    assert is_float16_model(plain)
    tvm.ir.assert_structural_equal(Float16Accumulation()(plain), plain)


def test_what_a_float16_model_computes_in_float32_stays_float32():
    """HF Llama's rotary angles (``inv_freq.float() @ positions.float()``, then cos) in a
    float16 export: the float32 matmul keeps float32 operands (ToMixedPrecision cast them to
    float16: position 2049 became 2048, the angle and its cos float16); the float16 matmul beside
    it accumulates in float32; the module computes what NumPy does."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8), "float16"))
    w = relax.Var("w", relax.TensorType((8, 4), "float16"))
    pos = relax.Var("pos", relax.TensorType((1, 1), "float32"))
    inv_freq = np.array([[1.0, 0.1, 0.01, 0.001]], "float32")
    with bb.function("main", [x, w, pos]):
        with bb.dataflow():
            angle = bb.emit(relax.op.matmul(pos, relax.const(inv_freq)))
            cos = bb.emit(relax.op.astype(relax.op.cos(angle), "float16"))
            out = bb.emit_output(relax.op.add(relax.op.matmul(x, w), cos))
        bb.emit_func_output(out)
    after = Float16Accumulation()(bb.get())
    assert sorted(_matmuls(after)) == [(("float16", "float16"), "float32"),
                                       (("float32", "float32"), "float32")]
    vm = relax.VirtualMachine(tvm.compile(after, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((1, 8)).astype("float16")
    ws = rng.standard_normal((8, 4)).astype("float16")
    got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ws),
                     tvm.runtime.tensor(np.array([[2049.0]], "float32"))).numpy()
    want = xs.astype("float32") @ ws.astype("float32") + np.cos(2049.0 * inv_freq)
    np.testing.assert_allclose(got.astype("float32"), want, atol=2e-2)


def test_bert_in_float16_is_a_float16_model_by_its_output():
    """bert_base's inputs are int64 (ids, mask): its float16 hidden state says it."""
    assert is_float16_model(_import("bert_base", "float16"))


def test_in_the_pipeline_at_float32_precision_only():
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import graph_passes

    names = [p.info.name for p in graph_passes(RammerConfig())]
    assert names.index("Float16Accumulation") < names.index("DecodeAttentionSplit")
    assert "Float16Accumulation" not in [p.info.name for p in
                                         graph_passes(RammerConfig(precision="float16"))]


def test_reduced_float16_gpt2_through_the_graph_passes_matches_onnxruntime_on_llvm():
    """The graph passes (Float16Accumulation, the split, fusion) built for llvm: within float16's
    2e-2 of onnxruntime on the float16 export, at position 6."""
    pytest.importorskip("onnxruntime")
    from tir_templates.serial_run import serial_threads
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model("gpt2_decode", dtype="float16", **REDUCED["gpt2_decode"])
    mod = tvm.transform.Sequential(graph_passes(RammerConfig()))(import_onnx(model))
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc):
            mod[gv] = serial_threads(func)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(1)
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([6], np.int64)}
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float16)
    got = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in model.graph.input])
    errors = [relative_error(g.numpy(), r) for g, r in zip(got, onnx_reference(model, feeds))]
    assert max(errors) <= 2e-2, errors


def test_precision_float16_on_a_model_mixed_precision_rejects_is_one_clear_error():
    """ONNX Range of float inputs: TVM's ToMixedPrecision raises ('Expected TensorType, but got
    R.Shape'); at precision="float16" that is a ValueError saying to compile at float32, not
    TVM's traceback."""
    from onnx import TensorProto, helper

    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import mixed_precision_passes

    graph = helper.make_graph(
        [helper.make_node("Range", ["start", "limit", "delta"], ["y"])], "range",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [])
         for n in ("start", "limit", "delta")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    mod = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(ValueError, match="precision float16: .*ToMixedPrecision.*float32"):
        tvm.transform.Sequential(mixed_precision_passes(RammerConfig(precision="float16")))(mod)
