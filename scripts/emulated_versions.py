"""Every rKernel version of every placeable operator of the reduced zoo models, checked against TVM's
default kernel on the CPU emulator (issue 23 item 4), as ``tvm-rammer inspect MODEL --emulate`` does.

    python3 scripts/emulated_versions.py --out emu.json                    # every model, float32
    python3 scripts/emulated_versions.py alexnet --precision float16 --out emu16.json

Per model (``tvm_rammer.models.REDUCED`` sizes, target ``rammer/nvidia-h100``, nothing measured:
``RammerConfig(emulate_versions=True, profile=False)``) this runs ``inspection.inspect_model`` in a
child process (a crash or a hang ends one model, reported, not the run) and reads back each placed
operator's ``versions_checked`` and ``dropped``, the operators left TVM's default kernel because
their pipeline version was not valid on the emulator, and the emulator's figures (lowering and g++
seconds, g++ builds, run seconds) from the back end's log line.

Unlike ``scripts/version_sweep.py`` (the TIR of each schedule run serially on llvm) this runs the
CUDA we generate for each version and for TVM's default kernel, threads, barriers, warp shuffles and
tensor-core PTX included. It checks the versions ``kernel_versions`` keeps for the compile (at most
``VersionOptions.max_versions`` per operator, one per launch shape, those that can share a vEU).

Output: ``{"commit", "precision", "models": {model: {...}}}`` and a Markdown table on stdout.
Exit status 1 when any version is wrong or a model failed.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tvm_rammer.benchmarks.harness import git_commit  # noqa: E402

TARGET = "rammer/nvidia-h100"
EMULATOR_LINE = "rKernel versions checked on the emulator"


class _Figures(logging.Handler):
    """Keeps the back end's emulator figures (its log line's stats dict)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.stats: dict = {}

    def emit(self, record):
        if EMULATOR_LINE in record.getMessage() and isinstance(record.args, tuple):
            for k, v in record.args[1].items():
                self.stats[k] = round(self.stats.get(k, 0) + v, 3)


def check_model(model: str, precision: str, separate: bool = False) -> dict:
    """One model's record (runs in the child process); ``separate``: one g++ build per kernel
    instead of one per compile (to measure what the joint module saves)."""
    import functools

    from tvm_rammer.checks.emulator import versions as emulated
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.views.inspection import inspect_model
    from tvm_rammer.models import REDUCED, get_model

    if separate:  # the back end's registered check looks EmulatedValidator up here at each call
        emulated.EmulatedValidator = functools.partial(emulated.EmulatedValidator, joint=False)
    log = logging.getLogger("tvm_rammer")
    figures = _Figures()
    log.addHandler(figures)
    log.setLevel(logging.INFO)
    start = time.perf_counter()
    summary = inspect_model(get_model(model, **REDUCED.get(model, {})), TARGET,
                            RammerConfig(emulate_versions=True, profile=False, precision=precision))
    operators = [{"operator": op["name"], "versions_checked": op.get("versions_checked"),
                  "dropped": op.get("dropped", [])}
                 for program in summary["programs"] for op in program["operators"]]
    left = [u for u in summary["unplaced"] if "emulator" in u["reason"]]
    return {"operators": operators, "left_default_by_emulator": left, "emulator": figures.stats,
            "seconds": round(time.perf_counter() - start, 1)}


def summarize(record: dict) -> dict:
    checks = [c for op in record["operators"] for c in (op["versions_checked"] or [])]
    wrong = [f"{op['operator']}:{c['version']}" for op in record["operators"]
             for c in (op["versions_checked"] or []) if c["valid"] is False]
    unchecked = [f"{op['operator']}:{c['version']}" for op in record["operators"]
                 for c in (op["versions_checked"] or []) if c["valid"] is None]
    missing = [op["operator"] for op in record["operators"] if op["versions_checked"] is None]
    return {"operators": len(record["operators"]), "checked": len(checks), "wrong": wrong,
            "unchecked": unchecked, "without_check": missing,
            "left_default": [u["name"] for u in record["left_default_by_emulator"]]}


def markdown(models: dict) -> str:
    lines = ["| model | operators | versions checked | found wrong | not checkable | left TVM default "
             "| which | g++ builds / s | lowering+g++ s | run s | model s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rec in models.items():
        if "error" in rec:
            lines.append(f"| {name} | failed: {rec['error'][:120]} |||||||||| ")
            continue
        s, e = rec["summary"], rec["emulator"]
        which = ", ".join(s["wrong"] + s["unchecked"] + s["left_default"]) or "-"
        lines.append(f"| {name} | {s['operators']} | {s['checked']} | {len(s['wrong'])} | "
                     f"{len(s['unchecked'])} | {len(s['left_default'])} | {which} | "
                     f"{e.get('gxx_builds', 0)} / {e.get('gxx_s', 0)} | {e.get('build_s', 0)} | "
                     f"{e.get('run_s', 0)} | {rec['seconds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from tvm_rammer.models import REDUCED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"zoo models (default: {', '.join(REDUCED)})")
    parser.add_argument("--precision", choices=("float32", "float16"), default="float32")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per model")
    parser.add_argument("--separate-builds", action="store_true",
                        help="one g++ build per kernel (default: one per compile), to measure")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(check_model(args.child, args.precision, args.separate_builds)))
        return 0
    unknown = [m for m in args.models if m not in REDUCED]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(REDUCED)}")
    # at the start: each child imports the tree as it is then
    models, commit = {}, git_commit(ROOT, short=True)
    for model in args.models or list(REDUCED):
        print(f"{model} ...", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", model, "--precision",
                                   args.precision] + (["--separate-builds"] if args.separate_builds
                                                      else []), capture_output=True, text=True,
                                  timeout=args.timeout, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
            record = json.loads(proc.stdout.strip().splitlines()[-1])
            record["summary"] = summarize(record)
        except (subprocess.TimeoutExpired, RuntimeError, ValueError, IndexError) as err:
            record = {"error": f"{type(err).__name__}: {err}"}
        models[model] = record
        doc = {"commit": commit, "commit_now": git_commit(ROOT, short=True),
               "precision": args.precision, "target": TARGET,
               "separate_builds": args.separate_builds, "models": models}
        if args.out:  # after every model: a run stopped early keeps what it checked
            Path(args.out).write_text(json.dumps(doc, indent=1))
    print(markdown(models))
    bad = any("error" in r or r["summary"]["wrong"] for r in models.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
