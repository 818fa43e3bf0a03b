"""The ONNX backend's node tests, lowered by TVM's default pipeline and by tvm-rammer (no GPU needed).

About 1,900 single-operator models generated with onnx's own case generators
(``onnx.backend.test.case.node``). For each model: import it with TVM's ONNX frontend, lower it with
TVM's default CUDA Relax pipeline (``inspection.lower_default``) and with the rammer pipeline
(``frontend.lower``, ``RammerConfig(profile=False)``), and count the kernel launches of both. What
must hold: every model the default pipeline lowers also lowers with tvm-rammer, with no more launches.

Each model runs in a worker subprocess with a time limit (a worker that hangs or crashes is replaced,
and the model counts as failed). The whole suite::

    python3 -m tvm_rammer.checks.node_suite --jobs 2 --json benchmarks/results/node_suite.json

A seeded sample: ``--sample 200 --seed 0``; one operator: ``--match nllloss``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass

from .workers import run_jobs

TARGET = "rammer/nvidia-h100"
DEFAULT_TIMEOUT_S = 120.0

# per-model outcomes; the first three break the contract when the default pipeline lowers the model
RAMMER_FAILS = "rammer_fails"
MORE_LAUNCHES = "more_launches"
TIMEOUT = "timeout"
OK = "ok"
DEFAULT_FAILS = "default_fails"
NOT_IMPORTED = "not_imported"
PROBLEMS = (RAMMER_FAILS, MORE_LAUNCHES, TIMEOUT)


@dataclass
class CaseResult:
    """One model's outcome (launch counts are None where that pipeline failed)."""

    name: str
    status: str
    default_launches: int | None = None
    rammer_launches: int | None = None
    error: str = ""
    seconds: float = 0.0


def node_cases() -> list:
    """``[(name, serialized ModelProto)]`` of every node test case, sorted by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow float casts on purpose
        cases = collect_testcases()
    seen = {}
    for case in cases:
        if case.model is not None:
            seen.setdefault(case.name, case.model.SerializeToString())
    return sorted(seen.items())


def select(cases: list, sample: int | None = None, seed: int = 0, match: str | None = None,
           include: tuple = ()) -> list:
    """The cases whose name matches ``match`` (a regex), then a seeded sample of ``sample`` of them,
    plus every case named in ``include`` (names or regexes)."""
    chosen = [c for c in cases if match is None or re.search(match, c[0])]
    if sample is not None and sample < len(chosen):
        chosen = random.Random(seed).sample(chosen, sample)
    if include:
        names = {c[0] for c in chosen}
        chosen += [c for c in cases if c[0] not in names and any(re.fullmatch(p, c[0]) for p in include)]
    return sorted(chosen)


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return f"{type(err).__name__}: {text}"[:400]


def check_model(name: str, model: bytes, target: str = TARGET) -> CaseResult:
    """Lower one model with both pipelines and compare (runs in the worker)."""
    import onnx

    from ..config import RammerConfig
    from ..driver.frontend import import_onnx, lower
    from ..views.inspection import lower_default
    from ..driver.launches import count_launches

    start = time.monotonic()
    result = CaseResult(name, OK)
    try:
        mod = import_onnx(onnx.load_from_string(model))
    except Exception as err:  # noqa: BLE001  (any import failure: out of scope for both)
        result.status, result.error = NOT_IMPORTED, _first_line(err)
        return result
    try:
        result.default_launches = count_launches(lower_default(mod, target))
    except Exception as err:  # noqa: BLE001
        result.status, result.error = DEFAULT_FAILS, _first_line(err)
    try:
        result.rammer_launches = count_launches(lower(mod, target, RammerConfig(profile=False)))
    except Exception as err:  # noqa: BLE001
        if result.status == OK:
            result.status, result.error = RAMMER_FAILS, _first_line(err)
    if result.status == OK and result.rammer_launches > result.default_launches:
        result.status = MORE_LAUNCHES
    result.seconds = time.monotonic() - start
    return result


def _check_job(name: str, payload: tuple) -> dict:
    """Worker side of :func:`run_cases`: payload = (model bytes, target)."""
    import tvm_rammer  # noqa: F401  (registers the rammer target tags)

    model, target = payload
    return asdict(check_model(name, model, target=target))


def run_cases(cases: list, target: str = TARGET, jobs: int = 1,
              timeout: float = DEFAULT_TIMEOUT_S, progress=None) -> list:
    """CaseResults of ``cases`` (``[(name, model bytes)]``), in the order given, each lowered in a
    worker subprocess (``workers.run_jobs``). ``progress``: called with each result as it comes."""
    def on_result(name, result, why):
        if progress is not None:
            progress(_as_result(name, result, why, timeout))

    done = run_jobs("tvm_rammer.checks.node_suite:_check_job",
                    [(name, (model, target)) for name, model in cases], jobs, timeout, on_result)
    return [_as_result(name, *done[name], timeout) for name, _ in cases]


def _as_result(name, result, why, timeout) -> CaseResult:
    if result is None:
        return CaseResult(name, TIMEOUT, error=f"worker {why}", seconds=timeout)
    return CaseResult(**result)


def summarize(results: list) -> dict:
    """Counts per outcome, the operator-level problem list, and the launch totals."""
    counts = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lowered_default = [r for r in results if r.default_launches is not None]
    both = [r for r in lowered_default if r.rammer_launches is not None]
    return {
        "models": len(results),
        "imported": len(results) - counts.get(NOT_IMPORTED, 0),
        "default_lowers": len(lowered_default),
        "rammer_lowers": sum(r.rammer_launches is not None for r in results),
        "counts": counts,
        "problems": [asdict(r) for r in results if r.status in PROBLEMS],
        "fewer_launches": sum(r.rammer_launches < r.default_launches for r in both),
        # TVM's default pipeline fails, tvm-rammer compiles: the models only tvm-rammer lowers
        "default_fails_rammer_lowers": sorted(r.name for r in results if r.status == DEFAULT_FAILS
                                              and r.rammer_launches is not None),
        "default_launches_total": sum(r.default_launches for r in both),
        "rammer_launches_total": sum(r.rammer_launches for r in both),
    }


def format_summary(summary: dict) -> str:
    lines = [f"{summary['models']} models, {summary['imported']} imported by TVM's ONNX frontend; "
             f"TVM default lowers {summary['default_lowers']}, tvm-rammer lowers "
             f"{summary['rammer_lowers']}",
             f"tvm-rammer fails where the default lowers: {summary['counts'].get(RAMMER_FAILS, 0)}; "
             f"more launches: {summary['counts'].get(MORE_LAUNCHES, 0)}; timeouts/crashes: "
             f"{summary['counts'].get(TIMEOUT, 0)}; fewer launches: {summary['fewer_launches']}",
             f"TVM default fails, tvm-rammer lowers: {len(summary['default_fails_rammer_lowers'])}"
             f" of {summary['counts'].get(DEFAULT_FAILS, 0)} the default fails"]
    for p in summary["problems"]:
        lines.append(f"  {p['status']:<14} {p['name']}: default {p['default_launches']}, rammer "
                     f"{p['rammer_launches']} {p['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tvm_rammer.checks.node_suite",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=None, help="a seeded sample of this many")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--match", default=None, help="only cases whose name matches this regex")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default: 1)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds per model (default: %(default)s)")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--json", default=None, metavar="PATH", help="write every result here")
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-model lines")
    args = parser.parse_args(argv)
    cases = select(node_cases(), args.sample, args.seed, args.match)
    start = time.monotonic()
    done = [0]

    def progress(result):
        done[0] += 1
        if not args.quiet and result.status in PROBLEMS:
            print(f"[{done[0]}/{len(cases)}] {result.status} {result.name}: {result.error}",
                  flush=True)

    results = run_cases(cases, args.target, args.jobs, args.timeout, progress)
    summary = summarize(results)
    summary["seconds"] = round(time.monotonic() - start, 1)
    print(format_summary(summary))
    print(f"{summary['seconds']} s, {args.jobs} job(s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "results": [asdict(r) for r in results]}, f, indent=1)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
