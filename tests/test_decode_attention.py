"""Decode attention split over the KV length (issue 34): ``tir_templates.decode_attention``'s two
kernels and ``relay_passes.decode_attention.DecodeAttentionSplit``.

The kernels: every version against NumPy on llvm (thread loops serial) at positions 0, inside a
chunk, on a chunk edge, L - 1, and outside [0, L) (what the masked graph computes there), the
slots past the position never read (NaN there changes nothing), and on the CUDA emulator; negative
control: the slot bound one too far is detected by both checks. The pass: Before/Expected (plain
and grouped-query), every other mask or no mask left untouched, and the reduced GPT-2 / Llama
decode steps rewritten and matching onnxruntime on llvm and (slow) on the emulator at positions 0,
6 and L - 1, with the off-by-one control detected there too.
"""
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relay_passes import decode_attention as pass_module
from relay_passes.decode_attention import DecodeAttentionSplit
from tir_templates import decode_attention as da
from tir_templates.decode_attention import (DecodeAttentionRule, DecodeAttentionShape,
                                            combine_func, combine_versions, partial_func,
                                            partial_versions, reference)
from tir_templates.serial_run import serial_threads
from tvm_rammer.models import REDUCED, get_model

F32_MIN = float(np.finfo(np.float32).min)
TARGET = "rammer/nvidia-h100"


def _arrays(shape, seed=0):
    rng = np.random.default_rng(seed)
    b, h, kv, length, d = (shape.batch, shape.heads, shape.kv_heads, shape.max_len,
                           shape.head_dim)
    return (rng.standard_normal((b, h, 1, d)).astype(np.float32),
            rng.standard_normal((b, kv, length, d)).astype(np.float32),
            rng.standard_normal((b, kv, length, d)).astype(np.float32))


class _Cpu:
    """One PrimFunc built once for llvm (thread loops serial), called on copies of arrays."""

    def __init__(self, func):
        mod = tvm.IRModule({"main": serial_threads(func).with_attr("global_symbol", "main")})
        self.run = tvm.compile(mod, target="llvm")["main"]

    def __call__(self, *arrays):
        args = [tvm.runtime.tensor(np.array(a, copy=True)) for a in arrays]
        self.run(*args)
        return args[-1].numpy()


def _two_phases(partial, combine, shape, q, k, v, p):
    pos = np.array([p], np.int64)
    part = partial(q, k, v, pos, np.full((shape.batch, shape.heads, shape.chunks,
                                          shape.head_dim + 2), np.nan, np.float32))
    return combine(part, pos, np.full((shape.batch, shape.heads, 1, shape.head_dim), np.nan,
                                      np.float32))


SHAPES = [DecodeAttentionShape(2, 4, 2, 16, 8, 4, 4.0, True),      # GQA, chunks pair up
          DecodeAttentionShape(1, 3, 3, 10, 16, 4, 0.25, False)]   # a last chunk half full


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa_divide", "ragged_multiply"])
def test_every_version_matches_numpy_on_llvm(shape):
    q, k, v = _arrays(shape)
    combines = [_Cpu(f) for _, f in combine_versions(shape)]
    partials = partial_versions(shape)
    assert len(partials) == (2 if shape.chunks % 2 == 0 else 1)
    length = shape.max_len
    for _, func in partials:
        partial = _Cpu(func)
        for combine in combines:
            for p in (0, 3, 4, length - 1, -1, length + 5):
                got = _two_phases(partial, combine, shape, q, k, v, p)
                want = reference(q, k, v, p, shape.scale, shape.divide)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"p={p}")


def test_slots_past_the_position_are_never_read():
    """NaN in every K, V slot past the position: the result is still finite and correct (the
    chunks past it and the slots past it in its own chunk are not read)."""
    shape = SHAPES[0]
    q, k, v = _arrays(shape)
    partial, combine = _Cpu(partial_func(shape)), _Cpu(combine_func(shape))
    for p in (0, 5, 8):
        k_nan, v_nan = k.copy(), v.copy()
        k_nan[:, :, p + 1:] = np.nan
        v_nan[:, :, p + 1:] = np.nan
        got = _two_phases(partial, combine, shape, q, k_nan, v_nan, p)
        np.testing.assert_allclose(got, reference(q, k, v, p, 4.0, True), rtol=1e-5, atol=1e-6)


def test_a_bound_one_slot_too_far_is_detected_on_llvm():
    """Negative control: the same kernel reading slot p + 1 differs from NumPy (at p = L - 1
    there is no slot past it: the same result)."""
    shape = SHAPES[0]
    q, k, v = _arrays(shape)
    wrong, combine = _Cpu(partial_func(shape, bound_shift=1)), _Cpu(combine_func(shape))
    got = _two_phases(wrong, combine, shape, q, k, v, 5)
    assert np.abs(got - reference(q, k, v, 5, 4.0, True)).max() > 1e-2
    got = _two_phases(wrong, combine, shape, q, k, v, shape.max_len - 1)
    np.testing.assert_allclose(got, reference(q, k, v, shape.max_len - 1, 4.0, True), rtol=1e-5,
                               atol=1e-6)


def _emulator_or_skip():
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")


def test_versions_match_numpy_on_the_cuda_emulator():
    """Every version lowered for the H100 and run on the CPU emulator (one g++ build), GQA, four
    chunks; the off-by-one bound is detected here too."""
    _emulator_or_skip()
    from tvm_rammer.checks.emulator.versions import _build, _run
    from tvm_rammer.target import resolve_target

    shape = DecodeAttentionShape(1, 4, 2, 32, 64, 8, 8.0, True)
    q, k, v = _arrays(shape, seed=3)
    partials, combines = partial_versions(shape), combine_versions(shape)
    assert [n for n, _ in partials] == ["decode_attention_t32g1", "decode_attention_t32g2"]
    assert [n for n, _ in combines] == ["decode_combine_t32", "decode_combine_t64"]
    funcs = dict(partials + combines + [("wrong", partial_func(shape, bound_shift=1))])
    built = _build(funcs, resolve_target(TARGET), None)

    def run(pname, cname, p):
        pos = np.array([p], np.int64)
        part = _run(built, pname, [q, k, v, pos, np.full((1, 4, 4, 66), np.nan, np.float32)],
                    60)[-1]
        return _run(built, cname, [part, pos, np.full((1, 4, 1, 64), np.nan, np.float32)],
                    60)[-1]

    for pname, _ in partials:
        for cname, _ in combines:
            for p in (0, 7, 8, 31, -1):
                np.testing.assert_allclose(run(pname, cname, p), reference(q, k, v, p, 8.0, True),
                                           rtol=1e-5, atol=1e-6, err_msg=f"{pname} {cname} {p}")
    assert np.abs(run("wrong", "decode_combine_t32", 12) - reference(q, k, v, 12, 8.0, True)
                  ).max() > 1e-2


def test_rtasks_and_what_the_cost_model_is_charged():
    """Phase 1: one rTask per (b, head, chunk group), whole warps; phase 2: one per (b, head).
    The cost model is charged the worst case (position L - 1): K and V whole, and a FLOP count
    of the static loops (a data-dependent loop extent made TVM's estimate 8e12 here)."""
    from tir_templates.prelower import prelower
    from tvm_rammer.scheduling.rkernels import flops_and_bytes, param_bytes
    from tvm_rammer.target import resolve_target

    shape = DecodeAttentionShape(1, 12, 12, 1024, 64, da.chunk_for(1024), 8.0, True)
    assert (shape.chunk, shape.chunks) == (64, 16)
    target = resolve_target(TARGET)
    for (name, func), grid, threads in zip(partial_versions(shape),
                                           (192, 96, 192, 96), (32, 32, 64, 64)):
        lowered = prelower(func, target, name=name)
        assert (lowered.num_rtasks, lowered.threads) == (grid, threads), name
    assert prelower(combine_func(shape), target).num_rtasks == 12
    cache = 12 * 1024 * 64 * 4
    partial_bytes = param_bytes(partial_func(shape))
    assert partial_bytes[1:3] == [cache, cache]
    flops, _ = flops_and_bytes(combine_func(shape))
    assert flops < 1e6


def test_the_rule_keeps_ours_and_the_templates_list_their_versions():
    from tir_templates.templates import template_schedules

    shape = SHAPES[0]
    func = partial_func(shape)
    tvm.ir.assert_structural_equal(DecodeAttentionRule().apply(func).mod["main"], func)
    other = tirx.PrimFunc([], tirx.Evaluate(0))
    assert DecodeAttentionRule().apply(other) is None
    # TVM has no kernel of its own for these: the first version is their default (the reference
    # of the versions' emulator check, the kernel outside an rProgram)
    from tir_templates.default_schedule import schedule_like_default
    from tvm_rammer.target import plain_target, resolve_target

    default = schedule_like_default(func, plain_target(resolve_target(TARGET)))
    tvm.ir.assert_structural_equal(default, func.with_attr("tirx.is_scheduled", True))
    names = [t.name for t in template_schedules(func)]
    assert names == ["decode_attention_t32g1", "decode_attention_t32g2"]
    assert [t.name for t in template_schedules(combine_func(shape))] == ["decode_combine_t32"]


# The pass.

B, H, L, D = 1, 4, 8, 16


def _tensor(shape, dtype="float32"):
    return relax.TensorType(list(shape), dtype)


def _repeat(bb, cache, kv):
    op = relax.op
    n = H // kv
    x = bb.emit(op.broadcast_to(bb.emit(op.expand_dims(cache, axis=[2])), (B, kv, n, L, D)))
    return bb.emit(op.reshape(x, (B, H, L, D)))


def before(kv=H, scale="divide", mask_min=F32_MIN, zero=0.0, slots=None, compare="greater",
           mask=True, tokens=1, axis=-1):
    """``main(q, k, v, pos) = softmax(q k^T / 4 + where(slots > pos, min, 0)) v`` as the ONNX
    import writes it (llama: ``* 0.25`` and the GQA repeat)."""
    op = relax.op
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor((B, H, tokens, D)))
    k, v = relax.Var("k", _tensor((B, kv, L, D))), relax.Var("v", _tensor((B, kv, L, D)))
    pos = relax.Var("pos", _tensor((1,), "int64"))
    with bb.function("main", [q, k, v, pos]):
        with bb.dataflow():
            keys, values = (k, v) if kv == H else (_repeat(bb, k, kv), _repeat(bb, v, kv))
            scores = bb.emit(op.matmul(q, bb.emit(op.permute_dims(keys, [0, 1, 3, 2]))))
            if scale == "divide":
                scores = bb.emit(op.divide(scores, relax.const(4.0, "float32")))
            elif scale == "multiply_left":
                scores = bb.emit(op.multiply(relax.const(0.25, "float32"), scores))
            if mask:
                values_r = np.arange(L) if slots is None else slots
                cond = bb.emit(getattr(op, compare)(relax.const(values_r.astype(np.int64)),
                                                    pos))
                scores = bb.emit(op.add(scores, bb.emit(op.where(
                    cond, relax.const(mask_min, "float32"), relax.const(zero, "float32")))))
            probs = bb.emit(op.nn.softmax(scores, axis=axis))
            out = bb.emit_output(op.matmul(probs, values))
        bb.emit_func_output(out)
    return bb.get()


def expected(kv=H, scale=4.0, divide=True):
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor((B, H, 1, D)))
    k, v = relax.Var("k", _tensor((B, kv, L, D))), relax.Var("v", _tensor((B, kv, L, D)))
    pos = relax.Var("pos", _tensor((1,), "int64"))
    shape = DecodeAttentionShape(B, H, kv, L, D, da.chunk_for(L), scale, divide)
    with bb.function("main", [q, k, v, pos]):
        with bb.dataflow():
            partial = bb.add_func(partial_func(shape), "decode_attention_partial")
            combine = bb.add_func(combine_func(shape), "decode_attention_combine")
            part = bb.emit(relax.call_tir(partial, [q, k, v, pos],
                                          _tensor((B, H, shape.chunks, D + 2))))
            out = bb.emit_output(relax.call_tir(combine, [part, pos], _tensor((B, H, 1, D))))
        bb.emit_func_output(out)
    return bb.get()


def test_masked_attention_becomes_the_two_calls():
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(before()), expected())


def test_grouped_query_attention_reads_the_cache_not_its_repeat():
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(before(kv=2, scale="multiply_left")),
                                   expected(kv=2, scale=0.25, divide=False))


@pytest.mark.parametrize("case", [
    dict(mask_min=-1e9), dict(zero=1.0), dict(slots=np.arange(1, L + 1)),
    dict(slots=np.arange(L)[::-1].copy()), dict(compare="greater_equal"), dict(mask=False),
    dict(tokens=2), dict(axis=2)],
    ids=["min_not_finfo", "zero_not_0", "range_shifted", "range_reversed", "greater_equal",
         "no_mask", "two_tokens", "softmax_axis_2"])
def test_any_other_mask_or_shape_leaves_the_graph_untouched(case):
    mod = before(**case)
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(mod), mod)


def test_bad_chunk_is_one_clear_error():
    with pytest.raises(ValueError, match=r"DecodeAttentionSplit: chunk=0 must be positive"):
        DecodeAttentionSplit(chunk=0)


def test_the_pass_is_in_the_rammer_pipeline():
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import graph_passes

    names = [p.info.name for p in graph_passes(RammerConfig())]
    assert names.index("DecodeAttentionSplit") < names.index("MemoLegalizeOps")


# The reduced decoders.

def _feeds(model, position, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([position], np.int64)}
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _llvm_vm(model, monkeypatch=None, shift=0):
    """The model imported, DecodeAttentionSplit (``shift``: the slot bound moved), the kernels'
    thread loops serial, legalized and built for llvm."""
    from tvm_rammer.driver.frontend import import_onnx

    if shift:
        monkeypatch.setattr(pass_module, "partial_func",
                            lambda shape: partial_func(shape, bound_shift=shift))
    mod = DecodeAttentionSplit()(import_onnx(model))
    text = mod["main"].script()
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gv] = serial_threads(func)
    exe = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    return relax.VirtualMachine(exe, tvm.cpu()), text


def _errors(vm, model, feeds):
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    got = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in model.graph.input])
    return [relative_error(g.numpy(), r) for g, r in zip(got, onnx_reference(model, feeds))]


@pytest.mark.parametrize("name", ["gpt2_decode", "llama_decode"])
def test_reduced_decoder_rewritten_matches_onnxruntime_on_llvm(name):
    pytest.importorskip("onnxruntime")
    model = get_model(name, **REDUCED[name])
    vm, text = _llvm_vm(model)
    layers = REDUCED[name]["layers"]
    assert text.count("decode_attention_partial") == layers and "softmax" not in text
    for p in (0, 6, REDUCED[name]["max_len"] - 1):
        errors = _errors(vm, model, _feeds(model, p))
        assert max(errors) <= 1e-4, (p, errors)


def test_off_by_one_bound_in_the_decoder_is_detected_on_llvm(monkeypatch):
    pytest.importorskip("onnxruntime")
    model = get_model("gpt2_decode", **REDUCED["gpt2_decode"])
    vm, _ = _llvm_vm(model, monkeypatch, shift=1)
    assert _errors(vm, model, _feeds(model, 6))[0] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_decode", "llama_decode"])
def test_reduced_decoder_on_the_emulator_matches_onnxruntime(name, monkeypatch):
    """The rammer pipeline's CUDA (2 SMs x 2 vEUs) on the CPU emulator at positions 0, 6 and
    L - 1 (fp32: relative error <= 1e-4); control (gpt2): the bound one slot too far, detected."""
    pytest.importorskip("onnxruntime")
    _emulator_or_skip()
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model(name, **REDUCED[name])
    config = RammerConfig(num_sms=2, veus_per_sm=2)

    def errors(build, p):
        feeds = _feeds(model, p)
        result = emulator.emulate(build, [feeds[i.name] for i in model.graph.input])
        return [relative_error(o, r) for o, r in zip(result.outputs, onnx_reference(model, feeds))]

    build = emulator.emulation_build(model, config=config)
    for p in (0, 6, REDUCED[name]["max_len"] - 1):
        assert max(errors(build, p)) <= 1e-4, p
    if name == "gpt2_decode":
        monkeypatch.setattr(pass_module, "partial_func",
                            lambda shape: partial_func(shape, bound_shift=1))
        assert errors(emulator.emulation_build(model, config=config), 6)[0] > 1e-3
