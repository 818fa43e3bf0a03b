"""SplitKGEMV (relay_passes.split_k_gemv): a narrow decode-step GEMV becomes a partial GEMV over
S row blocks of W and a sum.

The rewrite against its expected form (Before/Expected); which matmuls are split (a chain's
GEMVs; not a wave of parallel GEMVs that fills the vEUs, not M > 1, not a K without a divisor);
numerics against NumPy on llvm (fp32, and fp16 inputs accumulating in fp32) with a negative
control (the row blocks read in the wrong order: detected); the reduced gpt2_decode through the
rammer graph passes on llvm and (slow) the pipeline's CUDA on the CPU emulator, against
onnxruntime; the pipeline's vEU count and the config flag.
"""

import logging
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relay_passes import split_k_gemv as pass_module
from relay_passes.split_k_gemv import SplitKGEMV, partial_func, plan_splits
from tir_templates.serial_run import serial_threads
from tvm_rammer import RammerConfig
from tvm_rammer.models import REDUCED, get_model

K, N = 64, 32


def _gemv_module(k=K, n=N, m=1, dtype="float32", out_dtype=None, bias=True, seed=0):
    """main(x [m, 1, k]) = x @ W (+ b): W, b constants. Returns (module, W, b)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(out_dtype or dtype)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, 1, k), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w), out_dtype=out_dtype))
            if bias:
                y = bb.emit(relax.op.add(y, relax.const(b)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), w, b


def test_the_rewrite_is_the_partial_and_the_sum():
    """veus 8, 2 natural rTasks (N 32 / 16), min_rows 8: S = 4 (the smallest divisor of 64 with
    2 * S >= 8), W' = W reshaped [4, 16, 32]; the bias stays after the sum."""
    before, w, b = _gemv_module()
    after = SplitKGEMV(veus=8, min_rows=8)(before)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    partial = bb.add_func(partial_func([1, 1, K], 4, N, "float32", "float32"), "split_k_partial")
    with bb.function("main", [x]):
        with bb.dataflow():
            p = bb.emit(relax.call_tir(partial, [x, relax.const(w.reshape(4, 16, N))],
                                       relax.TensorType((4, 1, N), "float32")))
            y = bb.emit(relax.op.sum(p, axis=[0], keepdims=True))
            y = bb.emit(relax.op.add(y, relax.const(b)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(after, bb.get())


def test_what_is_split_and_what_is_not():
    mod, _, _ = _gemv_module()
    assert list(plan_splits(mod["main"], veus=8, min_rows=8).values()) == [4]
    assert list(plan_splits(mod["main"], veus=100, min_rows=8).values()) == [8]  # K/S >= 8
    assert plan_splits(mod["main"], veus=2) == {}  # 2 rTasks already fill 2 vEUs
    assert plan_splits(mod["main"], veus=8, min_rows=64) == {}  # no block of >= 64 rows
    assert plan_splits(_gemv_module(m=4)[0]["main"], veus=8, min_rows=8) == {}  # a GEMM
    assert plan_splits(_gemv_module(k=61)[0]["main"], veus=8, min_rows=8) == {}  # K prime
    unchanged, _, _ = _gemv_module()
    assert SplitKGEMV(veus=2)(unchanged).same_as(unchanged)


def _parallel_gemvs(branches):
    """``branches`` GEMVs of one input side by side (a wave), their outputs added."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, K), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            ys = [bb.emit(relax.op.matmul(x, relax.const(
                rng.standard_normal((K, N)).astype("float32")))) for _ in range(branches)]
            total = ys[0]
            for y in ys[1:]:
                total = bb.emit(relax.op.add(total, y))
            out = bb.emit_output(total)
        bb.emit_func_output(out)
    return bb.get()


def test_a_wave_of_gemvs_that_fills_the_veus_is_left_alone():
    """Four parallel GEMVs of 2 rTasks: a wave of 8. 8 vEUs: none split; 16 vEUs: none split
    (they share a wave) unless ``parallel``, then each in two (the wave's 8 x 2), not in eight
    (what one alone would need)."""
    wave = _parallel_gemvs(4)["main"]
    assert plan_splits(wave, veus=8, min_rows=8, parallel=True) == {}
    assert plan_splits(wave, veus=16, min_rows=8) == {}
    assert sorted(plan_splits(wave, veus=16, min_rows=8, parallel=True).values()) == [2] * 4
    # a chain is no wave: each GEMV of a chain is split for itself
    mod, _, _ = _gemv_module()
    assert list(plan_splits(mod["main"], veus=16, min_rows=8).values()) == [8]


def _normed_gemv(norm):
    """main(x [1, 1, K]) = norm(x) @ W: norm "layer_norm", "rms" (as exporters write RMSNorm:
    x * rsqrt(mean(x * x, -1) + eps) * g) or "first" (a mean over the first axis: no row norm)."""
    rng = np.random.default_rng(0)
    g = relax.const(np.ones(K, "float32"))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            if norm == "layer_norm":
                row = bb.emit(relax.op.nn.layer_norm(x, g, g, axes=[-1]))
            else:
                axis = -1 if norm == "rms" else 0
                ms = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(x, x)), axis=[axis],
                                           keepdims=True))
                inv = bb.emit(relax.op.rsqrt(bb.emit(relax.op.add(ms, relax.const(1e-5)))))
                row = bb.emit(relax.op.multiply(bb.emit(relax.op.multiply(x, inv)), g))
            y = bb.emit(relax.op.matmul(row, relax.const(
                rng.standard_normal((K, N)).astype("float32"))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("norm, left", [("layer_norm", True), ("rms", True), ("first", False)])
def test_a_gemv_after_a_row_norm_is_left_to_the_norm_fusion(norm, left):
    """With leave_norm_rows (NormGEMVFusion on) a GEMV whose row is a LayerNorm or an exported
    RMSNorm is not split (the norm becomes its prologue instead); a mean over another axis is no
    row norm; without leave_norm_rows every one is split."""
    func = _normed_gemv(norm)["main"]
    assert (plan_splits(func, 8, min_rows=8, leave_norm_rows=True) == {}) == left
    assert list(plan_splits(func, 8, min_rows=8).values()) == [4]


def _layer_norm_gemv(k=K, residual=False):
    """main(x [1, 1, k]) = layer_norm(x) @ W [k, N] (``residual``: plus layer_norm(x)[.., :N],
    the norm also read by an add, as in a post-LN block)."""
    rng = np.random.default_rng(0)
    g = relax.const(np.ones(k, "float32"))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, k), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            row = bb.emit(relax.op.nn.layer_norm(x, g, g, axes=[-1]))
            y = bb.emit(relax.op.matmul(row, relax.const(
                rng.standard_normal((k, N)).astype("float32"))))
            if residual:
                y = bb.emit(relax.op.add(y, relax.op.strided_slice(row, [2], [0], [N])))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def test_a_norm_the_fusion_cannot_take_does_not_stop_the_split():
    """leave_norm_rows leaves only what NormGEMVFusion takes: a norm also read by a residual add
    (post-LN) or a row past its 16 KB (K 8192 float32) would be neither fused nor split."""
    assert plan_splits(_layer_norm_gemv()["main"], 8, min_rows=8, leave_norm_rows=True) == {}
    for func in (_layer_norm_gemv(residual=True)["main"], _layer_norm_gemv(k=8192)["main"]):
        assert plan_splits(func, 8, min_rows=8, leave_norm_rows=True) != {}


def _llvm(mod):
    mod = relax.transform.LegalizeOps()(mod)
    return relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())


@pytest.mark.parametrize("dtype, out_dtype", [("float32", None), ("float16", "float32"),
                                              ("float16", None)])
def test_split_gemv_matches_numpy_on_llvm(dtype, out_dtype):
    """fp32; fp16 inputs with an fp32 out_dtype (ToMixedPrecision's matmul); an fp16 matmul
    (partials in fp32, one cast after the sum)."""
    before, w, b = _gemv_module(k=256, n=48, dtype=dtype, out_dtype=out_dtype)
    after = SplitKGEMV(veus=64, min_rows=16)(before)
    assert "split_k_partial" in after.script()
    x = np.random.default_rng(1).standard_normal((1, 1, 256)).astype(dtype)
    want = x.astype("float64") @ w.astype("float64") + b.astype("float64")
    got = _llvm(after)["main"](tvm.runtime.tensor(x)).numpy()
    assert got.dtype == np.dtype(out_dtype or dtype)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)


def test_a_matmul_of_two_dtypes_is_split_with_the_weights_own():
    """relax.matmul with an out_dtype takes x and W of different dtypes (here x float16, W
    float32): the partial reads W as its own dtype (it took x's: a type mismatch from inside
    TVM's CallTIRRewrite)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 48)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 256), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.const(w), out_dtype="float32"))
        bb.emit_func_output(out)
    after = SplitKGEMV(veus=64, min_rows=16)(bb.get())
    assert "split_k_partial" in after.script()
    xs = rng.standard_normal((1, 256)).astype("float16")
    got = _llvm(after)["main"](tvm.runtime.tensor(xs)).numpy()
    np.testing.assert_allclose(got, xs.astype("float32") @ w, rtol=1e-4, atol=1e-4)


def test_a_zero_size_gemv_is_left_alone():
    """N = 0 (or K = 0): nothing to read, nothing split (N = 0 divided by zero rTasks)."""
    for k, n in ((64, 0), (0, 32)):
        before, _, _ = _gemv_module(k=k, n=n, bias=False)
        assert plan_splits(before["main"], veus=8, min_rows=8) == {}
        assert SplitKGEMV(veus=8, min_rows=8)(before).same_as(before)


def _shifted(*args, **kwargs):
    """The negative control's partial: W's block b meets x's block b + 1."""
    return partial_func(*args, block_shift=1, **kwargs)


def test_row_blocks_in_the_wrong_order_are_detected(monkeypatch):
    """Negative control: the partial reading x's block b + 1 for W's block b gives other sums."""
    monkeypatch.setattr(pass_module, "partial_func", _shifted)
    before, w, b = _gemv_module(k=256, n=48)
    after = SplitKGEMV(veus=64, min_rows=16)(before)
    x = np.random.default_rng(1).standard_normal((1, 1, 256)).astype("float32")
    got = _llvm(after)["main"](tvm.runtime.tensor(x)).numpy()
    assert not np.allclose(got, x @ w + b, rtol=1e-3, atol=1e-3)


def test_bad_sizes_are_one_clear_error():
    with pytest.raises(ValueError, match=r"veus=0.*must be >= 1"):
        SplitKGEMV(veus=0)


# The reduced GPT-2 decode step (d_model 64: QKV 12 rTasks, projection and fc2 4, fc1 16, head 6).

GPT2 = REDUCED["gpt2_decode"]
VEUS = 16  # RammerConfig(num_sms=4, veus_per_sm=4) on the H100 preset


def _feeds(model, position, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([position], np.int64)}
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _errors(outputs, model, feeds):
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    return [relative_error(np.asarray(g), r)
            for g, r in zip(outputs, onnx_reference(model, feeds))]


@pytest.mark.parametrize("name, precision, tol, nt", [("gpt2_decode", "float32", 1e-4, False),
                                                       ("gpt2_decode", "float32", 1e-4, True),
                                                       ("gpt2_decode", "float16", 2e-2, True),
                                                       ("llama_decode", "float32", 1e-4, True),
                                                       ("llama_decode", "float16", 2e-2, True)])
def test_reduced_decoder_graph_passes_match_onnxruntime_on_llvm(name, precision, tol, nt):
    """The rammer graph passes with 16 vEUs built for llvm (gpt2: every GEMV but fc1 split;
    llama: the GEMVs alone in their wave, not q, k, v nor gate, up). ``nt``: the one-operator
    form where it has a layout (gpt2's projection and fc2, N 64: r 4; its QKV, N 192, stays
    split-K; llama's o_proj, down and LM head)."""
    pytest.importorskip("onnxruntime")
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes

    model = get_model(name, **REDUCED[name])
    mod = import_onnx(model)
    passes = graph_passes(RammerConfig(precision=precision),
                          [SplitKGEMV(VEUS, min_rows=16, nt=nt)])
    mod = tvm.transform.Sequential(passes)(mod)
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert any("split_k_partial" in n for n in names) == (name == "gpt2_decode" or not nt)
    assert any("nt_gemv" in n for n in names) == nt
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):  # the decode attention's kernels: threads serial
            mod[gv] = serial_threads(func)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for p in (0, REDUCED[name]["max_len"] - 1):
        feeds = _feeds(model, p)
        got = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in model.graph.input])
        assert max(_errors([g.numpy() for g in got], model, feeds)) <= tol, p


@pytest.mark.parametrize("precision, tol", [("float32", 1e-4), ("float16", 2e-2)])
def test_weights_apart_the_blocks_are_a_lifted_reshape_and_match_onnxruntime(precision, tol):
    """Weights kept apart (``main``'s weights are parameters): W' is a reshape of the parameter
    (at precision float16 of its cast: before, no GEMV was split there), and the one operator's
    W^T a permute_dims of it, which LiftWeightTransforms moves into ``transform_params``; the
    outputs still match."""
    pytest.importorskip("onnxruntime")
    from relay_passes.lift_weights import TRANSFORM_NAME
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes
    from tvm_rammer.lease import manifest as mf

    model = get_model("gpt2_decode", **GPT2)
    passes = graph_passes(RammerConfig(weights="apart", precision=precision),
                          [SplitKGEMV(VEUS, min_rows=16, nt=True)])
    mod = tvm.transform.Sequential(passes)(import_onnx(model, weights="apart"))
    # QKV's W [64, 192]: 12 rTasks; S 4 (48 rTasks, 3 rounds of 16) reads fastest: made there
    assert f'R.Tensor((4, 16, 192), dtype="{precision}")' in mod[TRANSFORM_NAME].script()
    # fc2's W [256, 64]: the one operator over W^T [64, 256], transposed there too (the shape
    # alone would not tell: fc1's W is [64, 256], a parameter of transform_params as it is)
    assert any("call_tir(transpose" in line and f'R.Tensor((64, 256), dtype="{precision}")' in line
               for line in mod[TRANSFORM_NAME].script().splitlines())
    assert any("nt_gemv" in gv.name_hint for gv in mod.get_global_vars())
    weight_only = []  # a call of main reading weights alone would run every inference
    params = set(mod["main"].params[int(mod["main"].attrs["num_input"]):])
    for binding in mod["main"].body.blocks[0].bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")) \
                and all(a in params for a in value.args[1].fields):
            weight_only.append(value.args[0].name_hint)
    assert weight_only == []
    assert any("split_k_partial" in str(gv.name_hint) for gv in mod.get_global_vars())
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gv] = serial_threads(func)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    weights = vm[TRANSFORM_NAME](*[tvm.runtime.tensor(a) for _, a in mf.raw_weights(model)])
    feeds = _feeds(model, 6)
    got = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in model.graph.input], *weights)
    assert max(_errors([g.numpy() for g in got], model, feeds)) <= tol


def test_the_pipeline_fills_the_vdevices_veus():
    from tvm_rammer.driver.pipeline import graph_passes, rammer_passes, split_k_passes

    target = tvm.target.Target("rammer/nvidia-h100")
    (full,) = split_k_passes(target, RammerConfig(num_sms=132))
    assert (full.veus, full.step_us, full.mem_bw_gbps, full.rtask_us) == (528, 1.3, 3000.0, 0.5)
    assert full.leave_norm_rows  # NormGEMVFusion runs: the GEMVs after norms are its
    assert (full.nt, full.threads) == (True, 256)  # the one-operator form where it has a layout
    assert not split_k_passes(target, RammerConfig(norm_fusion=False))[0].leave_norm_rows
    assert split_k_passes(target, RammerConfig(num_sms=4, veus_per_sm=4))[0].veus == VEUS
    assert split_k_passes(target, RammerConfig(split_k=False)) == []
    names = [p.info.name for p in rammer_passes(target, RammerConfig(num_sms=132))]
    assert names.index("FoldConstantOps") < names.index("SplitKGEMV") \
        < names.index("MemoLegalizeOps")
    assert "SplitKGEMV" not in [p.info.name for p in graph_passes(RammerConfig(split_k=False),
                                                                  [full])]


def test_s_is_the_cost_models_fastest_and_a_split_must_save_more_than_its_step():
    """528 vEUs, 0.5 us per rTask. fp16 W [3072, 768] (GPT-2 small's fc2, 48 rTasks, 17.8 us):
    S 8 (384 rTasks, one round, 2.7 us), not S 12 (576 rTasks: two rounds, 3.9 us); fp32: S 32
    (1536 rTasks, three rounds of a third of the bytes, 4.7 us against 35.1). [64, 32] fp32
    (8 KB): no split saves the 1.3 us step (a reduced model's GEMVs), any split saves 0 us."""
    fc2, _, _ = _gemv_module(k=3072, n=768, dtype="float16", bias=False)
    fc2_32, _, _ = _gemv_module(k=3072, n=768, bias=False)
    small, _, _ = _gemv_module()
    cost = dict(step_us=1.3, rtask_us=0.5)
    assert list(plan_splits(fc2["main"], 528, **cost).values()) == [8]
    assert list(plan_splits(fc2_32["main"], 528, **cost).values()) == [32]
    assert plan_splits(small["main"], 528, **cost) == {}
    assert plan_splits(small["main"], 528) != {}  # the step alone decides

@pytest.mark.slow
def test_reduced_gpt2_on_the_emulator_matches_onnxruntime(monkeypatch):
    """The rammer pipeline's CUDA (4 SMs x 4 vEUs) on the CPU emulator at positions 0 and L - 1
    (fp32: relative error <= 1e-4), its GEMVs split whatever they save (the reduced model's
    weights are too small for the pipeline's step test). Control: x's row blocks read in the
    wrong order, detected."""
    pytest.importorskip("onnxruntime")
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tvm_rammer.checks import emulator
    from tvm_rammer.driver import pipeline

    monkeypatch.setattr(pipeline, "SplitKGEMV", lambda veus, **_: SplitKGEMV(veus, min_rows=16))
    model = get_model("gpt2_decode", **GPT2)
    config = RammerConfig(num_sms=4, veus_per_sm=4)

    def errors(build, p):
        feeds = _feeds(model, p)
        result = emulator.emulate(build, [feeds[i.name] for i in model.graph.input])
        return _errors(result.outputs, model, feeds)

    build = emulator.emulation_build(model, config=config)
    assert "split_k_partial" in build.cuda_source
    for p in (0, GPT2["max_len"] - 1):
        assert max(errors(build, p)) <= 1e-4, p
    monkeypatch.setattr(pass_module, "partial_func", _shifted)
    assert errors(emulator.emulation_build(model, config=config), 6)[0] > 1e-3


def test_the_flag_turns_it_off():
    from tvm_rammer import cli

    parser = cli.build_parser()
    for command in (["run", "m.onnx"], ["compile", "m.onnx", "-o", "m.so"], ["inspect", "m.onnx"]):
        assert cli._config(parser.parse_args(command)).split_k is True
        assert cli._config(parser.parse_args(command + ["--no-split-k"])).split_k is False


# The one-operator form (nt=True, the pipeline's): y = x @ W as a GEMV over Wt = W^T [N, K] with
# r rows of Wt per rTask (tir_templates.nt_gemv), its epilogue fused by FuseOps.

def test_the_one_operator_form_is_the_gemv_over_the_transposed_weight():
    """veus 8, N 32: r = 4 (8 rTasks, 64 lanes over K 64 on 256 threads): one call_tir reading
    the constant W^T, the bias after it (FuseOps' epilogue), no partial and no sum."""
    before, w, b = _gemv_module()
    after = SplitKGEMV(veus=8, min_rows=8, nt=True)(before)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, K), "float32"))
    gemv = bb.add_func(pass_module.nt_gemv_func([1, 1, K], N, 4, "float32", "float32"), "nt_gemv")
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.call_tir(gemv, [x, relax.const(np.ascontiguousarray(w.T))],
                                       relax.TensorType((1, 1, N), "float32")))
            y = bb.emit(relax.op.add(y, relax.const(b)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(after, bb.get())


def test_rows_per_rtask_fill_one_round_of_the_veus():
    """528 vEUs of 256 threads: GPT-2 small's projection / fc2 (N 768) r 2 (384 rTasks), Llama-1B's
    o_proj / down (N 2048) r 4 (512); N 192 on 16 vEUs would need r 16 (8 threads a row): None,
    and the GEMV is split-K as before (the control); an M > 1 GEMM is left alone."""
    assert pass_module.nt_rows(768, 768, 2, 528) == 2
    assert pass_module.nt_rows(768, 3072, 2, 528) == 2
    assert pass_module.nt_rows(2048, 8192, 2, 528) == 4
    assert pass_module.nt_rows(192, 64, 4, 16) is None
    wide, _, _ = _gemv_module(k=64, n=192)
    after = SplitKGEMV(veus=16, min_rows=16, nt=True)(wide)
    names = [gv.name_hint for gv in after.get_global_vars()]
    assert "split_k_partial" in names and "nt_gemv" not in names
    gemm, _, _ = _gemv_module(m=4)
    assert SplitKGEMV(veus=8, min_rows=8, nt=True)(gemm).same_as(gemm)


def _fused_nt_gemv(k, n, dtype, veus):
    """The fused PrimFunc of ``cast(x @ W + b + res, float32)`` (x, W, b, res of ``dtype``) after
    SplitKGEMV(nt) and FuseOps / FuseTIR, with (W, b)."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, k), dtype))
    res = relax.Var("res", relax.TensorType((1, n), dtype))
    with bb.function("main", [x, res]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))
            y = bb.emit(relax.op.add(y, relax.const(b)))
            y = bb.emit(relax.op.add(y, res))
            out = bb.emit_output(relax.op.astype(y, "float32"))
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([
        SplitKGEMV(veus=veus, min_rows=16, nt=True), relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())
    (fused,) = [f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return fused, w, b


@pytest.mark.parametrize("dtype, k, n, veus, rows, tol", [
    ("float32", 512, 64, 32, 2, 1e-5),    # 128 lanes of 4 floats a row
    ("float16", 512, 64, 16, 4, 2e-3)])   # 64 lanes of 2 halves a row, fp32 sums, fp16 epilogue
def test_the_nt_gemv_kernel_matches_numpy_on_the_cuda_emulator(dtype, k, n, veus, rows, tol):
    """The fused GEMV + bias + residual + cast, scheduled by NTGEMV for the H100 (r rows an
    rTask, lanes over K, a cross-thread sum per row), on the CPU emulator against NumPy.
    Control: the same kernel fed W's own bytes (not transposed): detected."""
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tir_templates.nt_gemv import NT_GEMV_ANNOTATION, NTGEMV
    from tvm_rammer.checks.emulator.versions import _build, _run
    from tvm_rammer.target import resolve_target, rkernel_target

    fused, w, b = _fused_nt_gemv(k, n, dtype, veus)
    assert NT_GEMV_ANNOTATION in fused.script()  # the annotation FuseTIR keeps
    assert f"{NT_GEMV_ANNOTATION}\": {rows}" in fused.script()
    target = resolve_target("rammer/nvidia-h100")  # scheduled as in the pipeline: 256 threads
    scheduled = NTGEMV().apply(fused, rkernel_target(target, RammerConfig()))
    assert scheduled is not None
    func = scheduled.mod["main"]
    assert f"T.int64({n // rows}), thread=\"blockIdx.x\"" in func.script()
    built = _build({"nt": func.with_attr("global_symbol", "nt")}, target, None)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, k)).astype(dtype)
    res = rng.standard_normal((1, n)).astype(dtype)
    assert [p.name for p in func.params][:4] == ["x", "param_0", "param_1", "res"]  # W^T, b

    def run(wt):
        return _run(built, "nt", [x, wt, b, res, np.full((1, n), np.nan, np.float32)], 60)[-1]

    got = run(np.ascontiguousarray(w.T))
    want = x.astype(np.float64) @ w.astype(np.float64) + b + res
    if dtype == "float16":  # the fp16 GEMV rounds its fp32 sum once, then adds in fp16
        want = ((x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16) + b + res)
    np.testing.assert_allclose(got, want.astype(np.float64), rtol=tol, atol=tol)
    assert np.abs(run(w.reshape(n, k)) - want).max() > 1e-1  # W's bytes as they were: detected


@pytest.mark.slow
@pytest.mark.parametrize("name, precision, tol", [("gpt2_decode", "float32", 1e-4),
                                                   ("llama_decode", "float16", 2e-2)])
def test_reduced_decoders_with_the_one_operator_gemv_match_onnxruntime_on_the_emulator(
        monkeypatch, name, precision, tol):
    """The rammer pipeline's CUDA (4 SMs x 4 vEUs, the pipeline's nt) on the CPU emulator at
    positions 0 and L - 1, every chain GEMV split whatever it saves: gpt2's projection and fc2,
    llama's o_proj, down (its SiLU gate the prologue) and LM head are NTGEMV kernels in the
    rProgram (float16: half weights, float32 sums)."""
    pytest.importorskip("onnxruntime")
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tvm_rammer.checks import emulator
    from tvm_rammer.driver import pipeline

    monkeypatch.setattr(pipeline, "SplitKGEMV", lambda veus, **kw: SplitKGEMV(
        veus, min_rows=16, nt=kw["nt"], threads=kw["threads"]))
    model = get_model(name, **REDUCED[name])
    config = RammerConfig(num_sms=4, veus_per_sm=4, precision=precision)
    build = emulator.emulation_build(model, config=config)
    assert "nt_gemv" in build.cuda_source
    for p in (0, REDUCED[name]["max_len"] - 1):
        feeds = _feeds(model, p)
        result = emulator.emulate(build, [feeds[i.name] for i in model.graph.input])
        assert max(_errors(result.outputs, model, feeds)) <= tol, p


def test_the_nt_rule_leaves_other_functions_and_lays_out_whole_warps(caplog):
    """NTGEMV: None for a function without the annotation, and for an annotated one whose rows
    leave no whole warps over K (r 3 of 256 threads: dlight's rules take it then); its layouts
    tile K exactly with whole warps (vec 4 float32, 2 float16, halved until they tile)."""
    from tir_templates.nt_gemv import NTGEMV, nt_gemv_layout

    assert NTGEMV().apply(tirx.PrimFunc([], tirx.Evaluate(0))) is None
    assert NTGEMV().apply(partial_func([1, 64], 4, 32, "float32", "float32")) is None
    odd = pass_module.nt_gemv_func([1, 64], 30, 3, "float32", "float32")
    with caplog.at_level(logging.DEBUG, logger="tir_templates.annotated_rule"):
        assert NTGEMV().apply(odd) is None
    assert "NTGEMV does not apply: no layout of whole warps" in caplog.text  # said, not hidden
    assert nt_gemv_layout(768, 2, 2) == (128, 2)
    assert nt_gemv_layout(768, 2, 4) == (128, 2)  # 128 x 4 does not tile 768
    assert nt_gemv_layout(8192, 4, 2) == (64, 2)
    assert nt_gemv_layout(64, 8, 4) == (32, 2)
    assert nt_gemv_layout(48, 8, 4) is None  # 32 lanes do not tile 48
    assert nt_gemv_layout(64, 16, 4) is None  # 16 threads a row: not a warp


def _gated_nt_gemv(k, n, x_dtype, w_dtype, rows=4):
    """An annotated GEMV whose row is an elementwise prologue of two tensors, ``(a * b) @ Wt^T``
    (Llama's down projection after silu(gate) * up; GPT-2's fc2 after the GELU's last multiply),
    plus one, cast to ``x_dtype``: the PrimFunc FuseTIR makes of them (TE)."""
    from tvm import te
    from tir_templates.nt_gemv import NT_GEMV_ANNOTATION

    i64 = lambda d: tvm.tirx.IntImm("int64", d)  # noqa: E731
    a = te.placeholder([i64(1), i64(k)], x_dtype, name="a")
    b = te.placeholder([i64(1), i64(k)], x_dtype, name="b")
    wt = te.placeholder([i64(n), i64(k)], w_dtype, name="wt")
    row = te.compute(a.shape, lambda i, j: a[i, j] * b[i, j], name="gate")
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    y = te.compute([i64(1), i64(n)], lambda i, j: te.sum(
        row[i, r].astype("float32") * wt[j, r].astype("float32"), axis=r), name="nt_gemv",
        attrs={NT_GEMV_ANNOTATION: rows})
    out = te.compute(y.shape, lambda i, j: (y[i, j] + 1.0).astype(x_dtype), name="epilogue")
    return te.create_prim_func([a, b, wt, out])


@pytest.mark.parametrize("x_dtype, w_dtype, vec", [("float16", "float16", 2),
                                                    ("float32", "float16", 2),
                                                    ("float16", "float32", 4)])
def test_the_nt_rule_loads_the_weight_in_vectors_behind_a_two_tensor_prologue(x_dtype, w_dtype,
                                                                               vec):
    """With the prologue (a * b) inlined, the GEMV block reads a, b and Wt: the vector load and
    the vec of the layout are Wt's (its dtype), not the prologue's second tensor's."""
    from tir_templates.nt_gemv import schedule_nt_gemv

    script = schedule_nt_gemv(_gated_nt_gemv(512, 64, x_dtype, w_dtype)).mod["main"].script()
    assert "wt_local = T.sblock_alloc_buffer" in script
    assert "b_local" not in script and "a_local" not in script
    assert f"T.vectorized(T.int64({vec}))" in script and f"T.unroll(T.int64({vec}))" in script


@pytest.mark.parametrize("max_rtask_threads", [128, 256, 1024])
def test_the_nt_rule_schedules_the_rows_the_pass_chose_at_the_configs_threads(max_rtask_threads):
    """The pass chooses r for ``max_rtask_threads`` threads an rTask (the pipeline's
    split_k_passes); NTGEMV, under the rKernel target (threads capped at the same), lays out those
    r rows: N 4096 at 1024 threads on the H100's 132 vEUs is r 32 (32 lanes a row), which a rule
    capped at 256 threads (8 lanes a row) left to dlight."""
    from tir_templates.nt_gemv import NTGEMV
    from tvm_rammer.driver.pipeline import split_k_passes
    from tvm_rammer.target import resolve_target, rkernel_target

    config = RammerConfig(max_rtask_threads=max_rtask_threads)
    target = resolve_target("rammer/nvidia-h100")
    (split,) = split_k_passes(target, config)
    rows = pass_module.nt_rows(4096, 4096, 2, split.veus, split.threads)
    assert rows is not None and 4096 // rows <= split.veus
    func = pass_module.nt_gemv_func([1, 4096], 4096, rows, "float16", "float32")
    scheduled = NTGEMV().apply(func, rkernel_target(target, config))
    assert scheduled is not None
    script = scheduled.mod["main"].script()
    assert f"T.int64({4096 // rows}), thread=\"blockIdx.x\"" in script
    assert f"T.int64({max_rtask_threads // rows}), thread=\"threadIdx.x\"" in script
