"""What compile-time profiling costs: builds and seconds per zoo model, before and after the budget.

    python3 scripts/profile_cost.py                       # every zoo model, reduced sizes
    python3 scripts/profile_cost.py squeezenet lstm_tc --out cost.json
    python3 scripts/profile_cost.py --workers 16 alexnet  # build processes (a GPU host has 16 cores)
    python3 scripts/profile_cost.py --full --budget 60 lstm_tc  # full size, "after" within 60 s
    python3 scripts/profile_cost.py --whole squeezenet    # and the whole tvm.compile (build + nvcc)
    python3 scripts/profile_cost.py --repeat 3 lstm_tc    # each mode 3 times, median seconds

No GPU is needed: every kernel and persistent kernel the profiler asks for is really built as a
GPU host builds it (TVM's CUDA codegen, then nvcc on the module's CUDA source with TVM's nvcc
command: ``CudaDevice(compile_source=True)``, in its build processes; without it a CPU machine's
TVM keeps the source and compiles nothing), and its run is replaced by a fake timing
(``SimulatedDevice``: a deterministic time per built kernel, every version valid), so the
seconds are the builds' and the pipeline's, as on a GPU host minus the runs themselves (each run is
~20-100 short launches: milliseconds). Each model (its reduced size, ``models.REDUCED``) is lowered
in a fresh process, four ways:

- ``none``: ``RammerConfig(profile=False)``, nothing measured (the baseline);
- ``built``: ``RammerConfig(profile=False, check_unmeasured=False)``, nothing measured and every
  rProgram the policy makes built as a persistent kernel (without measured times the unmeasured
  check keeps most operators TVM's default kernels, so ``none`` builds little of what a profiled
  compile does: this baseline builds that kind of output, unprofiled);
- ``before``: every version of every operator and up to 32 candidate rPrograms measured
  (``profile_margin=None, profile_budget_s=None, rprogram_profiles=32``: the defaults before);
- ``after``: the defaults (only what can change a decision, within the budget), a fresh database;
- ``again``: the defaults on the database ``after`` filled (a second compile: everything cached).

One JSON line per model, then a Markdown table (kernel builds + rProgram builds, seconds, and the
ratio to ``none``); each JSON line also has the seconds of the profiling phases (``phases_s``:
making versions, the rKernel batches, the policy's whole-plan materializing and hashing, the
persistent kernels' TIR, the rProgram builds) and what the budget left unmeasured. The ``rammer``
pipeline only (``frontend.lower``), not ``tvm.compile``'s final build; with ``--whole`` each compile
is also finished as ``tvm.compile`` finishes it on a GPU host (the build, then the module's CUDA
source through TVM's compile callback: nvcc, or the binary cache's copy of a source compiled
before; what a user waits for) and a second table compares those whole compiles; its rows also
count the kernels and the device functions (outlined rKernel bodies) nvcc compiled. The binary
cache (``host.binary_cache``, one per model under ``--tmp``) is emptied before every mode but
``again``, which finds what ``after`` compiled, as a user's second compile does;
``--no-binary-cache`` runs nvcc every time (the rows before 2026-11-28 were measured so).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

MODELS = ("resnext29", "nasnet_cifar", "alexnet", "deepspeech2", "lstm_tc", "seq2seq",
          "inception_v3", "squeezenet", "googlenet", "randwire")

_CHILD = r"""
import hashlib, json, logging, sys, time
logging.getLogger("tvm_rammer").setLevel(logging.ERROR)
from tvm_rammer.driver.backend import make_profiler
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.host.gpu import DeviceId, LocalGPU
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.target import resolve_target
from tvm_rammer.tuning import measure


def _fake_us(path, low, high, entry=""):
    # a kernel of a batch: its library's bytes and its entry's name
    digest = hashlib.sha1(open(path, "rb").read() + entry.encode()).digest()
    return low + (high - low) * digest[0] / 255.0


class SimulatedDevice(measure.CudaDevice):
    # real builds (CudaDevice's), fake runs: a deterministic time per built kernel
    def __init__(self, target, workers):
        super().__init__(LocalGPU(None, DeviceId("Simulated H100", "sm_90a", "0")), target,
                         build_workers=workers, compile_source=True)
        self.rprogram_builds = 0

    def _run(self, fn, *args, deadline=None):
        if deadline is not None and time.monotonic() >= deadline:
            raise measure.BudgetSpent("the profiling budget is spent")
        if fn is measure._run_kernel_worker:
            job = args[0]
            us = _fake_us(job["path"], 5.0, 20.0, job["entry"])
            itself = (job["ref_path"], job["ref_entry"]) == (job["path"], job["entry"])
            return {"kernel_us": us, "valid": True, "error": 0.0,
                    "default_us": us if itself else _fake_us(job["ref_path"], 8.0, 20.0, job["ref_entry"])
                    if job["ref_path"] else None}
        self.rprogram_builds += 1
        return _fake_us(args[0], 5.0, 60.0)


name, target_name, mode, workers, db_path, budget, full, whole = sys.argv[1:9]
target = resolve_target(target_name)
mod = import_onnx(get_model(name, **({} if full == "1" else REDUCED.get(name, {}))))
budget = {} if budget == "default" else {"profile_budget_s": None if budget == "none" else float(budget)}
configs = {"none": RammerConfig(profile=False),
           "built": RammerConfig(profile=False, check_unmeasured=False),
           "before": RammerConfig(profile_db=db_path, profile_margin=None, profile_budget_s=None,
                                 rprogram_profiles=32),
           "after": RammerConfig(profile_db=db_path, **budget),
           "again": RammerConfig(profile_db=db_path, **budget)}
config = configs[mode]
device = None if mode in ("none", "built") else SimulatedDevice(target, int(workers))
profiler = make_profiler(target, config, device)

from tvm_rammer.driver import backend
from tvm_rammer.scheduling import policy
from tvm_rammer.tuning import profiler as profiler_mod
PHASES = {}


def timed(owner, attr, phase):
    # owner.attr, its calls' seconds summed under PHASES[phase]
    real = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            PHASES[phase] = PHASES.get(phase, 0.0) + time.perf_counter() - begin
    setattr(owner, attr, wrapper)


timed(backend, "_candidates", "versions")
timed(profiler_mod.Profiler, "prepare", "rkernels")
timed(policy, "materialize", "policy_materialize")
timed(profiler_mod, "plan_key", "plan_key")
timed(backend, "build_plan", "build_plan")
if device is not None:
    timed(device, "time_kernel", "rprogram_build_and_run")
start = time.perf_counter()
try:
    lowered = lower(mod, target, config, profiler)
finally:
    profiler.close()
seconds = time.perf_counter() - start
finish = {}
if whole == "1":  # the rest of tvm.compile on a GPU host: the build, then the CUDA source compiled
    import tvm
    from tvm_rammer.host.cuda_compile import compile_callback
    begin = time.perf_counter()
    ex = tvm.compile(lowered, target=target, relax_pipeline=None)
    finish["build_s"] = round(time.perf_counter() - begin, 1)
    sources = [str(m.inspect_source()) for m in ex.mod.imports[0].imports if m.kind == "cuda"]
    begin = time.perf_counter()
    with target:  # as a GPU host's build calls it: nvcc here, or the binary cache's copy
        for source in sources:
            compile_callback(source)
    finish["nvcc_s"] = round(time.perf_counter() - begin, 1)
    import re  # what nvcc compiled: kernels, and device functions (outlined rKernel bodies)
    finish["cuda_kernels"] = sum(len(re.findall(r"__global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\([^;]*\)\s*\{", s)) for s in sources)
    finish["device_functions"] = sum(len(re.findall(r'^extern "C" __device__ __noinline__ void \w+\([^;]*\)\s*\{', s, re.M)) for s in sources)
print(json.dumps({"model": name, "mode": mode, "seconds": round(seconds, 1),
                  "kernel_builds": device._count - device.rprogram_builds if device else 0,
                  "rprogram_builds": device.rprogram_builds if device else 0,
                  "build_jobs": device.batches if device else 0,
                  "profiled": profiler.counts.get("profiled", 0),
                  "unmeasured": {k: len(v) if isinstance(v, list) else v
                                 for k, v in profiler.unmeasured().items()},
                  "phases_s": {k: round(v, 1) for k, v in PHASES.items()}, **finish}))
"""

MODES = ("none", "built", "before", "after", "again")


def _compile(name, target, mode, workers, db, budget, full, whole, binaries=None) -> dict:
    """One compile of ``name`` in a fresh process: its JSON row (or ``error``). ``binaries``: the
    model's binary cache (``host.binary_cache``), empty for every mode but ``again`` (a second
    compile finds the CUDA binary of the first); None: the cache off, nvcc every time."""
    if mode in ("before", "after") and os.path.exists(db):
        os.remove(db)  # a first compile: a fresh database
    if binaries is not None and mode != "again":
        shutil.rmtree(binaries, ignore_errors=True)
    # nvcc, as the rows before measured it (a host with cuda-python would otherwise time NVRTC)
    env = {**os.environ, "TVM_RAMMER_BINARY_CACHE": binaries or "off", "TVM_CUDA_COMPILE_MODE": "nvcc"}
    out = subprocess.run([sys.executable, "-c", _CHILD, name, target, mode, str(workers), db,
                          budget, "1" if full else "0", "1" if whole else "0"],
                         capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"model": name, "mode": mode, "error": out.stderr.strip()[-400:]}
    row = json.loads(lines[-1])
    if whole:
        row["binary_cache"] = "off" if binaries is None else ("warm" if mode == "again" else "cold")
    return row


def _median_row(runs: list) -> dict:
    """The last of ``runs`` (rows of one mode) with the median of their seconds (``seconds``,
    ``build_s``, ``nvcc_s``) and every run's under ``runs_s``."""
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    row = dict(runs[-1])
    for field in ("seconds", "build_s", "nvcc_s"):
        if field in row:
            row[field] = round(statistics.median(r[field] for r in runs), 1)
    row["runs_s"] = [r["seconds"] for r in runs]
    return row


def run_model(name: str, target: str, workers: int, tmp: str, budget: str = "default",
              full: bool = False, modes=MODES, whole: bool = False, repeat: int = 1,
              binary_cache: bool = True) -> dict:
    """The compiles of one model (fresh processes, ``modes``); their rows by mode. ``whole``: each
    also finishes as ``tvm.compile`` does on a GPU host (``build_s`` + ``nvcc_s`` in its row; with
    ``binary_cache``, through the CUDA binary cache: cold for every mode, warm for ``again``).
    ``repeat``: each mode compiled that many times in a row (a first compile each time on a fresh
    database, the second compiles on the last first compile's), its seconds the median."""
    rows = {}
    for mode in modes:
        db = os.path.join(tmp, f"{name}-{'before' if mode == 'before' else 'after'}.json")
        binaries = os.path.join(tmp, f"{name}-binaries") if binary_cache else None
        runs = [_compile(name, target, mode, workers, db, budget, full, whole, binaries)
                for _ in range(repeat if mode != "before" else 1)]
        rows[mode] = _median_row(runs)
        print(json.dumps(rows[mode]), flush=True)
    return rows


def whole_seconds(row: dict) -> float | None:
    """A row's seconds as the whole ``tvm.compile`` on a GPU host: the pipeline, the build and nvcc
    (None when the row was not finished so)."""
    if "error" in row or "nvcc_s" not in row:
        return None
    return round(row["seconds"] + row["build_s"] + row["nvcc_s"], 1)


def table(results: dict, whole: bool = False) -> str:
    """Markdown: per model, builds (kernels + rPrograms) and seconds of each mode, ratio to none
    (``whole``: the seconds of the whole ``tvm.compile``, pipeline + build + nvcc)."""
    seconds = whole_seconds if whole else (lambda r: None if "error" in r else r["seconds"])
    what = "whole tvm.compile" if whole else "pipeline"
    lines = [f"| model | no profiling s ({what}) | before: builds, s (x) | after: builds, s (x) | "
             "second compile: builds, s (x) | no profiling, persistent kernels built: s (second "
             "compile / it) |", "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        base = seconds(rows["none"])
        cells = [name, f"{base}" if base is not None else "error"]
        for mode in ("before", "after", "again"):
            r = rows.get(mode)
            if r is None:
                cells.append("-")
                continue
            if "error" in r or base is None or seconds(r) is None:
                cells.append("error")
                continue
            builds = f"{r['kernel_builds']} + {r['rprogram_builds']}"
            cells.append(f"{builds}, {seconds(r)} ({seconds(r) / max(base, 1e-9):.2f}x)")
        built, again = rows.get("built"), rows.get("again")
        if built is None or "error" in built or seconds(built) is None:
            cells.append("-" if built is None else "error")
        elif again is None or "error" in again or seconds(again) is None:
            cells.append(f"{seconds(built)}")
        else:
            cells.append(f"{seconds(built)} ({seconds(again) / max(seconds(built), 1e-9):.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--target", default="rammer/nvidia-h100")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="build processes (default: this machine's CPU count)")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--tmp", default="/tmp/tvm_rammer_profile_cost")
    parser.add_argument("--budget", default="default", metavar="SECONDS",
                        help="profile_budget_s of the 'after' and 'again' compiles ('none': no "
                             "limit; default: RammerConfig's)")
    parser.add_argument("--full", action="store_true", help="the full-size models, not REDUCED")
    parser.add_argument("--whole", action="store_true",
                        help="finish each compile as tvm.compile does on a GPU host (the build, "
                             "then nvcc on its CUDA source) and also tabulate those seconds")
    parser.add_argument("--repeat", type=int, default=1,
                        help="compile each mode this many times ('before' once) and report the "
                             "median seconds (a second compile takes ~1 s: one run is noise)")
    parser.add_argument("--no-binary-cache", action="store_true",
                        help="with --whole, compile every CUDA source with nvcc (the second "
                             "compile too: TVM_RAMMER_BINARY_CACHE=off); default: the binary cache, "
                             "empty for every mode but 'again'")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    args = parser.parse_args(argv)
    os.makedirs(args.tmp, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES) or "none" not in modes:
        parser.error(f"--modes: a subset of {','.join(MODES)} that includes 'none'")
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    results = {name: run_model(name, args.target, args.workers, args.tmp, args.budget, args.full,
                               modes, args.whole, args.repeat, not args.no_binary_cache)
               for name in args.models}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(table(results))
    if args.whole:
        print()
        print(table(results, whole=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
