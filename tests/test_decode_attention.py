"""Decode attention split over the KV length (issue 34): ``tir_templates.decode_attention``'s two
kernels and ``relay_passes.decode_attention.DecodeAttentionSplit``.

The kernels: every version against NumPy on llvm (thread loops serial) at positions 0, inside a
chunk, on a chunk edge, L - 1, and outside [0, L) (what the masked graph computes there), the
slots past the position never read (NaN there changes nothing), and on the CUDA emulator; negative
control: the slot bound one too far is detected by both checks. The pass: Before/Expected (plain
and grouped-query), every other mask or no mask left untouched, and the reduced GPT-2 / Llama
decode steps rewritten and matching onnxruntime on llvm and (slow) on the emulator at positions 0,
6 and L - 1, with the off-by-one control detected there too. float16: the kernels reading float16
(and float16 q with float32 caches, ToMixedPrecision's form) against NumPy; the pass on float16
exports (GPT-2's float16 softmax, Llama's upcast one) and under ToMixedPrecision, the reduced
float16 decoders against onnxruntime (2e-2), the declined forms declined in float16 too.
"""
import dataclasses
import shutil

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

from relay_passes import decode_attention as pass_module
from relay_passes import decode_attention_row as row_module
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
                                      shape.out_dtype))


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


HALF_SHAPES = [  # a float16 export's; ToMixedPrecision's (float16 q, the float32 caches)
    DecodeAttentionShape(2, 4, 2, 16, 8, 4, 4.0, True, 1, "float16", "float16", "float16"),
    DecodeAttentionShape(1, 3, 3, 10, 16, 4, 0.25, False, 1, "float16", "float32", "float32")]


def _half_arrays(shape, seed=0):
    q, k, v = _arrays(shape, seed)
    return q.astype(shape.q_dtype), k.astype(shape.kv_dtype), v.astype(shape.kv_dtype)


def _half_tolerance(shape):
    """float32 arithmetic on the float16 inputs: float32's rounding, or one float16 rounding of
    the result."""
    return dict(rtol=1e-5, atol=1e-6) if shape.out_dtype == "float32" else dict(rtol=2e-3,
                                                                                   atol=2e-3)


@pytest.mark.parametrize("shape", HALF_SHAPES, ids=["float16", "float16_q_float32_cache"])
def test_float16_versions_match_numpy_on_llvm(shape):
    """Every version reading float16 (computing in float32, the result in the graph's dtype)
    against NumPy's float64 on the same float16 values; control: the bound one slot too far."""
    q, k, v = _half_arrays(shape)
    assert DecodeAttentionShape.decode(shape.encode()) == shape
    combines = [_Cpu(f) for _, f in combine_versions(shape)]
    for _, func in partial_versions(shape):
        partial = _Cpu(func)
        for combine in combines:
            for p in (0, 3, 4, shape.max_len - 1):
                got = _two_phases(partial, combine, shape, q, k, v, p)
                assert got.dtype == np.dtype(shape.out_dtype)
                want = reference(q, k, v, p, shape.scale, shape.divide)
                np.testing.assert_allclose(got.astype(np.float64), want, err_msg=f"p={p}",
                                           **_half_tolerance(shape))
    wrong = _Cpu(partial_func(shape, bound_shift=1))
    got = _two_phases(wrong, combines[0], shape, q, k, v, 5)
    assert np.abs(got - reference(q, k, v, 5, shape.scale, shape.divide)).max() > 1e-2


def test_float16_in_the_cost_model_is_half_the_bytes():
    """The worst case charged for float16 caches: K and V whole at 2 bytes an element."""
    from tvm_rammer.scheduling.rkernels import param_bytes

    shape = HALF_SHAPES[0]
    cache = shape.batch * shape.kv_heads * shape.max_len * shape.head_dim
    assert param_bytes(partial_func(shape))[:3] == [
        shape.batch * shape.heads * shape.head_dim * 2, 2 * cache, 2 * cache]
    with pytest.raises(ValueError, match=r"decode attention: invalid shape"):
        DecodeAttentionShape(1, 1, 1, 4, 4, 4, 1.0, True, 1, "bfloat16")


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
    assert [n for n, _ in combines] == ["decode_combine_t64", "decode_combine_t32"]
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
    assert np.abs(run("wrong", "decode_combine_t64", 12) - reference(q, k, v, 12, 8.0, True)
                  ).max() > 1e-2


def test_float16_versions_match_numpy_on_the_cuda_emulator():
    """The float16 versions lowered for the H100 (half loads, float32 arithmetic, a half store)
    on the CPU emulator; the off-by-one bound detected."""
    _emulator_or_skip()
    from tvm_rammer.checks.emulator.versions import _build, _run
    from tvm_rammer.target import resolve_target

    shape = DecodeAttentionShape(1, 4, 2, 32, 64, 8, 8.0, True, 1, "float16", "float16",
                                 "float16")
    q, k, v = _half_arrays(shape, seed=3)
    combine = combine_versions(shape)[0]
    funcs = dict(partial_versions(shape) + [combine]
                 + [("wrong", partial_func(shape, bound_shift=1))])
    built = _build(funcs, resolve_target(TARGET), None)

    def run(pname, p):
        pos = np.array([p], np.int64)
        part = _run(built, pname, [q, k, v, pos, np.full((1, 4, 4, 66), np.nan, np.float32)],
                    60)[-1]
        return _run(built, combine[0],
                    [part, pos, np.full((1, 4, 1, 64), np.nan, np.float16)], 60)[-1]

    for pname, _ in partial_versions(shape):
        for p in (0, 7, 8, 31):
            got = run(pname, p)
            assert got.dtype == np.float16
            np.testing.assert_allclose(got.astype(np.float64), reference(q, k, v, p, 8.0, True),
                                       rtol=2e-3, atol=2e-3, err_msg=f"{pname} {p}")
    assert np.abs(run("wrong", 12) - reference(q, k, v, 12, 8.0, True)).max() > 1e-2


WARP_SHAPES = [  # a warp per slot: GQA, 4 warps over chunks of 8 (2 slots a warp), 2 dims a lane
    DecodeAttentionShape(2, 4, 2, 32, 64, 8, 8.0, True, warps=4),  # batch 2: (b, h) of each rTask
    DecodeAttentionShape(1, 4, 2, 32, 64, 8, 0.125, False, 1, "float16", "float16", "float16",
                         warps=4),
    DecodeAttentionShape(1, 2, 1, 20, 32, 8, 4.0, True, 0, "float16", "float32", "float32",
                         warps=2),  # a last chunk half full, a scalar position, 1 dim a lane
    DecodeAttentionShape(1, 2, 2, 72, 32, 2, 1.0, True, warps=2)]  # 36 chunks: 2 a lane


def test_warp_per_slot_versions_match_numpy_on_the_cuda_emulator():
    """The warp-per-slot phase 1 and the warp-per-dim combine (the defaults where the shape has
    warps; shuffles, so the emulator only), float32 and float16, grouped-query, more chunks than
    a warp's lanes, at positions 0, inside a chunk, on a chunk edge, L - 1 and negative; the
    thread-per-dim combine reads the same ``part``; phase 1's slot bound one too far is
    detected."""
    _emulator_or_skip()
    from tvm_rammer.checks.emulator.versions import _build, _run
    from tvm_rammer.target import resolve_target

    shape = WARP_SHAPES[0]
    partials, combines = partial_versions(shape), combine_versions(shape)
    assert [n for n, _ in partials][:2] == ["decode_attention_w4", "decode_attention_t32g1"]
    assert [n for n, _ in combines] == ["decode_combine_w4", "decode_combine_t64",
                                        "decode_combine_t32"]
    tvm.ir.assert_structural_equal(partial_func(shape), partials[0][1])
    tvm.ir.assert_structural_equal(combine_func(shape), combines[0][1])
    funcs = {}
    for i, shape in enumerate(WARP_SHAPES):
        assert DecodeAttentionShape.decode(shape.encode()) == shape
        funcs.update({f"w{i}": partial_func(shape), f"c{i}": combine_func(shape),
                      f"t{i}": da.thread_combine_func(shape, 32),
                      f"wrong{i}": partial_func(shape, bound_shift=1)})
    folded = [dataclasses.replace(WARP_SHAPES[0], out_layout="b1x", out_dtype="float16"),
              dataclasses.replace(WARP_SHAPES[1], out_layout="b1hd")]  # fold_consumers' forms
    funcs.update({f"f{i}": combine_func(shape) for i, shape in enumerate(folded)})
    built = _build(funcs, resolve_target(TARGET), None)

    def run(i, pname, p, cname="c"):
        shape = WARP_SHAPES[i]
        q, k, v = _half_arrays(shape, seed=i)
        pos = np.array([p] if shape.pos_len else p, np.int64)
        part = _run(built, pname, [q, k, v, pos, np.full(
            (shape.batch, shape.heads, shape.chunks, shape.head_dim + 2), np.nan, np.float32)],
                    60)[-1]
        out = _run(built, f"{cname}{i}", [part, pos, np.full(
            (shape.batch, shape.heads, 1, shape.head_dim), np.nan, shape.out_dtype)], 60)[-1]
        assert out.dtype == np.dtype(shape.out_dtype)
        return out.astype(np.float64), reference(q, k, v, p, shape.scale, shape.divide)

    for i, shape in enumerate(WARP_SHAPES):
        for p in (0, 5, 8, 9, shape.max_len - 1, -1):
            got, want = run(i, f"w{i}", p)
            np.testing.assert_allclose(got, want, err_msg=f"{shape} p={p}",
                                       **_half_tolerance(shape))
        got, want = run(i, f"w{i}", 9, "t")
        np.testing.assert_allclose(got, want, **_half_tolerance(shape))
        got, want = run(i, f"wrong{i}", 0)  # slot 1 read too: its chunk
        assert np.abs(got - want).max() > 1e-2, shape
    for i, shape in enumerate(folded):  # the combine storing the consumer's dtype and layout
        q, k, v = _half_arrays(WARP_SHAPES[i], seed=i)
        pos = np.array([9], np.int64)
        part = _run(built, f"w{i}", [q, k, v, pos, np.full(
            (shape.batch, shape.heads, shape.chunks, shape.head_dim + 2), np.nan, np.float32)],
                    60)[-1]
        out = _run(built, f"f{i}", [part, pos, np.full(shape.out_shape, np.nan, np.float16)],
                   60)[-1]
        want = reference(q, k, v, 9, shape.scale, shape.divide).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(out.astype(np.float64), want.reshape(shape.out_shape),
                                   rtol=2e-3, atol=2e-3)


def test_warp_per_slot_needs_whole_warps_of_dims():
    with pytest.raises(ValueError, match=r"decode attention: invalid shape"):
        DecodeAttentionShape(1, 1, 1, 8, 16, 4, 1.0, True, warps=2)
    with pytest.raises(ValueError, match=r"a warp per slot needs D % 32 == 0"):
        da.warp_partial_func(SHAPES[0], 2)
    with pytest.raises(ValueError, match=r"the combine's warps=3 must divide D=8"):
        da.warp_combine_func(SHAPES[0], 3)
    assert da.combine_warps(DecodeAttentionShape(1, 1, 1, 8, 96, 4, 1.0, True, warps=8)) == 8
    assert da.combine_warps(DecodeAttentionShape(1, 1, 1, 8, 96, 4, 1.0, True, warps=4)) == 4
    assert da.combine_warps(DecodeAttentionShape(1, 1, 1, 8, 32, 4, 1.0, True, warps=3)) == 2


def test_no_thread_per_slot_version_needs_more_than_48_kib_of_shared_memory():
    """chunk_to_fill's chunks reach 128 slots and more (a Llama-8B-shaped step: 32 heads, L 4096,
    D 128, chunk 256): 128 threads x (D + 2) floats of state is 66,560 bytes, which ptxas rejects
    ('uses too much shared data (0x10400 bytes, 0xc000 max)'), so no such version is listed and
    the default of a shape without warps is the widest that fits; at D 64 128 threads stay
    (control)."""
    big = DecodeAttentionShape(1, 32, 8, 4096, 128, 256, 11.3, True, 1, "float16", "float16",
                               "float16", warps=8)
    names = [n for n, _ in partial_versions(big)]
    assert names == ["decode_attention_w8", "decode_attention_t64g1", "decode_attention_t64g2",
                     "decode_attention_t32g1", "decode_attention_t32g2"]
    assert [n for n, _ in partial_versions(dataclasses.replace(big, head_dim=64))][1:3] == [
        "decode_attention_t128g1", "decode_attention_t128g2"]
    odd = DecodeAttentionShape(1, 4, 4, 512, 112, 128, 1.0, True)  # no warps: D % 32 != 0
    tvm.ir.assert_structural_equal(partial_func(odd), partial_versions(odd)[0][1])
    assert partial_versions(odd)[0][0] == "decode_attention_t64g1"
    for shape in (big, odd):
        for name, func in partial_versions(shape):
            shared = [int(np.prod([int(d) for d in b.shape])) * 4 for b in _shared_buffers(func)]
            assert shared and max(shared) <= 48 * 1024, (name, shared)


def _shared_buffers(func):
    found = []

    def visit(block):
        found.extend(b for b in block.alloc_buffers if str(b.scope()) == "shared")

    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.SBlock, visit)])
    return found

def test_rtasks_and_what_the_cost_model_is_charged():
    """Phase 1: one rTask per (b, head, chunk group), whole warps, the most threads first (the
    default); phase 2: one per (b, head).
    The cost model is charged the worst case (position L - 1): K and V whole, and a FLOP count
    of the static loops (a data-dependent loop extent made TVM's estimate 8e12 here)."""
    from tir_templates.prelower import prelower
    from tvm_rammer.scheduling.rkernels import flops_and_bytes, param_bytes
    from tvm_rammer.target import resolve_target

    shape = DecodeAttentionShape(1, 12, 12, 1024, 64, da.chunk_for(1024), 8.0, True)
    assert (shape.chunk, shape.chunks) == (64, 16)
    target = resolve_target(TARGET)
    for (name, func), grid, threads in zip(partial_versions(shape),
                                           (192, 96, 192, 96), (64, 64, 32, 32)):
        lowered = prelower(func, target, name=name)
        assert (lowered.num_rtasks, lowered.threads) == (grid, threads), name
    assert prelower(combine_func(shape), target).num_rtasks == 12
    warp = DecodeAttentionShape(1, 12, 12, 1024, 64, 32, 8.0, True, warps=8)  # the pipeline's
    lowered = prelower(partial_func(warp), target)
    assert (lowered.num_rtasks, lowered.threads) == (384, 256)
    assert param_bytes(partial_func(warp))[1:3] == [12 * 1024 * 64 * 4] * 2
    lowered = prelower(combine_func(warp), target)  # a warp per dim: 8 dims an rTask
    assert (lowered.num_rtasks, lowered.threads) == (96, 256)
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


def _repeat(bb, cache, kv, dim=D):
    op = relax.op
    n = H // kv
    x = bb.emit(op.broadcast_to(bb.emit(op.expand_dims(cache, axis=[2])), (B, kv, n, L, dim)))
    return bb.emit(op.reshape(x, (B, H, L, dim)))


def before(kv=H, scale="divide", mask_min=None, zero=0.0, slots=None, compare="greater",
           mask=True, tokens=1, axis=-1, dtype="float32", upcast=False, dim=D):
    """``main(q, k, v, pos) = softmax(q k^T / 4 + where(slots > pos, min, 0)) v`` as the ONNX
    import writes it (llama: ``* 0.25`` and the GQA repeat), in ``dtype`` (``mask_min`` None: its
    finfo.min); ``upcast``: the softmax between casts to float32 and back (Llama in float16)."""
    op = relax.op
    bb = relax.BlockBuilder()
    mask_min = float(np.finfo(dtype).min) if mask_min is None else mask_min
    q = relax.Var("q", _tensor((B, H, tokens, dim), dtype))
    k, v = (relax.Var(n, _tensor((B, kv, L, dim), dtype)) for n in ("k", "v"))
    pos = relax.Var("pos", _tensor((1,), "int64"))
    with bb.function("main", [q, k, v, pos]):
        with bb.dataflow():
            keys, values = (k, v) if kv == H else (_repeat(bb, k, kv, dim), _repeat(bb, v, kv, dim))
            scores = bb.emit(op.matmul(q, bb.emit(op.permute_dims(keys, [0, 1, 3, 2]))))
            if scale == "divide":
                scores = bb.emit(op.divide(scores, relax.const(4.0, dtype)))
            elif scale == "multiply_left":
                scores = bb.emit(op.multiply(relax.const(0.25, dtype), scores))
            if mask:
                values_r = np.arange(L) if slots is None else slots
                cond = bb.emit(getattr(op, compare)(relax.const(values_r.astype(np.int64)),
                                                    pos))
                scores = bb.emit(op.add(scores, bb.emit(op.where(
                    cond, relax.const(mask_min, dtype), relax.const(zero, dtype)))))
            if upcast:
                scores = bb.emit(op.astype(scores, "float32"))
            probs = bb.emit(op.nn.softmax(scores, axis=axis))
            if upcast:
                probs = bb.emit(op.astype(probs, dtype))
            out = bb.emit_output(op.matmul(probs, values))
        bb.emit_func_output(out)
    return bb.get()


def expected(kv=H, scale=4.0, divide=True, dtype="float32"):
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor((B, H, 1, D), dtype))
    k, v = (relax.Var(n, _tensor((B, kv, L, D), dtype)) for n in ("k", "v"))
    pos = relax.Var("pos", _tensor((1,), "int64"))
    shape = DecodeAttentionShape(B, H, kv, L, D, da.chunk_for(L), scale, divide, 1, dtype, dtype,
                                 dtype)
    with bb.function("main", [q, k, v, pos]):
        with bb.dataflow():
            partial = bb.add_func(partial_func(shape), "decode_attention_partial")
            combine = bb.add_func(combine_func(shape), "decode_attention_combine")
            part = bb.emit(relax.call_tir(partial, [q, k, v, pos],
                                          _tensor((B, H, shape.chunks, D + 2))))
            out = bb.emit_output(relax.call_tir(combine, [part, pos],
                                                _tensor((B, H, 1, D), dtype)))
        bb.emit_func_output(out)
    return bb.get()


def test_masked_attention_becomes_the_two_calls():
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(before()), expected())


def test_grouped_query_attention_reads_the_cache_not_its_repeat():
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(before(kv=2, scale="multiply_left")),
                                   expected(kv=2, scale=0.25, divide=False))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", [
    dict(mask_min=-1e4), dict(zero=1.0), dict(slots=np.arange(1, L + 1)),
    dict(slots=np.arange(L)[::-1].copy()), dict(compare="greater_equal"), dict(mask=False),
    dict(tokens=2), dict(axis=2)],
    ids=["min_not_finfo", "zero_not_0", "range_shifted", "range_reversed", "greater_equal",
         "no_mask", "two_tokens", "softmax_axis_2"])
def test_any_other_mask_or_shape_leaves_the_graph_untouched(case, dtype):
    mod = before(dtype=dtype, **case)
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(mod), mod)


@pytest.mark.parametrize("kv,scale,upcast", [(H, "divide", False), (2, "multiply_left", True)],
                         ids=["gpt2_float16", "llama_float16_upcast_softmax"])
def test_float16_attention_becomes_the_two_calls(kv, scale, upcast):
    """A float16 export's attention (finfo(float16).min mask; Llama's softmax between casts): the
    same two calls, reading and writing float16; the casts around the softmax dropped."""
    got = DecodeAttentionSplit()(before(kv=kv, scale=scale, dtype="float16", upcast=upcast))
    tvm.ir.assert_structural_equal(got, expected(kv=kv, scale=4.0 if scale == "divide" else 0.25,
                                                 divide=scale == "divide", dtype="float16"))


def test_an_infinite_float16_mask_is_declined():
    """-inf (what finfo(float32).min becomes in float16) is not float16's finfo.min."""
    mod = before(dtype="float16", mask_min=float("-inf"))
    tvm.ir.assert_structural_equal(DecodeAttentionSplit()(mod), mod)


def _cache_casts(mod):
    """astype bindings of main whose result has a cache's shape [B, H, L, D] (any H)."""
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.astype")):
                shape = [int(d) for d in binding.var.ty.shape]
                if len(shape) == 4 and shape[2:] == [L, D]:
                    found.append(binding.var.name)
    return found


@pytest.mark.parametrize("kv,scale", [(H, "divide"), (2, "multiply_left")])
def test_mixed_precision_attention_reads_the_float32_caches(kv, scale):
    """ToMixedPrecision on the float32 graph (what ``precision="float16"`` runs first): float16
    q, scores cast up and down, the scale a cast constant, K and V cast to float16 whole. The
    split reads q in float16 and the caches before their cast (no float16 copy of the cache
    left), writes the matmul's float32; control: the casts are there before the pass."""
    mixed = relax.transform.ToMixedPrecision(out_dtype="float32")(before(kv=kv, scale=scale))
    assert _cache_casts(mixed)
    got = DecodeAttentionSplit()(mixed)
    assert not _cache_casts(got)
    text = got["main"].script()
    assert "softmax" not in text and "R.matmul" not in text
    funcs = {gv.name_hint: f for gv, f in got.functions_items() if isinstance(f, tirx.PrimFunc)}
    shape = DecodeAttentionShape.decode(
        funcs["decode_attention_partial"].attrs["rammer.decode_attention_params"])
    assert (shape.q_dtype, shape.kv_dtype, shape.out_dtype, shape.kv_heads, shape.scale) == (
        "float16", "float32", "float32", kv, 4.0 if scale == "divide" else 0.25)
    partial = next(c for b in got["main"].body.blocks for c in (x.value for x in b.bindings)
                   if isinstance(c, relax.Call) and "partial" in str(c.args[0]))
    assert [a.name for a in partial.args[1].fields[1:3]] == ["k", "v"]


def test_bad_chunk_is_one_clear_error():
    with pytest.raises(ValueError, match=r"DecodeAttentionSplit: chunk=0 must be positive"):
        DecodeAttentionSplit(chunk=0)


def _partial_shapes(mod):
    return [DecodeAttentionShape.decode(f.attrs[da._PARAMS_ATTR]) for _, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and f.attrs.get(da.KIND_ATTR, None) == "partial"]


def test_the_chunk_fills_the_veus_with_one_round_of_rtasks():
    """The most rTasks (rows x chunks) that do not exceed the vEUs, a power of two of at least
    one slot a warp; a chunk of every slot when the rows alone exceed them."""
    from relay_passes.decode_attention import chunk_to_fill

    assert chunk_to_fill(12, 1024, 528, 8) == 32      # GPT-2 small, H100: 384 rTasks
    assert chunk_to_fill(32, 1024, 528, 8) == 64      # Llama-1B-shaped: 512 rTasks
    for rows, length, veus, least in [(12, 1024, 528, 8), (4, 16, 8, 1), (3, 10, 7, 2),
                                      (4, 100, 1000, 8), (40, 64, 16, 4), (1, 1, 1, 1)]:
        chunk = chunk_to_fill(rows, length, veus, least)
        assert chunk >= least and chunk & (chunk - 1) == 0
        tasks = rows * -(-length // chunk)
        if rows <= veus:
            assert tasks <= veus, (rows, length, veus)
        else:
            assert chunk >= length
        if chunk > least and chunk // 2 < length:      # one step smaller would not fit
            assert rows * -(-length // (chunk // 2)) > veus
    assert chunk_to_fill(40, 64, 16, 4) == 64


def test_the_pass_lays_out_a_warp_per_slot_where_the_head_dim_allows():
    """threads and veus given: warps = threads / 32 where D % 32 == 0 (else a thread per slot),
    the chunk chunk_to_fill's; without them today's chunk_for and a thread per slot."""
    got = _partial_shapes(DecodeAttentionSplit(veus=8, threads=64)(before(dim=32)))
    assert [(s.warps, s.chunk, s.chunks) for s in got] == [(2, 4, 2)]   # 4 heads x 2 chunks
    got = _partial_shapes(DecodeAttentionSplit(veus=8, threads=64)(before(kv=2, dim=16)))
    assert [(s.warps, s.chunk, s.kv_heads) for s in got] == [(0, 4, 2)]
    got = _partial_shapes(DecodeAttentionSplit()(before(dim=32)))
    assert [(s.warps, s.chunk) for s in got] == [(0, da.chunk_for(L))]
    got = _partial_shapes(DecodeAttentionSplit(chunk=8, veus=8, threads=128)(before(dim=32)))
    assert [(s.warps, s.chunk) for s in got] == [(4, 8)]
    for kwargs, text in [(dict(veus=0), "veus=0 must be positive"),
                         (dict(threads=48), "threads=48 must be a positive multiple of 32")]:
        with pytest.raises(ValueError, match=text):
            DecodeAttentionSplit(**kwargs)


def test_the_pipeline_gives_the_pass_its_veus_and_threads():
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import decode_attention_pass, split_k_passes
    from tvm_rammer.target import resolve_target

    target = resolve_target(TARGET)
    full = decode_attention_pass(target, RammerConfig(num_sms=132))
    assert (full.veus, full.threads) == (split_k_passes(target, RammerConfig(num_sms=132))[0].veus,
                                         256)
    assert full.veus == 528
    small = decode_attention_pass(target, RammerConfig(num_sms=2, veus_per_sm=2,
                                                       max_rtask_threads=128))
    assert (small.veus, small.threads) == (4, 128)


def test_a_target_without_32_lane_warps_keeps_the_thread_per_slot_kernels():
    """ROCm (64-lane waves): its code generator has no ``tvm_warp_shuffle_xor`` (building the
    warp kernels for the MI300X fails: 'unknown intrinsic'), so the pipeline's pass there lays
    out no warps (chunk_for's chunk, the fold kept); the H100's does (control)."""
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import decode_attention_pass
    from tvm_rammer.target import resolve_target

    amd = decode_attention_pass(resolve_target("rammer/amd-mi300x"), RammerConfig())
    assert (amd.threads, amd.veus, amd.fold_consumers) == (None, None, True)
    nvidia = decode_attention_pass(resolve_target(TARGET), RammerConfig())
    for pass_, warps in ((amd, 0), (nvidia, 8)):
        mod = pass_(before(dim=32))
        assert [s.warps for s in _partial_shapes(mod)] == [warps]
        shuffles = [f.script().count("tvm_warp_shuffle_xor") for _, f in mod.functions_items()
                    if isinstance(f, tirx.PrimFunc)]
        assert (sum(shuffles) > 0) == bool(warps), shuffles

def test_the_pass_is_in_the_rammer_pipeline():
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import graph_passes

    names = [p.info.name for p in graph_passes(RammerConfig())]
    assert names.index("DecodeAttentionSplit") < names.index("MemoLegalizeOps")



def _attention_then(consume, dtype="float32"):
    """``main(q, k, v, pos)``: the masked attention (B=2, H=4, L=8, D=16) and ``consume(bb, out)``
    of its result (what the combine's readers are)."""
    op, b = relax.op, 2
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor((b, H, 1, D), dtype))
    k, v = (relax.Var(n, _tensor((b, H, L, D), dtype)) for n in ("k", "v"))
    pos = relax.Var("pos", _tensor((1,), "int64"))
    with bb.function("main", [q, k, v, pos]):
        with bb.dataflow():
            scores = bb.emit(op.divide(bb.emit(op.matmul(q, bb.emit(op.permute_dims(
                k, [0, 1, 3, 2])))), relax.const(4.0, dtype)))
            mask = bb.emit(op.where(bb.emit(op.greater(relax.const(np.arange(L)), pos)),
                                    relax.const(float(np.finfo(dtype).min), dtype),
                                    relax.const(0.0, dtype)))
            out = bb.emit(op.matmul(bb.emit(op.nn.softmax(bb.emit(op.add(scores, mask)))), v))
            result = bb.emit_output(consume(bb, out))
        bb.emit_func_output(result)
    return bb.get()


def _combine_layouts(mod):
    return sorted((s.out_layout, s.out_dtype) for s in (
        DecodeAttentionShape.decode(f.attrs[da._PARAMS_ATTR]) for _, f in mod.functions_items()
        if isinstance(f, tirx.PrimFunc) and f.attrs.get(da.KIND_ATTR, None) == "combine"))


def test_only_a_sole_reader_of_the_claimed_layout_is_folded():
    """fold_consumers' controls: a cast to float16 and a head transpose + reshape fold (b1x,
    float16); a combine also returned, a float16 result cast up to float32 (two roundings), a
    transpose of other axes or a reshape to another shape stay separate ops after the combine."""
    op, fold = relax.op, DecodeAttentionSplit(fold_consumers=True)
    cases = [
        (lambda bb, x: op.reshape(bb.emit(op.permute_dims(bb.emit(op.astype(x, "float16")),
                                                          [0, 2, 1, 3])), (2, 1, H * D)),
         "float32", [("b1x", "float16")], []),
        (lambda bb, x: relax.Tuple([bb.emit(op.astype(x, "float16")), x]), "float32",
         [("", "float32")], ["astype"]),
        (lambda bb, x: op.astype(x, "float32"), "float16", [("", "float16")], ["astype"]),
        (lambda bb, x: op.permute_dims(x, [0, 1, 3, 2]), "float32", [("", "float32")],
         ["permute_dims"]),
        (lambda bb, x: op.reshape(x, (2, H * D)), "float32", [("", "float32")], ["reshape"])]
    for consume, dtype, layouts, kept in cases:
        mod = fold(_attention_then(consume, dtype))
        assert _combine_layouts(mod) == layouts
        text = mod["main"].script()
        assert [name for name in ("astype", "permute_dims", "reshape")
                if f"R.{name}(" in text] == kept, text


def test_the_folded_layout_holds_the_graphs_elements_at_batch_two_on_llvm():
    """Batch 2: the combine storing b1x float16 (a cast, the head transpose and a reshape folded)
    gives what the graph's own ops give (llvm, thread loops serial), at positions 0, 5, L - 1;
    control: the same elements in [B, 1, D, H] order (heads and dims swapped) are told apart."""
    op = relax.op
    consume = (lambda bb, x: op.reshape(bb.emit(op.permute_dims(bb.emit(op.astype(
        x, "float16")), [0, 2, 1, 3])), (2, 1, H * D)))
    mod = _attention_then(consume)
    folded = DecodeAttentionSplit(fold_consumers=True)(mod)
    assert _combine_layouts(folded) == [("b1x", "float16")]
    rng = np.random.default_rng(2)
    args = [rng.standard_normal(s).astype("float32") for s in ((2, H, 1, D), (2, H, L, D),
                                                                (2, H, L, D))]
    outs = []
    for m in (DecodeAttentionSplit()(mod), folded):
        m = relax.transform.LegalizeOps()(m)
        for gv, func in list(m.functions_items()):
            if isinstance(func, tirx.PrimFunc):
                m[gv] = serial_threads(func)
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        for p in (0, 5, L - 1):
            outs.append(vm["main"](*[tvm.runtime.tensor(a) for a in args],
                                   tvm.runtime.tensor(np.array([p], np.int64))).numpy())
    for unfolded, got in zip(outs[:3], outs[3:]):
        assert got.shape == (2, 1, H * D) and got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), unfolded.astype(np.float32),
                                   rtol=1e-3, atol=1e-3)
    swapped = outs[4].reshape(2, 1, H, D).transpose(0, 1, 3, 2).reshape(2, 1, H * D)
    assert np.abs(swapped.astype(np.float32) - outs[1].astype(np.float32)).max() > 1e-2
    assert np.abs(outs[3][0] - outs[3][1]).max() > 1e-2  # the batches differ: not one copied

def test_a_combine_called_in_a_branch_is_kept():
    """An attention inside an ``If`` branch: the combine PrimFunc it calls stays in the module
    (the pruning of unused combines once looked at main's top-level bindings only and dropped
    it: ``GlobalVar decode_attention_combine is not defined``)."""
    from tvm.script import ir as I, relax as R  # pylint: disable=import-outside-toplevel

    slots, low = np.arange(8, dtype=np.int64), float(np.finfo(np.float32).min)

    @I.ir_module
    class Branch:  # pylint: disable=too-few-public-methods
        @R.function
        def main(q: R.Tensor((1, 4, 1, 16), "float32"), k: R.Tensor((1, 4, 8, 16), "float32"),
                 v: R.Tensor((1, 4, 8, 16), "float32"), pos: R.Tensor((1,), "int64"),
                 c: R.Tensor((), "bool")) -> R.Tensor((1, 4, 1, 16), "float32"):
            if c:
                s = R.divide(R.matmul(q, R.permute_dims(k, [0, 1, 3, 2])), R.const(4.0))
                m = R.where(R.greater(R.const(slots), pos), R.const(low), R.const(0.0))
                r = R.matmul(R.nn.softmax(R.add(s, m), axis=-1), v)
            else:
                r = q
            return r

    mod = DecodeAttentionSplit(fold_consumers=True)(Branch)
    assert _combine_layouts(mod) == [("", "float32")]
    relax.analysis.well_formed(mod)  # raises when a called GlobalVar is missing
    assert "decode_attention_combine" in mod["main"].script()


# The reduced decoders.

def _feeds(model, position, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([position], np.int64)}
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        half = value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
        feeds[value.name] = rng.standard_normal(dims).astype(np.float16 if half else np.float32)
    return feeds


def _shift_bound(monkeypatch, make, shift=1):
    """Every partial the passes make (DecodeAttentionSplit's, DecodeAttentionStepRow's) with its
    slot bound moved by ``shift`` (the negative control)."""
    for module in (pass_module, row_module):
        monkeypatch.setattr(module, "partial_func", lambda shape: make(shape, bound_shift=shift))


def _llvm_vm(model, monkeypatch=None, shift=0, mixed=False):
    """The model imported (``mixed``: then ToMixedPrecision, as ``precision="float16"`` runs it),
    DecodeAttentionSplit (``shift``: the slot bound moved), the kernels' thread loops serial,
    legalized and built for llvm."""
    from tvm_rammer.driver.frontend import import_onnx

    if shift:
        monkeypatch.setattr(pass_module, "partial_func",
                            lambda shape: partial_func(shape, bound_shift=shift))
    mod = import_onnx(model)
    if mixed:
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
    mod = DecodeAttentionSplit()(mod)
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


@pytest.mark.parametrize("name,dtype", [("gpt2_decode", "float16"), ("llama_decode", "float32")])
def test_the_combines_cast_transpose_and_reshape_fold_into_it(name, dtype):
    """fold_consumers: HF's astype / transpose / reshape after the attention become the combine's
    store (no such op reads a combine any more, no other combine left in the module); the reduced
    decoder still matches onnxruntime on llvm (float16 2e-2, float32 1e-4)."""
    pytest.importorskip("onnxruntime")
    from tvm_rammer.driver.frontend import import_onnx

    model = get_model(name, dtype=dtype, **REDUCED[name])
    mod = DecodeAttentionSplit(fold_consumers=True)(import_onnx(model))
    combines = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)
                and f.attrs.get(da.KIND_ATTR, None) == "combine"]
    assert len(combines) == 1
    shape = DecodeAttentionShape.decode(combines[0][1].attrs[da._PARAMS_ATTR])
    heads, dim = shape.heads, shape.head_dim
    assert (shape.out_layout, shape.out_dtype) == ("b1x", dtype)
    text = mod["main"].script()
    assert text.count(f"out_ty=R.Tensor((1, 1, {heads * dim}), dtype=\"{dtype}\")") \
        == REDUCED[name]["layers"]
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gv] = serial_threads(func)
    vm = relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm"),
                              tvm.cpu())
    for p in (0, 6, REDUCED[name]["max_len"] - 1):
        errors = _errors(vm, model, _feeds(model, p))
        assert max(errors) <= (2e-2 if dtype == "float16" else 1e-4), (p, errors)


def test_off_by_one_bound_in_the_decoder_is_detected_on_llvm(monkeypatch):
    pytest.importorskip("onnxruntime")
    model = get_model("gpt2_decode", **REDUCED["gpt2_decode"])
    vm, _ = _llvm_vm(model, monkeypatch, shift=1)
    assert _errors(vm, model, _feeds(model, 6))[0] > 1e-3


@pytest.mark.parametrize("name", ["gpt2_decode", "llama_decode"])
@pytest.mark.parametrize("form", ["float16_export", "mixed_precision"])
def test_reduced_float16_decoder_rewritten_matches_onnxruntime_on_llvm(name, form):
    """The float16 export (float16 caches; Llama's upcast softmax) and the float32 export under
    ToMixedPrecision: every layer's attention split, no softmax left, within float16's 2e-2 of
    onnxruntime (on the export itself) at positions 0, 6 and L - 1."""
    pytest.importorskip("onnxruntime")
    half = form == "float16_export"
    model = get_model(name, dtype="float16" if half else "float32", **REDUCED[name])
    vm, text = _llvm_vm(model, mixed=not half)
    assert text.count("decode_attention_partial") == REDUCED[name]["layers"]
    assert "softmax" not in text
    for p in (0, 6, REDUCED[name]["max_len"] - 1):
        errors = _errors(vm, model, _feeds(model, p))
        assert max(errors) <= 2e-2, (p, errors)


def test_off_by_one_bound_in_the_float16_decoder_is_detected_on_llvm(monkeypatch):
    pytest.importorskip("onnxruntime")
    model = get_model("gpt2_decode", dtype="float16", **REDUCED["gpt2_decode"])
    vm, _ = _llvm_vm(model, monkeypatch, shift=1)
    assert _errors(vm, model, _feeds(model, 6))[0] > 5e-2


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
        _shift_bound(monkeypatch, partial_func)
        assert errors(emulator.emulation_build(model, config=config), 6)[0] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_decode", "llama_decode"])
def test_reduced_float16_decoder_on_the_emulator_matches_onnxruntime(name, monkeypatch):
    """The float16 export through the rammer pipeline (its attention split, float16 caches in and
    out, no cast of them) on the CPU emulator at positions 0, 6 and L - 1 (relative error <=
    2e-2 of onnxruntime on the export); control (gpt2): the bound one slot too far, detected."""
    pytest.importorskip("onnxruntime")
    _emulator_or_skip()
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model(name, dtype="float16", **REDUCED[name])
    config = RammerConfig(num_sms=2, veus_per_sm=2)

    def errors(build, p):
        feeds = _feeds(model, p)
        result = emulator.emulate(build, [feeds[i.name] for i in model.graph.input])
        assert all(o.dtype == np.float16 for o in result.outputs)
        return [relative_error(o, r) for o, r in zip(result.outputs, onnx_reference(model, feeds))]

    build = emulator.emulation_build(model, config=config)
    for p in (0, 6, REDUCED[name]["max_len"] - 1):
        assert max(errors(build, p)) <= 2e-2, p
    if name == "gpt2_decode":
        _shift_bound(monkeypatch, partial_func)
        assert errors(emulator.emulation_build(model, config=config), 6)[0] > 5e-2


@pytest.mark.slow
def test_warp_layout_in_the_rammer_pipeline_on_the_emulator_matches_onnxruntime(monkeypatch):
    """A reduced GPT-2 with head dim 32 through the rammer pipeline: phase 1 a warp per slot and
    the warp-per-dim combine inside the rProgram (rTasks of 64 threads, 2 warps, 4 chunks of 4
    slots filling 4 SMs x 4 vEUs), on the CPU emulator at positions 0, 6 and L - 1 (relative error
    <= 1e-4 of onnxruntime); control: the bound one slot too far, detected."""
    pytest.importorskip("onnxruntime")
    _emulator_or_skip()
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    params = dict(REDUCED["gpt2_decode"], layers=1, d_model=128)
    model = get_model("gpt2_decode", **params)
    config = RammerConfig(num_sms=4, veus_per_sm=4, max_rtask_threads=64)
    made = []
    real = pass_module.partial_func

    def recording(shape):
        made.append(shape)
        return real(shape)

    monkeypatch.setattr(pass_module, "partial_func", recording)

    def errors(build, p):
        feeds = _feeds(model, p)
        result = emulator.emulate(build, [feeds[i.name] for i in model.graph.input])
        return [relative_error(o, r) for o, r in zip(result.outputs, onnx_reference(model, feeds))]

    build = emulator.emulation_build(model, config=config)
    assert [(s.warps, s.chunk, s.chunks) for s in made] == [(2, 4, 4)]
    for p in (0, 6, params["max_len"] - 1):
        assert max(errors(build, p)) <= 1e-4, p
    _shift_bound(monkeypatch, real)
    assert errors(emulator.emulation_build(model, config=config), 6)[0] > 1e-3
