"""Every rKernel version of every operator of the reduced zoo models, checked on the CPU.

    python3 scripts/version_sweep.py --out sweep.json                  # every model, float32
    python3 scripts/version_sweep.py alexnet squeezenet --precision float16 --out fp16.json

For each model (``tvm_rammer.models.REDUCED`` sizes) this runs the rammer pipeline up to dlight (the
operators as the backend sees them: fused PrimFuncs, unscheduled and dlight-scheduled), then makes
every candidate version ``tvm_rammer.tuning.versions`` draws from for each operator: the pipeline's
own schedule (dlight's, or our GEMVEpilogue rule's for a fused RNN cell), dlight under other tile
configurations and thread caps, dlight's Fallback, and
our templates (``tir_templates.templates``: spatial, cross-thread, tiled matmul, and the fast
families of ``gemm_templates``, ``conv_templates``, ``mma_templates``). Each version's scheduled
PrimFunc runs on llvm with its thread loops made serial (``tir_templates.serial_run``) on seeded
inputs, against the unscheduled PrimFunc on the same inputs; a version is valid when every buffer
is within ``tvm_rammer.numerics.KERNEL_TOLERANCE`` (relative, float32; 2e-2 for float16). A version
whose TIR stores past the end of a buffer without a predicate (``serial_run.stores_past_the_end``)
is reported wrong without being run, and each model is swept in a forked child process, so memory
corruption ends one model's sweep (reported), not the run.

What this check is, and is not: it runs the *TIR* of each schedule on the CPU, not the CUDA we
generate. It sees what a schedule computes (its loop nests, the regions of its caches and
write-backs, padding and predicates), the defect class of ``spatial_t128x4`` on a 7x7 plane. It
cannot see races, barriers, warp shuffles, the prelowered rTask rewrite, the persistent kernel's
coarsening loop, or nvcc: those are the CUDA emulator's (``tvm_rammer/checks/emulator/``, issue 23), which
runs the generated CUDA and complements this. In particular:

- coarsened variants (``rkernels.coarsenings``: several thread blocks of one version per rTask) run
  the same PrimFunc's blocks one after another; with serial threads every block already runs one
  after another, so this check is the same for all of them (``coarsenings`` is listed per version
  but not counted as separate versions);
- tensor-core versions (``mma_*``, float16 only) hold ``ldmatrix``/``mma.sync`` intrinsics llvm
  cannot build: listed with ``valid: null`` and the reason, never counted as checked;
- MetaSchedule records (``--tuning-db``) are not swept (no tuning database here).

One JSON record per (model, operator, version): ``model``, ``operator``, ``version``, ``source``,
``produced`` (``kernel_versions`` with the default options keeps it: the rest are dropped as
duplicates of a launch shape or over ``max_versions``), ``coarsenings``, ``valid`` (true, false, or
null when it could not run on the CPU, with ``reason``), ``max_rel_err``. The output file holds
``{"commit", "precision", "records": [...], "summary": {model: {...}}}`` (``--problems-only``:
only the records not valid); a Markdown table of the summary is printed. Exit status 1 when any
version is wrong.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import tirx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tir_templates.default_schedule import scheduled_by  # noqa: E402
from tir_templates.prelower import UnsupportedKernel, prelower  # noqa: E402
from tir_templates.serial_run import run_on_cpu, serial_threads, stores_past_the_end  # noqa: E402
from tir_templates.templates import template_schedules  # noqa: E402
from tvm_rammer.benchmarks.harness import git_commit  # noqa: E402
from tvm_rammer.config import RammerConfig  # noqa: E402
from tvm_rammer.driver.frontend import import_onnx  # noqa: E402
from tvm_rammer.models import MODELS, REDUCED, get_model  # noqa: E402
from tvm_rammer.numerics import KERNEL_TOLERANCE, relative_error, seeded_array  # noqa: E402
from tvm_rammer.driver.pipeline import rammer_passes  # noqa: E402
from tvm_rammer.scheduling.rkernels import coarsenings  # noqa: E402
from tvm_rammer.target import rammer_target, rkernel_target  # noqa: E402
from tvm_rammer.tuning.versions import (VersionOptions, dlight_schedules, func_key,  # noqa: E402
                                        kernel_versions, unscheduled_funcs)

FP16_TOLERANCE = 2e-2
DEFAULT_TARGET = {"kind": "cuda", "arch": "sm_90a"}
TENSOR_CORE_PREFIX = "mma_"


def operators(model: str, target, config: RammerConfig) -> list:
    """(name, unscheduled, dlight-scheduled) for every PrimFunc of ``model`` (reduced) as the
    rammer backend receives them: the pipeline run up to and including its dlight pass."""
    passes = rammer_passes(target, config)
    names = [p.info.name for p in passes]
    stop = names.index("StashUnscheduled") + 2  # the stash, then the dlight schedule pass
    mod = import_onnx(get_model(model, **REDUCED[model]))
    with target:
        mod = tvm.transform.Sequential(passes[:stop])(mod)
    stash = unscheduled_funcs(mod)
    found = []
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and gv.name_hint in stash:
            found.append((gv.name_hint, stash[gv.name_hint], func))
    return sorted(found, key=lambda item: item[0])


def candidates(scheduled, unscheduled, target) -> list:
    """(version, source, PrimFunc) in ``kernel_versions``' order, without its deduplication."""
    found = [("dlight", scheduled_by(scheduled) or "dlight", scheduled)]
    found += [(n, "dlight", f) for n, f in dlight_schedules(unscheduled, target)]
    found += [(t.name, "template", t.func) for t in template_schedules(unscheduled, target)]
    return found


def seeded_inputs(func, seed: int = 0) -> list:
    """One seeded array per parameter (``numerics.seeded_array``; outputs too, so an element a
    version never writes keeps a value the reference overwrites)."""
    rng = np.random.default_rng(seed)
    return [seeded_array(p.ty.shape, str(p.ty.dtype), rng) for p in func.params]


def max_rel_err(got: list, want: list) -> float:
    """The largest ``numerics.relative_error`` over all buffers (inputs nobody writes compare
    equal). Where the reference is not finite (a log of a negative input) the version must give the
    same NaN/inf; the error is taken over the finite elements."""
    errs = []
    for g, w in zip(got, want):
        g, w = g.astype("float64"), w.astype("float64")
        bad = ~np.isfinite(w)
        if bad.any():
            if not np.array_equal(np.isnan(g[bad]), np.isnan(w[bad])) or \
                    not np.array_equal(g[bad & ~np.isnan(w)], w[bad & ~np.isnan(w)]):
                errs.append(float("inf"))
                continue
            g, w = g[~bad], w[~bad]
        errs.append(relative_error(g, w))
    return max(errs, default=0.0)


def check(func, arrays, reference) -> tuple:
    """(max_rel_err or None, reason) of one scheduled PrimFunc run with serial threads; a version
    that would store past the end of a buffer (``stores_past_the_end``) is not run (it would
    corrupt this process's memory): infinite error, the stores named."""
    past = stores_past_the_end(func)
    if past:
        return float("inf"), "stores out of bounds: " + ", ".join(
            f"block {b} writes {buf} past dimension {d}" for b, buf, d in past)
    try:
        got = run_on_cpu(serial_threads(func), arrays)
    except Exception as err:  # pylint: disable=broad-except  (reported per version, not fatal)
        return None, "does not build on llvm: " + str(err).strip().splitlines()[-1][:200]
    return max_rel_err(got, reference), ""


def sweep_model(model: str, target, config: RammerConfig, tolerance: float, log) -> list:
    """Records for every (operator, candidate version) of ``model``."""
    rk_target = rkernel_target(target, config)
    records = []
    for name, unscheduled, scheduled in operators(model, target, config):
        produced = {v.key for v in kernel_versions(name, rk_target, scheduled=scheduled,
                                                   unscheduled=unscheduled,
                                                   options=VersionOptions())}
        arrays = seeded_inputs(unscheduled)
        reference = run_on_cpu(unscheduled, arrays)
        for version, source, func in candidates(scheduled, unscheduled, rk_target):
            record = {"model": model, "operator": name, "version": version, "source": source,
                      "produced": func_key(func) in produced}
            try:
                lowered = prelower(func, rk_target, name=name)
                record["coarsenings"] = coarsenings(lowered.num_rtasks)
            except UnsupportedKernel as err:
                record.update(valid=None, max_rel_err=None, coarsenings=[],
                              reason="prelower rejects it: " + str(err)[:200])
                records.append(record)
                continue
            if version.startswith(TENSOR_CORE_PREFIX):
                record.update(valid=None, max_rel_err=None,
                              reason="tensor-core intrinsics (ldmatrix/mma.sync): not runnable on "
                                     "llvm; the CUDA emulator checks these")
                records.append(record)
                continue
            err, reason = check(func, arrays, reference)
            record["valid"] = None if err is None else bool(err <= tolerance)
            record["max_rel_err"] = err if err is None or np.isfinite(err) else None
            if err is not None and not np.isfinite(err) and not reason:
                reason = "NaN/inf where the reference is finite"
            if reason:
                record["reason"] = reason
            records.append(record)
            if record["valid"] is False:
                log(f"  WRONG {model} {name} {version}: rel err {err:.3g} {reason}")
    return records


def sweep_isolated(model: str, target, config: RammerConfig, tolerance: float, log) -> list:
    """:func:`sweep_model` in a forked child process, so a version that corrupts memory in a way
    the checks do not foresee ends that model's sweep, not the whole run: then one record with
    ``valid: null`` and the child's exit status is returned for the model."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child():
        send.send(sweep_model(model, target, config, tolerance, log))
        send.close()

    proc = ctx.Process(target=child)
    proc.start()
    send.close()
    try:
        records = receive.recv()
    except EOFError:
        records = None
    proc.join()
    if records is None or proc.exitcode != 0:
        return [{"model": model, "operator": "*", "version": "*", "source": "", "produced": False,
                 "coarsenings": [], "valid": None, "max_rel_err": None,
                 "reason": f"the sweep process died (exit status {proc.exitcode})"}]
    return records


def summarize(records: list) -> dict:
    """model -> counts: operators; versions (prelower accepts them: each can be an rKernel);
    checked, wrong, and not runnable on llvm among them; how many wrong ones ``kernel_versions``
    produces; candidates prelower rejects (never a version); the wrong versions by name."""
    summary = {}
    for rec in records:
        row = summary.setdefault(rec["model"], {"operators": set(), "versions": 0, "checked": 0,
                                                "wrong": 0, "not_runnable": 0, "produced_wrong": 0,
                                                "rejected_by_prelower": 0, "wrong_versions": []})
        row["operators"].add(rec["operator"])
        if rec.get("reason", "").startswith("prelower rejects"):
            row["rejected_by_prelower"] += 1
            continue
        row["versions"] += 1
        if rec["valid"] is None:
            row["not_runnable"] += 1
            continue
        row["checked"] += 1
        if not rec["valid"]:
            row["wrong"] += 1
            row["produced_wrong"] += int(rec["produced"])
            row["wrong_versions"].append(f"{rec['operator']}:{rec['version']}")
    for row in summary.values():
        row["operators"] = len(row["operators"])
    return summary


def markdown(summary: dict) -> str:
    """The summary as a Markdown table."""
    lines = ["| model | operators | versions | checked | wrong | not runnable on llvm | "
             "rejected by prelower |", "|---|---|---|---|---|---|---|"]
    for model, row in summary.items():
        lines.append(f"| {model} | {row['operators']} | {row['versions']} | {row['checked']} | "
                     f"{row['wrong']} | {row['not_runnable']} | {row['rejected_by_prelower']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"zoo models (default: all of {', '.join(MODELS)})")
    parser.add_argument("--precision", choices=("float32", "float16"), default="float32")
    parser.add_argument("--out", help="write the JSON here (default: stdout)")
    parser.add_argument("--problems-only", action="store_true",
                        help="keep only the records that are not valid in the JSON")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    logging.getLogger("tvm_rammer").setLevel(logging.WARNING)
    config = RammerConfig(precision=args.precision)
    target = rammer_target(DEFAULT_TARGET)
    tolerance = FP16_TOLERANCE if args.precision == "float16" else KERNEL_TOLERANCE
    commit = git_commit(ROOT, short=True)  # the code swept: HEAD when the sweep starts
    records = []
    summary = {}
    for model in args.models or list(MODELS):
        start = time.perf_counter()
        found = sweep_isolated(model, target, config, tolerance,
                               lambda m: print(m, file=sys.stderr, flush=True))
        records += found
        print(f"{model}: {len(found)} candidates in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        summary = summarize(records)
        doc = {"commit": commit, "precision": args.precision, "tolerance": tolerance,
               "records": [r for r in records if not (args.problems_only and r["valid"])],
               "summary": summary}
        if args.out:  # after every model: a run stopped early keeps what it checked
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if not args.out:
        print(json.dumps(doc, indent=1))
    print(markdown(summary), file=sys.stderr)
    return 1 if any(row["wrong"] for row in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
