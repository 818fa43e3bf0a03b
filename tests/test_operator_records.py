"""Operator records (issue 21): a second compile on a filled profile database makes only the rKernel
versions it needs, and chooses exactly what the full path (every version made) chooses; a record
that is missing, stale or names a version or kernel record that is gone falls back to the full path.

Compiles run with the fake device (``fake_device.FakeDevice``: a deterministic time per kernel) on
reduced AlexNet; versions made are counted at ``tuning.versions.prelower`` (every version made,
by the full path or from a record, is prelowered there once)."""
import hashlib
import json
import shutil

import pytest

from fake_device import FakeDevice
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.tuning import operator_record, versions
from tvm_rammer.tuning.profile_db import open_profile_db
from tvm_rammer.tuning.profiler import Profiler

TARGET = "rammer/nvidia-h100"
MARGIN = 1.25  # RammerConfig's default profile_margin: only the decisive versions are measured


def kernel_us(job) -> float:
    """A deterministic time per kernel (its func_key), so versions other than dlight win too."""
    return 4.0 + int(hashlib.sha1(job.key.encode()).hexdigest()[:4], 16) % 13


class Counter:
    """Counts the versions made (calls of versions.prelower), by operator."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = versions.prelower

        def counting(func, target, name=None):
            self.calls.append(name)
            return real(func, target, name=name)

        monkeypatch.setattr(versions, "prelower", counting)

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def alexnet():
    return import_onnx(get_model("alexnet", **REDUCED["alexnet"]))


def compile_once(model, path, device=True):
    """(inspect summary, profiler) of one compile on the database at ``path``."""
    profiler = Profiler(open_profile_db(path), FakeDevice(kernel_us=kernel_us) if device else None,
                        "sm_90a", margin=MARGIN)
    return inspect_model(model, TARGET, RammerConfig(), profiler), profiler


def ignoring_records(monkeypatch):
    """The negative control: every operator record is ignored (read as absent)."""
    monkeypatch.setattr(Profiler, "operator_record", lambda self, key: None)


@pytest.fixture(scope="module")
def filled(alexnet, tmp_path_factory):
    """A database after one profiled compile, and how many versions that compile made."""
    path = str(tmp_path_factory.mktemp("db") / "profiles.json")
    calls = []
    real = versions.prelower
    versions.prelower = lambda func, target, name=None: calls.append(name) or real(func, target, name=name)
    try:
        summary, profiler = compile_once(alexnet, path)
    finally:
        versions.prelower = real
    assert profiler.device.measured
    return path, summary, len(calls)


@pytest.fixture(scope="module")
def full_path(alexnet, filled, tmp_path_factory):
    """{device: (summary, profiler, versions made)} of the full path (every operator record
    ignored: ``ignoring_records``) on a copy of the filled database, with the fake device and
    without: the control compile of the tests below whose database differs from the filled one in
    its operator records only (ignored by the full path) or by a kernel record under a key no
    version has, so the full path's compile there is this one (one compile each, not one a test)."""
    out = {}
    for device in (True, False):
        path = str(tmp_path_factory.mktemp("full") / "profiles.json")
        shutil.copy(filled[0], path)
        with pytest.MonkeyPatch.context() as patch:
            count = Counter(patch)
            ignoring_records(patch)
            summary, profiler = compile_once(alexnet, path, device=device)
        out[device] = (summary, profiler, len(count.take()))
    return out


def copy_db(filled, tmp_path) -> str:
    path = str(tmp_path / "profiles.json")
    shutil.copy(filled[0], path)
    return path


def operator_records(path) -> dict:
    with open(path, encoding="utf-8") as f:
        (device,) = json.load(f)["devices"].values()
    return device.get(operator_record.KIND, {})


def edit_db(path, change) -> None:
    """``change(device records)`` applied to the JSON database in place."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    (device,) = doc["devices"].values()
    change(device)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


def test_the_first_compile_writes_one_record_per_operator_naming_every_version(filled):
    records = operator_records(filled[0])
    assert records
    for record in records.values():
        names = [v["name"] for v in record["versions"]]
        assert "dlight" in names and len(names) == len(set(names))
        assert set(record["measured"]) <= set(names)
        assert record["fastest"] is None or record["fastest"] in record["measured"]
    assert sum(len(r["versions"]) for r in records.values()) <= filled[2]
    assert any(len(r["versions"]) > len(r["measured"]) + 1 for r in records.values()), \
        "the margin left versions unmeasured: the ones a second compile need not make"


def test_a_second_compile_makes_fewer_versions_and_chooses_the_same(alexnet, filled, full_path,
                                                                   tmp_path, monkeypatch):
    path = copy_db(filled, tmp_path)
    count = Counter(monkeypatch)
    again, profiler = compile_once(alexnet, path)
    made = count.take()
    full, control, full_made = full_path[True]  # the control: the full path on the same database
    assert again == full  # the same rPrograms, kernels, versions, times and fallbacks
    assert full_made == filled[2]  # every version made, as in the first compile
    assert 0 < len(made) < filled[2] / 2, (len(made), filled[2])
    # of the versions a record names, only those the policy chose are made (scheduled,
    # prelowered): the others only weighed, from their recorded fields
    chosen = {k.split("#")[0] for k in chosen_kernels(again)}
    assert len(made) <= len(chosen), (len(made), chosen)
    assert profiler.device.measured == control.device.measured == []
    assert profiler.device.rprograms == control.device.rprograms == 0
    kernels = [op["kernel"] for p in filled[1]["programs"] for op in p["operators"]]
    assert [op["kernel"] for p in again["programs"] for op in p["operators"]] == kernels


def chosen_kernels(summary) -> list:
    """The kernel (``operator:version#key8``, ``xN`` when coarsened) of every placed operator."""
    return [op["kernel"] for p in summary["programs"] for op in p["operators"]]


def test_without_a_device_the_records_are_read_too(alexnet, filled, full_path, tmp_path,
                                                   monkeypatch):
    path = copy_db(filled, tmp_path)
    count = Counter(monkeypatch)
    reused, _ = compile_once(alexnet, path, device=False)
    made = len(count.take())
    full, _, full_made = full_path[False]
    assert made < full_made == filled[2]
    assert reused == full


def _one_measured_other(records):
    """(record key, record, a measured version other than dlight) of some operator."""
    for key, record in records.items():
        others = [n for n in record["measured"] if n != "dlight"]
        if others:
            return key, record, others[0]
    raise AssertionError("no operator had a version other than dlight measured")


@pytest.mark.parametrize("stale", ["version_gone", "kernel_record_gone", "prediction_changed",
                                   "launch_fields_changed"])
def test_a_stale_record_falls_back_to_the_full_path_with_the_same_result(alexnet, filled, full_path,
                                                                       tmp_path, monkeypatch, stale):
    key, record, name = _one_measured_other(operator_records(filled[0]))
    entry = next(v for v in record["versions"] if v["name"] == name)

    def change(device):
        rec = device[operator_record.KIND][key]
        ver = next(v for v in rec["versions"] if v["name"] == name)
        if stale == "version_gone":  # a version no maker knows any more
            ver["name"] = "template_that_no_longer_exists"
            rec["measured"] = [ver["name"] if n == name else n for n in rec["measured"]]
        elif stale == "kernel_record_gone":
            del device["kernel"][entry["key"]]
        elif stale == "launch_fields_changed":  # so its analytical time is another
            ver["lowered"]["grid"][0] *= 2
        else:
            ver["predicted_us"] = 1e-3

    tampered = copy_db(filled, tmp_path)
    edit_db(tampered, change)
    control_db = str(tmp_path / "control.json")
    shutil.copy(tampered, control_db)

    count = Counter(monkeypatch)
    result, profiler = compile_once(alexnet, tampered)
    made = count.take()
    fell_back = [n for n in made if n == record["operator"]]
    assert len(fell_back) >= len(record["versions"]), "that operator made every version again"
    assert len(made) < filled[2], "the other operators still used their records"
    if stale == "kernel_record_gone":  # the full path's compile on this database is another
        ignoring_records(monkeypatch)
        full, control = compile_once(alexnet, control_db)
    else:  # the operator records differ only, which the full path ignores
        full, control, _ = full_path[True]
    assert result == full
    assert profiler.device.measured == control.device.measured  # the lost record measured again
    if stale == "kernel_record_gone":
        assert profiler.device.measured, "the version whose record was lost is measured again"



def _chosen_deferred(filled):
    """(operator, version name) of a placed operator whose chosen version is not dlight (one a
    second compile makes only when the persistent kernel's code is made)."""
    for kernel in chosen_kernels(filled[1]):
        operator, rest = kernel.split(":", 1)
        name = rest.split("#")[0]
        if name != "dlight":
            return operator, name
    raise AssertionError("the policy chose dlight everywhere: nothing made late")


@pytest.mark.parametrize("device", [True, False])
@pytest.mark.parametrize("late", ["another_kernel", "fails_to_schedule"])
def test_a_chosen_version_that_cannot_be_made_late_compiles_again_as_the_full_path(
        alexnet, filled, full_path, tmp_path, monkeypatch, caplog, late, device):
    """A version made from its record when its code is first needed (``tuning.deferred``) that is
    another kernel than its record says, or whose schedule fails then: the compile finishes, with a
    warning, as the full path (every record ignored) does; control: without the fault no warning."""
    operator, name = _chosen_deferred(filled)
    path = copy_db(filled, tmp_path)
    if late == "another_kernel":  # the maker now makes another kernel under that name
        def change(device_records):
            for rec in device_records[operator_record.KIND].values():
                for ver in rec["versions"]:
                    if rec["operator"] == operator and ver["name"] == name:
                        device_records["kernel"]["0" * 16] = device_records["kernel"][ver["key"]]
                        ver["key"] = "0" * 16
        edit_db(path, change)
    else:
        real = versions.version_func

        def failing(op, target, vname, *args, **kwargs):
            if op == operator and vname == name:
                raise RuntimeError("a dlight rule broke")
            return real(op, target, vname, *args, **kwargs)

        monkeypatch.setattr(versions, "version_func", failing)
    control_db = str(tmp_path / "control.json")
    shutil.copy(path, control_db)
    with caplog.at_level("WARNING", logger="tvm_rammer"):
        result, profiler = compile_once(alexnet, path, device=device)
    warned = [r.getMessage() for r in caplog.records if "compiling again" in r.getMessage()]
    assert len(warned) == 1 and f"{operator}: version {name}" in warned[0], warned
    if late == "another_kernel":  # a kernel record under a key no version has: the full path's
        full, control, _ = full_path[device]  # compile is the one on the filled database
    else:  # the schedule fails in the full path too
        ignoring_records(monkeypatch)
        full, control = compile_once(alexnet, control_db, device=device)
    assert result == full
    if device:
        assert profiler.device.measured == control.device.measured


def test_without_a_fault_no_version_is_made_again(alexnet, filled, tmp_path, caplog):
    """The control of the test above: the same compile on the untouched records warns nothing."""
    with caplog.at_level("WARNING", logger="tvm_rammer"):
        compile_once(alexnet, copy_db(filled, tmp_path))
    assert not [r for r in caplog.records if "compiling again" in r.getMessage()]


class FailingDevice(FakeDevice):
    """FakeDevice whose ``fail(job)`` jobs come back as failed runs (never cached)."""

    def __init__(self, fail, **kw):
        super().__init__(**kw)
        self.fail = fail

    def measure_kernels(self, jobs, progress, within_s=None):
        records = super().measure_kernels(jobs, progress, within_s)
        return [{"valid": False, "error": None, "reason": "run failed: RuntimeError: illegal address"}
                if self.fail(j) else r for j, r in zip(jobs, records)]


def test_a_failed_measurement_is_not_recorded_and_the_next_compile_makes_and_measures_it(
        alexnet, tmp_path, monkeypatch):
    def fail(job):  # every version other than dlight of the convolutions fails to run
        return "conv2d" in job.label and not job.label.endswith(":dlight")

    path = str(tmp_path / "profiles.json")
    first = Profiler(open_profile_db(path), FailingDevice(fail, kernel_us=kernel_us), "sm_90a",
                     margin=MARGIN)
    inspect_model(alexnet, TARGET, RammerConfig(), first)
    failed = {label for label in first.device.measured if "conv2d" in label and not label.endswith(":dlight")}
    assert failed
    for record in operator_records(path).values():
        assert not any(f"{record['operator']}:{name}" in failed for name in record["measured"])
    control_db = str(tmp_path / "control.json")
    shutil.copy(path, control_db)

    again, profiler = compile_once(alexnet, path)
    assert failed <= set(profiler.device.measured)  # made again from the record and measured
    ignoring_records(monkeypatch)
    full, control = compile_once(alexnet, control_db)
    assert sorted(profiler.device.measured) == sorted(control.device.measured)
    assert again == full


def _record(measured=("dlight", "b"), **predicted):
    versions = [{"name": n, "source": "dlight", "key": f"k_{n}", "predicted_us": p}
                for n, p in {"dlight": 10.0, "a": 11.0, "b": 12.0, "c": 30.0, **predicted}.items()]
    return {"format": operator_record.FORMAT, "versions": versions, "measured": list(measured)}


def _names(found):
    return None if found is None else ([v["name"] for v in found[0]], found[1])


@pytest.mark.parametrize("measures, margin, present, expected", [
    # without a device: dlight and the versions with records only
    (False, MARGIN, {"k_dlight", "k_b"}, (["dlight", "b"], False)),
    # with one: also the close versions decisive_jobs would measure (a: 11 <= 1.25 * 10)
    (True, MARGIN, {"k_dlight", "k_b"}, (["dlight", "a", "b"], True)),
    (True, MARGIN, {"k_dlight", "k_a", "k_b"}, (["dlight", "a", "b"], False)),
    # margin None: every version is measured, so every one without a record is needed
    (True, None, {"k_dlight", "k_a", "k_b"}, (["dlight", "a", "b", "c"], True)),
    # a version the record says was measured has lost its kernel record: the full path
    (True, MARGIN, {"k_dlight"}, None),
    (False, MARGIN, {"k_b"}, None),
])
def test_needed_versions(measures, margin, present, expected):
    found = operator_record.needed_versions(_record(), lambda key: key in present, measures, margin, 2)
    assert _names(found) == expected


def test_needed_versions_without_predictions_counts_every_version_as_measurable():
    found = operator_record.needed_versions(_record(c=None), lambda key: key in {"k_dlight", "k_b"},
                                            True, MARGIN, 2)
    assert _names(found) == (["dlight", "a", "b", "c"], True)
    no_dlight = {"format": operator_record.FORMAT, "versions": _record()["versions"][1:], "measured": []}
    assert operator_record.needed_versions(no_dlight, lambda key: True, True, MARGIN, 2) is None


def test_a_tensor_core_version_is_made_by_its_name_alone(monkeypatch):
    """named_versions makes an mma_w... version from its name (schedule_gemm_mma), the same kernel
    template_schedules made, without making every template (control: template_schedules not called)."""
    from conftest_tir import TARGET as CUDA
    from test_tensor_cores import fused16
    from tir_templates.templates import template_schedules

    func = fused16("matmul")
    mma = [t for t in template_schedules(func, CUDA) if t.name.startswith("mma_w")]
    assert mma
    monkeypatch.setattr(versions, "template_schedules",
                        lambda *a, **k: pytest.fail("every template made for one name"))
    (made,) = versions.named_versions("op", CUDA, [(mma[0].name, "template")],
                                      scheduled=mma[0].func, unscheduled=func)
    assert made.key == versions.func_key(mma[0].func)


def test_the_record_key_follows_the_code_that_makes_versions(monkeypatch):
    """Another version maker (here: one more line in the templates' source) is another key, so a
    record written by other code is never read as this code's."""
    import inspect

    before = operator_record.makers_digest()
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda m: real(m) + (
        "\n_GEMM += ((16, 16, 2, 2, 8),)\n" if m.__name__ == "tir_templates.templates" else ""))
    assert operator_record.makers_digest() != before
    monkeypatch.setattr(inspect, "getsource", real)
    assert operator_record.makers_digest() == before  # the control: the same code, the same key
