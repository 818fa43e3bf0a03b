"""The transformer zoo models of issue 34 (gpt2_decode, llama_decode, bert_base).

Reduced configurations run on onnxruntime against NumPy references written from the models'
definitions (HF's GPT-2, Llama and BERT), not from the ONNX graphs: the reference reads only the
cache slots <= position and writes the new key/value into a copy, so the graph's static-cache
semantics are pinned (slot p written, slots > p never read, slots < p read), with negative controls.
The `model` command writes files the checker accepts; a model forced to external data is read back
by `frontend.load_onnx` and `tvm-rammer inspect` from another directory; the reduced models lower
for a CUDA target without a GPU and (slow) run on the CPU emulator matching onnxruntime.
"""

import json
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tvm_rammer.models import REDUCED, get_model, save_model
from tvm_rammer.models.transformers import rope_tables

ort = pytest.importorskip("onnxruntime")

GPT2 = REDUCED["gpt2_decode"]
LLAMA = REDUCED["llama_decode"]
BERT = REDUCED["bert_base"]
NAMES = ("gpt2_decode", "llama_decode", "bert_base")


def _dims(value):
    return [d.dim_value for d in value.type.tensor_type.shape.dim]


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(None, feeds)))


def _weights(model, prefix):
    """The initializers named ``<prefix>_<n>`` in the builder's order (n ascending)."""
    found = [(int(t.name.rsplit("_", 1)[1]), numpy_helper.to_array(t).astype(np.float64))
             for t in model.graph.initializer if t.name.rsplit("_", 1)[0] == prefix]
    return [w for _, w in sorted(found, key=lambda p: p[0])]


def _decode_feeds(model, token, position, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": np.array([[token]], np.int64), "position": np.array([position], np.int64)}
    for value in model.graph.input[2:]:
        feeds[value.name] = rng.standard_normal(_dims(value)).astype(np.float32)
    return feeds


def _layer_norm(x, g, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _cached_attention(q, past_k, past_v, k, v, p, scale):
    """q [n_q, hd]; past_* [n_kv, L, hd]; k, v [n_kv, hd]. Writes slot p of copies, attends over
    slots 0..p only (query heads grouped onto the kv heads). Returns (out [n_q * hd], K, V)."""
    keys, values = past_k.copy(), past_v.copy()
    keys[:, p], values[:, p] = k, v
    group = q.shape[0] // keys.shape[0]
    out = []
    for h in range(q.shape[0]):
        kv = h // group
        probs = _softmax(keys[kv, :p + 1] @ q[h] * scale)
        out.append(probs @ values[kv, :p + 1])
    return np.concatenate(out), keys, values


def gpt2_reference(model, feeds, layers, d_model, heads, **_):
    """GPT-2 decode step in NumPy (float64): logits [vocab] and the per-layer caches."""
    hd, p = d_model // heads, int(feeds["position"][0])
    wte, wpe = _weights(model, "wte")[0], _weights(model, "wpe")[0]
    ln_g, ln_b, w, b = (_weights(model, k) for k in ("ln_g", "ln_b", "w", "b"))
    x = wte[feeds["input_ids"][0, 0]] + wpe[p]
    caches = []
    for i in range(layers):
        h = _layer_norm(x, ln_g[2 * i], ln_b[2 * i], 1e-5)
        q, k, v = np.split(h @ w[4 * i] + b[4 * i], 3)
        att, keys, values = _cached_attention(
            q.reshape(heads, hd), feeds[f"past_key_{i}"][0], feeds[f"past_value_{i}"][0],
            k.reshape(heads, hd), v.reshape(heads, hd), p, hd ** -0.5)
        x = x + att @ w[4 * i + 1] + b[4 * i + 1]
        h = _layer_norm(x, ln_g[2 * i + 1], ln_b[2 * i + 1], 1e-5) @ w[4 * i + 2] + b[4 * i + 2]
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ w[4 * i + 3] + b[4 * i + 3]
        caches += [keys, values]
    return _layer_norm(x, ln_g[-1], ln_b[-1], 1e-5) @ wte.T, caches


def llama_reference(model, feeds, layers, d_model, heads, kv_heads, **_):
    """Llama decode step in NumPy (float64): logits [vocab] and the per-layer caches."""
    hd, p = d_model // heads, int(feeds["position"][0])
    embed, gains, w = _weights(model, "embed")[0], _weights(model, "rms_g"), _weights(model, "w")
    cos_t, sin_t = rope_tables(_dims(model.graph.input[2])[2], hd, 500000.0)
    cos, sin = cos_t[p], sin_t[p]

    def rms(x, g):
        return g * x / np.sqrt((x * x).mean() + 1e-5)

    def rope(t):  # t [n, hd]
        rotated = np.concatenate([-t[:, hd // 2:], t[:, :hd // 2]], axis=1)
        return t * cos + rotated * sin

    x = embed[feeds["input_ids"][0, 0]]
    caches = []
    for i in range(layers):
        wq, wk, wv, wo, wg, wu, wd = w[7 * i:7 * i + 7]
        h = rms(x, gains[2 * i])
        att, keys, values = _cached_attention(
            rope((h @ wq).reshape(heads, hd)), feeds[f"past_key_{i}"][0],
            feeds[f"past_value_{i}"][0], rope((h @ wk).reshape(kv_heads, hd)),
            (h @ wv).reshape(kv_heads, hd), p, hd ** -0.5)
        x = x + att @ wo
        h = rms(x, gains[2 * i + 1])
        gate = h @ wg
        x = x + (gate / (1 + np.exp(-gate)) * (h @ wu)) @ wd
        caches += [keys, values]
    return rms(x, gains[-1]) @ embed.T, caches


def bert_reference(model, feeds, layers, d_model, heads, **_):
    """BERT encoder in NumPy (float64) for one sequence: [S, d] with masked keys ignored."""
    from scipy.special import erf

    hd = d_model // heads
    ids, keep = feeds["input_ids"][0], feeds["attention_mask"][0].astype(bool)
    s = ids.shape[0]
    word, pos, types = (_weights(model, k)[0] for k in ("word", "position", "token_type"))
    ln_g, ln_b, w, b = (_weights(model, k) for k in ("ln_g", "ln_b", "w", "b"))
    x = _layer_norm(word[ids] + pos[:s] + types[0], ln_g[0], ln_b[0], 1e-12)
    for i in range(layers):
        q, k, v = ((x @ w[6 * i + j] + b[6 * i + j]).reshape(s, heads, hd) for j in range(3))
        out = np.zeros((s, heads, hd))
        for h in range(heads):
            probs = _softmax(q[:, h] @ k[keep, h].T / np.sqrt(hd))
            out[:, h] = probs @ v[keep, h]
        x = _layer_norm(out.reshape(s, d_model) @ w[6 * i + 3] + b[6 * i + 3] + x,
                        ln_g[2 * i + 1], ln_b[2 * i + 1], 1e-12)
        h = x @ w[6 * i + 4] + b[6 * i + 4]
        h = h * 0.5 * (1 + erf(h / np.sqrt(2)))
        x = _layer_norm(h @ w[6 * i + 5] + b[6 * i + 5] + x, ln_g[2 * i + 2], ln_b[2 * i + 2],
                        1e-12)
    return x


def _bert_feeds(s, valid, seed=1):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, BERT["vocab"], (1, s)).astype(np.int64),
            "attention_mask": (np.arange(s) < valid)[None].astype(np.int64)}


@pytest.fixture(scope="module")
def gpt2():
    return get_model("gpt2_decode", **GPT2)


@pytest.fixture(scope="module")
def llama():
    return get_model("llama_decode", **LLAMA)


# Structure: valid ONNX at opset 17, the operators exporters write.

@pytest.mark.parametrize("name,ops,absent", [
    ("gpt2_decode", {"LayerNormalization", "Split", "ScatterND", "Tanh", "Pow", "Range", "Where",
                     "Softmax", "Gather", "Transpose"}, {"Sqrt", "Expand"}),
    ("llama_decode", {"ReduceMean", "Pow", "Sqrt", "Div", "Sigmoid", "Neg", "Slice", "Expand",
                      "ScatterND", "Gather", "Softmax"}, {"LayerNormalization", "Split"}),
    ("bert_base", {"LayerNormalization", "Erf", "Cast", "Softmax", "Gather"}, {"ScatterND"})])
def test_reduced_model_is_valid_and_written_as_exporters_write_it(name, ops, absent):
    model = get_model(name, **REDUCED[name])
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    used = {n.op_type for n in model.graph.node}
    assert ops <= used and not absent & used
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer
               if t.data_type != onnx.TensorProto.INT64)


def test_decoder_inputs_and_outputs(gpt2, llama):
    hd = GPT2["d_model"] // GPT2["heads"]
    assert [(i.name, _dims(i)) for i in gpt2.graph.input[:4]] == [
        ("input_ids", [1, 1]), ("position", [1]),
        ("past_key_0", [1, GPT2["heads"], GPT2["max_len"], hd]),
        ("past_value_0", [1, GPT2["heads"], GPT2["max_len"], hd])]
    assert [o.name for o in gpt2.graph.output] == [
        "logits", "present_key_0", "present_value_0", "present_key_1", "present_value_1"]
    assert _dims(gpt2.graph.output[0]) == [1, 1, GPT2["vocab"]]
    assert _dims(llama.graph.input[2]) == [1, LLAMA["kv_heads"], LLAMA["max_len"], hd]
    # Tied heads: one embedding initializer, read by the Gather and the head's Transpose.
    assert [t.name for t in gpt2.graph.initializer].count("wte_1") == 1
    assert sum("wte_1" in n.input for n in gpt2.graph.node) == 2


@pytest.mark.slow
def test_full_size_gpt2_small_has_124m_parameters():
    model = get_model("gpt2_decode")
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer
                 if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 1
                 and t.name.split("_")[0] in ("wte", "wpe", "w", "b", "ln"))
    assert params == 124_439_808  # HF's gpt2 (tied head counted once)
    assert len(model.graph.input) == 2 + 2 * 12
    assert _dims(model.graph.input[2]) == [1, 12, 1024, 64]


@pytest.mark.parametrize("name,kw,match", [
    ("gpt2_decode", dict(d_model=30, heads=4), r"d_model=30 is not a multiple of heads=4"),
    ("llama_decode", dict(heads=4, kv_heads=3, d_model=64), r"heads=4 is not a multiple of kv_"),
    ("bert_base", dict(layers=0), r"layers, d_model and heads must be positive"),
    ("gpt2_decode", dict(max_len=0), r"max_len=0 must be positive")])
def test_bad_sizes_are_one_clear_error(name, kw, match):
    with pytest.raises(ValueError, match=match):
        get_model(name, **kw)


# Semantics against NumPy references.

@pytest.mark.parametrize("position", [0, 5, GPT2["max_len"] - 1])
def test_gpt2_decode_matches_numpy(gpt2, position):
    feeds = _decode_feeds(gpt2, token=7, position=position)
    got = _ort(gpt2, feeds)
    logits, caches = gpt2_reference(gpt2, feeds, **GPT2)
    np.testing.assert_allclose(got["logits"][0, 0], logits, rtol=1e-4, atol=1e-4)
    assert 0.1 < np.std(logits) < 10
    for i in range(GPT2["layers"]):
        for j, kind in enumerate(("key", "value")):
            np.testing.assert_allclose(got[f"present_{kind}_{i}"][0], caches[2 * i + j],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("position", [0, 9])
def test_llama_decode_matches_numpy(llama, position):
    feeds = _decode_feeds(llama, token=42, position=position)
    got = _ort(llama, feeds)
    logits, caches = llama_reference(llama, feeds, **LLAMA)
    np.testing.assert_allclose(got["logits"][0, 0], logits, rtol=1e-4, atol=1e-4)
    assert 0.1 < np.std(logits) < 10
    for i in range(LLAMA["layers"]):
        np.testing.assert_allclose(got[f"present_key_{i}"][0], caches[2 * i], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(got[f"present_value_{i}"][0], caches[2 * i + 1], rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2_decode", "llama_decode"])
def test_index_copy_cache_write_computes_the_same_step(name):
    """cache_write="scatter_elements" (index_copy_'s export) = the ScatterND model, same weights."""
    nd = get_model(name, **REDUCED[name])
    elements = get_model(name, cache_write="scatter_elements", **REDUCED[name])
    used = {n.op_type for n in elements.graph.node}
    assert "ScatterElements" in used and "ScatterND" not in used
    feeds = _decode_feeds(nd, token=9, position=REDUCED[name]["max_len"] - 2)
    want = _ort(nd, feeds)
    for out, value in _ort(elements, feeds).items():
        np.testing.assert_array_equal(value, want[out])
    with pytest.raises(ValueError, match=r"cache_write='copy': use one of scatter_nd, scatter_"):
        get_model(name, cache_write="copy")


def test_reference_fails_on_another_position(gpt2):
    """Negative control of the references: the step at position 5 is not the one at 6."""
    feeds = _decode_feeds(gpt2, token=7, position=5)
    logits, _ = gpt2_reference(gpt2, {**feeds, "position": np.array([6])}, **GPT2)
    assert not np.allclose(_ort(gpt2, feeds)["logits"][0, 0], logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["gpt2_decode", "llama_decode"])
def test_cache_slots_after_position_are_ignored_and_slot_p_is_overwritten(name, gpt2, llama):
    model, p = (gpt2 if name == "gpt2_decode" else llama), 5
    feeds = _decode_feeds(model, token=3, position=p)
    base = _ort(model, feeds)
    for slot, layer, kind in ((p + 1, 0, "key"), (p + 3, 1, "value"), (p, 0, "key"),
                              (p, 1, "value")):
        changed = {k: v.copy() for k, v in feeds.items()}
        changed[f"past_{kind}_{layer}"][0, :, slot] += 3.0
        out = _ort(model, changed)
        np.testing.assert_array_equal(out["logits"], base["logits"])  # slot > p: never read;
        present = out[f"present_{kind}_{layer}"]                   # slot p: overwritten
        np.testing.assert_array_equal(present[0, :, p], base[f"present_{kind}_{layer}"][0, :, p])
        np.testing.assert_array_equal(np.delete(present, p, axis=2),
                                      np.delete(changed[f"past_{kind}_{layer}"], p, axis=2))
    for layer, kind in ((0, "key"), (1, "value")):  # control: slots < p are read
        changed = {k: v.copy() for k, v in feeds.items()}
        changed[f"past_{kind}_{layer}"][0, :, p - 2] += 3.0
        assert np.abs(_ort(model, changed)["logits"] - base["logits"]).max() > 1e-3


def test_batched_decode_step_is_each_sequence_alone():
    model = get_model("gpt2_decode", batch=2, **GPT2)
    one = get_model("gpt2_decode", **GPT2)
    feeds = _decode_feeds(model, token=0, position=4)
    feeds["input_ids"] = np.array([[3], [11]], np.int64)
    got = _ort(model, feeds)
    for b in range(2):
        alone = {k: (v[b:b + 1] if k.startswith("past") or k == "input_ids" else v)
                 for k, v in feeds.items()}
        ref = _ort(one, alone)
        for name, value in ref.items():
            np.testing.assert_allclose(got[name][b:b + 1], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("valid", [BERT["seq_len"], 11])
def test_bert_matches_numpy_and_masked_tokens_are_ignored(valid):
    pytest.importorskip("scipy")
    model = get_model("bert_base", **BERT)
    feeds = _bert_feeds(BERT["seq_len"], valid)
    got = _ort(model, feeds)["last_hidden_state"][0]
    np.testing.assert_allclose(got, bert_reference(model, feeds, **BERT), rtol=1e-4, atol=1e-4)
    changed = {**feeds, "input_ids": feeds["input_ids"].copy()}
    changed["input_ids"][0, -1] = (changed["input_ids"][0, -1] + 1) % BERT["vocab"]
    other = _ort(model, changed)["last_hidden_state"][0]
    if valid < BERT["seq_len"]:  # the last token is masked: no other row sees it
        np.testing.assert_allclose(other[:-1], got[:-1], rtol=1e-6, atol=1e-6)
    else:  # control: unmasked, every row attends to it
        assert np.abs(other[0] - got[0]).max() > 1e-4


# float16 exports (dtype="float16"): what torch.onnx.export writes for a float16 HF model.

F16 = onnx.TensorProto.FLOAT16


def _float_inits(model):
    return [t for t in model.graph.initializer
            if t.data_type in (onnx.TensorProto.FLOAT, F16)]


@pytest.mark.parametrize("name,casts", [
    ("gpt2_decode", 0), ("llama_decode", 2 * (2 * LLAMA["layers"] + 1) + 2 * LLAMA["layers"]),
    ("bert_base", 1)])
def test_float16_export_is_the_float32_model_in_float16(name, casts):
    """Same seed, same graph: every weight the float32 one rounded, float16 caches, logits and
    hidden states, int64 ids and positions; the mask constant finfo(float16).min; Casts only where
    HF upcasts (Llama: each RMSNorm and each attention softmax, two each; BERT: its mask)."""
    m32 = get_model(name, **REDUCED[name])
    m16 = get_model(name, dtype="float16", **REDUCED[name])
    onnx.checker.check_model(m16, full_check=True)
    onnx.shape_inference.infer_shapes(m16, strict_mode=True)
    for a, b in ((m16.graph.input, m32.graph.input), (m16.graph.output, m32.graph.output)):
        assert [(v.name, _dims(v)) for v in a] == [(v.name, _dims(v)) for v in b]
        assert [v.type.tensor_type.elem_type for v in a] == [
            F16 if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT else
            v.type.tensor_type.elem_type for v in b]
    w16, w32 = _float_inits(m16), _float_inits(m32)
    assert len(w16) == len(w32)
    upcast = 0
    for t16, t32 in zip(w16, w32):
        a, b = numpy_helper.to_array(t16), numpy_helper.to_array(t32)
        if t16.name.startswith("min_"):  # the mask's finfo.min: float16's own (below)
            continue
        if t16.data_type == onnx.TensorProto.FLOAT:  # what Llama's RMSNorm computes in float32
            upcast += 1
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(a, b.astype(np.float16))
    assert upcast == (3 * (2 * LLAMA["layers"] + 1) if name == "llama_decode" else 0)
    ops16 = [n.op_type for n in m16.graph.node]
    assert ops16.count("Cast") - [n.op_type for n in m32.graph.node].count("Cast") == (
        casts if name != "bert_base" else 0)
    assert ops16.count("Cast") == casts
    mins = [numpy_helper.to_array(t) for t in w16 if t.name.startswith("min_")]
    assert mins and all(m.dtype == np.float16 and m == np.finfo(np.float16).min for m in mins)


def _half_feeds(feeds):
    return {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}


@pytest.mark.parametrize("name,position", [("gpt2_decode", 0), ("gpt2_decode", 6),
                                           ("gpt2_decode", GPT2["max_len"] - 1),
                                           ("llama_decode", 0), ("llama_decode", 9),
                                           ("llama_decode", LLAMA["max_len"] - 1)])
def test_float16_decoder_matches_float32_on_onnxruntime(name, position):
    """onnxruntime on the float16 export against the float32 one on the same (float16-exact)
    inputs: within float16's tolerance (2e-2 of each output's scale), and not bit-equal (computed
    in float16 indeed); control: the float32 step at another position is outside it."""
    from tvm_rammer.numerics import relative_error

    m32 = get_model(name, **REDUCED[name])
    m16 = get_model(name, dtype="float16", **REDUCED[name])
    feeds = {k: v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v
             for k, v in _decode_feeds(m32, token=7, position=position).items()}
    want, got = _ort(m32, feeds), _ort(m16, _half_feeds(feeds))
    assert all(v.dtype == np.float16 for v in got.values())
    errors = [relative_error(got[k].astype(np.float32), want[k]) for k in want]
    assert max(errors) <= 2e-2 and errors[0] > 1e-6, errors
    other = _ort(m32, {**feeds, "position": np.array([(position + 3) % REDUCED[name]["max_len"]])})
    assert relative_error(got["logits"].astype(np.float32), other["logits"]) > 5e-2


def test_float16_bert_matches_float32_on_onnxruntime():
    from tvm_rammer.numerics import relative_error

    m32 = get_model("bert_base", **BERT)
    m16 = get_model("bert_base", dtype="float16", **BERT)
    feeds = _bert_feeds(BERT["seq_len"], 11)
    got = _ort(m16, feeds)["last_hidden_state"]
    want = _ort(m32, feeds)["last_hidden_state"]
    assert got.dtype == np.float16
    assert 1e-6 < relative_error(got.astype(np.float32), want) <= 2e-2
    other = _ort(m32, _bert_feeds(BERT["seq_len"], 12))["last_hidden_state"]  # control
    assert relative_error(got.astype(np.float32), other) > 5e-2


def test_float16_model_command_and_a_bad_dtype(tmp_path):
    from tvm_rammer.cli import main

    out = tmp_path / "g16.onnx"
    assert main(["model", "gpt2_decode", "-o", str(out), "--param", "dtype=float16"] + [
        f"--param={k}={v}" for k, v in GPT2.items()]) == 0
    assert onnx.load(str(out)).SerializeToString() == get_model(
        "gpt2_decode", dtype="float16", **GPT2).SerializeToString()
    with pytest.raises(ValueError, match=r"^gpt2_decode: dtype='half': use one of float32, "
                                         r"float16$"):
        get_model("gpt2_decode", dtype="half", **GPT2)


def test_runner_random_inputs_are_valid_indices(gpt2):
    """`tvm-rammer run/check` feed runner.random_inputs: integer inputs are 0 (a normal draw cast
    to int64 would give -1: an out-of-bounds Gather on the GPU)."""
    from tvm_rammer.run.runner import random_inputs

    feeds = random_inputs(gpt2, seed=3)
    assert feeds["input_ids"].dtype == np.int64 and not feeds["input_ids"].any()
    assert feeds["position"].tolist() == [0] and feeds["past_key_0"].dtype == np.float32
    logits = _ort(gpt2, feeds)["logits"]
    np.testing.assert_allclose(logits[0, 0], gpt2_reference(gpt2, feeds, **GPT2)[0], rtol=1e-4,
                               atol=1e-4)


# Files: the model command, external data.

def test_model_command_writes_a_checked_file(tmp_path, capsys):
    from tvm_rammer.cli import main

    out = tmp_path / "gpt2.onnx"
    args = ["model", "gpt2_decode", "-o", str(out)] + [
        f"--param={k}={v}" for k, v in GPT2.items()]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert model.SerializeToString() == get_model("gpt2_decode", **GPT2).SerializeToString()
    assert not (tmp_path / "gpt2.onnx.data").exists()  # small: one file
    assert main(["model", "llama_decode", "-o", str(tmp_path / "l.onnx"), "--param",
                 "kv_heads=2", "--param", "layers=1", "--param", "d_model=32", "--param",
                 "heads=4", "--param", "d_ff=64", "--param", "vocab=50", "--param",
                 "max_len=8"]) == 0
    onnx.checker.check_model(str(tmp_path / "l.onnx"))


def test_external_data_is_written_and_read_back_relative_to_the_file(tmp_path, monkeypatch,
                                                                      gpt2):
    from tvm_rammer.driver.frontend import load_onnx

    folder = tmp_path / "models"
    folder.mkdir()
    model = onnx.ModelProto()
    model.CopyFrom(gpt2)
    data = save_model(model, str(folder / "g.onnx"), external_data=True)
    assert data == str(folder / "g.onnx.data") and os.path.getsize(data) > 100_000
    assert os.path.getsize(folder / "g.onnx") < 50_000  # the graph only
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_onnx(os.path.join("..", "models", "g.onnx"))
    onnx.checker.check_model(loaded)
    feeds = _decode_feeds(gpt2, token=7, position=3)
    for name, value in _ort(gpt2, feeds).items():
        np.testing.assert_array_equal(_ort(loaded, feeds)[name], value)
    # Moved together, the pair still loads; the data alone missing is one clear error.
    shutil.move(str(folder), str(tmp_path / "moved"))
    assert len(load_onnx(str(tmp_path / "moved" / "g.onnx")).graph.initializer) == len(
        gpt2.graph.initializer)
    os.remove(tmp_path / "moved" / "g.onnx.data")
    with pytest.raises(ValueError, match=r"is not a readable ONNX model"):
        load_onnx(str(tmp_path / "moved" / "g.onnx"))


def test_save_model_chooses_external_data_past_the_limit(tmp_path, monkeypatch, gpt2):
    from tvm_rammer.models import _save

    assert save_model(gpt2, str(tmp_path / "a.onnx")) is None
    monkeypatch.setattr(_save, "EXTERNAL_ABOVE", 1000)  # as if past 2 GiB
    model = onnx.ModelProto()
    model.CopyFrom(gpt2)
    assert save_model(model, str(tmp_path / "b.onnx")) == str(tmp_path / "b.onnx.data")
    assert _save.weight_bytes(gpt2) > 1000


# Compilation for a CUDA target without a GPU, and the emulator.

def test_inspect_lowers_an_external_data_model_for_cuda(tmp_path, capsys, gpt2):
    """``tvm-rammer inspect --json`` (profile off) reads the file with its external data and lowers
    it with the rammer pipeline: fewer launches than TVM's default."""
    from tvm_rammer.cli import main

    model = onnx.ModelProto()
    model.CopyFrom(gpt2)
    save_model(model, str(tmp_path / "g.onnx"), external_data=True)
    assert main(["inspect", str(tmp_path / "g.onnx"), "--no-profile", "--json", "--brief"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rprograms"] >= 1
    assert summary["launches"] < summary["default_launches"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_reduced_model_on_the_emulator_matches_onnxruntime(name):
    """The rammer pipeline's CUDA (2 SMs x 2 vEUs) on the CPU emulator against onnxruntime, with
    valid token ids and positions (fp32: relative error <= 1e-4)."""
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model(name, **REDUCED[name])
    if name == "bert_base":
        feeds = _bert_feeds(BERT["seq_len"], 11)
    else:
        feeds = _decode_feeds(model, token=5, position=6)
    result = emulator.emulate(model, feeds, config=RammerConfig(num_sms=2, veus_per_sm=2))
    ref = onnx_reference(model, feeds)
    errors = [relative_error(o, r) for o, r in zip(result.outputs, ref)]
    assert len(result.outputs) == len(ref) and max(errors) <= 1e-4, errors


def test_a_model_past_the_check_limit_is_checked_without_its_weights(monkeypatch, gpt2):
    """Past protobuf's 2 GiB, onnx.checker cannot take the model in memory (it serialises it):
    import_onnx checks a copy without the weights' bytes (forced here by a lower limit), which
    still catches a broken graph (negative control)."""
    from tvm_rammer.driver import frontend

    monkeypatch.setattr(frontend, "CHECK_WEIGHTS_BELOW", 10_000)
    light = frontend._checkable(gpt2)
    assert light is not gpt2 and light.ByteSize() < 100_000
    assert "main" in [gv.name_hint for gv in frontend.import_onnx(gpt2).get_global_vars()]
    broken = onnx.ModelProto()
    broken.CopyFrom(gpt2)
    broken.graph.node[5].input[0] = "no_such_tensor"
    with pytest.raises(ValueError, match=r"^invalid ONNX model: .*no_such_tensor"):
        frontend.import_onnx(broken)
    monkeypatch.setattr(frontend, "CHECK_WEIGHTS_BELOW", 1 << 30)
    assert frontend._checkable(gpt2) is gpt2


@pytest.mark.parametrize("name", NAMES)
def test_lean_build_writes_what_graph_builder_writes(name, monkeypatch):
    """The transformers' build (weights moved, not copied: Llama-3.2-1B's shape is 5 GB) gives
    GraphBuilder.build's model byte for byte."""
    from tvm_rammer.models import transformers
    from tvm_rammer.models._builder import GraphBuilder

    lean = get_model(name, **REDUCED[name]).SerializeToString()
    monkeypatch.setattr(transformers._Builder, "build", GraphBuilder.build)
    assert get_model(name, **REDUCED[name]).SerializeToString() == lean


def _opset23_node(op, inputs, input_infos, inits=()):
    """A one-node model at opset 23 (IR 10), as torch.onnx's dynamo exporter writes
    scaled_dot_product_attention (Attention) and rotary embeddings (RotaryEmbedding) there."""
    from onnx import TensorProto, helper

    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 8])
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], name=f"{op.lower()}_0")], "g",
                              input_infos, [out], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def test_operators_tvm_cannot_import_are_one_line_naming_them(capsys):
    """Opset 23's Attention reaches TVM's com.microsoft-style converter (KeyError 'num_heads',
    after printing its inputs): the error names the operator and the opset, on one line, and
    nothing is printed; RotaryEmbedding (no converter) is named too."""
    from onnx import TensorProto, helper

    from tvm_rammer.driver.frontend import import_onnx

    def info(name, shape, kind=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, kind, shape)

    attention = _opset23_node("Attention", ["q", "k", "v"], [
        info("q", [1, 4, 1, 8]), info("k", [1, 4, 16, 8]), info("v", [1, 4, 16, 8])])
    with pytest.raises(ValueError) as err:
        import_onnx(attention)
    text = str(err.value)
    assert "\n" not in text and "cannot import operator Attention of this model (opset 23)" in text
    assert "num_heads" in text
    rotary = _opset23_node("RotaryEmbedding", ["x", "c", "s", "p"], [
        info("x", [1, 4, 1, 8]), info("p", [1, 1], TensorProto.INT64)], [
        numpy_helper.from_array(np.ones((16, 4), np.float32), "c"),
        numpy_helper.from_array(np.zeros((16, 4), np.float32), "s")])
    with pytest.raises(ValueError, match=r"^TVM's ONNX frontend cannot import this model: .*"
                                         r"not supported.*: RotaryEmbedding$"):
        import_onnx(rotary)
    captured = capsys.readouterr()
    assert "Error converting operator" not in captured.out + captured.err


@pytest.mark.slow
def test_gpt2_decode_in_float16_on_the_emulator():
    """RammerConfig(precision="float16") on the fp32 export: TVM writes htanh for the GELU's Tanh
    (the emulator's half header has it); within float16's tolerance 2e-2, and computed in half
    indeed (not float32's ~1e-7)."""
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model("gpt2_decode", **GPT2)
    feeds = _decode_feeds(model, token=5, position=6)
    config = RammerConfig(precision="float16", num_sms=2, veus_per_sm=2)
    result = emulator.emulate(model, feeds, config=config)
    errors = [relative_error(o, r) for o, r in zip(result.outputs, onnx_reference(model, feeds))]
    assert max(errors) <= 2e-2 and errors[0] > 1e-5, errors


def test_reference_of_a_model_past_the_protobuf_limit_runs_from_a_file(monkeypatch, gpt2):
    """runner.onnx_reference (run / check / --emulate) cannot serialise a model past 2 GiB: above
    REFERENCE_IN_MEMORY_BELOW (lowered here) onnxruntime reads it from a temporary file with
    external data; same outputs, the caller's model untouched."""
    from tvm_rammer.run import runner

    feeds = _decode_feeds(gpt2, token=7, position=3)
    want = runner.onnx_reference(gpt2, feeds)
    before = gpt2.SerializeToString()
    calls = []
    real = runner._reference_from_file
    monkeypatch.setattr(runner, "_reference_from_file",
                        lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(runner, "REFERENCE_IN_MEMORY_BELOW", 10_000)
    got = runner.onnx_reference(gpt2, feeds)
    assert calls and gpt2.SerializeToString() == before
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
