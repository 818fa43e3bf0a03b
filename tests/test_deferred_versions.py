"""Deferred versions (``tuning.deferred``): a version read from its operator record answers what
the policy weighs (name, key, launch fields) without being scheduled or prelowered, is made once on
the first use of its code, and raises ``LateVersionError`` when what is made is not what the record
says (another kernel, other launch fields, a schedule that no longer applies)."""
import pytest

from conftest_tir import TARGET
from test_tensor_cores import fused16
from tir_templates.mma_templates import MMA_CONFIGS, schedule_gemm_mma
from tvm_rammer.tuning import deferred, versions


@pytest.fixture(scope="module")
def made():
    """(unscheduled func, the eagerly made tensor-core template version: KernelVersion)."""
    func = fused16("matmul")  # the first tensor-core variant of template_schedules' list, alone
    scheduled = schedule_gemm_mma(func, *MMA_CONFIGS[0])  # (all 25: minutes of this machine)
    name = "mma_w{}x{}_f{}x{}_k{}".format(*MMA_CONFIGS[0])
    (version,) = versions.named_versions("op", TARGET, [(name, "template")], scheduled=scheduled,
                                         unscheduled=func)
    return func, version


def deferred_of(made, key=None, **fields):
    func, version = made
    recorded = {**deferred.lowered_fields(version.lowered), **fields}
    return deferred.DeferredVersion("op", version.name, "template", key or version.key, recorded,
                                    TARGET, scheduled=func, unscheduled=func)


def counting(monkeypatch) -> list:
    calls, real = [], versions.prelower
    monkeypatch.setattr(versions, "prelower", lambda f, t, name=None: calls.append(name) or real(f, t, name=name))
    return calls


def test_the_recorded_fields_are_answered_without_making_the_version(made, monkeypatch):
    calls = counting(monkeypatch)
    late = deferred_of(made)
    eager = made[1].lowered
    assert (late.lowered.grid, late.lowered.block, late.lowered.shared_bytes, late.lowered.has_sync,
            late.lowered.num_rtasks, late.lowered.threads, late.lowered.name, late.key) == \
        (eager.grid, eager.block, eager.shared_bytes, eager.has_sync, eager.num_rtasks, eager.threads,
         eager.name, made[1].key)
    assert isinstance(deferred.func_if_made(late), deferred.Unmade)
    assert calls == [] and not late.is_made
    body = late.lowered.body  # the code: made now, once
    assert calls == ["op"] and late.is_made
    assert versions.func_key(late.func) == made[1].key
    assert len(late.lowered.params) == len(eager.params) and body is late.lowered.body
    assert calls == ["op"]
    assert deferred.func_if_made(late) is late.func
    assert deferred.func_if_made(made[1]) is made[1].func  # the control: an eager version


@pytest.mark.parametrize("stale, match", [
    ({"key": "0" * 16}, "is another kernel"),
    ({"shared_bytes": 1}, "other launch fields"),
    ({"has_sync": "flip"}, "other launch fields"),
])
def test_a_version_that_is_not_what_its_record_says_raises_late(made, stale, match):
    fields = {k: v for k, v in stale.items() if k != "key"}
    if fields.get("has_sync") == "flip":
        fields["has_sync"] = not made[1].lowered.has_sync
    late = deferred_of(made, stale.get("key"), **fields)
    assert late.lowered.threads == made[1].lowered.threads  # the recorded fields still answer
    with pytest.raises(deferred.LateVersionError, match=match):
        late.lowered.body
    with pytest.raises(deferred.LateVersionError, match=match):
        late.func


def test_a_schedule_that_fails_late_raises_late(made, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the rule broke")

    monkeypatch.setattr(versions, "version_func", broken)
    with pytest.raises(deferred.LateVersionError, match="the rule broke"):
        deferred_of(made).func
    monkeypatch.setattr(versions, "version_func", lambda *a, **k: None)
    with pytest.raises(deferred.LateVersionError, match="no longer applies"):
        deferred_of(made).lowered.params


def test_made_by_name_knows_the_makers_that_need_no_other_version():
    func = fused16("matmul")
    mma = "mma_w{}x{}_f{}x{}_k{}".format(*MMA_CONFIGS[0])  # a tensor-core variant's name
    assert versions.made_by_name(mma, "template", func, TARGET)
    assert versions.made_by_name("dlight_t64", "dlight", func, TARGET)
    assert not versions.made_by_name("dlight", "dlight", func, TARGET)  # the pipeline's own
    assert not versions.made_by_name("template_that_no_longer_exists", "template", func, TARGET)
    assert not versions.made_by_name("metaschedule_top0", "metaschedule", func, TARGET)


@pytest.mark.parametrize("fields, ok", [
    ({"grid": [2, 1, 1], "block": [128, 1, 1], "shared_bytes": 0, "has_sync": True,
      "volatile_shared": False}, True),
    ({"grid": [2, 1], "block": [128, 1, 1], "shared_bytes": 0, "has_sync": True,
      "volatile_shared": False}, False),
    ({"grid": [2, 1, 1], "block": [128, 1, 1], "shared_bytes": 0, "has_sync": 1,
      "volatile_shared": False}, False),
    ({"grid": [2, 1, 1], "block": [128, 1, 1], "shared_bytes": 0, "has_sync": True}, False),
    (None, False),
])
def test_valid_fields(fields, ok):
    assert deferred.valid_fields(fields) is ok
