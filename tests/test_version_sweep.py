"""scripts/version_sweep.py: every version of a small model checked on the CPU, and its check fails
on a version that computes the wrong thing (the write-back defect of spatial_t128x4, rebuilt here)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tvm import s_tir

from test_spatial_template import pool, unscheduled
from tir_templates.serial_run import run_on_cpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "version_sweep.py"


def _sweep_module():
    spec = importlib.util.spec_from_file_location("version_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_back_under_thread_loop(func, threads, per):
    """The spatial schedule as it was before the fix: the local buffer written back under the thread
    loop (whole 7x7 planes per thread when ``per`` does not divide them)."""
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("pool_max")
    fused = sch.fuse(*sch.get_loops(block)[:4])
    bx, tx, vec = sch.split(fused, factors=[None, threads, per])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    local = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(local, tx)
    sch.decompose_reduction(block, vec)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def test_the_check_finds_a_write_back_that_covers_other_threads_outputs():
    sweep = _sweep_module()
    func = unscheduled(pool, (1, 12, 14, 14))
    arrays = sweep.seeded_inputs(func)
    reference = run_on_cpu(func, arrays)
    err, reason = sweep.check(write_back_under_thread_loop(func, 128, 4), arrays, reference)
    assert reason == "" and err > 100 * sweep.KERNEL_TOLERANCE
    # the same schedule on 8x8 planes (4 divides them) was right, and the check says so
    func = unscheduled(pool, (1, 12, 16, 16))
    arrays = sweep.seeded_inputs(func)
    err, _ = sweep.check(write_back_under_thread_loop(func, 128, 4), arrays, run_on_cpu(func, arrays))
    assert err == 0.0


def test_the_error_compares_non_finite_references_elementwise():
    sweep = _sweep_module()
    want = [np.array([1.0, np.nan, np.inf], "float32")]
    assert sweep.max_rel_err([want[0].copy()], want) == 0.0
    assert sweep.max_rel_err([np.array([1.0, 2.0, np.inf], "float32")], want) == float("inf")
    assert sweep.max_rel_err([np.array([1.5, np.nan, np.inf], "float32")], want) == pytest.approx(0.5)


def test_run_on_cpu_names_a_parameter_that_does_not_match():
    func = unscheduled(pool, (1, 2, 4, 4))
    with pytest.raises(ValueError, match="parameter x0 is .*got"):
        run_on_cpu(func, [np.zeros((1, 2, 4, 5), "float32"), np.zeros((1, 2, 2, 2), "float32")])
    with pytest.raises(ValueError, match="1 arrays for 2 parameters"):
        run_on_cpu(func, [np.zeros((1, 2, 4, 4), "float32")])


def test_the_sweep_checks_every_version_of_a_small_model(tmp_path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "two_branch", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    records = doc["records"]
    row = doc["summary"]["two_branch"]
    assert row["checked"] >= 10 and row["wrong"] == 0
    assert {r["source"] for r in records} >= {"dlight", "template"}
    assert any(r["produced"] for r in records)
    for rec in records:
        assert set(rec) >= {"model", "operator", "version", "valid", "max_rel_err"}
        if rec["valid"]:
            assert rec["max_rel_err"] <= doc["tolerance"]
    assert "| two_branch |" in proc.stderr
