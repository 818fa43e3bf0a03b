"""Predicted time and critical path of models with the critical-path rewrites off and on (no GPU).

    python3 scripts/critical_paths.py lstm_tc seq2seq            # full size (minutes per model)
    python3 scripts/critical_paths.py --reduced lstm_tc          # tvm_rammer.models.REDUCED sizes
    python3 scripts/critical_paths.py lstm_tc --configs after,after-no-batch
    python3 scripts/critical_paths.py lstm_tc --l2-bw 4000 --l2-bw 7000   # the cost model's L2 figure

One JSON line per (model, configuration): rPrograms, operators, rTasks, the policy's predicted time
(sum over rPrograms), the critical path (dependent operators and predicted us) and each rProgram's
work bound, then a Markdown table of the rows. The numbers are the analytical cost model's
(``time_source: analytical``): a guide to compare graphs, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from tvm_rammer.config import RammerConfig
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model

CONFIGS = {
    "before": RammerConfig(tail_fusion=False, prologue_fusion=False, split_concat_matmul=False,
                           batch_shared_matmuls=False, gemv_epilogue=False),
    "after-no-epilogue": RammerConfig(gemv_epilogue=False),
    "after": RammerConfig(),
    "after-no-batch": RammerConfig(batch_shared_matmuls=False),
    "after-no-prologue": RammerConfig(prologue_fusion=False),
}


def measure(name: str, label: str, reduced: bool, target: str, l2_bw: float | None = None) -> dict:
    """One row: inspect `name` under CONFIGS[label] (the cost model's L2 bandwidth ``l2_bw`` GB/s
    when given)."""
    model = get_model(name, **(REDUCED[name] if reduced else {}))
    start = time.time()
    config = CONFIGS[label] if l2_bw is None else dataclasses.replace(CONFIGS[label], l2_bw_gbps=l2_bw)
    summary = inspect_model(model, target, config)
    path = summary["critical_path"] or {}
    return {"model": name, "reduced": reduced, "config": label, "l2_bw_gbps": l2_bw,
            "rprograms": summary["rprograms"],
            "operators": sum(len(p["operators"]) for p in summary["programs"]),
            "rtasks": sum(summary["rtasks"]),
            "predicted_us": round(sum(p["predicted_us"] for p in summary["programs"]), 1),
            "critical_path": path,
            "work_us": [p["critical_path"]["work_us"] for p in summary["programs"]
                        if p.get("critical_path")],
            "seconds": round(time.time() - start, 1)}


def table(rows: list) -> str:
    """Markdown: one line per row."""
    lines = ["| model | config | L2 GB/s | rPrograms | predicted us | critical path: operators | "
             "critical path: us |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cp = r["critical_path"]
        l2 = "default" if r.get("l2_bw_gbps") is None else f"{r['l2_bw_gbps']:,.0f}"
        lines.append(f"| {r['model']} | {r['config']} | {l2} | {r['rprograms']} | "
                     f"{r['predicted_us']:,.0f} | "
                     f"{cp.get('operators', '-')} | {cp.get('predicted_us', 0):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--reduced", action="store_true")
    parser.add_argument("--configs", default="before,after",
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: %(default)s)")
    parser.add_argument("--target", default="rammer/nvidia-h100")
    parser.add_argument("--l2-bw", type=float, action="append", default=None, metavar="GBPS",
                        help="the cost model's L2 bandwidth in GB/s (repeatable: one row per value; "
                             "default: the cost model's own)")
    args = parser.parse_args()
    labels = args.configs.split(",")
    unknown = [c for c in labels if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    rows = []
    for name in args.models:
        for label in labels:
            for l2_bw in args.l2_bw or [None]:
                rows.append(measure(name, label, args.reduced, args.target, l2_bw))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
