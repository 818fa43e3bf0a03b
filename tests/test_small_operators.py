"""Operators too small to be measured get no versions but their dlight one (issue 21: a first
compile makes only what can change a decision).

``profiler.decisive_jobs`` measures nothing of an operator whose dlight version is predicted under
``MIN_SHARE`` of all operators' dlight predictions, and a version with no measured time is never
chosen; so the back end (``backend._small_operators``) does not make those operators' other
versions at all. The tests compile reduced AlexNet (7 of its 12 operators are that small) with the
fake device, and compare with the control where the rule is off (``_small_operators`` finds
nothing): the same jobs measured, the same summary, fewer versions made (counted at
``tuning.versions.prelower``)."""
import hashlib
import json

import pytest

from fake_device import FakeDevice
from tvm_rammer.driver import backend
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.tuning import operator_record, versions
from tvm_rammer.tuning.profile_db import open_profile_db
from tvm_rammer.tuning.profiler import MIN_SHARE, Profiler

TARGET = "rammer/nvidia-h100"


def kernel_us(job) -> float:
    """A deterministic time per kernel, so versions other than dlight win too."""
    return 4.0 + int(hashlib.sha1(job.key.encode()).hexdigest()[:4], 16) % 13


@pytest.fixture(scope="module")
def alexnet():
    return import_onnx(get_model("alexnet", **REDUCED["alexnet"]))


class Made:
    """The versions made (``versions.prelower`` calls, by operator name) and, per compile, the
    small operators ``backend._small_operators`` found."""

    def __init__(self, monkeypatch, rule=True):
        self.lowered, self.small, self.base_lowered = [], [], []
        real_prelower, real_small = versions.prelower, backend._small_operators

        def counting(func, target, name=None):
            self.lowered.append(name)
            return real_prelower(func, target, name=name)

        def small(*args):
            found, lowered = real_small(*args)
            self.small.append(set(found))
            self.base_lowered.append(set(lowered))
            return (found, lowered) if rule else (set(), lowered)

        monkeypatch.setattr(versions, "prelower", counting)
        monkeypatch.setattr(backend, "_small_operators", small)


def compile_once(model, path):
    profiler = Profiler(open_profile_db(path), FakeDevice(kernel_us=kernel_us), "sm_90a", margin=1.25)
    return inspect_model(model, TARGET, RammerConfig(), profiler), profiler


def records_of(path) -> dict:
    with open(path, encoding="utf-8") as f:
        (device,) = json.load(f)["devices"].values()
    return device.get(operator_record.KIND, {})


def test_small_operators_get_only_dlight_and_the_same_kernels_are_measured(alexnet, tmp_path,
                                                                          monkeypatch):
    made = Made(monkeypatch)
    summary, profiler = compile_once(alexnet, str(tmp_path / "rule.json"))
    (small,) = made.small
    assert len(small) >= 3, small
    assert all(made.lowered.count(name) == 1 for name in small)  # the dlight version, lowered once
    with_rule = len(made.lowered)

    control = Made(monkeypatch, rule=False)  # every operator's versions made, as before
    full, control_profiler = compile_once(alexnet, str(tmp_path / "control.json"))
    assert control.small == [small]
    assert all(control.lowered.count(name) > 1 for name in small)
    assert with_rule < len(control.lowered)
    assert profiler.device.measured == control_profiler.device.measured  # nothing decisive lost
    assert profiler.device.measured
    assert not any(label.split(":")[0] in small for label in profiler.device.measured)
    assert summary == full  # the same rPrograms, kernels and times

    dlight_only = [r for r in records_of(str(tmp_path / "rule.json")).values() if r.get("dlight_only")]
    assert sorted(r["operator"] for r in dlight_only) == sorted(small)
    assert all([v["name"] for v in r["versions"]] == ["dlight"] for r in dlight_only)


def test_the_small_ones_are_under_min_share_of_the_dlight_predictions(alexnet, tmp_path, monkeypatch):
    jobs = []
    real = Profiler.prepare
    monkeypatch.setattr(Profiler, "prepare", lambda self, js: jobs.extend(js) or real(self, js))
    made = Made(monkeypatch, rule=False)
    compile_once(alexnet, str(tmp_path / "p.json"))
    bases = {job.operator: job.predicted_us for job in jobs if job.base}
    total = sum(us for us in bases.values() if us)
    (small,) = made.small
    assert small == {op for op, us in bases.items() if us is not None and us < MIN_SHARE * total}
    assert small and small != set(bases)  # negative control: not every operator


def test_a_second_compile_reads_the_small_operators_from_their_records(alexnet, tmp_path,
                                                                      monkeypatch):
    path = str(tmp_path / "db.json")
    compile_once(alexnet, path)
    made = Made(monkeypatch)
    again, profiler = compile_once(alexnet, path)
    (small,) = made.small
    assert small
    assert made.base_lowered == [set()]  # found small from the records: nothing lowered for it
    # their dlight versions lowered only when a chosen persistent kernel holds their code
    assert all(made.lowered.count(name) <= 1 for name in small)
    assert profiler.device.measured == []
    reused = len(made.lowered)
    control = Made(monkeypatch)
    monkeypatch.setattr(Profiler, "operator_record", lambda self, key: None)  # control: full path
    full, _ = compile_once(alexnet, path)
    assert again == full
    assert control.small == [small]
    assert reused < len(control.lowered)


def test_a_dlight_only_record_is_not_used_where_other_versions_are_wanted(alexnet, tmp_path,
                                                                         monkeypatch):
    path = str(tmp_path / "db.json")
    compile_once(alexnet, path)  # writes dlight-only records for the small operators
    small = {r["operator"] for r in records_of(path).values() if r.get("dlight_only")}
    assert small
    made = Made(monkeypatch, rule=False)  # as if they were not small now (another model)
    result, _ = compile_once(alexnet, path)
    for name in small:  # every version made again: the record was not used
        assert made.lowered.count(name) > 1, name
    monkeypatch.setattr(Profiler, "operator_record", lambda self, key: None)  # control: full path
    full, _ = compile_once(alexnet, path)
    assert result == full


def test_decisive_jobs_measures_nothing_of_a_small_operator_even_without_every_prediction():
    from tvm_rammer.tuning.measure import KernelJob
    from tvm_rammer.tuning.profiler import decisive_jobs

    def job(op, name, us, base=False):
        return KernelJob(f"{op}:{name}", f"{op}:{name}", None, None, None, 1, operator=op,
                         predicted_us=us, base=base)

    jobs = [job("big", "dlight", 100.0, True), job("big", "t", 90.0),
            job("small", "dlight", 0.5, True), job("small", "t", None),
            job("unknown", "dlight", 50.0, True), job("unknown", "t", None)]
    kept = [j.key for j in decisive_jobs(jobs, 1.25)]
    # the small one (0.5 of 150.5 us) is left out although one of its versions has no
    # prediction; an operator that is not small with one is measured whole (the control)
    assert kept == ["big:dlight", "big:t", "unknown:dlight", "unknown:t"]
