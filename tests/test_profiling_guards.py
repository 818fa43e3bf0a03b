"""The GPU path degrades, never aborts or hangs (issue 21, defects 1, 3, 4, 9, 11), checked on CPU
with fake devices, monkeypatched workers and databases that refuse writes.

Each test names the defect it catches; every one fails on the code before the fix."""
import concurrent.futures as cf
import dataclasses
import logging
import os
import sqlite3
import subprocess
import sys
import threading

import numpy as np
import pytest
import tvm

import fake_device
from fake_device import FakeDevice
from tvm_rammer.config import RammerConfig
from tvm_rammer.host.gpu import DeviceId, LocalGPU
from tvm_rammer.tuning import measure
from tvm_rammer.tuning.measure import CudaDevice, KernelJob, tolerance_for
from tvm_rammer.tuning.profile_db import JsonProfileDB, open_profile_db
from tvm_rammer.tuning.profiler import Profiler, decisive_jobs, is_failure, plan_key

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
DEV = FakeDevice().id
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(key, op="op", version="dlight", predicted=None):
    return KernelJob(key, f"{op}:{version}", None, None, f"{op}-ref", 1, operator=op,
                     predicted_us=predicted, base=version == "dlight")


class _FailingDevice(FakeDevice):
    """Measures like FakeDevice, except that ``fail(job)`` jobs come back as failures."""

    def __init__(self, fail, reason="run failed: RuntimeError: CUDA: illegal address", **kw):
        super().__init__(**kw)
        self.fail, self.reason = fail, reason

    def measure_kernels(self, jobs, progress, within_s=None):
        records = super().measure_kernels(jobs, progress, within_s)
        return [{"valid": False, "error": None, "reason": self.reason} if self.fail(j) else r
                for j, r in zip(jobs, records)]


# --- defect 3: failures are never cached as facts -----------------------------------------------

@pytest.mark.parametrize("reason", ["run failed: RuntimeError: CUDA: illegal address",
                                    "build failed: RuntimeError: nvcc", "timed out: no result"])
def test_a_failed_measurement_is_not_written_and_the_next_compile_measures_again(tmp_path, reason):
    path = str(tmp_path / "p.sqlite")
    first = Profiler(open_profile_db(path), _FailingDevice(lambda j: j.key == "a", reason), "sm_90a")
    first.prepare([_job("a"), _job("b", op="other")])
    record, _ = first.kernel("a")
    assert is_failure(record)  # this compilation: the operator keeps TVM's default kernel
    db = open_profile_db(path)
    assert db.get("kernel", "a", DEV) is None and db.get("kernel", "b", DEV) is not None
    again = FakeDevice()
    second = Profiler(open_profile_db(path), again, "sm_90a")
    second.prepare([_job("a"), _job("b", op="other")])
    assert again.measured == ["op:dlight"]  # measured again; b came from the database
    assert second.kernel("a")[0]["valid"] is True


def test_a_failure_an_older_version_cached_is_measured_again(tmp_path):
    db = JsonProfileDB(str(tmp_path / "old.json"))
    db.put("kernel", "a", DEV, {"valid": False, "error": None, "reason": "run failed: illegal address"})
    db.flush()
    device = FakeDevice()
    profiler = Profiler(JsonProfileDB(str(tmp_path / "old.json")), device, "sm_90a")
    profiler.prepare([_job("a")])
    assert device.measured == ["op:dlight"] and profiler.kernel("a")[0]["valid"] is True
    assert Profiler(JsonProfileDB(str(tmp_path / "old.json")), None, "sm_90a").kernel("a")[0]["valid"]


def test_a_wrong_output_is_a_fact_and_stays_cached(tmp_path):
    """The negative control: a version measured wrong is not a failure of the measurement."""
    path = str(tmp_path / "p.json")
    first = Profiler(open_profile_db(path), FakeDevice(wrong=lambda j: True), "sm_90a")
    first.prepare([_job("a")])
    first.flush()
    assert open_profile_db(path).get("kernel", "a", DEV)["valid"] is False


def test_a_dlight_failure_makes_an_ordinary_kernel_now_and_not_in_the_next_compile(tmp_path):
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.driver.report import unplaced_operators

    mod = import_onnx(get_model("branches", **REDUCED["branches"]))
    config = RammerConfig(profile_db=str(tmp_path / "p.sqlite"), profile_margin=None)
    failing = _FailingDevice(lambda j: j.label.endswith(":dlight"))
    first = lower(mod, "rammer/nvidia-h100", config,
                  Profiler(open_profile_db(config.profile_db), failing, "sm_90a"))
    reasons = [u["reason"] for u in unplaced_operators(first)]
    assert any("could not be measured" in r for r in reasons)
    second = lower(mod, "rammer/nvidia-h100", config,
                   Profiler(open_profile_db(config.profile_db), FakeDevice(), "sm_90a"))
    assert not any("could not be measured" in u["reason"] or "differs" in u["reason"]
                   for u in unplaced_operators(second))


def test_a_device_that_raises_costs_one_warning_not_the_compile(caplog):
    class Raising(FakeDevice):
        def measure_kernels(self, jobs, progress, within_s=None):
            raise RuntimeError("the driver went away")

        def time_kernel(self, func, fixed, within_s=None):
            raise RuntimeError("the driver went away")

    profiler = Profiler(JsonProfileDB(), Raising(), "sm_90a")
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        profiler.prepare([_job("a"), _job("b")])
        assert profiler.rprogram_time("p", lambda: Raising().time_kernel(None, {})) == (None, None)
    assert is_failure(profiler.kernel("a")[0])
    assert not profiler.db.dirty  # nothing written
    assert len([r for r in caplog.records if "driver went away" in r.getMessage()]) == 2


# --- a database that refuses writes (locked, read-only, full) -----------------------------------

def _locked_sqlite(path):
    db = open_profile_db(path)
    db._conn.execute("PRAGMA busy_timeout = 50")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    return db, holder


@pytest.mark.parametrize("kind", ["locked", "read-only", "full"])
def test_a_database_that_refuses_writes_costs_one_warning(tmp_path, caplog, kind):
    holder = None
    if kind == "locked":
        db, holder = _locked_sqlite(str(tmp_path / "p.sqlite"))
    elif kind == "read-only":
        JsonProfileDB(str(tmp_path / "p.json")).flush()
        (tmp_path / "p.json").write_text('{"format": "tvm-rammer-profile-db/2", "devices": {}}')
        db = JsonProfileDB(str(tmp_path / "p.json"), readonly=True)
    else:
        db = JsonProfileDB(str(tmp_path / "p.json"))

        def full(*_args):
            raise OSError(28, "No space left on device")
        db.flush = full
    try:
        device = FakeDevice()
        profiler = Profiler(db, device, "sm_90a")
        with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
            profiler.prepare([_job("a"), _job("b", op="other")])
            assert profiler.rprogram_time("p", lambda: 7.0) == (7.0, "profiled")
            profiler.close()
    finally:
        if holder is not None:
            holder.execute("ROLLBACK")
    assert profiler.kernel("a")[0]["kernel_us"] == 10.0  # kept in memory for this compile
    assert profiler.rprogram_time("p", None) == (7.0, "profiled")
    assert len([r for r in caplog.records if "not writable" in r.getMessage()]) == 1


# --- defect 1: per-batch flush, the budget, measuring only what can change a decision -----------

def test_a_killed_compile_keeps_every_batch_measured_before_it(tmp_path, monkeypatch):
    from tvm_rammer.tuning import profiler as profiler_mod

    monkeypatch.setattr(profiler_mod, "BATCH_JOBS", 2)

    class Killed(FakeDevice):
        def measure_kernels(self, jobs, progress, within_s=None):
            if any(j.operator == "op3" for j in jobs):
                raise KeyboardInterrupt  # the run is killed during the third batch
            return super().measure_kernels(jobs, progress, within_s)

    path = str(tmp_path / "p.json")
    profiler = Profiler(JsonProfileDB(path), Killed(), "sm_90a")
    jobs = [_job(f"{op}-{v}", op=f"op{op}", version=v) for op in (1, 2, 3) for v in ("dlight", "t")]
    with pytest.raises(KeyboardInterrupt):
        profiler.prepare(jobs)
    on_disk = JsonProfileDB(path)  # what a new process reads: nothing of the killed batch lost
    assert all(on_disk.get("kernel", f"{op}-{v}", DEV) for op in (1, 2) for v in ("dlight", "t"))
    assert on_disk.get("kernel", "3-dlight", DEV) is None


def test_past_the_budget_nothing_more_is_measured_with_one_warning(caplog):
    device = FakeDevice()
    profiler = Profiler(JsonProfileDB(), device, "sm_90a", budget_s=0.0)
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        profiler.prepare([_job("a"), _job("b", op="other")])
        assert profiler.rprogram_time("p", lambda: 1.0, force=True) == (None, None)
        profiler.finish()
        profiler.close()
    assert device.measured == [] and profiler.kernel("a") == (None, None)
    (warning,) = [r.getMessage() for r in caplog.records if "profiling budget" in r.getMessage()]
    assert "2 rKernel version(s) of 2 operator(s) (op, other)" in warning
    assert "1 rProgram(s)" in warning


# --- the budget is a deadline: nothing starts after it, what it cuts short is abandoned ----------

def _budget_run(monkeypatch, budget_s, kernel_s=10.0, rprogram_s=30.0):
    """Four operators' jobs in one batch and two rProgram timings on a fake clock: each kernel
    takes ``kernel_s``, each rProgram ``rprogram_s`` seconds of it."""
    from tvm_rammer.tuning import profiler as profiler_mod

    monkeypatch.setattr(profiler_mod, "BATCH_JOBS", 100)  # one batch: the deadline must cut it
    clock = fake_device.FakeClock()
    device = FakeDevice(clock=clock, kernel_s=kernel_s, rprogram_s=rprogram_s)
    profiler = Profiler(JsonProfileDB(), device, "sm_90a", budget_s=budget_s, clock=clock)
    profiler.prepare([_job(f"k{i}", op=f"op{i}") for i in range(4)])
    times = [profiler.rprogram_time(key, lambda: profiler.time_kernel(None, {"rammer_program": 0}),
                                    force=True)[0] for key in ("p1", "p2")]
    return profiler, device, times


def test_past_the_budget_no_build_or_run_starts_and_the_one_cut_short_is_abandoned(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        profiler, device, times = _budget_run(monkeypatch, budget_s=25.0)
        profiler.finish()
        profiler.finish()
    assert all(at < 25.0 for _, at in device.started)  # nothing started past the budget
    assert [what for what, _ in device.started] == ["op0:dlight", "op1:dlight", "op2:dlight"]
    assert device.measured == ["op0:dlight", "op1:dlight"]  # op2 ran past it: abandoned
    assert profiler.kernel("k2") == (None, None) and profiler.kernel("k3") == (None, None)
    assert not any(is_failure(r) for r in profiler._failed.values())  # not measured is not failed
    assert times == [None, None] and device.rprograms == 0
    (warning,) = [r.getMessage() for r in caplog.records if "profiling budget" in r.getMessage()]
    assert "2 rKernel version(s) of 2 operator(s) (op2, op3)" in warning
    assert "2 rProgram(s)" in warning and "--profile-budget" in warning


def test_an_rprogram_build_that_outlives_the_budget_is_abandoned_not_failed(monkeypatch):
    profiler, device, times = _budget_run(monkeypatch, budget_s=55.0)  # kernels end at 40
    assert device.measured == [f"op{i}:dlight" for i in range(4)]
    assert [what for what, at in device.started if what == "rprogram"] == ["rprogram"]  # p2 never starts
    assert times == [None, None] and ("rprogram", "p1") not in profiler._failed
    assert profiler.unmeasured()["rprograms"] == 2


def test_within_the_budget_everything_is_measured_and_nothing_warned(monkeypatch, caplog):
    """The negative control of the two above: the same work under a budget it fits in."""
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        profiler, device, times = _budget_run(monkeypatch, budget_s=200.0)
        profiler.finish()
    assert device.measured == [f"op{i}:dlight" for i in range(4)] and times == [5.0, 5.0]
    assert profiler.unmeasured() == {"kernels": [], "rprograms": 0, "policy": False, "versions": []}
    assert not [r for r in caplog.records if "profiling budget" in r.getMessage()]


def test_the_budget_counts_from_the_compiles_start():
    clock = fake_device.FakeClock(100.0)
    device = FakeDevice(clock=clock)
    late = Profiler(JsonProfileDB(), device, "sm_90a", budget_s=30.0, clock=clock, started=70.0)
    late.prepare([_job("a")])
    assert late.over_budget() and device.started == []
    assert Profiler(JsonProfileDB(), device, "sm_90a", budget_s=30.0, clock=clock).remaining_s() == 30.0


def test_the_pipeline_starts_the_budget_before_its_first_pass(monkeypatch):
    import time

    from tvm_rammer.driver import backend
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model

    seen = []
    real = backend.make_profiler

    def spy(target, config, device=None, started=None):
        seen.append((started, time.monotonic()))
        return real(target, config, device, started)

    monkeypatch.setattr(backend, "make_profiler", spy)
    before = time.monotonic()
    lower(import_onnx(get_model("branches", **REDUCED["branches"])), "rammer/nvidia-h100",
          RammerConfig(profile_db=None))
    ((started, made),) = seen
    assert started is not None and before <= started < made  # the compile's start, not the back end's


def test_a_compile_past_its_budget_finishes_on_predictions_with_one_warning(caplog):
    """The whole back end on a fake clock: each rProgram timing takes 50 s; with a 60 s budget
    nothing starts after 60 s, the policy stops asking for plan times, one warning; without a
    budget (the control) more rPrograms are timed."""
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model

    mod = import_onnx(get_model("branches", **REDUCED["branches"]))

    def compile_with(budget_s, rprogram_budget=32):
        clock = fake_device.FakeClock()
        device = FakeDevice(clock=clock, kernel_s=1.0, rprogram_s=50.0)
        profiler = Profiler(JsonProfileDB(), device, "sm_90a", budget_s=budget_s, clock=clock,
                            margin=None, rprogram_budget=rprogram_budget)
        lower(mod, "rammer/nvidia-h100", RammerConfig(profile_margin=None), profiler)
        return device, profiler

    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        device, profiler = compile_with(60.0)
        spent, _ = compile_with(0.0)  # spent before the back end: no version made, nothing run
    assert spent.started == [] and spent.measured == []
    assert device.started and all(at < 60.0 for _, at in device.started)
    assert profiler.unmeasured()["rprograms"] or profiler.unmeasured()["policy"]
    assert len([r for r in caplog.records if "profiling budget of 60 s spent" in r.getMessage()]) == 1
    (cut,) = [r.getMessage() for r in caplog.records if "profiling budget of 0 s" in r.getMessage()]
    assert "the other versions of" in cut and "not made" in cut
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        free, _ = compile_with(None)
        compile_with(10_000.0, rprogram_budget=1)  # the count of plans runs out, not the time
    assert free.rprograms > device.rprograms
    assert not [r for r in caplog.records if "profiling budget" in r.getMessage()
                or "back end failed" in r.getMessage()]


def test_only_operators_whose_versions_are_close_to_dlight_are_measured():
    jobs = [_job("c1", "close", "dlight", 10.0), _job("c2", "close", "tile", 12.0),
            _job("c3", "close", "slow", 40.0),
            _job("f1", "far", "dlight", 10.0), _job("f2", "far", "tile", 30.0),
            _job("o1", "only", "dlight", 10.0),
            _job("u1", "unknown", "dlight", None), _job("u2", "unknown", "tile", None)]
    kept = [j.key for j in decisive_jobs(jobs, 1.5)]
    assert kept == ["c1", "c2", "u1", "u2"]
    many = [_job("m0", "many", "dlight", 10.0)] + [_job(f"m{k}", "many", f"t{k}", 10.0 - k)
                                                   for k in range(1, 6)]
    assert [j.key for j in decisive_jobs(many, 1.5, max_versions=2)] == ["m0", "m5", "m4"]
    tiny = [_job("t0", "tiny", "dlight", 0.1), _job("t1", "tiny", "x", 0.05)]
    assert [j.key for j in decisive_jobs(many + tiny, 1.5, min_share=0.05)][-1] != "t1"
    assert [j.key for j in decisive_jobs(jobs, None)] == [j.key for j in jobs]


def test_the_policy_times_only_close_choices():
    """Two independent 1-op waves: merging is analytically a clear win or a close call; with a
    margin only the close one asks the profile for times."""
    from tvm_rammer.scheduling.policy import OpGraph, PolicyConfig, schedule
    from tvm_rammer.scheduling.rkernels import ROperator, RKernel
    from tvm_rammer.abstractions.vdevice import VDevice

    vdevice = VDevice(num_sms=132)
    kernels = [RKernel("k", 16, 256, 32, 0, 0.01, "t")]  # launches dominate: merging clearly wins
    graph = OpGraph(ops={i: ROperator(i, f"op{i}", list(kernels)) for i in range(2)},
                    preds={1: [0]}, waves=[[0], [1]])
    calls = []

    def profile(plan):
        calls.append(plan)
        return None

    schedule(graph, vdevice, PolicyConfig(), profile)
    everything = len(calls)
    calls.clear()
    (merged,) = schedule(graph, vdevice, PolicyConfig(profile_margin=1.2), profile)
    assert everything > len(calls) and merged.ops == [0, 1]
    assert calls  # the final plans are still timed (never slower than TVM's default)
    calls.clear()
    profile.active = lambda: False  # a profiler past its budget: no plan comparison asks
    (merged,) = schedule(graph, vdevice, PolicyConfig(), profile)
    assert len(calls) == 1 and merged.ops == [0, 1]  # the final plan only (answered analytically)


# --- defect 9: every wait on the device has a deadline; a dead context restarts the runner ------

@pytest.fixture
def device():
    dev = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90a")), TARGET, build_workers=1,
                     run_timeout_s=20.0)
    yield dev
    dev.close()


def test_a_hung_job_times_out_and_the_runner_is_killed_and_restarted(device):
    first = device._run(fake_device.runner_pid)
    device.run_timeout_s = 3.0
    with pytest.raises(RuntimeError, match="timed out"):
        device._run(fake_device.hang)
    device.run_timeout_s = 60.0
    assert device._run(fake_device.runner_pid) != first


def test_a_dead_cuda_context_restarts_the_runner(device):
    first = device._run(fake_device.runner_pid)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        device._run(fake_device.dead_context)
    assert device._run(fake_device.runner_pid) != first  # a fresh process, a fresh context


def test_a_kernel_that_hangs_is_no_time_and_no_record(device, monkeypatch):
    """time_kernel on a persistent kernel whose run never returns: None, within the deadline."""
    done: cf.Future = cf.Future()
    done.set_result({"path": "/nonexistent.so"})
    monkeypatch.setattr(device, "_submit_build", lambda func, resources: done)
    monkeypatch.setattr(measure, "_time_kernel_worker", fake_device.hang)
    monkeypatch.setattr(measure, "param_specs", lambda func: [])
    device.run_timeout_s = 3.0
    profiler = Profiler(JsonProfileDB(), device, "sm_90a")
    assert profiler.rprogram_time("p", lambda: device.time_kernel(None, {})) == (None, None)
    assert not profiler.db.dirty


def test_a_build_past_the_deadline_is_abandoned_and_no_run_starts(device, monkeypatch):
    import time

    from tvm_rammer.tuning.measure import BudgetSpent

    never: cf.Future = cf.Future()  # a build that does not end (a 10-minute nvcc)
    submitted, ran = [], []
    monkeypatch.setattr(device, "_submit_build", lambda func, resources: submitted.append(func) or never)
    monkeypatch.setattr(device, "_submit_batch", lambda chunk: submitted.append(chunk) or never)
    monkeypatch.setattr(device, "_run", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(measure, "param_specs", lambda func: [])
    jobs = [KernelJob("a", "op:a", "fa", None, None, 1), KernelJob("b", "op:b", "fb", None, None, 1)]
    progress = []
    assert device.measure_kernels(jobs, progress.append, within_s=1.0) == [None, None]
    assert progress == [] and ran == [] and device._builder is None  # abandoned, nothing run
    with pytest.raises(BudgetSpent):
        device.time_kernel("f", {}, within_s=1.0)
    submitted.clear()
    with pytest.raises(BudgetSpent):  # spent: not even a build is submitted
        device.time_kernel("f", {}, within_s=0.0)
    assert device.measure_kernels(jobs, progress.append, within_s=0.0) == [None, None]
    assert submitted == []


def test_a_run_past_the_deadline_is_budget_spent_not_a_timeout(device):
    import time

    from tvm_rammer.tuning.measure import BudgetSpent

    first = device._run(fake_device.runner_pid)
    with pytest.raises(BudgetSpent):
        device._run(fake_device.hang, deadline=time.monotonic() + 2.0)
    assert device._runner is None  # killed; the control: the job's own timeout is a failure
    with pytest.raises(BudgetSpent):
        device._run(fake_device.runner_pid, deadline=time.monotonic() - 1.0)
    assert device._runner is None  # nothing started past the deadline
    device.run_timeout_s = 2.0
    with pytest.raises(RuntimeError, match="timed out"):
        device._run(fake_device.hang, deadline=time.monotonic() + 600.0)
    device.run_timeout_s = 60.0
    assert device._run(fake_device.runner_pid) != first


def test_close_does_not_wait_for_a_hung_job(device):
    device.run_timeout_s = 600.0
    runner = measure._spawn_pool(1)
    device._runner = runner
    measure._submit(runner, fake_device.runner_pid).result(timeout=120)
    measure._submit(runner, fake_device.hang)
    processes = list(runner._processes.values())
    closer = threading.Thread(target=device.close, daemon=True)
    closer.start()
    closer.join(timeout=60)  # a deadline, not a timing: before the fix close() never returned
    assert not closer.is_alive()
    assert not any(p.is_alive() for p in processes)


def test_a_wait_that_gave_up_makes_the_candidate_invalid_without_timing_it(monkeypatch):
    """_time_kernel_worker reads the fault page after the warm-up: a recorded fault raises
    instead of ~100 timed runs that each wait wait_timeout_ms."""
    from tvm_rammer.codegen import faults

    class Array:
        def __init__(self, a):
            self.a = np.array(a)

        def numpy(self):
            return self.a

    def kernel(*args):  # the warm-up run gives up a wait: code 1 in word 0
        for arg in args:
            if arg.a.shape == faults.empty_page().shape and arg.a[-1] == faults.PAGE_MAGIC:
                arg.a[0] = 1

    class Dev:
        def sync(self):
            pass

    timed = []
    monkeypatch.setattr(measure, "_load", lambda path: {measure.ENTRY: kernel})
    monkeypatch.setattr(measure.tvm, "cuda", lambda i=0: Dev())
    monkeypatch.setattr(measure.tvm.runtime, "tensor", lambda a, dev: Array(a))
    monkeypatch.setattr(measure, "_time", lambda *a: timed.append(1) or 1.0)
    specs = [("rammer_program", [4], "int32"), ("rammer_fault_page", [faults.PAGE_WORDS], "int32")]
    with pytest.raises(RuntimeError, match="timed out"):
        measure._time_kernel_worker("k.so", specs, {"rammer_program": np.zeros(4, "int32")}, 20, 5)
    assert timed == []


# --- defect 11: tolerances by dtype; spawn pools and a script without a __main__ guard ----------

def test_half_precision_versions_are_checked_at_their_own_tolerance():
    assert tolerance_for(["float32"]) == 1e-4
    assert tolerance_for(["float16"]) == 1e-2 and tolerance_for(["bfloat16"]) == 2e-2
    assert tolerance_for(["float32", "float16"]) == 1e-2 and tolerance_for([]) == 1e-4


def test_a_script_without_a_main_guard_is_not_run_again_by_the_workers(tmp_path):
    mark = tmp_path / "runs.txt"
    script = tmp_path / "user_script.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
with open({str(mark)!r}, "a") as f:
    f.write("run\\n")
import tvm
import fake_device
from tvm_rammer.host.gpu import DeviceId, LocalGPU
from tvm_rammer.tuning.measure import CudaDevice
device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90a")),
                    tvm.target.Target({{"kind": "cuda", "arch": "sm_90a"}}), run_timeout_s=120)
print("pid", device._run(fake_device.runner_pid))
device.close()
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert mark.read_text().splitlines() == ["run"]  # the user's script ran once, in its process


INJECTED = RammerConfig(wait_timeout_ms=250.0, extra={"inject_unsatisfiable_barrier": True})


def _constants(func):
    import tvm_ffi

    found = []
    tvm_ffi.structural_walk(func, [(type(tvm.relax.const(0)), found.append)])
    return found


# --- defect 4: the injected fault is never timed; the table is part of the rProgram's key -------

def test_the_injected_fault_is_not_in_the_timed_table_but_in_the_emitted_one():
    from tvm_rammer.codegen import faults
    from tvm_rammer.codegen.executor import manifests
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model

    mod = import_onnx(get_model("branches", **REDUCED["branches"]))
    timed = {}

    def run(extra):
        tables = []

        class Recording(FakeDevice):
            def time_kernel(self, func, fixed, within_s=None):
                tables.append(np.array(fixed["rammer_program"]))
                return super().time_kernel(func, fixed, within_s)

        config = dataclasses.replace(INJECTED, extra=extra)
        out = lower(mod, "rammer/nvidia-h100", config,
                    Profiler(JsonProfileDB(), Recording(), "sm_90a"))
        return tables, out

    timed["clean"], clean = run({})
    timed["injected"], injected = run({faults.INJECT_KEY: True})
    assert len(timed["clean"]) == len(timed["injected"]) > 0
    assert all((a == b).all() for a, b in zip(timed["clean"], timed["injected"]))
    (a,), (b,) = manifests(clean), manifests(injected)
    clean_table = np.array(a["table"])
    assert any(t.shape == clean_table.shape and (t == clean_table).all() for t in timed["injected"])
    expected = faults.inject_test_fault(np.array(a["table"], "int32"), a["num_veus"], INJECTED)
    assert (expected != np.array(a["table"])).sum() == 1 and b["table"] == expected.tolist()
    emitted = [c.value.numpy() for c in _constants(injected["main"]) if hasattr(c.value, "numpy")]
    assert any(t.shape == expected.shape and (t == expected).all() for t in emitted)

def test_the_plan_key_changes_with_the_table():
    from tvm_rammer.scheduling.policy import OpGraph, PolicyConfig, schedule
    from tvm_rammer.scheduling.rkernels import ROperator, RKernel
    from tvm_rammer.abstractions.vdevice import VDevice

    graph = OpGraph(ops={0: ROperator(0, "op0", [RKernel("k", 16, 256, 32, 0, 5.0, "t")])},
                    preds={}, waves=[[0]])
    (plan,) = schedule(graph, VDevice(num_sms=132), PolicyConfig())
    table = np.arange(8, dtype=np.int32)
    injected = table.copy()
    injected[3] = 10 ** 9
    assert plan_key(plan, graph) == plan_key(plan, graph)
    assert plan_key(plan, graph, table) != plan_key(plan, graph, injected)
    assert plan_key(plan, graph, table) == plan_key(plan, graph, table.copy())



def test_the_plan_key_is_the_kernels_code_not_the_functions_name():
    """The weights-apart and the embedded build number their operators differently ("reshape5" /
    "reshape"): the same code and program give the same key; other code (hash) another one."""
    from tvm_rammer.scheduling.policy import OpGraph, PolicyConfig, schedule
    from tvm_rammer.scheduling.rkernels import ROperator, RKernel
    from tvm_rammer.abstractions.vdevice import VDevice

    def key(name):
        graph = OpGraph(ops={0: ROperator(0, "op0", [RKernel(name, 16, 256, 32, 0, 5.0, "t")])},
                        preds={}, waves=[[0]])
        (plan,) = schedule(graph, VDevice(num_sms=132), PolicyConfig())
        return plan_key(plan, graph)

    assert key("reshape:dlight#eacf431f") == key("reshape5:dlight#eacf431f")
    assert key("reshape:dlight#eacf431f") != key("reshape:dlight#0123abcd")  # control
    assert key("reshape:dlight#eacf431f") != key("reshape:dlight#eacf431fx2")  # coarsened

# --- the back end as a whole: any failure on a GPU host falls back to TVM's default -------------

def test_a_back_end_failure_while_measuring_falls_back_to_tvms_default(monkeypatch, caplog):
    from tvm_rammer.driver import backend
    from tvm_rammer.driver.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.driver.report import unplaced_operators

    def broken(*_args, **_kw):
        raise MemoryError("cudaMalloc failed")

    monkeypatch.setattr(backend, "build_rprograms", broken)
    mod = import_onnx(get_model("branches", **REDUCED["branches"]))
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        out = lower(mod, "rammer/nvidia-h100", RammerConfig(),
                    Profiler(JsonProfileDB(), FakeDevice(), "sm_90a"))
    assert unplaced_operators(out) and all("cudaMalloc" in u["reason"] for u in unplaced_operators(out))
    assert len([r for r in caplog.records if "rammer back end failed" in r.getMessage()]) == 1
    with pytest.raises(MemoryError):  # without a device the failure is a bug to see
        lower(mod, "rammer/nvidia-h100", RammerConfig(profile=False))


# --- the budget from the command line -----------------------------------------------------------

def test_profile_budget_flag_sets_the_config_and_rejects_nonsense(capsys):
    from tvm_rammer.cli import _config, build_parser

    parse = build_parser().parse_args
    assert _config(parse(["compile", "m.onnx", "-o", "m.so", "--profile-budget", "12.5"])).profile_budget_s == 12.5
    assert _config(parse(["compile", "m.onnx", "-o", "m.so", "--profile-budget", "none"])).profile_budget_s is None
    assert _config(parse(["compile", "m.onnx", "-o", "m.so"])).profile_budget_s == RammerConfig().profile_budget_s
    with pytest.raises(SystemExit):
        parse(["compile", "m.onnx", "-o", "m.so", "--profile-budget", "-3"])
    assert "seconds of measuring allowed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="profile_budget_s=-1"):
        RammerConfig(profile_budget_s=-1)
    with pytest.raises(ValueError, match="profile_margin=0.5"):
        RammerConfig(profile_margin=0.5)


# --- defect 1: GPU tests and the stress run compile without profiling (one small test with) ----

def _compile_calls(path):
    """(enclosing function, profiled?) of every tvm_rammer.compile / CLI compile call in a file."""
    import ast

    tree = ast.parse(open(path, encoding="utf-8").read())
    found = []
    for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        for call in [n for n in ast.walk(func) if isinstance(n, ast.Call)]:
            text = ast.unparse(call)
            if text.startswith("tvm_rammer.compile("):
                found.append((func.name, "UNPROFILED" not in text and "profile=False" not in text))
            elif text.startswith("main([") and "'compile'" in text:
                found.append((func.name, "--no-profile" not in text))
    return found


def test_gpu_tests_and_the_stress_run_compile_without_profiling_but_one():
    gpu = _compile_calls(os.path.join(REPO, "tests", "test_gpu.py"))
    assert len(gpu) >= 5
    assert [name for name, profiled in gpu if profiled] == [
        "test_an_unsatisfiable_barrier_raises_naming_the_veu_and_the_context_survives"]
    stress = _compile_calls(os.path.join(REPO, "tvm_rammer", "checks", "stress.py"))
    assert stress and not any(profiled for _, profiled in stress)


@pytest.mark.parametrize("budget_s", [25.0, None])
def test_making_versions_stops_when_the_budget_runs_out_while_they_are_made(monkeypatch, budget_s):
    """Each operator's versions take 10 s (a fake clock): with a 25 s budget the third operator's
    are made and the others keep their dlight version only (named in unmeasured()["versions"]);
    the control without a budget makes every operator's."""
    from tvm_rammer.driver import backend
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.views.inspection import inspect_model
    from tvm_rammer.models import REDUCED, get_model

    clock = fake_device.FakeClock(0.0)
    made = []
    real = backend.kernel_versions

    def slow(name, target, **kwargs):
        if kwargs.get("unscheduled") is not None:
            made.append(name)
            clock.advance(10.0)
        return real(name, target, **kwargs)

    monkeypatch.setattr(backend, "kernel_versions", slow)
    profiler = Profiler(JsonProfileDB(), FakeDevice(clock=clock), "sm_90a", budget_s=budget_s,
                        clock=clock, started=0.0)
    inspect_model(import_onnx(get_model("alexnet", **REDUCED["alexnet"])), "rammer/nvidia-h100",
                  RammerConfig(), profiler)
    skipped = profiler.unmeasured()["versions"]
    if budget_s is None:
        assert len(made) > 3 and skipped == []
    else:
        assert len(made) == 3 and skipped and not set(skipped) & set(made)
