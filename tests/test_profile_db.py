"""Profile database and profiler: measure once, then read; analytical without a GPU."""
import json

import pytest

from conftest_tir import TARGET, scheduled_kernel
from tir_templates.prelower import prelower
from tvm_rammer.rtask import RKernel, ROperator
from tvm_rammer.policy import OpGraph, PolicyConfig, schedule
from tvm_rammer.tuning.profile_db import FORMAT, ProfileDB
from tvm_rammer.tuning.profiler import Profiler, plan_key, rprogram_profile, rtask_time
from tvm_rammer.tuning.versions import KernelVersion, func_key
from tvm_rammer.vdevice import VDevice

H100 = VDevice.for_arch("sm_90")
DEVICE = "NVIDIA H100 80GB HBM3"


def version(model):
    func = scheduled_kernel(model)
    return KernelVersion(model, "dlight", func, prelower(func, TARGET, model))


class FakeMeasure:
    """Counts calls; a kernel 'takes' 10 us per 100 rTasks."""

    def __init__(self):
        self.calls = 0

    def __call__(self, func, lowered):
        self.calls += 1
        return {"kernel_us": 10.0 * max(1, lowered.num_rtasks / 100), "registers": 40, "shared_bytes": 0}


@pytest.fixture(scope="module")
def two_versions():
    return [version("matmul"), version("gemv")]


def test_second_compile_reads_the_database_and_measures_nothing(tmp_path, two_versions):
    path = str(tmp_path / "profile.json")
    fake = FakeMeasure()
    first = Profiler(ProfileDB.load(path), TARGET, measure=fake, device=DEVICE)
    timings = first.timings(two_versions, H100, analytical=lambda v: 99.0)
    assert fake.calls == 2 and [t.source for t in timings] == ["profiled", "profiled"]
    first.db.save()
    data = json.loads(open(path).read())
    assert data["format"] == FORMAT and data["devices"][DEVICE]["arch"] == "sm_90a"
    assert set(data["devices"][DEVICE]["kernels"]) == {v.key for v in two_versions}

    again = FakeMeasure()
    second = Profiler(ProfileDB.load(path), TARGET, measure=again, device=DEVICE)
    reread = second.timings(two_versions, H100, analytical=lambda v: 99.0)
    assert again.calls == 0 and [t.source for t in reread] == ["database", "database"]
    assert [t.rtask_us for t in reread] == [t.rtask_us for t in timings]
    assert second.summary() == {"device": DEVICE, "profiled": 0, "database": 2, "analytical": 0}


def test_the_key_is_the_structural_hash_and_the_device(two_versions):
    db = ProfileDB()
    matmul = two_versions[0]
    db.put_kernel(func_key(scheduled_kernel("matmul")), DEVICE, {"kernel_us": 5.0}, "sm_90")
    assert db.kernel(matmul.key, DEVICE) == {"kernel_us": 5.0}
    assert db.kernel(matmul.key, "NVIDIA A100-SXM4-80GB") is None
    assert db.kernel(two_versions[1].key, DEVICE) is None


def test_without_gpu_the_device_of_the_targets_arch_is_used(tmp_path, two_versions):
    db = ProfileDB(str(tmp_path / "p.json"))
    for v in two_versions:
        db.put_kernel(v.key, DEVICE, {"kernel_us": 3.0, "registers": 32}, "sm_90")
    profiler = Profiler(db, TARGET, use_gpu=False)  # sm_90a target, no device name given
    assert profiler.device == DEVICE
    assert [t.source for t in profiler.timings(two_versions, H100, lambda v: 1.0)] == ["database"] * 2


def test_an_operator_with_an_unknown_version_is_timed_analytically_throughout(two_versions):
    db = ProfileDB()
    db.put_kernel(two_versions[0].key, DEVICE, {"kernel_us": 3.0}, "sm_90")
    profiler = Profiler(db, TARGET, use_gpu=False, device=DEVICE)
    timings = profiler.timings(two_versions, H100, analytical=lambda v: 7.0)
    assert [(t.source, t.rtask_us) for t in timings] == [("analytical", 7.0)] * 2
    assert profiler.counts["analytical"] == 2


def test_rtask_time_divides_by_the_rounds_of_thread_blocks():
    # 1,024 blocks of 256 threads: 8 per SM on 132 SMs = 1,056 at once -> one round
    assert rtask_time(10.0, 1024, 256, 32, 0, H100) == 10.0
    # 1,024 threads per block: 2 per SM -> 264 at once -> 4 rounds
    assert rtask_time(10.0, 1024, 1024, 32, 0, H100) == 2.5


def test_bad_database_files_say_what_to_do(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON.*--profile-db"):
        ProfileDB.load(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="has format 'other'"):
        ProfileDB.load(str(bad))
    with pytest.raises(ValueError, match="needs a path"):
        ProfileDB().save()


def test_rprogram_times_are_measured_once_and_feed_the_policy():
    kernels = [RKernel("fast", 1024, 256, 32, 0, 0.5, "t"), RKernel("eff", 16, 256, 32, 0, 7.0, "t")]
    graph = OpGraph(ops={i: ROperator(i, f"mm{i}", list(kernels)) for i in range(4)}, preds={},
                    waves=[[0, 1, 2, 3]])
    db, calls = ProfileDB(), []

    def build_and_time(plan):
        calls.append(plan_key(plan, graph))
        return 1.0 + sum(graph.ops[o].kernels[i].num_rtasks for o, i in plan.selected.items()) / 1000

    profile = rprogram_profile(graph, build_and_time, db, DEVICE, "sm_90")
    (plan,) = schedule(graph, H100, PolicyConfig(), profile)
    assert plan.profiled and calls and len(calls) == len(set(calls))
    before = len(calls)
    (again,) = schedule(graph, H100, PolicyConfig(), rprogram_profile(graph, None, db, DEVICE))
    assert len(calls) == before and again.profiled and again.predicted_us == plan.predicted_us
