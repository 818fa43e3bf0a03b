"""The close rProgram candidates of a GPU lease (issue 31, item 5): the rPrograms a compile forms
with the kernels the profile database chose, whose keep-or-fall-back decision is not measured yet,
in order of value, as entries of the lease's kernel manifest (``tvm_rammer.lease.kernels``).

The back end keeps an rProgram or leaves its operators as TVM's default kernels by comparing
``profiler.rprogram_time(plan_key(plan, op_graph, table))`` with ``profiler.default_time(the
operators' reference keys)`` (``driver.backend._check_against_default``); both come from the profile
database a compile without a GPU reads. :func:`record_rprograms` runs a model's rammer compile to
the back end's rPrograms with a profiler that reads the database as it stands (``db``, else the
shipped one of the target's arch; no device) and, where there is none, an empty one of the arch: a
compile then forms and builds every rProgram as a compile reading a lease's results will
(``check_unmeasured``'s estimate is for compiles that read nothing). For each rProgram it keeps
the back end's key, its persistent kernel, the fixed arguments the timing must pass (the program
table, the fault page, the constants blob when small) and the reference kernels of its operators.
An rProgram is *measured* when its key has a record and every reference has one; the others are
candidates, valued by how close the estimate of ``scheduling.unmeasured_check`` puts it to TVM's
default kernels, weighted by the time at stake (:func:`value_of`). A candidate is *stable* when no
kernel job of its operators is still to be timed (its kernels, hence its key, will not change when
they are).

:func:`entries_of` turns candidates into ``kernels.KernelEntry`` items: role "rprogram" (its
``extra``: ``fixed`` param -> .npy file beside the manifest, ``references``, ``fault_page``,
``estimate``) and, before it, a role "reference" entry for each operator whose TVM default kernel
has no record yet. ``tvm_rammer.runtime.kernel_timing`` times them; ``tvm_rammer.lease.
kernel_results`` writes an rProgram's time as the record the back end looks up.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..host.gpu import DeviceId
from ..tuning.profiler import Profiler, plan_key
from .reading import Overlay, source_device

__all__ = ["RProgramCandidate", "RecordedRPrograms", "record_rprograms", "value_of", "ordered",
           "entries_of", "FIXED_DIR", "FIXED_MAX_BYTES", "RPROGRAM_SLOTS", "leases_needed"]

LOG = logging.getLogger("tvm_rammer")
FIXED_DIR = "rprograms"  # beside kernels.json: the fixed arguments of the rProgram entries
FIXED_MAX_BYTES = 1 << 20  # a larger fixed argument (a model's constants blob) is not carried:
#                            the GPU side passes seeded data (its values do not change the time)
RPROGRAM_SLOTS = 3  # an rProgram takes this many kernels' time of the lease (a larger kernel)
BACKEND_PASS = "WithTarget(RammerBackend)"  # driver.pipeline's name of the back end's pass


@dataclass(frozen=True)
class RProgramCandidate:
    """One rProgram whose decision is not measured: ``key`` (the back end's ``plan_key`` with its
    table), ``name`` (``rammer_rprogramK``), its persistent kernel ``func``, ``fixed`` (param name
    -> array the timing passes), ``references`` (its operators' TVM default kernel keys, in order;
    a key may repeat), ``reference_funcs`` (key -> (PrimFunc, num_outputs, operator) of those
    without a record), the estimates (us) and ``stable``."""

    key: str
    name: str
    model: str
    func: object
    fixed: dict
    references: tuple
    reference_funcs: dict
    operators: tuple
    rammer_estimate_us: float
    default_estimate_us: float
    stable: bool

    @property
    def value(self) -> float:
        return value_of(self.rammer_estimate_us, self.default_estimate_us)


@dataclass(frozen=True)
class RecordedRPrograms:
    """What one model's rProgram compile found: ``formed`` (rPrograms the back end made, kept or
    fallen back), ``measured`` (their decisions on measured times), ``unmeasurable`` (an operator
    without a reference kernel: the back end keeps it, nothing to compare), ``candidates`` (the
    rest, best first), ``seconds`` (of the compile)."""

    name: str
    formed: int
    measured: int
    unmeasurable: int
    candidates: list = field(default_factory=list)
    seconds: float = 0.0


def value_of(rammer_us: float, default_us: float) -> float:
    """The value of timing an rProgram: the time at stake (its operators' estimated time as TVM's
    default kernels, us) times how close the estimate is to a tie: 1 at a ratio of 1, 1/2 at 2x
    either way (``2 ** -|log2(rammer / default)|``)."""
    if rammer_us <= 0 or default_us <= 0:
        return 0.0
    return float(default_us) * 2.0 ** -abs(math.log2(rammer_us / default_us))


def ordered(candidates: Sequence[RProgramCandidate]) -> list:
    """``candidates`` in order of value: the stable ones first, each group by :func:`value_of`."""
    return sorted(candidates, key=lambda c: (not c.stable, -c.value, c.model, c.key))


class _CollectingProfiler(Profiler):
    """A profiler without a device that keeps every kernel job the back end gives it (``jobs``):
    the reference kernels (TVM's default) of the operators come from them."""

    jobs: list

    def prepare(self, jobs) -> None:
        self.jobs = list(jobs)
        super().prepare(jobs)


def _profiler(db, arch: str, config):
    """The profiler of a compile without a GPU reading ``db``'s records of ``arch`` (else the
    first shipped database's that has them), or an empty database of the arch where none has
    them; what the compile writes stays in memory (``lease.reading``)."""
    base, device = source_device(db, arch)
    reading = Overlay(base, device or DeviceId(f"lease {arch}", arch, "unknown"))
    profiler = _CollectingProfiler(reading, None, arch, rprogram_budget=config.rprogram_profiles,
                                   progress=False, margin=config.profile_margin, budget_s=None)
    profiler.jobs = []
    return profiler


def _backend_input(mod, target, config, profiler):
    """``mod`` through the rammer pipeline's passes before the back end, as the back end gets it."""
    import tvm

    from ..driver.pipeline import rammer_passes

    passes = rammer_passes(target, config, profiler)
    names = [p.info.name for p in passes]
    if BACKEND_PASS not in names:
        raise ValueError(f"the rammer pipeline has no pass {BACKEND_PASS!r}: tvm_rammer.lease."
                         "rprograms needs updating to the pipeline's back end")
    with target:
        return tvm.transform.Sequential(passes[:names.index(BACKEND_PASS)])(mod)


def _fixed(built) -> dict:
    """The arguments an rProgram's timing passes as they are (``BuiltRProgram.fixed_args`` and an
    empty fault page), the large ones left out (:data:`FIXED_MAX_BYTES`)."""
    from ..codegen.faults import empty_page
    from ..tuning.measure import FAULT_PAGE_PARAM, param_specs

    # np.require keeps a 0-d argument 0-d (np.ascontiguousarray makes it 1-d)
    fixed = {k: np.require(v, requirements="C") for k, v in built.fixed_args().items()
             if np.asarray(v).nbytes <= FIXED_MAX_BYTES}
    if any(name == FAULT_PAGE_PARAM for name, _, _ in param_specs(built.func)):
        fixed[FAULT_PAGE_PARAM] = empty_page()
    return fixed


def record_rprograms(spec: dict, target: str, db=None, config=None,
                     pending_references: Sequence[str] = (), timed: Sequence[str] = ()) \
        -> RecordedRPrograms:
    """Run the rammer compile of the model ``spec`` (``{"zoo", "params", "batch"}``, as
    ``kernels.model_spec`` gives it) to its rPrograms with the database as it stands (module
    docstring) and return what it found. ``pending_references``:
    the reference keys of operators with kernel jobs still to time (their candidates are not
    stable); ``timed``: keys an earlier lease timed without a result (not asked again)."""
    from relay_passes.dataflow_graph import DataflowGraph

    from ..config import RammerConfig
    from ..driver.backend import build_rprograms, op_graph_of
    from ..driver.frontend import import_onnx
    from ..models import get_model
    from ..scheduling import rkernels, unmeasured_check
    from ..target import resolve_target, target_arch

    config = config or RammerConfig()
    tgt = resolve_target(target)
    profiler = _profiler(db, target_arch(tgt), config)
    start = time.perf_counter()
    mod = _backend_input(import_onnx(get_model(spec["zoo"], batch=spec["batch"], **spec["params"])),
                         tgt, config, profiler)
    vdevice = rkernels.vdevice_for(tgt, config)
    with tgt:
        graph = DataflowGraph.from_function(mod["main"], mod)
        result = build_rprograms(graph, mod, tgt, config, profiler, vdevice)
    op_graph = op_graph_of(graph, result.operators, {})
    ops = op_graph.ops
    funcs = {j.reference_key: (j.reference, j.num_outputs, j.operator) for j in profiler.jobs
             if j.reference_key and j.reference is not None}
    pending, timed = set(pending_references), set(timed)
    measured = sum(1 for f in result.fallbacks if f.get("rammer_us") is not None)
    unmeasurable, candidates = 0, []
    for one in result.rprograms:
        key = plan_key(one.plan, op_graph, one.table)
        refs = tuple(getattr(ops[i], "reference_key", None) for i in one.nodes)
        if not all(refs):
            unmeasurable += 1
            continue
        rammer_us = profiler.rprogram_time(key, None, force=True)[0]
        if rammer_us is not None and profiler.default_time(refs) is not None:
            measured += 1
            continue
        if key in timed:  # an earlier lease failed to time it: not asked again
            continue
        missing = {r: funcs[r] for r in dict.fromkeys(refs)
                   if profiler.default_time([r]) is None and r in funcs}
        if len(missing) < sum(1 for r in set(refs) if profiler.default_time([r]) is None):
            unmeasurable += 1  # a reference that no job carries: nothing to build it from
            continue
        candidates.append(RProgramCandidate(
            key, one.spec.name, spec["zoo"], one.func, _fixed(one), refs, missing,
            tuple(ops[i].name for i in one.nodes),
            unmeasured_check.rprogram_estimate_us(one.plan, op_graph, vdevice, config),
            unmeasured_check.default_estimate_us(one.plan, op_graph, vdevice, config),
            not pending.intersection(refs)))
    return RecordedRPrograms(spec["zoo"], len(result.rprograms) + len(result.fallbacks), measured,
                             unmeasurable, ordered(candidates), time.perf_counter() - start)


def _save_fixed(out_dir: str, cand: RProgramCandidate) -> dict:
    """Write ``cand``'s fixed arguments as .npy files under ``out_dir/FIXED_DIR``; param name ->
    path relative to ``out_dir``. A file of the same content is kept (named by its hash)."""
    folder = os.path.join(out_dir, FIXED_DIR)
    os.makedirs(folder, exist_ok=True)
    names = {}
    for param, array in sorted(cand.fixed.items()):
        digest = hashlib.sha1(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()[:16]
        rel = os.path.join(FIXED_DIR, f"{digest}.npy")
        if not os.path.exists(os.path.join(out_dir, rel)):
            tmp = os.path.join(folder, f".{digest}.tmp{os.getpid()}.npy")
            np.save(tmp, array)
            os.replace(tmp, os.path.join(out_dir, rel))
        names[param] = rel
    return names


def entries_of(candidates: Sequence[RProgramCandidate], out_dir: str, entry_type,
               seen: set | None = None) -> list:
    """``entry_type`` (``kernels.KernelEntry``) items of ``candidates`` (in their order): per
    candidate the
    reference kernels it needs that are not in ``seen`` (role "reference"), then the rProgram
    (role "rprogram", operator = its key: a library never splits it from its references).
    Their fixed arguments are written under ``out_dir`` (:func:`_save_fixed`)."""
    from ..tuning.measure import FAULT_PAGE_PARAM

    seen = set() if seen is None else seen
    entries = []
    for cand in candidates:
        if cand.key in seen:
            continue
        for ref, (func, num_outputs, operator) in cand.reference_funcs.items():
            if ref in seen:
                continue
            seen.add(ref)
            entries.append(entry_type(ref, f"{operator}:tvm_default", func, cand.key, "reference",
                                       None, num_outputs, cand.model))
        seen.add(cand.key)
        extra = {"fixed": _save_fixed(out_dir, cand), "references": list(cand.references),
                 "fault_page": FAULT_PAGE_PARAM if FAULT_PAGE_PARAM in cand.fixed else None,
                 "operators": list(cand.operators), "stable": cand.stable,
                 "estimate": {"rammer_us": round(cand.rammer_estimate_us, 3),
                              "default_us": round(cand.default_estimate_us, 3),
                              "value": round(cand.value, 3)}}
        entries.append(entry_type(cand.key, f"{cand.model}:{cand.name}", cand.func, cand.key,
                                   "rprogram", None, 0, cand.model, cand.rammer_estimate_us,
                                   extra=extra))
    return entries


def remove_stale_fixed(out_dir: str, kernels: Sequence[dict]) -> None:
    """Remove the .npy files under ``out_dir/FIXED_DIR`` that no listed kernel passes."""
    keep = {os.path.normpath(p) for k in kernels for p in (k.get("fixed") or {}).values()}
    folder = os.path.join(out_dir, FIXED_DIR)
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if os.path.normpath(os.path.join(FIXED_DIR, name)) not in keep:
            os.remove(os.path.join(folder, name))


def leases_needed(kernels_left: int, rprograms_left: int | None, per_lease: int) -> int | None:
    """Leases until a model's choices are all measured, at ``per_lease`` kernel slots a lease:
    its kernels first, then its rProgram candidates (:data:`RPROGRAM_SLOTS` each; formed again
    once the kernels are measured, so a lower bound). None when the rPrograms were not formed."""
    if rprograms_left is None:
        return None
    per_lease = max(1, per_lease)
    return math.ceil(kernels_left / per_lease) + math.ceil(rprograms_left * RPROGRAM_SLOTS / per_lease)
