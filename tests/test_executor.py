"""The reference executor of the rProgram table: real tables pass, broken ones are reported."""

import json

import numpy as np
import pytest

import tvm_rammer.codegen.tensors as tensors_mod
from tvm_rammer.codegen import executor
from tvm_rammer.config import RammerConfig
from tvm_rammer.codegen.executor import TableError, Task, Wait, check, decode_table, manifests
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.models import REDUCED, get_model

from onnx_builders import random_dag

TARGET = "rammer/nvidia-h100"


def _lowered(model):
    return lower(import_onnx(model), TARGET, RammerConfig(profile=False))


@pytest.fixture(scope="module")
def branches_manifest():
    """The 4-branch GEMV model: four rTasks, then a Sum behind one barrier on three vEUs."""
    found = manifests(_lowered(get_model("branches", **REDUCED["branches"])))
    assert len(found) == 1
    return found[0]


def _with_table(manifest, table):
    broken = json.loads(json.dumps(manifest))
    broken["table"] = [int(x) for x in table]
    return broken


def _first_wait(manifest):
    """(table index of the first barrier-rTask instruction, its vEU)."""
    v = manifest["num_veus"]
    table = manifest["table"]
    for veu in range(v):
        for i in range(table[veu], table[veu + 1]):
            at = v + 1 + 4 * i
            if table[at] == executor.BARRIER_KIND:
                return at, veu
    raise AssertionError("no barrier-rTask in this table")


def test_manifest_is_json_and_matches_the_table(branches_manifest):
    m = branches_manifest
    prog = decode_table(m["table"], m["num_veus"])
    tasks = [item for items in prog for item in items if isinstance(item, Task)]
    assert len(tasks) == sum(op["num_rtasks"] for op in m["ops"].values()) == 5
    assert sum(isinstance(item, Wait) for items in prog for item in items) >= 1
    assert json.loads(json.dumps(m)) == m


def test_real_tables_pass_every_interleaving(branches_manifest):
    assert check(branches_manifest, trials=20) == []
    stats = executor.execute(branches_manifest, 0)
    assert stats["rtasks"] == 5 and stats["waits"] >= 1


@pytest.mark.parametrize("model", [
    lambda: get_model("nasbench_cell", **REDUCED["nasbench_cell"]),
    lambda: get_model("lstm_tc", **REDUCED["lstm_tc"]),
    lambda: random_dag(3, num_ops=14, hidden=64),
])
def test_lowered_models_pass(model):
    found = manifests(_lowered(model()))
    assert found
    for m in found:
        assert check(m, trials=10) == [], m["kernel"]


def test_a_dropped_wait_is_a_race(branches_manifest):
    at, _ = _first_wait(branches_manifest)
    table = list(branches_manifest["table"])
    table[at + 2] = 0  # the barrier-rTask now waits for nothing
    problems = check(_with_table(branches_manifest, table), trials=20)
    assert problems and any(p.startswith("race:") for p in problems), problems
    assert "lv8" in " ".join(problems) or "lv9" in " ".join(problems) or "lv1" in " ".join(problems)


def test_a_wait_for_a_step_nobody_publishes_deadlocks(branches_manifest):
    at, veu = _first_wait(branches_manifest)
    table = list(branches_manifest["table"])
    pair = table[at + 1]
    table[pair + 1] = 99  # wait for step 99 of that vEU: it never gets there
    problems = check(_with_table(branches_manifest, table), trials=3)
    assert problems and all(p.startswith("deadlock:") for p in problems)
    assert f"vEU {veu} at instruction" in problems[0]


def test_an_rtask_run_twice_and_one_never_run_are_reported(branches_manifest):
    m = branches_manifest
    v = m["num_veus"]
    table = list(m["table"])
    prog = decode_table(table, v)
    # vEU 2's only rTask becomes a copy of vEU 1's (same operator, same arena offsets)
    src, dst = v + 1 + 4 * table[1], v + 1 + 4 * table[2]
    assert isinstance(prog[1][0], Task) and isinstance(prog[2][0], Task)
    table[dst: dst + 4] = table[src: src + 4]
    problems = check(_with_table(m, table))
    assert any("appears twice" in p for p in problems)
    assert any("never run" in p for p in problems)


def test_overlapping_arena_tensors_are_reported(monkeypatch):
    """A planner bug that puts every intermediate tensor at offset 0 of the work arena."""
    real = tensors_mod._layout

    def overlapping(tensors):
        offsets, size = real(tensors)
        if tensors and not tensors[0].is_constant:
            offsets = {t: 0 for t in tensors}
        return offsets, size

    monkeypatch.setattr(tensors_mod, "_layout", overlapping)
    found = manifests(_lowered(get_model("branches", **REDUCED["branches"])))
    problems = check(found[0], trials=4)
    assert problems and any(p.startswith("arena overlap:") for p in problems), problems


def test_a_write_to_an_input_is_reported(branches_manifest):
    m = json.loads(json.dumps(branches_manifest))
    out = next(tid for tid, t in m["tensors"].items() if m["slots"][t["slot"]]["role"] == "output")
    m["slots"][m["tensors"][out]["slot"]]["role"] = "input"
    assert any("read-only" in p for p in check(m, trials=1))


@pytest.mark.parametrize("table, message", [
    ([0, 1, -3, 0, 0, 0], "unknown instruction kind"),
    ([0, 2, 1, 0, 0, 0], "instructions need"),
    ([1, 0], "not non-decreasing"),
    ([0, 1, 0, 99, 1, 0], "outside the table"),
])
def test_malformed_tables_are_refused(table, message):
    with pytest.raises(TableError, match=message):
        decode_table(np.array(table), 1)
