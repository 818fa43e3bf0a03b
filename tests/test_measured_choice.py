"""Kernels chosen on measured times (issue 7): without a measurement TVM's dlight schedule; with one,
the fastest valid version; a wrong version never; an rProgram slower than TVM's default never."""
import json

import pytest
import tvm
from tvm import tirx

from fake_device import FakeDevice, version_name
from tvm_rammer.driver.backend import make_profiler
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.driver.launches import count_launches
from tvm_rammer.driver.pipeline import own_schedule_rules
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.driver.report import rprogram_reports
from tvm_rammer.tuning.profile_db import JsonProfileDB, open_profile_db
from tvm_rammer.tuning.profiler import Profiler

TARGET = "rammer/nvidia-h100"


def operators(summary):
    return [op for program in summary["programs"] for op in program["operators"]]


@pytest.fixture(scope="module")
def alexnet():
    return import_onnx(get_model("alexnet", **REDUCED["alexnet"]))


def profiled(db=None, **fake):
    return Profiler(db if db is not None else JsonProfileDB(), FakeDevice(**fake), "sm_90a")


def templates_fastest(job):
    """A fake device on which every template beats every other version 10:1."""
    return 10.0 if version_name(job).startswith(("dlight", "metaschedule")) else 1.0


@pytest.mark.parametrize("name", ["alexnet", "squeezenet", "inception_v3"])
def test_without_gpu_or_records_every_operator_is_tvms_dlight_schedule(tmp_path, name):
    # check_unmeasured=False: keep the rProgram whose kernels this test reads (the estimate
    # leaves reduced AlexNet's to TVM's default; tests/test_unmeasured_check.py)
    config = RammerConfig(profile_db=str(tmp_path / "empty.sqlite"), check_unmeasured=False)
    summary = inspect_model(get_model(name, **REDUCED[name]), TARGET, config)
    ops = operators(summary)
    assert ops and summary["rprograms"] >= 1
    # the pipeline's own schedule: dlight's, or that of the rule of ours that took a function one
    # of our graph passes made (reduced Inception's classifier: a transposed-weight GEMV, nt_gemv)
    own = {"dlight"} | {rule.schedule_name for rule in own_schedule_rules()}
    assert {op["version"] for op in ops} <= own and "dlight" in {op["version"] for op in ops}
    assert {op["time_source"] for op in ops} == {"analytical"}
    assert all(op["kernel"].split(":")[1].startswith("dlight#") for op in ops)  # the pipeline's key


def test_profiling_off_reads_no_database_and_measures_nothing(alexnet, tmp_path):
    path = str(tmp_path / "p.json")
    profiled(open_profile_db(path), kernel_us=templates_fastest).flush()
    profiler = make_profiler(tvm.target.Target(TARGET), RammerConfig(profile=False))
    assert not profiler.measures and not profiler.sources
    summary = inspect_model(alexnet, TARGET, RammerConfig(profile=False, check_unmeasured=False))
    assert {op["version"] for op in operators(summary)} == {"dlight"}


def test_measured_times_choose_the_fastest_version_and_a_second_compile_measures_nothing(
        alexnet, tmp_path):
    path = str(tmp_path / "profiles.sqlite")
    first = profiled(open_profile_db(path), kernel_us=templates_fastest)
    summary = inspect_model(alexnet, TARGET, RammerConfig(), first)
    assert first.device.measured, "every version was measured"
    convs = [op for op in operators(summary) if "conv2d" in op["name"]]
    assert convs and {op["version"] for op in convs} == {"template"}
    assert {op["time_source"] for op in operators(summary)} == {"profiled"}

    second = profiled(open_profile_db(path), kernel_us=templates_fastest)
    again = inspect_model(alexnet, TARGET, RammerConfig(), second)
    assert second.device.measured == []
    assert second.device.rprograms == 0  # every rProgram time came from the database too
    assert {op["time_source"] for op in operators(again)} == {"database"}
    assert [op["kernel"] for op in operators(again)] == [op["kernel"] for op in operators(summary)]


def test_a_database_whose_times_favour_a_template_chooses_it_without_a_gpu(alexnet, tmp_path):
    path = str(tmp_path / "recorded.json")
    recorder = profiled(open_profile_db(path), kernel_us=templates_fastest)
    lower(alexnet, TARGET, RammerConfig(), recorder)
    summary = inspect_model(alexnet, TARGET, RammerConfig(profile_db=path))  # no device here
    convs = [op for op in operators(summary) if "conv2d" in op["name"]]
    assert {op["version"] for op in convs} == {"template"}
    assert {op["time_source"] for op in operators(summary)} == {"database"}


def test_a_version_measured_wrong_is_dropped_listed_and_never_chosen(alexnet):
    wrong = lambda job: not version_name(job).startswith("dlight")  # noqa: E731
    profiler = profiled(kernel_us=templates_fastest, wrong=wrong)
    summary = inspect_model(alexnet, TARGET, RammerConfig(), profiler)
    ops = operators(summary)
    assert {op["version"] for op in ops} == {"dlight"}  # the fast templates were all wrong
    dropped = [d for op in ops for d in op["dropped"]]
    assert dropped and all(d["source"] == "template" for d in dropped)
    assert all("relative error" in d["reason"] for d in dropped)


def test_an_operator_whose_dlight_rkernel_is_wrong_stays_tvms_default_kernel(alexnet):
    wrong = lambda job: "conv2d2" in job.label and version_name(job) == "dlight"  # noqa: E731
    summary = inspect_model(alexnet, TARGET, RammerConfig(), profiled(wrong=wrong))
    (reason,) = [op["reason"] for op in summary["unplaced"] if "conv2d2" in (op["kernel"] or "")]
    assert "differs from TVM's default kernel" in reason
    assert not any("conv2d2" in op["name"] for op in operators(summary))


def _persistent(mod):
    return [f for f in mod.functions.values()
            if isinstance(f, tirx.PrimFunc) and "rammer.report" in (f.attrs or {})]


def test_an_rprogram_slower_than_tvms_default_kernels_is_replaced_by_them(alexnet):
    def slow():  # TVM's default kernels take 1 us each; the persistent kernel 1 s
        return profiled(rprogram_us=lambda func: 1e6, kernel_us=lambda job: 1.0,
                        default_us=lambda job: 1.0)

    lowered = lower(alexnet, TARGET, RammerConfig(), slow())
    assert _persistent(lowered) == []
    summary = inspect_model(alexnet, TARGET, RammerConfig(), slow())
    (fallback,) = summary["fallbacks"]
    assert fallback["rammer_us"] == 1e6 and fallback["default_us"] == pytest.approx(
        len(fallback["operators"]) * 1.0)
    assert summary["launches"] == summary["default_launches"]  # the same kernels TVM builds
    assert all("slower than TVM's default" in op["reason"] for op in summary["unplaced"])

    fast = profiled(rprogram_us=lambda func: 1.0, default_us=lambda job: 100.0)
    kept = lower(alexnet, TARGET, RammerConfig(), fast)
    (report,) = rprogram_reports(kept)
    assert report["measured_us"] == 1.0 and report["default_us"] > 1.0
    assert count_launches(kept) == 1


def test_inspect_json_and_text_say_where_times_come_from(alexnet, capsys):
    from tvm_rammer.driver.report import format_schedule

    summary = inspect_model(alexnet, TARGET, RammerConfig(), profiled(
        kernel_us=templates_fastest, wrong=lambda job: version_name(job).startswith("gemm")))
    json.dumps(summary)  # JSON-able
    text = format_schedule(summary)
    assert "profiled time" in text and "measured" in text and "dropped gemm" in text
