"""Persistent kernels built side by side (issue 21: the first compile on a GPU host). Timing an
rProgram builds its persistent kernel (TVM codegen and nvcc, ~1-2 s each) then runs it; the
policy's comparisons ask for two or three plans at a time and every final rProgram is timed. The
policy now names a comparison's plans to the profiler first (``profile.prefetch``), which starts
their builds (``Profiler.prebuild`` -> ``CudaDevice.prebuild``), then asks for each; the final
rPrograms' builds all start before the first is timed. Choices do not change: only when builds
start."""
import pytest

from fake_device import FakeDevice
from tvm_rammer.scheduling import policy
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.host.gpu import DeviceId, LocalGPU
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.tuning.measure import CudaDevice
from tvm_rammer.tuning.profile_db import open_profile_db
from tvm_rammer.tuning.profiler import Profiler, plan_key

from conftest_tir import TARGET, scheduled_kernel


class PrebuildingDevice(FakeDevice):
    """A fake device with a ``prebuild``: which kernels were started early, and whether each
    timed kernel's build had been started, and how many builds ran at once at most."""

    def __init__(self, **kwargs):
        super().__init__(rprogram_us=lambda func: 5.0 + len(func.script()) % 97, **kwargs)
        self.started_early, self.timed_early, self.timed_late = [], 0, 0
        self.most_at_once = 0
        self.final = False  # set when the back end checks its final rPrograms

    def prebuild(self, func):
        self.started_early.append(func)
        if not self.final:  # during the policy: the plans of one comparison
            self.most_at_once = max(self.most_at_once, len(self.started_early) - self.timed_early)

    def time_kernel(self, func, fixed, within_s=None):
        if any(f is func for f in self.started_early):
            self.timed_early += 1
        else:
            self.timed_late += 1
        return super().time_kernel(func, fixed, within_s)


class PlainDevice(FakeDevice):
    """The control: the same times, no prebuild."""

    def __init__(self, **kwargs):
        super().__init__(rprogram_us=lambda func: 5.0 + len(func.script()) % 97, **kwargs)


@pytest.fixture(scope="module")
def alexnet():
    return import_onnx(get_model("alexnet", **REDUCED["alexnet"]))


def compile_with(model, device, path):
    profiler = Profiler(open_profile_db(path), device, "sm_90a", margin=1.25, rprogram_budget=8)
    return inspect_model(model, "rammer/nvidia-h100", RammerConfig(), profiler)


def test_every_timed_persistent_kernel_was_built_early_and_the_choices_are_the_same(alexnet, tmp_path,
                                                                                  monkeypatch):
    from tvm_rammer.driver import backend

    early = PrebuildingDevice()
    real_policy = backend.get_policy

    def get_policy(name):  # once the policy has returned, the final rPrograms are built
        def policy_then_final(*args):
            plans = real_policy(name)(*args)
            early.final = True
            return plans
        return policy_then_final

    monkeypatch.setattr(backend, "get_policy", get_policy)
    summary = compile_with(alexnet, early, str(tmp_path / "early.json"))
    plain = PlainDevice()
    control = compile_with(alexnet, plain, str(tmp_path / "plain.json"))
    assert summary == control  # the same plans, kernels and times: only the builds moved
    assert early.rprograms == plain.rprograms > 2
    assert early.timed_early == early.rprograms and early.timed_late == 0
    assert len(early.started_early) == early.rprograms  # none started that was not timed
    assert early.most_at_once >= 2  # a comparison's plans built side by side, in the policy


def test_merge_pays_names_the_plans_before_it_asks_and_decides_the_same(monkeypatch):
    calls = []

    def profile(result):
        calls.append(("ask", id(result)))
        return 10.0 if len(calls) % 2 else 3.0

    def prefetch(result):
        calls.append(("prefetch", id(result)))

    profile.prefetch = prefetch

    class Plan:  # the parts of a PartialPlan that _merge_pays and its helpers read
        def __init__(self, us):
            self.us = us

        def analytic_time_us(self, cost):
            return self.us

    monkeypatch.setattr(policy, "materialize", lambda plan, graph, config, prof=None: type(
        "R", (), {"predicted_us": plan.us, "profiled": False})())
    config = policy.PolicyConfig(profile_margin=None)
    with_prefetch = policy._merge_pays(Plan(1.0), Plan(1.0), Plan(1.0), None, config, profile)
    assert [c[0] for c in calls] == ["prefetch"] * 3 + ["ask"] * 3
    assert [c[1] for c in calls[:3]] == [c[1] for c in calls[3:]]  # the same plans, in order
    del profile.prefetch  # control: a profile without prefetch is asked the same
    calls.clear()
    assert policy._merge_pays(Plan(1.0), Plan(1.0), Plan(1.0), None, config, profile) == with_prefetch
    assert [c[0] for c in calls] == ["ask"] * 3


def test_prefetch_starts_nothing_the_budget_would_not_time(tmp_path):
    started = []

    def build_and_time(plan):
        return 5.0

    build_and_time.start_build = started.append
    profiler = Profiler(open_profile_db(str(tmp_path / "db.json")), FakeDevice(), "sm_90a",
                        rprogram_budget=2)
    plans = [policy.RProgramPlan(program=policy.RProgram(n), ops=[], selected={}, reason={},
                                 veus_per_sm=1, num_veus=n, predicted_us=1.0, waves=[], op_finish={})
             for n in (1, 2, 3)]
    profile = profiler.plan_profile(None, build_and_time)
    for plan in plans:
        profile.prefetch(plan)
    assert started == plans[:2]  # rprogram_budget 2: the third would be analytical
    asked_first = policy.RProgramPlan(program=policy.RProgram(4), ops=[], selected={}, reason={},
                                      veus_per_sm=1, num_veus=4, predicted_us=1.0, waves=[],
                                      op_finish={})
    fresh = profiler.plan_profile(None, build_and_time)
    profiler.rprogram_budget = 8
    fresh(asked_first)
    fresh.prefetch(asked_first)  # asked (and measured) before it was named: nothing to build
    assert started == plans[:2]
    recorded = Profiler(open_profile_db(str(tmp_path / "db.json")), FakeDevice(), "sm_90a",
                        rprogram_budget=8).plan_profile(None, build_and_time)
    recorded.prefetch(asked_first)  # a record exists (measured above): nothing to build
    assert started == plans[:2]
    recorded.prefetch(plans[2])  # the control: a plan with none is built
    assert started == plans


def test_a_prebuilt_kernel_is_timed_from_its_build(monkeypatch):
    """CudaDevice.time_kernel of a prebuilt kernel waits for that build (no second build); two
    prebuilds are both submitted before either is waited for. Control: time_kernel alone builds."""
    import fake_builds

    from tvm_rammer.tuning import measure

    monkeypatch.setattr(measure, "_build_worker", fake_builds.build)
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=2)
    monkeypatch.setattr(device, "_run", lambda fn, *args, deadline=None: 7.0)
    try:
        a, b, c = (scheduled_kernel(m) for m in ("matmul", "gemv", "add"))
        device.prebuild(a)
        device.prebuild(b)
        assert device.batches == 2  # both builds submitted, nothing waited for yet
        assert device.time_kernel(a, {}) == 7.0
        assert device._prebuilt[id(b)][1].future.done()  # a was timed with no build beside it
        assert device.time_kernel(b, {}) == 7.0
        assert device.batches == 2
        assert device.time_kernel(c, {}) == 7.0 and device.batches == 3  # control: built then
        assert device.time_kernel(a, {}) == 7.0 and device.batches == 4  # a prebuild is used once
        device.prebuild(c)
        device.drop_prebuilt()  # not timed: forgotten
        assert device._prebuilt == {}
        assert device.time_kernel(c, {}) == 7.0 and device.batches == 6
    finally:
        device.close()
