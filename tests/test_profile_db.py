"""Profile databases: records keyed by kind, key and device; JSON and sqlite3 stores that lose nothing
under concurrent writers; the per-user cache; the profiler's lookups and measurement batches."""
import json
import multiprocessing
import sqlite3

import pytest

from conftest_tir import TARGET, scheduled_kernel
from fake_device import FakeDevice
from tir_templates.prelower import prelower
from tvm_rammer.host.gpu import DeviceId
from tvm_rammer.scheduling.policy import OpGraph, PolicyConfig, schedule
from tvm_rammer.abstractions.rtask import RKernel, ROperator
from tvm_rammer.tuning.measure import KernelJob
from tvm_rammer.tuning.profile_db import (FORMAT, JsonProfileDB, SqliteProfileDB, default_cache_path,
                                          open_profile_db)
from tvm_rammer.tuning.profiler import Profiler, plan_key, rtask_time
from tvm_rammer.tuning.versions import KernelVersion, func_key
from tvm_rammer.abstractions.vdevice import VDevice

H100 = VDevice.for_arch("sm_90")
DEV = DeviceId("NVIDIA H100 80GB HBM3", "sm_90", "580.159.04")


def version(model):
    func = scheduled_kernel(model)
    return KernelVersion(model, "dlight", func, prelower(func, TARGET, model))


@pytest.fixture(params=["json", "sqlite"])
def db_path(request, tmp_path):
    return str(tmp_path / ("p.json" if request.param == "json" else "p.sqlite"))


def test_records_are_keyed_by_kind_key_and_device(db_path):
    db = open_profile_db(db_path)
    db.put("kernel", "abc", DEV, {"kernel_us": 5.0})
    db.flush()
    again = open_profile_db(db_path)
    assert again.get("kernel", "abc", DEV) == {"kernel_us": 5.0}
    assert again.get("rprogram", "abc", DEV) is None
    assert again.get("kernel", "abc", DeviceId(DEV.name, DEV.arch, "999.0")) is None  # other driver
    assert again.get("kernel", "abd", DEV) is None
    assert again.devices() == [DEV]
    assert again.device_for("sm_90a") == DEV and again.device_for("sm_80") is None
    with pytest.raises(ValueError, match="kind 'kernels'"):
        again.get("kernels", "abc", DEV)


def test_device_keys_round_trip():
    assert DeviceId.from_key(DEV.key) == DEV


def _writer(path, worker, n):
    db = open_profile_db(path)
    for i in range(n):
        db.put_many([("kernel", f"w{worker}-{i}", DEV, {"kernel_us": float(i)}),
                     ("kernel", f"shared-{i}", DEV, {"kernel_us": float(worker)})])
        if i % 10 == 9:
            db.flush()
    db.flush()


@pytest.mark.parametrize("suffix", [".json", ".sqlite"])
def test_concurrent_writers_lose_nothing_and_leave_a_readable_database(tmp_path, suffix):
    path = str(tmp_path / f"cache{suffix}")
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_writer, args=(path, w, 40)) for w in range(6)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
        assert p.exitcode == 0
    db = open_profile_db(path)
    for w in range(6):
        for i in range(40):
            assert db.get("kernel", f"w{w}-{i}", DEV) == {"kernel_us": float(i)}
    assert all(db.get("kernel", f"shared-{i}", DEV)["kernel_us"] in range(6) for i in range(40))
    if suffix == ".json":
        assert json.loads(open(path).read())["format"] == FORMAT
    else:
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_bad_database_files_say_what_to_do(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON.*--profile-db"):
        JsonProfileDB(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="has format 'other'"):
        JsonProfileDB(str(bad))
    notsql = tmp_path / "bad.sqlite"
    notsql.write_text("not a database at all, just text " * 100)
    with pytest.raises(ValueError, match="not a usable sqlite3 file"):
        SqliteProfileDB(str(notsql))
    with pytest.raises(ValueError, match="does not exist"):
        open_profile_db(str(tmp_path / "missing.sqlite"), readonly=True)
    with pytest.raises(ValueError, match="read-only"):
        JsonProfileDB(None, readonly=True).put("kernel", "k", DEV, {})


def test_the_cache_lives_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path() == str(tmp_path / "tvm-rammer" / "profiles.sqlite")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_path().endswith(".cache/tvm-rammer/profiles.sqlite")


def _jobs(versions):
    return [KernelJob(v.key, f"op:{v.name}", v.func, v.func, v.key + "ref", 1) for v in versions]


def test_a_second_profiler_on_the_same_database_measures_nothing(tmp_path):
    versions = [version("matmul"), version("gemv")]
    path = str(tmp_path / "profiles.sqlite")
    fake = FakeDevice(name=DEV.name)
    first = Profiler(open_profile_db(path), fake, "sm_90a")
    first.prepare(_jobs(versions))
    assert len(fake.measured) == 2
    assert [first.kernel(v.key)[1] for v in versions] == ["profiled", "profiled"]
    assert first.default_time([v.key + "ref" for v in versions]) == 20.0

    again = FakeDevice(name=DEV.name)
    second = Profiler(open_profile_db(path), again, "sm_90a")
    second.prepare(_jobs(versions))
    assert again.measured == []
    assert [second.kernel(v.key)[1] for v in versions] == ["database", "database"]
    assert second.summary()["database"] == 2


def test_without_a_device_records_of_the_targets_arch_are_read(tmp_path):
    versions = [version("matmul")]
    db = JsonProfileDB(str(tmp_path / "p.json"))
    db.put("kernel", versions[0].key, DEV, {"kernel_us": 3.0, "valid": True})
    profiler = Profiler(db, None, "sm_90a")
    assert profiler.device_id == DEV and not profiler.measures
    assert profiler.kernel(versions[0].key) == ({"kernel_us": 3.0, "valid": True}, "database")
    assert Profiler(db, None, "sm_80").kernel(versions[0].key) == (None, None)


def test_shipped_databases_are_read_only_where_the_database_has_nothing(tmp_path):
    shipped = JsonProfileDB(str(tmp_path / "h100.json"))
    shipped.put("kernel", "k", DEV, {"kernel_us": 3.0, "valid": True})
    shipped.flush()
    ro = JsonProfileDB(str(tmp_path / "h100.json"), readonly=True)
    empty = JsonProfileDB()
    assert Profiler(empty, None, "sm_90a", readonly=[ro]).kernel("k")[1] == "shipped"
    own = JsonProfileDB()
    own.put("kernel", "other", DEV, {"kernel_us": 1.0, "valid": True})
    assert Profiler(own, None, "sm_90a", readonly=[ro]).kernel("k") == (None, None)  # one source


def test_rtask_time_divides_by_the_rounds_of_thread_blocks():
    # 1,024 blocks of 256 threads: 8 per SM on 132 SMs = 1,056 at once -> one round
    assert rtask_time(10.0, 1024, 256, 32, 0, H100) == 10.0
    # 1,024 threads per block: 2 per SM -> 264 at once -> 4 rounds
    assert rtask_time(10.0, 1024, 1024, 32, 0, H100) == 2.5


def test_rprogram_times_are_measured_once_within_the_budget_and_feed_the_policy():
    kernels = [RKernel("fast", 1024, 256, 32, 0, 0.5, "t"), RKernel("eff", 16, 256, 32, 0, 7.0, "t")]
    graph = OpGraph(ops={i: ROperator(i, f"mm{i}", list(kernels)) for i in range(4)}, preds={},
                    waves=[[0, 1, 2, 3]])
    db, calls = JsonProfileDB(), []

    def build_and_time(plan):
        calls.append(plan_key(plan, graph))
        return 1.0 + sum(graph.ops[o].kernels[i].num_rtasks for o, i in plan.selected.items()) / 1000

    profiler = Profiler(db, FakeDevice(name=DEV.name), "sm_90a")
    (plan,) = schedule(graph, H100, PolicyConfig(), profiler.plan_profile(graph, build_and_time))
    assert plan.profiled and calls and len(calls) == len(set(calls))
    before = len(calls)
    reread = Profiler(db, FakeDevice(name=DEV.name), "sm_90a")
    (again,) = schedule(graph, H100, PolicyConfig(), reread.plan_profile(graph, build_and_time))
    assert len(calls) == before and again.profiled and again.predicted_us == plan.predicted_us

    broke = Profiler(JsonProfileDB(), FakeDevice(name=DEV.name), "sm_90a", rprogram_budget=1)
    (limited,) = schedule(graph, H100, PolicyConfig(), broke.plan_profile(graph, build_and_time))
    assert len(calls) == before + 1 and broke.rprogram_budget == 0


def test_func_key_is_the_structural_hash():
    assert func_key(scheduled_kernel("matmul")) == func_key(scheduled_kernel("matmul"))
    assert func_key(scheduled_kernel("matmul")) != func_key(scheduled_kernel("gemv"))
