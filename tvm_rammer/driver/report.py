"""What a compiled module looks like: rPrograms, rTasks, vEUs and launches, as one JSON-able dict."""

from __future__ import annotations

import json

import tvm
from tvm import tirx

from .launches import count_launches

REPORT_ATTR = "rammer.report"
UNPLACED_ATTR = "rammer.unplaced"
FALLBACK_ATTR = "rammer.fallbacks"


def rprogram_reports(mod: tvm.IRModule) -> list:
    """The per-rProgram reports that RammerGroupRPrograms attached to its persistent kernels."""
    reports = []
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and REPORT_ATTR in func.attrs:
            report = json.loads(str(func.attrs[REPORT_ATTR]))
            report.setdefault("kernel", gv.name_hint)
            reports.append(report)
    return sorted(reports, key=lambda r: r["kernel"])


def unplaced_operators(mod: tvm.IRModule) -> list:
    """Operators the rammer pass left as ordinary kernels, each with the reason."""
    attrs = mod.attrs or {}
    return json.loads(str(attrs[UNPLACED_ATTR])) if UNPLACED_ATTR in attrs else []


def fallbacks(mod: tvm.IRModule) -> list:
    """rPrograms the back end dropped because TVM's default kernels measured at least as fast,
    each with both times."""
    attrs = mod.attrs or {}
    return json.loads(str(attrs[FALLBACK_ATTR])) if FALLBACK_ATTR in attrs else []


def summarize(rammer_mod: tvm.IRModule, default_mod: tvm.IRModule | None = None) -> dict:
    """``rprograms``, ``rtasks`` (one count per rProgram), ``veus``, ``launches`` and, given the
    default pipeline's lowering of the same model, ``default_launches``."""
    reports = rprogram_reports(rammer_mod)
    summary = {
        "rprograms": len(reports),
        "rtasks": [r["rtasks"] for r in reports],
        "veus": [r["num_veus"] for r in reports],
        "veus_per_sm": [r["veus_per_sm"] for r in reports],
        "veu_threads": [r["veu_threads"] for r in reports],
        "barriers": [r["barriers"] for r in reports],
        "launches": count_launches(rammer_mod),
        "unplaced": unplaced_operators(rammer_mod),
        "fallbacks": fallbacks(rammer_mod),
        "programs": reports,
    }
    if default_mod is not None:
        summary["default_launches"] = count_launches(default_mod)
    return summary


def prediction_line(summary: dict) -> str:
    """One line: the predicted inference (rPrograms + ordinary kernels) and, when known, the
    floor (``bench``'s: the largest of the compute, memory and critical-path bounds)."""
    parts = summary.get("prediction") or {}
    calls = sum(k["calls"] for k in parts.get("ordinary_kernels", []))
    line = (f"predicted inference: {summary['predicted_us']:.1f} us (rPrograms "
            f"{parts.get('rprograms_us', 0.0):.1f} us + {calls} ordinary kernel calls "
            f"{parts.get('ordinary_us', 0.0):.1f} us)")
    floor = summary.get("floor") or {}
    if summary.get("floor_us") is not None:
        line += (f"; floor {summary['floor_us']:.1f} us ({floor.get('bound', '?')} bound"
                 + (f", {summary['predicted_us'] / summary['floor_us']:.1f}x"
                    if summary["floor_us"] > 0 else "") + ")")
    elif floor.get("error"):
        line += f"; floor: not computed ({floor['error']})"
    return line


def format_schedule(summary: dict) -> str:
    """A short human-readable schedule."""
    lines = [f"rPrograms: {summary['rprograms']}   kernel launches per inference: "
             f"{summary['launches']}" + (f" (TVM default pipeline: {summary['default_launches']})"
                                         if summary.get("default_launches") is not None else "")]
    if summary.get("default_unavailable"):
        lines.append(f"{summary['default_unavailable']} (its launches: unavailable); "
                     "tvm-rammer's schedule above is what compiles")
    if summary.get("critical_path"):
        path = summary["critical_path"]
        lines.append(f"critical path: {path['operators']} dependent operators, "
                     f"predicted {path['predicted_us']:.1f} us")
    if summary.get("predicted_us") is not None:
        lines.append(prediction_line(summary))
    for op in summary.get("unplaced", []):
        lines.append(f"  ordinary kernel: {op['name']}: {op['reason']}")
    for fb in summary.get("fallbacks", []):
        lines.append(f"  TVM default kept for {fb['kernel']} ({len(fb['operators'])} operators): "
                     f"rProgram {fb['rammer_us']:.1f} us vs TVM default {fb['default_us']:.1f} us")
    for report in summary["programs"]:
        lines.append(f"  {report['kernel']}: {report['rtasks']} rTasks of {len(report['operators'])} "
                     f"operators on {report['num_veus']} vEUs ({report['veus_per_sm']}/SM x "
                     f"{report['veu_threads']} threads), {report['barriers']} barrier-rTasks, "
                     f"predicted {report['predicted_us']:.1f} us")
        if report.get("measured_us") is not None:
            lines.append(f"      measured {report['measured_us']:.1f} us" + (
                f" (TVM default kernels: {report['default_us']:.1f} us)"
                if report.get("default_us") is not None else ""))
        for op in report["operators"]:
            coarse = op.get("blocks_per_rtask", 1)
            lines.append(f"      {op['name']:<40} {op['rtasks']:>5} rTasks x {op['threads']:>4} thr"
                         + (f" of {coarse} blocks" if coarse > 1 else "")
                         + f"  ({op['version']}: {op['reason']}, "
                         f"{op.get('time_source', 'analytical')} time)")
            checked = op.get("versions_checked")
            if checked is not None:  # RammerConfig.emulate_versions
                valid = sum(c["valid"] is True for c in checked)
                wrong = sum(c["valid"] is False for c in checked)
                lines.append(f"          emulator: {len(checked)} versions checked, {valid} valid, "
                             f"{wrong} wrong, {len(checked) - valid - wrong} not checkable")
            for bad in op.get("dropped", []):
                lines.append(f"          dropped {bad['version']}: {bad['reason']}")
    return "\n".join(lines)
