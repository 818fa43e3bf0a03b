"""Compile time of every zoo model: the rammer pipeline against TVM's default pipeline (no GPU needed).

    python3 scripts/compile_times.py                      # every Table-1 and IOS model, full size
    python3 scripts/compile_times.py lstm_tc nasnet_cifar --out times.json
    python3 scripts/compile_times.py --build --no-build deepspeech2   # tvm.compile's build too
    python3 scripts/compile_times.py --build --nvcc googlenet         # and nvcc of its CUDA source
    python3 scripts/compile_times.py --build --repeat 3 alexnet       # median of three runs
    python3 scripts/compile_times.py --build --nvcc --no-unmeasured-check --no-rkernel-functions googlenet

Each model is compiled in a fresh Python process, one model at a time (side-by-side jobs would
distort each other's times): the ONNX model is imported, then lowered by the rammer pipeline
(``RammerConfig(profile=False)``: nothing measured, no database read, as on a machine without a GPU)
under the phase timer of ``--timings`` (``tvm_rammer.driver.timings.PipelineProgress``), then by TVM's
default CUDA pipeline: the Relax pipelines (what ``tvm-rammer inspect`` runs). With ``--build``,
each lowered module is then built as ``tvm.compile`` builds it (TIR lowering, CUDA and host code
generation): the "with build" columns are what a user waits for in ``tvm.compile`` on a machine
without a GPU, where TVM keeps the CUDA source. On a GPU host ``tvm.compile`` also compiles that
source (NVRTC, or nvcc with ``TVM_CUDA_COMPILE_MODE=nvcc``); ``--nvcc`` times nvcc on it here.
With ``--repeat N`` each model is timed N times (a fresh process each) and every time reported is
the median of its N samples (all kept in the row). One JSON line per model, then a Markdown table:
seconds of each pipeline, their ratio, and the three largest steps of the rammer one (the back
end's own phases in place of the back end as a whole).

``--nvcc`` also keeps nvcc's own phase times (``nvcc --time``: ``cicc``, NVVM's optimiser, and
``ptxas``) summed over the module's sources, in ``rammer_nvcc_phases`` / ``default_nvcc_phases``:
on a shared machine these say more than the wall times do when two builds of one source are compared.
``--no-unmeasured-check`` builds every rProgram the policy makes (``RammerConfig(check_unmeasured=
False)``): without measured times the check keeps most CNN operators as TVM's default kernels, so
there is hardly a persistent kernel to compile. ``--rkernel-functions`` / ``--no-rkernel-functions``
set ``RammerConfig.rkernel_functions`` (each rKernel body its own device function); the row records
both settings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODELS = ("resnext29", "nasnet_cifar", "alexnet", "deepspeech2", "lstm_tc", "seq2seq",
          "inception_v3", "squeezenet", "googlenet", "randwire")

_CHILD = r"""
import json, sys, time
import tvm
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.views.inspection import lower_default
from tvm_rammer.driver.launches import count_launches
from tvm_rammer.models import get_model
from tvm_rammer.driver.timings import PipelineProgress

name, target, build, nvcc = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
options = json.loads(sys.argv[5])  # RammerConfig fields besides profile=False
config = RammerConfig(profile=False, **options)


def nvcc_phases(source):
    # source compiled as tir_templates.cuda_resources does (nvcc -cubin for sm_90a, ptxas -v), with
    # --time: {phase (gcc preprocessing, cicc, ptxas, ...): ms}
    import csv, os, subprocess, tempfile
    from tir_templates.cuda_resources import find_tool
    with tempfile.TemporaryDirectory(prefix="compile_times_") as work:
        src, out, times = (os.path.join(work, n) for n in ("k.cu", "k.cubin", "t.csv"))
        with open(src, "w") as f:
            f.write(source)
        subprocess.run([find_tool("nvcc") or "nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v",
                        "--time", times, "-o", out, src], check=True, capture_output=True)
        phases = {}
        with open(times) as f:
            for rec in csv.reader(f):
                if len(rec) >= 8 and rec[-1].strip() == "ms":
                    phase = rec[1].strip()
                    phases[phase] = phases.get(phase, 0.0) + float(rec[-2])
        return phases


start = time.perf_counter()
mod = import_onnx(get_model(name))
import_s = time.perf_counter() - start
progress = PipelineProgress()
start = time.perf_counter()
with tvm.transform.PassContext(instruments=[progress]):
    ours = lower(mod, target, config)
rammer_s = time.perf_counter() - start
start = time.perf_counter()
theirs = lower_default(mod, target)
default_s = time.perf_counter() - start
steps = progress.steps + [("  " + p, s) for p, s in progress.phases]
row = {"model": name, "import_s": round(import_s, 2), "rammer_s": round(rammer_s, 2),
       "default_s": round(default_s, 2), "launches": count_launches(ours),
       "default_launches": count_launches(theirs),
       "phases": [[n, round(s, 2)] for n, s in steps],
       "check_unmeasured": config.check_unmeasured, "rkernel_functions": config.rkernel_functions}
if build:  # what tvm.compile adds: TIR lowering, CUDA and host codegen (no CUDA compile without a GPU)
    from tvm_rammer.run.runner import resolve_target
    from tvm_rammer.target import plain_target
    rammer = resolve_target(target)
    for key, lowered, tgt in (("rammer_build_s", ours, rammer), ("default_build_s", theirs,
                                                                 plain_target(rammer))):
        start = time.perf_counter()
        ex = tvm.compile(lowered, target=tgt, relax_pipeline=None)
        row[key] = round(time.perf_counter() - start, 2)
        if nvcc:  # what a GPU host adds: the CUDA source compiled (nvcc for sm_90a, as TVM's nvcc mode)
            sources = [m.inspect_source() for m in ex.mod.imports[0].imports if m.kind == "cuda"]
            start = time.perf_counter()
            phases = {}
            for source in sources:
                for phase, ms in nvcc_phases(str(source)).items():
                    phases[phase] = phases.get(phase, 0.0) + ms / 1000
            row[key.replace("build", "nvcc")] = round(time.perf_counter() - start, 2)
            row[key.replace("build_s", "nvcc_phases")] = {p: round(v, 2) for p, v in phases.items()}
print(json.dumps(row))
"""


def measure(name: str, target: str, timeout: float, build: bool = False,
            nvcc: bool = False, options: dict | None = None) -> dict:
    """One model in a fresh interpreter; a failure or timeout becomes a row saying so.
    ``options``: RammerConfig fields for the rammer pipeline (besides ``profile=False``)."""
    # on a GPU host the build compiles the CUDA source: timed as nvcc, not as a cached binary
    env = {**os.environ, "TQDM_DISABLE": "1", "TVM_RAMMER_BINARY_CACHE": "off"}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, name, target, str(int(build)),
                               str(int(nvcc)), json.dumps(options or {})],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": name, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


TIMED = ("rammer_s", "default_s", "rammer_build_s", "default_build_s", "rammer_nvcc_s",
         "default_nvcc_s")


def median_row(samples: list) -> dict:
    """One row from the repetitions of a model: each time the median of its samples (all kept
    under ``samples``), the phases of the repetition whose rammer pipeline took the median time."""
    ok = [r for r in samples if "error" not in r]
    if not ok:
        return samples[-1]
    middle = statistics.median_low(r["rammer_s"] for r in ok)
    row = dict(next(r for r in ok if r["rammer_s"] == middle))
    row["samples"] = {k: [r[k] for r in ok] for k in TIMED if k in row}
    for key, values in row["samples"].items():
        row[key] = round(statistics.median(values), 2)
    if len(ok) < len(samples):
        row["failed_repetitions"] = [r["error"] for r in samples if "error" in r]
    return row


def _total(r: dict, system: str) -> float | None:
    """Seconds of ``system``'s pipeline and build, or None when the build was not timed."""
    if f"{system}_build_s" not in r:
        return None
    return r[f"{system}_s"] + r[f"{system}_build_s"]


def _phases(r: dict, system: str) -> str:
    phases = r.get(f"{system}_nvcc_phases") or {}
    return f"{phases.get('cicc', 0):.1f} + {phases.get('ptxas', 0):.1f}" if phases else "-"


def table(rows: list) -> str:
    """Markdown: one line per model."""
    out = ["| model | rammer s | default s | ratio | with build: rammer s | default s | ratio | "
           "launches (default) | largest rammer phases |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['error']} | | | | | | | |")
            continue
        ours, theirs = _total(r, "rammer"), _total(r, "default")
        built = ours is not None and theirs is not None
        totals = f"{ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}" if built else "- | - | -"
        top = sorted((p for p in r["phases"] if p[0] != "RammerBackend"), key=lambda p: -p[1])[:3]
        phases = ", ".join(f"{n.strip()} {s:.1f}" for n, s in top)
        out.append(f"| {r['model']} | {r['rammer_s']:.1f} | {r['default_s']:.1f} | "
                   f"{r['rammer_s'] / max(r['default_s'], 1e-9):.2f} | {totals} | {r['launches']} "
                   f"({r['default_launches']}) | {phases} |")
    timed = [r for r in rows if "rammer_nvcc_s" in r]
    if timed:
        out += ["", "| model | nvcc of the built CUDA source: rammer s | default s | "
                "cicc + ptxas: rammer s | default s |", "|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['rammer_nvcc_s']:.1f} | {r['default_nvcc_s']:.1f} | "
                f"{_phases(r, 'rammer')} | {_phases(r, 'default')} |" for r in timed]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--target", default="rammer/nvidia-h100")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per model")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--build", action="store_true",
                        help="also time what tvm.compile adds to each pipeline: TIR lowering and "
                             "CUDA and host code generation of the lowered module")
    parser.add_argument("--nvcc", action="store_true",
                        help="with --build, also time nvcc compiling each built module's CUDA "
                             "source for sm_90a (what a GPU host adds; needs nvcc)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time each model this many times, each in a fresh process, and "
                             "report the median (times under 2 s vary by 20-50%% on a 2-core "
                             "machine)")
    parser.add_argument("--no-build", dest="no_build", nargs="*", default=[],
                        help="models to time without --build (e.g. one whose default build is "
                             "too long to wait for)")
    parser.add_argument("--no-unmeasured-check", dest="check_unmeasured", action="store_false",
                        help="RammerConfig(check_unmeasured=False): build every rProgram the policy "
                             "makes, as a persistent kernel, even without measured times")
    parser.add_argument("--rkernel-functions", dest="rkernel_functions",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="RammerConfig.rkernel_functions (default: the config's default)")
    args = parser.parse_args()
    options = {} if args.check_unmeasured else {"check_unmeasured": False}
    if args.rkernel_functions is not None:
        options["rkernel_functions"] = args.rkernel_functions
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give at least 1")
    rows = []
    for name in args.models:
        build = args.build and name not in args.no_build
        rows.append(median_row([measure(name, args.target, args.timeout, build=build,
                                        nvcc=build and args.nvcc, options=options)
                                for _ in range(args.repeat)]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
