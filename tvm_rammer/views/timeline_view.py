"""Pictures of :mod:`tvm_rammer.scheduling.timeline`: a Perfetto / Chrome trace and a PNG Gantt chart.

- :func:`trace_events` / :func:`write_trace`: the Chrome trace-event JSON that the Perfetto UI
  (ui.perfetto.dev) and ``chrome://tracing`` open. One process per (source, SM), named
  "predicted SM 3" / "measured SM 3"; in it one thread (track) per vEU; one complete ("X") slice per
  rTask, named by its operator ("fused_matmul_relu (op 7)", so every operator gets its own colour),
  and per barrier-rTask ("barrier-rTask", its waits in the args). Times in microseconds.
  ``otherData.kernels`` lists each rProgram with its operators (name, version, rTask count,
  predecessor operators), so the trace can be checked on its own.
- :func:`plot` / :func:`write_png`: a matplotlib Gantt chart, one panel per source, one row per
  vEU, rows grouped by SM (alternating bands, labelled "SM s"), rTasks coloured by operator,
  barrier-rTasks dark grey. Readable at hundreds of vEUs: with more than 64 rows only the SM groups
  are labelled. matplotlib (object API only: no pyplot state, no backend chosen) is imported here
  only, when a PNG is asked for (``pip install matplotlib`` or the ``timeline`` extra).
- :func:`write` writes both, ``OUT.json`` and ``OUT.png`` (the JSON only without matplotlib).
"""
from __future__ import annotations

import json
import os
import warnings

from ..host import packages
from ..scheduling.timeline import shares

__all__ = ["trace_events", "write_trace", "plot", "write_png", "write", "output_paths"]

_SOURCES = ("predicted", "measured")
_LABELLED_ROWS = 64  # above this (or when labels would overlap), rows are labelled by SM group
_LEGEND = 30  # operators named in the PNG's legend
_WAITS_SHOWN = 32  # <vEU, order> pairs listed in a barrier-rTask slice's args (all are counted)


def _slice_name(s) -> str:
    return s.name if s.kind == "barrier" else f"{s.name} (op {s.op})"


def _source_index(source: str) -> int:
    return _SOURCES.index(source) if source in _SOURCES else len(_SOURCES)


def trace_events(timelines) -> dict:
    """The Chrome trace-event JSON object (``{"traceEvents": [...], ...}``) of ``timelines``."""
    events, seen_pid, seen_tid = [], set(), set()
    for timeline in timelines:
        k = _source_index(timeline.source)
        for s in timeline.slices:
            sm = max(s.sm, 0)
            pid = k * 10000 + sm + 1
            tid = (k + 1) * 100000 + s.veu
            if pid not in seen_pid:
                seen_pid.add(pid)
                events.append({"name": "process_name", "ph": "M", "pid": pid,
                               "args": {"name": f"{timeline.source} SM {sm}"}})
                events.append({"name": "process_sort_index", "ph": "M", "pid": pid,
                               "args": {"sort_index": pid}})
            if (pid, tid) not in seen_tid:
                seen_tid.add((pid, tid))
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"name": f"vEU {s.veu}"}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"sort_index": s.veu}})
            args = {"kernel": s.kernel, "vEU": s.veu, "SM": s.sm, "order": s.order,
                    "source": timeline.source}
            if s.kind == "rtask":
                args.update(operator=s.name, op=s.op, rtask_id=s.rtask_id, version=s.version)
            else:
                shown = [f"op {o} (all rTasks)" if v == "op" else f"vEU {v} order {o}"
                         for v, o in s.waits[:_WAITS_SHOWN]]
                if len(s.waits) > _WAITS_SHOWN:
                    shown.append(f"... {len(s.waits) - _WAITS_SHOWN} more")
                args.update(waits_on=len(s.waits), waits=shown, wait_us=round(s.duration_us, 4))
            events.append({"name": _slice_name(s), "cat": "rtask" if s.kind == "rtask" else "barrier",
                           "ph": "X", "ts": round(s.start_us, 4),
                           "dur": round(s.duration_us, 4), "pid": pid, "tid": tid, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"tool": "tvm-rammer timeline",
                          "kernels": [{"kernel": t.kernel, "source": t.source,
                                       "span_us": round(t.span_us, 4), "operators": t.ops}
                                      for t in timelines]}}


def write_trace(path: str, timelines) -> str:
    """Write :func:`trace_events` to ``path``; returns the path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace_events(timelines), f)
    return path


def _matplotlib():
    """matplotlib's pieces, without pyplot (no global figure state, no GUI backend chosen)."""
    try:
        import matplotlib
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("the timeline PNG needs matplotlib: `pip install matplotlib` (or "
                          "tvm-rammer's [timeline] extra); the Perfetto JSON needs nothing") from None
    colours = [matplotlib.colormaps[name](i) for name in ("tab20", "tab20b", "tab20c")
               for i in range(20)]
    return colours, Figure, PolyCollection, Patch


def _rows(timelines) -> list:
    """(sm, vEU) rows of a panel, grouped by SM."""
    return sorted({(max(s.sm, 0), s.veu) for t in timelines for s in t.slices})


def _panel_inches(rows: int) -> float:
    return min(max(1.6, 0.022 * rows + 1.0), 24.0)


def _draw_panel(ax, timelines, colour_of, PolyCollection):
    rows = _rows(timelines)
    row_of = {row: i for i, row in enumerate(rows)}
    verts, colours = [], []
    for timeline in timelines:
        for s in timeline.slices:
            y = row_of[(max(s.sm, 0), s.veu)]
            x0, x1 = s.start_us, max(s.end_us, s.start_us + 1e-3)
            verts.append([(x0, y - 0.42), (x1, y - 0.42), (x1, y + 0.42), (x0, y + 0.42)])
            colours.append((0.25, 0.25, 0.25, 1.0) if s.kind == "barrier" else colour_of(s.op))
    ax.add_collection(PolyCollection(verts, facecolors=colours, edgecolors="none"))
    groups: dict = {}
    for i, (sm, _) in enumerate(rows):
        groups.setdefault(sm, []).append(i)
    for n, (sm, members) in enumerate(sorted(groups.items())):
        if n % 2:
            ax.axhspan(members[0] - 0.5, members[-1] + 0.5, color=(0.93, 0.93, 0.96), zorder=0)
    fits = max(4, int(_panel_inches(len(rows)) / 0.13))  # 6-point labels that do not overlap
    if len(rows) <= min(_LABELLED_ROWS, fits):
        ax.set_yticks(range(len(rows)), [f"vEU {v} (SM {sm})" for sm, v in rows])
    else:
        step = max(1, -(-len(groups) // fits))
        shown = sorted(groups.items())[::step]
        ax.set_yticks([(m[0] + m[-1]) / 2 for _, m in shown], [f"SM {sm}" for sm, _ in shown])
    ax.tick_params(axis="y", labelsize=6 if len(ax.get_yticks()) > 24 else 8)
    start = min((t.start_us for t in timelines), default=0.0)
    end = max((t.end_us for t in timelines), default=1.0)
    ax.set_xlim(start, end + 0.01 * max(end - start, 1e-3))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    return rows


def plot(timelines, title: str | None = None):
    """A matplotlib Figure: one panel per source present (predicted above measured)."""
    colours, Figure, PolyCollection, Patch = _matplotlib()
    by_source: dict = {}
    for t in timelines:
        by_source.setdefault(t.source, []).append(t)
    sources = sorted(by_source, key=_source_index)
    if not sources:
        raise ValueError("no timeline to plot")
    ops: dict = {}
    for t in timelines:
        for s in t.slices:
            if s.kind == "rtask" and s.op not in ops:
                ops[s.op] = s.name
    palette = {op: colours[i % len(colours)] for i, op in enumerate(ops)}
    heights = [len(_rows(by_source[src])) for src in sources]
    fig_h = sum(_panel_inches(h) for h in heights) + 1.2
    fig = Figure(figsize=(14, fig_h))
    axes = fig.subplots(len(sources), 1, squeeze=False,
                        gridspec_kw={"height_ratios": [max(h, 4) for h in heights]})
    for ax, src in zip(axes[:, 0], sources):
        _draw_panel(ax, by_source[src], palette.__getitem__, PolyCollection)
        summary = [shares(t) for t in by_source[src]]
        busy = sum(s["busy"] for s in summary) / len(summary)
        wait = sum(s["wait"] for s in summary) / len(summary)
        span = max(t.end_us for t in by_source[src]) - min(t.start_us for t in by_source[src])
        ax.set_title(f"{src}: {len(by_source[src])} rProgram(s), {span:.1f} us; vEUs busy "
                     f"{busy:.0%}, in barrier-rTasks {wait:.0%}", fontsize=9, loc="left")
        ax.set_ylabel("vEUs, grouped by SM", fontsize=8)
    axes[-1, 0].set_xlabel("time (us)")
    handles = [Patch(color=palette[op], label=f"{name} (op {op})")
               for op, name in list(ops.items())[:_LEGEND]]
    handles.append(Patch(color=(0.25, 0.25, 0.25), label="barrier-rTask"))
    if len(ops) > _LEGEND:
        handles.append(Patch(color="white", label=f"... {len(ops) - _LEGEND} more operators"))
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 0.8, 0.97 if title else 1))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.805, 0.97), fontsize=6,
               frameon=False)
    return fig


def write_png(path: str, timelines, title: str | None = None, dpi: int = 110) -> str:
    """Write :func:`plot` to ``path`` as PNG; returns the path."""
    plot(timelines, title).savefig(path, dpi=dpi)
    return path


def output_paths(out: str) -> tuple:
    """``(OUT.json, OUT.png)`` for ``--timeline OUT`` (a trailing .json or .png is dropped)."""
    base, ext = os.path.splitext(os.fspath(out))
    if ext.lower() not in (".json", ".png"):
        base = os.fspath(out)
    return f"{base}.json", f"{base}.png"


def write(out: str, timelines, title: str | None = None, png: bool = True) -> tuple:
    """Write ``OUT.json`` (Perfetto) and, with ``png``, ``OUT.png``; returns ``(json path, png path
    or None)``. Without matplotlib the PNG is skipped with a warning (the CLI passes
    ``png=False`` then, having said so before the command started)."""
    if not timelines:
        raise ValueError("the model has no rProgram: there is no persistent kernel to show")
    json_path, png_path = output_paths(out)
    directory = os.path.dirname(os.path.abspath(json_path))
    if not os.path.isdir(directory):
        raise ValueError(f"--timeline {out}: directory {directory} does not exist")
    if png and packages.missing("matplotlib"):
        warnings.warn(f"matplotlib is not installed: {png_path} is not drawn, only {json_path} "
                      "(pip install matplotlib)", stacklevel=2)
        png = False
    write_trace(json_path, timelines)
    if not png:
        return json_path, None
    write_png(png_path, timelines, title)
    return json_path, png_path

