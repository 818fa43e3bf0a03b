"""Kernel versions for a GPU lease (issue 31, item 4): the jobs a compile's profiler would measure,
found here without a GPU, built here as libraries the GPU host only loads and times.

:func:`prepare_kernels` runs, per model, the rammer compile up to its profiling phase against a
*recording* device (:class:`RecordingDevice`: it measures nothing and keeps the jobs it is given),
so the jobs are exactly those ``Profiler.prepare`` would measure on a GPU: the ones the profiler's
decisive rule keeps (``profiler.decisive_jobs``: an operator's versions only when one of them is
predicted within the margin of its dlight version) that have no record yet in the profile database
read for the target (``db``, or the shipped one of the target's arch) nor in ``timed.json`` (what a
lease timed already, :mod:`tvm_rammer.lease.kernel_results`). The compile stops right after that
phase (nothing of the policy or the code generation runs).

The jobs' kernels, and per operator TVM's default kernel (the validity reference, as
``measure.CudaDevice`` uses it), are built as the profiler's batches are (``measure._built``: one
TVM build per library), many kernels per library, and exported by ``host.cross.export``: their
CUDA compiled here into binaries for the target's arch (the CUDA source where there is no CUDA
compiler; the GPU host then compiles it at load; ``cuda_format`` in the manifest says which). The
libraries are named by the hash of what they hold, so an unchanged library is not built again.

The manifest (``kernels.json``, format :data:`FORMAT`) is what ``tvm_rammer.runtime.kernel_timing``
reads on the GPU host::

    {"format", "target", "arch", "device_type", "device": the DB device the records are read for,
     "libraries": [{"library", "bytes", "kernels", "build_s", "cuda_format", "arches"}],
     "kernels": [{"library", "function", "key", "label", "operator", "model", "role": "reference" |
                  "version" | "rprogram", "reference": key of its reference (None for a reference),
                  "num_outputs", "params": [[name, shape, dtype]], "predicted_us", "base",
                  "registers", "shared_bytes",
                  # an rProgram (lease.rprograms): key = the back end's plan_key, and
                  "fixed": {param: .npy path}, "references": [keys], "fault_page": param | None,
                  "operators", "stable", "estimate": {"rammer_us", "default_us", "value"}}],
     "models": [{"model": {"zoo", "params", "batch"}, "name", "decisive": [keys], "measured": n,
                 "to_time": n, "built": n, "predicted_gain_us", "at_stake_us", "record_s",
                 "rprograms": {"formed", "measured", "unmeasurable", "candidates", "built",
                               "left", "record_s"} | None (not formed: no room),
                 "leases_needed": n | None}],
     "left_out": n}                                          # to time, not built (size budget)

After the kernels, in what is left of the lease's time and size, the close rProgram candidates of
every model (:mod:`tvm_rammer.lease.rprograms`): the rPrograms a compile forms with the kernels the
database chose whose keep-or-fall-back decision is not measured, closest to a tie first, each with
the TVM default kernels of its operators that have no record (role "reference").

Models are taken in order of value (``predicted_gain_us``: per decisive operator, its dlight
version's predicted time less the best other version's; then ``at_stake_us``, the dlight times of
the decisive operators), operators within a model likewise, a reference before its versions.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..host.gpu import DeviceId
from ..tuning.measure import BudgetSpent, KernelJob
from ..tuning.profiler import Profiler, decisive_jobs
from .reading import Overlay, source_device

__all__ = ["FORMAT", "DEFAULT_TARGET", "MANIFEST", "TIMED", "RecordingDevice", "RecordedModel",
           "KernelEntry", "model_spec", "record_jobs", "entries_of", "build_libraries",
           "prepare_kernels", "write_manifest", "timed_keys", "prepare"]

LOG = logging.getLogger("tvm_rammer")
FORMAT = "tvm-rammer-kernels/1"
DEFAULT_TARGET = "rammer/nvidia-h200"
MANIFEST = "kernels.json"
TIMED = "timed.json"  # kernel key -> outcome, what earlier leases timed (kernel_results writes it)
KERNELS_PER_LIBRARY = 32


class RecordingDevice:
    """A ``measure.MeasureDevice`` that measures nothing: ``jobs`` gets every job the profiler asks
    it to measure, and each comes back not measured (None), as past a budget; no rProgram is
    timed (:class:`~tvm_rammer.tuning.measure.BudgetSpent`)."""

    def __init__(self, device_id: DeviceId):
        self.id = device_id
        self.jobs: list = []

    def measure_kernels(self, jobs, progress, within_s=None) -> list:
        self.jobs.extend(jobs)
        return [None] * len(jobs)

    def time_kernel(self, func, fixed, within_s=None):
        raise BudgetSpent("a recording device times nothing")


class _Recorded(BaseException):
    """Raised after the profiling phase: the recording compile has what it needs. Not an
    ``Exception``: the back end's guard (a failure while measuring keeps TVM's default kernels
    and goes on compiling) must let it through, so nothing after the phase runs."""


class _RecordingProfiler(Profiler):
    """A profiler whose ``prepare`` keeps every job it is given (``all_jobs``), asks its device
    to measure what the decisive rule keeps, then stops the compile (:class:`_Recorded`)."""

    all_jobs: list | None = None

    def prepare(self, jobs: Sequence[KernelJob]) -> None:
        self.all_jobs = list(jobs)
        super().prepare(jobs)
        raise _Recorded("recorded")


@dataclass(frozen=True)
class RecordedModel:
    """What one model's recording compile found: ``jobs`` (to time: decisive, without a record),
    ``decisive`` (the keys of every job the decisive rule keeps, measured or not, with their
    references), ``measured`` (those of ``decisive`` with a record), ``seconds`` (of the compile)."""

    name: str
    model: dict
    jobs: list
    decisive: list
    measured: list
    seconds: float


def model_spec(model) -> dict:
    """``{"zoo", "params", "batch"}`` of a model given as a zoo name (full size) or as that dict
    (the lease manifest's ``model`` form, e.g. with ``models.REDUCED`` params)."""
    from ..models import MODELS

    spec = {"zoo": model, "params": {}, "batch": 1} if isinstance(model, str) else \
        {"zoo": model["zoo"], "params": dict(model.get("params") or {}), "batch": int(model.get("batch", 1))}
    if spec["zoo"] not in MODELS:
        raise ValueError(f"unknown zoo model {spec['zoo']!r}; valid names: {', '.join(sorted(MODELS))}")
    return spec


def record_jobs(model, target: str = DEFAULT_TARGET, db=None, config=None,
                timed: Sequence[str] = ()) -> RecordedModel:
    """Run ``model``'s rammer compile (``target``, ``config``: a ``RammerConfig``) to its profiling
    phase against a :class:`RecordingDevice` and return what it would measure (see the module
    docstring); ``db`` and the shipped databases are read, never written."""
    from ..config import RammerConfig
    from ..driver.frontend import import_onnx, lower
    from ..models import get_model
    from ..target import resolve_target, target_arch

    spec = model_spec(model)
    config = config or RammerConfig()
    arch = target_arch(resolve_target(target))
    base, base_device = source_device(db, arch)
    overlay = Overlay(base, base_device, timed)
    device = RecordingDevice(base_device or DeviceId(f"lease {arch}", arch, "unknown"))
    profiler = _RecordingProfiler(overlay, device, arch, rprogram_budget=0, progress=False,
                                  margin=config.profile_margin, budget_s=None)
    start = time.perf_counter()
    mod = import_onnx(get_model(spec["zoo"], batch=spec["batch"], **spec["params"]))
    try:
        lower(mod, target, config, profiler)
    except BaseException as err:  # the stop after the profiling phase, through TVM's passes
        if profiler.all_jobs is None or isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
    seconds = time.perf_counter() - start
    chosen = decisive_jobs(profiler.all_jobs or [], config.profile_margin)
    keys = _keys_of(chosen)
    measured = [k for k in keys if k not in overlay.timed and overlay.get("kernel", k, None) is not None]
    return RecordedModel(spec["zoo"], spec, list(device.jobs), keys, measured, seconds)


def _keys_of(jobs) -> list:
    """The kernel keys of ``jobs`` with their references', each once, in order."""
    keys: dict = {}
    for job in jobs:
        if job.reference_key:
            keys.setdefault(job.reference_key, None)
        keys.setdefault(job.key, None)
    return list(keys)


@dataclass(frozen=True)
class KernelEntry:
    """One kernel of a lease library: ``func`` (a scheduled PrimFunc), its ``key``
    (``versions.func_key``), ``role`` "reference" (TVM's default kernel of ``operator``) or
    "version" (checked against ``reference``, a key), ``num_outputs`` (the last parameters)."""

    key: str
    label: str
    func: object
    operator: str
    role: str
    reference: str | None
    num_outputs: int
    model: str = ""
    predicted_us: float | None = None
    base: bool = False
    extra: dict | None = None  # more fields of its manifest entry (an rProgram's: lease.rprograms)


def _operator_value(jobs: list) -> tuple:
    """(predicted gain, dlight time) of one operator's jobs (0 where not predicted)."""
    base = next((j.predicted_us for j in jobs if j.base), None)
    others = [j.predicted_us for j in jobs if not j.base and j.predicted_us is not None]
    if base is None:
        return 0.0, 0.0
    return (max(0.0, base - min(others)) if others else 0.0), base


def entries_of(recorded: RecordedModel, seen: set | None = None) -> tuple:
    """``(entries, value)``: the :class:`KernelEntry` list of a model's jobs (per operator in order
    of predicted gain: its reference, then its versions by predicted time; a key in ``seen`` is
    skipped and ``seen`` gets the new ones) and ``{"predicted_gain_us", "at_stake_us"}``.
    Operators without a reference (nothing to check a version against) are left out."""
    seen = set() if seen is None else seen
    groups: dict = {}
    for job in recorded.jobs:
        groups.setdefault(job.operator or job.label.split(":", 1)[0], []).append(job)
    values = {op: _operator_value(jobs) for op, jobs in groups.items()}
    entries = []
    for op in sorted(groups, key=lambda o: (-values[o][0], -values[o][1], o)):
        jobs = groups[op]
        ref = next((j for j in jobs if j.reference is not None), None)
        if ref is None:
            LOG.info("tvm-rammer: %s has no default kernel to check its versions against: left out", op)
            continue
        if ref.reference_key not in seen:  # the dlight version, when it is the default kernel
            seen.add(ref.reference_key)
            same = next((j for j in jobs if j.key == ref.reference_key), None)
            entries.append(KernelEntry(ref.reference_key, same.label if same else f"{op}:tvm_default",
                                       ref.reference, op, "reference", None, ref.num_outputs,
                                       recorded.name, same.predicted_us if same else None,
                                       bool(same and same.base)))
        for job in sorted(jobs, key=lambda j: (j.predicted_us is None, j.predicted_us or 0.0)):
            if job.key in seen:
                continue
            seen.add(job.key)
            entries.append(KernelEntry(job.key, job.label, job.func, op, "version", job.reference_key,
                                       job.num_outputs, recorded.name, job.predicted_us, job.base))
    gain = sum(v[0] for v in values.values())
    stake = sum(v[1] for v in values.values())
    return entries, {"predicted_gain_us": round(gain, 3), "at_stake_us": round(stake, 3)}


def _cuda_format(path: str) -> str | None:
    """How the CUDA modules of a library are stored (``host.cross.library_cuda_modules``):
    "source" (compiled at load on the GPU host), "binary" (cubin, fatbin), None (none)."""
    from ..host import cross

    modules = cross.library_cuda_modules(path)
    if not modules:
        return None
    return "source" if any(m.is_source for m in modules) else "binary"


def _cuda_arches(path: str) -> list:
    """The archs the compiled CUDA modules of a library hold (``host.cross.binary_arches``)."""
    from ..host import cross

    return sorted({a for m in cross.library_cuda_modules(path) if not m.is_source
                   for a in cross.binary_arches(m.code)})


def _library_name(entries: Sequence[KernelEntry], spec: dict) -> str:
    """A library's file name from what it holds (the kernels' keys, the target, TVM's version).
    A kernel's key is its PrimFunc's structural hash, an rProgram's is the back end's ``plan_key``
    (program, kernel names, table), which the persistent kernel's code can change under (the code
    generator's options and sources): its PrimFunc's hash is added, so an rProgram built by an older
    compiler is never reused for a new one."""
    import tvm

    from ..tuning.versions import func_key

    doc = json.dumps({"keys": [e.key if e.role != "rprogram" else [e.key, func_key(e.func)]
                               for e in entries], "target": spec,
                      "tvm": getattr(tvm, "__version__", "")}, sort_keys=True, default=str)
    return f"kernels-{hashlib.sha1(doc.encode()).hexdigest()[:12]}.so"


def _function_name(entry: KernelEntry) -> str:
    return f"rk_{entry.key}"


def build_libraries(entries: Sequence[KernelEntry], target, out_dir: str,
                    size_budget_mib: float | None = None,
                    kernels_per_library: int = KERNELS_PER_LIBRARY,
                    deadline: float | None = None) -> tuple:
    """Build ``entries`` into libraries under ``out_dir`` (whole operators per library, about
    ``kernels_per_library`` kernels each) until their total size reaches ``size_budget_mib``.
    Returns ``(libraries, kernels, left_out)``: the manifest's ``libraries`` and ``kernels`` lists
    and how many entries were not built. An unchanged library (same name) is reused; none is
    built past ``deadline`` (a ``time.perf_counter()``)."""
    import tvm

    from ..target import resolve_target, target_spec
    from ..tuning.measure import param_specs

    tgt = target if isinstance(target, tvm.target.Target) else resolve_target(target) \
        if str(target).startswith("rammer/") else tvm.target.Target(target)
    spec = target_spec(tgt)
    cuda = tgt.kind.name == "cuda"
    os.makedirs(out_dir, exist_ok=True)
    libraries, kernels, total = [], [], 0
    chunks = _chunks(list(entries), kernels_per_library)
    budget = None if size_budget_mib is None else size_budget_mib * 2**20
    for n, chunk in enumerate(chunks):
        estimate = total / len(kernels) * len(chunk) if kernels else 0.0  # at this size per kernel
        if budget is not None and (budget <= 0 or total + estimate > budget):
            return libraries, kernels, sum(len(c) for c in chunks[n:])  # the next would not fit
        if deadline is not None and time.perf_counter() > deadline:
            return libraries, kernels, sum(len(c) for c in chunks[n:])  # prepare's time limit
        name = _library_name(chunk, spec)
        path, info_path = os.path.join(out_dir, name), os.path.join(out_dir, name + ".info.json")
        start = time.perf_counter()
        if os.path.exists(path) and os.path.exists(info_path):
            with open(info_path, encoding="utf-8") as f:
                built = json.load(f)
        else:
            mod = tvm.IRModule({_function_name(e): e.func.with_attr("global_symbol", _function_name(e))
                                for e in chunk})
            built = {"items": _build_one(mod, tgt, path), "build_s": round(time.perf_counter() - start, 2)}
            if cuda:
                built.update(cuda_format=_cuda_format(path), arches=_cuda_arches(path))
            tmp = f"{info_path}.tmp{os.getpid()}"  # whole or absent: a prepare killed here
            with open(tmp, "w", encoding="utf-8") as f:   # rebuilds it, never reads half a file
                json.dump(built, f)
            os.replace(tmp, info_path)
        size = os.path.getsize(path)
        if budget is not None and total + size > budget:  # the first one, larger than the budget
            return libraries, kernels, sum(len(c) for c in chunks[n:])
        total += size
        libraries.append({"library": name, "bytes": size, "kernels": len(chunk),
                          "build_s": built["build_s"], "cuda_format": built.get("cuda_format"),
                          "arches": built.get("arches", [])})
        for e in chunk:
            res = built["items"].get(_function_name(e), {})
            kernels.append({"library": name, "function": _function_name(e), "key": e.key,
                            "label": e.label, "operator": e.operator, "model": e.model,
                            "role": e.role, "reference": e.reference, "num_outputs": e.num_outputs,
                            "params": [list(p) for p in param_specs(e.func)],
                            "predicted_us": e.predicted_us, "base": e.base,
                            "registers": res.get("registers"), "shared_bytes": res.get("shared_bytes"),
                            **(e.extra or {})})
    return libraries, kernels, 0


def _build_one(mod, tgt, path: str) -> dict:
    """Build ``mod`` (entry name -> PrimFunc) for ``tgt`` into the library ``path``: one TVM build
    (``measure._built``, as the profiler's batches), its CUDA compiled here for the target's arch
    where a CUDA compiler is (``host.cross.export``; else the source is kept), and the registers
    and shared bytes of each entry from one ``nvcc -Xptxas -v`` of the module's source (as
    ``measure._batch_build_worker`` reads them). Returns entry -> {registers, shared_bytes} (or
    ``resources_error``)."""
    from tir_templates import cuda_resources

    from ..host import cross
    from ..codegen.resources import module_cuda_source
    from ..target import target_arch
    from ..tuning.measure import _built

    lib, _ = _built(mod, tgt, False)
    cross.export(lib, path, tgt)
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    if tgt.kind.name != "cuda" or cuda_resources.find_tool("nvcc") is None:
        return {n: {} for n in names}
    try:
        found = cuda_resources.compile_cuda_resources_per_kernel(module_cuda_source(lib),
                                                                target_arch(tgt))
    except Exception as err:  # pylint: disable=broad-except  (resources are optional)
        return {n: {"resources_error": str(err).splitlines()[0] if str(err) else type(err).__name__}
                for n in names}
    items = {}
    for n in names:
        mine = [r for k, r in found.items() if k == n or k.startswith(n + "_kernel")]
        items[n] = {"registers": max(r["registers"] for r in mine),
                    "shared_bytes": max(r["shared_bytes"] for r in mine)} if mine else \
            {"resources_error": "no ptxas line for this kernel"}
    return items


def _chunks(entries: list, size: int) -> list:
    """``entries`` cut into chunks of about ``size``, an operator's entries never split."""
    chunks, current = [], []
    for i, entry in enumerate(entries):
        current.append(entry)
        nxt = entries[i + 1] if i + 1 < len(entries) else None
        boundary = nxt is None or nxt.operator != entry.operator or nxt.role == "reference"
        if len(current) >= size and boundary:
            chunks.append(current)
            current = []
    if current:
        chunks.append(current)
    return chunks


def timed_keys(out_dir: str) -> dict:
    """``timed.json`` of ``out_dir``: kernel key -> outcome of what earlier leases timed ({} when
    there is none)."""
    path = os.path.join(out_dir, TIMED)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f).get("kernels", {}))


def prepare_kernels(models: Sequence, out_dir: str, size_budget_mib: float | None, db=None,
                    target: str = DEFAULT_TARGET, config=None, max_kernels: int | None = None,
                    kernels_per_library: int = KERNELS_PER_LIBRARY,
                    deadline: float | None = None, rprograms: bool = True) -> dict:
    """Record, build and list the kernel versions a lease is to time (module docstring).

    ``models``: zoo names (full size) or ``{"zoo", "params", "batch"}``; ``out_dir``: where the
    libraries and ``kernels.json`` go (and where ``timed.json`` is read); ``size_budget_mib``: the
    libraries' total size at most (None: no limit); ``db``: the profile database whose records
    (for the target's arch) need no timing (None: the shipped ones); ``max_kernels``: at most this
    many kernels built (what the lease's time allows); ``deadline``: a ``time.perf_counter()``
    past which no model is recorded and no library built (prepare's time limit: what is left is
    counted in ``left_out`` and done by the next prepare); ``rprograms``: then, in what is left of
    ``max_kernels`` and the size, the close rProgram candidates (:func:`_rprogram_entries`).
    Returns the manifest (also written)."""
    from ..target import resolve_target, target_arch

    tgt = resolve_target(target)
    arch = target_arch(tgt)
    timed = timed_keys(out_dir)
    key = _inputs_key(models, target, db, config, timed, size_budget_mib, max_kernels,
                      kernels_per_library, rprograms)
    previous = _read_manifest(out_dir)
    if previous is not None and previous.get("inputs_key") == key and all(
            os.path.exists(os.path.join(out_dir, lib["library"])) for lib in previous["libraries"]):
        return previous  # nothing that decides the jobs changed: no recording compile again
    recorded = []
    for m in models:  # in order of value; past the deadline the rest waits for the next prepare
        if deadline is not None and time.perf_counter() > deadline:
            LOG.warning("tvm-rammer: kernels: prepare's time limit reached: %d of %d models "
                        "recorded, the rest next time", len(recorded), len(models))
            key = None  # an incomplete manifest: the next prepare records again
            break
        recorded.append(record_jobs(m, target, db, config, timed))
    seen, per_model = set(), []
    for rec in recorded:
        entries, value = entries_of(rec, seen)
        per_model.append((rec, entries, value))
    per_model.sort(key=lambda x: (-x[2]["predicted_gain_us"], -x[2]["at_stake_us"], x[0].name))
    entries = [e for _, es, _ in per_model for e in es]
    cut = entries[max_kernels:] if max_kernels is not None else []
    if cut:  # whole operators only
        keep = entries[:max_kernels]
        while keep and len(keep) < len(entries) and entries[len(keep)].operator == keep[-1].operator \
                and entries[len(keep)].role != "reference":
            keep.pop()
        cut, entries = entries[len(keep):], keep
    libraries, kernels, left = build_libraries(entries, tgt, out_dir, size_budget_mib,
                                               kernels_per_library, deadline)
    built = {k["key"] for k in kernels}
    found: dict = {}  # model name -> lease.rprograms.RecordedRPrograms (None: not formed)
    if rprograms:  # after the kernels: none while a kernel is left for a later lease
        rp_libs, rp_kernels, rp_left, found = _rprogram_entries(
            [rec for rec, _, _ in per_model], built, out_dir, tgt, db, config, timed,
            0 if (left or cut) else None if max_kernels is None else max_kernels - len(entries),
            None if size_budget_mib is None else
            size_budget_mib - sum(lib["bytes"] for lib in libraries) / 2**20,
            kernels_per_library, deadline)
        libraries, kernels, left = libraries + rp_libs, kernels + rp_kernels, left + rp_left
    from .rprograms import remove_stale_fixed

    remove_stale_fixed(out_dir, kernels)
    if deadline is not None and time.perf_counter() > deadline:
        key = None  # cut by prepare's time limit: the next prepare goes on (built libraries reused)
    _remove_stale(out_dir, {lib["library"] for lib in libraries})
    _, device = source_device(db, arch)
    per_lease = max_kernels or max(1, int(LEASE_KERNEL_S / SECONDS_PER_KERNEL))
    models_doc = [{"model": rec.model, "name": rec.name, "decisive": rec.decisive,
                   "measured": len(rec.measured), "to_time": len(rec.jobs),
                   "built": sum(e.key in built for e in es), **value, "record_s": round(rec.seconds, 1),
                   **_rprogram_doc(found.get(rec.name), kernels, len(rec.jobs), per_lease)}
                  for rec, es, value in per_model]
    return write_manifest(out_dir, str(target), arch, tgt.kind.name, libraries, kernels, models_doc,
                          left + len(cut), device.key if device is not None else None, key)


def _rprogram_entries(recorded: list, built: set, out_dir: str, tgt, db, config, timed,
                      room: int | None, size_mib: float | None, kernels_per_library: int,
                      deadline: float | None) -> tuple:
    """The close rProgram candidates of ``recorded``'s models (``lease.rprograms``), built after
    the kernels (``built``: their keys) in ``room`` kernel slots (an rProgram takes
    ``rprograms.RPROGRAM_SLOTS``; None: no limit) and ``size_mib`` (the rest of the size budget,
    the fixed arguments' files included). No model is compiled when there is no room or past
    ``deadline``. Returns ``(libraries, kernels, left_out, found)``: found = model name ->
    ``RecordedRPrograms`` of the models compiled."""
    from . import rprograms as rp

    found, candidates = {}, []
    pending = {j.reference_key for rec in recorded for j in rec.jobs if j.reference_key}
    for rec in recorded:
        if (room is not None and room < rp.RPROGRAM_SLOTS) or (size_mib is not None and size_mib <= 0):
            break
        if deadline is not None and time.perf_counter() > deadline:
            LOG.warning("tvm-rammer: kernels: prepare's time limit reached: the rPrograms of %d "
                        "of %d models formed", len(found), len(recorded))
            break
        found[rec.name] = rp.record_rprograms(model_spec(rec.model), str(tgt), db, config,
                                              pending, timed)
        candidates += found[rec.name].candidates
    entries = rp.entries_of(rp.ordered(candidates), out_dir, KernelEntry, seen=set(built))
    taken, slots = [], 0  # whole candidates: their references with them
    group: list = []
    for e in entries:
        group.append(e)
        if e.role != "rprogram":
            continue
        cost = rp.RPROGRAM_SLOTS + len(group) - 1
        if room is not None and slots + cost > room:
            break
        taken += group
        slots += cost
        group = []
    left = sum(e.role == "rprogram" for e in entries) - sum(e.role == "rprogram" for e in taken)
    fixed_mib = sum(os.path.getsize(os.path.join(out_dir, path)) for path in
                    {p for e in taken for p in ((e.extra or {}).get("fixed") or {}).values()}) / 2**20
    libraries, kernels, cut = build_libraries(
        taken, tgt, out_dir, None if size_mib is None else size_mib - fixed_mib,
        kernels_per_library, deadline)
    cut_rprograms = sum(e.role == "rprogram" for e in taken) - sum(k["role"] == "rprogram" for k in kernels)
    return libraries, kernels, left + cut_rprograms, found


def _rprogram_doc(found, kernels: list, kernels_left: int, per_lease: int) -> dict:
    """A model's ``rprograms`` entry of the manifest (formed, measured, unmeasurable, candidates,
    built, left; None when not formed) and ``leases_needed`` (``rprograms.leases_needed``)."""
    from .rprograms import leases_needed

    if found is None:
        return {"rprograms": None, "leases_needed": None}
    built = sum(1 for k in kernels if k["role"] == "rprogram" and k["model"] == found.name)
    doc = {"formed": found.formed, "measured": found.measured, "unmeasurable": found.unmeasurable,
           "candidates": len(found.candidates), "built": built,
           "left": len(found.candidates) - built, "record_s": round(found.seconds, 1)}
    return {"rprograms": doc,
            "leases_needed": leases_needed(kernels_left, len(found.candidates), per_lease)}


def _remove_stale(out_dir: str, keep: set) -> None:
    """Remove the libraries of earlier prepares that the new manifest does not list (all of
    ``out_dir`` travels to the GPU host)."""
    for path in Path(out_dir).glob("kernels-*.so"):
        if path.name not in keep:
            path.unlink(missing_ok=True)
            Path(f"{path}.info.json").unlink(missing_ok=True)


def _read_manifest(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def _sources_digest() -> str:
    """The hash of tvm-rammer's Python sources (``tvm_rammer``, ``relay_passes``, ``tir_templates``)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha1()
    for package in ("tvm_rammer", "relay_passes", "tir_templates"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _inputs_key(models, target, db, config, timed, *limits) -> str:
    """What decides a prepare's jobs and libraries: tvm-rammer's sources (``tvm_rammer``,
    ``relay_passes``, ``tir_templates``), TVM's version, the models, target, config and limits,
    the profile databases read (the given one's file, the shipped ones) and ``timed``."""
    import tvm

    from ..tuning.profile_db import SHIPPED_DIR

    digest = hashlib.sha1(_sources_digest().encode())

    dbs = sorted(SHIPPED_DIR.glob("*.json")) + ([Path(db.path)] if getattr(db, "path", None) else [])
    for path in dbs:
        if path.exists():
            digest.update(path.read_bytes())
    if db is not None and getattr(db, "path", None) is None:
        digest.update(repr(id(db)).encode())  # an in-memory database: never reused
    doc = {"models": [model_spec(m) for m in models], "target": str(target), "limits": limits,
           "config": repr(config), "timed": sorted(timed), "tvm": getattr(tvm, "__version__", "")}
    digest.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def write_manifest(out_dir: str, target: str, arch: str | None, device_type: str, libraries: list,
                   kernels: list, models: list = (), left_out: int = 0, device: str | None = None,
                   inputs_key: str | None = None) -> dict:
    """Write ``out_dir/kernels.json`` (format :data:`FORMAT`, see the module docstring) from
    :func:`build_libraries`' lists; returns it."""
    manifest = {"format": FORMAT, "target": target, "arch": arch, "device_type": device_type,
                "device": device, "libraries": list(libraries), "kernels": list(kernels),
                "models": list(models), "left_out": left_out, "inputs_key": inputs_key}
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".{MANIFEST}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return manifest



# --- the lease's hook (tvm_rammer.lease.prepare's "kernels" step) ---------------------------------

SECONDS_PER_KERNEL = 0.15  # estimated H200 seconds per kernel (load, check, time) before a lease
LEASE_KERNEL_S = 120.0  # seconds of a 15-minute lease given to kernel timing after the models
LEASE_MODELS = ("resnext29", "nasnet_cifar", "alexnet", "inception_v3", "squeezenet", "googlenet",
                "randwire", "deepspeech2", "lstm_tc", "seq2seq")  # the zoo at full size
RESULTS = "kernel_results.jsonl"  # kernel_timing's results file in the step's output folder
TIMING_MODULE = "tvm_rammer.runtime.kernel_timing"


def prepare(out_dir: str, target: str = DEFAULT_TARGET, budget_mib: float | None = None,
            models: Sequence = LEASE_MODELS, db=None, time_s: float = LEASE_KERNEL_S,
            seconds_per_kernel: float = SECONDS_PER_KERNEL, deadline: float | None = None) -> dict:
    """The "kernels" step of a lease (``tvm_rammer.lease.prepare``): :func:`prepare_kernels` into
    ``out_dir`` within ``budget_mib`` and as many kernels as ``time_s`` of timing allows at
    ``seconds_per_kernel``; returns the step's index entry: ``{"module", "args"}`` (run on the GPU
    host as ``python3 -m MODULE *ARGS --out DIR`` from the lease folder's parent), ``estimate_s``,
    ``kernels``, ``libraries``, ``mib``, ``left_out``, ``manifest``, ``rprograms`` (rProgram
    candidates listed, each ``rprograms.RPROGRAM_SLOTS`` kernels' time) and ``models``: per model
    ``{"name", "rprograms", "leases_needed"}`` (the manifest's)."""
    from .rprograms import RPROGRAM_SLOTS

    limit = max(1, int(time_s / max(seconds_per_kernel, 1e-6)))
    manifest = prepare_kernels(models, out_dir, budget_mib, db, target, max_kernels=limit,
                               deadline=deadline)
    n = len(manifest["kernels"])
    n_rprograms = sum(1 for k in manifest["kernels"] if k.get("role") == "rprogram")
    slots = n + (RPROGRAM_SLOTS - 1) * n_rprograms
    path = Path(out_dir).resolve() / MANIFEST
    base = Path(out_dir).resolve().parent.parent  # the GPU side runs from the lease folder's parent
    estimate = round(min(time_s, slots * seconds_per_kernel) + 10.0, 1) if n else 0.0
    return {"module": TIMING_MODULE if n else None,
            "args": [os.path.relpath(path, base), "--budget-s", f"{max(estimate - 5.0, 1.0):g}"],
            "estimate_s": estimate, "kernels": n, "libraries": len(manifest["libraries"]),
            "mib": round(sum(lib["bytes"] for lib in manifest["libraries"]) / 2**20, 2),
            "left_out": manifest["left_out"], "manifest": str(path), "rprograms": n_rprograms,
            "models": [{"name": m.get("name"), "rprograms": m.get("rprograms"),
                        "leases_needed": m.get("leases_needed")} for m in manifest.get("models", [])]}
