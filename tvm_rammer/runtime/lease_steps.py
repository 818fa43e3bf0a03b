"""The GPU side of a lease (``gpu_lease.sh run OUT_DIR``): the steps, each bounded, packed as it ends.

In: the lease folder ``.lease/`` that ``tvm_rammer.lease.prepare`` wrote (``index.json``, the
libraries and their manifests). Out, in ``OUT_DIR`` (at most 8 files; what a cut run did stays):

- ``results.jsonl``: one line per finished step (``step``, ``status`` "ok" | "failed" | "timeout" |
  "skipped", ``seconds``, ``limit_s``, ``records``: one dict per library or measurement);
- ``raw.tar``: the raw files of the steps (timeline buffers, their schedules, each step's log);
- ``index.json``: the index of the lease that ran; ``run.log``: this driver's log.

:func:`steps` lists the steps with estimated seconds (``plan`` prints the same list); :func:`run`
runs each in a child process (``python3 -m tvm_rammer.runtime.lease_steps step NAME``) under its own
time limit within the lease's budget: a step that overruns is stopped, recorded, the next one runs.
A child appends each record to ``WORK/NAME.jsonl`` as soon as it has it, so a stopped step keeps the
libraries it finished.

Runtime-only: stdlib, numpy, TVM's runtime (``TVM_USE_RUNTIME_LIB=1``), ``tvm_rammer.models``
(numpy+onnx) and, when present, onnxruntime, torch and onnx2torch. Without a GPU the CUDA libraries
are loaded as far as they load and listed as "would time: ..."; llvm libraries (``prepare
--cpu-check``) run, are checked and timed on the CPU.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

BUDGET_S = 540.0
TOLERANCE = 1e-4  # float32 relative error (norm of the difference over the norm of the reference)
TIMING_S = 2.0  # seconds of timed runs per library (runs = TIMING_S / expected latency, 10..200)
DEFAULT_LATENCY_US = 5000.0
STEP_FLOOR_S = 20.0
# the 16-branch demo's medians on the H200, 2026-11-25 (benchmarks/results/gpu-2026-11-25-7f085df)
PRIOR_BUILTIN = {"branches": {"rammer": 10.74, "default": 85.90}}


# --- the step list and its estimates (shared with ``plan``) -------------------------------------

def prior_latencies(root: Path) -> dict:
    """Median latencies (us) measured by earlier leases: ``{model: {"rammer": us, "default": us}}``
    from ``benchmarks/results/gpu-*/np/*.json`` and ``gpu-*/results.json`` (newest last wins)."""
    found: dict = {k: dict(v) for k, v in PRIOR_BUILTIN.items()}
    for path in sorted(glob.glob(str(root / "benchmarks/results/gpu-*/np/*.json"))):
        try:
            rec = json.loads(Path(path).read_text())
            found[Path(path).stem] = {k: rec[k]["latency_us"] for k in ("rammer", "default")
                                      if isinstance(rec.get(k), dict)}
        except (OSError, ValueError, KeyError):
            continue
    for path in sorted(glob.glob(str(root / "benchmarks/results/gpu-*/results.json"))):
        try:
            for row in json.loads(Path(path).read_text()).get("models", []):
                found.setdefault(row["model"], {}).update(
                    {k: v for k, v in row.get("latency_us", {}).items() if v})
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    return found


def _mib(lease: Path, rel: str | None) -> float:
    try:
        return (lease / rel).stat().st_size / 2**20 if rel else 0.0
    except OSError:
        return 0.0


def _weights_mib(manifest: dict) -> float:
    n = 0
    for w in manifest.get("raw_weights", []):
        size = 1
        for d in w["shape"]:
            size *= int(d)
        n += size * 4
    return n / 2**20


def _runs(latency_us: float) -> int:
    return int(min(200, max(10, TIMING_S * 1e6 / max(latency_us, 1.0))))


def library_estimate_s(weights_mib: float, so_mib: float, latency_us: float,
                       source: bool = False) -> float:
    """Seconds to load one library (``source``: its CUDA is source, compiled at load: 20 s), move
    and transform its weights, check two runs and time ``_runs`` runs (3 warm-up)."""
    load = 1.0 + so_mib / 50 + (20.0 if source else 0.0)
    weights = weights_mib / 500
    return load + weights + (_runs(latency_us) + 4) * latency_us * 1e-6 + 0.5


def _manifest(lease: Path, name: str, index: dict) -> dict | None:
    rec = index.get("artifacts", {}).get(name)
    if not rec or "error" in rec:
        return None
    try:
        return json.loads((lease / "libs" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _facts(lease: Path, index: dict, name: str) -> tuple:
    """``(weights MiB, library MiB, CUDA kept as source)`` of a library: from the index (prepare
    writes them) or, for an older index, from its manifest and file."""
    rec = index["artifacts"][name]
    if "so_mib" in rec:
        w, so, dev = rec.get("weights_mib", 0.0), rec["so_mib"], rec.get("device_type")
    else:
        man = _manifest(lease, name, index) or {}
        w, so, dev = _weights_mib(man), _mib(lease, f"libs/{name}.so"), man.get("device_type")
    return w, so, dev == "cuda" and not rec.get("binary")


def steps(lease: Path, root: Path | None = None) -> list:
    """The run's steps in order: dicts ``{"name", "kind", "libraries", "estimate_s", "what"}``."""
    lease = Path(lease)
    root = root or Path(__file__).resolve().parents[2]
    index = json.loads((lease / "index.json").read_text())
    prior = prior_latencies(root)
    out = [{"name": "device", "kind": "device", "libraries": [], "estimate_s": 5.0,
            "what": "nvidia-smi, driver, SMs, versions of python/torch/onnxruntime/tvm"}]

    def libs_of(prefix):
        return [n for n, r in index.get("artifacts", {}).items()
                if n.startswith(prefix + ".") and "error" not in r and r.get("variant") != "timeline"]

    def model_step(name, stem, model, what):
        libs = libs_of(stem)
        lat = prior.get(model, {})
        est = 3.0 + 2.0  # child start and imports; inputs and the onnxruntime reference
        mib = 0.0
        for lib in libs:
            w, so, source = _facts(lease, index, lib)
            mib = max(mib, w)
            variant = index["artifacts"][lib].get("variant", "rammer")
            us = lat.get("default" if variant == "default" else "rammer", DEFAULT_LATENCY_US)
            est += library_estimate_s(w, so, us, source)
        est += mib / 100 + mib / 200  # weights regenerated (numpy), reference run (onnxruntime)
        if stem != "demo":  # PyTorch eager and CUDA graph through onnx2torch
            us = lat.get("default", DEFAULT_LATENCY_US) * 1.5
            est += 3.0 + 2 * (_runs(us) + 4) * us * 1e-6
        out.append({"name": name, "kind": "model", "libraries": libs, "estimate_s": round(est, 1),
                    "what": what})

    if libs_of("demo"):
        model_step("demo", "demo", "branches", "16-branch demo: rammer vs TVM's default")
    for m in index.get("spec", {}).get("models", []):
        model_step(f"zoo-{m}", m, m, f"{m}: outputs vs onnxruntime; median latency of rammer, "
                   "rammer --no-unmeasured-check, TVM default, PyTorch eager and CUDA graph")
    for name, rec in index.get("artifacts", {}).items():
        if rec.get("variant") == "timeline" and "error" not in rec:
            model = name.split(".")[0]
            w, so, source = _facts(lease, index, name)
            us = prior.get(model, {}).get("rammer", DEFAULT_LATENCY_US)
            est = 5.0 + w / 100 + library_estimate_s(w, so, us, source)
            out.append({"name": f"timeline-{model}", "kind": "timeline", "libraries": [name],
                        "estimate_s": round(est, 1),
                        "what": f"{model}: measured per-vEU timeline (raw buffers; report decodes)"})
    kernels = index.get("kernels")
    if kernels:
        out.append({"name": "kernels", "kind": "kernels", "libraries": [],
                    "estimate_s": float(kernels.get("estimate_s", 0.0)) or None,
                    "what": "KERNELS HOOK: kernel versions timed, as many as the rest of the "
                            "lease allows (" + str(kernels.get("module", "?")) + ")"})
    return out


# --- the driver ---------------------------------------------------------------------------------

def run(lease: Path, out: Path, budget_s: float = BUDGET_S, install_s: float | None = None,
        only: list | None = None) -> int:
    """Run every step of ``lease`` into ``out`` within ``budget_s`` seconds; returns 0 when every
    step that ran finished "ok" or "skipped". ``install_s``: the seconds the run's install took
    before this call (``gpu_lease.sh``), counted in ``budget_s`` as ``plan`` counts it."""
    start = time.monotonic() - (install_s or 0.0)
    lease, out = Path(lease).resolve(), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="lease-work-"))  # the children's files; OUT gets the packs
    log_path = out / "run.log"
    (out / "index.json").write_bytes((lease / "index.json").read_bytes())

    def log(text):
        line = f"[{time.monotonic() - start:6.1f}s] {text}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    if install_s is not None:
        _append(out / "results.jsonl", {"step": "install", "status": "ok", "seconds": install_s})
    plan = [s for s in steps(lease) if not only or s["name"] in only]
    bad = 0
    for i, step in enumerate(plan):
        left = budget_s - (time.monotonic() - start)
        est = step["estimate_s"]
        if step["kind"] == "kernels" or est is None:
            limit = left - 5.0
        else:
            limit = min(max(2.0 * est, est + STEP_FLOOR_S), left - 5.0)
        if limit < 5.0:
            _append(out / "results.jsonl", {"step": step["name"], "status": "not run",
                                            "reason": "the lease's time is spent"})
            log(f"{step['name']}: not run (lease time spent)")
            continue
        log(f"{step['name']}: start (estimate {est} s, limit {limit:.0f} s)")
        rec = _run_step(step, lease, work, limit)
        _append(out / "results.jsonl", rec)
        _pack(out / "raw.tar", work / step["name"], step["name"])
        bad += rec["status"] not in ("ok", "skipped")
        log(f"{step['name']}: {rec['status']} in {rec['seconds']} s")
    log(f"run: {len(plan)} steps, {bad} not ok, {time.monotonic() - start:.0f} s")
    return 1 if bad else 0


def _run_step(step: dict, lease: Path, work: Path, limit: float) -> dict:
    """One step in a child process of its own session, killed (the whole group) at ``limit``."""
    records = work / f"{step['name']}.jsonl"
    records.unlink(missing_ok=True)
    raw = work / step["name"]
    raw.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "tvm_rammer.runtime.lease_steps", "step", step["name"],
           "--lease", str(lease), "--work", str(work)]
    t0 = time.monotonic()
    with open(raw / "step.log", "w") as logf:
        child = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=limit)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            kill_group(child)
            status, code = "timeout", None
    recs = []
    if records.exists():
        for line in records.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    if status == "ok" and recs and all(r.get("status") == "skipped" for r in recs):
        status = "skipped"
    if status == "ok" and any(r.get("ok") is False or "error" in r for r in recs):
        status = "failed"
    return {"step": step["name"], "status": status, "exit": code,
            "seconds": round(time.monotonic() - t0, 1), "limit_s": round(limit, 1),
            "estimate_s": step["estimate_s"], "records": recs}


def kill_group(child) -> None:
    """Stop ``child`` (started with ``start_new_session=True``) and every process it started."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass
        child.wait()


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _pack(tar_path: Path, folder: Path, arcname: str) -> None:
    """Append ``folder`` to the uncompressed tar ``tar_path`` (it stays readable if a later step is
    cut: every member is complete once appended)."""
    if not folder.is_dir():
        return
    with tarfile.open(tar_path, "a") as t:
        t.add(folder, arcname=arcname)


# --- the steps (children) -----------------------------------------------------------------------

class Step:
    """What one child knows: the lease, where to write, the device."""

    def __init__(self, name: str, lease: Path, work: Path):
        self.name, self.lease, self.work = name, Path(lease), Path(work)
        self.index = json.loads((self.lease / "index.json").read_text())
        self.raw = self.work / name
        self.raw.mkdir(parents=True, exist_ok=True)

    def record(self, rec: dict) -> None:
        _append(self.work / f"{self.name}.jsonl", rec)
        print(json.dumps(rec), flush=True)


def cuda_visible() -> bool:
    """A CUDA GPU this process can use (asked of TVM's runtime)."""
    try:
        from .device import device_for
        device_for("cuda")
        return True
    except Exception:  # noqa: BLE001 - no driver, no runtime library: no GPU
        return False


def step_device(step: Step) -> None:
    import datetime
    facts = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "python": sys.version.split()[0], "tvm_runtime_only":
             os.environ.get("TVM_USE_RUNTIME_LIB") == "1"}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.max.sm,clocks.sm,temperature.gpu,power.draw",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        facts["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        (step.raw / "nvidia-smi.txt").write_text(
            subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
    except (OSError, subprocess.SubprocessError) as err:
        facts["nvidia_smi"] = f"unavailable: {err}"
    for mod in ("numpy", "onnx", "onnxruntime", "torch", "tvm", "tvm_ffi"):
        try:
            facts[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as err:  # noqa: BLE001 - a missing or broken package is a fact
            facts[mod] = f"missing ({type(err).__name__})"
    try:
        import tvm
        facts["tvm_path"] = str(Path(tvm.__file__).parent)
    except Exception:  # noqa: BLE001 - recorded above as missing
        pass
    facts["gpu"] = cuda_visible()
    if facts["gpu"]:
        import tvm
        dev = tvm.cuda(0)
        facts.update(device=str(dev.device_name), sms=int(dev.multi_processor_count),
                     compute_version=str(dev.compute_version))
    step.record(dict(facts, kind="device"))


def _runs_for(prior: dict, variant: str) -> tuple:
    us = prior.get("default" if variant == "default" else "rammer", DEFAULT_LATENCY_US)
    return _runs(us), us


def _error(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1][:300] if text else ''}"


def step_model(step: Step, libraries: list) -> None:
    """Every library of one model (tvm_rammer.runtime): weights regenerated once, each library
    loaded, run once (fault page checked), compared with onnxruntime, timed; then PyTorch."""
    from .reference import onnx_reference, seeded_inputs
    from .spec import read_spec
    from .weights import zoo_model

    gpu = cuda_visible()
    manifests = {lib: step.lease / "libs" / f"{lib}.json" for lib in libraries}
    if not manifests:
        step.record({"status": "skipped", "reason": "no library built for this step"})
        return
    t0 = time.perf_counter()
    first = read_spec(next(iter(manifests.values())))
    proto = zoo_model(first)
    inputs = seeded_inputs(first)
    try:
        ref = onnx_reference(proto, first, inputs)
    except ImportError:
        ref = None
    step.record({"kind": "reference", "model": first.model,
                 "reference": "onnxruntime" if ref is not None else None,
                 "seconds": round(time.perf_counter() - t0, 2)})
    prior = prior_latencies(Path(__file__).resolve().parents[2]).get(first.model["zoo"], {})
    for lib, path in manifests.items():
        step.record(_measure_library(step, lib, path, proto, inputs, ref, gpu, prior))
    if step.name != "demo":
        feeds = {t.name: x for t, x in zip(first.inputs, inputs)}
        step_torch(step, proto, feeds, ref, gpu, prior)


def _measure_library(step: Step, lib: str, path: Path, proto, inputs, ref, gpu, prior) -> dict:
    """One library's record: load, run, compare, time (or, a CUDA library without a GPU, what can
    be done here and what would be timed)."""
    from .library import Library
    from .spec import read_spec
    from .weights import raw_weights

    spec = read_spec(path)
    variant = step.index["artifacts"][lib].get("variant")
    runs, _ = _runs_for(prior, variant)
    rec = {"kind": "library", "library": lib, "variant": variant, "pipeline": spec.pipeline,
           "device_type": spec.device_type, "weights_apart": spec.transform is not None
           or bool(spec.raw_weights)}
    t1 = time.perf_counter()
    try:
        raw = raw_weights(spec, proto)
        if spec.device_type == "cuda" and not gpu:
            rec.update(_load_only(path), status="skipped",
                       would_time=f"main of {lib} on the GPU, {runs} runs")
            return rec
        import tvm
        dev = tvm.cuda(0) if spec.device_type == "cuda" else tvm.cpu(0)
        loaded = Library(spec, dev, raw)
        rec["load_s"] = round(time.perf_counter() - t1, 2)
        outs = loaded.run(inputs)  # the fault page is checked; the first run loads the module
        if ref is not None:
            rec.update(loaded.compare(ref, inputs, outs))
            rec.pop("rel_errs", None)
        t2 = time.perf_counter()
        loaded.run(inputs)  # one more, timed on the host clock: sizes the timed runs
        runs = _runs((time.perf_counter() - t2) * 1e6)
        rec["runs"] = runs
        rec["latency_us"] = loaded.time(runs, inputs)  # the fault page is checked after
    except Exception as err:  # noqa: BLE001 - recorded; the next library still runs
        rec["error"] = _error(err)
    rec["seconds"] = round(time.perf_counter() - t1, 2)
    return rec


def _load_only(path: Path) -> dict:
    """Without a GPU: what can be done with a CUDA library here (its manifest read, its weights
    checked against it; the library loaded where TVM's CUDA runtime loads, e.g. with the cross
    helper's stub driver)."""
    import tvm
    lib = path.parent / json.loads(path.read_text())["library"]
    found = {"library_mib": round(lib.stat().st_size / 2**20, 3)}
    try:
        from .device import load_cuda_runtime
        load_cuda_runtime()
        tvm.runtime.load_module(str(lib))
        found["load"] = "ok"
    except Exception as err:  # noqa: BLE001 - no driver here: said, not fatal
        found["load"] = f"not here: {_error(err)}"
    return found


def step_torch(step: Step, proto, feeds: dict, ref, gpu: bool, prior: dict) -> None:
    """PyTorch eager and CUDA graph of the same ONNX model through onnx2torch (from the carried
    wheel), median us over CUDA events; outputs compared with onnxruntime."""
    from .reference import relative_error as rel_err

    rec = {"kind": "torch"}
    try:
        import torch
        from onnx2torch import convert
    except Exception as err:  # noqa: BLE001 - missing here: listed
        rec.update(status="skipped", reason=f"{type(err).__name__}: {err}"[:200],
                   would_time="PyTorch eager and CUDA graph (onnx2torch)")
        step.record(rec)
        return
    if not gpu:
        rec.update(status="skipped", would_time="PyTorch eager and CUDA graph (no GPU)")
        step.record(rec)
        return
    t0 = time.perf_counter()
    try:
        model = convert(proto).eval().cuda()
        xs = [torch.from_numpy(v).cuda() for v in feeds.values()]
        with torch.inference_mode():
            outs = model(*xs)
            outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
            if ref is not None:
                rec["rel_err"] = max(rel_err(o.float().cpu().numpy(), r) for o, r in zip(outs, ref))
            rec["eager_us"], runs = _torch_time(lambda: model(*xs))
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    model(*xs)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                model(*xs)
            rec["graph_us"], _ = _torch_time(graph.replay)
            rec["runs"] = runs
    except Exception as err:  # noqa: BLE001 - recorded
        rec["error"] = f"{type(err).__name__}: {str(err).strip()[:300]}"
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    step.record(rec)


def _torch_time(fn) -> tuple:
    """Median us of ``fn`` over CUDA events (3 warm-up runs; runs sized like the TVM timing)."""
    import statistics

    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    runs = _runs(a.elapsed_time(b) * 1e3)
    times = []
    for _ in range(runs):
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times), runs


def step_timeline(step: Step, library: str) -> None:
    """The instrumented build (``main`` returns the outputs and one timeline buffer per persistent
    kernel): three warm-up runs, one recorded; the buffers saved raw (``buffers.npz``, by kernel
    name) with the predicted schedules, for ``report`` to decode."""
    import numpy as np
    import tvm

    from .library import Library, _flatten
    from .reference import onnx_reference, relative_error, seeded_inputs
    from .spec import read_spec
    from .weights import raw_weights, zoo_model

    path = step.lease / "libs" / f"{library}.json"
    sched = step.lease / "libs" / f"{library}.schedules.json"
    if sched.exists():
        (step.raw / "schedules.json").write_bytes(sched.read_bytes())
    rec = {"kind": "timeline", "library": library}
    if not cuda_visible():
        rec.update(_load_only(path), status="skipped",
                   would_time=f"{library}: 3 warm-up runs, 1 recorded (%globaltimer per rTask)")
        step.record(rec)
        return
    t0 = time.perf_counter()
    spec = read_spec(path)
    proto = zoo_model(spec)
    inputs = seeded_inputs(spec)
    loaded = Library(spec, tvm.cuda(0), raw_weights(spec, proto))
    args = [tvm.runtime.tensor(x, loaded.device) for x in inputs] + loaded.weights
    for _ in range(3):
        loaded.vm["main"](*args)
    outs, buffers = loaded.vm["main"](*args)
    arrays = [b.numpy() for b in buffers]
    loaded.check_fault()
    names = json.loads(sched.read_text()).get("kernels", []) if sched.exists() else []
    np.savez(step.raw / "buffers.npz", **{(names[i] if i < len(names) else f"kernel{i}"): a
                                          for i, a in enumerate(arrays)})
    rec.update(buffers=len(arrays), seconds=round(time.perf_counter() - t0, 2))
    try:
        ref = onnx_reference(proto, spec, inputs)
        rec["max_rel_err"] = max(relative_error(o.numpy(), r) for o, r in zip(_flatten(outs), ref))
    except ImportError:
        pass
    step.record(rec)


def step_kernels(step: Step) -> None:
    """KERNELS HOOK: the "kernels" helper's GPU-side timing, given what prepare recorded
    (``index["kernels"]``: ``module`` to run with ``python3 -m`` and its ``args``)."""
    entry = step.index.get("kernels") or {}
    module = entry.get("module")
    if not module:
        step.record({"status": "skipped", "reason": "no kernel-version libraries in this lease"})
        return
    cmd = [sys.executable, "-m", module, *entry.get("args", []), "--out", str(step.raw)]
    done = subprocess.run(cmd, cwd=step.lease.resolve().parent, check=False)
    step.record({"kind": "kernels", "module": module, "exit": done.returncode,
                 "status": "ok" if done.returncode == 0 else "failed"})


def step_main(name: str, lease: Path, work: Path) -> int:
    step = Step(name, lease, work)
    found = [s for s in steps(lease) if s["name"] == name]
    if not found:
        raise ValueError(f"no step {name!r} in this lease")
    kind = found[0]["kind"]
    if kind == "device":
        step_device(step)
    elif kind == "model":
        step_model(step, found[0]["libraries"])
    elif kind == "timeline":
        step_timeline(step, found[0]["libraries"][0])
    elif kind == "kernels":
        step_kernels(step)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tvm_rammer.runtime.lease_steps")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every step, bounded, into OUT_DIR")
    r.add_argument("out")
    r.add_argument("--lease", default=".lease")
    r.add_argument("--budget-s", type=float, default=BUDGET_S)
    r.add_argument("--install-s", type=float, default=None)
    r.add_argument("--only", default="", help="comma-separated step names")
    s = sub.add_parser("step", help="one step (the driver's child)")
    s.add_argument("name")
    s.add_argument("--lease", default=".lease")
    s.add_argument("--work", required=True)
    args = p.parse_args(argv)
    if args.cmd == "run":
        if not (Path(args.lease) / "index.json").exists():
            print(f"gpu_lease.sh run: error: {args.lease}/index.json missing; run "
                  "`bash scripts/gpu_lease.sh prepare` first and carry .lease", file=sys.stderr)
            return 2
        return run(Path(args.lease), Path(args.out), args.budget_s, args.install_s,
                   [n for n in args.only.split(",") if n])
    return step_main(args.name, Path(args.lease), Path(args.work))


if __name__ == "__main__":
    sys.exit(main())
