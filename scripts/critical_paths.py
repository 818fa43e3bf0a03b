"""Predicted time and critical path of models with the critical-path rewrites off and on (no GPU).

    python3 scripts/critical_paths.py lstm_tc seq2seq            # full size (minutes per model)
    python3 scripts/critical_paths.py --reduced lstm_tc          # tvm_rammer.models.REDUCED sizes
    python3 scripts/critical_paths.py lstm_tc --configs after,after-no-batch

One JSON line per (model, configuration): rPrograms, operators, rTasks, the policy's predicted time
(sum over rPrograms), the critical path (dependent operators and predicted us) and each rProgram's
work bound, then a Markdown table of the rows. The numbers are the analytical cost model's
(``time_source: analytical``): a guide to compare graphs, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import time

from tvm_rammer.config import RammerConfig
from tvm_rammer.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model

CONFIGS = {
    "before": RammerConfig(tail_fusion=False, prologue_fusion=False, split_concat_matmul=False,
                           batch_shared_matmuls=False, gemv_epilogue=False),
    "after-no-epilogue": RammerConfig(gemv_epilogue=False),
    "after": RammerConfig(),
    "after-no-batch": RammerConfig(batch_shared_matmuls=False),
    "after-no-prologue": RammerConfig(prologue_fusion=False),
}


def measure(name: str, label: str, reduced: bool, target: str) -> dict:
    """One row: inspect `name` under CONFIGS[label]."""
    model = get_model(name, **(REDUCED[name] if reduced else {}))
    start = time.time()
    summary = inspect_model(model, target, CONFIGS[label])
    path = summary["critical_path"] or {}
    return {"model": name, "reduced": reduced, "config": label, "rprograms": summary["rprograms"],
            "operators": sum(len(p["operators"]) for p in summary["programs"]),
            "rtasks": sum(summary["rtasks"]),
            "predicted_us": round(sum(p["predicted_us"] for p in summary["programs"]), 1),
            "critical_path": path,
            "work_us": [p["critical_path"]["work_us"] for p in summary["programs"]
                        if p.get("critical_path")],
            "seconds": round(time.time() - start, 1)}


def table(rows: list) -> str:
    """Markdown: one line per row."""
    lines = ["| model | config | rPrograms | predicted us | critical path: operators | "
             "critical path: us |", "|---|---|---|---|---|---|"]
    for r in rows:
        cp = r["critical_path"]
        lines.append(f"| {r['model']} | {r['config']} | {r['rprograms']} | {r['predicted_us']:,.0f} | "
                     f"{cp.get('operators', '-')} | {cp.get('predicted_us', 0):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--reduced", action="store_true")
    parser.add_argument("--configs", default="before,after",
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: %(default)s)")
    parser.add_argument("--target", default="rammer/nvidia-h100")
    args = parser.parse_args()
    labels = args.configs.split(",")
    unknown = [c for c in labels if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    rows = []
    for name in args.models:
        for label in labels:
            rows.append(measure(name, label, args.reduced, args.target))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
