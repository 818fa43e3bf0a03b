"""Schedule and launch counts of a model under the rammer and the default pipeline (no GPU needed)."""

from __future__ import annotations

import tvm
from tvm import relax

from relay_passes.dataflow_graph import DataflowGraph

from .config import RammerConfig
from .critical_path import rprogram_critical_paths
from .frontend import import_onnx, lower
from .report import summarize
from .target import RAMMER_KEY, resolve_target


def plain_cuda_target(target) -> tvm.target.Target:
    """The same target without the rammer key: TVM's default pipeline applies to it."""
    spec = dict(resolve_target(target).export())
    spec.pop("tag", None)
    spec["keys"] = [k for k in spec["keys"] if k != RAMMER_KEY]
    return tvm.target.Target(spec)


def lower_default(mod: tvm.IRModule, target) -> tvm.IRModule:
    """TVM's default CUDA Relax pipeline (the baseline "RammerBase"), Relax part only."""
    plain = plain_cuda_target(target)
    with plain:
        return relax.get_default_pipeline(plain)(mod)


def inspect_model(model, target, config: RammerConfig | None = None) -> dict:
    """One dict: rprograms, rtasks, veus, launches and default_launches (see report.summarize),
    and ``critical_path`` (operators, predicted_us) of the model and of every rProgram."""
    mod = model if isinstance(model, tvm.IRModule) else import_onnx(model)
    capture = _BeforePass(GROUPING_PASS)
    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(opt_level=current.opt_level, config=current.config,
                                   required_pass=current.required_pass,
                                   disabled_pass=current.disabled_pass,
                                   instruments=[*current.instruments, capture]):
        rammer_mod = lower(mod, target, config)
    default_mod = lower_default(mod, target)
    summary = summarize(rammer_mod, default_mod)
    add_critical_paths(summary, capture.captured, (config or RammerConfig()).barrier_us)
    return summary


GROUPING_PASS = "RammerGroupRPrograms"


@tvm.instrument.pass_instrument
class _BeforePass:
    """Keeps the module a named pass receives (the dependency graph the policy scheduled)."""

    def __init__(self, pass_name):
        self.pass_name, self.captured = pass_name, None

    def run_before_pass(self, mod, info):
        if info.name == self.pass_name:
            self.captured = mod


def placed_operators(mod: tvm.IRModule | None, unplaced: list) -> list:
    """``(uid, callee name, preds)`` of the operators RammerGroupRPrograms placed, in the order
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
