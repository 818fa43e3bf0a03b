"""``gpu_lease.sh report DIR``: a lease's files turned into the results table.

In: ``DIR``, what ``gpu_lease.sh run`` packed (``results.jsonl``, ``raw.tar``, ``index.json``,
``run.log``). Out: ``benchmarks/results/gpu-<date>-<commit>/`` (or ``--out``) with ``README.md``
(device, date, commit; the latency and correctness table per model; the demo; the measured vs
predicted per-operator rTask times of the timelines; every step's status and seconds),
``results.json`` (the same as data) and the lease's files, ready to commit. Runs on the CPU
machine: the timeline buffers are decoded here (``tvm_rammer.scheduling.timeline``).
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("rammer", "rammer_nocheck", "default", "torch_eager", "torch_graph")


def read_results(folder: Path) -> list:
    """The step records of ``results.jsonl`` (a line cut by the end of the lease is skipped)."""
    out = []
    path = folder / "results.jsonl"
    if not path.exists():
        raise ValueError(f"{path} missing: pass the OUT_DIR that `gpu_lease.sh run` filled")
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def raw_members(folder: Path) -> dict:
    """``{member name: bytes}`` of ``raw.tar`` (empty when there is none)."""
    path = folder / "raw.tar"
    if not path.exists():
        return {}
    found = {}
    try:
        with tarfile.open(path) as t:
            for m in t:  # member by member: a tar cut short keeps the members before the cut
                if m.isfile():
                    data = t.extractfile(m).read()
                    if len(data) == m.size:
                        found[m.name] = data
    except (tarfile.TarError, OSError, EOFError):
        pass
    return found


def model_rows(steps: list) -> list:
    """One row per model step (demo and zoo-*): latency per system, errors, ok, speedups."""
    rows = []
    for step in steps:
        name = step.get("step", "")
        if not (name == "demo" or name.startswith("zoo-")):
            continue
        row = {"model": "demo (16 branches)" if name == "demo" else name[4:],
               "status": step.get("status"), "latency_us": {}, "rel_err": {}, "ok": {},
               "errors": {}, "would_time": []}
        for rec in step.get("records", []):
            kind = rec.get("kind")
            if kind == "reference":
                row["params"] = (rec.get("model") or {}).get("params")
                if rec.get("position") is not None:
                    row["position"] = rec["position"]
            elif kind == "library":
                v = rec.get("variant")
                if "latency_us" in rec:
                    row["latency_us"][v] = rec["latency_us"]
                if "max_rel_err" in rec:
                    row["rel_err"][v] = rec["max_rel_err"]
                    row["ok"][v] = rec.get("ok")
                if "error" in rec:
                    row["errors"][v] = rec["error"]
                if "would_time" in rec:
                    row["would_time"].append(rec["would_time"])
                row.setdefault("device_type", rec.get("device_type"))
            elif kind == "torch":
                for key, sysname in (("eager_us", "torch_eager"), ("graph_us", "torch_graph")):
                    if key in rec:
                        row["latency_us"][sysname] = rec[key]
                if "rel_err" in rec:
                    row["rel_err"]["torch"] = rec["rel_err"]
                if "graph_rel_err" in rec:
                    row["rel_err"]["torch CUDA graph"] = rec["graph_rel_err"]
                if "error" in rec:
                    row["errors"]["torch"] = rec["error"]
                if "graph_error" in rec:
                    row["errors"]["torch CUDA graph"] = rec["graph_error"]
                if rec.get("host_read"):
                    row["errors"]["torch (a host read: no CUDA graph)"] = rec["host_read"]
                if "would_time" in rec:
                    row["would_time"].append(rec["would_time"])
        lat = row["latency_us"]
        if lat.get("rammer") and lat.get("default"):
            row["speedup_vs_default"] = lat["default"] / lat["rammer"]
        torch_best = min([lat[k] for k in ("torch_eager", "torch_graph") if lat.get(k)] or [0])
        if lat.get("rammer") and torch_best:
            row["speedup_vs_torch_best"] = torch_best / lat["rammer"]
        rows.append(row)
    return rows


def timeline_rows(steps: list, raw: dict) -> list:
    """Per timeline step: the per-operator measured (median in context) vs predicted rTask times
    and the per-rProgram busy / wait / idle shares, decoded from the raw buffers."""
    import numpy as np

    from tvm_rammer.scheduling import timeline

    out = []
    for step in steps:
        name = step.get("step", "")
        if not name.startswith("timeline-"):
            continue
        entry = {"model": name[len("timeline-"):], "status": step.get("status")}
        buf, sched = raw.get(f"{name}/buffers.npz"), raw.get(f"{name}/schedules.json")
        if buf is None or sched is None:
            entry["note"] = "no buffers came back" if sched else "no schedules came back"
            out.append(entry)
            continue
        schedules = json.loads(sched)["schedules"]
        with np.load(io.BytesIO(buf)) as data:
            buffers = {k: data[k] for k in data.files}
        measured = timeline.decode_all(schedules, buffers)
        records = timeline.in_context_records(measured, schedules)
        entry["operators"] = sorted(
            ({"operator": r["operator"], "kernel": k, "measured_us": r["rtask_us"],
              "predicted_us": r["predicted_rtask_us"], "rtasks": r["count"]}
             for k, r in records.items()), key=lambda r: -r["measured_us"] * r["rtasks"])
        entry["rprograms"] = [{k: v for k, v in timeline.shares(t).items() if k != "veus"}
                              for t in measured]
        out.append(entry)
    return out


def model_label(row: dict) -> str:
    """The table's name of a model row: "(reduced)" for ``tvm_rammer.models.REDUCED``'s size,
    else the parameters the lease set (a decoder's float16, Llama's layers), and a decode step's
    cache slot."""
    from tvm_rammer.models import REDUCED

    name, params = row["model"], dict(row.get("params") or {})
    if name.startswith("demo") or not params:
        return name
    small = REDUCED.get(name, {})
    reduced = bool(small) and all(params.get(k) == v for k, v in small.items())
    shown = [str(params.pop("dtype"))] if "dtype" in params else []
    if reduced:
        shown.append("reduced")
    else:
        shown += [f"{k}={v}" for k, v in params.items()]
    if row.get("position") is not None:
        shown.append(f"step at position {row['position']}")
    return f"{name} ({', '.join(shown)})"


def _us(v) -> str:
    return f"{v:,.1f}" if isinstance(v, (int, float)) else "-"


def _against_nocheck(rows: list, title: str, columns: list, variants: tuple) -> list:
    """Markdown lines of a table of ``rows`` (models): the ``--no-unmeasured-check`` build's
    latency, each of ``variants``', and the gain (the last variant's latency over the build's;
    '-' where either is missing); [] without rows."""
    if not rows:
        return []
    out = ["", title, "", "| model | " + " | ".join(columns) + " |",
           "|---" * (len(columns) + 1) + "|"]
    for r in rows:
        lat = r["latency_us"]
        base, last = lat.get("rammer_nocheck"), lat.get(variants[-1])
        gain = last / base if last and base else None
        cells = [_us(lat.get(v)) for v in ("rammer_nocheck", *variants)]
        out.append(f"| {model_label(r)} | " + " | ".join(cells)
                   + f" | {f'{gain:.2f}x' if gain else '-'} |")
    return out


def format_markdown(summary: dict) -> str:
    dev = summary["device"]
    lines = [f"# GPU lease {summary['date']}, commit {summary['commit']}", "",
             f"Device: {dev.get('device') or dev.get('nvidia_smi') or 'no GPU'}"
             f" ({dev.get('sms', '?')} SMs), driver/nvidia-smi: {dev.get('nvidia_smi', '-')}; "
             f"python {dev.get('python', '?')}, torch {dev.get('torch', '-')}, onnxruntime "
             f"{dev.get('onnxruntime', '-')}, TVM runtime only: {dev.get('tvm_runtime_only')}.",
             f"Built by `gpu_lease.sh prepare` at {summary['commit']} for "
             f"{summary['target']}; run by `gpu_lease.sh run` (`scripts/README.md`).", "",
             "## Latency (median us) and correctness against onnxruntime", "",
             "| model | tvm-rammer | rammer --no-unmeasured-check | TVM default | PyTorch eager | "
             "PyTorch CUDA graph | speedup vs default | vs best PyTorch | max rel err (rammer) | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["models"]:
        lat = r["latency_us"]
        ok = all(v for v in r["ok"].values()) if r["ok"] else None
        sp = r.get("speedup_vs_default")
        st = r.get("speedup_vs_torch_best")
        label = model_label(r) + (" (CPU check: llvm)" if r.get("device_type") == "cpu" else "")
        lines.append(
            f"| {label} | {_us(lat.get('rammer'))} | {_us(lat.get('rammer_nocheck'))} | "
            f"{_us(lat.get('default'))} | {_us(lat.get('torch_eager'))} | "
            f"{_us(lat.get('torch_graph'))} | {f'{sp:.2f}x' if sp else '-'} | "
            f"{f'{st:.2f}x' if st else '-'} | "
            f"{(lambda e: f'{e:.1e}' if e is not None else '-')(r['rel_err'].get('rammer'))} | "
            f"{'yes' if ok else ('-' if ok is None else '**NO**')} |")
    lines += _against_nocheck(
        [r for r in summary["models"]
         if any(r["latency_us"].get(v) for v in ("lookahead1", "prefetch_off"))],
        "## Weights prefetched across barriers (issue 34): the same decode step's rProgram with "
        "the prefetch issued up to 4 barriers early (tvm-rammer's default), at the barrier right "
        "before its reader only, and with none",
        ["lookahead 4 (rammer --no-unmeasured-check)", "lookahead 1", "no prefetch",
         "prefetch's gain"], ("lookahead1", "prefetch_off"))
    lines += _against_nocheck(
        [r for r in summary["models"]
         if r["latency_us"].get("after_writes") or "after_writes" in r["errors"]],
        "## Attention beside the cache writes (issue 34): the decode attention reading q, k, v "
        "from the projections' rows and the caches beside their one-slot writes (tvm-rammer's "
        "default), and after the writes (`--no-attention-row`)",
        ["beside the writes (rammer --no-unmeasured-check)", "after the writes", "gain"],
        ("after_writes",))
    problems = [(r["model"], k, e) for r in summary["models"] for k, e in r["errors"].items()]
    if problems:
        lines += ["", "Errors:", ""] + [f"- {m} {k}: {e}" for m, k, e in problems]
    would = [w for r in summary["models"] for w in r["would_time"]]
    if would:
        lines += ["", f"Not timed (no GPU): {len(would)} measurements, e.g. {would[0]}."]
    for t in summary["timelines"]:
        lines += ["", f"## Timeline of {t['model']}: measured vs predicted rTask times", ""]
        if "operators" not in t:
            lines.append(f"Not measured ({t['status']}: {t.get('note', '')}).")
            continue
        lines += ["| operator | rTasks | measured us (median) | predicted us | measured / predicted |",
                  "|---|---|---|---|---|"]
        for op in t["operators"][:25]:
            ratio = op["measured_us"] / op["predicted_us"] if op["predicted_us"] else None
            lines.append(f"| {op['operator']} | {op['rtasks']} | {op['measured_us']:.2f} | "
                         f"{op['predicted_us']:.2f} | {f'{ratio:.2f}' if ratio else '-'} |")
        for rp in t["rprograms"]:
            lines.append(f"\n{rp['kernel']}: span {rp['span_us']} us, busy {rp['busy']:.0%}, "
                         f"barrier wait {rp['wait']:.0%}, idle {rp['idle']:.0%}")
    lines += ["", "## Steps", "", "| step | status | seconds | limit s | estimate s |",
              "|---|---|---|---|---|"]
    for s in summary["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s.get('seconds', '-')} | "
                     f"{s.get('limit_s', '-')} | {s.get('estimate_s', '-')} |")
    return "\n".join(lines) + "\n"


def summarize(folder: Path) -> dict:
    """The results of one lease (``DIR``) as data."""
    folder = Path(folder)
    steps = read_results(folder)
    raw = raw_members(folder)
    try:
        index = json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        index = {}
    device = next((r for s in steps if s.get("step") == "device" for r in s.get("records", [])),
                  {})
    date = str(device.get("date", "unknown"))[:10]
    return {"date": date, "commit": index.get("commit") or "unknown",
            "target": index.get("target", "?"), "device": device,
            "models": model_rows(steps), "timelines": timeline_rows(steps, raw),
            "steps": [{k: v for k, v in s.items() if k != "records"} for s in steps]}


def write_report(folder: Path, out: Path | None = None) -> Path:
    """Write README.md, results.json and a copy of the lease's files; returns the folder."""
    summary = summarize(folder)
    if out is None:
        out = ROOT / "benchmarks" / "results" / f"gpu-{summary['date']}-{summary['commit']}"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "README.md").write_text(format_markdown(summary))
    lease = out / "lease"
    lease.mkdir(exist_ok=True)
    for name in ("results.jsonl", "run.log", "index.json", "raw.tar"):
        src = Path(folder) / name
        if src.exists() and src.resolve() != (lease / name).resolve():
            shutil.copy2(src, lease / name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_lease.sh report", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="the OUT_DIR a lease's `gpu_lease.sh run` filled (fetched back)")
    p.add_argument("--out", default=None,
                   help="where to write (default: benchmarks/results/gpu-<date>-<commit>/)")
    args = p.parse_args(argv)
    try:
        out = write_report(Path(args.dir), Path(args.out) if args.out else None)
    except ValueError as err:
        print(f"gpu_lease.sh report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}/README.md and results.json")
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
