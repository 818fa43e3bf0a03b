"""A decode step's LayerNorm fused into the GEMVs that read it (issue 34):
``relay_passes.norm_gemv.NormGEMVFusion`` and ``tir_templates.norm_gemv.NormGEMV``.

The pass: Before/Expected on ``layer_norm -> matmul + bias`` after the grouping (one fused
function per GEMV holding the norm's call then the GEMV's, the matmul's block annotated), an
exported RMSNorm fused as well; a norm whose output is also read by something else (a residual,
BERT's post-LN) or returned is left as it is, and a square GEMV with its bias and ReLU (which
reduces over its row's K values too) is no norm. HF's RMSNorm upcast (``x.to(float32)``, a cast
of its own before the norm) joins the prologue (Before/Expected; with the residual add reading
the uncast ``x`` it goes, read elsewhere or returned it stays and is recomputed). The rule: its
one-kernel schedule run on llvm (thread loops serial) against NumPy's LayerNorm / RMSNorm then
matmul, float32 and float16 (and a float16 ``x`` upcast inside the kernel), with a negative
control (the epsilon changed) that the same check detects. The pipeline: reduced gpt2_decode and
llama_decode have no norm operator left (llama: q, k, v, gate and up each recompute theirs; its
float16 export no upcast either) and, on the CPU emulator, are one launch matching onnxruntime
(GPT-2: with a wrong epsilon in the fused kernels detected).
"""
import shutil

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

from relay_passes.branch_fusion import BranchPreservingFusion
from relay_passes.norm_gemv import NORM_GEMV_ANNOTATION, NormGEMVFusion, annotated_matmul
from tir_templates.norm_gemv import NormGEMV, norm_gemv_shape, schedule_norm_gemv
from tir_templates.serial_run import serial_threads
from tvm_rammer.models import REDUCED, get_model

K, N, EPS = 64, 96, 1e-5


def _tensor(shape, dtype="float32"):
    return relax.TensorType(list(shape), dtype)


def _consts(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(K).astype("float32"), rng.standard_normal(K).astype("float32"),
            (rng.standard_normal((K, N)) / 8).astype(dtype), rng.standard_normal(N).astype(dtype))


def _rms_norm(bb, x, g):
    """HF's LlamaRMSNorm as exported: ``x * (1 / sqrt(mean(x^2) + eps)) * weight``."""
    op = relax.op
    var = bb.emit(op.mean(bb.emit(op.power(x, relax.const(2.0))), axis=[-1], keepdims=True))
    inv = bb.emit(op.divide(relax.const(1.0), bb.emit(op.sqrt(bb.emit(
        op.add(var, relax.const(EPS)))))))
    return bb.emit(op.multiply(relax.const(g), bb.emit(op.multiply(x, inv))))


def _high_level(residual=False, returned=False, dtype="float32", norm="layer", upcast=None):
    """``main(x) = layer_norm(x) [-> astype] @ W + b`` (``residual``: plus the norm's output
    added to the result; ``returned``: the norm's output returned too; ``norm="rms"``: an
    RMSNorm as exported instead). ``upcast``: ``x`` is float16 and the norm reads
    ``x.astype(float32)`` (HF's RMSNorm); ``"residual"``: ``x + x`` (uncast, as Llama's residual
    add reads the stream) returned too; ``"cast_read"``: ``xf + xf`` of the cast ``xf`` returned
    too; ``"cast_returned"``: ``xf`` returned too; any other true value: nothing else."""
    g, beta, w, bias = _consts(dtype)
    bb = relax.BlockBuilder()
    x = relax.Var("x", _tensor((1, 1, K), "float16" if upcast else "float32"))
    op = relax.op
    with bb.function("main", [x]):
        with bb.dataflow():
            x16, extra = x, None
            if upcast:
                x = bb.emit(op.astype(x16, "float32"))
                extra = {"residual": lambda: bb.emit(op.add(x16, x16)),
                         "cast_read": lambda: bb.emit(op.add(x, x)),
                         "cast_returned": lambda: x}.get(upcast, lambda: None)()
            if norm == "dense":  # a square GEMV, bias and ReLU: no norm (AlexNet's classifier)
                square = (np.random.default_rng(5).standard_normal((K, K)) / 8).astype(dtype)
                ln = bb.emit(op.nn.relu(op.add(op.matmul(x, relax.const(square)),
                                               relax.const(g))))
            else:
                ln = _rms_norm(bb, x, g) if norm == "rms" else bb.emit(op.nn.layer_norm(
                    x, relax.const(g), relax.const(beta), axes=[-1], epsilon=EPS))
            row = ln if dtype == "float32" else bb.emit(op.astype(ln, dtype))
            y = bb.emit(op.add(op.matmul(row, relax.const(w), out_dtype="float32")
                               if dtype == "float32" else
                               op.astype(op.matmul(row, relax.const(w), out_dtype="float32"),
                                         dtype), relax.const(bias)))
            if residual:
                y = bb.emit(op.add(bb.emit(op.matmul(row, relax.const(w[:, :K]))), row))
            outs = [y, *([ln] if returned else []), *([extra] if extra is not None else [])]
            out = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else y)
        bb.emit_func_output(out)
    return bb.get()


def _grouped(mod):
    """Legalized, op patterns, grouped as the rammer pipeline groups before its fusion passes."""
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FoldConstant(), BranchPreservingFusion()]
    return tvm.transform.Sequential(passes)(mod)


def _calls(func):
    names = []

    def visit(call):
        if isinstance(call.op, tvm.ir.GlobalVar):
            names.append(call.op.name_hint)
        elif isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            names.append(call.args[0].name_hint)

    tvm_ffi.structural_walk(func.body, (relax.Call, visit))
    return names


def _expected(before):
    """What the pass should make of ``_grouped(_high_level())``: main calls one fused function
    (the norm's call_tir, then the GEMV group's calls with the annotated matmul copy)."""
    main = before["main"]
    (ln_binding, gemv_binding) = main.body.blocks[0].bindings[:2]
    ln_call, gemv_call = ln_binding.value, gemv_binding.value
    group = before[gemv_call.op]
    matmul_call, add_call = [b.value for b in group.body.blocks[0].bindings]
    bb = relax.BlockBuilder(before)
    annotated = bb.add_func(annotated_matmul(before[matmul_call.args[0]]),
                            f"{matmul_call.args[0].name_hint}_norm_gemv")
    ext = [*ln_call.args[1].fields, *gemv_call.args[1:]]
    params = [relax.Var(f"p{i}", e.ty) for i, e in enumerate(ext)]
    with bb.function(f"fused_norm_{gemv_call.op.name_hint}", params, private=True,
                     attrs={"Primitive": True}):
        with bb.dataflow():
            row = bb.emit(relax.call_tir(ln_call.args[0], relax.Tuple(params[:3]),
                                         out_ty=ln_binding.var.ty))
            mm = bb.emit(relax.call_tir(annotated, relax.Tuple([row, params[3]]),
                                        out_ty=matmul_call.ty))
            out = bb.emit_output(relax.call_tir(add_call.args[0], relax.Tuple([mm, params[4]]),
                                                out_ty=add_call.ty))
        fused = bb.emit_func_output(out)
    bindings = [relax.VarBinding(gemv_binding.var, relax.Call(fused, ext)),
                *main.body.blocks[0].bindings[2:]]  # the norm's binding goes
    new_main = relax.Function(main.params, relax.SeqExpr([relax.DataflowBlock(bindings)],
                                                         main.body.body),
                              main.ret_ty, main.is_pure, main.attrs)
    bb.update_func(before.get_global_var("main"), relax.BlockBuilder().normalize(new_main))
    out = bb.finalize()
    return tvm.IRModule({gv: f for gv, f in out.functions_items()
                         if gv.name_hint != gemv_call.op.name_hint}, attrs=out.attrs)


def _expected_with_cast(before):
    """What the pass should make of ``_grouped(_high_level(norm="rms", upcast=True))`` (main: the
    cast's call_tir, the RMSNorm group, the GEMV group): main calls one fused function taking the
    float16 ``x`` that casts it, then the norm group's calls, then the annotated matmul and the
    bias add; the cast's and the norm's bindings go."""
    main = before["main"]
    cast_b, norm_b, gemv_b = main.body.blocks[0].bindings[:3]
    cast_call, norm_call, gemv_call = cast_b.value, norm_b.value, gemv_b.value
    assert cast_call.args[0].name_hint == "cast" and norm_call.args[0].same_as(cast_b.var)
    group = before[gemv_call.op]
    matmul_call, add_call = [b.value for b in group.body.blocks[0].bindings]
    bb = relax.BlockBuilder(before)
    annotated = bb.add_func(annotated_matmul(before[matmul_call.args[0]]),
                            f"{matmul_call.args[0].name_hint}_norm_gemv")
    ext = [cast_call.args[1].fields[0], *norm_call.args[1:], *gemv_call.args[1:]]
    params = [relax.Var(f"p{i}", e.ty) for i, e in enumerate(ext)]
    with bb.function(f"fused_norm_{gemv_call.op.name_hint}", params, private=True,
                     attrs={"Primitive": True}):
        with bb.dataflow():
            cast = bb.emit(relax.call_tir(cast_call.args[0], relax.Tuple([params[0]]),
                                          out_ty=cast_b.var.ty))
            norm = before[norm_call.op]
            inner = dict(zip(norm.params, [cast, params[1]]))
            for b in norm.body.blocks[0].bindings:
                args = [inner.get(a, a) for a in b.value.args[1].fields]
                inner[b.var] = bb.emit(relax.call_tir(b.value.args[0], relax.Tuple(args),
                                                      out_ty=b.var.ty), str(b.var.name))
            mm = bb.emit(relax.call_tir(annotated, relax.Tuple([inner[norm.body.body], params[2]]),
                                        out_ty=matmul_call.ty))
            out = bb.emit_output(relax.call_tir(add_call.args[0], relax.Tuple([mm, params[3]]),
                                                out_ty=add_call.ty))
        fused = bb.emit_func_output(out)
    bindings = [relax.VarBinding(gemv_b.var, relax.Call(fused, ext)),
                *main.body.blocks[0].bindings[3:]]
    new_main = relax.Function(main.params, relax.SeqExpr([relax.DataflowBlock(bindings)],
                                                         main.body.body),
                              main.ret_ty, main.is_pure, main.attrs)
    bb.update_func(before.get_global_var("main"), relax.BlockBuilder().normalize(new_main))
    out = bb.finalize()
    gone = (norm_call.op.name_hint, gemv_call.op.name_hint)
    return tvm.IRModule({gv: f for gv, f in out.functions_items() if gv.name_hint not in gone},
                        attrs=out.attrs)


def test_the_upcast_before_an_rms_norm_joins_the_prologue():
    """HF's RMSNorm reads ``x.to(float32)``: the grouping leaves that cast a call_tir of its own
    (its output is read twice in the norm's group); the fused function takes the float16 ``x``
    and casts it itself, and the cast's step goes."""
    before = _grouped(_high_level(norm="rms", upcast=True))
    assert _calls(before["main"])[0] == "cast" and len(_calls(before["main"])) == 3
    after = NormGEMVFusion()(before)
    tvm.ir.assert_structural_equal(after, _expected_with_cast(before))


def test_the_upcast_goes_with_the_residual_reading_the_uncast_stream():
    """Llama: the residual add reads the float16 stream, the cast only the norm: the cast goes,
    the add stays."""
    before = _grouped(_high_level(norm="rms", upcast="residual"))
    after = NormGEMVFusion()(before)
    (fused,) = [n for n in _calls(after["main"]) if n.startswith("fused_norm")]
    assert "cast" in _calls(before["main"]) and "cast" not in _calls(after["main"])
    assert "cast" in _calls(after[fused]) and "add" in _calls(after["main"])


@pytest.mark.parametrize("upcast", ["cast_read", "cast_returned"])
def test_a_cast_read_elsewhere_stays_and_the_prologue_recomputes_it(upcast):
    """Control: the cast's output is also read by an add or returned: its binding stays for that
    reader, and the fused function still casts ``x`` itself (recomputed, K values: the norm's
    GEMVs do not wait for the cast's step)."""
    before = _grouped(_high_level(norm="rms", upcast=upcast))
    after = NormGEMVFusion()(before)
    (fused,) = [n for n in _calls(after["main"]) if n.startswith("fused_norm")]
    assert _calls(after["main"]).count("cast") == 1 and _calls(after[fused])[0] == "cast"
    assert len(_calls(after["main"])) == len(_calls(before["main"])) - 1  # the norm went
    main = after["main"]
    (call,) = [b.value for b in main.body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)
               and b.value.op.name_hint == fused]
    assert call.args[0].same_as(main.params[0])  # the float16 x, not the cast's output


def test_layer_norm_becomes_the_prologue_of_its_gemv():
    before = _grouped(_high_level())
    assert _calls(before["main"])[:2] == ["layer_norm", "fused_matmul_add"]
    after = NormGEMVFusion()(before)
    tvm.ir.assert_structural_equal(after, _expected(before))


@pytest.mark.parametrize("case", [dict(residual=True), dict(returned=True),
                                  dict(norm="dense")],
                         ids=["also_read_by_an_add", "returned", "a_square_gemv_is_no_norm"])
def test_a_norm_needed_elsewhere_is_left_alone(case):
    mod = _grouped(_high_level(**case))
    tvm.ir.assert_structural_equal(NormGEMVFusion()(mod), mod)


def test_a_row_past_the_shared_memory_limit_is_left_alone():
    mod = _grouped(_high_level())  # K = 64 float32: a 256-byte row
    tvm.ir.assert_structural_equal(NormGEMVFusion(max_row_bytes=255)(mod), mod)
    assert "fused_norm_fused_matmul_add" in _calls(NormGEMVFusion(max_row_bytes=256)(mod)["main"])


def test_a_gemv_the_rule_cannot_lay_out_in_whole_warps_is_left_alone():
    """Fused, it would go to dlight's generic rules (two kernels, the statistics in a global
    buffer: a fuzz graph's norm-like ``x - max(x)`` before a 48 x 48 GEMV at 64 threads)."""
    from tir_templates.norm_gemv import norm_gemv_shape

    mod = _grouped(_high_level())  # K = 64
    assert norm_gemv_shape(N, K, 4, 16) is None and norm_gemv_shape(N, K, 4, 256) is not None
    tvm.ir.assert_structural_equal(NormGEMVFusion(max_threads=16)(mod), mod)
    assert "fused_norm_fused_matmul_add" in _calls(NormGEMVFusion(max_threads=256)(mod)["main"])


def test_the_pass_and_the_rule_are_in_the_rammer_pipeline_and_the_flag_turns_them_off():
    from tvm_rammer import cli
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import graph_passes

    names = [p.info.name for p in graph_passes(RammerConfig())]
    assert names.index("BranchPreservingFusion") < names.index("NormGEMVFusion") \
        < names.index("FuseTIR")
    assert "NormGEMVFusion" not in [p.info.name for p in
                                    graph_passes(RammerConfig(norm_fusion=False))]
    parser = cli.build_parser()
    for command in (["run", "m.onnx"], ["compile", "m.onnx", "-o", "m.so"], ["inspect", "m.onnx"]):
        assert cli._config(parser.parse_args(command)).norm_fusion is True
        assert cli._config(parser.parse_args(command + ["--no-norm-fusion"])).norm_fusion is False


# The rule.

def _fused_prim_func(dtype, norm="layer", upcast=None):
    mod = relax.transform.FuseTIR()(NormGEMVFusion()(_grouped(_high_level(
        dtype=dtype, norm=norm, upcast=upcast))))
    (func,) = [f for gv, f in mod.functions_items()
               if isinstance(f, tirx.PrimFunc) and gv.name_hint.startswith("fused_norm")]
    return func


def _numpy(x, dtype, eps=EPS, norm="layer"):
    g, beta, w, bias = _consts(dtype)
    x = x.astype("float32")  # a float16 x: the upcast is exact
    if norm == "rms":
        row = (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g).astype(dtype)
    else:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        row = ((x - mean) / np.sqrt(var + eps) * g + beta).astype(dtype)
    return row.astype("float32") @ w.astype("float32") + bias.astype("float32")


def _run_llvm(func, x, dtype, norm="layer"):
    g, beta, w, bias = _consts(dtype)
    mod = tvm.IRModule({"main": serial_threads(func).with_attr("global_symbol", "main")})
    run = tvm.compile(mod, target="llvm")["main"]
    inputs = (x, g, w, bias) if norm == "rms" else (x, g, beta, w, bias)
    args = [tvm.runtime.tensor(a) for a in (*inputs, np.zeros((1, 1, N), dtype))]
    run(*args)
    return args[-1].numpy().astype("float32")


def _with_epsilon(func, eps):
    """``func`` with its LayerNorm epsilon (the float32 constant ``EPS``) replaced."""
    def swap(imm):
        if str(imm.ty) == "float32" and abs(float(imm.value) - EPS) < 1e-9:
            return tirx.FloatImm("float32", eps)
        return imm

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.FloatImm, swap)]))


@pytest.mark.parametrize("dtype, norm, upcast", [
    ("float32", "layer", None), ("float16", "layer", None), ("float32", "rms", None),
    ("float16", "rms", "residual"), ("float32", "layer", "residual")],
    ids=["layer-float32", "layer-float16", "rms-float32", "upcast-rms-float16",
         "upcast-layer-float32"])
def test_the_one_kernel_schedule_matches_numpy_on_llvm(dtype, norm, upcast):
    """``upcast``: a float16 ``x`` cast to float32 before the norm (the cast inside the fused
    kernel: RMSNorm's as its own node, LayerNorm's grouped with the norm)."""
    func = _fused_prim_func(dtype, norm, upcast)
    scheduled = NormGEMV().apply(func, tvm.target.Target("cuda"))
    assert scheduled is not None
    text = scheduled.mod["main"].script()
    assert text.count('thread="blockIdx.x"') == 1 and NORM_GEMV_ANNOTATION not in text
    x = (np.random.default_rng(3).standard_normal((1, 1, K)) * 2 + 0.5).astype(
        "float16" if upcast else "float32")
    if upcast:
        assert str(func.params[0].dtype) == "float16"
    got = _run_llvm(scheduled.mod["main"], x, dtype, norm)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(got, _numpy(x, dtype, norm=norm), rtol=tol, atol=tol)


def test_the_upcast_inside_the_kernel_changes_no_bit():
    """RMSNorm's numerics: float16 -> float32 is exact, so the kernel that casts ``x`` as it reads
    it gives the very bits of the same kernel fed the float32 copy of ``x``."""
    target = tvm.target.Target("cuda")
    x = (np.random.default_rng(4).standard_normal((1, 1, K)) * 2 + 0.5).astype("float16")
    runs = []
    for upcast, given in (("residual", x), (None, x.astype("float32"))):
        scheduled = NormGEMV().apply(_fused_prim_func("float16", "rms", upcast), target)
        runs.append(_run_llvm(scheduled.mod["main"], given, "float16", "rms"))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert np.abs(runs[0]).max() > 0


def test_an_exported_rms_norm_is_fused_too():
    """RMSNorm as exporters write it (pow, mean, add eps, sqrt, 1 / ., two multiplies) is one
    group after the fusion; the pass makes it the GEMV's prologue as well."""
    before = _grouped(_high_level(norm="rms"))
    after = NormGEMVFusion()(before)
    assert len(_calls(before["main"])) == 2 and len(_calls(after["main"])) == 1
    (name,) = _calls(after["main"])
    assert name.startswith("fused_norm") and "mean" in _calls(after[name])


def test_a_wrong_epsilon_is_detected_on_llvm():
    """Negative control: the same kernel with epsilon 0.5 instead of 1e-5 differs from NumPy
    beyond the tolerance (the row's variance is about 4)."""
    x = (np.random.default_rng(3).standard_normal((1, 1, K)) * 2 + 0.5).astype("float32")
    wrong = _with_epsilon(_fused_prim_func("float32"), 0.5)
    got = _run_llvm(schedule_norm_gemv(wrong).mod["main"], x, "float32")
    assert np.abs(got - _numpy(x, "float32")).max() > 1e-2
    np.testing.assert_allclose(got, _numpy(x, "float32", eps=0.5), rtol=1e-5, atol=1e-5)


def test_the_rule_leaves_other_functions_and_picks_whole_warps():
    assert NormGEMV().apply(tirx.PrimFunc([], tirx.Evaluate(0))) is None
    # GPT-2 small's QKV in float16: 2 columns a thread, 2 lanes of them, 128 rows in flight
    # (576 rTasks of 256 threads); the reduced model's: 64 rows (K) in flight
    assert norm_gemv_shape(2304, 768, 2) == (2, 2, 128)
    assert norm_gemv_shape(96, 64, 4) == (4, 1, 64)
    for n, k, size in ((2304, 768, 2), (3072, 768, 4), (50257, 768, 2), (192, 64, 2)):
        vec, lanes, split_k = norm_gemv_shape(n, k, size)
        assert n % vec == 0 and k % split_k == 0 and (lanes * split_k) % 32 == 0


# The pipeline on the reduced decoder.

def _main_calls(model, norm_fusion):
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes

    with tvm.target.Target("cuda"):
        mod = tvm.transform.Sequential(graph_passes(RammerConfig(norm_fusion=norm_fusion)))(
            import_onnx(model))
    return _calls(mod["main"])


def test_reduced_gpt2_has_no_norm_operator_left():
    model = get_model("gpt2_decode", **REDUCED["gpt2_decode"])
    with_fusion, without = _main_calls(model, True), _main_calls(model, False)
    norms = 2 * REDUCED["gpt2_decode"]["layers"] + 1
    assert without.count("layer_norm") == norms and "layer_norm" not in with_fusion
    assert len(with_fusion) == len(without) - norms
    assert sum(n.startswith("fused_norm") for n in with_fusion) == norms


def test_reduced_llama_recomputes_each_rms_norm_in_every_gemv_reading_it():
    """Llama's RMSNorms: before attention q, k and v read one, before the MLP gate and up: each
    GEMV recomputes it (5 fused GEMVs a layer, and the LM head), and no norm is left."""
    model = get_model("llama_decode", **REDUCED["llama_decode"])
    with_fusion, without = _main_calls(model, True), _main_calls(model, False)
    layers = REDUCED["llama_decode"]["layers"]
    norms = 2 * layers + 1
    assert sum(n.startswith("fused_norm") for n in with_fusion) == 5 * layers + 1
    assert len(with_fusion) == len(without) - norms


def _decode_feeds(model, position=6):
    rng = np.random.default_rng(1)
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([position], np.int64)}
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def test_weights_apart_the_fused_gemvs_take_the_parameters_and_match_onnxruntime():
    """Weights kept apart (gain, shift and W are ``main``'s parameters): the norms are fused
    all the same, and the graph (unscheduled, on llvm) matches onnxruntime."""
    pytest.importorskip("onnxruntime")
    from relay_passes.lift_weights import TRANSFORM_NAME
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes
    from tvm_rammer.lease import manifest as mf
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model("gpt2_decode", **REDUCED["gpt2_decode"])
    passes = graph_passes(RammerConfig(weights="apart"))
    mod = tvm.transform.Sequential(passes)(import_onnx(model, weights="apart"))
    calls = _calls(mod["main"])
    assert "layer_norm" not in calls and sum(n.startswith("fused_norm") for n in calls) == 5
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    weights = vm[TRANSFORM_NAME](*[tvm.runtime.tensor(a) for _, a in mf.raw_weights(model)])
    feeds = _decode_feeds(model)
    got = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in model.graph.input], *weights)
    errors = [relative_error(g.numpy(), r) for g, r in zip(got, onnx_reference(model, feeds))]
    assert max(errors) <= 1e-4, errors


def _emulated_errors(name, precision="float32", dtype="float32"):
    """(launches, relative errors of the outputs) of reduced ``name`` (exported in ``dtype``)
    through the rammer pipeline's CUDA (2 SMs x 2 vEUs) on the CPU emulator against
    onnxruntime."""
    pytest.importorskip("onnxruntime")
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model = get_model(name, dtype=dtype, **REDUCED[name])
    feeds = _decode_feeds(model)
    if dtype == "float16":
        feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v
                 for k, v in feeds.items()}
    config = RammerConfig(num_sms=2, veus_per_sm=2, precision=precision)
    result = emulator.emulate(emulator.emulation_build(model, config=config),
                              [feeds[i.name] for i in model.graph.input])
    return len(result.launches), [relative_error(o, r) for o, r in
                                  zip(result.outputs, onnx_reference(model, feeds))]


def test_reduced_gpt2_on_the_emulator_matches_onnxruntime(monkeypatch):
    """float32: one launch, relative error <= 1e-4 against onnxruntime; control: the fused
    kernels built with epsilon 0.5 are detected (the logits)."""
    launches, errors = _emulated_errors("gpt2_decode")
    assert launches == 1 and max(errors) <= 1e-4, errors
    from tir_templates import norm_gemv as rule

    schedule = rule.schedule_norm_gemv
    monkeypatch.setattr(rule, "schedule_norm_gemv",
                        lambda func, *a, **k: schedule(_with_epsilon(func, 0.5), *a, **k))
    _, errors = _emulated_errors("gpt2_decode")
    assert errors[0] > 1e-3, errors


@pytest.mark.slow
@pytest.mark.parametrize("name, precision", [("gpt2_decode", "float16"),
                                             ("llama_decode", "float32")])
def test_reduced_decoders_on_the_emulator_match_onnxruntime(name, precision):
    """GPT-2 in float16 (2-column half loads; <= 2e-2) and Llama's RMSNorm fused into q, k, v,
    gate and up (float32, <= 1e-4)."""
    launches, errors = _emulated_errors(name, precision)
    assert launches == 1 and max(errors) <= (2e-2 if precision == "float16" else 1e-4), errors


def test_reduced_llama_float16_export_casts_inside_the_fused_gemvs():
    """The float16 export's RMSNorms read ``hidden_states.to(float32)``: without the fusion the
    upcasts are call_tirs of their own (one before each norm but the last, whose cast joined the
    residual add's group); with it no cast is left before a norm in main."""
    model = get_model("llama_decode", dtype="float16", **REDUCED["llama_decode"])
    with_fusion, without = _main_calls(model, True), _main_calls(model, False)
    layers = REDUCED["llama_decode"]["layers"]
    assert without.count("cast") == 2 * layers and "cast" not in with_fusion
    assert len(with_fusion) == len(without) - (2 * layers + 1) - 2 * layers


@pytest.mark.slow
def test_reduced_llama_float16_export_on_the_emulator_matches_onnxruntime():
    """The casts inside the fused kernels: one launch, within float16's tolerance 2e-2 of
    onnxruntime on the float16 export."""
    launches, errors = _emulated_errors("llama_decode", dtype="float16")
    assert launches == 1 and max(errors) <= 2e-2, errors
