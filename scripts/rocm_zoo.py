"""Every reduced zoo model and the 16-branch demo through the CLI for an AMD target, checked on the
code object (no AMD GPU needed; nothing runs).

For each model: ``tvm-rammer compile MODEL.onnx --target T -o m.so`` (the library must be written)
and ``tvm-rammer inspect MODEL.onnx --target T --json``; per rProgram the code object's figures must
satisfy the checks of ``tests/test_rocm.py`` (no scratch or VGPR spills, LDS <= 64 KiB, workgroup limit
>= vEU width, wave64, at least as many vEUs per CU as the placement assumed, no memory-ordering
problem). Prints a Markdown table (the one in benchmarks/README.md) and exits non-zero when a model
fails.

    python scripts/rocm_zoo.py [--target rammer/amd-mi300x] [--models a,b] [--out DIR] [--product]

By default with ``--no-unmeasured-check``: nothing is ever measured for an AMD target, so the
product's check (``RammerConfig.check_unmeasured``) keeps conv-heavy models on TVM's default
kernels, and their persistent kernels would go unchecked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import onnx

from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.rocm.report import problems_of

DEMO = ("branches16", "branches", {"n": 16})


def models(names=None) -> list:
    """(label, zoo name, kwargs): every reduced model and the 16-branch demo."""
    out = [(name, name, REDUCED[name]) for name in sorted(REDUCED)] + [DEMO]
    return [m for m in out if not names or m[0] in names]


def run(label, name, kwargs, target, out_dir, flags=()) -> dict:
    path = os.path.join(out_dir, f"{label}.onnx")
    onnx.save(get_model(name, **kwargs), path)
    start = time.perf_counter()
    compiled = subprocess.run(["tvm-rammer", "compile", path, "--target", target, "--no-progress",
                               *flags, "-o", os.path.join(out_dir, f"{label}.so")],
                              capture_output=True, text=True, check=False)
    compile_s = time.perf_counter() - start
    row = {"model": label, "compile_s": compile_s, "problems": []}
    if compiled.returncode != 0 or not os.path.exists(os.path.join(out_dir, f"{label}.so")):
        row["problems"].append("compile failed: " + compiled.stderr.strip().splitlines()[-1])
        return row
    start = time.perf_counter()
    inspected = subprocess.run(["tvm-rammer", "inspect", path, "--target", target, "--json",
                                "--no-progress", *flags], capture_output=True, text=True, check=False)
    row["inspect_s"] = time.perf_counter() - start
    if inspected.returncode != 0:
        row["problems"].append("inspect failed: " + inspected.stderr.strip().splitlines()[-1])
        return row
    summary = json.loads(inspected.stdout.strip().splitlines()[-1])
    programs = summary["programs"]
    row.update(rprograms=len(programs), launches=summary["launches"],
               veu_threads=max((p["veu_threads"] for p in programs), default=0),
               vgprs=max((p["code_object"]["vgprs"] for p in programs), default=0),
               sgprs=max((p["code_object"]["sgprs"] for p in programs), default=0),
               lds=max((p["code_object"]["lds_bytes"] for p in programs), default=0),
               scratch=max((p["code_object"]["scratch_bytes"] for p in programs), default=0),
               sgpr_spills=sum(p["code_object"]["sgpr_spills"] for p in programs),
               veus_per_cu=min((p["veus_per_cu_code_object"] for p in programs
                                if isinstance(p["veus_per_cu_code_object"], int)), default=0),
               acquires=sum(p["ordering"]["acquires"] for p in programs),
               releases=sum(p["ordering"]["releases"] for p in programs))
    for p in programs:
        row["problems"] += [f"{p['kernel']}: {x}" for x in problems_of(p)]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="rammer/amd-mi300x")
    parser.add_argument("--models", default="", help="comma-separated labels (default: all)")
    parser.add_argument("--out", default=None, help="directory for the ONNX files and libraries")
    parser.add_argument("--product", action="store_true",
                        help="as a user compiles: nothing is measured on an AMD target, so the "
                             "unmeasured check leaves conv-heavy rPrograms to TVM's default "
                             "(default: --no-unmeasured-check, every persistent kernel checked)")
    args = parser.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="rocm_zoo_")
    rows = []
    for label, name, kwargs in models([m for m in args.models.split(",") if m]):
        row = run(label, name, kwargs, args.target, out_dir,
                  () if args.product else ("--no-unmeasured-check",))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"| model ({args.target}) | compile s | inspect s | rPrograms | launches | vEU threads "
          "| max VGPRs | max SGPRs | max LDS B | max scratch B | min vEUs/CU | acquires | releases "
          "| problems |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["model"], f"{r['compile_s']:.0f}",
                 f"{r['inspect_s']:.0f}" if "inspect_s" in r else "-"]
        cells += [str(r.get(k, "-")) for k in ("rprograms", "launches", "veu_threads", "vgprs",
                                               "sgprs", "lds", "scratch", "veus_per_cu",
                                               "acquires", "releases")]
        print("| " + " | ".join(cells + ["; ".join(r["problems"]) or "none"]) + " |")
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
