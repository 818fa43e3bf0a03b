"""DecodeAttentionStepRow: the partial reads q, k, v from the QKV row and the caches beside their
writes (relay_passes/decode_attention_row.py, the kernels' ``q_row`` / ``k_row`` / ``v_row`` /
``rope_rank``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import onnx_builders as ob
from test_decode_attention import _Cpu  # one PrimFunc built for llvm, threads serial
from relay_passes.cache_write import BESIDE_WRITE_ATTR, CacheSlotWrite, beside_write_params
from relay_passes.dataflow_graph import DataflowGraph
from relay_passes.decode_attention import DecodeAttentionSplit
from relay_passes.decode_attention_row import DecodeAttentionStepRow
from tir_templates.decode_attention import (DecodeAttentionShape, combine_func, partial_versions,
                                            reference)
from tvm_rammer.models import REDUCED, get_model

SHAPE = DecodeAttentionShape(2, 4, 2, 16, 8, 4, 4.0, True)  # GQA, chunks pair up


def _partial_calls(mod):
    """(callee PrimFunc, args) of every partial call in main."""
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
                    and value.op.name == "relax.call_tir":
                func = mod[value.args[0]]
                if func.attrs is not None and str(func.attrs.get("rammer.decode_attention",
                                                                 "")) == "partial":
                    found.append((func, list(value.args[1].fields)))
    return found


def _rewritten(name, **params):
    from tvm_rammer.driver.frontend import import_onnx

    mod = DecodeAttentionSplit()(import_onnx(get_model(name, **params)))
    return mod, DecodeAttentionStepRow()(mod)


def test_gpt2s_partial_reads_the_qkv_row_and_the_cache_parameters():
    """Each layer's partial: (row, Kc, Vc, pos, row, kidx, vidx), the row the split's input
    [1, 1, 3 d], q at 0, k at d, v at 2 d, the caches main's parameters (not the scatters), the
    indices those of the layer's scatters; the reads beside the writes declared."""
    params = REDUCED["gpt2_decode"]
    before, after = _rewritten("gpt2_decode", **params)
    calls = _partial_calls(after)
    assert len(calls) == params["layers"] == len(_partial_calls(before))
    d = params["d_model"]
    names = {p.name for p in after["main"].params}
    for func, args in calls:
        shape = DecodeAttentionShape.decode(func.attrs["rammer.decode_attention_params"])
        assert (shape.q_row, shape.q_off, shape.k_row, shape.k_off, shape.v_row, shape.v_off,
                shape.rope_rank) == (3 * d, 0, 3 * d, d, 3 * d, 2 * d, 0)
        assert len(args) == 8 and args[0].same_as(args[4]) and args[0].same_as(args[6])
        assert [int(x) for x in args[0].ty.shape] == [1, 1, 3 * d]
        assert args[1].name in names and args[2].name in names
        assert beside_write_params(func) == [(1, 5), (2, 7)]
    scatters = [b.value for block in after["main"].body.blocks for b in block.bindings
                if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
                and b.value.op.name == "relax.scatter_nd"]
    assert len(scatters) == 2 * params["layers"]  # the writes stay: main's results
    written = {(s.args[0].name, s.args[1]) for s in scatters}
    for _, args in calls:
        assert (args[1].name, args[5]) in written and (args[2].name, args[7]) in written
    # no partial of the first pass is left behind
    partials = [f for _, f in after.functions_items() if isinstance(f, tirx.PrimFunc)
                and f.attrs is not None and str(f.attrs.get("rammer.decode_attention", ""))
                == "partial"]
    assert partials and all(beside_write_params(f) for f in partials)


def test_llamas_partial_reads_its_three_projections_and_rotates_q_and_k():
    """Llama (separate q, k, v projections, rotary on q and k, GQA): each layer's partial reads
    (q row, Kc, Vc, pos, k row, kidx, v row, vidx, cos, sin): the rows the projections' outputs
    (offset 0), cos and sin the [1, 1, D] rows gathered at the position, shared by the layers."""
    params = REDUCED["llama_decode"]
    _, after = _rewritten("llama_decode", **params)
    calls = _partial_calls(after)
    assert len(calls) == params["layers"]
    d = params["d_model"] // params["heads"]
    tables = set()
    for func, args in calls:
        shape = DecodeAttentionShape.decode(func.attrs["rammer.decode_attention_params"])
        assert (shape.q_row, shape.k_row, shape.v_row) == (
            params["heads"] * d, params["kv_heads"] * d, params["kv_heads"] * d)
        assert (shape.q_off, shape.k_off, shape.v_off, shape.rope_rank) == (0, 0, 0, 3)
        assert len(args) == 10 and beside_write_params(func) == [(1, 5), (2, 7)]
        assert [int(x) for x in args[8].ty.shape] == [1, 1, d]
        tables.add((args[8], args[9]))
    assert len(tables) == 1


@pytest.mark.parametrize("name,params", [
    ("gpt2_decode", {"cache_write": "scatter_elements"}),  # index_copy: not ScatterND
])
def test_what_is_no_view_of_one_row_is_left_alone(name, params):
    before, after = _rewritten(name, **dict(REDUCED[name], **params))
    tvm.ir.assert_structural_equal(before, after)


def test_cache_slot_write_writes_in_place_beside_the_partial():
    """CacheSlotWrite counts the partial's declared reads of a cache as reads beside the write:
    the writes stay in place. Control: the same partial without the declaration makes the cache
    read elsewhere, and the writes copy the cache (the whole-cache select)."""
    _, after = _rewritten("gpt2_decode", **REDUCED["gpt2_decode"])

    def inplace_writes(mod):
        text = CacheSlotWrite(inplace=True)(mod)["main"].script()
        return text.count("call_tir_inplace")

    assert inplace_writes(after) == 2 * REDUCED["gpt2_decode"]["layers"]
    stripped = tvm.IRModule(dict(after.functions_items()), attrs=after.attrs)
    for gv, func in after.functions_items():
        if isinstance(func, tirx.PrimFunc) and beside_write_params(func):
            stripped[gv] = func.without_attr(BESIDE_WRITE_ATTR)
    assert inplace_writes(stripped) == 0


def test_a_reader_beside_other_indices_keeps_the_write_copying():
    """CacheSlotWrite writes a cache in place beside a reader only where the reader names the
    write's own indices: with the partial's K declared read beside V's indices (another slot, as
    far as the pass knows), K's write copies the cache and V's stays in place."""
    _, after = _rewritten("gpt2_decode", **dict(REDUCED["gpt2_decode"], layers=1))
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class _OtherIndices(relax.PyExprMutator):  # pylint: disable=too-few-public-methods
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(call_tir) and len(call.args[1].fields) == 8:
                fields = list(call.args[1].fields)
                fields[5] = fields[7]  # K beside vidx
                return relax.call_tir(call.args[0], fields, call.ty)
            return call

    def inplace_caches(mod):
        main = CacheSlotWrite(inplace=True)(mod)["main"]
        return sorted(b.value.args[1].fields[0].name for block in main.body.blocks
                      for b in block.bindings if isinstance(b.value, relax.Call)
                      and isinstance(b.value.op, tvm.ir.Op)
                      and b.value.op.name == "relax.call_tir_inplace")

    assert inplace_caches(after) == ["past_key_0", "past_value_0"]
    after["main"] = _OtherIndices(after).visit_expr(after["main"])
    assert inplace_caches(after) == ["past_value_0"]


def test_the_dataflow_graph_places_the_write_beside_its_reader():
    """In the grouped graph the in-place write stays placeable though the partial reads its
    cache; without the declaration the same write is not placeable (read elsewhere)."""
    from tvm_rammer import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes

    model = get_model("gpt2_decode", **REDUCED["gpt2_decode"])
    mod = ob.gpu_schedule(tvm.transform.Sequential(graph_passes(RammerConfig()))(
        import_onnx(model)))
    graph = DataflowGraph.of_main(mod)
    writes = [n for n in graph.nodes if n.kind == "call_tir_inplace"]
    assert len(writes) == 2 * REDUCED["gpt2_decode"]["layers"]
    assert all(n.placeable for n in writes), [n.reason for n in writes]
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and beside_write_params(func):
            mod[gv] = func.without_attr(BESIDE_WRITE_ATTR)
    graph = DataflowGraph.of_main(mod)
    writes = [n for n in graph.nodes if n.kind == "call_tir_inplace"]
    assert writes and all("read elsewhere" in n.reason for n in writes)


def _case(shape, seed=0):
    """A row [B, 1, N] holding q, k, v (at 0, Hq D, Hq D + Hkv D), caches, and ScatterND indices
    (b, g, slot) per kv head."""
    rng = np.random.default_rng(seed)
    b, h, kv, length, d = (shape.batch, shape.heads, shape.kv_heads, shape.max_len,
                           shape.head_dim)
    row = rng.standard_normal((b, 1, (h + 2 * kv) * d)).astype(np.float32)
    k = rng.standard_normal((b, kv, length, d)).astype(np.float32)
    v = rng.standard_normal((b, kv, length, d)).astype(np.float32)
    return row, k, v


def _indices(shape, slots):
    """ScatterND indices [B, Hkv, 1, 3] writing ``slots[b][g]`` for (b, g)."""
    idx = np.zeros((shape.batch, shape.kv_heads, 1, 3), np.int64)
    for b in range(shape.batch):
        for g in range(shape.kv_heads):
            idx[b, g, 0] = (b, g, slots[b][g])
    return idx


def _written(cache, row, off, idx, shape):
    """The cache after the step's write (the in-place kernel's semantics): row's k at the
    normalized slot, nothing out of range."""
    out = cache.copy()
    d = shape.head_dim
    for b in range(shape.batch):
        for g in range(shape.kv_heads):
            slot = int(idx[b, g, 0, 2])
            slot = slot + shape.max_len if slot < 0 else slot
            if 0 <= slot < shape.max_len:
                out[b, g, slot] = row[b, 0, off + g * d:off + (g + 1) * d]
    return out


ROW = dataclasses.replace(SHAPE, q_row=(4 + 2 * 2) * 8, q_off=0, k_row=(4 + 2 * 2) * 8,
                          k_off=4 * 8, v_row=(4 + 2 * 2) * 8, v_off=4 * 8 + 2 * 8)


@pytest.mark.parametrize("slots", [[[6, 6], [6, 6]], [[-10, 3], [15, 99]]],
                         ids=["at_the_position", "negative_and_out_of_range"])
def test_every_row_version_matches_numpy_over_the_written_caches(slots):
    """Each thread-per-slot version (serial on llvm) reading q from the row and K, V beside the
    write equals the two-phase attention over the caches as written (numpy), at position 6 and
    at L - 1; the write's slot normalized as the write normalizes it (-10 -> 6), out of range
    nothing substituted. Control: the same kernel given indices of another slot differs."""
    shape = ROW
    row, k, v = _case(shape)
    idx = _indices(shape, slots)
    kw = _written(k, row, shape.k_off, idx, shape)
    vw = _written(v, row, shape.v_off, idx, shape)
    q = row[:, 0, :shape.heads * shape.head_dim].reshape(shape.batch, shape.heads, 1,
                                                         shape.head_dim)
    combine = _Cpu(combine_func(shape, threads=32))
    versions = [(n, f) for n, f in partial_versions(shape) if not n.startswith(
        "decode_attention_w")]
    assert versions
    for p in (6, shape.max_len - 1):
        want = reference(q, kw, vw, p, shape.scale, shape.divide)
        pos = np.array([p], np.int64)
        for name, func in versions:
            run = _Cpu(func)
            part = run(row, k, v, pos, row, idx, row, idx, np.full(
                (shape.batch, shape.heads, shape.chunks, shape.head_dim + 2), np.nan, np.float32))
            got = combine(part, pos, np.full((shape.batch, shape.heads, 1, shape.head_dim),
                                             np.nan, np.float32))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    moved = _indices(shape, [[1, 2], [3, 4]])
    pos = np.array([6], np.int64)
    part = _Cpu(versions[0][1])(row, k, v, pos, row, moved, row, moved, np.full(
        (shape.batch, shape.heads, shape.chunks, shape.head_dim + 2), np.nan, np.float32))
    got = combine(part, pos, np.full((shape.batch, shape.heads, 1, shape.head_dim), np.nan,
                                     np.float32))
    want = reference(q, kw, vw, 6, shape.scale, shape.divide)
    assert np.abs(got - want).max() > 1e-2


def test_q_after_k_and_v_in_the_row_matches_numpy():
    """A row laid out k, v, q (``q_off`` past k and v, ``k_off`` 0): the default thread-per-slot
    version equals the attention over the written caches with q read at ``q_off``. Control: q
    read at the row's start (k and v) differs."""
    kv = SHAPE.kv_heads * SHAPE.head_dim
    shape = dataclasses.replace(ROW, q_off=2 * kv, k_off=0, v_off=kv)
    row, k, v = _case(shape)
    idx = _indices(shape, [[6, 3], [-10, 6]])
    kw = _written(k, row, shape.k_off, idx, shape)
    vw = _written(v, row, shape.v_off, idx, shape)
    width = shape.heads * shape.head_dim

    def q_at(off):
        return row[:, 0, off:off + width].reshape(shape.batch, shape.heads, 1, shape.head_dim)

    pos = np.array([6], np.int64)
    part = _Cpu(partial_versions(shape)[0][1])(row, k, v, pos, row, idx, row, idx, np.full(
        (shape.batch, shape.heads, shape.chunks, shape.head_dim + 2), np.nan, np.float32))
    got = _Cpu(combine_func(shape, threads=32))(part, pos, np.full(
        (shape.batch, shape.heads, 1, shape.head_dim), np.nan, np.float32))
    np.testing.assert_allclose(got, reference(q_at(shape.q_off), kw, vw, 6, shape.scale,
                                              shape.divide), rtol=1e-5, atol=1e-5)
    assert np.abs(got - reference(q_at(0), kw, vw, 6, shape.scale, shape.divide)).max() > 1e-2


def test_the_shape_encodes_its_row_fields():
    assert DecodeAttentionShape.decode(ROW.encode()) == ROW
    assert DecodeAttentionShape.decode(SHAPE.encode()) == SHAPE
    with pytest.raises(ValueError):
        dataclasses.replace(ROW, v_off=ROW.v_row)  # v past the row's end
    with pytest.raises(ValueError):
        dataclasses.replace(SHAPE, rope_rank=3)  # rotary without the rows it rotates


def test_the_pass_is_in_the_rammer_pipeline_and_can_be_turned_off():
    from tvm_rammer import RammerConfig
    from tvm_rammer.driver.pipeline import graph_passes

    def names(config):
        return [p.info.name for p in graph_passes(config)]

    assert "DecodeAttentionStepRow" in names(RammerConfig())
    assert names(RammerConfig()).index("DecodeAttentionStepRow") \
        < names(RammerConfig()).index("CacheSlotWrite")
    assert "DecodeAttentionStepRow" not in names(RammerConfig(attention_row=False))


def _rotated(x, cos, sin):
    """HF's rotary embedding of [..., D] (numpy): x * cos + cat(-x[D/2:], x[:D/2]) * sin."""
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def test_rotary_versions_match_numpy_over_the_rotated_written_caches():
    """q and the step's k rotated inside the partial (``rope_rank``), k and v from two rows
    (Llama's projections): every thread-per-slot version (serial on llvm) equals numpy's
    attention of the rotated q over the caches written with the rotated k and the v row, at the
    position and past it. Controls: the same kernel without the rotation (``rope_rank`` 0) and
    with cos and sin swapped differ."""
    shape = dataclasses.replace(SHAPE, q_row=4 * 8, k_row=2 * 8, v_row=2 * 8, rope_rank=3)
    rng = np.random.default_rng(5)
    b, h, kv, length, d = (shape.batch, shape.heads, shape.kv_heads, shape.max_len,
                           shape.head_dim)
    qrow = rng.standard_normal((b, 1, h * d)).astype(np.float32)
    krow = rng.standard_normal((b, 1, kv * d)).astype(np.float32)
    vrow = rng.standard_normal((b, 1, kv * d)).astype(np.float32)
    k = rng.standard_normal((b, kv, length, d)).astype(np.float32)
    v = rng.standard_normal((b, kv, length, d)).astype(np.float32)
    angle = rng.uniform(0, 3, d // 2)
    cos = np.cos(np.concatenate([angle, angle])).astype(np.float32).reshape(1, 1, d)
    sin = np.sin(np.concatenate([angle, angle])).astype(np.float32).reshape(1, 1, d)
    idx = _indices(shape, [[6, 6], [6, 6]])
    q = _rotated(qrow.reshape(b, h, 1, d), cos, sin)
    knew = _rotated(krow.reshape(b, kv, 1, d), cos, sin)
    kw, vw = k.copy(), v.copy()
    kw[:, :, 6] = knew[:, :, 0]
    vw[:, :, 6] = vrow.reshape(b, kv, d)
    combine = _Cpu(combine_func(shape, threads=32))

    def attend(func, pos, c=cos, s=sin):
        p = np.array([pos], np.int64)
        args = [qrow, k, v, p, krow, idx, vrow, idx] + ([c, s] if func_has_rope(func) else [])
        part = _Cpu(func)(*args, np.full((b, h, shape.chunks, d + 2), np.nan, np.float32))
        return combine(part, p, np.full((b, h, 1, d), np.nan, np.float32))

    def func_has_rope(func):
        return any(param.name == "cos" for param in func.params)

    versions = [(n, f) for n, f in partial_versions(shape) if not n.startswith(
        "decode_attention_w")]
    for pos in (6, length - 1):
        want = reference(q, kw, vw, pos, shape.scale, shape.divide)
        for name, func in versions:
            np.testing.assert_allclose(attend(func, pos), want, rtol=1e-5, atol=1e-5,
                                       err_msg=name)
    want = reference(q, kw, vw, 6, shape.scale, shape.divide)
    plain = partial_versions(dataclasses.replace(shape, rope_rank=0, q_row=0))[-1][1]
    p = np.array([6], np.int64)
    part = _Cpu(plain)(qrow.reshape(b, h, 1, d), k, v, p, krow, idx, vrow, idx,
                       np.full((b, h, shape.chunks, d + 2), np.nan, np.float32))
    got = combine(part, p, np.full((b, h, 1, d), np.nan, np.float32))
    assert np.abs(got - want).max() > 1e-2
    assert np.abs(attend(versions[0][1], 6, sin, cos) - want).max() > 1e-2


WARP_ROPE_SHAPES = [  # warp per slot (head dim a multiple of 32) with the rotation inside
    DecodeAttentionShape(2, 4, 2, 16, 64, 4, 8.0, True, warps=2, q_row=4 * 64, k_row=2 * 64,
                         v_row=2 * 64, rope_rank=3),                     # GQA, batch 2, fp32
    DecodeAttentionShape(1, 4, 1, 16, 128, 4, 11.3, True, 1, "float16", "float16", "float16",
                         warps=2, q_row=4 * 128, k_row=128, v_row=128, rope_rank=4,
                         rope_dtype="float16"),                          # MQA, D 128, fp16
]


def test_warp_rotary_versions_match_numpy_on_the_cuda_emulator():
    """The warp-per-slot partial (lane l holds dims l, l + 32, ...; each partner dim d +- D/2
    read from the row) with the rotation inside, lowered for the H100 and run on the CPU emulator:
    equal to numpy's attention of the rotated q over the caches written with the rotated k, at
    the written slot and past it (fp32 <= 1e-5, fp16 <= 2e-2 of the result's scale). Control: q
    taken unrotated differs."""
    import shutil
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tvm_rammer.checks.emulator.versions import _build, _run
    from tvm_rammer.target import resolve_target

    funcs = {}
    for i, shape in enumerate(WARP_ROPE_SHAPES):
        assert partial_versions(shape)[0][0].startswith("decode_attention_w")
        funcs.update({f"p{i}": partial_versions(shape)[0][1], f"c{i}": combine_func(shape)})
    built = _build(funcs, resolve_target("rammer/nvidia-h100"), None)
    for i, shape in enumerate(WARP_ROPE_SHAPES):
        rng = np.random.default_rng(i)
        b, h, kv, length, d = (shape.batch, shape.heads, shape.kv_heads, shape.max_len,
                               shape.head_dim)
        dtype = np.dtype(shape.kv_dtype)
        qrow = rng.standard_normal((b, 1, h * d)).astype(dtype)
        krow, vrow = (rng.standard_normal((b, 1, kv * d)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((b, kv, length, d)).astype(dtype) for _ in range(2))
        angle = rng.uniform(0, 3, d // 2)
        cos = np.cos(np.concatenate([angle, angle])).reshape(shape.rope_shape).astype(
            shape.rope_dtype)
        sin = np.sin(np.concatenate([angle, angle])).reshape(shape.rope_shape).astype(
            shape.rope_dtype)
        idx = _indices(shape, [[6] * kv] * b)
        c64, s64 = cos.astype(np.float64).reshape(d), sin.astype(np.float64).reshape(d)
        plain_q = qrow.astype(np.float64).reshape(b, h, 1, d)
        q = _rotated(plain_q, c64, s64)
        kw, vw = k.astype(np.float64), v.astype(np.float64)
        kw[:, :, 6] = _rotated(krow.astype(np.float64).reshape(b, kv, d), c64, s64)
        vw[:, :, 6] = vrow.astype(np.float64).reshape(b, kv, d)
        tolerance = 1e-5 if dtype == np.float32 else 2e-2
        for p in (6, length - 1):
            pos = np.array([p], np.int64)
            part = _run(built, f"p{i}", [qrow, k, v, pos, krow, idx, vrow, idx, cos, sin, np.full(
                (b, h, shape.chunks, d + 2), np.nan, np.float32)], 120)[-1]
            out = _run(built, f"c{i}", [part, pos, np.full((b, h, 1, d), np.nan,
                                                           shape.out_dtype)], 120)[-1]
            want = reference(q, kw, vw, p, shape.scale, shape.divide)
            scale = np.abs(want).max()
            assert np.abs(out.astype(np.float64) - want).max() <= tolerance * scale, (i, p)
            unrotated = reference(plain_q, kw, vw, p, shape.scale, shape.divide)
            assert np.abs(out.astype(np.float64) - unrotated).max() > 10 * tolerance * scale
