"""Transformer models of issue 34: a GPT-2 and a Llama decode step with a static KV cache, and a
BERT encoder, written node for node as ``torch.onnx.export`` (opset 17) writes the Hugging Face
models.

Inputs and outputs (``d``: d_model, ``H``: heads, ``KV``: kv_heads, ``hd = d / H``, ``L``: max_len):

- ``gpt2_decode`` / ``llama_decode``: ``input_ids`` int64 [B, 1], ``position`` int64 [1] (the
  cache slot of this token, the same for the B sequences, 0 <= position < L), then per layer
  ``past_key_i`` and ``past_value_i`` float32 (float16 with ``dtype="float16"``) [B, H, L, hd]
  (Llama: [B, KV, L, hd]); outputs ``logits`` [B, 1, vocab], then per layer ``present_key_i`` /
  ``present_value_i``: the caches with this token's key and value written at ``position``
  (ScatterND, as an exported ``cache[:, :, position] = new`` is).
  Attention covers all L slots with an additive mask, ``finfo(dtype).min`` where the slot is past
  ``position`` (``Range`` / ``Greater`` / ``Where``, as HF builds its causal mask from
  ``cache_position``), so the slots after the current one are never read into the result.
- ``bert_base``: ``input_ids`` int64 [B, S] and ``attention_mask`` int64 [B, S] (1 = attend);
  output ``last_hidden_state`` [B, S, d]. ``B`` is ``batch`` (default 1).

Weights are random from one seed: embeddings and projections scaled by 1/sqrt(fan_in) so
activations and logits stay O(1); norm gains near 1. Large weights are drawn directly in float32
(Llama-3.2-1B's shape is 1.24 G parameters). Save with :func:`tvm_rammer.models.save_model`, which
writes external data past ONNX's 2 GiB protobuf limit.

``dtype="float16"`` (every builder) writes what ``torch.onnx.export`` writes for the model loaded
with ``torch_dtype=torch.float16``: the float32 model's weights (same seed) rounded to float16,
float16 caches, logits and hidden states; token ids, positions and the BERT mask input stay int64.
The mask constants become ``finfo(float16).min``; LayerNormalization, GPT-2's and BERT's Softmax,
the GELUs and SiLU run in float16 as HF's modules do, and only what HF upcasts is cast: Llama's
RMSNorm (``hidden_states.to(torch.float32)`` ... ``.to(input_dtype)``: Cast, the norm in float32,
Cast back, then the float16 gain) and its attention softmax (``softmax(..., dtype=torch.float32)
.to(query.dtype)``: Cast, Softmax, Cast). Rotary tables are float16 (HF's ``cos.to(x.dtype)``).
"""

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._builder import IR_VERSION, OPSET, GraphBuilder

CACHE_WRITES = ("scatter_nd", "scatter_elements")
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}


class _Builder(GraphBuilder):
    """GraphBuilder with the few things transformer graphs add: int64 inputs, float32 draws, the
    batch of every activation's shape, the model's float ``dtype`` (float32 or float16: weights,
    float inputs and constants; draws are made in float32 and rounded, so both dtypes hold the
    same weights)."""

    def __init__(self, name, seed, batch, dtype="float32"):
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype={dtype!r}: use one of {', '.join(DTYPES)}")
        super().__init__(name, seed)
        self.batch = batch
        self.float, self.elem = DTYPES[dtype]

    @property
    def half(self):
        return self.float is np.float16

    def build(self, outputs):
        """GraphBuilder.build's model, made without copying the weights more than once (its
        make_graph / make_model / shape-inference copies would hold Llama-3.2-1B's 5 GB four
        times): the initializers move into the model one by one, shapes are inferred on the
        graph alone with the float weights declared as inputs (the integer constants kept: Reshape
        shapes and the like)."""
        model = helper.make_model(
            helper.make_graph(self.nodes, self.name, self.inputs,
                              [helper.make_tensor_value_info(o, self.elem, None)
                               for o in outputs]),
            opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tvm_rammer.models")
        model.ir_version = IR_VERSION
        light = onnx.ModelProto()
        light.CopyFrom(model)
        floats = [t for t in self.initializers
                  if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)]
        light.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in floats)
        light.graph.initializer.extend(t for t in self.initializers  # shapes, axes, indices
                                       if t not in floats)
        shapes = {v.name: v for v in onnx.shape_inference.infer_shapes(light).graph.output}
        del model.graph.output[:]
        model.graph.output.extend(shapes[o] for o in outputs)
        while self.initializers:
            model.graph.initializer.append(self.initializers.pop(0))
        return model

    def input(self, name, shape):
        """A float input (a cache) of the model's dtype."""
        self.inputs.append(helper.make_tensor_value_info(name, self.elem, list(shape)))
        return name

    def int_input(self, name, shape):
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, list(shape)))
        return name

    def randn(self, shape, std, prefix="w"):
        """Normal(0, std) weight drawn in float32 (no float64 copy of a 1 GB embedding), in the
        model's dtype."""
        w = self.rng.standard_normal(size=shape, dtype=np.float32)
        w *= np.float32(std)
        return self.const(w.astype(self.float, copy=False), prefix)

    def gain(self, n, prefix="g"):
        return self.floats(1.0 + 0.1 * self.rng.standard_normal(n, dtype=np.float32), prefix)

    def shift(self, n, prefix="b"):
        return self.floats(0.02 * self.rng.standard_normal(n, dtype=np.float32), prefix)

    def floats(self, values, prefix="f"):
        """A constant of the model's dtype (float32 values rounded to float16 there)."""
        return self.const(np.asarray(values, dtype=np.float32).astype(self.float), prefix)

    def ints(self, values, prefix="i"):
        return self.const(np.asarray(values, dtype=np.int64), prefix)

    def scalar(self, value, prefix="s", dtype=None):
        """A one-element constant of the model's dtype (``dtype="float32"``: float32 always, for
        what a float16 model computes upcast)."""
        kind = np.float32 if dtype == "float32" else self.float
        return self.const(np.asarray(value, dtype=np.float32).astype(kind), prefix)

    def cast(self, x, to_float32):
        """Cast ``x`` to float32 (True) or back to the model's dtype (False)."""
        return self.node("Cast", [x], to=TensorProto.FLOAT if to_float32 else self.elem)

    def min_value(self):
        """finfo(dtype).min: HF's masked-score constant for the model's dtype."""
        return float(np.finfo(self.float).min)

    def linear(self, x, n_in, n_out, bias=True):
        """``x @ W (+ b)``: MatMul then Add, as torch exports nn.Linear on a 3-D input."""
        y = self.node("MatMul", [x, self.randn((n_in, n_out), n_in ** -0.5)])
        return self.add(y, self.shift(n_out)) if bias else y

    def layer_norm(self, x, d, eps):
        return self.node("LayerNormalization", [x, self.gain(d, "ln_g"), self.shift(d, "ln_b")],
                         axis=-1, epsilon=eps)

    def heads(self, x, n_heads, head_dim, seq=1):
        """[B, seq, n*hd] -> [B, n, seq, hd] (Reshape, Transpose)."""
        y = self.reshape(x, [self.batch, seq, n_heads, head_dim])
        return self.node("Transpose", [y], perm=[0, 2, 1, 3])

    def merge_heads(self, x, d, seq=1):
        """[B, n, seq, hd] -> [B, seq, d]."""
        return self.reshape(self.node("Transpose", [x], perm=[0, 2, 1, 3]), [self.batch, seq, d])

    def unsqueeze(self, x, axes):
        return self.node("Unsqueeze", [x, self.ints(axes, "axes")])


def _check(name, layers, d_model, heads, **more):
    if layers < 1 or d_model < 1 or heads < 1:
        raise ValueError(f"{name}: layers, d_model and heads must be positive "
                         f"(got {layers}, {d_model}, {heads})")
    if d_model % heads:
        raise ValueError(f"{name}: d_model={d_model} is not a multiple of heads={heads}")
    for key, value in more.items():
        if value < 1:
            raise ValueError(f"{name}: {key}={value} must be positive")


def _cache_step(g, past, new, position, n_heads, head_dim, cache_write):
    """``past`` [B, n, L, hd] with ``new`` [B, n, 1, hd] written at slot ``position``:
    ``scatter_nd``: ScatterND with indices [B, n, 1, 3] = (b, h, position), as an exported
    ``cache[:, :, position] = new`` (index_put) is; ``scatter_elements``: ScatterElements on axis 2
    with the position expanded to [B, n, 1, hd], as an exported ``cache.index_copy_(2, position,
    new)`` (HF's StaticCache.update) is."""
    if cache_write == "scatter_elements":
        shape = [g.batch, n_heads, 1, head_dim]
        index = g.node("Expand", [g.reshape(position, [1, 1, 1, 1]), g.ints(shape, "shape")])
        return g.node("ScatterElements", [past, index, new], axis=2)
    base = np.zeros((g.batch, n_heads, 1, 3), dtype=np.int64)
    base[:, :, 0, 0] = np.arange(g.batch)[:, None]
    base[:, :, 0, 1] = np.arange(n_heads)
    slot = g.mul(position, g.ints([0, 0, 1], "slot_axis"))  # [1] * [3] -> (0, 0, p)
    indices = g.add(g.const(base, "cache_idx"), slot)
    return g.node("ScatterND", [past, indices, new])


def _check_cache_write(cache_write):
    if cache_write not in CACHE_WRITES:
        raise ValueError(f"cache_write={cache_write!r}: use one of {', '.join(CACHE_WRITES)}")


def _decode_mask(g, position, max_len):
    """Additive mask [max_len]: 0 at slots <= position, finfo(dtype).min after."""
    slots = g.node("Range", [g.ints(0, "start"), g.ints(max_len, "limit"), g.ints(1, "delta")])
    after = g.node("Greater", [slots, position])
    return g.node("Where", [after, g.scalar(g.min_value(), "min"), g.scalar(0.0, "zero")])


def _attend(g, q, k, v, mask, head_dim, divide, upcast=False):
    """softmax(q k^T * scale + mask) v over the cache's slots; GPT-2 divides by sqrt(hd), Llama
    multiplies by its inverse (as each HF model writes it). ``upcast`` (Llama in float16): the
    softmax in float32 between two Casts."""
    scores = g.node("MatMul", [q, g.node("Transpose", [k], perm=[0, 1, 3, 2])])
    if divide:
        scores = g.node("Div", [scores, g.scalar(np.sqrt(head_dim), "sqrt_hd")])
    else:
        scores = g.mul(scores, g.scalar(head_dim ** -0.5, "scale"))
    scores = g.add(scores, mask)
    if upcast and g.half:
        probs = g.cast(g.node("Softmax", [g.cast(scores, True)], axis=-1), False)
    else:
        probs = g.node("Softmax", [scores], axis=-1)
    return g.node("MatMul", [probs, v])


def _gelu_tanh(g, x):
    """HF's NewGELUActivation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    cube = g.node("Pow", [x, g.scalar(3.0, "three")])
    inner = g.mul(g.add(x, g.mul(cube, g.scalar(0.044715, "c"))),
                  g.scalar(np.sqrt(2.0 / np.pi), "k"))
    return g.mul(g.mul(x, g.scalar(0.5, "half")), g.add(g.tanh(inner), g.scalar(1.0, "one")))


def gpt2_decode(layers=12, d_model=768, heads=12, vocab=50257, max_len=1024,
                cache_write="scatter_nd", dtype="float32", batch=1, seed=0):
    """One GPT-2 decode step with a static KV cache (GPT-2 small by default).

    Source: HF transformers' GPT2LMHeadModel (token + learned position embeddings, pre-LayerNorm
    blocks with a fused QKV MatMul + Split, tanh-GELU MLP, final LayerNorm, LM head tied to the
    token embedding: MatMul by its Transpose). Inputs and outputs: see the module docstring.
    ``cache_write``: "scatter_nd" (index_put's export) or "scatter_elements" (index_copy_'s).
    ``dtype``: "float32" or "float16" (the module docstring).
    """
    _check_cache_write(cache_write)
    _check("gpt2_decode", layers, d_model, heads, vocab=vocab, max_len=max_len, batch=batch)
    d, hd = d_model, d_model // heads
    g = _Builder("gpt2_decode", seed, batch, dtype)
    ids, pos = g.int_input("input_ids", [batch, 1]), g.int_input("position", [1])
    wte = g.randn((vocab, d), d ** -0.5, "wte")
    x = g.add(g.node("Gather", [wte, ids], axis=0),
              g.node("Gather", [g.randn((max_len, d), d ** -0.5, "wpe"), pos], axis=0))
    mask = _decode_mask(g, pos, max_len)
    presents = []
    for i in range(layers):
        past_k = g.input(f"past_key_{i}", [batch, heads, max_len, hd])
        past_v = g.input(f"past_value_{i}", [batch, heads, max_len, hd])
        qkv = g.linear(g.layer_norm(x, d, 1e-5), d, 3 * d)
        q, k, v = g.node("Split", [qkv, g.ints([d, d, d], "split")], n_outputs=3, axis=2)
        key = _cache_step(g, past_k, g.heads(k, heads, hd), pos, heads, hd, cache_write)
        value = _cache_step(g, past_v, g.heads(v, heads, hd), pos, heads, hd, cache_write)
        att = _attend(g, g.heads(q, heads, hd), key, value, mask, hd, divide=True)
        x = g.add(x, g.linear(g.merge_heads(att, d), d, d))
        h = _gelu_tanh(g, g.linear(g.layer_norm(x, d, 1e-5), d, 4 * d))
        x = g.add(x, g.linear(h, 4 * d, d))
        presents += [key, value]
    logits = g.node("MatMul", [g.layer_norm(x, d, 1e-5),
                               g.node("Transpose", [wte], perm=[1, 0])])
    return _named(g.build([logits, *presents]), layers)


def _rms_norm(g, x, d, eps):
    """HF LlamaRMSNorm as exported: x * (1 / sqrt(mean(x^2) + eps)) * weight, the norm in float32
    (a float16 model: Cast to float32 and back before the gain)."""
    x = g.cast(x, True) if g.half else x
    var = g.node("ReduceMean", [g.node("Pow", [x, g.scalar(2.0, "two", "float32")])], axes=[-1],
                 keepdims=1)
    inv = g.node("Div", [g.scalar(1.0, "one", "float32"),
                         g.node("Sqrt", [g.add(var, g.scalar(eps, "eps", "float32"))])])
    gain = g.gain(d, "rms_g")  # named before the product, as the float32 graph always was
    normed = g.mul(x, inv)
    return g.mul(gain, g.cast(normed, False) if g.half else normed)


def _rotate(g, x, cos, sin, half):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x[..., half:], x[..., :half])."""
    first = g.node("Slice", [x, g.ints([0], "s"), g.ints([half], "e"), g.ints([-1], "ax")])
    second = g.node("Slice", [x, g.ints([half], "s"), g.ints([2 * half], "e"), g.ints([-1], "ax")])
    rotated = g.concat([g.node("Neg", [second]), first], axis=-1)
    return g.add(g.mul(x, cos), g.mul(rotated, sin))


def _repeat_kv(g, x, kv_heads, n_rep, max_len, hd):
    """[B, KV, L, hd] -> [B, KV * n_rep, L, hd]: Unsqueeze, Expand, Reshape (HF's repeat_kv)."""
    if n_rep == 1:
        return x
    shape = [g.batch, kv_heads, n_rep, max_len, hd]
    y = g.node("Expand", [g.unsqueeze(x, [2]), g.ints(shape, "shape")])
    return g.reshape(y, [g.batch, kv_heads * n_rep, max_len, hd])


def rope_tables(max_len, head_dim, theta):
    """cos and sin [max_len, head_dim] of rotary embeddings (HF's duplicated-halves layout)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def llama_decode(layers=16, d_model=2048, heads=32, kv_heads=8, d_ff=8192, vocab=128256,
                 max_len=1024, rope_theta=500000.0, cache_write="scatter_nd", dtype="float32",
                 batch=1, seed=0):
    """One Llama decode step with a static KV cache (Llama-3.2-1B's shape by default, max_len 1024).

    Source: HF transformers' LlamaForCausalLM (RMSNorm, rotary embeddings from cos/sin tables
    Gathered at the position, grouped-query attention with ``kv_heads`` cache heads repeated to
    ``heads``, SiLU-gated MLP written x * Sigmoid(x), LM head tied to the embedding as in
    Llama-3.2-1B). Inputs and outputs: see the module docstring (caches [B, kv_heads, L, hd]).
    ``cache_write`` and ``dtype`` as for :func:`gpt2_decode`.
    """
    _check_cache_write(cache_write)
    _check("llama_decode", layers, d_model, heads, kv_heads=kv_heads, d_ff=d_ff, vocab=vocab,
           max_len=max_len, batch=batch)
    if heads % kv_heads:
        raise ValueError(f"llama_decode: heads={heads} is not a multiple of kv_heads={kv_heads}")
    d, hd = d_model, d_model // heads
    if hd % 2:
        raise ValueError(f"llama_decode: head_dim={hd} must be even for rotary embeddings")
    g = _Builder("llama_decode", seed, batch, dtype)
    ids, pos = g.int_input("input_ids", [batch, 1]), g.int_input("position", [1])
    embed = g.randn((vocab, d), d ** -0.5, "embed")
    x = g.node("Gather", [embed, ids], axis=0)
    cos_t, sin_t = rope_tables(max_len, hd, rope_theta)
    cos = g.unsqueeze(g.node("Gather", [g.floats(cos_t, "cos"), pos], axis=0), [1])  # [1, 1, hd]
    sin = g.unsqueeze(g.node("Gather", [g.floats(sin_t, "sin"), pos], axis=0), [1])
    mask = _decode_mask(g, pos, max_len)
    presents = []
    for i in range(layers):
        past_k = g.input(f"past_key_{i}", [batch, kv_heads, max_len, hd])
        past_v = g.input(f"past_value_{i}", [batch, kv_heads, max_len, hd])
        h = _rms_norm(g, x, d, 1e-5)
        q = _rotate(g, g.heads(g.linear(h, d, heads * hd, bias=False), heads, hd), cos, sin,
                    hd // 2)
        k = _rotate(g, g.heads(g.linear(h, d, kv_heads * hd, bias=False), kv_heads, hd), cos, sin,
                    hd // 2)
        v = g.heads(g.linear(h, d, kv_heads * hd, bias=False), kv_heads, hd)
        key = _cache_step(g, past_k, k, pos, kv_heads, hd, cache_write)
        value = _cache_step(g, past_v, v, pos, kv_heads, hd, cache_write)
        n_rep = heads // kv_heads
        att = _attend(g, q, _repeat_kv(g, key, kv_heads, n_rep, max_len, hd),
                      _repeat_kv(g, value, kv_heads, n_rep, max_len, hd), mask, hd, divide=False,
                      upcast=True)
        x = g.add(x, g.linear(g.merge_heads(att, d), heads * hd, d, bias=False))
        h = _rms_norm(g, x, d, 1e-5)
        gate = g.linear(h, d, d_ff, bias=False)
        up = g.linear(h, d, d_ff, bias=False)
        x = g.add(x, g.linear(g.mul(g.mul(gate, g.sigmoid(gate)), up), d_ff, d, bias=False))
        presents += [key, value]
    logits = g.node("MatMul", [_rms_norm(g, x, d, 1e-5),
                               g.node("Transpose", [embed], perm=[1, 0])])
    return _named(g.build([logits, *presents]), layers)


def _gelu_erf(g, x):
    """HF's GELUActivation (exact): x * 0.5 * (1 + erf(x / sqrt(2)))."""
    erf = g.node("Erf", [g.node("Div", [x, g.scalar(np.sqrt(2.0), "sqrt2")])])
    return g.mul(g.mul(x, g.scalar(0.5, "half")), g.add(erf, g.scalar(1.0, "one")))


def bert_base(layers=12, d_model=768, heads=12, seq_len=128, vocab=30522, d_ff=None,
              dtype="float32", batch=1, seed=0):
    """A BERT encoder over ``seq_len`` tokens with an attention mask (BERT-base by default).

    Source: HF transformers' BertModel (word + position + token-type-0 embeddings, LayerNorm eps
    1e-12, post-LayerNorm blocks with separate Q/K/V MatMuls, the extended mask
    ``(1 - mask) * finfo.min`` added to the scores, exact-erf GELU MLP of ``d_ff`` = 4 d). Output:
    the last hidden state [B, seq_len, d_model] (no pooler). ``dtype`` as for
    :func:`gpt2_decode` (the mask is cast to it, as HF's ``get_extended_attention_mask`` does).
    """
    d_ff = 4 * d_model if d_ff is None else d_ff
    _check("bert_base", layers, d_model, heads, seq_len=seq_len, vocab=vocab, d_ff=d_ff,
           batch=batch)
    d, hd, s = d_model, d_model // heads, seq_len
    g = _Builder("bert_base", seed, batch, dtype)
    ids, attn = g.int_input("input_ids", [batch, s]), g.int_input("attention_mask", [batch, s])
    emb = g.sum([g.node("Gather", [g.randn((vocab, d), 1.0, "word"), ids], axis=0),
                 g.node("Gather", [g.randn((512 if s <= 512 else s, d), 1.0, "position"),
                                   g.ints(np.arange(s)[None], "pos_ids")], axis=0),
                 g.node("Gather", [g.randn((2, d), 1.0, "token_type"),
                                   g.ints(np.zeros((1, s)), "type_ids")], axis=0)])
    x = g.layer_norm(emb, d, 1e-12)
    keep = g.node("Cast", [g.unsqueeze(attn, [1, 2])], to=g.elem)  # [B, 1, 1, S]
    mask = g.mul(g.node("Sub", [g.scalar(1.0, "one"), keep]), g.scalar(g.min_value(), "min"))
    for _ in range(layers):
        q, k, v = (g.heads(g.linear(x, d, d), heads, hd, seq=s) for _ in range(3))
        scores = g.node("Div", [g.node("MatMul", [q, g.node("Transpose", [k], perm=[0, 1, 3, 2])]),
                                g.scalar(np.sqrt(hd), "sqrt_hd")])
        probs = g.node("Softmax", [g.add(scores, mask)], axis=-1)
        att = g.merge_heads(g.node("MatMul", [probs, v]), d, seq=s)
        x = g.layer_norm(g.add(g.linear(att, d, d), x), d, 1e-12)
        h = _gelu_erf(g, g.linear(x, d, d_ff))
        x = g.layer_norm(g.add(g.linear(h, d_ff, d), x), d, 1e-12)
    return _rename(g.build([x]), {x: "last_hidden_state"})


def _named(model, layers):
    """Give a decoder's outputs HF's names: logits, present_key_i, present_value_i."""
    names = ["logits"] + [f"present_{kind}_{i}" for i in range(layers)
                          for kind in ("key", "value")]
    return _rename(model, dict(zip([o.name for o in model.graph.output], names)))


def _rename(model, names):
    """Rename graph outputs (``names``: old -> new) in the nodes that make them and the outputs.
    An output that is also consumed elsewhere keeps working: every use is renamed."""
    for node in model.graph.node:
        node.output[:] = [names.get(o, o) for o in node.output]
        node.input[:] = [names.get(i, i) for i in node.input]
    for out in model.graph.output:
        out.name = names.get(out.name, out.name)
    return model
