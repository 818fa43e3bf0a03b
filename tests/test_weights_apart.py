"""Weights apart from the library (issue 31, item 2): ``main(*inputs, *weights)`` and
``transform_params(*raw_weights)``, the manifest beside the library.

Checked on llvm (CPU) with small models: the rammer graph rewrites (to FuseTIR,
``pipeline.graph_passes``) and TVM's default pipeline built with the weights apart give
onnxruntime's outputs and the embedded build's once the raw weights go through
``transform_params``; the rewrites still fire (batch norm folded, W split over the concat, the
recurrent GEMV fused with its column interleave in the transform); the rammer target lowers to the
same launches either way; the library is code only (smaller than the embedded one). Negative
controls: raw weights given to ``main`` without the transform, or in another order, do not
pass for the model's outputs. The whole rammer build for a CUDA target, weights apart (the
transform's kernels and the persistent kernel), runs on the CPU emulator against onnxruntime.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from relay_passes.lift_weights import TRANSFORM_NAME, lift_weight_transforms
from tvm_rammer.codegen.tensors import pack_func
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.driver.launches import count_launches
from tvm_rammer.lease import manifest as mf
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.driver.pipeline import graph_passes

from onnx_builders import random_inputs, run_onnxruntime

TARGET = "rammer/nvidia-h100"
NO_PROFILE = RammerConfig(profile=False)


def conv_bn_model(seed=0):
    """x -> Conv (no bias) -> BN -> Relu -> Conv (bias) -> BN: both of the pipeline's batch-norm
    folds (TVM's bias-free one, ours with the bias)."""
    rng = np.random.default_rng(seed)

    def init(name, *shape, positive=False):
        value = rng.standard_normal(shape).astype("float32")
        return numpy_helper.from_array(np.abs(value) + 0.5 if positive else value, name)

    inits = [init("w1", 8, 3, 3, 3), init("g1", 8, positive=True), init("b1", 8), init("m1", 8),
             init("v1", 8, positive=True), init("w2", 4, 8, 1, 1), init("c2", 4),
             init("g2", 4, positive=True), init("b2", 4), init("m2", 4),
             init("v2", 4, positive=True)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["y1"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["y1", "g1", "b1", "m1", "v1"], ["n1"]),
             helper.make_node("Relu", ["n1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "c2"], ["y2"]),
             helper.make_node("BatchNormalization", ["y2", "g2", "b2", "m2", "v2"], ["out"])]
    graph = helper.make_graph(nodes, "conv_bn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                             [1, 4, 8, 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


MODELS = {"lstm_tc": lambda: get_model("lstm_tc", **REDUCED["lstm_tc"]), "conv_bn": conv_bn_model}


def _outputs(result) -> list:
    return [result.numpy()] if hasattr(result, "numpy") else [o.numpy() for o in result]


def _raw(model) -> list:
    return [tvm.runtime.tensor(a) for _, a in mf.raw_weights(model)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request):
    """(name, model, feeds, {mode: (graph module, VM)}) of the rammer graph passes on llvm."""
    model = MODELS[request.param]()
    found = {}
    for mode in ("embedded", "apart"):
        mod = import_onnx(model, weights=mode)
        mod = tvm.transform.Sequential(graph_passes(RammerConfig(weights=mode)))(mod)
        found[mode] = (mod, relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()))
    return request.param, model, random_inputs(model, seed=1), found


def test_graph_passes_apart_give_onnxruntimes_and_the_embedded_outputs(built):
    _, model, feeds, found = built
    inputs = [tvm.runtime.tensor(v) for v in feeds.values()]
    weights = found["apart"][1][TRANSFORM_NAME](*_raw(model))
    apart = _outputs(found["apart"][1]["main"](*inputs, *weights))
    embedded = _outputs(found["embedded"][1]["main"](*inputs))
    for got, same, want in zip(apart, embedded, run_onnxruntime(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got, same, rtol=1e-5, atol=1e-6)


def test_raw_weights_given_to_main_do_not_pass(built):
    """Negative controls: the untransformed raw weights (or the transformed ones reversed) are
    refused by main's shape checks or give other outputs."""
    _, model, feeds, found = built
    vm = found["apart"][1]
    inputs = [tvm.runtime.tensor(v) for v in feeds.values()]
    want = run_onnxruntime(model, feeds)
    weights = list(vm[TRANSFORM_NAME](*_raw(model)))
    for wrong in (_raw(model), weights[::-1]):
        try:
            got = _outputs(vm["main"](*inputs, *wrong))
        except Exception as err:  # noqa: BLE001 - TVM's shape/arity check: the clear failure
            assert "shape" in str(err).lower() or "argument" in str(err).lower() \
                or "ndim" in str(err).lower() or "dtype" in str(err).lower(), err
            continue
        assert not all(g.shape == w.shape and np.allclose(g, w, rtol=1e-3, atol=1e-4)
                       for g, w in zip(got, want))


def _calls(mod, func) -> list:
    names = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            names.append(expr.args[0].name_hint)
        elif isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
            names.append(expr.op.name_hint)

    relax.analysis.post_order_visit(mod[func], visit)
    return names


def test_the_rewrites_fire_with_the_weights_apart(built):
    """The same operators in main as embedded; the weight transforms in transform_params:
    batch norm folded (no batch_norm kernel), W cut into row blocks (strided_slice) and the fused
    recurrent GEMV's columns interleaved (lstm_tc)."""
    name, _, _, found = built
    apart, embedded = found["apart"][0], found["embedded"][0]
    main_apart, main_embedded = _calls(apart, "main"), _calls(embedded, "main")
    ops_apart = sorted(re.sub(r"\d+", "", n) for n in main_apart)
    ops_embedded = sorted(re.sub(r"\d+", "", n) for n in main_embedded)
    assert ops_apart == ops_embedded
    transform = _calls(apart, TRANSFORM_NAME)
    everything = [gv.name_hint for gv in apart.get_global_vars()]
    assert not any("batch_norm" in n for n in everything)
    if name == "conv_bn":
        assert any(n.startswith("multiply") for n in transform)  # W * scale, once per conv
    else:
        cells = [n for n in main_apart if n.startswith("fused_gemv_epilogue")]
        assert cells and len(cells) == sum(n.startswith("fused_gemv_epilogue")
                                           for n in main_embedded)
        assert any(n.startswith("strided_slice") for n in transform)  # SplitMatMulOverConcat
        assert any(n.startswith("interleave") for n in transform)  # GEMVEpilogueFusion
        assert not any(n.startswith("interleave") for n in main_apart)


def _persistent(mod) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if gv.name_hint.startswith("rammer_rprogram") and "pack" not in gv.name_hint}


@pytest.fixture(scope="module", params=sorted(MODELS))
def rammer_builds(request):
    """(name, model, the embedded lowering, the weights-apart EmulationBuild) for TARGET."""
    from tvm_rammer.checks.emulator import emulation_build

    model = MODELS[request.param]()
    embedded = lower(import_onnx(model), TARGET, NO_PROFILE)
    apart = emulation_build(import_onnx(model, weights="apart"), TARGET,
                            RammerConfig(profile=False, weights="apart"), pipeline="rammer")
    return request.param, model, embedded, apart


def test_rammer_target_lowers_to_the_same_launches_and_kernels(rammer_builds):
    """The same launches and the same persistent kernels (bodies structurally equal): the
    weights apart are packed into the rProgram's constants blob by transform_params, at the
    offsets the embedded blob has."""
    _, _, embedded, build = rammer_builds
    apart = build.relax_mod
    assert TRANSFORM_NAME in [gv.name_hint for gv in apart.get_global_vars()]
    assert TRANSFORM_NAME not in [gv.name_hint for gv in embedded.get_global_vars()]
    assert any(n.endswith("_pack_weights") for n in _calls(apart, TRANSFORM_NAME))
    assert not any(n.endswith("_pack_weights") for n in _calls(apart, "main"))
    assert count_launches(apart) == count_launches(embedded)
    kernels = {"apart": _persistent(apart), "embedded": _persistent(embedded)}
    assert sorted(kernels["apart"]) == sorted(kernels["embedded"]) and kernels["apart"]
    for kernel, func in kernels["apart"].items():
        assert tvm_ffi.structural_equal(func.body, kernels["embedded"][kernel].body,
                                        map_free_vars=True)


def test_pack_func_writes_the_blob_layout():
    """The blob transform_params packs: each tensor's bytes at its offset, zeros between (what
    the embedded blob holds); checked unscheduled on llvm for float32, float16 and int64."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 5)).astype("float32"),
              rng.standard_normal(7).astype("float16"),
              np.arange(4, dtype="int64").reshape(2, 2) - 3]
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        size += -(-a.nbytes // 64) * 64
    func = pack_func([(a.shape, str(a.dtype), o) for a, o in zip(arrays, offsets)], size,
                     threads=None)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target="llvm")
    out = tvm.runtime.tensor(np.full(size, 7, "uint8"))
    lib["main"](*[tvm.runtime.tensor(a) for a in arrays], out)
    want = np.zeros(size, "uint8")
    for a, o in zip(arrays, offsets):
        want[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(out.numpy(), want)


def test_lift_appends_to_an_existing_transform_and_leaves_modules_without_weights():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 4], "float32"))
    w = relax.Var("w", relax.TensorType([4, 3], "float32"))
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            wt = bb.emit(relax.op.multiply(w, relax.const(2.0, "float32")))
            y = bb.emit_output(relax.op.matmul(x, wt))
        bb.emit_func_output(y)
    mod = bb.get()
    once = lift_weight_transforms(mod)
    assert len(once["main"].params) == 2 and len(once[TRANSFORM_NAME].params) == 1
    # a second lift after a later weight rewrite: the transform grows, raw weights stay
    main = once["main"]
    block = main.body.blocks[0]
    neg = relax.DataflowVar("neg", main.params[1].ty)
    bindings = [relax.VarBinding(neg, relax.op.negative(main.params[1])), *block.bindings]
    y_var = block.bindings[-1].var
    new_y = relax.op.matmul(main.params[0], neg)
    bindings[-1] = relax.VarBinding(y_var, new_y)
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], main.body.body)
    once[once.get_global_var("main")] = relax.BlockBuilder().normalize(
        relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs))
    twice = lift_weight_transforms(once)
    vm = relax.VirtualMachine(tvm.compile(twice, target="llvm"), tvm.cpu())
    xv, wv = np.ones((2, 4), "float32"), np.arange(12, dtype="float32").reshape(4, 3)
    got = vm["main"](tvm.runtime.tensor(xv), *vm[TRANSFORM_NAME](tvm.runtime.tensor(wv)))
    np.testing.assert_allclose(got.numpy(), xv @ -(2 * wv))
    without = tvm.IRModule({"main": mod["main"].without_attr("num_input")})
    assert lift_weight_transforms(without).same_as(without)


# --- TVM's default pipeline, the library and its manifest -----------------------------------------

@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """AlexNet (reduced) built for llvm with TVM's default pipeline, weights apart through
    ``manifest.build_library`` (regenerated from the zoo model, and a copy with the .npz), and
    the same model with the weights embedded, exported."""
    out = tmp_path_factory.mktemp("lease")
    model = get_model("alexnet", **REDUCED["alexnet"])
    zoo = {"zoo": "alexnet", "params": REDUCED["alexnet"], "batch": 1}
    apart = mf.build_library(model, target="llvm", out=str(out / "alexnet.so"), model=zoo)
    manifest = mf.read_manifest(apart["manifest"])  # the same library, its weights from a file
    mf.write_weights(out / "alexnet.weights.npz", mf.raw_weights(model))
    npz = {"manifest": str(mf.write_manifest(out / "alexnet_npz.json", {
        **manifest, "model": None, "weights_file": "alexnet.weights.npz"}))}
    embedded = tvm.compile(import_onnx(model), target="llvm", relax_pipeline="default")
    embedded.export_library(str(out / "alexnet_embedded.so"))
    return model, out, apart, npz


def test_default_pipeline_library_apart_gives_onnxruntimes_outputs(libraries):
    model, out, apart, _ = libraries
    manifest = mf.read_manifest(apart["manifest"])
    vm = relax.VirtualMachine(tvm.runtime.load_module(apart["library"]), tvm.cpu())
    raw = [tvm.runtime.tensor(a) for a in mf.read_weights(manifest, out)]
    weights = vm[manifest["transform"]](*raw) if manifest["transform"] else raw
    feeds = random_inputs(model, seed=3)
    got = _outputs(vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()], *weights))
    for g, w in zip(got, run_onnxruntime(model, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert [e["shape"] for e in manifest["weights"]] == [list(w.shape) for w in weights]


def test_the_library_apart_holds_code_only(libraries):
    """AlexNet (reduced, 16 initializers, 2.1 MB of float32): the embedded library is the
    weights' size bigger; the one apart is not (numbers in the README)."""
    model, out, apart, _ = libraries
    weight_bytes = sum(a.nbytes for _, a in mf.raw_weights(model))
    embedded = os.path.getsize(out / "alexnet_embedded.so")
    assert apart["bytes"] < embedded - 0.9 * weight_bytes
    assert apart["bytes"] < weight_bytes


def test_manifest_fields_and_weights_file(libraries):
    model, out, apart, npz = libraries
    manifest = json.loads((out / "alexnet.json").read_text())
    assert manifest["format"] == mf.FORMAT and manifest["library"] == "alexnet.so"
    assert manifest["device_type"] == "cpu" and manifest["arch"] is None
    assert manifest["pipeline"] == "default" and manifest["weights_file"] is None
    assert [w["name"] for w in manifest["raw_weights"]] == [n for n, _ in mf.raw_weights(model)]
    assert manifest["inputs"][0]["name"] == model.graph.input[0].name
    assert manifest["tolerance"] == 1e-4  # float32's (numerics.model_tolerance), for the runner
    assert manifest["fault_page"] is False
    with_npz = mf.read_manifest(npz["manifest"])
    assert with_npz["weights_file"] == "alexnet.weights.npz" and with_npz["model"] is None
    for a, b in zip(mf.read_weights(with_npz, out), mf.read_weights(manifest, out)):
        np.testing.assert_array_equal(a, b)


def test_manifest_checks_say_what_is_wrong(tmp_path, libraries):
    _, out, apart, npz = libraries
    manifest = mf.read_manifest(apart["manifest"])
    with pytest.raises(ValueError, match="format"):
        mf.write_manifest(tmp_path / "x.json", {**manifest, "format": "other/0"})
    (tmp_path / "old.json").write_text(json.dumps({**manifest, "format": "tvm-rammer-lib/0"}))
    with pytest.raises(ValueError, match="rebuild"):
        mf.read_manifest(tmp_path / "old.json")
    (tmp_path / "null.json").write_text(json.dumps({**manifest, "transform": None}))
    if manifest["weights"] != [{k: v for k, v in w.items() if k != "name"}
                               for w in manifest["raw_weights"]]:
        with pytest.raises(ValueError, match="transform"):
            mf.read_manifest(tmp_path / "null.json")
    other = {**mf.read_manifest(npz["manifest"])}
    other["raw_weights"] = [{**other["raw_weights"][0], "shape": [1, 2, 3]}]
    with pytest.raises(ValueError, match="not this library"):
        mf.read_weights(other, out)
    with pytest.raises(ValueError, match="pipeline"):
        mf.make_manifest("a.so", pipeline="nope", target="llvm", arch=None, device_type="cpu",
                         inputs=[], raw=[], weights=[], transform=None, outputs=[],
                         fault_page=False)


def test_manifest_module_imports_without_tvms_compiler():
    code = ("import sys, tvm_rammer.lease.manifest as m; "
            "print(sorted(k for k in sys.modules if k.startswith(('tvm.relax', 'tvm.s_tir'))))")
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="the CPU emulator needs a C++ compiler")
def test_rammer_build_apart_on_the_emulator_gives_onnxruntimes_outputs(rammer_builds):
    """The whole rammer pipeline for a CUDA target, weights apart: transform_params (its CUDA
    kernels: the interleave, the slices, the packed rProgram blob) then main, both run on the
    CPU emulator, give onnxruntime's outputs."""
    from tvm_rammer.checks.emulator.interpret import Interpreter

    _, model, _, build = rammer_builds
    interpreter = Interpreter(build, build.emulated())
    weights = interpreter(*[a for _, a in mf.raw_weights(model)], func=TRANSFORM_NAME)
    feeds = random_inputs(model, seed=1)
    got = interpreter(*feeds.values(), *weights)
    got = list(got) if isinstance(got, tuple) else [got]
    for g, w in zip(got, run_onnxruntime(model, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_initializers_listed_as_inputs_are_weights_once():
    """IR < 4 style (initializers also graph inputs): each is one weight, and TVM's default
    pipeline apart gives onnxruntime's outputs."""
    from tvm_rammer.driver.pipeline import default_pipeline
    from tvm_rammer.run.runner import onnx_reference

    model = conv_bn_model()
    model.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, i.dims)
                             for i in model.graph.initializer)
    mod = import_onnx(model, weights="apart")
    assert len(mod["main"].params) == 1 + len(model.graph.initializer)
    llvm = tvm.target.Target("llvm")
    ex = tvm.compile(mod, target=llvm, relax_pipeline=default_pipeline(llvm, "apart"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    weights = vm[TRANSFORM_NAME](*_raw(model))  # Conv's bias reshaped: lifted
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype("float32")
    got = _outputs(vm["main"](tvm.runtime.tensor(x), *weights))
    np.testing.assert_allclose(got[0], onnx_reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_a_module_with_num_input_compiled_embedded_keeps_every_parameter_an_input():
    """A Relax module made elsewhere with its weights as parameters (``num_input``), compiled with
    the weights embedded (the default): no weight rewrite emits transforms into main (nothing would
    lift them: they would run on every inference); main takes all its parameters as before and
    computes onnxruntime's outputs. Control: the same module with the weights apart gets the
    transforms (a transform_params function)."""
    model = conv_bn_model()
    mod = import_onnx(model, weights="apart")  # main(x, *weights), num_input = 1
    embedded = tvm.transform.Sequential(graph_passes(RammerConfig()))(mod)
    assert "num_input" not in (embedded["main"].attrs or {})
    assert TRANSFORM_NAME not in [gv.name_hint for gv in embedded.get_global_vars()]
    assert len(embedded["main"].params) == len(mod["main"].params)
    vm = relax.VirtualMachine(tvm.compile(embedded, target="llvm"), tvm.cpu())
    feeds = random_inputs(model, seed=2)
    got = _outputs(vm["main"](tvm.runtime.tensor(feeds["x"]), *_raw(model)))
    np.testing.assert_allclose(got[0], run_onnxruntime(model, feeds)[0], rtol=1e-4, atol=1e-4)
    apart = tvm.transform.Sequential(graph_passes(RammerConfig(weights="apart")))(mod)
    assert TRANSFORM_NAME in [gv.name_hint for gv in apart.get_global_vars()]
