"""Model zoo: every model builds, passes the ONNX checker and strict shape inference, runs on
onnxruntime with finite O(1) outputs at a reduced size, imports into TVM's Relax ONNX frontend,
and has the paper's structure at full size (counted, not run)."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tvm_rammer.models import MODELS, REDUCED, get_model
from tvm_rammer.models.nasbench import random_cell
from tvm_rammer.models.randwire import watts_strogatz

ort = pytest.importorskip("onnxruntime")



def _shape(value_info):
    return [d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _feed(value, rng):
    """Standard-normal floats; integer inputs (the transformers' token ids, position, attention
    mask) are 1: a valid token, cache slot and mask everywhere."""
    if value.type.tensor_type.elem_type == onnx.TensorProto.INT64:
        return np.ones(_shape(value), np.int64)
    return rng.standard_normal(_shape(value)).astype(np.float32)


def _run(model, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {i.name: _feed(i, rng) for i in model.graph.input}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return feeds, sess.run(None, feeds)


def _count(model, op_type):
    return sum(n.op_type == op_type for n in model.graph.node)


def _params(model):
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


def _weights(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture(scope="module", params=sorted(REDUCED))
def reduced(request):
    return request.param, get_model(request.param, batch=2, **REDUCED[request.param])


def test_every_model_has_a_reduced_config():
    assert set(REDUCED) == set(MODELS)


def test_reduced_model_is_valid_onnx(reduced):
    _, model = reduced
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer
               if t.name.startswith("w_"))
    assert len({n.name for n in model.graph.node}) == len(model.graph.node)
    assert "LSTM" not in {n.op_type for n in model.graph.node}


def test_reduced_model_runs_with_finite_order_one_outputs(reduced):
    name, model = reduced
    _, (y, *_caches) = _run(model)  # the decoders also return their KV caches
    assert list(y.shape) == _shape(model.graph.output[0])
    assert y.shape[0] == (2 * REDUCED[name].get("rows", 1) if name == "two_branch" else 2)
    assert np.isfinite(y).all()
    assert 1e-3 < float(np.std(y)) < 1e2, f"{name}: activations are not O(1)"


def test_reduced_model_imports_into_tvm(reduced):
    from_onnx = pytest.importorskip("tvm.relax.frontend.onnx").from_onnx
    _, model = reduced
    mod = from_onnx(model, keep_params_in_input=False)
    assert "main" in [gv.name_hint for gv in mod.get_global_vars()]


def test_get_model_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"unknown model 'resnet50'; valid names: alexnet, "):
        get_model("resnet50")


def test_models_are_deterministic():
    a = get_model("nasbench_cell", **REDUCED["nasbench_cell"])
    b = get_model("nasbench_cell", **REDUCED["nasbench_cell"])
    assert a.SerializeToString() == b.SerializeToString()


def test_two_branch_matches_numpy():
    model = get_model("two_branch", **REDUCED["two_branch"])
    feeds, (y,) = _run(model)
    w = [v for v in _weights(model).values() if v.ndim == 2]
    x = feeds["input"]
    np.testing.assert_allclose(y, np.maximum(x @ w[0], 0) + np.maximum(x @ w[1], 0), rtol=1e-5)


@pytest.mark.parametrize("join,width", [("sum", 8), ("add_chain", 8), ("concat", 32)])
def test_branches_joins(join, width):
    model = get_model("branches", m=3, join=join, activation="tanh", **REDUCED["branches"])
    feeds, (y,) = _run(model)
    ws = [v for v in _weights(model).values() if v.ndim == 2]
    parts = [np.tanh(feeds["input"] @ w) for w in ws]
    ref = np.concatenate(parts, axis=1) if join == "concat" else sum(parts)
    assert y.shape == (3, width)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    assert _count(model, "MatMul") == 4


def test_branches_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"activation='gelu' is not supported; use one of"):
        get_model("branches", activation="gelu")
    with pytest.raises(ValueError, match=r"join='max' is not supported; use one of"):
        get_model("branches", join="max")
    with pytest.raises(ValueError, match=r"n=0 branches: need at least 1"):
        get_model("branches", n=0)


def test_size_arguments_are_checked():
    with pytest.raises(ValueError, match=r"image_size=64 is too small for Inception-v3"):
        get_model("inception_v3", image_size=64)
    with pytest.raises(ValueError, match=r"image_size=32 is too small for AlexNet"):
        get_model("alexnet", image_size=32)
    with pytest.raises(ValueError, match=r"dec_layers=5 > enc_layers=4"):
        get_model("seq2seq", enc_layers=4, dec_layers=5)
    with pytest.raises(ValueError, match=r"even k with 0 < k < n"):
        watts_strogatz(8, 3, 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"max_ops=0: a cell needs at least one operator"):
        random_cell(0, max_ops=0)


def test_watts_strogatz_keeps_edge_count_and_is_a_dag():
    edges = watts_strogatz(32, 4, 0.75, np.random.default_rng(0))
    assert len(edges) == len(set(edges)) == 32 * 4 // 2
    assert all(a < b for a, b in edges)


def test_nasbench_cells_vary_and_stay_valid():
    sizes = set()
    for seed in range(40):
        cell, sinks = random_cell(seed, max_ops=9)
        sizes.add(len(cell))
        assert 1 <= len(cell) <= 9 and sinks
        assert all(preds and max(preds) <= v for v, (_, preds) in enumerate(cell))
    assert len(sizes) > 4
    for seed in range(5):
        model = get_model("nasbench_cell", seed=seed, join="sum", channels=4, image_size=4)
        onnx.checker.check_model(model)
        _, (y,) = _run(model)
        assert y.shape == (1, 4, 4, 4) and np.isfinite(y).all()


# Full-size configurations: structure only (running them is slow on a CPU).

def test_deepspeech2_full_unrolls_7_layers_by_300_steps():
    model = get_model("deepspeech2")
    assert _count(model, "MatMul") == 7 * 300 + 1
    assert _count(model, "Conv") == 2
    assert _count(model, "Split") == 7 * 300 + 1
    assert _shape(model.graph.input[0]) == [1, 1, 161, 300]
    assert _shape(model.graph.output[0]) == [1, 300, 29]
    lstm_w = [t for t in model.graph.initializer if t.name.startswith("lstm_w")]
    assert [tuple(t.dims) for t in lstm_w] == [(32 * 41 + 256, 1024)] + [(512, 1024)] * 6


def test_lstm_tc_full_unrolls_10_layers_by_100_steps():
    model = get_model("lstm_tc")
    assert _count(model, "MatMul") == 10 * 100
    assert _count(model, "Sigmoid") == 3 * 10 * 100
    assert _shape(model.graph.output[0]) == [1, 256]


def test_seq2seq_full_encoder_8x100_decoder_4x30():
    model = get_model("seq2seq")
    assert _count(model, "MatMul") == 8 * 100 + 4 * 30
    assert [_shape(i) for i in model.graph.input] == [[1, 100, 128], [1, 30, 128]]
    assert _shape(model.graph.output[0]) == [1, 30, 128]


def test_resnext29_full_is_16x64d():
    model = get_model("resnext29")
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    groups = [a.i for n in convs for a in n.attribute if a.name == "group" and a.i > 1]
    assert len(convs) == 1 + 9 * 3 + 3
    assert groups == [16] * 9
    assert _shape(model.graph.output[0]) == [1, 10]
    assert 68.0e6 < _params(model) < 68.2e6


def test_nasnet_cifar_full_is_6_at_768():
    model = get_model("nasnet_cifar")
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert _weights(model)[gemm.input[1]].shape == (768, 10)
    assert _count(model, "Concat") == 20 + 2
    assert 3.2e6 < _params(model) < 3.4e6


@pytest.mark.parametrize("name,low,high", [
    ("inception_v3", 23.7e6, 23.9e6), ("squeezenet", 1.23e6, 1.24e6),
    ("googlenet", 6.9e6, 7.1e6), ("randwire", 5.5e6, 5.9e6), ("alexnet", 62.0e6, 62.5e6)])
def test_imagenet_models_full_parameter_counts(name, low, high):
    model = get_model(name)
    assert low < _params(model) < high
    assert _shape(model.graph.output[0]) == [1, 1000]


def test_randwire_full_has_three_stages_of_32_nodes():
    model = get_model("randwire")
    depthwise = [n for n in model.graph.node if n.op_type == "Conv"
                 and any(a.name == "group" and a.i > 1 for a in n.attribute)]
    assert len(depthwise) == 3 * 32
