"""Schedule and launch counts of a model under the rammer and the default pipeline (no GPU needed)."""

from __future__ import annotations

import time

import tvm

from relay_passes.dataflow_graph import DataflowGraph

from ..codegen import tvm_default
from ..config import RammerConfig
from ..scheduling.critical_path import rprogram_critical_paths
from ..driver.frontend import import_onnx, lower
from ..driver.report import summarize
from ..target import resolve_target
from .prediction import predict_inference


def lower_default(mod: tvm.IRModule, target) -> tvm.IRModule:
    """TVM's default CUDA Relax pipeline (the baseline "RammerBase"), Relax part only;
    ``codegen.tvm_default.DefaultPipelineFailed`` (one-line reason) where TVM cannot compile it."""
    return tvm_default.lower_default(mod, target)


def inspect_lowered(model, target, config: RammerConfig | None = None, profiler=None,
                    timings: list | None = None, shapes: dict | None = None,
                    batch: int | None = None, floor_of=None) -> tuple:
    """``(summary, rammer-lowered module)``: :func:`inspect_model`'s dict and the module it read
    (``timeline.schedules_of`` takes the predicted timeline from it). ``timings``: a list that gets
    ("TVM default pipeline", seconds) for the baseline's lowering; ``shapes`` / ``batch`` bind an
    ONNX model's symbolic inputs (``frontend.import_onnx``). ``floor_of(imported module, target)``:
    the model's floor as ``tvm-rammer bench`` computes it (a dict with ``floor_us``), handed in by
    the CLI (``benchmarks.floor`` is a later stage): :func:`add_floor`."""
    mod = model if isinstance(model, tvm.IRModule) else import_onnx(model, shapes, batch)
    capture = _BeforePass(GROUPING_PASS)
    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(opt_level=current.opt_level, config=current.config,
                                   required_pass=current.required_pass,
                                   disabled_pass=current.disabled_pass,
                                   instruments=[*current.instruments, capture]):
        rammer_mod = lower(mod, target, config, profiler)
    start = time.perf_counter()
    try:
        default_mod, unavailable = lower_default(mod, target), None
    except tvm_default.DefaultPipelineFailed as err:  # the baseline is unavailable, said why
        default_mod, unavailable = None, err.reason
    if timings is not None:
        timings.append(("TVM default pipeline (baseline)", time.perf_counter() - start))
    summary = summarize(rammer_mod, default_mod)
    if unavailable is not None:
        summary.update(default_launches=None, default_unavailable=unavailable)
    resolved = resolve_target(target)
    if resolved.kind.name == "rocm":  # what each rProgram's code object says (tvm_rammer.rocm)
        from ..rocm.report import add_code_objects  # pylint: disable=import-outside-toplevel
        add_code_objects(summary, rammer_mod, resolved)
    add_critical_paths(summary, capture.captured, (config or RammerConfig()).barrier_us)
    add_prediction(summary, rammer_mod, resolved, config)
    if floor_of is not None:
        add_floor(summary, lambda: floor_of(mod, resolved))
    return summary, rammer_mod


def add_prediction(summary: dict, lowered: tvm.IRModule, target,
                   config: RammerConfig | None = None) -> None:
    """Add ``predicted_us`` (the cost model's whole inference: every rProgram's prediction plus
    every ordinary kernel's launch and analytical time, ``views.prediction``) and its parts
    (``prediction``: rprograms_us, ordinary_us, ordinary_kernels, unpriced) to the summary."""
    found = predict_inference(lowered, target, config)
    summary["predicted_us"] = found["predicted_us"]
    summary["prediction"] = {k: v for k, v in found.items() if k != "predicted_us"}


def add_floor(summary: dict, compute) -> None:
    """Add ``floor_us`` and ``floor`` (the dict ``compute()`` returns: ``benchmarks.floor.floor``'s
    bounds, ``bound`` the largest) to the summary; a floor that cannot be computed is
    ``floor_us`` None and ``floor`` {"error": why}, as ``bench`` records it."""
    try:
        found = compute()
    except Exception as err:  # pylint: disable=broad-except  (informative: never stops inspect)
        found = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    summary["floor"] = found
    summary["floor_us"] = found.get("floor_us")


def inspect_model(model, target, config: RammerConfig | None = None, profiler=None,
                  timings: list | None = None, shapes: dict | None = None,
                  batch: int | None = None, floor_of=None) -> dict:
    """One dict: rprograms, rtasks, veus, launches and default_launches (see report.summarize),
    ``critical_path`` (operators, predicted_us) of the model and of every rProgram,
    ``predicted_us`` of the whole inference (:func:`add_prediction`) and, given ``floor_of``,
    ``floor_us`` (:func:`add_floor`). ``shapes`` / ``batch`` bind an ONNX model's symbolic inputs
    (``frontend.import_onnx``)."""
    return inspect_lowered(model, target, config, profiler, timings, shapes, batch, floor_of)[0]


GROUPING_PASS = "RammerBackend"  # receives the fused, scheduled graph the policy places


@tvm.instrument.pass_instrument
class _BeforePass:
    """Keeps the module a named pass receives (the dependency graph the policy scheduled)."""

    def __init__(self, pass_name):
        self.pass_name, self.captured = pass_name, None

    def run_before_pass(self, mod, info):
        if info.name == self.pass_name:
            self.captured = mod


def placed_operators(mod: tvm.IRModule | None, unplaced: list) -> list:
    """``(uid, callee name, preds)`` of the operators RammerBackend placed, in the order
    the policy placed them (wave by wave), from the module it received; [] without one."""
    if mod is None:
        return []
    try:
        graph = DataflowGraph.from_function(mod["main"], mod)
    except ValueError:
        return []
    skipped = {op["name"] for op in unplaced}
    return [(i, str(graph.nodes[i].gvar.name_hint), list(graph.nodes[i].preds))
            for wave in graph.waves() for i in wave if graph.nodes[i].name not in skipped]


def add_critical_paths(summary: dict, grouped_mod: tvm.IRModule | None, barrier_us: float) -> None:
    """Add ``critical_path`` to the summary and to each of its rProgram reports (None when the
    reports cannot be matched to the scheduled graph)."""
    paths = rprogram_critical_paths(summary["programs"],
                                    placed_operators(grouped_mod, summary["unplaced"]), barrier_us)
    summary["critical_path"] = None if paths is None else {
        "operators": paths["operators"], "predicted_us": paths["predicted_us"]}
    by_kernel = {p["kernel"]: p for p in (paths or {}).get("programs", [])}
    for report in summary["programs"]:
        entry = by_kernel.get(report["kernel"])
        report["critical_path"] = None if entry is None else {
            k: v for k, v in entry.items() if k != "kernel"}
