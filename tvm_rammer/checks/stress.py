"""GPU stress run: the checks of reliability at scale, for any machine with a CUDA GPU.

``python3 -m tvm_rammer.checks.stress --out DIR`` (``bash scripts/gpu_check.sh --stress``) runs, each
part on its own and recorded whatever the others do:

1. ``fuzz``: the fuzzer's graphs (default 5,000, seed 2026) compiled, run on the device and compared
   with onnxruntime, every table also checked by the reference executor (``tvm_rammer.checks.fuzz``);
2. ``sanitizer``: compute-sanitizer memcheck, racecheck and synccheck on the reduced model zoo, one
   model per process (``compute-sanitizer --tool T python3 -m tvm_rammer.checks.stress run-model NAME``);
3. ``back_to_back``: 10,000 runs of one module, every output equal to the first run's, bit for bit;
4. ``threads``: 8 threads sharing one compiled module, 300 runs each, all equal to one reference.

Results are one JSON file (``DIR/stress-<date>.json``: device, commit, each part's counts, time and
failures). Exit status 0 only when every part ran and found nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time

TOOLS = ("memcheck", "racecheck", "synccheck")
STRESS_MODEL = ("branches", {"n": 16})


def _outputs(result) -> list:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [x for r in result for x in _outputs(r)]


def _compile(name: str, params: dict):
    import tvm
    from tvm import relax

    import tvm_rammer
    from tvm_rammer.models import get_model
    from tvm_rammer.run.runner import random_inputs

    model = get_model(name, **params)
    # numerics and stability only: nothing measured (the sanitizer runs each compile under
    # compute-sanitizer, where profiling would build and time every candidate)
    ex = tvm_rammer.compile(model, target=_local_target(),
                            config=tvm_rammer.RammerConfig(profile=False))
    feeds = random_inputs(model, seed=3)
    dev = tvm.cuda(0)
    names = [v.name for v in model.graph.input if v.name in feeds]
    args = [tvm.runtime.tensor(feeds[n], dev) for n in names]
    return model, ex, relax.VirtualMachine(ex, dev), args, feeds


def _local_target():
    import tvm

    import tvm_rammer

    arch = "sm_" + str(tvm.cuda(0).compute_version).replace(".", "")
    arch = arch + "a" if arch == "sm_90" else arch
    return tvm_rammer.rammer_target({"kind": "cuda", "arch": arch})


def back_to_back(runs: int = 10_000) -> dict:
    """``runs`` runs of one module; every output equal to the first run's, bit for bit."""
    import numpy as np

    from tvm_rammer.codegen import faults

    start = time.monotonic()
    _, _, vm, args, _ = _compile(*STRESS_MODEL)
    first = _outputs(vm["main"](*args))
    faults.check(vm)
    mismatches = 0
    for i in range(runs):
        out = vm["main"](*args)
        if i % 100 == 99 or i == runs - 1:  # compare often, without a sync per run
            mismatches += any(not np.array_equal(a, b) for a, b in zip(_outputs(out), first))
    faults.check(vm)
    return {"runs": runs, "compared": runs // 100 + 1, "mismatches": int(mismatches),
            "seconds": round(time.monotonic() - start, 1), "ok": mismatches == 0}


def threads(count: int = 8, runs: int = 300) -> dict:
    """``count`` threads, each with its own VirtualMachine over one executable, ``runs`` runs each;
    every output equal to a single-threaded reference run, bit for bit."""
    import numpy as np
    import tvm
    from tvm import relax

    start = time.monotonic()
    _, ex, vm, args, feeds = _compile(*STRESS_MODEL)
    reference = _outputs(vm["main"](*args))
    errors, mismatches = [], [0] * count

    def worker(k):
        try:
            own = relax.VirtualMachine(ex, tvm.cuda(0))
            for _ in range(runs):
                out = _outputs(own["main"](*args))
                mismatches[k] += any(not np.array_equal(a, b) for a, b in zip(out, reference))
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(f"thread {k}: {type(err).__name__}: {err}")

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(count)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=1800)
    hung = sum(t.is_alive() for t in pool)
    total = sum(mismatches)
    return {"threads": count, "runs_per_thread": runs, "mismatches": int(total), "errors": errors,
            "hung_threads": hung, "seconds": round(time.monotonic() - start, 1),
            "ok": total == 0 and not errors and hung == 0}


def run_model(name: str) -> int:
    """One reduced zoo model compiled and run once, compared with onnxruntime (the process the
    sanitizer watches). Exit status 0 when it matched."""
    from tvm_rammer.codegen import faults
    from tvm_rammer.models import REDUCED
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    model, _, vm, args, feeds = _compile(name, REDUCED.get(name, {}))
    outs = _outputs(vm["main"](*args))
    faults.check(vm)
    worst = max(relative_error(o, r) for o, r in zip(outs, onnx_reference(model, feeds)))
    print(f"{name}: max relative error {worst:.3g}")
    return 0 if worst <= 1e-4 else 1


def sanitizer(models=None, tools=TOOLS, timeout: float = 1800.0) -> dict:
    """compute-sanitizer ``tools`` over each reduced zoo model, one process per (tool, model)."""
    from tvm_rammer.models import REDUCED

    exe = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)
    if exe is None:
        return {"ok": False, "error": "compute-sanitizer not found (CUDA toolkit's bin/)"}
    results = []
    for tool in tools:
        for name in models or sorted(REDUCED):
            start = time.monotonic()
            cmd = [exe, "--tool", tool, "--error-exitcode", "99", sys.executable, "-m",
                   "tvm_rammer.checks.stress", "run-model", name]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                      check=False)
                summary = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                           if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
                ok = proc.returncode == 0
                entry = {"tool": tool, "model": name, "exit": proc.returncode,
                         "summary": summary[-1] if summary else "", "ok": ok}
                if not ok:
                    entry["tail"] = (proc.stdout + proc.stderr)[-3000:]
            except subprocess.TimeoutExpired:
                entry = {"tool": tool, "model": name, "exit": None, "ok": False,
                         "summary": f"timed out after {timeout:g} s"}
            entry["seconds"] = round(time.monotonic() - start, 1)
            results.append(entry)
            print(f"  {tool:<9} {name:<14} {'ok' if entry['ok'] else 'FAIL'} {entry['summary']}",
                  flush=True)
    return {"runs": results, "ok": all(r["ok"] for r in results)}


def fuzz_on_gpu(graphs: int, seed: int, jobs: int, out_dir: str) -> dict:
    from tvm_rammer.checks.fuzz import fuzz

    result = fuzz(graphs, seed, jobs=jobs, gpu=True, out_dir=os.path.join(out_dir, "fuzz-failures"))
    return {"graphs": graphs, "seed": seed, "failures": len(result["failures"]),
            "failed": [{"index": f["index"], "stage": f["stage"], "problem": f["problems"][0]}
                       for f in result["failures"]],
            "checked": result["ok"], "skipped": result["skipped"], "seconds": result["seconds"],
            "ok": not result["failures"]}


def _device() -> dict:
    import tvm

    dev = tvm.cuda(0)
    return {"name": str(dev.device_name), "compute": str(dev.compute_version),
            "sms": int(dev.multi_processor_count)}


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["run-model"]:
        return run_model(argv[1])
    p = argparse.ArgumentParser(prog="python3 -m tvm_rammer.checks.stress", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="where the JSON goes")
    p.add_argument("--parts", default="fuzz,sanitizer,back_to_back,threads")
    p.add_argument("--graphs", type=int, default=5000)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--jobs", type=int, default=4, help="fuzz worker processes sharing the GPU")
    p.add_argument("--runs", type=int, default=10_000, help="back-to-back runs")
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args(argv)
    from tvm_rammer.benchmarks.harness import git_commit
    from tvm_rammer.host.gpu import gpu_available

    if not gpu_available():
        print("tvm-rammer stress: no CUDA GPU is visible: nothing measured", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    record = {"device": _device(), "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "parts": {}}
    path = os.path.join(args.out, f"stress-{record['date']}.json")
    parts = {"fuzz": lambda: fuzz_on_gpu(args.graphs, args.seed, args.jobs, args.out),
             "sanitizer": sanitizer,
             "back_to_back": lambda: back_to_back(args.runs),
             "threads": lambda: threads(args.threads)}
    for name in args.parts.split(","):
        print(f"== {name}", flush=True)
        start = time.monotonic()
        try:
            record["parts"][name] = parts[name]()
        except Exception as err:  # noqa: BLE001  (one part's failure is recorded, the rest run)
            record["parts"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        record["parts"][name].setdefault("seconds", round(time.monotonic() - start, 1))
        print(json.dumps({k: v for k, v in record["parts"][name].items()
                          if k not in ("runs", "failed")}), flush=True)
        with open(path, "w", encoding="utf-8") as f:  # written after every part
            json.dump(record, f, indent=1)
    ok = all(part.get("ok") for part in record["parts"].values())
    print(f"wrote {path}: {'all ok' if ok else 'FAILURES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
