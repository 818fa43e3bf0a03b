"""scripts/gpu_lease.sh (issue 31): prepare -> plan -> run -> report on this CPU machine.

The end-to-end test builds llvm libraries of the lease's form (``prepare --cpu-check``: a reduced
model, the two reduced float16 decoders and the demo), plans them, runs every step as the GPU host would (children under time
limits, TVM_USE_RUNTIME_LIB=1, results packed into OUT_DIR) and reports them. The driver's own
rules (a step past its limit stopped and recorded, the lease's time spent, a cut tar) and the
report's timeline decoding are tested on synthetic leases.
"""
import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tvm_rammer.lease import plan as lease_plan
from tvm_rammer.lease import prepare as lease_prepare
from tvm_rammer.lease import report as lease_report
from tvm_rammer.runtime import lease_steps

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_lease.sh"


def _sh(*args, env=None, check=True):
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=600, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"gpu_lease.sh {' '.join(args)}: exit {done.returncode}\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


MODELS = ("two_branch",) + lease_prepare.DECODERS  # the decoders: issue 34's decode step
LIBS = {"demo.default"} | {f"{m}.default" for m in MODELS}


@pytest.fixture(scope="module")
def cpu_lease(tmp_path_factory):
    """``prepare --cpu-check`` of the reduced two_branch model, the reduced float16 decoders and
    the demo, then ``run``."""
    base = tmp_path_factory.mktemp("lease")
    lease = base / ".lease"
    first = _sh("prepare", "--out", str(lease), "--cpu-check", "--models", ",".join(MODELS),
                "--reduced", "all", "--no-bundle")
    sources = json.loads((lease / "index.json").read_text())["sources"]
    again = _sh("prepare", "--out", str(lease), "--cpu-check", "--models", ",".join(MODELS),
                "--reduced", "all", "--no-bundle")
    out = base / "out"
    ran = _sh("run", str(out), env={"LEASE_DIR": str(lease)})
    return {"lease": lease, "out": out, "first": first.stdout, "again": again.stdout,
            "run": ran.stdout, "same_sources": sources == json.loads(
                (lease / "index.json").read_text())["sources"]}


def _results(out: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def test_prepare_builds_lease_libraries_and_reuses_them(cpu_lease):
    index = json.loads((cpu_lease["lease"] / "index.json").read_text())
    assert set(index["artifacts"]) == LIBS
    for name, rec in index["artifacts"].items():
        assert "error" not in rec, rec
        manifest = json.loads((cpu_lease["lease"] / "libs" / f"{name}.json").read_text())
        assert manifest["format"] == "tvm-rammer-lib/1" and manifest["device_type"] == "cpu"
        assert manifest["model"]["zoo"] in ("branches",) + MODELS
    assert cpu_lease["first"].splitlines()[-1].startswith("travel: ")
    if cpu_lease["same_sources"]:  # (a shared working tree may change between the two)
        assert f"{len(LIBS)} unchanged, 0 to build" in cpu_lease["again"]  # keyed by content: no rebuild
    assert cpu_lease["again"].splitlines()[-1].startswith("travel: ")


def test_plan_lists_the_steps_and_ends_with_the_total(cpu_lease):
    done = _sh("plan", env={"LEASE_DIR": str(cpu_lease["lease"])})
    lines = done.stdout.splitlines()
    names = [ln.split()[0] for ln in lines[1:-2]]
    assert names == ["install", "device", "demo"] + [f"zoo-{m}" for m in MODELS]
    assert lines[-1].startswith("total: ") and lines[-1].endswith(" s")
    total = int(lines[-1].split()[1])
    rows, exact = lease_plan.plan(cpu_lease["lease"])
    assert total == round(exact) and 0 < total <= 540


def test_run_loads_runs_checks_and_times_every_library_on_the_cpu(cpu_lease):
    out = cpu_lease["out"]
    assert len([p for p in out.iterdir()]) <= 8
    res = _results(out)
    assert list(res) == ["install", "device", "demo"] + [f"zoo-{m}" for m in MODELS]
    assert res["device"]["records"][0]["gpu"] is False
    assert res["device"]["records"][0]["tvm_runtime_only"] is True
    for step in ("demo", "zoo-two_branch"):
        assert res[step]["status"] == "ok", res[step]
        libs = [r for r in res[step]["records"] if r["kind"] == "library"]
        assert libs and all(r["ok"] and r["max_rel_err"] < 1e-5 and r["latency_us"] > 0
                            for r in libs)
    torch = [r for r in res["zoo-two_branch"]["records"] if r["kind"] == "torch"]
    assert torch and "would_time" in torch[0]  # listed, not timed, without a GPU (or torch)
    with tarfile.open(out / "raw.tar") as t:
        assert {"device/step.log", "demo/step.log", "zoo-two_branch/step.log"} <= set(t.getnames())


def test_the_decoders_step_is_loaded_run_and_checked_on_the_cpu(cpu_lease):
    """Issue 34 on the lease: both float16 decoders (reduced here) load, run at cache slot
    L // 2 = 8 and match onnxruntime; the libraries are TVM's default on llvm (the CUDA lease adds
    tvm-rammer's). Control: the same library run at another slot is caught by the same check."""
    from tvm_rammer.runtime.library import load
    from tvm_rammer.runtime.reference import onnx_reference, seeded_inputs
    from tvm_rammer.runtime.spec import read_spec
    from tvm_rammer.runtime.weights import zoo_model

    res = _results(cpu_lease["out"])
    for m in lease_prepare.DECODERS:
        step = res[f"zoo-{m}"]
        assert step["status"] == "ok", step
        (ref,) = [r for r in step["records"] if r["kind"] == "reference"]
        assert ref["position"] == 8 and ref["model"]["params"]["dtype"] == "float16"
        (lib,) = [r for r in step["records"] if r["kind"] == "library"]
        assert lib["ok"] and lib["max_rel_err"] <= 2e-2 and lib["latency_us"] > 0
        (torch,) = [r for r in step["records"] if r["kind"] == "torch"]
        assert "would_time" in torch and torch.get("host_read") is None, torch
    spec = read_spec(cpu_lease["lease"] / "libs" / "gpt2_decode.default.json")
    inputs, slot = lease_steps.decode_position(spec, seeded_inputs(spec))
    ref = onnx_reference(zoo_model(spec), spec, inputs)
    library = load(spec.manifest)
    assert slot == 8 and library.compare(ref, inputs)["ok"]
    moved = list(inputs)
    moved[1] = np.full_like(inputs[1], 3)  # "position": another cache slot
    assert not library.compare(ref, moved)["ok"]


def test_the_torch_baseline_of_the_decoders_has_no_host_read():
    """Where PyTorch and onnx2torch are installed (not in CI): onnx2torch's own conversion reads
    device tensors on the host (Range's bounds, ScatterND's indices: a CUDA graph cannot capture
    that), the lease's (torch_baseline) does not, on the "meta" device, and matches onnxruntime."""
    torch = pytest.importorskip("torch")
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.runtime import torch_baseline
    from tvm_rammer.runtime.reference import relative_error

    try:
        onnx_to_torch, _ = torch_baseline.import_convert()
    except ImportError:
        pytest.skip("onnx2torch is not installed")
    ort = pytest.importorskip("onnxruntime")
    for name in lease_prepare.DECODERS:
        model = get_model(name, **REDUCED[name], dtype="float16")
        rng = np.random.default_rng(0)
        feeds = {}
        for v in model.graph.input:
            shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
            feeds[v.name] = (np.full(shape, 8, np.int64) if v.type.tensor_type.elem_type == 7
                             else rng.standard_normal(shape).astype(np.float16))
        plain = onnx_to_torch(model).eval().to("meta")
        with pytest.raises(Exception):  # the control: a host read of a device tensor
            plain(*[torch.from_numpy(x).to("meta") for x in feeds.values()])
        assert torch_baseline.host_reads(model, feeds) is None
        gm, notes = torch_baseline.convert(model, "cpu", onnx_to_torch)
        assert any("ScatterND" in n for n in notes)
        with torch.inference_mode():
            outs = gm(*[torch.from_numpy(x) for x in feeds.values()])
        ref = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)
        assert max(relative_error(o.float().numpy(), r) for o, r in zip(outs, ref)) < 2e-2


def test_the_lease_measures_both_decoders_at_their_lease_size():
    arts = {a.name: a for a in lease_prepare.artifacts(lease_prepare.LeaseSpec())}
    for m in lease_prepare.DECODERS:
        for v in ("rammer", "default"):  # tvm-rammer's library against TVM's default
            assert arts[f"{m}.{v}"].model["params"]["dtype"] == "float16"
        assert "max_len" not in arts[f"{m}.rammer"].model["params"]  # full width: 1024 slots
    assert arts["gpt2_decode.rammer"].model["params"] == {"dtype": "float16"}  # GPT-2 small whole
    assert arts["llama_decode.rammer"].model["params"] == {"dtype": "float16", "layers": 2}


def test_report_of_the_cpu_run(cpu_lease, tmp_path):
    lease_report.write_report(cpu_lease["out"], tmp_path / "rep")
    text = (tmp_path / "rep" / "README.md").read_text()
    assert "| two_branch (reduced) (CPU check: llvm) |" in text
    assert "| demo (16 branches) (CPU check: llvm) |" in text
    for m in lease_prepare.DECODERS:
        assert f"| {m} (float16, reduced, step at position 8) (CPU check: llvm) |" in text
    data = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert data["commit"] == json.loads((cpu_lease["lease"] / "index.json").read_text())["commit"]
    assert all(ok for r in data["models"] for ok in r["ok"].values()) and data["models"]


# --- the driver's rules, on synthetic leases ----------------------------------------------------

def _fake_lease(tmp_path, kernels=None) -> Path:
    lease = tmp_path / ".lease"
    lease.mkdir()
    index = {"format": lease_prepare.FORMAT, "target": "rammer/nvidia-h200", "commit": "abc1234",
             "spec": {"models": []}, "artifacts": {}, "kernels": kernels}
    (lease / "index.json").write_text(json.dumps(index))
    return lease


def test_a_step_past_its_limit_is_stopped_and_recorded(tmp_path):
    # the kernels hook runs `python3 -m MODULE` from the lease's parent: a module that hangs
    (tmp_path / "hang_step.py").write_text("import time\ntime.sleep(120)\n")
    lease = _fake_lease(tmp_path, {"module": "hang_step", "args": [], "estimate_s": 30.0})
    out = tmp_path / "out"
    (out / "results.jsonl").parent.mkdir()
    (out / "results.jsonl").write_text(json.dumps({"step": "device", "status": "ok"}) + "\n")
    code = lease_steps.run(lease, out, budget_s=12.0, only=["kernels"])  # limit: 12 - 5 s
    res = _results(out)
    assert code == 1
    assert res["kernels"]["status"] == "timeout" and res["kernels"]["seconds"] < 15
    assert res["device"]["status"] == "ok"  # what an earlier step wrote stays


def test_steps_past_the_lease_budget_are_not_run(tmp_path):
    lease = _fake_lease(tmp_path)
    out = tmp_path / "out"
    lease_steps.run(lease, out, budget_s=4.0)
    assert _results(out)["device"]["status"] == "not run"


def test_a_failed_library_is_recorded_and_the_next_one_runs(cpu_lease, tmp_path):
    lease = tmp_path / ".lease"
    (lease / "libs").mkdir(parents=True)
    for f in (cpu_lease["lease"] / "libs").iterdir():
        (lease / "libs" / f.name).write_bytes(f.read_bytes())
    index = json.loads((cpu_lease["lease"] / "index.json").read_text())
    index["artifacts"]["demo.broken"] = dict(index["artifacts"]["demo.default"], variant="rammer")
    (lease / "index.json").write_text(json.dumps(index))
    (lease / "libs" / "demo.broken.json").write_text(
        (lease / "libs" / "demo.default.json").read_text().replace('"demo.default.so"',
                                                                 '"missing.so"'))
    out = tmp_path / "out"
    lease_steps.run(lease, out, only=["demo"])
    rec = _results(out)["demo"]
    assert rec["status"] == "failed"
    by_lib = {r["library"]: r for r in rec["records"] if r["kind"] == "library"}
    assert "missing" in by_lib["demo.broken"]["error"]
    assert by_lib["demo.default"]["ok"] is True


def test_a_cut_tar_keeps_its_complete_members(tmp_path):
    raw = tmp_path / "raw.tar"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.txt").write_text(name * 1000)
        lease_steps._pack(raw, tmp_path / name, name)
    data = raw.read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "raw.tar").write_bytes(data[: len(data) - 3000])
    members = lease_report.raw_members(tmp_path / "cut")
    assert members.get("a/x.txt") == b"a" * 1000


# --- the report, on a synthetic lease with a measured timeline ----------------------------------

def _schedule():
    """Paper Figure 9 (tests/test_timeline.py's): three operators on two vEUs."""
    from tvm_rammer.scheduling import timeline
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.scheduling.policy import OpGraph, RProgramPlan
    from tvm_rammer.abstractions.rprogram import RProgram
    from tvm_rammer.abstractions.rtask import RKernel, ROperator, RTask

    def op(uid, rtasks, time_us, name):
        return ROperator(uid, name, [RKernel(f"{name}:v1#abcd", rtasks, 128, 32, 0, time_us,
                                             "test")])

    p = RProgram(2)
    mm, relu = [RTask(0, i) for i in range(2)], [RTask(1, i) for i in range(4)]
    for t in mm:
        p.append(t, 0)
    for t in relu:
        p.append(t, 1)
    for veu in (0, 1):
        p.wait(RTask(2, veu), mm + relu)
        p.append(RTask(2, veu), veu)
    graph = OpGraph({0: op(0, 2, 1.0, "matmul"), 1: op(1, 4, 0.5, "relu"),
                     2: op(2, 2, 2.0, "conv")}, {2: [0, 1]}, [[0, 1], [2]])
    plan = RProgramPlan(p, [0, 1, 2], {0: 0, 1: 0, 2: 0}, {}, veus_per_sm=1, num_veus=2,
                        predicted_us=0.0)
    return timeline.schedule_of(0, "rammer_rprogram0", plan, graph, 2, num_sms=2,
                                config=RammerConfig())


def _measured_buffer(schedule, slow=2.0):
    """The buffer an instrumented run would write if every instruction took ``slow`` x its
    predicted time."""
    from tvm_rammer.scheduling import timeline
    (t,) = timeline.predict_all([schedule])
    by_pos = {(s.veu, s.order): s for s in t.slices}
    words = []
    for veu, queue in enumerate(schedule["prog"]):
        for order in range(len(queue)):
            s = by_pos[(veu, order)]
            words += [10_000_000 + int(s.start_us * slow * 1000) + 1,
                      10_000_000 + int(s.end_us * slow * 1000) + 1, 3 * veu]
    return np.array(words, dtype=np.int64)


def test_report_decodes_a_timeline_and_tables_a_synthetic_lease(tmp_path):
    schedule = _schedule()
    lease = tmp_path / "lease-out"
    lease.mkdir()
    steps = [
        {"step": "install", "status": "ok", "seconds": 12},
        {"step": "device", "status": "ok", "seconds": 2.0, "records": [
            {"kind": "device", "date": "2026-12-01 10:00 UTC", "device": "NVIDIA H200", "sms": 132,
             "nvidia_smi": "NVIDIA H200, 580.159.04", "python": "3.12.3", "torch": "2.11.0",
             "onnxruntime": "1.30.0", "tvm_runtime_only": True, "gpu": True}]},
        {"step": "zoo-alexnet", "status": "ok", "seconds": 20.0, "records": [
            {"kind": "reference", "model": {"zoo": "alexnet", "params": {}, "batch": 1}},
            {"kind": "library", "variant": "rammer", "latency_us": 1000.0, "max_rel_err": 1e-6,
             "ok": True},
            {"kind": "library", "variant": "rammer_nocheck", "latency_us": 1500.0,
             "max_rel_err": 1e-6, "ok": True},
            {"kind": "library", "variant": "default", "latency_us": 1300.0, "max_rel_err": 2e-6,
             "ok": True},
            {"kind": "torch", "eager_us": 2000.0, "graph_us": 1250.0, "rel_err": 1e-6}]},
        {"step": "zoo-resnext29", "status": "timeout", "seconds": 60.0, "records": [
            {"kind": "library", "variant": "rammer", "max_rel_err": 0.5, "ok": False,
             "latency_us": 10.0}]},
        {"step": "zoo-gpt2_decode", "status": "ok", "seconds": 30.0, "records": [
            {"kind": "library", "variant": "rammer_nocheck", "latency_us": 200.0,
             "max_rel_err": 1e-3, "ok": True},
            {"kind": "library", "variant": "lookahead1", "latency_us": 210.0,
             "max_rel_err": 1e-3, "ok": True},
            {"kind": "library", "variant": "prefetch_off", "latency_us": 250.0,
             "max_rel_err": 1e-3, "ok": True},
            {"kind": "library", "variant": "after_writes", "latency_us": 220.0,
             "max_rel_err": 1e-3, "ok": True}]},
        {"step": "timeline-alexnet", "status": "ok", "seconds": 5.0,
         "records": [{"kind": "timeline", "buffers": 1}]},
    ]
    (lease / "results.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps)
                                         + '{"step": "cut')  # the lease ended mid-line
    (lease / "index.json").write_text(json.dumps({"commit": "abc1234",
                                                  "target": "rammer/nvidia-h200"}))
    buf = io.BytesIO()
    np.savez(buf, rammer_rprogram0=_measured_buffer(schedule))
    with tarfile.open(lease / "raw.tar", "w") as t:
        for name, data in (("timeline-alexnet/buffers.npz", buf.getvalue()),
                           ("timeline-alexnet/schedules.json",
                            json.dumps({"kernels": ["rammer_rprogram0"],
                                        "schedules": [schedule]}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    res_dir = tmp_path / "results"
    assert lease_report.write_report(lease, res_dir) == res_dir
    data = json.loads((res_dir / "results.json").read_text())
    assert data["date"] == "2026-12-01" and data["commit"] == "abc1234"
    alex = next(r for r in data["models"] if r["model"] == "alexnet")
    assert alex["speedup_vs_default"] == pytest.approx(1.3)
    assert alex["speedup_vs_torch_best"] == pytest.approx(1.25)
    (tl,) = data["timelines"]
    ops = {o["operator"]: o for o in tl["operators"]}
    assert set(ops) == {"matmul", "relu", "conv"}
    for o in ops.values():  # every rTask measured at twice its prediction
        assert o["measured_us"] == pytest.approx(2 * o["predicted_us"], rel=0.01)
    text = (res_dir / "README.md").read_text()
    assert "| alexnet | 1,000.0 | 1,500.0 | 1,300.0 | 2,000.0 | 1,250.0 | 1.30x | 1.25x |" in text
    assert "| resnext29 |" in text and "**NO**" in text  # a wrong output is shown, not hidden
    assert "| zoo-resnext29 | timeout |" in text
    # the prefetch table: the decoder's three builds, the gain of the prefetch; alexnet (no such
    # builds) not in it
    prefetch = text.split("## Weights prefetched across barriers")[1].split("##")[0]
    assert "| gpt2_decode | 200.0 | 210.0 | 250.0 | 1.25x |" in prefetch
    assert "alexnet" not in prefetch
    # the attention beside the cache writes against after them: the gain measured; '-' where a
    # build has no latency (here the default's), a model without the build not in the table
    row = text.split("## Attention beside the cache writes")[1].split("##")[0]
    assert "| gpt2_decode | 200.0 | 220.0 | 1.10x |" in row
    assert "alexnet" not in row
    gpt2 = next(r for r in data["models"] if r["model"] == "gpt2_decode")
    del gpt2["latency_us"]["rammer_nocheck"]
    gpt2["errors"]["rammer_nocheck"] = "load failed"
    row = lease_report.format_markdown(data).split("## Attention beside the cache writes")[1]
    assert "| gpt2_decode | - | 220.0 | - |" in row.split("##")[0]
    assert "## Attention beside" not in lease_report.format_markdown(
        {**data, "models": [alex]})
    assert (res_dir / "lease" / "raw.tar").exists()


def test_report_default_folder_is_named_by_date_and_commit(tmp_path, monkeypatch):
    lease = tmp_path / "o"
    lease.mkdir()
    (lease / "results.jsonl").write_text(json.dumps(
        {"step": "device", "status": "ok", "records": [{"date": "2026-12-02 01:00 UTC"}]}) + "\n")
    (lease / "index.json").write_text(json.dumps({"commit": "def5678"}))
    monkeypatch.setattr(lease_report, "ROOT", tmp_path)
    out = lease_report.write_report(lease)
    assert out == tmp_path / "benchmarks" / "results" / "gpu-2026-12-02-def5678"


def test_prepare_starts_no_build_past_its_time_limit(tmp_path):
    lines = []
    spec = lease_prepare.LeaseSpec(out=str(tmp_path / ".lease"), models=("two_branch",),
                                   reduced=True, cpu_check=True, bundle=False,
                                   time_limit_s=1e-6)
    index = lease_prepare.prepare(spec, log=lines.append)
    assert index["artifacts"] and all(r["error"].startswith("not built")
                                      for r in index["artifacts"].values())
    assert lease_steps.steps(tmp_path / ".lease")[1:] == [] or all(
        not s["libraries"] for s in lease_steps.steps(tmp_path / ".lease")[1:])
    assert lines[-1].startswith("travel: ") and any("next prepare" in ln for ln in lines)


def test_prepare_stops_a_build_in_flight_at_its_time_limit(tmp_path, monkeypatch):
    """The limit bounds prepare's wall time: a build still running when it is reached is stopped
    and recorded "not built" (not a failure), so the next prepare builds it; control: the same
    build with no limit is built."""
    spec = lease_prepare.LeaseSpec(out=str(tmp_path / ".lease"), models=(), reduced=True,
                                   cpu_check=True, bundle=False, kernels=False,
                                   time_limit_s=lease_prepare.PACK_RESERVE_S + 0.5)
    # prepare's clock stands still: the build always starts (however slow the hashing before it
    # on a loaded machine) with the floor of 1 s left, and a child needs seconds to import TVM
    monkeypatch.setattr(lease_prepare, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    index = lease_prepare.prepare(spec, log=lambda _: None)
    (rec,) = index["artifacts"].values()
    assert rec["error"].startswith("not built") and "during its build" in rec["error"]
    monkeypatch.undo()
    lines = []
    index = lease_prepare.prepare(replace(spec, time_limit_s=None), log=lines.append)
    (rec,) = index["artifacts"].values()
    assert "error" not in rec and rec["files"]
    assert any(ln.startswith("libraries packed") for ln in lines)  # the control of the next one
    # one more model, cut by the limit: the same libraries were built, so the pack is kept
    lines = []
    monkeypatch.setattr(lease_prepare, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    index = lease_prepare.prepare(replace(spec, models=("two_branch",)), log=lines.append)
    assert index["artifacts"]["two_branch.default"]["error"].startswith("not built")
    assert not any(ln.startswith("libraries packed") for ln in lines)


def test_prepare_builds_every_models_main_comparison_before_the_nocheck_builds():
    arts = lease_prepare.artifacts(lease_prepare.LeaseSpec(models=("alexnet", "squeezenet")))
    names = [a.name for a in arts]
    last_main = max(i for i, a in enumerate(arts) if a.variant in ("rammer", "default"))
    assert all(i > last_main for i, a in enumerate(arts) if a.variant in ("rammer_nocheck",
                                                                            "timeline"))
    assert sorted(names) == sorted(f"{s}.{v}" for s, vs in (
        ("demo", ("rammer", "default")), ("alexnet", ("rammer", "rammer_nocheck", "default")),
        ("squeezenet", ("rammer", "rammer_nocheck", "default")), ("nasnet_cifar", ("timeline",)),
        ("resnext29", ("timeline",)), ("alexnet", ("timeline",))) for v in vs)


def test_decoders_get_the_prefetch_builds_after_every_main_comparison():
    """Issue 34's prefetch measured: each decoder also built with the prefetch at the barrier
    right before its reader only (lookahead 1) and with none, after every model's main
    comparison (a prepare cut by its time limit keeps those); a CNN and a CPU check get none."""
    spec = lease_prepare.LeaseSpec(models=("gpt2_decode", "alexnet"), timelines=(), demo=False)
    arts = lease_prepare.artifacts(spec)
    extra = {a.name: a for a in arts if a.variant in lease_prepare.PREFETCH_VARIANTS}
    assert set(extra) == {"gpt2_decode.lookahead1", "gpt2_decode.prefetch_off"}
    assert extra["gpt2_decode.lookahead1"].config == {"prefetch_lookahead": 1,
                                                      "check_unmeasured": False}
    assert extra["gpt2_decode.prefetch_off"].config["prefetch_weights"] is False
    last_main = max(i for i, a in enumerate(arts) if a.variant in ("rammer", "default"))
    assert all(i > last_main for i, a in enumerate(arts) if a.name in extra)
    from tvm_rammer import RammerConfig
    for a in extra.values():  # fields the product's config takes
        RammerConfig(**a.config)
    cpu = lease_prepare.artifacts(replace(spec, cpu_check=True))
    assert not any(a.variant in lease_prepare.PREFETCH_VARIANTS for a in cpu)


def test_decoders_get_the_attention_after_the_writes_build_after_the_prefetch_builds():
    """The attention beside the cache writes (RammerConfig.attention_row) measured against the
    attention after them: the decoders only (GPT-2's views of its QKV row, Llama's rotated
    projections), after the prefetch builds; a CPU check gets none."""
    spec = lease_prepare.LeaseSpec(models=("gpt2_decode", "llama_decode", "alexnet"),
                                   timelines=(), demo=False)
    arts = lease_prepare.artifacts(spec)
    rows = [a for a in arts if a.variant in lease_prepare.ROW_VARIANTS]
    assert [a.name for a in rows] == ["gpt2_decode.after_writes", "llama_decode.after_writes"]
    assert all(a.config == {"attention_row": False, "check_unmeasured": False} for a in rows)
    from tvm_rammer import RammerConfig
    assert RammerConfig(**rows[0].config).attention_row is False and RammerConfig().attention_row
    last_prefetch = max(i for i, a in enumerate(arts)
                        if a.variant in lease_prepare.PREFETCH_VARIANTS)
    assert min(arts.index(a) for a in rows) > last_prefetch
    cpu = lease_prepare.artifacts(replace(spec, cpu_check=True))
    assert not any(a.variant in lease_prepare.ROW_VARIANTS for a in cpu)


def test_source_hash_ignores_the_lease_and_runtime_code_but_not_the_compiler(tmp_path):
    for rel in ("tvm_rammer/a.py", "tvm_rammer/lease/prepare.py", "tvm_rammer/lease/manifest.py",
                "tvm_rammer/runtime/x.py", "relay_passes/p.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("1")
    h0 = lease_prepare.source_hash(tmp_path)
    (tmp_path / "tvm_rammer/lease/prepare.py").write_text("2")
    (tmp_path / "tvm_rammer/runtime/x.py").write_text("2")
    assert lease_prepare.source_hash(tmp_path) == h0
    for rel in ("tvm_rammer/a.py", "tvm_rammer/lease/manifest.py", "relay_passes/p.py"):
        (tmp_path / rel).write_text("3")
        h1 = lease_prepare.source_hash(tmp_path)
        assert h1 != h0
        h0 = h1


def test_lease_steps_imports_under_the_runtime_alone():
    code = ("import sys, tvm_rammer.runtime.lease_steps as s; "
            "print(any(m.startswith(('tvm.relax', 'tvm.s_tir')) for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"), check=True)
    assert done.stdout.strip() == "False"


class _Killed(BaseException):
    """Stands for the step's child being stopped (its limit) or dying (an abort in the capture)."""


def test_the_torch_eager_time_is_recorded_before_the_cuda_graph_is_tried(tmp_path, monkeypatch):
    """A CUDA-graph capture that never returns (the step's limit) or takes the process down must
    not lose the eager time already measured: it is on disk before the capture starts."""
    from contextlib import nullcontext
    from tvm_rammer.runtime import torch_baseline

    def no_graph(*_args, **_kwargs):
        raise _Killed()

    fake = SimpleNamespace(
        Tensor=type("Tensor", (), {}), from_numpy=lambda v: SimpleNamespace(to=lambda d: v),
        inference_mode=nullcontext,
        cuda=SimpleNamespace(CUDAGraph=no_graph, Stream=no_graph, graph=no_graph))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(torch_baseline, "import_convert", lambda: (None, ""))
    monkeypatch.setattr(torch_baseline, "convert", lambda proto, dev, conv: (lambda *xs: xs, []))
    monkeypatch.setattr(lease_steps, "_torch_time", lambda fn: (1234.0, 10))
    lease = tmp_path / "lease"
    lease.mkdir()
    (lease / "index.json").write_text("{}")
    step = lease_steps.Step("zoo-x", lease, tmp_path / "work")
    with pytest.raises(_Killed):
        lease_steps.step_torch(step, None, {"x": np.zeros(2)}, None, True, {})
    recs = [json.loads(line) for line in (tmp_path / "work" / "zoo-x.jsonl").read_text().splitlines()]
    assert [r["eager_us"] for r in recs if r.get("kind") == "torch"] == [1234.0]


def _integer_weights_model(inputs_list_initializers: bool):
    """x [2, 4] float -> Gather(rows of an int8 weight dequantized, by an int64 index table) @ x^T
    + a float bias, reshaped by an int64 shape: integer initializers that are weights, not shapes."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.integers(-100, 100, (5, 4)).astype(np.int8), "w_q"),
             numpy_helper.from_array(np.array(0.05, np.float32), "w_scale"),
             numpy_helper.from_array(np.array([4, 0, 2], np.int64), "table"),
             numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"]),
             helper.make_node("Gather", ["w", "table"], ["rows"], axis=0),
             helper.make_node("Transpose", ["x"], ["xt"]),
             helper.make_node("MatMul", ["rows", "xt"], ["y0"]),
             helper.make_node("Add", ["y0", "bias"], ["y1"]),
             helper.make_node("Reshape", ["y1", "flat"], ["y"])]
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    if inputs_list_initializers:  # IR < 4: every initializer also a graph input
        graph_inputs += [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                         for i in inits]
    graph = helper.make_graph(nodes, "int_weights", graph_inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.parametrize("listed", [False, True])
def test_integers_as_constants_keeps_integer_weights_meaning(listed):
    """An int8 weight (DequantizeLinear) and a Gather's int64 index table are embedded as Constant
    nodes, not dropped or reordered: onnxruntime gives the same outputs; only floats stay apart."""
    ort = pytest.importorskip("onnxruntime")
    from tvm_rammer.lease.manifest import integers_as_constants

    model = _integer_weights_model(listed)
    moved = integers_as_constants(model)
    assert sorted(i.name for i in moved.graph.initializer) == ["bias", "w_scale"]
    assert [v.name for v in moved.graph.input] == (["x", "w_scale", "bias"] if listed else ["x"])
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}

    def outs(m):
        return ort.InferenceSession(m.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    np.testing.assert_array_equal(outs(moved), outs(model))
    assert len(model.graph.initializer) == 5  # the input model is left as it was


def test_a_library_apart_with_integer_weights_and_a_scalar_weight_matches_onnxruntime(tmp_path):
    """build_library (llvm, weights apart, no zoo model: the weights travel as .npz) of a model
    whose int8 weight and int64 Gather table are embedded as constants and whose float scale is
    0-d: the .npz keeps the scalar 0-d (np.ascontiguousarray made it [1]: 'no weight') and the
    library gives onnxruntime's outputs."""
    ort = pytest.importorskip("onnxruntime")
    import tvm
    from tvm import relax
    from tvm_rammer.lease import manifest as mf

    model = _integer_weights_model(False)
    built = mf.build_library(model, pipeline="default", target="llvm", out=str(tmp_path / "m.so"))
    man = mf.read_manifest(built["manifest"])
    assert [w["name"] for w in man["raw_weights"]] == ["w_scale", "bias"]
    raw = mf.read_weights(man, tmp_path)
    assert raw[0].shape == ()
    vm = relax.VirtualMachine(tvm.runtime.load_module(built["library"]), tvm.cpu())
    weights = [tvm.runtime.tensor(a) for a in raw]
    weights = vm[man["transform"]](*weights) if man["transform"] else weights
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(x), *weights)
    got = (got if hasattr(got, "numpy") else got[0]).numpy()
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
