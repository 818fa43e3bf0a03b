"""The emulator driver end to end: compiled models' CUDA run on the CPU against onnxruntime.

``tvm_rammer.emulate`` compiles as ``tvm.compile`` does (the same CUDA source), describes every
launch, runs the finalized Relax ``main`` with each kernel launch on the C++ emulator, and raises
``KernelFault`` from the module's own fault page. Negative controls: the waits removed from a
program table give a wrong result; an unsatisfiable barrier is reported, not hung.

Each test prints one ``EMU`` line (model, max rel err vs onnxruntime, emulated wall s, g++ s);
``pytest -s`` shows them.
"""

import json
import shutil

import numpy as np
import pytest
import tvm
import tvm_ffi

from tvm_rammer import RammerConfig
from tvm_rammer.codegen import faults
from tvm_rammer.codegen.persistent import waiting_barriers
from tvm_rammer.models import get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import onnx_reference, random_inputs

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
    reason="the emulator builds kernels with a C++ compiler (none on PATH)")

TOL = 1e-4
REDUCED = {  # small versions of zoo models (tvm-rammer model --help)
    "lstm_tc": dict(seq_len=4, input_size=32, hidden=32, layers=2),
    "squeezenet": dict(image_size=32, width=0.25, num_classes=10),
}
# NASNet-CIFAR (2 SMs x 2 vEUs, one rProgram, onnxruntime at 1e-4) is test_emulator_zoo.py's, at
# models.REDUCED's size: a smaller copy here emulated the same path a second time.
# the vDevice each runs on: the preset one (None)
VDEVICE = {"lstm_tc": None, "squeezenet": None}


def _emulator():
    from tvm_rammer.checks import emulator
    return emulator


def _check(name, proto, result, feeds=None, seed=0):
    """Max relative error of ``result`` against onnxruntime; prints the EMU line."""
    feeds = feeds if feeds is not None else random_inputs(proto, seed)
    ref = onnx_reference(proto, feeds)
    assert len(result.outputs) == len(ref)
    err = max(relative_error(o, r) for o, r in zip(result.outputs, ref))
    print(f"\nEMU {name}: max rel err {err:.2e}, emulated {result.emulated_wall_s:.2f} s, "
          f"g++ {result.gxx_seconds:.1f} s, build {result.build_seconds:.1f} s, "
          f"{len(result.launches)} launches")
    return err


@pytest.fixture(scope="module")
def branches():
    return get_model("branches", n=16)


@pytest.fixture(scope="module")
def branches_build(branches):
    """The demo model at its preset vDevice (one build shared by the tests that only run it)."""
    return _emulator().emulation_build(branches)


# --- compile-for-emulation ------------------------------------------------------------------------

def test_emulation_build_generates_what_tvm_compile_does():
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.target import plain_target, resolve_target

    proto = get_model("lstm_tc", **REDUCED["lstm_tc"])
    callback = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    build = _emulator().emulation_build(proto, pipeline="default")
    after = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    assert (after is None) if callback is None else callback.same_as(after)  # restored
    ex = tvm.compile(import_onnx(proto), target=plain_target(resolve_target("rammer/nvidia-h100")),
                     relax_pipeline="default")
    cuda = [i for m in ex.mod.imports for i in m.imports if i.kind == "cuda"]  # VM -> host -> cuda
    assert len(cuda) == 1 and cuda[0].inspect_source() == build.cuda_source
    launched = {launch.kernel for launch in build.launches()}
    assert launched == set(build.kernels)  # every kernel of the source is launched, nothing else


def test_launch_description_of_a_persistent_kernel(branches_build):
    build = branches_build
    (launch,) = build.launches()
    func = build.relax_mod[launch.func]
    manifest = json.loads(str(func.attrs["rammer.manifest"]))
    assert launch.cooperative and launch.grid == (int(func.attrs["rammer.num_veus"]), 1, 1)
    assert launch.block == (int(func.attrs["rammer.veu_threads"]), 1, 1)
    roles = {p.role: p for p in launch.params}
    assert set(roles) == {"input", "output", "weights", "table", "fault_page", "work", "state"}
    np.testing.assert_array_equal(roles["table"].constant, manifest["table"])
    page = roles["fault_page"].constant
    np.testing.assert_array_equal(page, faults.empty_page())
    assert roles["state"].nbytes == 4 * int(func.attrs["rammer.state_words"])
    assert roles["input"].shape == (1, 256) and roles["weights"].nbytes == 16 * 256 * 256 * 4
    assert json.loads(json.dumps(build.launches_json()))[0]["kernel"] == launch.kernel


def test_ordinary_kernels_read_inputs_and_write_outputs():
    proto = get_model("lstm_tc", **REDUCED["lstm_tc"])
    build = _emulator().emulation_build(proto, pipeline="default")
    for launch in build.launches():
        roles = [p.role for p in launch.params]
        assert set(roles) <= {"input", "output", "scalar"} and "output" in roles, launch.to_json()
        assert not launch.cooperative
        for p in launch.params:
            if p.constant is not None:
                assert p.role == "input"  # a kernel never writes a weight


# --- numerics against onnxruntime -----------------------------------------------------------------

def test_demo_model_at_its_preset_vdevice(branches, branches_build):
    result = _emulator().emulate(branches_build)
    assert _check("branches16 (preset vDevice)", branches, result) <= TOL
    assert len(result.launches) == 1 and result.launches[0].cooperative


def test_demo_model_on_two_sms_one_veu_each(branches):
    config = RammerConfig(num_sms=2, veus_per_sm=1)
    result = _emulator().emulate(branches, config=config)
    (launch,) = result.build.launches()
    assert launch.grid == (2, 1, 1)
    assert _check("branches16 (2 SMs x 1 vEU)", branches, result) <= TOL


@pytest.mark.parametrize("name", sorted(REDUCED))
def test_reduced_zoo_model(name):
    proto = get_model(name, **REDUCED[name])
    result = _emulator().emulate(proto, config=VDEVICE[name])
    assert len(result.launches) == 1  # one rProgram
    assert _check(f"{name} (reduced)", proto, result) <= TOL


def test_tvm_default_pipeline_emulated():
    proto = get_model("squeezenet", **REDUCED["squeezenet"])
    result = _emulator().emulate(proto, pipeline="default")
    assert len(result.launches) > 1 and not any(r.cooperative for r in result.launches)
    assert _check("squeezenet (reduced), TVM default pipeline", proto, result) <= TOL


def _onnx_node_case(module: str, case: str):
    """ONNX's own node test ``case`` (its model and data sets), made by importing the one module
    of ``onnx.backend.test.case.node`` that exports it (its classes' export functions run on import
    and append their cases): ``collect_testcases()`` would import and run all of them (a minute)."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case import node
        importlib.import_module(f"onnx.backend.test.case.node.{module}")
    (found,) = [c for c in node._NodeTestCases if c.name == case]  # pylint: disable=protected-access
    return found


@pytest.mark.parametrize("module, case", [
    ("scatternd", "test_scatternd"),  # a kernel taking a buffer's elem_offset as a scalar argument
    ("clip", "test_clip_default_int8_inbounds"),  # main launches no kernel at all
])
def test_onnx_node_cases(module, case):
    found = _onnx_node_case(module, case)
    inputs, expected = found.data_sets[0]
    result = _emulator().emulate(found.model, list(inputs),
                                 config=RammerConfig(profile=False, num_sms=2, veus_per_sm=2))
    assert len(result.outputs) == len(expected)
    for out, ref in zip(result.outputs, expected):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_inputs_by_name_and_errors(branches_build):
    emulator = _emulator()
    feeds = random_inputs(branches_build.onnx, seed=3)
    by_name = emulator.emulate(branches_build, feeds)
    by_order = emulator.emulate(branches_build, [feeds["input"]])
    np.testing.assert_array_equal(by_name.outputs[0], by_order.outputs[0])
    with pytest.raises(ValueError, match=r"inputs are \['input'\]; unknown \['x'\]"):
        emulator.emulate(branches_build, {"x": feeds["input"]})
    with pytest.raises(ValueError, match="takes 1 inputs"):
        emulator.emulate(branches_build, [feeds["input"], feeds["input"]])
    with pytest.raises(ValueError, match="dtype float64"):
        emulator.emulate(branches_build, [feeds["input"].astype("float64")])


@pytest.fixture(scope="module")
def branches2_path(tmp_path_factory):
    import onnx

    path = tmp_path_factory.mktemp("emulator") / "b2.onnx"
    onnx.save(get_model("branches", n=2), str(path))
    return str(path)


SMALL = ["--num-sms", "2", "--veus-per-sm", "1"]


def test_relax_module_input_and_a_random_block_order():
    from tvm_rammer.driver.frontend import import_onnx

    proto = get_model("branches", n=2)
    x = random_inputs(proto, 1)["input"]
    emulator = _emulator()
    result = emulator.emulate(import_onnx(proto), [x], config=RammerConfig(num_sms=2, veus_per_sm=1),
                              order=7)  # an int: a seeded permutation of the blocks
    assert _check("branches2 (Relax module, block order seed 7)", proto, result,
                  feeds={"input": x}) <= TOL
    with pytest.raises(ValueError, match="seeded random inputs for an ONNX model only"):
        emulator.emulate(result.build)


def test_cli_run_emulate_json(branches2_path, capsys):
    from tvm_rammer.cli import main

    code = main(["run", branches2_path, "--emulate", "--json", *SMALL])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] and out["device"] == "emulator"
    assert out["reference"] == "onnxruntime" and "not GPU times" in out["times"]
    for label in ("rammer", "default"):
        assert out[label]["max_rel_err"] <= TOL and out[label]["emulated_wall_s"] > 0
        assert "latency_us" not in out[label]  # emulated seconds are no GPU latency
    assert out["rammer"]["launches"] == 1 and out["default"]["launches"] == 3
    print(f"\nEMU branches2 via CLI: rammer {out['rammer']}, default {out['default']}")


def test_cli_run_emulate_reports_a_mismatch(branches2_path, capsys, monkeypatch):
    """Negative control of the check: a reference the outputs do not match exits 1, says so."""
    from tvm_rammer.cli import main
    from tvm_rammer.checks.emulator import run as emulated

    real = emulated.onnx_reference
    monkeypatch.setattr(emulated, "onnx_reference",
                        lambda proto, feeds: [r + 1.0 for r in real(proto, feeds)])
    code = main(["run", branches2_path, "--emulate", *SMALL])
    out = capsys.readouterr().out
    assert code == 1
    assert "MISMATCH: tvm-rammer's outputs differ from onnxruntime" in out.splitlines()[-1]


def test_symbolic_shapes_are_refused_with_the_fix():
    proto = get_model("branches", n=2)
    for value in (*proto.graph.input, *proto.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"  # a symbolic batch
    with pytest.raises(ValueError, match=r"static shapes only: bind the inputs' shapes \(--batch N"):
        _emulator().emulation_build(proto)
    build = _emulator().emulation_build(proto, batch=1)  # bound: it builds
    assert build.launches() and build.launches()[0].params[0].shape == (1, 256)


def test_no_cxx_compiler_is_said_before_anything_is_compiled(tmp_path, monkeypatch):
    from tvm_rammer.checks.emulator.errors import EmulatorError

    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(EmulatorError, match=r"no C\+\+ compiler .*install g\+\+"):
        _emulator().emulate(str(tmp_path / "not_compiled_yet.onnx"))  # (a missing model file)


def test_the_grid_barrier_words_of_the_page_serve_run_after_run(branches_build):
    """The persistent kernel's prologue barrier (cuda_helpers.GRID_SYNC_SOURCE) keeps its two words
    in the module's fault page, through the Relax constant the VM owns: after each run the count is
    0 and the generation one higher, and the outputs stay right."""
    from tvm_rammer.codegen import cuda_helpers
    from tvm_rammer.checks.emulator.interpret import Interpreter

    build = branches_build
    run = Interpreter(build, build.emulated())
    (launch,) = build.launches()
    page = run.constant(launch.param("fault_page").relax_const)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype("float32")
    first = run(x)
    for count in (1, 2):
        out = run(x) if count == 2 else first
        np.testing.assert_array_equal(np.asarray(out), np.asarray(first))
        assert page[cuda_helpers.GRID_COUNT_WORD] == 0
        assert page[cuda_helpers.GRID_GENERATION_WORD] == count
        assert page[0] == 0


# --- faults and negative controls -----------------------------------------------------------------

def test_injected_fault_is_decoded_from_the_emulated_page(branches):
    config = RammerConfig(num_sms=2, veus_per_sm=1, wait_timeout_ms=5.0,
                          extra={faults.INJECT_KEY: True})
    with pytest.raises(faults.KernelFault, match=r"rammer_rprogram0: vEU \d+ waited more than 5 ms"
                                                 r" \(timed out\)") as caught:
        _emulator().emulate(branches, config=config)
    record = caught.value.record
    assert record["kernel"] == "rammer_rprogram0" and record["awaited_step"] == 10 ** 9
    print(f"\nEMU injected fault: {record}, emulated {caught.value.result.emulated_wall_s:.2f} s")


def _without_waits(table: np.ndarray, num_veus: int) -> int:
    """Set every barrier-rTask's wait count to 0 in ``table`` (in place); how many there were."""
    waiting = waiting_barriers(table, num_veus)
    for at in waiting:
        table[at + 2] = 0
    return len(waiting)


def reverse_order_run(build, waits: bool) -> tuple:
    """(an ``Interpreter`` over ``build`` in reverse block order, how many barrier-rTasks it had
    made wait for nothing): with ``waits`` False every program table's waits are removed, the
    negative control of the tests that check the barriers order the rTasks."""
    from tvm_rammer.checks.emulator.interpret import Interpreter

    run = Interpreter(build, build.emulated(), order="reverse")
    removed = 0
    for launch in build.launches():
        table = launch.param("table")
        if table is not None and not waits:
            removed += _without_waits(run.constant(table.relax_const), launch.grid[0])
    return run, removed


@pytest.mark.parametrize("name, params, vdevice", [
    ("lstm_tc", REDUCED["lstm_tc"], (2, 2)),
    ("branches", {"n": 16}, (2, 1)),  # in forward block order this one happens to come out right
])
def test_waits_removed_from_the_table_give_a_wrong_result(name, params, vdevice):
    proto = get_model(name, **params)
    emulator = _emulator()
    config = RammerConfig(num_sms=vdevice[0], veus_per_sm=vdevice[1])
    build = emulator.emulation_build(proto, config=config)
    feeds = random_inputs(proto, 0)
    args = [feeds[n] for n in build.input_names]
    ref = onnx_reference(proto, feeds)
    errors = {}
    for waits in (True, False):
        run, removed = reverse_order_run(build, waits)
        out = run(*args)
        out = out if isinstance(out, tuple) else (out,)
        errors[waits] = max(relative_error(o, r) for o, r in zip(out, ref))
        if not waits:
            assert removed > 0
    print(f"\nEMU {name} {vdevice} block order reverse: waits kept: err {errors[True]:.2e}; "
          f"waits removed: err {errors[False]:.2e}")
    assert errors[True] <= TOL
    assert errors[False] > 1e-2
