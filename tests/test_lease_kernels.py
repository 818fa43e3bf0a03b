"""Kernel versions timed over GPU leases (issue 31, items 4 and 5): the jobs recorded without a GPU
are those the profiler's decisive rule measures; the runtime-only timer checks and times built
kernels and catches a wrong one; a lease's results become a shipped profile that a compile without
a GPU reads and chooses by."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
from tvm import te

from fake_device import FakeDevice
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.lease import kernel_results, kernels
from tvm_rammer.lease.kernels import KernelEntry
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.tuning import profile_db
from tvm_rammer.tuning.profile_db import JsonProfileDB
from tvm_rammer.tuning.profiler import Profiler

TARGET = "rammer/nvidia-h200"
ROOT = Path(__file__).resolve().parents[1]
TIMING = ROOT / "tvm_rammer" / "runtime" / "kernel_timing.py"
MODEL = "two_branch"  # reduced: two operators with versions, seconds to compile
SPEC = {"zoo": MODEL, "params": REDUCED[MODEL], "batch": 1}
H200 = {"name": "NVIDIA H200", "arch": "sm_90", "driver": "570.00"}


def kernel_us(job):
    return 5.0 if job.base else 3.0


@pytest.fixture(scope="module")
def recorded():
    return kernels.record_jobs(SPEC, TARGET)


def operators(summary):
    return [op for program in summary["programs"] for op in program["operators"]]


def test_recorded_jobs_are_those_a_device_measures(recorded, tmp_path):
    profiler = Profiler(JsonProfileDB(str(tmp_path / "fake.json")), FakeDevice(kernel_us=kernel_us),
                        "sm_90a", margin=RammerConfig().profile_margin)
    lower(import_onnx(get_model(MODEL, **REDUCED[MODEL])), TARGET, RammerConfig(), profiler)
    profiler.flush()
    assert recorded.jobs and [j.label for j in recorded.jobs] == profiler.device.measured
    assert not recorded.measured
    assert set(recorded.decisive) >= {j.key for j in recorded.jobs}

    # the records of a database (all but two operators' here: all of them) and what an earlier
    # lease timed (timed.json: the first of those two) are not asked again
    fake = JsonProfileDB(str(tmp_path / "fake.json"))
    (device,) = fake.devices()
    first, second = list(dict.fromkeys(j.operator for j in recorded.jobs))[:2]
    known = JsonProfileDB()
    known.put_many([("kernel", k, device, fake.get("kernel", k, device)) for k in recorded.decisive
                    if not any(j.key == k and j.operator in (first, second) for j in recorded.jobs)])
    timed = [j.key for j in recorded.jobs if j.operator == first]
    rest = kernels.record_jobs(SPEC, TARGET, db=known, timed=timed)
    assert [j.label for j in rest.jobs] == [j.label for j in recorded.jobs if j.operator == second]
    assert len(rest.measured) == len(rest.decisive) - len(rest.jobs) - len(timed)


def test_entries_put_each_reference_before_its_versions_once(recorded):
    entries, value = kernels.entries_of(recorded)
    assert value["predicted_gain_us"] > 0 and value["at_stake_us"] >= value["predicted_gain_us"]
    keys = [e.key for e in entries]
    assert len(keys) == len(set(keys))
    assert set(keys) == {j.key for j in recorded.jobs} | {j.reference_key for j in recorded.jobs}
    for i, e in enumerate(entries):
        if e.role == "version":
            assert e.reference in keys[:i]
    again, _ = kernels.entries_of(recorded, seen=set(keys))  # a second model sharing every kernel
    assert again == []


@pytest.mark.nvcc
def test_prepare_builds_libraries_and_a_manifest_then_reuses_them(recorded, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "record_jobs", lambda *args: recorded)  # recorded once (above)
    monkeypatch.setattr(kernels, "_sources_digest", lambda: "fixed")  # others edit the tree
    out = str(tmp_path / "kernels")
    manifest = kernels.prepare_kernels([SPEC], out, size_budget_mib=40, rprograms=False)
    assert manifest["format"] == kernels.FORMAT and manifest["arch"] == "sm_90a"
    listed = {k["key"] for k in manifest["kernels"]}
    assert listed == {j.key for j in recorded.jobs} | {j.reference_key for j in recorded.jobs}
    for lib in manifest["libraries"]:
        assert os.path.getsize(os.path.join(out, lib["library"])) == lib["bytes"] > 0
        assert lib["cuda_format"] == "binary" and "sm_90a" in lib["arches"]  # cross-compiled
    assert all(k["registers"] for k in manifest["kernels"])  # nvcc compiled each one
    (model,) = manifest["models"]
    assert model["to_time"] == len(recorded.jobs) and manifest["left_out"] == 0
    assert model["built"] == len(listed)
    stamps = {lib["library"]: os.path.getmtime(os.path.join(out, lib["library"]))
              for lib in manifest["libraries"]}
    assert kernels.prepare_kernels([SPEC], out, 40, rprograms=False) == manifest  # unchanged
    assert stamps == {n: os.path.getmtime(os.path.join(out, n)) for n in stamps}


# --- the GPU side, on llvm-built kernels ------------------------------------------------------------

def _matmul(variant: str):
    a = te.placeholder((16, 32), "float32", name="a")
    b = te.placeholder((32, 8), "float32", name="b")
    k = te.reduce_axis((0, 32), name="k")
    if variant == "wrong":  # forgets the last row of the reduction
        c = te.compute((16, 8), lambda i, j: te.sum(
            tvm.tirx.if_then_else(k < 31, a[i, k] * b[k, j], 0.0), axis=k), name="c")
    else:
        c = te.compute((16, 8), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    func = te.create_prim_func([a, b, c])
    if variant == "split":  # the same result, another loop order
        sch = tvm.s_tir.Schedule(func)
        i, j, kk = sch.get_loops(sch.get_sblock("c"))
        io, ii = sch.split(i, [4, 4])
        sch.reorder(io, j, ii)
        func = sch.mod["main"]
    return func


def _llvm_manifest(out: str) -> dict:
    ref = KernelEntry("ref0", "mm:tvm_default", _matmul("plain"), "mm", "reference", None, 1, "test")
    good = KernelEntry("good", "mm:split", _matmul("split"), "mm", "version", "ref0", 1, "test", 1.0)
    bad = KernelEntry("bad", "mm:wrong", _matmul("wrong"), "mm", "version", "ref0", 1, "test", 0.5)
    libraries, built, left = kernels.build_libraries([ref, good, bad], "llvm", out)
    assert left == 0 and len(libraries) == 1
    return kernels.write_manifest(out, "llvm", None, "cpu", libraries, built)


def test_libraries_stop_at_the_size_budget(tmp_path):
    entries = [KernelEntry(f"r{i}", f"op{i}:tvm_default", _matmul("plain"), f"op{i}", "reference",
                           None, 1) for i in range(3)]
    out = str(tmp_path / "lib")
    libs, built, left = kernels.build_libraries(entries, "llvm", out, None, kernels_per_library=1)
    assert len(libs) == 3 and left == 0 and [k["key"] for k in built] == ["r0", "r1", "r2"]
    size = max(lib["bytes"] for lib in libs)
    libs, built, left = kernels.build_libraries(entries, "llvm", out, 2.5 * size / 2**20, 1)
    assert len(libs) == 2 and left == 1  # the third would not fit (reused: nothing built again)
    assert kernels.build_libraries(entries, "llvm", out, 0, 1) == ([], [], 3)


def _timing(*args, env=None):
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", **(env or {})}
    return subprocess.run([sys.executable, str(TIMING), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def test_timing_checks_and_times_llvm_kernels_runtime_only_and_catches_a_wrong_one(tmp_path):
    out = tmp_path / "lib"
    _llvm_manifest(str(out))
    results = tmp_path / "results.jsonl"
    done = _timing(out / "kernels.json", "--out", results, "--budget-s", 120, "--number", 2,
                   "--repeat", 2)
    assert done.returncode == 0, done.stderr
    lines = {r["key"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert set(lines) == {"ref0", "good", "bad"}
    assert lines["ref0"]["valid"] is True and lines["ref0"]["kernel_us"] > 0
    assert lines["good"]["valid"] is True and lines["good"]["error"] < 1e-5
    assert lines["good"]["default_us"] == lines["ref0"]["kernel_us"]
    assert lines["bad"]["valid"] is False and lines["bad"]["error"] > 1e-3  # the negative control
    assert "differs from TVM's default kernel" in lines["bad"]["reason"]
    again = _timing(out / "kernels.json", "--out", results)  # continues: nothing left
    assert again.returncode == 0 and '"timed": 0' in again.stdout
    assert len(results.read_text().splitlines()) == 3


def test_timing_without_the_device_lists_what_it_would_time(tmp_path):
    kernel = {"library": "kernels-x.so", "function": "rk_a", "key": "a", "label": "op:dlight",
              "operator": "op", "role": "reference", "reference": None, "num_outputs": 1,
              "params": [["x", [4], "float32"], ["y", [4], "float32"]]}
    kernels.write_manifest(str(tmp_path), TARGET, "sm_90a", "cuda", [{"library": "kernels-x.so"}],
                           [kernel])
    done = _timing(tmp_path / "kernels.json", "--out", tmp_path)
    if "would time" not in done.stdout:
        pytest.skip("a CUDA device is visible here")
    assert done.returncode == 0 and "would time 1 kernel(s) in 1 library" in done.stdout
    assert not (tmp_path / kernels.RESULTS).exists()


def test_timing_refuses_a_file_that_is_not_a_manifest(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    done = _timing(tmp_path / "x.json", "--out", tmp_path / "r.jsonl")
    assert done.returncode == 2 and "is not a kernel manifest" in done.stderr


# --- the loop: results -> shipped profile -> the next compile ---------------------------------------

def _results(recorded, operator: str, dlight_us: float, other_us: float) -> list:
    """Made-up lease results for ``operator``: its reference (TVM's default kernel), its dlight
    version (when that is another kernel) and its best predicted other version, the dlight
    version and the reference taking ``dlight_us``, the other ``other_us``."""
    jobs = [j for j in recorded.jobs if j.operator == operator]
    base = next(j for j in jobs if j.base)
    other = min((j for j in jobs if not j.base), key=lambda j: j.predicted_us)
    lines = [{"key": base.reference_key, "role": "reference", "kernel_us": dlight_us, "valid": True,
              "error": 0.0, "registers": 32, "shared_bytes": 0, "seconds": 0.1}]
    if base.key != base.reference_key:
        lines.append({"key": base.key, "role": "version", "reference": base.reference_key,
                      "kernel_us": dlight_us, "valid": True, "error": 0.0, "registers": 32,
                      "shared_bytes": 0, "seconds": 0.1})
    lines.append({"key": other.key, "role": "version", "reference": base.reference_key,
                  "kernel_us": other_us, "valid": True, "error": 1e-7, "registers": 40,
                  "shared_bytes": 1024, "seconds": 0.1, "label": other.label})
    return lines


def _compiled_choice(recorded, tmp_path, monkeypatch, dlight_us, other_us, name):
    profiles = tmp_path / name
    results = tmp_path / f"{name}.jsonl"
    operator = recorded.jobs[0].operator
    lines = _results(recorded, operator, dlight_us, other_us)
    lines.append({"key": "feedbeef00000000", "role": "version", "kernel_us": None, "valid": None,
                  "reason": "timed out: no result within 60 s"})  # a failure: not a fact
    results.write_text("".join(json.dumps(r) + "\n" for r in lines))
    timed = tmp_path / f"{name}-lease" / "timed.json"
    info = kernel_results.import_results(str(results), H200, profiles_dir=profiles, timed_path=timed)
    assert info["written"] == len(lines) - 1 and info["failed"] == 1
    assert Path(info["path"]).name == "nvidia-h200.json"
    doc = json.loads(Path(info["path"]).read_text())
    assert doc["format"] == profile_db.FORMAT
    assert list(doc["devices"]) == ["NVIDIA H200 | sm_90 | driver 570.00"]
    assert json.loads(timed.read_text())["kernels"]["feedbeef00000000"].startswith("timed out")
    # a compile without a GPU reads the shipped database of the target's arch (no user cache)
    monkeypatch.setattr(profile_db, "SHIPPED_DIR", profiles)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache-{name}"))
    summary = inspect_model(get_model(MODEL, **REDUCED[MODEL]), TARGET,
                            RammerConfig(check_unmeasured=False))
    ops = [o for o in operators(summary) if o["name"] == operator]
    assert ops  # every call of the operator (one PrimFunc, one choice)
    return ops, lines[-2]["label"]


def test_imported_results_change_the_choice_of_a_compile_without_a_gpu(recorded, tmp_path, monkeypatch):
    ops, other = _compiled_choice(recorded, tmp_path, monkeypatch, 10.0, 1.0, "faster")
    assert all(op["kernel"].split("#")[0] == other and op["time_source"] == "shipped" for op in ops)


def test_imported_results_that_favour_dlight_keep_it(recorded, tmp_path, monkeypatch):
    ops, _ = _compiled_choice(recorded, tmp_path, monkeypatch, 1.0, 10.0, "slower")
    assert all(op["version"] == "dlight" and op["time_source"] == "shipped" for op in ops)


def test_state_table_counts_measured_kernels_and_leases_left(tmp_path):
    device = kernel_results.device_id(H200)
    db = JsonProfileDB(str(tmp_path / "p.json"))
    db.put_many([("kernel", "a", device, {"kernel_us": 1.0, "valid": True, "error": 0.0}),
                 ("kernel", "b", device, {"valid": False, "error": None, "reason": "run failed: x"})])
    manifest = {"models": [{"name": "m1", "decisive": ["a", "b", "c"]},
                           {"name": "m2", "decisive": ["a"]}]}
    rows = kernel_results.state_table(manifest, db, device, per_lease=1)
    assert rows == [{"model": "m1", "decisive": 3, "measured": 1, "left": 2, "leases_left": 2},
                    {"model": "m2", "decisive": 1, "measured": 1, "left": 0, "leases_left": 0}]
    assert "| m1 | 3 | 1 | 2 | 2 |" in kernel_results.state_markdown(rows, per_lease=1)
    assert kernel_results.kernels_per_lease(0.2, 120.0) == 600
    assert kernel_results.kernels_per_lease(0.2, 120.0, size_mib=10, mib_per_kernel=0.1) == 100
    assert kernel_results.leases_needed(601, 0, 600) == 2


def test_the_lease_hook_names_the_timing_module_and_its_manifest(tmp_path, monkeypatch):
    asked = {}

    def fake_prepare(models, out_dir, budget_mib, db, target, max_kernels=None, deadline=None):
        asked.update(models=list(models), budget=budget_mib, max_kernels=max_kernels)
        return kernels.write_manifest(out_dir, target, "sm_90a", "cuda", [{"bytes": 2**20}],
                                      [{"key": str(i)} for i in range(100)])

    monkeypatch.setattr(kernels, "prepare_kernels", fake_prepare)
    lease = tmp_path / ".lease"
    entry = kernels.prepare(str(lease / "kernels"), budget_mib=30, time_s=60, seconds_per_kernel=0.2)
    assert asked == {"models": list(kernels.LEASE_MODELS), "budget": 30, "max_kernels": 300}
    assert entry["module"] == "tvm_rammer.runtime.kernel_timing" and entry["kernels"] == 100
    assert entry["args"][0] == os.path.join(".lease", "kernels", "kernels.json")  # from the lease's parent
    assert entry["estimate_s"] == 100 * 0.2 + 10 and entry["mib"] == 1.0


def test_the_import_command_writes_the_profile_and_the_state_command_counts_it(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps({"key": "a", "role": "reference", "kernel_us": 2.0, "valid": True,
                                   "error": 0.0}) + "\n")
    facts = tmp_path / "device.json"
    facts.write_text(json.dumps(H200))
    profiles = tmp_path / "profiles"
    assert kernel_results.main(["import", str(results), str(facts), "--profiles", str(profiles)]) == 0
    manifest = tmp_path / "kernels.json"
    manifest.write_text(json.dumps({"models": [{"name": "m", "decisive": ["a", "b"]}]}))
    capsys.readouterr()
    assert kernel_results.main(["state", str(manifest), "--facts", str(facts),
                                "--profiles", str(profiles)]) == 0
    assert "| m | 2 | 1 | 1 | 1 |" in capsys.readouterr().out


# --- item 5: the close rProgram candidates, timed by the next lease ----------------------------------

FAKE = {"name": "Fake GPU", "arch": "sm_90", "driver": "1.0"}  # fake_device.FakeDevice's id


@pytest.fixture(scope="module")
def kernels_measured(tmp_path_factory):
    """A shipped profile folder whose database (the fake device's) has every decisive kernel of
    MODEL measured and no rProgram record: a compile reading it forms rPrograms whose
    keep-or-fall-back decision is not measured."""
    profiles = tmp_path_factory.mktemp("profiles")
    path = profiles / "fake-gpu.json"
    profiler = Profiler(JsonProfileDB(str(path)), FakeDevice(kernel_us=kernel_us), "sm_90a",
                        margin=RammerConfig().profile_margin)
    lower(import_onnx(get_model(MODEL, **REDUCED[MODEL])), TARGET, RammerConfig(), profiler)
    profiler.flush()
    doc = json.loads(path.read_text())
    for records in doc["devices"].values():
        records.pop("rprogram", None)  # the fake device timed them: forget it
    path.write_text(json.dumps(doc))
    return profiles


@pytest.fixture()
def shipped(kernels_measured, tmp_path, monkeypatch):
    """A copy of ``kernels_measured`` as the shipped profiles (and no per-user cache)."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for p in kernels_measured.glob("*.json"):
        (profiles / p.name).write_text(p.read_text())
    monkeypatch.setattr(profile_db, "SHIPPED_DIR", profiles)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return profiles


def test_rprogram_candidates_are_built_with_the_back_ends_key(shipped, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "_sources_digest", lambda: "fixed")
    out = tmp_path / "kernels"
    manifest = kernels.prepare_kernels([SPEC], str(out), size_budget_mib=40)
    (model,) = manifest["models"]
    assert model["to_time"] == 0  # every kernel measured: what is left is the rPrograms
    assert model["rprograms"] == {"formed": 1, "measured": 0, "unmeasurable": 0, "candidates": 1,
                                  "built": 1, "left": 0, "record_s": model["rprograms"]["record_s"]}
    assert model["leases_needed"] == 1
    (entry,) = [k for k in manifest["kernels"] if k["role"] == "rprogram"]
    assert entry["stable"] and entry["model"] == MODEL and entry["fault_page"] == "rammer_fault_page"
    assert not [k for k in manifest["kernels"] if k["role"] != "rprogram"]  # references measured
    table = np.load(out / entry["fixed"]["rammer_program"])
    assert table.dtype == np.int32 and len(table) == dict(
        (n, s) for n, s, _ in entry["params"])["rammer_program"][0]
    assert os.path.getsize(out / entry["library"]) > 0
    # the key is the one the back end looks up: measured by a fake device, it is found there
    found = []
    profiler = Profiler(JsonProfileDB(), FakeDevice(kernel_us=kernel_us,
                                                    rprogram_us=lambda f: found.append(f) or 7.0),
                        "sm_90a", margin=RammerConfig().profile_margin)
    lower(import_onnx(get_model(MODEL, **REDUCED[MODEL])), TARGET, RammerConfig(), profiler)
    (device,) = profiler.db.devices()
    assert profiler.db.get("rprogram", entry["key"], device) == {"time_us": 7.0}
    # a second prepare with nothing changed reuses it; with --no-rprograms none is listed
    assert kernels.prepare_kernels([SPEC], str(out), size_budget_mib=40) == manifest
    none = kernels.prepare_kernels([SPEC], str(tmp_path / "k2"), 40, rprograms=False)
    assert none["kernels"] == [] and none["models"][0]["rprograms"] is None
    full = kernels.prepare_kernels([SPEC], str(tmp_path / "k3"), 40, max_kernels=2)  # < 3 slots
    assert full["kernels"] == [] and full["models"][0]["rprograms"] is None
    assert full["models"][0]["leases_needed"] is None  # not formed: not known


def _decided(shipped, tmp_path, rammer_us: float) -> dict:
    """The back end's decision on MODEL's rProgram after a lease timed it at ``rammer_us``."""
    from tvm_rammer.lease import rprograms

    (cand,) = rprograms.record_rprograms(SPEC, TARGET).candidates
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps({"key": cand.key, "role": "rprogram", "kernel_us": rammer_us,
                                   "valid": True, "error": None, "seconds": 0.3}) + "\n")
    info = kernel_results.import_results(str(results), FAKE, profiles_dir=shipped)
    assert info["rprograms"] == 1 and Path(info["path"]).name == "fake-gpu.json"
    after = rprograms.record_rprograms(SPEC, TARGET)
    assert (after.formed, after.measured, after.candidates) == (1, 1, [])
    return inspect_model(get_model(MODEL, **REDUCED[MODEL]), TARGET, RammerConfig())


def test_no_rprogram_time_keeps_it_unmeasured(shipped):  # the control of the two below
    summary = inspect_model(get_model(MODEL, **REDUCED[MODEL]), TARGET, RammerConfig())
    (program,) = summary["programs"]
    assert program["measured_us"] is None and program["default_us"] > 0


def test_an_imported_rprogram_time_faster_than_default_keeps_it(shipped, tmp_path):
    summary = _decided(shipped, tmp_path, 1.5)
    (program,) = summary["programs"]
    assert program["measured_us"] == 1.5 and program["measured_source"] == "shipped"
    assert summary["fallbacks"] == []


def test_an_imported_rprogram_time_slower_than_default_falls_back(shipped, tmp_path, caplog):
    summary = _decided(shipped, tmp_path, 1000.0)
    assert summary["programs"] == []  # its operators are TVM's default kernels (then the
    # whole model TVM's default pipeline: fewer launches than 3 ordinary kernels)
    assert "rProgram measured 1000.0 us, not faster than TVM's default kernels (20.0 us)" \
        in caplog.text


def test_candidates_go_closest_to_a_tie_first_stable_ones_before():
    from tvm_rammer.lease import rprograms

    def cand(key, rammer, default, stable=True):
        return rprograms.RProgramCandidate(key, "p", "m", None, {}, (), {}, (), rammer, default, stable)

    found = [cand("far", 20.0, 10.0), cand("tie", 50.0, 50.0), cand("small_tie", 2.0, 2.0),
             cand("unstable", 50.0, 50.0, stable=False), cand("close", 60.0, 50.0)]
    assert [c.key for c in rprograms.ordered(found)] == ["tie", "close", "far", "small_tie", "unstable"]
    assert rprograms.value_of(40.0, 20.0) == rprograms.value_of(10.0, 20.0) == 10.0
    assert rprograms.leases_needed(0, 0, 100) == 0
    assert rprograms.leases_needed(150, 40, 100) == 2 + 2  # kernels first, 3 slots an rProgram
    assert rprograms.leases_needed(5, None, 100) is None


def _fault_kernel(scale: float = 2.0):
    """An llvm stand-in of a persistent kernel: ``out = a * scale`` and its fault page's word 0 set
    to the table's first word (a fault when it is not 0)."""
    a = te.placeholder((64,), "float32", name="a")
    table = te.placeholder((4,), "int32", name="rammer_program")
    out = te.compute((64,), lambda i: a[i] * scale, name="out")
    page = te.compute((16,), lambda i: tvm.tirx.if_then_else(i == 0, table[0], 0),
                      name="rammer_fault_page")
    return te.create_prim_func([a, table, out, page])


def test_timing_times_an_rprogram_entry_with_its_fixed_arguments_and_reads_its_fault_page(tmp_path):
    out = tmp_path / "lib"
    (out / "rprograms").mkdir(parents=True)
    entries = []
    for key, first in (("fine", 0), ("faulty", 7), ("missing", None)):
        if first is not None:  # "missing": its table did not travel (the lease's fault)
            np.save(out / "rprograms" / f"{key}.npy", np.array([first, 1, 2, 3], "int32"))
        entries.append(KernelEntry(key, f"m:{key}", _fault_kernel(), key, "rprogram", None, 0, "m",
                                   extra={"fixed": {"rammer_program": f"rprograms/{key}.npy"},
                                          "fault_page": "rammer_fault_page"}))
    libraries, built, _ = kernels.build_libraries(entries, "llvm", str(out))
    kernels.write_manifest(str(out), "llvm", None, "cpu", libraries, built)
    results = tmp_path / "results.jsonl"
    done = _timing(out / "kernels.json", "--out", results, "--number", 2, "--repeat", 2)
    assert done.returncode == 0, done.stderr
    lines = {r["key"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert lines["fine"]["valid"] is True and lines["fine"]["kernel_us"] > 0
    assert lines["fine"]["role"] == "rprogram"
    assert lines["faulty"]["kernel_us"] is None and "fault page" in lines["faulty"]["reason"]
    assert lines["missing"]["reason"].startswith("load failed") and "missing.npy" in \
        lines["missing"]["reason"]
    info = kernel_results.import_results(str(results), FAKE, profiles_dir=tmp_path / "profiles",
                                         timed_path=tmp_path / "timed" / "timed.json")
    assert info["rprograms"] == 1 and info["failed"] == 2
    db = JsonProfileDB(info["path"])
    device = kernel_results.device_id(FAKE)
    assert db.get("rprogram", "fine", device) == {"time_us": lines["fine"]["kernel_us"],
                                                  "source": "lease"}
    assert db.get("rprogram", "faulty", device) is None  # a failure is not a fact
    timed = json.loads((tmp_path / "timed" / "timed.json").read_text())["kernels"]
    assert timed["faulty"].startswith("run failed")
    assert "missing" not in timed  # asked again by the next prepare


def test_an_rprogram_library_is_named_by_its_code_not_only_its_key(tmp_path):
    """An rProgram's key (the back end's plan_key) stays when the code generator changes its
    persistent kernel: the library name changes with the code, so an older build is not reused;
    control: the same code, the same name (a second prepare reuses it)."""
    def entry(scale):
        return KernelEntry("k", "m:p", _fault_kernel(scale), "k", "rprogram", None, 0, "m")

    spec = {"kind": "llvm"}
    assert kernels._library_name([entry(2.0)], spec) == kernels._library_name([entry(2.0)], spec)
    assert kernels._library_name([entry(2.0)], spec) != kernels._library_name([entry(3.0)], spec)


@pytest.mark.nvcc
def test_a_prepare_cut_by_its_deadline_is_not_reused_by_the_next(recorded, tmp_path, monkeypatch):
    """prepare's time limit reached while a model was recorded: no library is built and the
    manifest is not one the next prepare reuses (no inputs key): the next, without a limit, builds
    them; a limit reached before the first model records none."""
    clock = {"t": 0.0}  # kernels' clock: the recording compile below takes "10 s"
    monkeypatch.setattr(kernels, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))

    def record(*args):
        clock["t"] += 10.0
        return recorded

    monkeypatch.setattr(kernels, "record_jobs", record)
    monkeypatch.setattr(kernels, "_sources_digest", lambda: "fixed")
    out, n = str(tmp_path / "kernels"), len(kernels.entries_of(recorded)[0])
    cut = kernels.prepare_kernels([SPEC], out, 40, deadline=5.0, rprograms=False)
    assert cut["kernels"] == [] and cut["left_out"] == n and cut["inputs_key"] is None
    assert len(cut["models"]) == 1
    whole = kernels.prepare_kernels([SPEC], out, 40, rprograms=False)
    assert len(whole["kernels"]) == n and whole["inputs_key"] is not None
    none = kernels.prepare_kernels([SPEC], str(tmp_path / "k2"), 40, deadline=clock["t"] - 1.0,
                                   rprograms=False)
    assert none["models"] == [] and none["kernels"] == [] and none["inputs_key"] is None


def test_state_table_adds_the_rprogram_decisions_where_the_prepare_formed_them():
    manifest = {"models": [
        {"name": "m1", "decisive": ["a"], "measured": 1,
         "rprograms": {"formed": 4, "measured": 1, "unmeasurable": 0, "candidates": 3, "built": 2,
                       "left": 1}},
        {"name": "m2", "decisive": ["b", "c"], "measured": 0, "rprograms": None}]}
    rows = kernel_results.state_table(manifest, per_lease=4)
    assert rows[0]["leases_left"] == 0 + 3 and rows[1]["leases_left"] == 1  # 3 slots an rProgram
    text = kernel_results.state_markdown(rows, per_lease=4)
    assert "| m1 | 1 | 1 | 0 | 4 | 1 | 3 | 3 |" in text and "| m2 | 2 | 0 | 2 | - | - | - | 1 |" in text
    # after an import (state --facts): a listed candidate with a time there is measured, one
    # without (or another model's, or a kernel record under its key) stays a candidate
    manifest["kernels"] = [{"key": "p1", "role": "rprogram", "model": "m1"},
                           {"key": "p2", "role": "rprogram", "model": "m1"},
                           {"key": "p3", "role": "rprogram", "model": "m2"}]
    device = kernel_results.device_id(FAKE)
    db = JsonProfileDB()
    db.put_many([("rprogram", "p1", device, {"time_us": 3.0}),
                 ("kernel", "p2", device, {"kernel_us": 1.0, "valid": True}),
                 ("kernel", "a", device, {"kernel_us": 1.0, "valid": True})])
    rows = kernel_results.state_table(manifest, db, device, per_lease=4)
    assert rows[0]["rprograms"]["measured"] == 2 and rows[0]["rprograms"]["candidates"] == 2
    assert rows[0]["leases_left"] == 0 + 2 and rows[1]["rprograms"] is None


def test_no_rprogram_is_formed_while_kernels_are_left_for_a_later_lease(recorded, tmp_path,
                                                                       monkeypatch):
    from tvm_rammer.lease import rprograms

    monkeypatch.setattr(kernels, "record_jobs", lambda *args: recorded)
    formed = []
    monkeypatch.setattr(rprograms, "record_rprograms", lambda *args: formed.append(args))
    manifest = kernels.prepare_kernels([SPEC], str(tmp_path / "k"), size_budget_mib=0)
    assert manifest["kernels"] == [] and manifest["left_out"] == len(kernels.entries_of(recorded)[0])
    assert not formed and manifest["models"][0]["rprograms"] is None


def test_the_prepare_hook_prints_the_rprogram_state_per_model(tmp_path, monkeypatch):
    from tvm_rammer.lease import prepare as lease_prepare

    rp = {"formed": 4, "measured": 1, "unmeasurable": 0, "candidates": 3, "built": 2, "left": 1}
    monkeypatch.setattr(kernels, "prepare", lambda *a, **k: {
        "kernels": 9, "libraries": 2, "mib": 0.5, "left_out": 1, "models": [
            {"name": "two_branch", "rprograms": rp, "leases_needed": 2},
            {"name": "branches", "rprograms": None, "leases_needed": None}]})
    lines = []
    spec = lease_prepare.LeaseSpec(models=("two_branch", "branches"), reduced=True)
    lease_prepare._kernels_hook(spec, tmp_path, 120.0, lines.append)
    assert "kernels: two_branch: 4 rPrograms formed, 1 measured, 3 candidates, 2 built, 1 left " \
           "for a later lease; leases needed: 2" in lines
    assert "kernels: branches: rPrograms not formed (no room or time left in this lease)" in lines


def test_fixed_arguments_keep_their_shapes_a_scalar_too(monkeypatch):
    """lease.rprograms._fixed hands the timing each fixed argument as it is: a 0-d one stays 0-d
    (np.ascontiguousarray made it [1], which no kernel parameter of shape () accepts); one over
    FIXED_MAX_BYTES is left out."""
    from types import SimpleNamespace

    from tvm_rammer.lease import rprograms
    from tvm_rammer.tuning import measure

    monkeypatch.setattr(measure, "param_specs", lambda func: [])
    big = np.zeros(rprograms.FIXED_MAX_BYTES // 4 + 1, dtype=np.float32)
    built = SimpleNamespace(func=None, fixed_args=lambda: {
        "pos": np.array(7, dtype=np.int64), "w": np.arange(6.0).reshape(2, 3).T, "big": big})
    got = rprograms._fixed(built)
    assert set(got) == {"pos", "w"}
    assert got["pos"].shape == () and int(got["pos"]) == 7
    assert got["w"].shape == (3, 2) and got["w"].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(got["w"], np.arange(6.0).reshape(2, 3).T)
