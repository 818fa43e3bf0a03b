"""RammerGroupRPrograms: waves -> rPrograms -> one persistent call_tir each.

Input: a Relax module whose ``main`` is one dataflow block of ``call_tir`` bindings to dlight-scheduled
PrimFuncs (after LegalizeOps, FoldConstant, BranchPreservingFusion, FuseTIR and dlight). Output: the
same module where the operators of every rProgram chosen by the policy (Algorithm 1) are replaced by
ONE ``call_tir`` to a persistent PrimFunc (``tvm_rammer.codegen.persistent``).

Declines, leaving them as ordinary kernels between rPrograms with a logged reason: bindings that are
not static-shape call_tirs of scheduled GPU kernels (library or extern calls, dynamic shapes) and
kernels that ``tir_templates.prelower`` cannot turn into rTasks. An rProgram always ends before the
wave of such an operator, so compilation never fails because one operator is unsupported.

Must run after dlight (rKernels are the scheduled thread blocks) and before the dataflow lowering
passes (it emits dataflow bindings).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from tir_templates.prelower import UnsupportedKernel, prelower
from tir_templates.rtask_rewrite import early_exit_problem, instantiate
from tvm_rammer import rkernels
from tvm_rammer.codegen.persistent import (PersistentKernelSpec, build_persistent_func,
                                           encode_program, has_barriers)
from tvm_rammer.config import RammerConfig
from tvm_rammer.policy import OpGraph, schedule
from tvm_rammer.report import REPORT_ATTR, UNPLACED_ATTR
from tvm_rammer.resources import ResourceProbe
from tvm_rammer.target import rkernel_target

from .dataflow_graph import DataflowGraph
from .rprogram_tensors import TensorPlan, plan_tensors

LOG = logging.getLogger("tvm_rammer")


@dataclass
class _Plan:
    """A policy plan together with the tensors and code of its persistent kernel."""

    plan: object
    nodes: list
    first_wave: int
    tensors: TensorPlan
    spec: PersistentKernelSpec
    table: np.ndarray
    func: tvm.tirx.PrimFunc


def _static_shape(tensor) -> tuple:
    return tuple(int(d) for d in tensor.shape)


def _collect_operators(graph: DataflowGraph, mod: tvm.IRModule, target, config, vdevice):
    """rOperators for every placeable node; unplaceable nodes get their reason logged.

    With ``config.versions`` each operator gets several rKernel versions (``tvm_rammer.tuning``) timed
    by the profiler; otherwise one rKernel, the pipeline's dlight schedule, timed analytically."""
    from tvm_rammer.tuning import versions as tv
    from tvm_rammer.tuning.profile_db import ProfileDB
    from tvm_rammer.tuning.profiler import Profiler
    from tvm_rammer.tuning.tune import open_database

    ops, skipped = {}, {}
    if config.versions:
        stash = tv.unscheduled_funcs(mod)
        if not stash:
            LOG.info("tvm-rammer: no unscheduled PrimFuncs stashed (StashUnscheduled did not run); "
                     "one rKernel version per operator")
        database = None if config.tuning_db is None else open_database(config.tuning_db)
        db = ProfileDB.load(config.profile_db)
        # measure on the GPU only when asked to keep the results (--profile-db)
        profiler = Profiler(db, target, use_gpu=config.profile_db is not None)
    # identical operators share one PrimFunc (BlockBuilder dedups): version and time them once
    cache, built = {}, {}
    for node in graph.nodes:
        if node.kind == "alias":
            continue
        if not node.placeable:
            skipped[node.index] = node.reason
            continue
        name = node.gvar.name_hint
        if config.versions:
            if name not in cache:
                found = tv.kernel_versions(name, rkernel_target(target, config),
                                           scheduled=mod[node.gvar],
                                           unscheduled=stash.get(name), database=database)
                cache[name] = _runnable(found, config.max_rtask_threads)
            found = cache[name]
            if not found:
                skipped[node.index] = f"{name}: no rKernel version can run as rTasks in a vEU"
                continue
            if name not in built:
                built[name] = rkernels.operator_versions(node.index, name, mod[node.gvar], found,
                                                         config, vdevice, profiler)
            ops[node.index] = dataclasses.replace(built[name], uid=node.index)
            continue
        try:
            if name not in cache:
                cache[name] = prelower(mod[node.gvar], target, name=name)
            lowered = cache[name]
            problem = early_exit_problem(lowered, config.max_rtask_threads)
            if problem:
                raise UnsupportedKernel(problem)
        except UnsupportedKernel as err:
            skipped[node.index] = str(err)
            continue
        if name not in built:
            built[name] = rkernels.operator_from_kernel(node.index, name, mod[node.gvar], lowered,
                                                        config, vdevice)
        ops[node.index] = dataclasses.replace(built[name], uid=node.index)
    for index, reason in skipped.items():
        LOG.info("tvm-rammer: %s stays an ordinary kernel: %s", graph.nodes[index].name, reason)
    if config.versions:
        LOG.info("tvm-rammer: rKernel times %s", profiler.summary())
        if config.profile_db and db.dirty:
            db.save()
    return ops, skipped


def _runnable(versions: list, veu_threads: int) -> list:
    """The versions whose rTasks can share a vEU as wide as the widest rTask may be."""
    keep = []
    for version in versions:
        problem = early_exit_problem(version.lowered, veu_threads)
        if problem:
            LOG.info("tvm-rammer: version %s dropped: %s", version.name, problem)
        else:
            keep.append(version)
    return keep


def _op_graph(graph: DataflowGraph, ops: dict, skipped: dict) -> OpGraph:
    """The policy's view: placeable operators by wave, their placeable preds, forced split waves."""
    waves, split_before = [], set()
    for w, wave in enumerate(graph.waves()):
        waves.append([i for i in wave if i in ops])
        if any(i in skipped for i in wave):
            split_before.add(w)
    preds = {i: [p for p in graph.nodes[i].preds if p in ops] for i in ops}
    return OpGraph(ops=ops, preds=preds, waves=waves, split_before=split_before)


def _spec_for(name: str, graph: DataflowGraph, node_ids: list, selected: dict, ops: dict,
              config: RammerConfig):
    """The persistent kernel's code-relevant description for one rProgram, and its tensors."""
    kernel_of = {i: ops[i].kernels[selected[i]].payload for i in node_ids}
    tensors = plan_tensors(graph, node_ids, kernel_of)
    threads = max(e.kernel.threads for e in tensors.entries)
    veu_threads = -(-threads // 32) * 32
    spec = PersistentKernelSpec(name=name, tensors=tuple(tensors.slots),
                                num_inputs=tensors.num_inputs, entries=tuple(tensors.entries),
                                veu_threads=veu_threads, spin_limit=config.spin_limit)
    return spec, tensors


def _emit_order(graph: DataflowGraph, plans: list, levels: list, planned: set) -> list:
    """Segments (plans and leftover bindings) in an order where every input is defined first."""
    segments = [((p.first_wave, 1, k), ("plan", p)) for k, p in enumerate(plans)]
    for node in graph.nodes:
        if node.index in planned:
            continue
        rank = 2 if node.kind == "alias" else 0
        segments.append(((levels[node.index], rank, node.index), ("node", node)))
    return [seg for _, seg in sorted(segments, key=lambda s: s[0])]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Re-emits main's dataflow block: one call_tir per rProgram, other bindings unchanged."""

    def __init__(self, mod, graph, segments):
        super().__init__(mod)
        self.graph, self.segments = graph, segments
        self.done = False

    def visit_var_binding_(self, binding):
        if self.done:
            return
        self.done = True
        for kind, item in self.segments:
            if kind == "plan":
                self._emit_plan(item)
            else:
                self._emit_node(item)

    def _emit(self, var, value):
        bb = self.builder_
        new = bb.emit(value, name_hint=var.name) if isinstance(var, relax.DataflowVar) \
            else bb.emit_output(value, name_hint=var.name)
        self.set_var_remap(var, new)
        return new

    def _emit_node(self, node):
        binding = self.graph.block.bindings[node.index]
        self._emit(binding.var, self.visit_expr(binding.value))

    def _emit_plan(self, p: _Plan):
        bb = self.builder_
        gv = bb.add_func(p.func, p.spec.name)
        plan = p.tensors
        args = [self.visit_expr(e) for e in plan.input_exprs]
        if plan.blob is not None:
            args.append(relax.const(plan.blob, "uint8"))
        args.append(relax.const(p.table, "int32"))
        out_sinfo = [relax.TensorType(_static_shape(t), t.dtype) for t in plan.outputs]
        if plan.arena_bytes:
            out_sinfo.append(relax.TensorType((plan.arena_bytes,), "uint8"))
        out_sinfo.append(relax.TensorType((p.func.attrs["rammer.num_veus"] + 1,), "int32"))
        call = bb.emit(relax.call_tir(gv, relax.Tuple(args), out_sinfo), name_hint=p.spec.name)
        new_of = {t: relax.TupleGetItem(call, k) for k, t in enumerate(plan.outputs)}
        for i in p.nodes:
            node = self.graph.nodes[i]
            if not all(t in new_of for t in node.outputs):
                continue  # lives in the work arena only: nothing outside reads it
            items = [new_of[t] for t in node.outputs]
            value = items[0] if len(items) == 1 else relax.Tuple(items)
            self._emit(self.graph.block.bindings[i].var, value)


def _build_plan(k, plan, graph, op_graph, config, vdevice, probe, target) -> _Plan:
    """Code for one rProgram; re-placed when the compiled kernel's registers change its occupancy."""
    node_ids = list(plan.ops)
    spec, tensors = _spec_for(f"rammer_rprogram{k}", graph, node_ids, plan.selected,
                              op_graph.ops, config)
    registers = probe.registers(spec, target)
    if registers is not None and vdevice.occupancy(spec.veu_threads, registers,
                                                   spec.shared_bytes) != plan.veus_per_sm:
        plan = rkernels.replace_plan(plan, op_graph, registers, vdevice, config)
    plan.program.validate({op: op_graph.ops[op].kernels[plan.selected[op]].num_rtasks
                           for op in node_ids}, {op: op_graph.preds.get(op, []) for op in node_ids})
    # vEUs that got no rTask would only slow the grid sync down: drop the trailing empty ones
    num_veus = max(v + 1 for v, queue in enumerate(plan.program.prog) if queue)
    table = encode_program(plan.program, tensors.dispatch, num_veus)
    func = build_persistent_func(spec, num_veus, len(table), has_barriers(table, num_veus),
                                 instantiate, veus_per_sm=plan.veus_per_sm)
    report = rkernels.plan_report(plan, op_graph.ops, spec, num_veus, registers)
    func = func.with_attr(REPORT_ATTR, json.dumps(report))
    levels = graph.levels()  # a copy: take it once
    first_wave = min(levels[i] for i in node_ids)
    return _Plan(plan, node_ids, first_wave, tensors, spec, table, func)


def _plan_timer(graph, op_graph, config, vdevice, target, dev):
    """``build_and_time(plan)``: the measured time (us) of a plan's persistent kernel on ``dev``
    (compile-time profiling of whole rPrograms, paper 3.2), run on seeded random inputs."""
    rng = np.random.default_rng(0)

    def build_and_time(plan):
        built = _build_plan(0, plan, graph, op_graph, config, vdevice, ResourceProbe(False), target)
        name = built.spec.name
        lib = tvm.tirx.build(tvm.IRModule({name: built.func.with_attr("global_symbol", name)}),
                             target)
        args = []
        for param in built.func.params:
            shape, dtype = [int(d) for d in param.ty.shape], str(param.ty.dtype)
            if param.name == "rammer_program":
                data = built.table
            elif param.name == "weights" and built.tensors.blob is not None:
                data = built.tensors.blob
            elif dtype.startswith("float"):
                data = rng.standard_normal(shape).astype(dtype)
            else:
                data = np.zeros(shape, dtype=dtype)
            args.append(tvm.runtime.tensor(data, dev))
        timer = lib.time_evaluator(name, dev, number=20, repeat=5, min_repeat_ms=1)
        return float(np.median(timer(*args).results)) * 1e6

    return build_and_time


def _profile_for(graph, op_graph, config, vdevice, target):
    """The policy's ``profile``: measured rProgram times from the profile database, measuring on
    the local GPU when ``config.profile_db`` is set; None (analytical times) otherwise."""
    if not config.profile_db:
        return None, None
    from tvm_rammer.tuning.profile_db import ProfileDB
    from tvm_rammer.tuning.profiler import local_gpu, rprogram_profile

    db = ProfileDB.load(config.profile_db)
    arch = str(target.attrs.get("arch", "sm_90a"))
    gpu = local_gpu()
    if gpu is None:
        device = db.device_for_arch(arch) or f"unknown-{arch}"
        return rprogram_profile(op_graph, None, db, device, arch), db
    dev, device, _ = gpu
    timer = _plan_timer(graph, op_graph, config, vdevice, target, dev)
    return rprogram_profile(op_graph, timer, db, device, arch), db


@tvm.transform.module_pass(opt_level=0, name="RammerGroupRPrograms")
class RammerGroupRPrograms:
    """Replace the operators of each rProgram by one call_tir to its persistent kernel.

    Parameters
    ----------
    config: RammerConfig
        Policy, vDevice and codegen options.
    """

    def __init__(self, config: RammerConfig | None = None):
        self.config = config or RammerConfig()

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name != "cuda":
            raise ValueError("RammerGroupRPrograms needs a CUDA target in scope "
                             f"(got {target}); run it inside `with rammer_target(...)`")
        config = self.config
        vdevice = rkernels.vdevice_for(target, config)
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            raise ValueError("the module has no Relax function 'main' to schedule")
        try:
            graph = DataflowGraph.from_function(mod["main"], mod)
        except ValueError as err:  # control flow or several blocks: keep TVM's ordinary kernels
            LOG.warning("tvm-rammer: main is left as ordinary kernels: %s", err)
            return mod.with_attr(UNPLACED_ATTR, json.dumps([{"name": "main", "reason": str(err)}]))
        ops, skipped = _collect_operators(graph, mod, target, config, vdevice)
        if not ops:
            LOG.info("tvm-rammer: no operator can become rTasks; module left unchanged")
            unplaced = [{"name": graph.nodes[i].name, "reason": r} for i, r in skipped.items()]
            return mod.with_attr(UNPLACED_ATTR, json.dumps(unplaced))
        op_graph = _op_graph(graph, ops, skipped)
        profile, db = _profile_for(graph, op_graph, config, vdevice, target)
        plans = schedule(op_graph, vdevice, rkernels.policy_config(config, vdevice), profile)
        if db is not None and db.dirty:
            db.save()
        probe = ResourceProbe(enabled=config.measure_resources)
        built = [_build_plan(k, plan, graph, op_graph, config, vdevice, probe, target)
                 for k, plan in enumerate(plans)]
        planned = {i for p in built for i in p.nodes}
        segments = _emit_order(graph, built, graph.levels(), planned)
        rewriter = _Rewriter(mod, graph, segments)
        main_gv = mod.get_global_var("main")
        new_main = rewriter.visit_expr(mod["main"])
        rewriter.builder_.update_func(main_gv, new_main)
        new_mod = relax.transform.DeadCodeElimination(["main"])(rewriter.builder_.get())
        unplaced = [{"name": graph.nodes[i].name, "reason": reason} for i, reason in skipped.items()]
        return new_mod.with_attr(UNPLACED_ATTR, json.dumps(unplaced))
