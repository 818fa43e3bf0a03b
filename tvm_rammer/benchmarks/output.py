"""Results out: derived columns, the terminal table, the JSON file and the bar chart.

* ``add_derived(doc)``: per system ``vs_floor`` (latency / floor) and ``speedup_vs_default``
  (tvm-default latency / latency); per model ``best_other`` (the fastest timed system that is not
  tvm-rammer) and ``rammer_vs_best_other`` (its latency / tvm-rammer's).
* ``format_table(doc)``: rows = models, columns = systems. With timings: latency in us, its
  multiple of the floor and the speedup over tvm-default. Without a GPU: launches per inference and
  compile seconds, then the line ``timing needs a GPU: none visible``.
* ``write_json(doc, out_dir)``: ``<out_dir>/<date>-<device>-batch<B>.json`` (a rerun on the same
  day, device and batch replaces the file).
* ``write_chart(doc, path)``: a PNG bar chart of latency per model and system (matplotlib), or the
  reason it was skipped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .systems import TVM_DEFAULT, TVM_RAMMER

STATUS_MARK = {"failed": "FAIL", "timeout": "TIMEOUT", "skipped": "skip", "mismatch": "WRONG"}


def _latency(result):
    if result and result.get("status") == "ok":
        return result.get("latency_us")
    return None


def add_derived(doc: dict) -> dict:
    """Fill in vs_floor, speedup_vs_default, best_other and rammer_vs_best_other (in place)."""
    for model in doc["models"]:
        results = model["results"]
        floor_us = model.get("floor", {}).get("floor_us")
        base = _latency(results.get(TVM_DEFAULT))
        for result in results.values():
            lat = _latency(result)
            result["vs_floor"] = lat / floor_us if lat and floor_us else None
            result["speedup_vs_default"] = base / lat if lat and base else None
        others = {s: _latency(r) for s, r in results.items() if s != TVM_RAMMER and _latency(r)}
        best = min(others, key=others.get) if others else None
        rammer = _latency(results.get(TVM_RAMMER))
        model["best_other"] = best
        model["rammer_vs_best_other"] = others[best] / rammer if best and rammer else None
    return doc


def _cell(result, timing: bool) -> str:
    if result is None:
        return "-"
    status = result.get("status")
    if status in STATUS_MARK:
        return STATUS_MARK[status]
    if timing:
        lat = result.get("latency_us")
        text = f"{lat:.1f}"
        if result.get("vs_floor"):
            text += f" ({result['vs_floor']:.1f}xF)"
        if result.get("speedup_vs_default"):
            text += f" {result['speedup_vs_default']:.2f}x"
        return text
    launches = result.get("launches")
    compile_s = result.get("compile_s")
    return (f"{launches if launches is not None else '?'} / "
            f"{compile_s:.1f}s" if compile_s is not None else f"{launches}")


def _grid(header: list, rows: list) -> list:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)]


def format_table(doc: dict) -> str:
    """The terminal table (see the module docstring), with notes on failures below it."""
    systems, timing = doc["systems"], doc["timing"]
    dev = doc.get("device", {})
    lines = [f"device: {dev.get('name', '?')}   target: {doc['target']}   batch: {doc['batch']}"
             f"   commit: {doc['git_commit'][:12]}   {doc['date']}"]
    peaks = doc.get("peaks") or {}
    if peaks:
        lines.append(f"floor peaks: {peaks['flops_per_s'] / 1e12:.1f} TFLOP/s, "
                     f"{peaks['bytes_per_s'] / 1e12:.2f} TB/s ({peaks['source']})")
    if timing:
        lines.append("cells: median latency in us (multiple of the floor, xF) and speedup over "
                     f"{TVM_DEFAULT}")
        header = ["model", "floor us", *systems, "rammer vs best other"]
    else:
        lines.append("cells: kernel launches per inference / compile seconds")
        header = ["model", "floor us", *systems]
    rows, notes = [], []
    for model in doc["models"]:
        floor_us = model.get("floor", {}).get("floor_us")
        row = [model["name"], f"{floor_us:.3g}" if floor_us is not None else "?"]
        for s in systems:
            result = model["results"].get(s)
            row.append(_cell(result, timing))
            if result and result.get("status") in STATUS_MARK and \
                    result.get("reason") != doc.get("timing_note"):
                notes.append(f"{model['name']} / {s}: {result['status']}: "
                             f"{result.get('reason', '')}")
        if timing:
            ratio, best = model.get("rammer_vs_best_other"), model.get("best_other")
            row.append(f"{ratio:.2f}x vs {best}" if ratio else "-")
        rows.append(row)
    lines += _grid(header, rows)
    if not timing:
        lines.append(doc.get("timing_note") or "")
    notes = list(dict.fromkeys(notes))  # one line per distinct failure, in order
    lines += [f"  {n}" for n in notes]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_stem(doc: dict) -> str:
    """``<date>-<device>-batch<B>``; the device is ``cpu`` when no GPU was visible."""
    dev = doc.get("device", {})
    name = _slug(dev["name"]) if dev.get("gpu") else "cpu"
    return f"{doc['date']}-{name}-batch{doc['batch']}"


def to_json(obj, indent=1) -> str:
    """The results document as JSON (infinite errors become the string "inf")."""
    def fix(x):
        if isinstance(x, float) and x != x:
            return "nan"
        if isinstance(x, float) and x in (float("inf"), float("-inf")):
            return "inf" if x > 0 else "-inf"
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        return x

    return json.dumps(fix(obj), indent=indent)


def write_json(doc: dict, out_dir) -> Path:
    """Write the results document; returns the path."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result_stem(doc)}.json"
    path.write_text(to_json(doc) + "\n")
    return path


def write_chart(doc: dict, path) -> tuple:
    """(path, "") when the PNG was written, (None, reason) when it was skipped."""
    if not doc["timing"]:
        return None, "chart skipped: no timings (" + (doc.get("timing_note") or "no GPU") + ")"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "chart skipped: matplotlib is not installed (pip install matplotlib)"
    systems, models = doc["systems"], doc["models"]
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models)), 4))
    for i, s in enumerate(systems):
        xs = [m + i * width for m in range(len(models))]
        ys = [_latency(model["results"].get(s)) or 0.0 for model in models]
        ax.bar(xs, ys, width, label=s)
    for m, model in enumerate(models):
        floor_us = model.get("floor", {}).get("floor_us")
        if floor_us:
            ax.hlines(floor_us, m - width / 2, m + 0.8 - width / 2, colors="k", linestyles="dashed")
    ax.set_xticks([m + 0.4 - width / 2 for m in range(len(models))])
    ax.set_xticklabels([model["name"] for model in models], rotation=20)
    ax.set_ylabel("median latency (us); dashed = floor")
    ax.set_yscale("log")
    ax.set_title(f"{doc['device'].get('name', '?')}, batch {doc['batch']}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, ""
