"""The rammer back end: rOperators, the policy, persistent kernels, and the checks on measured times.

``build_rprograms(graph, mod, target, config, profiler)`` turns the dataflow graph of ``main`` (after
dlight) into the rPrograms to emit:

1. rOperators: for every placeable operator its rKernel versions (``tuning.versions``), checked and
   timed on the device by the ``profiler`` (an object: a real GPU, a test's fake, or databases only).
   A version is a candidate only when measured and valid; with no measured time an operator has
   TVM's own dlight schedule only (``rkernels.operator_versions``); an operator too small for its
   choice to matter gets no other version at all (``_small_operators``);
2. the policy (``RammerConfig.policy``, ``tvm_rammer.scheduling.policies``; Algorithm 1 by default), whose P1 vs Pcurr+P2 uses rPrograms timed whole
   when the profiler can (the plans of one comparison, and the final rPrograms, built side by
   side: ``Profiler.plan_profile``'s ``prefetch``, ``Profiler.prebuild``);
3. code: one persistent PrimFunc per rProgram (``codegen.persistent``), placed again when the
   compiled kernel's registers change its occupancy;
4. never slower than TVM's default: an rProgram whose measured time is not below the measured time
   of its operators as TVM's default kernels is dropped, and its operators stay ordinary kernels;
   with nothing measured or read, an rProgram that ``unmeasured_check`` (occupancy and block
   latency) estimates behind TVM's default is not built (``RammerConfig.check_unmeasured``).

Operators left as ordinary kernels (not placeable, or from a dropped rProgram) get TVM's default
schedule (uncapped: what TVM's default pipeline would build). :class:`RammerBackend` is the module
pass that runs this and hands the result to the Relax rewrite ``relay_passes.RammerGroupRPrograms``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from relay_passes.dataflow_graph import DataflowGraph, becomes_view
from relay_passes.group_rprograms import RammerGroupRPrograms, RProgramCall
from relay_passes.lift_weights import weight_params
from tir_templates.default_schedule import schedule_like_default
from tir_templates.prelower import UnsupportedKernel
from tir_templates.rtask_rewrite import early_exit_problem, instantiate

from ..scheduling import rkernels, timeline, unmeasured_check
from ..codegen.persistent import (PersistentKernelSpec, build_persistent_func, encode_program,
                                 has_barriers, num_counters)
from ..codegen.tensors import TensorPlan, pack_func, plan_tensors
from ..config import RammerConfig
from ..codegen.executor import MANIFEST_ATTR, build_manifest
from ..codegen.faults import PAGE_FUNC, inject_test_fault, page_constant, page_function
from ..scheduling.policies import get_policy
from ..scheduling.policy import OpGraph
from . import prefetch
from .report import FALLBACK_ATTR, REPORT_ATTR, UNPLACED_ATTR
from ..codegen.resources import ResourceProbe
from ..target import plain_target, rkernel_target, target_arch
from .timings import TIMINGS_ATTR
from ..tuning.deferred import LateVersionError, func_if_made
from ..tuning.measure import KernelJob
from ..tuning.profiler import MAX_VERSIONS, Profiler, plan_key
from ..tuning import versions as tuning_versions
from ..tuning.versions import func_key, kernel_versions, unscheduled_funcs
from ..tuning.version_pool import VersionRequest, make_versions_in_pool

__all__ = ["BuiltRProgram", "BackendResult", "build_rprograms", "RammerBackend", "make_profiler"]

LOG = logging.getLogger("tvm_rammer")

# A later stage's service, registered when that stage is imported (never imported from here):
# ``factory(target)`` -> an object whose ``validate(jobs)`` checks every rKernel version against
# TVM's default kernel ({version key: record}) and whose ``stats`` says what it did, for
# ``RammerConfig(emulate_versions=True)``. ``tvm_rammer.checks.emulator.versions`` registers the
# CPU emulator's (importing ``tvm_rammer`` imports it). Not configuration: in no key.
_VERSION_CHECKER: dict = {}


def register_version_checker(factory) -> None:
    """Make ``factory(target)`` the check of rKernel versions that ``emulate_versions`` runs."""
    _VERSION_CHECKER["factory"] = factory


@dataclass
class BuiltRProgram:
    """A policy plan with its tensors, table and persistent kernel."""

    plan: object
    nodes: list
    first_wave: int
    tensors: TensorPlan
    spec: PersistentKernelSpec
    table: np.ndarray
    func: tvm.tirx.PrimFunc
    report: dict
    schedule: dict | None = None  # timeline.schedule_of: what the timeline needs (inspect, run)
    manifest: dict | None = None  # executor.build_manifest: what the reference executor checks

    @property
    def uses_fault_page(self) -> bool:
        """Whether the persistent kernel takes the module's fault page (it has barriers)."""
        return bool(self.func.attrs.get("rammer.fault_page", False))

    def call(self, fault_page: tvm.ir.expr.Constant | None = None) -> RProgramCall:
        """What the Relax rewrite needs to emit this rProgram. ``fault_page``: the module's one
        page (``faults.page_constant``), required when :attr:`uses_fault_page`."""
        args = list(self.tensors.input_exprs)
        packs = ()
        if self.tensors.blob is not None:
            args.append(_uint8_const(self.tensors.blob))
        elif self.tensors.packed is not None:  # weights apart: the blob packed from them
            nbytes, parts = self.tensors.packed
            func = pack_func([(tuple(int(d) for d in t.shape), t.dtype, offset)
                              for t, offset in parts], nbytes)
            packs = ((len(args), func, tuple(t.expr for t, _ in parts),
                      relax.TensorType((nbytes,), "uint8")),)
            args.append(relax.const(np.zeros(1, "uint8")))  # placeholder: the pack's output
        args.append(relax.const(self.table, "int32"))
        if self.uses_fault_page:
            if fault_page is None:
                raise ValueError(f"{self.spec.name} has barriers: pass the module's fault page")
            args.append(fault_page)
        extra = []
        if self.tensors.arena_bytes:
            extra.append(relax.TensorType((self.tensors.arena_bytes,), "uint8"))
        extra.append(relax.TensorType((int(self.func.attrs["rammer.state_words"]),), "int32"))
        if self.spec.timeline:  # the instrumented build's per-run timeline buffer: last output
            extra.append(relax.TensorType((int(self.func.attrs["rammer.timeline_words"]),), "int64"))
        func = self.func.with_attr(REPORT_ATTR, json.dumps(self.report))
        if self.schedule is not None:
            func = func.with_attr(timeline.SCHEDULE_ATTR, json.dumps(self.schedule))
        if self.manifest is not None:
            func = func.with_attr(MANIFEST_ATTR, json.dumps(self.manifest))
        return RProgramCall(name=self.spec.name, func=func, nodes=tuple(self.nodes),
                            args=tuple(args), outputs=tuple(self.tensors.outputs),
                            extra_outputs=tuple(extra), level=self.first_wave, packs=packs,
                            aliased=tuple(self.tensors.aliased))

    def instrumented(self) -> "BuiltRProgram":
        """The same rProgram with the timeline-instrumented persistent kernel (a separate build:
        ``RammerConfig(timeline=True)``; every decision is made on the uninstrumented one)."""
        num_veus = int(self.func.attrs["rammer.num_veus"])
        spec = dataclasses.replace(self.spec, timeline=True)
        func = build_persistent_func(spec, num_veus, len(self.table), has_barriers(self.table, num_veus),
                                     instantiate, veus_per_sm=self.plan.veus_per_sm,
                                     num_instructions=int(self.table[num_veus]),
                                     counters=num_counters(self.plan.program))
        return dataclasses.replace(self, spec=spec, func=func)

    def fixed_args(self) -> dict:
        """The kernel parameters whose contents matter for its time: the program table and the
        constants blob (everything else is seeded)."""
        fixed = {"rammer_program": self.table}
        if self.tensors.blob is not None:
            fixed["weights"] = self.tensors.blob
        return fixed


def _uint8_const(blob: np.ndarray) -> relax.Constant:
    """A Relax constant of the constants blob, sharing its memory where it is aligned for DLPack
    (``codegen.tensors.aligned_zeros``): a model's weights are not copied twice more."""
    try:
        return relax.const(tvm.runtime.from_dlpack(blob))
    except (RuntimeError, TypeError, BufferError):
        return relax.const(blob, "uint8")


@dataclass
class BackendResult:
    """What :func:`build_rprograms` decided: rPrograms to emit, operators left as ordinary kernels
    (index -> reason) and rPrograms dropped for being slower than TVM's default."""

    rprograms: list
    unplaced: dict
    fallbacks: list = field(default_factory=list)
    operators: dict = field(default_factory=dict)
    phases: list = field(default_factory=list)  # (phase, seconds), in order


@contextlib.contextmanager
def _phase(phases: list, name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        phases.append((name, round(time.perf_counter() - start, 4)))


# --- rOperators --------------------------------------------------------------------------------

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


@dataclass
class _Candidate:
    """One distinct operator (PrimFunc) of the graph and its versions."""

    name: str
    node: object
    versions: list
    reference: object = None
    reference_key: str | None = None
    checked: list | None = None  # emulate_versions: one record per version made
    emulator_dropped: list = field(default_factory=list)
    unusable: str | None = None  # emulate_versions: why the pipeline's own version cannot be used


def _made_in_workers(pending, mod, stash, rk_target, plain, profiler, database) -> dict:
    """name -> ``version_pool.MadeVersions`` of the pending operators whose every version is made,
    made in the measuring device's build processes when it lends them (``version_workers``: a host
    with enough cores) within the profiling budget; the operators left out are made in the loop,
    in process, under the budget as without workers."""
    lend = getattr(profiler.device, "version_workers", None)
    pool, submit = lend() if lend is not None else (None, None)
    requests = [VersionRequest(name, rk_target, mod[node.gvar], stash[name], reference_target=plain)
                for name, (node, others) in pending.items() if others and name in stash]
    if pool is None or database is not None or len(requests) < 2:
        return {}
    left = profiler.remaining_s()  # None: no budget, and then a hung worker waits 10 minutes
    return make_versions_in_pool(requests, pool, submit, within_s=600.0 if left is None else left)


def _small_operators(operators: dict, mod, stash: dict, rk_target, config, vdevice, records) -> tuple:
    """(the names of the operators too small for their choice to matter, name -> its dlight
    version prelowered here), for a compile whose profiler has a margin.

    ``profiler.decisive_jobs`` measures nothing of an operator whose dlight version is predicted
    under ``MIN_SHARE`` of the summed dlight predictions of all operators
    (``profiler.small_operators``); its other versions, with no measured time, are never chosen,
    so making them (scheduling and prelowering ~10 versions) is wasted. This finds those operators
    first, with the same predictions (of each dlight version that prelowers and fits a vEU): from
    the operator's record when it has one (checked again when the record is used), else by
    prelowering its dlight version (returned, so that it is not lowered twice). An operator that
    fails here is simply not small (it is made as before, and fails there on its own). The set
    can only be smaller than ``decisive_jobs``' (an operator whose versions fail to be made
    leaves that total), never larger: what is measured and chosen is the same. Also where a
    database holds kernel records of a small operator's other versions (from another model or a
    compile with ``profile_margin=None``), they are not offered: it keeps dlight, as the device
    compile that wrote its record did. On a host that makes versions in its build processes
    (``tuning.version_pool``) the dlight versions lowered here are lowered there again: this
    lowering (~25 ms an operator without a record) is the one part done in the main process, so
    that every host makes the same versions and writes the same records. ``operators``: name ->
    node; ``stash``: the unscheduled PrimFuncs (``unscheduled_funcs``)."""
    from ..tuning.profiler import small_operators

    base_us, lowered = {}, {}
    for name, node in operators.items():
        scheduled = mod[node.gvar]
        try:
            recorded = records.base_us(scheduled, stash[name]) \
                if (records is not None and name in stash) else None
            if recorded is None:
                lowered[name] = tuning_versions.prelower(scheduled, rk_target, name=name)
                if early_exit_problem(lowered[name], config.max_rtask_threads):
                    continue
                recorded = rkernels.predicted_version_us(scheduled, lowered[name], config, vdevice)
        except Exception as err:  # pylint: disable=broad-except  (not small: made as before)
            LOG.debug("tvm-rammer: %s: no dlight prediction (%s)", name, str(err).splitlines()[0])
            continue
        base_us[name] = recorded
    return small_operators(base_us), lowered


def _candidates(graph, mod, target, config, profiler, skipped, vdevice=None):
    """name -> _Candidate for every distinct placeable PrimFunc; the unplaceable ones go to skipped.

    Versions other than the pipeline's dlight schedule are made only when the profiler can measure
    them or has records to read: without measured times they could never be chosen; with a
    margin, not for an operator too small to be measured (``_small_operators``). An operator
    with a usable operator record (``tuning.operator_record``) gets only the versions a choice
    or a measurement can use; the others take the full path, and with a device have their record
    written."""
    from ..tuning.operator_record import OperatorRecords
    from ..tuning.versions import open_database

    informed = profiler.measures or bool(profiler.sources) or config.emulate_versions
    stash = unscheduled_funcs(mod) if informed else {}
    database = open_database(config.tuning_db) if (informed and config.tuning_db) else None
    rk_target, plain = rkernel_target(target, config), plain_target(target)
    records = None  # not with the emulator's check of every version, nor metaschedule versions
    if informed and stash and not config.emulate_versions and not config.tuning_db:
        records = OperatorRecords(profiler, target, config,
                                  runnable=lambda vs: _runnable(vs, config.max_rtask_threads),
                                  vdevice=rkernels.vdevice_for(target, config),
                                  predict=rkernels.predicted_version_us, max_versions=MAX_VERSIONS)

    def out_of_budget(name, others) -> bool:  # past the budget they could never be measured
        if others and profiler.measures and name in stash and profiler.over_budget():
            profiler.versions_not_made(name)
            return True
        return False

    operators = {}
    for node in graph.nodes:
        if node.kind == "alias":
            continue
        if not node.placeable:
            skipped[node.index] = node.reason
            continue
        operators.setdefault(node.gvar.name_hint, node)
    small, base_lowered = set(), {}
    if config.versions and stash and vdevice is not None and profiler.margin is not None \
            and config.profile_margin is not None and database is None \
            and not config.emulate_versions:
        small, base_lowered = _small_operators(operators, mod, stash, rk_target, config, vdevice,
                                               records)
    found, pending = {}, {}
    for name, node in operators.items():
        others = config.versions and name not in small and not node.inplace \
            and not out_of_budget(name, config.versions)  # in place: no output to check versions by
        reused = records.made(name, mod[node.gvar], stash[name], dlight_only=name in small) \
            if (records is not None and (others or name in small) and name in stash) else None
        if reused is not None:
            found[name] = _Candidate(name, node, reused.versions, reused.reference, reused.reference_key)
            continue
        pending[name] = (node, others)
    made = _made_in_workers(pending, mod, stash, rk_target, plain, profiler, database)
    for name, (node, others) in pending.items():
        here = made.get(name)
        if here is None and out_of_budget(name, others):  # spent while earlier ones were made
            others = False
        try:
            versions = here.versions if here is not None else kernel_versions(
                name, rk_target, scheduled=mod[node.gvar],
                unscheduled=stash.get(name) if others else None, database=database,
                scheduled_lowered=base_lowered.get(name))
        except Exception as err:  # pylint: disable=broad-except  (one operator's failure is its own)
            LOG.info("tvm-rammer: no rKernel version of %s: %s", name, str(err).splitlines()[0])
            versions = []
        versions = _runnable(versions, config.max_rtask_threads)
        found[name] = _Candidate(name, node, versions)
        if versions and informed and name in stash:
            ref = here.reference if here is not None else schedule_like_default(stash[name], plain)
            if ref is not None:
                found[name].reference, found[name].reference_key = ref, func_key(ref)
        if records is not None and (others or name in small) and name in stash:
            records.note(name, mod[node.gvar], stash[name], versions, found[name].reference_key,
                         dlight_only=name in small)
    return found


def _jobs(candidates: dict, predict=None) -> list:
    """One KernelJob per version; ``predict(candidate)`` (version key -> analytical kernel time)
    lets the profiler measure only the versions that can change a choice."""
    jobs = []
    for c in candidates.values():
        times = predict(c) if predict is not None else {}
        jobs += [KernelJob(key=v.key, label=f"{c.name}:{v.name}", func=func_if_made(v),
                           reference=c.reference,
                           reference_key=c.reference_key, num_outputs=len(c.node.outputs),
                           operator=c.name, predicted_us=times.get(v.key),
                           base=v.name == rkernels.PIPELINE_VERSION)
                 for v in c.versions]
    return jobs


def _predictor(mod, config: RammerConfig, vdevice):
    """``predict(candidate)`` for :func:`_jobs`: each version's analytical whole-kernel time."""
    def predict(c) -> dict:
        try:
            flops, nbytes = rkernels.flops_and_bytes(mod[c.node.gvar])
            return {v.key: rkernels.predicted_kernel_us(flops, nbytes, v.lowered, config, vdevice)
                    for v in c.versions}
        except Exception:  # pylint: disable=broad-except  (no prediction: measured as before)
            return {}
    return predict


def _check_on_emulator(candidates: dict, target) -> None:
    """``RammerConfig.emulate_versions``: every version of every candidate checked against TVM's
    default kernel on the CPU emulator (``checks.emulator.versions``, registered with
    :func:`register_version_checker`); each candidate gets ``checked``
    (one record per version), the versions not valid there leave ``versions`` for
    ``emulator_dropped``, and ``unusable`` says why when that removes the pipeline's own version
    (the operator then stays TVM's default kernel, as when a GPU measures it wrong)."""
    factory = _VERSION_CHECKER.get("factory")
    if factory is None:
        raise ValueError("RammerConfig(emulate_versions=True) needs the CPU emulator's check of "
                         "rKernel versions: import tvm_rammer.checks.emulator first (importing "
                         "tvm_rammer does)")
    validator = factory(target)
    records = validator.validate(_jobs(candidates))
    LOG.info("tvm-rammer: %d rKernel versions checked on the emulator (%s)", len(records),
             validator.stats)
    for c in candidates.values():
        c.checked, keep = [], []
        for v in c.versions:
            rec = records[v.key]
            c.checked.append({"version": v.name, "source": v.source, "valid": rec["valid"],
                              "max_rel_err": rec["max_rel_err"],
                              **({"reason": rec["reason"]} if rec["reason"] else {})})
            if rec["valid"] is True:
                keep.append(v)
                continue
            c.emulator_dropped.append({"version": v.name, "source": v.source,
                                       "reason": f"emulator: {rec['reason']}"})
            if v.name == rkernels.PIPELINE_VERSION:
                c.unusable = (f"its dlight rKernel is not valid on the emulator ({rec['reason']}); "
                              "it stays TVM's default kernel")
        c.versions = keep


def collect_operators(graph: DataflowGraph, mod, target, config: RammerConfig, vdevice,
                      profiler: Profiler):
    """(rOperators by node index, skipped node index -> reason), every version measured first."""
    skipped: dict = {}
    candidates = _candidates(graph, mod, target, config, profiler, skipped, vdevice)
    predict = _predictor(mod, config, vdevice) if (profiler.measures and config.profile_margin) else None
    profiler.prepare(_jobs(candidates, predict))
    if config.emulate_versions:
        _check_on_emulator(candidates, target)
    built, ops = {}, {}
    resident = rkernels.resident_inputs(graph, rkernels.cost_config(config, vdevice).l2_resident_bytes)
    fetching = prefetch.enabled(config, target)
    boxes: dict = {}  # PrimFunc name -> prefetch.whole_reads of it
    weights = set(weight_params(graph.func)) if fetching else set()
    for node in graph.nodes:
        if node.kind == "alias" or node.index in skipped:
            continue
        cand = candidates[node.gvar.name_hint]
        if cand.unusable:
            skipped[node.index] = cand.unusable
            continue
        key = (cand.name, resident.get(node.index, ()))  # the same kernel, its weights in L2 or not
        if key not in built:
            try:
                built[key] = rkernels.operator_versions(
                    node.index, cand.name, mod[node.gvar], cand.versions, config, vdevice, profiler,
                    reference_key=cand.reference_key, resident=key[1])
            except UnsupportedKernel as err:
                built[key] = str(err)
        op = built[key]
        if isinstance(op, str):
            skipped[node.index] = op
            continue
        if cand.checked is not None:
            op = dataclasses.replace(op, versions_checked=cand.checked,
                                     dropped=cand.emulator_dropped + list(op.dropped))
        if fetching:  # weights prefetched across the barrier before its rTasks (prefetch.py)
            name = node.gvar.name_hint
            op = prefetch.with_prefetch(
                op, node, lambda n=name: boxes.setdefault(n, prefetch.whole_reads(mod[n])),
                weights, config, vdevice, resident.get(node.index, ()))
        ops[node.index] = dataclasses.replace(op, uid=node.index)
    for index, reason in skipped.items():
        LOG.info("tvm-rammer: %s stays an ordinary kernel: %s", graph.nodes[index].name, reason)
    LOG.info("tvm-rammer: rKernel times %s", profiler.summary())
    return ops, skipped


def op_graph_of(graph: DataflowGraph, ops: dict, skipped: dict) -> OpGraph:
    """The policy's view: placeable operators by wave, their placeable preds, forced split waves."""
    waves, split_before = [], set()
    for w, wave in enumerate(graph.waves()):
        waves.append([i for i in wave if i in ops])
        if any(i in skipped for i in wave):
            split_before.add(w)
    preds = {i: [p for p in graph.nodes[i].preds if p in ops] for i in ops}
    return OpGraph(ops=ops, preds=preds, waves=waves, split_before=split_before)


# --- code ---------------------------------------------------------------------------------------

def _spec_for(name: str, graph: DataflowGraph, node_ids: list, selected: dict, ops: dict,
              config: RammerConfig):
    """The persistent kernel's code-relevant description for one rProgram, and its tensors."""
    kernel_of = {i: ops[i].kernels[selected[i]].payload for i in node_ids}
    blocks_of = {i: ops[i].kernels[selected[i]].blocks_per_rtask for i in node_ids}
    tensors = plan_tensors(graph, node_ids, kernel_of, blocks_of)
    threads = max(e.kernel.threads for e in tensors.entries)
    veu_threads = -(-threads // 32) * 32
    spec = PersistentKernelSpec(name=name, tensors=tuple(tensors.slots),
                                num_inputs=tensors.num_inputs, entries=tuple(tensors.entries),
                                veu_threads=veu_threads,
                                wait_timeout_ns=int(config.wait_timeout_ms * 1e6),
                                rkernel_functions=config.rkernel_functions)
    return spec, tensors


def build_plan(k: int, plan, graph, op_graph, config, vdevice, probe, target) -> BuiltRProgram:
    """Code for one rProgram; re-placed when the compiled kernel's registers change its occupancy."""
    node_ids = list(plan.ops)
    spec, tensors = _spec_for(f"rammer_rprogram{k}", graph, node_ids, plan.selected,
                              op_graph.ops, config)
    fetches = prefetch.prefetch_ranges(graph, node_ids, op_graph.ops, plan.selected, tensors)
    if fetches:  # the weights blob is the one slot named "weights" (codegen.tensors)
        slot = next(i for i, t in enumerate(spec.tensors[:spec.num_inputs]) if t.name == "weights")
        spec = dataclasses.replace(spec, prefetch_slot=slot)
    registers = probe.registers(spec, target)
    if registers is not None and vdevice.occupancy(spec.veu_threads, registers,
                                                   spec.shared_bytes) != plan.veus_per_sm:
        plan = rkernels.replace_plan(plan, op_graph, registers, vdevice, config)
    plan.program.validate({op: op_graph.ops[op].kernels[plan.selected[op]].num_rtasks
                           for op in node_ids}, {op: op_graph.preds.get(op, []) for op in node_ids})
    # vEUs that got no rTask would only slow the grid sync down: drop the trailing empty ones
    num_veus = max(v + 1 for v, queue in enumerate(plan.program.prog) if queue)
    table = encode_program(plan.program, tensors.dispatch, num_veus, fetches,
                           config.prefetch_lookahead)  # timed: never injected
    func = build_persistent_func(spec, num_veus, len(table), has_barriers(table, num_veus),
                                 instantiate, veus_per_sm=plan.veus_per_sm,
                                 counters=num_counters(plan.program))
    report = rkernels.plan_report(plan, op_graph.ops, spec, num_veus, registers)
    first_wave = min(graph.levels()[i] for i in node_ids)
    schedule = timeline.schedule_of(k, spec.name, plan, op_graph, num_veus, vdevice.num_sms, config)
    manifest = build_manifest(graph, node_ids, tensors, spec, table, num_veus, {
        op: op_graph.ops[op].kernels[plan.selected[op]].num_rtasks for op in node_ids})
    return BuiltRProgram(plan, node_ids, first_wave, tensors, spec, table, func, report, schedule,
                         manifest)


def _plan_timer(graph, op_graph, config, vdevice, target, profiler):
    """``build_and_time(plan)``: the measured time (us) of a plan's persistent kernel (compile-time
    profiling of whole rPrograms, paper 3.2), or None without a device. Its ``start_build(plan)``
    makes the plan's code and starts its build on the device (``Profiler.prebuild``): the
    profiler's ``prefetch`` calls it for the plans of one comparison, and ``build_and_time`` then
    times what was started."""
    if not profiler.measures:
        return None
    # id(plan) -> (plan, BuiltRProgram) whose build start_build started: the policy names and
    # then asks for the same plan object (policy._merge_pays), so no key is hashed again here
    started: dict = {}

    def build(plan):
        return build_plan(0, plan, graph, op_graph, config, vdevice, ResourceProbe(False), target)

    def build_and_time(plan):
        named = started.pop(id(plan), None)
        built = named[1] if named is not None and named[0] is plan else build(plan)
        measured = profiler.time_kernel(built.func, built.fixed_args())  # within the budget
        if measured is not None:  # also under the key with its table, the final check's
            profiler.record_rprogram(plan_key(plan, op_graph, built.table), measured)
        return measured

    def start_build(plan) -> None:
        built = build(plan)
        started[id(plan)] = (plan, built)
        profiler.prebuild(built.func)

    build_and_time.start_build = start_build
    return build_and_time


def _check_against_default(built: BuiltRProgram, op_graph, profiler, timer) -> dict | None:
    """The fallback record when ``built`` is not faster than its operators as TVM's default kernels
    (both measured), else None. Annotates ``built.report`` with both times."""
    if not profiler.measures and not profiler.sources:
        return None  # nothing measured and nothing to read: no time to compare
    ops = op_graph.ops
    default_us = profiler.default_time([getattr(ops[i], "reference_key", None) for i in built.nodes])
    measure = None if timer is None else (
        lambda: profiler.time_kernel(built.func, built.fixed_args()))
    rammer_us, source = profiler.rprogram_time(plan_key(built.plan, op_graph, built.table), measure,
                                               force=True)
    built.report.update(measured_us=rammer_us, default_us=default_us, measured_source=source)
    if rammer_us is None or default_us is None or rammer_us < default_us:
        return None
    return {"kernel": built.spec.name, "operators": [ops[i].name for i in built.nodes],
            "rammer_us": rammer_us, "default_us": default_us,
            "reason": f"rProgram measured {rammer_us:.1f} us, not faster than TVM's default kernels "
                      f"({default_us:.1f} us): its operators stay TVM's default kernels"}


def _with_injected_fault(one: BuiltRProgram, config) -> BuiltRProgram:
    """``one`` with its emitted table carrying the test fault when the config asks for it
    (``faults.inject_test_fault``); applied after every measurement, so nothing timed waits on it."""
    num_veus = int(one.func.attrs["rammer.num_veus"])
    table = inject_test_fault(one.table, num_veus, config)
    if table is one.table:
        return one
    manifest = None if one.manifest is None else {**one.manifest, "table": [int(x) for x in table]}
    return dataclasses.replace(one, table=table, manifest=manifest)


def _views_only(plan, graph, mod, skipped) -> bool:
    """True (and its operators skipped) for an rProgram made only of reshapes that TVM's default
    pipeline turns into views: as TVM's default they cost no launch, as an rProgram one."""
    if not all(becomes_view(graph.nodes[i], mod) for i in plan.ops):
        return False
    for i in plan.ops:
        skipped[i] = "a reshape that TVM turns into a view (no kernel); an rProgram of views only " \
                     "would add a launch"
    return True


def build_rprograms(graph: DataflowGraph, mod: tvm.IRModule, target, config: RammerConfig,
                    profiler: Profiler, vdevice=None) -> BackendResult:
    """The rPrograms of ``graph`` (see the module docstring). A version made from its operator
    record when first used that is not what the record says (``tuning.deferred``) makes the
    compile start again with every operator record ignored: the full path's result."""
    mark = profiler.mark()
    try:
        return _build_rprograms(graph, mod, target, config, profiler, vdevice)
    except LateVersionError as err:
        LOG.warning("tvm-rammer: %s; compiling again with every operator's versions made", err)
        profiler.ignore_operator_records(mark)
        return _build_rprograms(graph, mod, target, config, profiler, vdevice)


def _build_rprograms(graph, mod, target, config, profiler, vdevice) -> BackendResult:
    phases: list = []
    vdevice = vdevice or rkernels.vdevice_for(target, config)
    with _phase(phases, "rOperators and versions"):
        ops, skipped = collect_operators(graph, mod, target, config, vdevice, profiler)
    if not ops:
        profiler.finish()
        return BackendResult([], skipped, phases=phases)
    op_graph = op_graph_of(graph, ops, skipped)
    timer = _plan_timer(graph, op_graph, config, vdevice, target, profiler)
    profile = profiler.plan_profile(op_graph, timer) if (timer or profiler.sources) else None
    with _phase(phases, "policy (Algorithm 1)" if config.policy == "rammer" else f"policy ({config.policy})"):
        plans = get_policy(config.policy)(op_graph, vdevice, rkernels.policy_config(config, vdevice),
                                          profile)
    probe = ResourceProbe(enabled=config.measure_resources)
    built, fallbacks = [], []
    unmeasured = (config.check_unmeasured and config.veus_per_sm is None  # a pinned vDevice is kept
                  and not profiler.measures and not profiler.sources)
    made = []
    for k, plan in enumerate(plans):
        if _views_only(plan, graph, mod, skipped):
            continue
        if unmeasured:  # nothing measured: TVM's kernels as rTasks, estimated against TVM's default
            estimate = unmeasured_check.check_plan(plan, op_graph, vdevice, config)
            if estimate is not None:
                estimate["kernel"] = f"rammer_rprogram{k}"
                LOG.warning("tvm-rammer: %s", estimate["reason"])
                fallbacks.append(estimate)
                for i in plan.ops:
                    skipped[i] = (f"in rProgram {k}, estimated slower than TVM's default kernels "
                                  "with nothing measured (RammerConfig.check_unmeasured)")
                continue
        with _phase(phases, f"persistent kernel {k}"):
            one = build_plan(k, plan, graph, op_graph, config, vdevice, probe, target)
        if timer is not None:  # every final rProgram is timed: their builds run side by side
            profiler.prebuild(one.func, plan_key(one.plan, op_graph, one.table))
        made.append((k, one))
    for k, one in made:
        with _phase(phases, f"check {k} against TVM default"):
            fallback = _check_against_default(one, op_graph, profiler, timer)
        if fallback is None:
            one = _with_injected_fault(one, config)
            built.append(one.instrumented() if config.timeline else one)
            continue
        LOG.warning("tvm-rammer: %s", fallback["reason"])
        fallbacks.append(fallback)
        for i in one.nodes:
            skipped[i] = f"in {one.spec.name}, which was slower than TVM's default kernels"
    profiler.finish()  # one warning naming what the budget left unmeasured
    return BackendResult(built, skipped, fallbacks, ops, phases)


# --- the module pass ----------------------------------------------------------------------------

def make_profiler(target, config: RammerConfig, device=None, started: float | None = None) -> Profiler:
    """The default profiler of a compilation (see ``RammerConfig.profile``/``profile_db``): the
    per-user cache or ``profile_db``, and the local GPU when it has the target's arch.
    ``started``: when the compile started (``time.monotonic()``; None: now), the start of
    ``profile_budget_s``."""
    import os

    from ..host.gpu import local_gpu
    from ..target import same_arch
    from ..tuning.measure import CudaDevice
    from ..tuning.profile_db import (JsonProfileDB, default_cache_path, open_profile_db,
                                    shipped_profile_dbs)

    arch = target_arch(target)
    if not config.profile:
        db = open_profile_db(config.profile_db, readonly=True) if config.profile_db else JsonProfileDB()
        return Profiler(db, None, arch, rprogram_budget=0, progress=False)
    if device is None:
        gpu = local_gpu()
        if gpu is not None and same_arch(gpu.id.arch, arch):
            device = CudaDevice(gpu, target)
        elif gpu is not None:
            LOG.warning("tvm-rammer: the local GPU (%s, %s) is not the target's arch %s: nothing is "
                        "measured", gpu.id.name, gpu.id.arch, arch)
    if config.profile_db:
        db = open_profile_db(config.profile_db)
    else:  # the per-user cache: written with a device, read (when it exists) without one
        path = default_cache_path()
        try:
            db = open_profile_db(path) if device is not None else (
                open_profile_db(path, readonly=True) if os.path.exists(path) else JsonProfileDB())
        except (OSError, ValueError) as err:
            LOG.warning("tvm-rammer: profile cache %s unusable (%s); measuring into memory only",
                        path, err)
            db = JsonProfileDB()
    return Profiler(db, device, arch, readonly=shipped_profile_dbs(),
                    rprogram_budget=config.rprogram_profiles, margin=config.profile_margin,
                    budget_s=config.profile_budget_s, started=started)


def _with_default_kernels(mod: tvm.IRModule, graph: DataflowGraph, unplaced: dict, target):
    """``mod`` where every PrimFunc called only by ordinary-kernel operators has TVM's default
    (uncapped) schedule, as TVM's default pipeline would build it."""
    stash = unscheduled_funcs(mod)
    names = {graph.nodes[i].gvar.name_hint for i in unplaced if graph.nodes[i].gvar is not None}
    if not names or not stash:
        return mod
    plain = plain_target(target)
    updated = dict(mod.functions_items())
    for gv in list(updated):
        if gv.name_hint in names and gv.name_hint in stash:
            default = schedule_like_default(stash[gv.name_hint], plain)
            if default is not None:
                updated[gv] = default
    return tvm.IRModule(updated, attrs=mod.attrs)


@tvm.transform.module_pass(opt_level=0, name="RammerBackend")
class RammerBackend:
    """Schedule ``main``'s operators into rPrograms and emit one persistent call_tir each.

    Input: a Relax module after dlight (``main`` one dataflow block of call_tirs). Output: the same
    module with each rProgram's operators replaced by one call_tir (``relay_passes``'
    ``RammerGroupRPrograms``), its other operators TVM's default kernels, and the attributes
    ``inspect`` reads (operators left out, rPrograms dropped for being slower). Needs a CUDA target
    in scope. This is the back end, not a graph rewrite: it times kernels through ``profiler``.
    """

    def __init__(self, config: RammerConfig | None = None, profiler: Profiler | None = None,
                 started: float | None = None):
        self.config = config or RammerConfig()
        self.profiler = profiler
        self.started = started  # the compile's start (time.monotonic()): profile_budget_s counts from it

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name not in ("cuda", "rocm"):
            raise ValueError("RammerBackend needs a CUDA or ROCm target in scope "
                             f"(got {target}); run it inside `with rammer_target(...)`")
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            raise ValueError("the module has no Relax function 'main' to schedule")
        try:
            graph = DataflowGraph.from_function(mod["main"], mod)
        except ValueError as err:  # control flow or several blocks: keep TVM's ordinary kernels
            LOG.warning("tvm-rammer: main is left as ordinary kernels: %s", err)
            return mod.with_attr(UNPLACED_ATTR, json.dumps([{"name": "main", "reason": str(err)}]))
        profiler = self.profiler or make_profiler(target, self.config, started=self.started)
        try:
            result = build_rprograms(graph, mod, target, self.config, profiler)
        except Exception as err:  # pylint: disable=broad-except
            if not profiler.measures:
                raise  # no device involved: a bug to see, not to hide
            reason = f"the rammer back end failed while measuring ({type(err).__name__}: {err})"
            LOG.warning("tvm-rammer: %s; every operator stays TVM's default kernel", reason)
            result = BackendResult([], {n.index: reason for n in graph.nodes if n.kind != "alias"})
        finally:
            if self.profiler is None:  # ours: stop its build and runner processes
                profiler.close()
        if not result.rprograms:
            LOG.info("tvm-rammer: no rProgram; every operator stays TVM's default kernel")
        phases = result.phases
        with _phase(phases, "ordinary kernels: TVM default schedule"):
            mod = _with_default_kernels(mod, graph, result.unplaced, target)
        with _phase(phases, "Relax rewrite"):
            # one fault page per module, returned by its function rammer_fault_page (faults.py)
            page = page_constant() if any(r.uses_fault_page for r in result.rprograms) else None
            mod = RammerGroupRPrograms([r.call(page) for r in result.rprograms])(mod)
            if page is not None:
                mod[PAGE_FUNC] = page_function(page)
        unplaced = [{"name": graph.nodes[i].name, "reason": reason,
                     "kernel": graph.nodes[i].gvar.name_hint if graph.nodes[i].gvar else None}
                    for i, reason in result.unplaced.items()]
        return mod.with_attrs({UNPLACED_ATTR: json.dumps(unplaced),
                               FALLBACK_ATTR: json.dumps(result.fallbacks),
                               TIMINGS_ATTR: json.dumps(phases)})
