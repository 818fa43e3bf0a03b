"""From TVM objects to the scheduler's abstractions and back.

The policy (:mod:`tvm_rammer.scheduling.policy`) is pure Python; this module makes its inputs out of lowered TVM
kernels (one ``RKernel`` per dlight-scheduled PrimFunc, an analytical time until profiling exists)
and turns its plans into reports.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import s_tir, sym

from ..config import RammerConfig
from .cost_model import CostModelConfig, rtask_time_us
from .policy import OpGraph, PolicyConfig, bfs_waves, schedule_units
from ..abstractions.rtask import RKernel, ROperator
from ..abstractions.vdevice import VDevice

LOG = logging.getLogger("tvm_rammer")


def vdevice_for(target: tvm.target.Target, config: RammerConfig) -> VDevice:
    """The vDevice: the local GPU when one of the target's arch is visible, else the arch's preset."""
    from ..host.gpu import local_gpu
    from ..target import same_arch, target_arch

    overrides = {}
    if config.veus_per_sm is not None:
        overrides["max_blocks_per_sm"] = config.veus_per_sm
    arch = target_arch(target)
    gpu = local_gpu() if config.num_sms is None else None
    if gpu is not None and same_arch(gpu.id.arch, arch):
        return dataclasses.replace(VDevice.from_tvm_device(gpu.dev), **overrides)
    if config.num_sms is not None:
        overrides["num_sms"] = config.num_sms
    return VDevice.for_arch(arch, **overrides)


def cost_config(config: RammerConfig, vdevice: VDevice) -> CostModelConfig:
    """The analytical cost model for this vDevice and config."""
    extra = {} if config.l2_bw_gbps is None else {"l2_bw_gbps": float(config.l2_bw_gbps)}
    return CostModelConfig(num_sms=vdevice.num_sms, barrier_us=config.barrier_us,
                           launch_us=config.launch_us, **extra)


def policy_config(config: RammerConfig, vdevice: VDevice) -> PolicyConfig:
    """The policy options of a RammerConfig."""
    return PolicyConfig(cost=cost_config(config, vdevice), selection=config.selection,
                        merge=config.merge, max_waits_per_op=config.max_waits_per_op,
                        profile_margin=config.profile_margin,
                        prefetch_lookahead=_lookahead(config))


def _lookahead(config: RammerConfig) -> int:
    """``PolicyConfig.prefetch_lookahead`` of a RammerConfig: its own where barriers prefetch at all
    (1 otherwise: nothing is issued early, nothing credited)."""
    return config.prefetch_lookahead if config.prefetch_weights else 1


def _tensor_bytes(param) -> int:
    ty = param.ty
    return math.prod(int(d) for d in ty.shape) * tvm.runtime.DataType(str(ty.dtype)).bits // 8


_LOAD = tvm.ir.expr.TensorLoad  # the class tirx.BufferLoad(...) builds


def _loads_and_vars(exprs) -> tuple:
    """(whether ``exprs`` read a buffer, i.e. are data dependent; the handles of the variables in
    them, those inside the loads included)."""
    loads, names = [], set()
    for expr in exprs:
        tvm_ffi.structural_walk(expr, [(_LOAD, loads.append),
                                       (tvm.tirx.Var, lambda v: names.add(v.__hash__()))])
    return bool(loads), names


def _indirect_elements(region, extent_of: dict) -> int | None:
    """Elements that all iterations of a block read or write through a region whose index is data
    dependent (a gather ``x[idx[i], j]``): one iteration's region (every dimension its region
    extent, also where its start is data dependent: 1 for a gather's row index, ``w`` for a
    window ``x[idx[i]:idx[i] + w]``) times the iterations of the block variables the region's
    indices use (those inside the index loads included: ``i`` and ``j`` above, not a reduction
    variable the region does not name, whose iterations re-read the same elements). None when an
    extent is not a constant."""
    per_iteration = 1
    for r in region.region:
        if not isinstance(r.extent, tvm.tirx.IntImm):
            return None
        per_iteration *= int(r.extent)
    _, used = _loads_and_vars([e for r in region.region for e in (r.min, r.extent)])
    iterations = 1
    for handle in used:
        if handle in extent_of:
            if extent_of[handle] is None:
                return None
            iterations *= extent_of[handle]
    return per_iteration * iterations


def _accessed_boxes(func: tvm.tirx.PrimFunc) -> dict:
    """param -> per-dimension ``(lo, hi)`` bounding box of every region the PrimFunc's blocks read
    or write in it, each region relaxed over its block's iteration domain; None for a parameter
    some of whose regions cannot be bounded by constants (an indirect index among them), or that
    no block names (:func:`_accessed`)."""
    return {p: (box if indirect == 0 else None) for p, (box, indirect) in _accessed(func).items()}


def whole_reads(func: tvm.tirx.PrimFunc) -> list:
    """Per parameter of the scheduled PrimFunc ``func``: whether its blocks read it whole through
    affine indices only (no index loaded from a tensor, every read region bounded by constants,
    their bounding box the whole parameter): what ``driver.prefetch`` may prefetch."""
    found = []
    for param, (box, indirect) in _accessed(func, writes=False).items():
        shape = [int(d) for d in param.ty.shape]
        found.append(indirect == 0 and box is not None and len(box) == len(shape)
                     and all(lo <= 0 and hi >= n - 1 for (lo, hi), n in zip(box, shape)))
    return found


def _accessed(func: tvm.tirx.PrimFunc, writes: bool = True) -> dict:
    """param -> ``(box, indirect)``: ``box`` the per-dimension ``(lo, hi)`` bounding box of every
    region the PrimFunc's blocks read (and, with ``writes``, write) in it directly (an affine index), each region
    relaxed over its block's iteration domain, or None where no block names it that way;
    ``indirect`` the elements accessed through regions whose index is data dependent
    (:func:`_indirect_elements`, summed over such regions), or None for a parameter one of whose
    regions cannot be bounded at all (then it is charged whole)."""
    boxes = {p: None for p in func.params}
    indirect = {p: 0 for p in func.params}
    blocks = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, blocks.append)])
    analyzer = sym.Analyzer()
    for block in blocks:
        dom = {iv.var: sym.IntervalSet(iv.dom.min, iv.dom.min + iv.dom.extent - 1)
               for iv in block.iter_vars}
        extent_of = {iv.var.__hash__(): (int(iv.dom.extent)
                                         if isinstance(iv.dom.extent, tvm.tirx.IntImm) else None)
                     for iv in block.iter_vars}
        for region in [*block.reads, *(block.writes if writes else ())]:
            param = region.source
            if param not in boxes or indirect[param] is None:
                continue
            if _loads_and_vars([e for r in region.region for e in (r.min, r.extent)])[0]:
                found = _indirect_elements(region, extent_of)
                indirect[param] = None if found is None else indirect[param] + found
                continue
            box = []
            for r in region.region:
                lo = analyzer.int_set(r.min, dom).min_value
                hi = analyzer.int_set(r.min + r.extent - 1, dom).max_value
                if not (isinstance(lo, tvm.tirx.IntImm) and isinstance(hi, tvm.tirx.IntImm)):
                    indirect[param] = None
                    break
                box.append((int(lo), int(hi)))
            else:
                old = boxes[param]
                boxes[param] = box if old is None else [
                    (min(a, c), max(b, d)) for (a, b), (c, d) in zip(old, box)]
    return {p: ((None, None) if indirect[p] is None else (boxes[p], indirect[p]))
            for p in func.params}


def param_bytes(func: tvm.tirx.PrimFunc) -> list:
    """Bytes of each parameter the PrimFunc reads or writes, at most the whole parameter: the
    bounding box of the regions its blocks access directly (a strided slice reads one row of its
    input, not the input) plus, for regions whose index is data dependent (a Gather / ``take``
    reads one row of its table per token), one block iteration's region times the iterations
    (:func:`_indirect_elements`); the whole parameter where a region cannot be bounded (a
    symbolic extent) or no block names it."""
    out = []
    for param, (box, indirect) in _accessed(func).items():
        whole = _tensor_bytes(param)
        shape = [int(d) for d in param.ty.shape]
        if indirect is None or (box is None and not indirect) or (
                box is not None and len(box) != len(shape)):
            out.append(whole)
            continue
        elements = 0 if box is None else math.prod(
            max(0, min(hi, n - 1) - max(lo, 0) + 1) for (lo, hi), n in zip(box, shape))
        elements += indirect
        out.append(min(whole, elements * tvm.runtime.DataType(str(param.ty.dtype)).bits // 8))
    return out


def flops_and_bytes(func: tvm.tirx.PrimFunc, per_param: list | None = None) -> tuple:
    """FLOPs (TVM's estimate; 1 per output element when it cannot tell) and bytes of every
    parameter region read or written once (``per_param``: :func:`param_bytes` of ``func``,
    computed here when not given)."""
    nbytes = sum(param_bytes(func) if per_param is None else per_param)
    try:
        flops = float(tvm.s_tir.analysis.estimate_tir_flops(tvm.IRModule({"main": func})))
    except Exception:  # estimate_tir_flops rejects some opaque loops
        flops = float(nbytes // 4)
    return flops, float(nbytes)


def resident_inputs(graph, l2_resident_bytes: int) -> dict:
    """node index -> positions (in its PrimFunc's parameters) of the inputs the cost model reads
    from the L2 cache: constants that a node earlier in the graph already read, when all the
    constants read by two or more nodes fit ``l2_resident_bytes`` together (an unrolled RNN reads
    each layer's weights once per step). Nodes with none are left out."""
    readers: dict = {}
    for node in graph.nodes:
        if node.kind != "call_tir":
            continue
        for t in {t for t in node.inputs if t.is_constant}:
            readers.setdefault(t, []).append(node.index)
    shared = {t: nodes for t, nodes in readers.items() if len(nodes) > 1}
    footprint = sum(math.prod(t.shape) * tvm.runtime.DataType(t.dtype).bits // 8 for t in shared)
    if not shared or footprint > l2_resident_bytes:
        return {}
    later = {(t, i) for t, nodes in shared.items() for i in nodes[1:]}
    resident = {}
    for node in graph.nodes:
        if node.kind == "call_tir":
            positions = tuple(k for k, t in enumerate(node.inputs) if (t, node.index) in later)
            if positions:
                resident[node.index] = positions
    return resident


def analytical_us(flops: float, nbytes: float, lowered, config: RammerConfig,
                  vdevice: VDevice, l2_bytes: float = 0.0) -> float:
    """The analytical per-rTask time of one lowered rKernel of an operator (``l2_bytes`` of its
    ``nbytes`` read from the L2 cache)."""
    veus_per_sm = vdevice.occupancy(lowered.threads, None, lowered.shared_bytes)
    return rtask_time_us(flops, nbytes, lowered.num_rtasks, veus_per_sm, cost_config(config, vdevice),
                         l2_bytes)


def predicted_kernel_us(flops: float, nbytes: float, lowered, config: RammerConfig,
                        vdevice: VDevice) -> float | None:
    """The analytical time of one whole kernel of an operator (``flops``, ``nbytes``: the
    operator's, from :func:`flops_and_bytes`): its rTasks' rounds on the device times the per-rTask
    time, to compare the versions of one operator before measuring them; None when one rTask of it
    does not fit an SM."""
    try:
        per_sm = max(1, vdevice.occupancy(lowered.threads, None, lowered.shared_bytes))
    except ValueError:
        return None
    rounds = math.ceil(lowered.num_rtasks / (vdevice.num_sms * per_sm))
    return analytical_us(flops, nbytes, lowered, config, vdevice) * max(1, rounds)


def predicted_version_us(func, lowered, config: RammerConfig, vdevice: VDevice) -> float | None:
    """:func:`predicted_kernel_us` of one version (``lowered``) of operator ``func`` (its scheduled
    PrimFunc: its flops and bytes), or None when it cannot be predicted."""
    try:
        flops, nbytes = flops_and_bytes(func)
        return predicted_kernel_us(flops, nbytes, lowered, config, vdevice)
    except Exception:  # pylint: disable=broad-except  (no prediction: measured as without one)
        return None


def operator_from_kernel(uid: int, name: str, func, lowered, config: RammerConfig,
                         vdevice: VDevice) -> ROperator:
    """An rOperator with one rKernel: the dlight schedule, timed by the analytical model."""
    flops, nbytes = flops_and_bytes(func)
    time_us = analytical_us(flops, nbytes, lowered, config, vdevice)
    kernel = RKernel(name=name, num_rtasks=lowered.num_rtasks, threads=lowered.threads,
                     registers=None, shared_bytes=lowered.shared_bytes, time_us=time_us,
                     source="dlight", payload=lowered)
    return ROperator(uid=uid, name=name, kernels=[kernel], flops=flops, bytes=nbytes)


# --- rKernel versions (tvm_rammer.tuning) ------------------------------------------------------
@dataclass
class VersionedOperator(ROperator):
    """An rOperator with several rKernel versions and, per version, where its time comes from.

    ``timing[i]`` is ``kernels[i]``'s ``tuning.profiler.Timing`` ("profiled", "database", "shipped"
    or "analytical"); ``analytical_us[i]`` the analytical model's per-rTask time for comparison;
    ``dropped`` the versions measured wrong (name and why); ``reference_key`` the profile key of TVM's
    default kernel for this operator (its measured time is the baseline the rProgram must beat).
    """

    timing: list = field(default_factory=list)
    analytical_us: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    reference_key: str | None = None
    versions_checked: list | None = None  # RammerConfig.emulate_versions: every version's record


PIPELINE_VERSION = "dlight"  # the rammer pipeline's own dlight schedule (tuning.versions)
MAX_BLOCKS_PER_RTASK = 256
MIN_COARSE_RTASKS = 16


def _fits(lowered, vdevice: VDevice) -> bool:
    """Whether one rTask of ``lowered`` fits a vEU on an SM (e.g. not over the shared-memory limit
    per block: a tensor-core version with large tiles may be)."""
    try:
        vdevice.occupancy(lowered.threads, None, lowered.shared_bytes)
    except ValueError:
        return False
    return True


def coarsenings(blocks: int, min_rtasks: int = MIN_COARSE_RTASKS) -> list:
    """Blocks per rTask offered for a kernel of ``blocks`` thread blocks: 1, then powers of two up
    to ``MAX_BLOCKS_PER_RTASK`` while at least ``max(min_rtasks, MIN_COARSE_RTASKS)`` rTasks
    remain. The policy's SelectRKernels weighs them like any rKernel: the same code, fewer rTasks
    to dispatch (each costs ``per_rtask_overhead_us`` of table decoding and synchronisation), less
    balance. :func:`operator_versions` passes the vEUs the device holds of the kernel as
    ``min_rtasks`` (``RammerConfig.coarsen_below_veus``)."""
    floor = max(int(min_rtasks), MIN_COARSE_RTASKS)
    found, b = [1], 2
    while b <= MAX_BLOCKS_PER_RTASK and -(-blocks // b) >= floor:
        found.append(b)
        b *= 2
    return found


def coarse_floor(lowered, config: RammerConfig, vdevice: VDevice) -> int:
    """The fewest rTasks a coarsened variant of ``lowered`` may have: the vEUs the device holds of
    it (SMs x vEUs per SM for its threads and shared memory), unless
    ``config.coarsen_below_veus`` (then ``MIN_COARSE_RTASKS``)."""
    if config.coarsen_below_veus:
        return MIN_COARSE_RTASKS
    per_sm = vdevice.occupancy(lowered.threads, None, lowered.shared_bytes)
    if config.veus_per_sm is not None:
        per_sm = min(per_sm, config.veus_per_sm)
    return vdevice.num_sms * per_sm


def _trusted(record) -> bool:
    return record is not None and record.get("valid") is True and record.get("kernel_us") is not None


def operator_versions(uid: int, name: str, func, versions, config: RammerConfig, vdevice: VDevice,
                      profiler, reference_key: str | None = None,
                      resident: tuple = ()) -> VersionedOperator:
    """An rOperator whose rKernels are the versions the policy may choose among.

    The rule (a choice that affects speed is made on measurements): when the pipeline's dlight
    version has a measured, valid record, every version with a measured, valid record is a
    candidate, timed by its record; versions measured wrong are dropped (``dropped``). Otherwise the
    pipeline's dlight version is the only one, timed by the analytical model: templates, other
    tiles and tuning records are never chosen on a guess. Each version is offered coarsened too
    (:func:`coarsenings`): the same kernel code with several thread blocks per rTask, only while
    its rTasks still fill every vEU the device holds of it (``RammerConfig.coarsen_below_veus``). A measured
    per-rTask time gets the cost model's dispatch overhead added (a kernel timed alone has none). Raises ``UnsupportedKernel`` when no
    version can run as rTasks, or when the dlight version itself was measured wrong.
    ``func`` is the operator's scheduled PrimFunc (for its FLOPs and bytes); each version's
    payload is its LoweredKernel, as for :func:`operator_from_kernel`. ``resident``: positions
    of the parameters whose bytes the analytical model reads from the L2 cache
    (:func:`resident_inputs`)."""
    from tir_templates.prelower import UnsupportedKernel

    from ..tuning.profiler import Timing, rtask_time

    if not versions:
        raise UnsupportedKernel(f"{name}: no rKernel version can run as rTasks in a vEU")
    base = next((i for i, v in enumerate(versions) if v.name == PIPELINE_VERSION), 0)
    records = [(None, None)] * len(versions)
    if profiler is not None:
        records = [profiler.kernel(v.key) for v in versions]
    base_record = records[base][0]
    if base_record is not None and base_record.get("valid") is False:
        from ..tuning.profiler import is_failure

        if is_failure(base_record):  # this compilation only: failures are never cached
            raise UnsupportedKernel(f"{name}: its dlight rKernel could not be measured on the "
                                    f"device ({base_record.get('reason')}); it stays TVM's "
                                    "default kernel in this compilation")
        raise UnsupportedKernel(f"{name}: its dlight rKernel differs from TVM's default kernel on "
                                f"the device ({base_record.get('reason', 'wrong output')})")
    dropped = [{"version": v.name, "source": v.source, "reason": rec.get("reason", "wrong output")}
               for v, (rec, _) in zip(versions, records)
               if rec is not None and rec.get("valid") is False]
    if _trusted(base_record):
        keep = [i for i, (rec, _) in enumerate(records) if _trusted(rec)]
    else:
        keep = [base]
    keep = [i for i in keep if _fits(versions[i].lowered, vdevice)]
    if not keep:
        raise UnsupportedKernel(f"{name}: its rKernel needs more than one SM of {vdevice} holds "
                                "(threads or shared memory)")
    for v in dropped:
        LOG.info("tvm-rammer: %s version %s dropped: %s", name, v["version"], v["reason"])
    per_param = param_bytes(func)
    flops, nbytes = flops_and_bytes(func, per_param)
    l2_bytes = float(sum(per_param[k] for k in resident))
    overhead = cost_config(config, vdevice).per_rtask_overhead_us
    kernels, timings, estimates = [], [], []
    for i in keep:
        version, (record, source) = versions[i], records[i]
        lowered = version.lowered
        estimate = analytical_us(flops, nbytes, lowered, config, vdevice, l2_bytes)
        if _trusted(record):
            registers = record.get("registers")
            shared = max(lowered.shared_bytes, int(record.get("shared_bytes") or 0))
            body = rtask_time(record["kernel_us"], lowered.num_rtasks, lowered.threads, registers,
                              shared, vdevice)
            timing = Timing(body + overhead, source, registers, record["kernel_us"])
        else:
            timing = Timing(estimate, "analytical")
        for blocks in coarsenings(lowered.num_rtasks, coarse_floor(lowered, config, vdevice)):
            kernels.append(RKernel(
                name=f"{name}:{version.name}#{version.key[:8]}" + (f"x{blocks}" if blocks > 1 else ""),
                num_rtasks=-(-lowered.num_rtasks // blocks), threads=lowered.threads,
                registers=timing.registers, shared_bytes=lowered.shared_bytes,
                time_us=blocks * (timing.rtask_us - overhead) + overhead, source=version.source,
                payload=lowered, blocks_per_rtask=blocks))
            timings.append(timing)
            estimates.append(blocks * (estimate - overhead) + overhead)
    return VersionedOperator(uid=uid, name=name, kernels=kernels, flops=flops, bytes=nbytes,
                             timing=timings, analytical_us=estimates, dropped=dropped,
                             reference_key=reference_key)
# --- end rKernel versions ------------------------------------------------------------------------


def replace_plan(plan, graph: OpGraph, registers: int, vdevice: VDevice, config: RammerConfig):
    """The same operators and rKernel versions, placed again for the compiled kernel's registers."""
    members = set(plan.ops)
    sub_ops = {op: ROperator(uid=op, name=graph.ops[op].name,
                             kernels=[graph.ops[op].kernels[plan.selected[op]]],
                             flops=graph.ops[op].flops, bytes=graph.ops[op].bytes,
                             prefetch_inputs=graph.ops[op].prefetch_inputs,
                             prefetch_fraction=graph.ops[op].prefetch_fraction)
               for op in plan.ops}
    preds = {op: [p for p in graph.preds.get(op, []) if p in members] for op in plan.ops}
    units = [list(w) for w in plan.waves] or [list(plan.ops)]  # the policy's order, kept
    sub = OpGraph(ops=sub_ops, preds=preds, waves=bfs_waves(plan.ops, preds), split_before=set())
    cfg = PolicyConfig(cost=cost_config(config, vdevice), selection="fastest", merge="always",
                       registers=registers, max_waits_per_op=None,
                       prefetch_lookahead=_lookahead(config))
    (new_plan,) = schedule_units(units, sub, vdevice, cfg)
    new_plan.selected = dict(plan.selected)
    new_plan.reason = dict(plan.reason)
    return new_plan


def plan_report(plan, ops: dict, spec, num_veus: int, registers) -> dict:
    """JSON-able description of one rProgram (used by ``tvm-rammer inspect``)."""
    program = plan.program
    operators = []
    for op in plan.ops:
        kernel = ops[op].kernels[plan.selected[op]]
        entry = {"name": ops[op].name, "rtasks": kernel.num_rtasks,
                 "blocks_per_rtask": kernel.blocks_per_rtask,
                 "threads": kernel.threads, "version": kernel.source,
                 "reason": plan.reason.get(op, "only"),
                 "time_us_per_rtask": round(kernel.time_us, 3)}
        timing = getattr(ops[op], "timing", None)  # VersionedOperator: which version, timed how
        if timing:
            chosen = timing[plan.selected[op]]
            entry.update(kernel=kernel.name, versions=len(ops[op].kernels), time_source=chosen.source,
                         predicted_us_per_rtask=round(ops[op].analytical_us[plan.selected[op]], 3),
                         profiled_kernel_us=None if chosen.kernel_us is None
                         else round(chosen.kernel_us, 3), dropped=list(ops[op].dropped))
            if ops[op].versions_checked is not None:
                entry["versions_checked"] = list(ops[op].versions_checked)
        operators.append(entry)
    return {"kernel": spec.name, "rtasks": int(program.num_rtasks), "num_veus": num_veus,
            "veus_per_sm": plan.veus_per_sm, "veu_threads": spec.veu_threads,
            "registers": registers, "shared_bytes": spec.shared_bytes,
            "kernel_bodies": len(spec.entries),
            "barriers": int(program.num_barriers), "predicted_us": float(plan.predicted_us),
            "operators": operators}
