"""``gpu_lease.sh plan``: the lease's run, step by step, with estimated seconds.

In: the lease folder ``prepare`` wrote (``.lease/index.json`` and its manifests). Out (stdout): one
line per step (``name  seconds  what``), the install and the overheads outside ``run``, and last
``total: N s``: the seconds ``run`` is expected to take, kernels step excluded (it takes what the
budget leaves). The estimates are ``tvm_rammer.runtime.lease_steps.steps``' (the same ones ``run``
bounds each step by): the H200 latencies of earlier leases (``benchmarks/results/gpu-*``), library
and weight sizes, and fixed costs of loading and of the onnxruntime reference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tvm_rammer.runtime.lease_steps import BUDGET_S, steps

INSTALL_S = 20.0  # unpack TVM's runtime (xz) and pip-install two wheels into /tmp
LEASE_S = 900.0  # the whole lease: start, transfers, give-back included


def plan(lease: Path) -> tuple:
    """``(rows, total_s)``: rows ``(name, estimate_s or None, what)`` in run order, the install
    first; total = the install + every step with an estimate."""
    rows = [("install", INSTALL_S, "TVM runtime (xz) + tvm-ffi and onnx2torch wheels into /tmp")]
    for s in steps(lease):
        rows.append((s["name"], s["estimate_s"], s["what"]))
    total = sum(e for _, e, _ in rows if e)
    return rows, total


def format_plan(rows: list, total: float, budget_s: float = BUDGET_S) -> str:
    lines = [f"{'step':<24} {'est s':>7}  what"]
    for name, est, what in rows:
        shown = f"{est:7.1f}" if est else "   rest"
        lines.append(f"{name:<24} {shown}  {what}")
    left = budget_s - total
    lines.append(f"(run's budget {budget_s:.0f} s of the {LEASE_S:.0f} s lease; "
                 f"{max(left, 0):.0f} s left for the kernels step)")
    lines.append(f"total: {int(round(total))} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_lease.sh plan", description=__doc__.split("\n")[0])
    p.add_argument("--lease", default=".lease")
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = p.parse_args(argv)
    lease = Path(args.lease)
    if not (lease / "index.json").exists():
        print(f"gpu_lease.sh plan: error: {lease}/index.json missing: run "
              "`bash scripts/gpu_lease.sh prepare` first", file=sys.stderr)
        return 2
    rows, total = plan(lease)
    print(format_plan(rows, total, args.budget_s))
    return 0 if total <= args.budget_s else 1


if __name__ == "__main__":
    sys.exit(main())
