"""The runtime-only runner (tvm_rammer/runtime/): a library built here with the compiler runs in a
fresh interpreter on TVM's runtime alone (``TVM_USE_RUNTIME_LIB=1``), its weights given apart.

The libraries are of the lease contract's form (issue 31), manifests written with
``tvm_rammer.lease.manifest``: the reduced zoo ``two_branch`` model written as
``main(input, *weights)`` over its two weights stacked into one (a weight transform the compiler
lifts out), ``LiftTransformParams`` making the transform a function of the library
(``transform_params(*raw)`` per the contract; TVM's own ``main_transform_params`` takes one
tuple), a ``rammer_fault_page`` function, compiled for llvm; and the reduced ``lstm_tc`` through the
project's graph passes with the weights apart (its own ``transform_params``). One child process
runs the CLI on seven manifests (weights regenerated, from a file, through the tuple-taking
transform, a weights file of a wrong shape, a page holding a fault, weights embedded, lstm_tc);
another checks what that interpreter loaded.
"""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from tvm_rammer.codegen import faults
from tvm_rammer import runtime
from tvm_rammer.codegen import cuda_helpers
from tvm_rammer.host.gpu import gpu_available
from tvm_rammer.lease import manifest as mf
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.runtime import fault_page

ROOT = Path(__file__).resolve().parents[1]
MODEL = "two_branch"
PARAMS = REDUCED[MODEL]
GPU = gpu_available()
FAULT = [1, 3, 5, 7, 2, 9, 4, 11, 42]  # code, kernel, vEU, instruction, ..., rtask_id


def _page(fault=None) -> np.ndarray:
    page = faults.empty_page()
    if fault:
        page[:len(fault)] = fault
    return page


def _module(model, page: np.ndarray, lower=None) -> tvm.IRModule:
    """main(input, w_1, w_4) over concat(w_1, w_4) with the concat lifted out, a contract-named
    transform_params(w_1, w_4), ``lower`` (a pass, e.g. legalize and schedule for a GPU) applied,
    and rammer_fault_page returning ``page``."""
    inits = list(model.graph.initializer)
    (inp,) = [v for v in model.graph.input if v.name not in {i.name for i in inits}]
    dims = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    f32 = "float32"
    x = relax.Var(inp.name, relax.TensorType(dims, f32))
    ws = [relax.Var(i.name, relax.TensorType(list(i.dims), f32)) for i in inits]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws], attrs={"num_input": 1}):
        with bb.dataflow():
            w = bb.emit(relax.op.concat(ws, axis=1))
            parts = bb.emit(relax.op.split(bb.emit(relax.op.matmul(x, w)), 2, axis=1))
            a = bb.emit(relax.op.nn.relu(relax.TupleGetItem(parts, 0)))
            b = bb.emit(relax.op.nn.relu(relax.TupleGetItem(parts, 1)))
            out = bb.emit_output(relax.op.add(a, b))
        bb.emit_func_output(out)
    mod = relax.transform.LiftTransformParams()(bb.get())
    bb = relax.BlockBuilder(mod)
    raw = [relax.Var(i.name, relax.TensorType(list(i.dims), f32)) for i in inits]
    with bb.function("transform_params", raw):
        lifted = mod.get_global_var("main_transform_params")
        bb.emit_func_output(bb.emit(relax.Call(lifted, [relax.Tuple(raw)])))
    mod = bb.get() if lower is None else lower(bb.get())
    mod[fault_page.PAGE_FUNC] = faults.page_function(relax.const(page, "int32"))
    return mod


def _manifest(mod, model, library: str, transform="transform_params", zoo=(MODEL, PARAMS),
              **fields) -> dict:
    """The contract's manifest of ``mod`` (its main's weights after ``num_input``) built from
    ``model``, written with ``tvm_rammer.lease.manifest``; ``fields`` override (device_type,
    weights_file, ...)."""
    inputs, outputs = mf.graph_io(model)
    main = mod["main"]
    apart = main.attrs is not None and "num_input" in main.attrs
    weights = [([int(d) for d in p.ty.shape.values], str(p.ty.dtype))
               for p in main.params[int(main.attrs["num_input"]):]] if apart else []
    names = [gv.name_hint for gv in mod.get_global_vars()]
    args = dict(pipeline="default", target="llvm", arch=None, device_type="cpu", inputs=inputs,
                raw=mf.raw_weights(model) if weights else [], weights=weights,
                transform=transform if weights and transform in names else None, outputs=outputs,
                fault_page=fault_page.PAGE_FUNC in names,
                model={"zoo": zoo[0], "params": zoo[1], "batch": 1})
    return mf.make_manifest(library, **{**args, **fields})


def _lstm_apart():
    """lstm_tc (reduced) through the rammer graph passes with the weights apart, built for llvm:
    a transform_params of the project's own rewrites (W split over the concat, the recurrent
    GEMV's columns interleaved)."""
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.driver.pipeline import graph_passes

    model = get_model("lstm_tc", **REDUCED["lstm_tc"])
    config = RammerConfig(weights="apart")
    mod = tvm.transform.Sequential(graph_passes(config))(import_onnx(model, weights="apart"))
    return model, mod


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Four libraries (clean page, page holding a fault, weights embedded, lstm_tc through the
    project's weights-apart passes) and seven manifests."""
    out = tmp_path_factory.mktemp("runtime_lib")
    model = get_model(MODEL, **PARAMS)
    mods = {"clean": _module(model, _page()), "faulted": _module(model, _page(FAULT)),
            "embedded": from_onnx(model, keep_params_in_input=False)}  # weights as constants
    lstm, mods["lstm"] = _lstm_apart()
    for name, mod in mods.items():
        tvm.compile(mod, target="llvm").export_library(str(out / f"{name}.so"))
    arrays = dict(mf.raw_weights(model))
    mf.write_weights(out / "good.npz", list(arrays.items()))
    first = next(iter(arrays))
    bad = {**arrays, first: np.ascontiguousarray(arrays[first].T)}
    mf.write_weights(out / "bad.npz", list(bad.items()))
    clean = mods["clean"]
    manifests = {
        "regenerated": _manifest(clean, model, "clean.so"),
        "file": _manifest(clean, model, "clean.so", weights_file="good.npz"),
        "tuple_transform": _manifest(clean, model, "clean.so", transform="main_transform_params"),
        "bad_shape": _manifest(clean, model, "clean.so", weights_file="bad.npz"),
        "faulted": _manifest(mods["faulted"], model, "faulted.so"),
        "embedded": _manifest(mods["embedded"], model, "embedded.so"),
        "lstm_apart": _manifest(mods["lstm"], lstm, "lstm.so",
                                zoo=("lstm_tc", REDUCED["lstm_tc"])),
    }
    assert manifests["lstm_apart"]["transform"] == "transform_params"
    assert manifests["embedded"]["raw_weights"] == [] and not manifests["embedded"]["fault_page"]
    for name, data in manifests.items():
        mf.write_manifest(out / f"{name}.json", data)
    return out


def _runtime_only_env() -> dict:
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


@pytest.fixture(scope="module")
def cli_run(built):
    """``python3 -m tvm_rammer.runtime`` on all seven manifests, in a fresh runtime-only
    interpreter: (completed process, rows by manifest name)."""
    names = ["regenerated", "file", "tuple_transform", "bad_shape", "faulted", "embedded",
             "lstm_apart"]
    out = built / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tvm_rammer.runtime", *[str(built / f"{n}.json") for n in names],
         "--runs", "10", "--json", str(out)],
        cwd=ROOT, env=_runtime_only_env(), capture_output=True, text=True, timeout=300)
    assert out.is_file(), proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    return proc, dict(zip(names, rows))


@pytest.mark.parametrize("name", ["regenerated", "file", "tuple_transform", "embedded",
                                  "lstm_apart"])
def test_the_library_runs_on_the_runtime_alone_and_matches_onnxruntime(cli_run, name):
    proc, rows = cli_run
    row = rows[name]
    assert "error" not in row, row
    assert row["reference"] == "onnxruntime" and row["ok"]
    assert row["max_rel_err"] <= 1e-5, row
    assert row["latency_us"] > 0 and row["device"].startswith("cpu")
    assert sum(" ok" in line for line in proc.stdout.splitlines()) == 5


def test_negative_control_a_weights_file_of_another_shape_is_refused(cli_run):
    proc, rows = cli_run
    assert proc.returncode == 1  # the two failing libraries below; the others still ran
    error = rows["bad_shape"]["error"]
    assert "weight 'w_1' is float32[8, 16]" in error and "says float32[16, 8]" in error
    assert "do not belong to this library" in error


def test_negative_control_a_fault_in_the_page_is_an_error_naming_kernel_veu_instruction(cli_run):
    _, rows = cli_run
    error = rows["faulted"]["error"]
    assert "persistent kernel rammer_rprogram3: vEU 5" in error
    assert "at instruction 7" in error and "rTask 42" in error


PROBE = textwrap.dedent("""
    import json, sys
    import tvm, tvm.runtime.vm
    bare = {m for m in sys.modules if m == "tvm" or m.startswith("tvm.")}
    import tvm_rammer
    import tvm_rammer.models
    import tvm_rammer.runtime
    lib = tvm_rammer.runtime.load(sys.argv[1])
    result = lib.compare()
    try:
        from tvm_rammer import compile
        compiler_error = None
    except ImportError as err:
        compiler_error = str(err)
    print(json.dumps({
        "ok": result["ok"],
        "added_tvm": sorted(m for m in sys.modules
                            if (m == "tvm" or m.startswith("tvm.")) and m not in bare),
        "tvm_modules": sorted(m for m in sys.modules if m.startswith("tvm.")),
        "rammer_modules": sorted(m for m in sys.modules if m.startswith("tvm_rammer")),
        "compiler_mapped": "libtvm_compiler" in open("/proc/self/maps").read(),
        "compiler_error": compiler_error,
    }))
""")

RUNNER_PACKAGES = ("tvm_rammer.runtime", "tvm_rammer.models")  # and everything under them
RUNNER_MODULES = ("tvm_rammer", "tvm_rammer.version", "tvm_rammer.lease",
                  "tvm_rammer.lease.manifest", *RUNNER_PACKAGES)


def _probe(manifest, env) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(manifest)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compiler_side(found: dict) -> list:
    """What of TVM's compiler or of tvm_rammer's compiler side the probe found loaded."""
    bad = [m for m in found["tvm_modules"]
           if m.startswith(("tvm.relax", "tvm.s_tir", "tvm.topi", "tvm.meta_schedule"))]
    bad += [m for m in found["rammer_modules"]
            if m not in RUNNER_MODULES
            and not m.startswith(tuple(p + "." for p in RUNNER_PACKAGES))]
    return bad + (["libtvm_compiler"] if found["compiler_mapped"] else [])


def test_the_runtime_only_interpreter_holds_nothing_of_the_compiler(built):
    found = _probe(built / "regenerated.json", _runtime_only_env())
    assert found["ok"]
    assert _compiler_side(found) == []
    # nothing of TVM beyond what `import tvm, tvm.runtime.vm` loads on the runtime library
    assert found["added_tvm"] == [], found["added_tvm"]
    assert "needs TVM's compiler" in found["compiler_error"]
    assert "TVM_USE_RUNTIME_LIB=1" in found["compiler_error"]


def test_negative_control_the_same_probe_finds_the_compiler_in_a_normal_interpreter(built):
    env = dict(_runtime_only_env())
    env.pop("TVM_USE_RUNTIME_LIB")
    found = _probe(built / "regenerated.json", env)
    side = _compiler_side(found)
    assert "libtvm_compiler" in side and "tvm.relax" in side and "tvm_rammer.driver.pipeline" in side
    assert found["compiler_error"] is None


# --- in this process (the runner imports under the compiler too) ---------------------------------

def test_the_python_api_runs_checks_and_compares(built):
    lib = runtime.load(built / "file.json")
    assert str(lib.device) == str(tvm.cpu())
    (out,) = lib.run()
    model = get_model(MODEL, **PARAMS)
    assert lib.compare()["max_rel_err"] <= 1e-5
    (ref,) = lib.reference(lib.inputs(), model)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert lib.time(10) > 0
    lib.check_fault()  # clean page: no error


def test_negative_control_compare_fails_against_other_outputs(built):
    lib = runtime.load(built / "regenerated.json")
    (out,) = lib.run()
    result = lib.compare(reference=[out + 1.0], outputs=[out])
    assert not result["ok"] and result["max_rel_err"] > 1e-2


def test_a_fault_is_raised_once_and_the_page_cleared(built):
    lib = runtime.load(built / "faulted.json")
    with pytest.raises(runtime.KernelFault,
                       match=r"rammer_rprogram3: vEU 5 .* instruction 7") as err:
        lib.run()
    assert err.value.record["rtask_id"] == 42
    lib.check_fault()  # cleared


@pytest.mark.parametrize("name", [MODEL, "gpt2_decode"])
def test_inputs_are_the_compiler_sides_seeded_inputs(tmp_path, name):
    """The same arrays as ``runner.random_inputs`` (gpt2_decode: int64 token id and position,
    then float caches)."""
    from tvm_rammer.run.runner import random_inputs
    from tvm_rammer.runtime.reference import seeded_inputs

    model = get_model(name, **REDUCED[name])
    inputs, outputs = mf.graph_io(model)
    path = mf.write_manifest(tmp_path / "m.json", mf.make_manifest(
        "m.so", pipeline="default", target="llvm", arch=None, device_type="cpu", inputs=inputs,
        raw=[], weights=[], transform=None, outputs=outputs, fault_page=False))
    want = random_inputs(model, seed=3)
    got = seeded_inputs(runtime.read_spec(path), seed=3)
    assert len(got) == len(want) > 0
    for array, (key, expected) in zip(got, want.items()):
        assert array.dtype == expected.dtype, key
        np.testing.assert_array_equal(array, expected)


def test_the_page_decoder_agrees_with_tvm_rammer_faults():
    assert (fault_page.PAGE_WORDS, fault_page.PAGE_MAGIC, fault_page.PAGE_FUNC) == (
        cuda_helpers.PAGE_WORDS, faults.PAGE_MAGIC, faults.PAGE_FUNC)
    assert (fault_page.FAULT_WAIT_TIMEOUT, fault_page.FAULT_GRID_TIMEOUT) == (
        cuda_helpers.FAULT_WAIT_TIMEOUT, cuda_helpers.FAULT_GRID_TIMEOUT)
    np.testing.assert_array_equal(fault_page.empty_page(), faults.empty_page())
    assert fault_page.describe(fault_page.empty_page()) is None
    for code, awaited in ((1, 2), (1, -3), (2, 0)):
        page = _page([code, 3, 5, 7, awaited, 9, 4, 11, 42])
        record = fault_page.describe(page)
        assert record == faults.describe(page)
        assert fault_page.message(record) == faults.message(record)
        assert fault_page.message(record, 250.0) == faults.message(record, 250.0)


def _changed(built, tmp_path, name: str, change: dict):
    """``built/name.json`` with ``change``, written in ``tmp_path`` (paths made absolute)."""
    data = {**json.loads((built / f"{name}.json").read_text()), **change}
    for key in ("library", "weights_file"):
        if data[key] and key not in change:
            data[key] = str(built / data[key])
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, match", [
    ({"format": "tvm-rammer-lib/0"}, r"format 'tvm-rammer-lib/0', expected 'tvm-rammer-lib/1'"),
    ({"library": "absent.so"}, r"the library .*absent.so is missing"),
    ({"weights_file": "absent.npz"}, r"the weights file .*absent.npz is missing"),
    ({"transform": "absent"}, r"has no function 'absent'"),
    ({"weights": [{"shape": [16, 8], "dtype": "float32"}]},
     r"the weights main takes are \['float32\[16, 16\]'\], .* says \['float32\[16, 8\]'\]"),
    ({"raw_weights": [{"name": "w_9", "shape": [16, 8], "dtype": "float32"}]},
     r"has no weight 'w_9'"),
    ({"device_type": "rocm"}, r"device_type 'rocm', expected one of"),
])
def test_a_wrong_manifest_is_one_clear_error(built, tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        runtime.load(_changed(built, tmp_path, "file", change))


@pytest.mark.parametrize("name, change, call, match", [
    ("file", {"outputs": [{"shape": [4, 9], "dtype": "float32"}]}, "run",
     r"main's outputs are \['float32\[4, 8\]'\], .* says \['float32\[4, 9\]'\]"),
    ("embedded", {"fault_page": True}, "run", r"has no rammer_fault_page although"),
    ("file", {}, "run_without_inputs", r"0 inputs given, two_branch takes \['input'\]"),
    ("file", {"model": None}, "compare", r"names no zoo model: pass the ONNX model"),
])
def test_a_wrong_call_or_manifest_is_one_clear_error_when_running(built, tmp_path, name, change,
                                                                   call, match):
    lib = runtime.load(_changed(built, tmp_path, name, change))
    action = {"run": lambda: lib.run(), "run_without_inputs": lambda: lib.run([]),
              "compare": lambda: lib.compare()}[call]
    with pytest.raises(ValueError, match=match):
        action()


def test_a_page_of_another_layout_and_a_refused_launch_are_one_clear_error():
    from tvm_rammer.runtime.library import _launch_error

    with pytest.raises(ValueError, match=r"not a tvm-rammer fault page \(16 words ending in"):
        fault_page.describe(np.zeros(16, "int32"))
    err = _launch_error(RuntimeError("CUDA: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"))
    assert isinstance(err, ValueError) and "rebuild it for this GPU's target" in str(err)
    other = RuntimeError("something else")
    assert _launch_error(other) is other


def test_a_cuda_library_without_a_cuda_driver_is_one_clear_error(built, tmp_path):
    if GPU:
        pytest.skip("a CUDA device is visible here")
    path = _changed(built, tmp_path, "file", {"device_type": "cuda"})
    with pytest.raises(ValueError, match=r"(CUDA runtime library .* does not load|no cuda device)"):
        runtime.load(path)


def test_runtime_modules_import_nothing_of_the_compiler():
    """Read from the sources: no module of runtime/ imports TVM's compiler (anything of tvm
    outside tvm.runtime and tvm.base; tvm_ffi is the runtime's) or tvm_rammer outside models/ and
    lease.manifest; relative imports stay inside runtime/. Other packages (NumPy, ONNX,
    onnxruntime, the standard library) are free."""
    import ast

    allowed = ("tvm.runtime", "tvm.base", "tvm_rammer.models", "tvm_rammer.lease.manifest")
    offenders = {}
    for path in sorted((ROOT / "tvm_rammer" / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                names = [] if node.level == 1 else [f"{'.' * node.level}{node.module}"]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad = [n for n in names if n.startswith((".", "tvm.", "tvm_rammer"))
                   and not any(n == a or n.startswith(a + ".") for a in allowed)]
            if bad:
                offenders.setdefault(path.name, []).extend(bad)
    assert offenders == {}


# --- a CUDA library: run on a GPU, or refused with one clear line without a CUDA driver -----------

@pytest.fixture(scope="module")
def cuda_built(tmp_path_factory):
    """The same library compiled for CUDA (dlight's default schedules) for this GPU's arch, or
    sm_90a where none is visible, with its manifest."""
    from onnx_builders import gpu_schedule

    out = tmp_path_factory.mktemp("runtime_cuda_lib")
    arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "") if GPU else "sm_90a"
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    model = get_model(MODEL, **PARAMS)
    with target:
        mod = _module(model, _page(), lambda m: gpu_schedule(relax.transform.LegalizeOps()(m)))
    tvm.compile(mod, target=target).export_library(str(out / "cuda.so"))
    manifest = _manifest(mod, model, "cuda.so", device_type="cuda", target=str(target),
                         arch=arch)
    return mf.write_manifest(out / "cuda.json", manifest)


def _cli_rows(manifest) -> tuple:
    out = manifest.parent / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "tvm_rammer.runtime", str(manifest), "--runs",
                           "10", "--json", str(out)], cwd=ROOT, env=_runtime_only_env(),
                          capture_output=True, text=True, timeout=300)
    assert out.is_file(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())["results"]


@pytest.mark.gpu
def test_a_cuda_library_runs_on_the_gpu_on_the_runtime_alone(cuda_built):
    proc, (row,) = _cli_rows(cuda_built)
    assert proc.returncode == 0 and "error" not in row, row
    assert row["ok"] and row["max_rel_err"] <= 1e-5 and row["latency_us"] > 0


def test_a_cuda_library_without_a_cuda_device_is_its_error_row(cuda_built):
    if GPU:
        pytest.skip("a CUDA device is visible here: the test above runs the library")
    proc, (row,) = _cli_rows(cuda_built)
    assert proc.returncode == 1 and row["model"] == MODEL
    assert re.search(r"CUDA runtime library .* does not load|no cuda device", row["error"])


def _topk_model():
    """TopK (k=3) of x[2, 8]: on llvm TVM calls tvm.contrib.sort.topk of libtvm_runtime_extra,
    which ``import tvm`` does not load under TVM_USE_RUNTIME_LIB=1."""
    from onnx import TensorProto, helper

    k = helper.make_tensor("k", TensorProto.INT64, [1], [3])
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1)], "topk",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 3])], initializer=[k])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_library_calling_tvms_runtime_extra_runs_and_an_onnx_file_is_its_reference(tmp_path):
    """A library without a zoo model (manifest model null, weights embedded) is compared with the
    ONNX file given by --onnx; its TopK needs libtvm_runtime_extra, which the runner loads."""
    import onnx

    model = _topk_model()
    onnx.save(model, tmp_path / "topk.onnx")
    mod = from_onnx(model, keep_params_in_input=False)
    tvm.compile(mod, target="llvm").export_library(str(tmp_path / "topk.so"))
    bare = ("import sys, numpy, tvm; from tvm.runtime.vm import VirtualMachine; "
            "vm = VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu()); "
            "vm['main'](tvm.runtime.tensor(numpy.zeros((2, 8), 'float32')))")
    control = subprocess.run([sys.executable, "-c", bare, str(tmp_path / "topk.so")],
                             env=_runtime_only_env(), capture_output=True, text=True, timeout=300)
    assert "tvm.contrib.sort.topk" in control.stderr  # control: TVM alone does not load it
    inputs, outputs = mf.graph_io(model)
    mf.write_manifest(tmp_path / "topk.json", mf.make_manifest(
        "topk.so", pipeline="default", target="llvm", arch=None, device_type="cpu",
        inputs=inputs, raw=[], weights=[], transform=None, outputs=outputs, fault_page=False))
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "tvm_rammer.runtime", str(tmp_path / "topk.json"),
                           "--runs", "10", "--onnx", str(tmp_path / "topk.onnx"), "--json",
                           str(out)], cwd=ROOT, env=_runtime_only_env(), capture_output=True,
                          text=True, timeout=300)
    (row,) = json.loads(out.read_text())["results"]
    assert proc.returncode == 0 and row["ok"] and row["max_rel_err"] == 0.0, (row, proc.stderr)
    assert row["model"] == "topk"
