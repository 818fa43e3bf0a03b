"""Where TVM's default pipeline fails (issue 33): tvm-rammer compiles the model anyway, and every
command says in one line why the baseline is unavailable.

The model: fuzz graph 184 of seed 20261123 (compiled by the fuzzer with max_rtask_threads=512,
num_sms=1), on which dlight's GEMV rule asserts (``s_tir/dlight/analysis/gemv.py: normalize``).
Negative controls: a model TVM's default pipeline compiles reports its launches, no reason; a
function no dlight rule can schedule gets tvm-rammer's own plain schedule, checked on the emulator.
"""
import logging
import shutil

import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.s_tir import dlight as dl

from tvm_rammer.checks import fuzz
from tvm_rammer.cli import main as cli_main
from tvm_rammer.codegen.tvm_default import (UNAVAILABLE, DefaultPipelineFailed, lower_default,
                                            reason_of)
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.driver.pipeline import DEFAULT_UNAVAILABLE_ATTR
from tir_templates.default_schedule import (SCHEDULE_NOTE_ATTR, GuardedDefaultSchedule,
                                            is_scheduled, scheduled_by)
from tir_templates.plain_schedule import PLAIN_SCHEDULE

TARGET = "rammer/nvidia-h100"
SEED, INDEX = 20261123, 184
GXX = any(shutil.which(c) for c in ("g++", "clang++", "c++"))
needs_gxx = pytest.mark.skipif(not GXX, reason="the emulator builds kernels with a C++ compiler")


@pytest.fixture(scope="module")
def graph184():
    model, _ = fuzz.random_graph(SEED, INDEX)
    return model


@pytest.fixture(scope="module")
def fuzz_options():
    options = fuzz.random_config(SEED, INDEX)
    assert options["max_rtask_threads"] == 512 and options["num_sms"] == 1
    return options


def _small_model(shape=(1, 256)):
    """x -> Relu: TVM's default pipeline compiles it (negative control)."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_tvm_default_fails_with_one_line_naming_the_rule_and_the_function(graph184):
    with pytest.raises(DefaultPipelineFailed) as info:
        lower_default(import_onnx(graph184), TARGET)
    reason = info.value.reason
    assert reason.startswith(UNAVAILABLE) and "\n" not in reason
    assert "dlight's GEMV rule fails on fused_" in reason and "gemv.py: normalize" in reason
    assert reason_of(RuntimeError(f"Traceback ...\n  {reason}")) == reason  # read back after FFI


def test_tvm_default_compiles_the_negative_control():
    assert lower_default(import_onnx(_small_model()), TARGET) is not None


def test_the_fuzzer_options_lower_and_keep_tvm_rammer_with_the_reason(graph184, fuzz_options,
                                                                      caplog):
    config = RammerConfig(profile=False, **fuzz_options)
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        lowered = lower(import_onnx(graph184), TARGET, config)
    assert UNAVAILABLE in str(lowered.attrs[DEFAULT_UNAVAILABLE_ATTR])
    assert any("tvm-rammer's lowering is kept" in r.getMessage() for r in caplog.records)


def test_the_fuzzer_counts_it_apart_not_as_a_failure(graph184, fuzz_options):
    result = fuzz.check_graph(graph184.SerializeToString(), fuzz_options, trials=2)
    assert result["status"] == "ok", result
    assert "GEMV" in result["default_unavailable"]
    control = fuzz.check_graph(_small_model().SerializeToString(), fuzz_options, trials=2)
    assert control["status"] == "ok" and control["default_unavailable"] is None


def test_inspect_prints_a_schedule_and_the_reason(graph184, tmp_path, capsys):
    summary = inspect_model(graph184, TARGET, RammerConfig(profile=False))
    assert summary["default_launches"] is None and "GEMV" in summary["default_unavailable"]
    path = tmp_path / "graph-184.onnx"
    onnx.save(graph184, path)
    code = cli_main(["inspect", str(path), "--max-rtask-threads", "512", "--num-sms", "1",
                     "--no-profile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("rPrograms: ") and "kernel launches per inference" in out
    assert f"{UNAVAILABLE}: dlight's GEMV rule fails on" in out
    assert "Traceback" not in out + err


@pytest.mark.parametrize("extra", [[], ["--weights-apart"]], ids=["embedded", "apart"])
def test_compile_with_tvms_default_pipeline_says_why_in_one_line(graph184, tmp_path, capsys,
                                                                extra):
    """`compile --pipeline default` (TVM's default asked for by name, also with the weights apart)
    of a model it rejects: exit 2, one line naming the dlight rule, no traceback, no file."""
    path = tmp_path / "graph-184.onnx"
    onnx.save(graph184, path)
    out = tmp_path / "m.so"
    code = cli_main(["compile", str(path), "--pipeline", "default", "--target", TARGET,
                     "--no-profile", "-o", str(out), *extra])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert "TVM's default pipeline cannot compile this model: dlight's GEMV rule fails" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph-184.onnx"]


@needs_gxx
def test_run_emulate_checks_tvm_rammer_against_onnxruntime(graph184, fuzz_options):
    from tvm_rammer.checks.emulator import run as emulated

    config = RammerConfig(profile=False, **fuzz.emulated_options(fuzz_options))
    result = emulated.run_model(graph184, TARGET, config)
    assert result["reference"] == "onnxruntime" and result["ok"]
    assert result["rammer"]["max_rel_err"] <= result["tolerance"]
    assert "dlight's GEMV rule fails on" in result["default"]["error"]
    assert "TVM default: " + UNAVAILABLE in emulated.format_result(result)


# --- a schedule for every PrimFunc --------------------------------------------------------------

class _Raising(dl.ScheduleRule):
    """A rule that fails the way dlight's GEMV rule does on graph 184."""

    def apply(self, func, target, tunable):
        raise AssertionError("r_loops")


def _legalized(model):
    return tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                     relax.transform.AnnotateTIROpPattern()])(import_onnx(model))


def test_no_rule_left_gives_the_plain_schedule_with_a_warning(caplog):
    from tvm_rammer.target import plain_target

    plain = plain_target(TARGET)
    mod = _legalized(_reduce_model())
    with plain, caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        out = GuardedDefaultSchedule(_Raising())(mod)
    funcs = [(gv.name_hint, f) for gv, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert funcs and all(is_scheduled(f) and scheduled_by(f) == PLAIN_SCHEDULE for _, f in funcs)
    assert all("_Raising failed (AssertionError: r_loops)" in str(f.attrs[SCHEDULE_NOTE_ATTR])
               for _, f in funcs)
    warned = [r.getMessage() for r in caplog.records]
    assert all(any(name in m and "AssertionError" in m for m in warned) for name, _ in funcs)
    # negative control: without a failing rule nothing is ours
    with plain:
        theirs = GuardedDefaultSchedule(dl.gpu.Fallback())(_legalized(_reduce_model()))
    assert not any(scheduled_by(f) for _, f in theirs.functions_items()
                   if isinstance(f, tvm.tirx.PrimFunc))


def _reduce_model():
    """x[4, 300] - ReduceMax(x) then Softmax, beside two elementwise branches (rTasks)."""
    nodes = [helper.make_node("ReduceMax", ["x"], ["m"], axes=[1], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Softmax", ["d"], ["s"], axis=-1),
             helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Sigmoid", ["x"], ["g"]),
             helper.make_node("Mul", ["r", "x"], ["rx"]),
             helper.make_node("Tanh", ["g"], ["t"]),
             helper.make_node("Sum", ["s", "rx", "t"], ["y"])]
    graph = helper.make_graph(nodes, "reduce",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 300])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


DLIGHT_RULES = (dl.gpu.Matmul, dl.gpu.GEMV, dl.gpu.Reduction, dl.gpu.GeneralReduction,
                dl.gpu.Fallback)


@needs_gxx
def test_every_dlight_rule_failing_still_compiles_and_matches_onnxruntime(monkeypatch):
    """Every dlight rule raises everywhere (TVM's default pipeline, rKernels, ordinary kernels):
    each function gets the plain schedule (here: all of them rTasks of one rProgram, softmax's
    reductions computed per thread), and the emulator checks the outputs against onnxruntime."""
    from tvm_rammer.checks.emulator import run as emulated
    from tvm_rammer.driver.report import summarize

    for rule in DLIGHT_RULES:
        monkeypatch.setattr(rule, "apply", _Raising.apply)
    config = RammerConfig(profile=False, num_sms=2, veus_per_sm=2, max_rtask_threads=128,
                          check_unmeasured=False)
    lowered = lower(import_onnx(_reduce_model()), TARGET, config)
    summary = summarize(lowered)
    assert summary["rprograms"] >= 1, summary["unplaced"]
    versions = {op["name"]: op["version"] for p in summary["programs"] for op in p["operators"]}
    assert len(versions) >= 4 and set(versions.values()) == {PLAIN_SCHEDULE}, versions
    result = emulated.run_model(_reduce_model(), TARGET, config)
    assert result["ok"], result
    assert result["rammer"]["max_rel_err"] <= 1e-5
    assert result["default"]["error"].startswith(UNAVAILABLE)  # every rule raises there too


def test_symbolic_model_tvm_cannot_schedule_compiles_with_our_schedule(monkeypatch, caplog):
    """An unbound dimension (no rPrograms) where TVM's default pipeline fails: TVM's passes with
    tvm-rammer's guarded schedule, one warning naming TVM's failure."""
    monkeypatch.setattr(dl.gpu.GEMV, "apply", _Raising.apply)
    model = _small_model(("N", 256))
    mod = import_onnx(model)
    with pytest.raises(DefaultPipelineFailed, match="GEMV rule fails on"):
        lower_default(mod, TARGET)
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        lowered = lower(mod, TARGET, RammerConfig(profile=False))
    funcs = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
             and not (f.attrs is not None and f.attrs.get("tirx.is_host_func", False))]
    assert funcs and all(is_scheduled(f) for f in funcs)
    assert any("GEMV rule fails" in r.getMessage() and "tvm-rammer's schedule" in r.getMessage()
               for r in caplog.records)
    from tvm_rammer.checks.emulator.compile import no_cuda_compile
    from tvm_rammer.target import plain_target

    with no_cuda_compile():  # TVM's codegen accepts it: every loop nest bound to threads
        assert relax.build(lowered, target=plain_target(TARGET), relax_pipeline=None) is not None


def test_gpu_run_and_bench_report_the_default_as_unavailable():
    """``run`` on a GPU and ``bench``: the default's latency unavailable with the reason (no GPU
    needed to check the reporting)."""
    from tvm_rammer.benchmarks.harness import _short
    from tvm_rammer.run.runner import format_result

    reason = f"{UNAVAILABLE}: dlight's GEMV rule fails on fused_sum (AssertionError)"
    text = format_result({"device": "H100", "reference": "onnxruntime", "ok": True,
                          "rammer": {"max_rel_err": 1e-7, "latency_us": 12.5},
                          "default": {"error": reason, "latency_us": None, "max_rel_err": None},
                          "speedup": None})
    assert f"TVM default: {reason} (latency: unavailable)" in text
    assert "speedup unavailable  OK" in text
    assert _short(DefaultPipelineFailed(reason)) == reason
    assert _short(ValueError("a\nb")) == "ValueError: b"  # others: type and last line, as before
