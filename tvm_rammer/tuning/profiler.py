"""Compile-time profiler (Rammer, OSDI'20, 3.2 "Compile-time profiling"): measured times for the
policy, from profile databases or measured on the device.

Rammer's profiler provides 1) an rTask's time on a vEU, 2) its resource usage and 3) an rProgram's
time. :class:`Profiler` puts them behind the profile databases (``profile_db``):

- rKernel versions (:meth:`Profiler.prepare`, :meth:`Profiler.kernel`): every version whose record is
  missing is checked and timed on the device (``measure.MeasureDevice.measure_kernels``) in one
  batch, with a progress bar; the record says whether its outputs matched TVM's default kernel for
  the operator (``valid``) and that default kernel's own time (``default_us``). The per-rTask time is

      rtask_us = kernel_us / ceil(num_rtasks / (num_sms * occupancy))

  i.e. the kernel's time divided by its rounds of thread blocks on the device (:func:`rtask_time`);
- rPrograms (:meth:`Profiler.plan_profile`, :meth:`Profiler.rprogram_time`): the persistent kernel of
  a plan timed whole, cached under :func:`plan_key`; at most ``rprogram_budget`` candidate plans are
  built and timed per compilation (each is a full nvcc build), the final ones always. The plans of
  one comparison are named first (``plan_profile``'s ``prefetch``) and the final ones all built
  (:meth:`Profiler.prebuild`) before any is timed, so their builds run side by side; each is
  timed after every started build has ended (``CudaDevice._quiet``).

What is measured, and for how long (``RammerConfig.profile_margin``, ``profile_budget_s``): with a
``margin`` only what can change a decision is measured (:func:`decisive_jobs`: an operator's
versions only when one of them is predicted within ``margin`` of its dlight version; the policy
asks for plan times only when two plans' analytical times are that close, ``policy._close``); with
a ``budget_s`` the measuring stops once that many seconds have passed since the compile started
(``started``, default the profiler's creation), and every remaining choice is made as without a
device (dlight, analytical times, the rProgram kept). The budget is a deadline, not a check between
batches: the device gets the seconds left with every batch and every rProgram
(``within_s``), starts no build or run past them, and abandons (kills) those in flight; so
profiling adds at most ``budget_s`` (plus the time to kill its processes) to a compile. A build
started early (:meth:`Profiler.prebuild`, only while the budget lasts) that is not timed is
dropped at :meth:`Profiler.finish`, and the device's processes end with :meth:`Profiler.close`. What the
budget left unmeasured is named in one warning at the end (:meth:`Profiler.finish`). Kernels are
measured in batches of whole operators, each batch written to the database (and flushed) as it
completes, so a killed compile loses at most one batch.

Failures are not facts: a record of a version that did not build, failed to run or timed out on
the device (:func:`is_failure`) is kept for this compilation only (the operator stays TVM's default
kernel now) and never written to a database, so the next compilation measures it again. A
database that cannot be written (locked, read-only, full) costs one warning, not the compile.

Operator records (``operator_record``; :meth:`Profiler.note_operator`, written at the end of
:meth:`Profiler.prepare` with a device): which versions an operator has, with their keys and
predicted times, so that a later compile makes only the versions it needs
(:meth:`Profiler.operator_record`, :meth:`Profiler.has_kernel_record`).

Where records come from is counted in ``Profiler.counts``: "profiled" (measured now), "database"
(the writable database), "shipped" (a read-only database, e.g. one shipped with tvm-rammer).
Without a device and without a record nothing is measured: the caller decides what that means
(``rkernels``: TVM's dlight schedule only, timed by the analytical model).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..host.gpu import DeviceId
from ..abstractions.vdevice import VDevice
from .deferred import LateVersionError, Unmade, made_func
from .measure import BudgetSpent, KernelJob, MeasureDevice
from .operator_record import FORMAT as OPERATOR_FORMAT, KIND as OPERATOR_KIND

__all__ = ["Timing", "Profiler", "rtask_time", "plan_key", "Progress", "decisive_jobs",
           "small_operators", "is_failure", "FAILURES"]

LOG = logging.getLogger("tvm_rammer")

# reasons of records that say the measurement failed, not what the kernel does (never cached)
FAILURES = ("build failed", "run failed", "timed out", "measure failed")
BATCH_JOBS = 32  # kernel jobs per measured batch (whole operators; one database write each)
MAX_VERSIONS = 2  # versions other than dlight measured per operator (the best predicted)
MIN_SHARE = 0.01  # an operator under this share of the predicted time is not worth measuring


def is_failure(record) -> bool:
    """Whether a kernel record says its measurement failed (build, run, timeout) rather than
    what the kernel computes: such records are never cached."""
    return bool(record) and str(record.get("reason", "")).startswith(FAILURES)


def small_operators(base_us: dict, min_share: float = MIN_SHARE) -> set:
    """The operators (keys of ``base_us``: operator -> its dlight version's predicted time, or
    None) whose dlight version is predicted under ``min_share`` of all operators' predicted
    dlight times: a choice there cannot matter, so none of their versions is measured
    (:func:`decisive_jobs`) nor, with a margin, made (``backend._small_operators``)."""
    total = sum(us for us in base_us.values() if us)
    return {op for op, us in base_us.items() if us is not None and us < min_share * total}


def decisive_jobs(jobs: Sequence[KernelJob], margin: float | None,
                  max_versions: int = MAX_VERSIONS, min_share: float = MIN_SHARE) -> list:
    """The jobs whose measurement can change a choice, per operator (``KernelJob.operator``): its
    base (dlight) version and the ``max_versions`` other versions predicted fastest, among those
    predicted within ``margin`` of the base or faster; nothing of an operator whose predicted time
    is under ``min_share`` of all operators' (:func:`small_operators`: a choice there cannot
    matter), nor of one whose other versions are all predicted slower (it keeps dlight, as
    without a device). An operator whose dlight version or another version has no prediction
    is measured whole (unless small); ``margin`` None keeps every job."""
    if margin is None:
        return list(jobs)
    groups: dict = {}
    for job in jobs:
        groups.setdefault(job.operator or job.label.split(":", 1)[0], []).append(job)
    bases = {op: next((j for j in group if j.base), None) for op, group in groups.items()}
    small = small_operators({op: b.predicted_us for op, b in bases.items() if b is not None},
                            min_share)
    keep = []
    for op, group in groups.items():
        base = bases[op]
        if op in small:
            continue
        if base is None or base.predicted_us is None \
                or any(j.predicted_us is None for j in group if not j.base):
            keep.extend(group)
            continue
        close = sorted((j for j in group if not j.base and j.predicted_us <= margin * base.predicted_us),
                       key=lambda j: j.predicted_us)[:max_versions]
        if close:
            keep.extend([base] + close)
    return keep


@dataclass(frozen=True)
class Timing:
    """Time of one rTask of an rKernel and where it comes from ("profiled", "database", "shipped"
    or "analytical")."""

    rtask_us: float
    source: str
    registers: int | None = None
    kernel_us: float | None = None


def rtask_time(kernel_us: float, num_rtasks: int, threads: int, registers, shared_bytes: int,
               vdevice: VDevice) -> float:
    """Per-rTask time of a kernel timed alone (formula in the module docstring)."""
    per_sm = max(1, vdevice.occupancy(threads, registers, shared_bytes))
    rounds = math.ceil(num_rtasks / (vdevice.num_sms * per_sm))
    return kernel_us / max(1, rounds)


def plan_key(plan, graph, table=None) -> str:
    """A stable key of an rProgram plan: its program, its rKernels' code (the version's name and
    hash, and coarsening: the rKernel's name less the function name in front of its ``:``, which
    the graph's numbering of operators sets, so a build with the weights apart and one with them
    embedded look up the same record) and, when given, the encoded table the persistent kernel
    runs (an int32 array)."""
    kernels = {str(op): _code_of(graph.ops[op].kernels[i].name) for op, i in plan.selected.items()}
    doc = {"program": plan.program.to_dict(), "kernels": kernels}
    if table is not None:
        doc["table"] = hashlib.sha1(np.ascontiguousarray(table, dtype=np.int32).tobytes()).hexdigest()
    blob = json.dumps(doc, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _code_of(kernel_name: str) -> str:
    """``"reshape5:dlight#eacf431f"`` -> ``"dlight#eacf431f"`` (``rkernels``' rKernel names)."""
    func, sep, code = kernel_name.partition(":")
    return code if sep and "#" in code else kernel_name


class Progress:
    """Kernels measured so far, shown with tqdm once a batch has run for ``after_s`` seconds (plain
    lines without tqdm, nothing when disabled)."""

    def __init__(self, total: int, label: str, enabled: bool = True, after_s: float = 2.0):
        self.total, self.label, self.enabled, self.after_s = total, label, enabled, after_s
        self.done, self.start, self._bar = 0, time.monotonic(), None

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled or (self._bar is None and time.monotonic() - self.start < self.after_s):
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:  # the GPU machines have no package index: plain lines instead
                tqdm = None
            self._bar = tqdm(total=self.total, desc=self.label, unit="kernel", leave=False) \
                if tqdm is not None else False
            if self._bar:
                self._bar.update(self.done - n)
        if self._bar:
            self._bar.update(n)
        elif self.done == self.total or self.done % 50 == 0:
            LOG.warning("%s: %d/%d", self.label, self.done, self.total)

    def close(self) -> None:
        if self._bar:
            self._bar.close()


class Profiler:
    """Measured times from profile databases or a device (see the module docstring).

    Parameters
    ----------
    db: the writable profile database (``profile_db.open_profile_db``, or ``JsonProfileDB()`` in
        memory); measured records go here.
    device: where to measure (``measure.CudaDevice`` or a test's fake); None: nothing is measured.
    arch: the target's architecture; without a device, records of a device of this arch are read.
    readonly: databases to read when ``db`` holds nothing for ``arch`` and there is no device (the
        shipped ones). Records of one compilation all come from one database and one device, so
        the versions of an operator are always compared on one scale.
    rprogram_budget: candidate rPrograms built and timed whole per compilation at most.
    progress: show a progress bar for long measurement batches.
    margin: measure only the jobs :func:`decisive_jobs` keeps (None: every job).
    budget_s: stop measuring ``budget_s`` seconds after ``started`` (None: never).
    clock: the clock of the budget (``time.monotonic``; tests pass a fake one).
    started: when the compile started on ``clock`` (None: now, the profiler's creation).
    """

    def __init__(self, db, device: MeasureDevice | None = None, arch: str = "sm_90a",
                 readonly: Sequence = (), rprogram_budget: int = 32, progress: bool = True,
                 margin: float | None = None, budget_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, started: float | None = None):
        self.db, self.device = db, device
        self.counts: Counter = Counter()
        self.rprogram_budget = rprogram_budget
        self.progress = progress
        self.margin, self.budget_s = margin, budget_s
        self._clock = clock
        self._start = clock() if started is None else started
        self._spent_at: float | None = None  # seconds after the start when the budget ran out
        self._unmeasured: dict = {"kernels": [], "rprograms": 0, "policy": False,
                                  "versions": []}  # what the budget left out
        self._warned: set = set()
        self._failed: dict = {}  # (kind, key) -> failure record, for this compilation only
        self._asked: set = set()  # rProgram keys answered within rprogram_budget
        self._prefetched: set = set()  # rProgram keys whose build prebuild started (plan_profile)
        self._measured: set = set()
        self._operators: dict = {}  # operator -> its record's key, versions, reference (note_operator)
        self._records_ignored = False  # ignore_operator_records
        self.sources = []  # (database, device its records are read for, label): one source
        if device is not None:
            self.sources = [(db, device.id, "database")]
        elif db.device_for(arch) is not None:
            self.sources = [(db, db.device_for(arch), "database")]
        else:
            for extra in readonly:
                found = extra.device_for(arch)
                if found is not None:
                    self.sources = [(extra, found, "shipped")]
                    break
        self.device_id: DeviceId | None = self.sources[0][1] if self.sources else None

    @property
    def measures(self) -> bool:
        """Whether missing records are measured (a device is attached)."""
        return self.device is not None

    def _lookup(self, kind: str, key: str):
        if (kind, key) in self._failed:
            return self._failed[(kind, key)], "profiled"
        for db, device, label in self.sources:
            try:
                record = db.get(kind, key, device)
            except Exception as err:  # pylint: disable=broad-except  (an unreadable database)
                self._warn_once(f"read {db!r}", f"tvm-rammer: profile database {getattr(db, 'path', None)} "
                                f"unreadable ({_short(err)}): its records are not used")
                record = None
            if is_failure(record):  # written by an older tvm-rammer: not a fact, measure again
                record = None
            if record is not None:
                return record, ("profiled" if (kind, key) in self._measured else label)
        return None, None

    # --- the budget and the one-warning rule ---------------------------------------------------
    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            LOG.warning(message)

    def remaining_s(self) -> float | None:
        """Seconds of the budget left (0 once spent; None without a budget)."""
        if self.budget_s is None:
            return None
        return max(0.0, self.budget_s - (self._clock() - self._start))

    def over_budget(self) -> bool:
        """Whether the measuring budget (``budget_s``) is spent."""
        if self.budget_s is None or self.remaining_s() > 0:
            return False
        if self._spent_at is None:
            self._spent_at = self._clock() - self._start
        return True

    def _not_measured(self, kernels=(), rprograms: int = 0) -> None:
        """Note what the budget left unmeasured (named by :meth:`finish`'s one warning)."""
        self.over_budget()  # the moment it ran out
        self._unmeasured["kernels"].extend(kernels)
        self._unmeasured["rprograms"] += rprograms

    def versions_not_made(self, operator: str) -> None:
        """Note an operator whose other rKernel versions were not made (the budget was spent
        before the back end came to it: it keeps its dlight version)."""
        self._not_measured()
        self._unmeasured["versions"].append(operator)

    def unmeasured(self) -> dict:
        """What the budget left unmeasured so far: {"kernels": [job labels], "rprograms": count,
        "policy": whether the policy's later plan comparisons were analytical, "versions":
        [operators whose other versions were not even made]}."""
        return {"kernels": list(self._unmeasured["kernels"]),
                "rprograms": self._unmeasured["rprograms"], "policy": self._unmeasured["policy"],
                "versions": list(self._unmeasured["versions"])}

    def budget_message(self) -> str | None:
        """The warning naming what the budget left unmeasured (None: nothing was left out)."""
        kernels, rprograms = self._unmeasured["kernels"], self._unmeasured["rprograms"]
        policy, versions = self._unmeasured["policy"], self._unmeasured["versions"]
        if not kernels and not rprograms and not policy and not versions:
            return None
        parts = []
        if versions:
            parts.append(f"the other versions of {len(versions)} operator(s) (not made: "
                         f"{_names(versions)}), which keep their dlight version")
        if kernels:
            ops = sorted({label.split(":", 1)[0] for label in kernels})
            parts.append(f"{len(kernels)} rKernel version(s) of {len(ops)} operator(s) "
                         f"({_names(ops)}), which keep their dlight version")
        if rprograms:
            parts.append(f"{rprograms} rProgram(s), which keep their analytical time")
        if policy:
            parts.append("the policy's remaining plan comparisons, made on analytical times")
        spent = f" (spent {self._spent_at:.0f} s into the compile)" if self._spent_at is not None else ""
        return (f"tvm-rammer: profiling budget of {self.budget_s:g} s spent{spent}; not measured: "
                f"{'; '.join(parts)} (as without a GPU); raise it with --profile-budget / "
                "RammerConfig(profile_budget_s=...)")

    def finish(self) -> None:
        """The end of measuring in a compilation: flush, and warn once naming what the budget
        left unmeasured."""
        self.flush()
        self._drop_prebuilt()
        message = self.budget_message()
        if message is not None:
            self._warn_once("budget", message)

    def _drop_prebuilt(self) -> None:
        """The device forgets the builds :meth:`prebuild` started that were not timed."""
        self._device_call("drop_prebuilt", "dropping early builds", LOG.debug)

    def _device_call(self, method: str, what: str, log) -> None:
        """``self.device.<method>()`` where the device has that method; a failure is logged
        (``log``, naming ``what``), never raised: the compile goes on."""
        call = getattr(self.device, method, None)
        if call is not None:
            try:
                call()
            except Exception as err:  # pylint: disable=broad-except
                log("tvm-rammer: %s failed: %s", what, _short(err))

    def prebuild(self, func, key: str | None = None) -> None:
        """Start building persistent kernel ``func`` now (the device's ``prebuild``, where it has
        one), when it is to be timed soon (by :meth:`time_kernel`, the same object) and the budget
        lasts; not when ``key`` (its rProgram key) already has a record. A failure here costs
        nothing: the timing builds it again."""
        start = getattr(self.device, "prebuild", None)
        if start is None or self.over_budget() or \
                (key is not None and self._lookup("rprogram", key)[0] is not None):
            return
        try:
            start(func)
        except Exception as err:  # pylint: disable=broad-except  (time_kernel builds it then)
            LOG.debug("tvm-rammer: a persistent kernel's build did not start early: %s", _short(err))

    def time_kernel(self, func, fixed: dict) -> float | None:
        """The device's time of a persistent kernel within the budget left; raises
        :class:`~tvm_rammer.tuning.measure.BudgetSpent` when that is not enough."""
        if self.over_budget():
            raise BudgetSpent("the profiling budget is spent")
        return self.device.time_kernel(func, fixed, within_s=self.remaining_s())

    def _put(self, items) -> None:
        """Write measured records (failures excluded) and flush; a database that refuses (locked,
        read-only, full) costs one warning: the records stay in memory for this compilation."""
        keep = [item for item in items if not is_failure(item[3])]
        for kind, key, _, record in items:
            if is_failure(record):
                self._failed[(kind, key)] = record
        if not keep:
            return
        try:
            self.db.put_many(keep)
            self.db.flush()
        except Exception as err:  # pylint: disable=broad-except  (the compile must go on)
            self._warn_once("write", f"tvm-rammer: profile database {getattr(self.db, 'path', None)} "
                            f"not writable ({_short(err)}): this compilation's measurements are "
                            "kept in memory only")
            for kind, key, _, record in keep:
                self._failed.setdefault((kind, key), record)

    # --- rKernels ---------------------------------------------------------------------------
    def prepare(self, jobs: Sequence[KernelJob]) -> None:
        """Check and time every job whose key has no record and that can change a choice
        (:func:`decisive_jobs`), in batches of whole operators while the budget lasts; each
        batch's records are written (and flushed) when it completes."""
        if self.device is None:
            return
        todo, seen = [], set()
        for job in decisive_jobs(jobs, self.margin):  # on every job: the same choice each compile
            if job.key in seen or self._lookup("kernel", job.key)[0] is not None:
                continue
            seen.add(job.key)
            if isinstance(job.func, Unmade) or isinstance(job.reference, Unmade):
                # made from an operator record (``deferred``): its code made now, to be measured
                job = dataclasses.replace(job, func=made_func(job.func),
                                          reference=made_func(job.reference))
            todo.append(job)
        if todo:
            progress = Progress(len(todo), "tvm-rammer: profiling rKernels", self.progress)
            try:
                for batch in _batches(todo, BATCH_JOBS):
                    if self.over_budget():
                        self._not_measured(kernels=[job.label for job in batch])
                        continue
                    self._measure_batch(batch, progress)
            finally:
                progress.close()
        self._write_operators(jobs)

    def _measure_batch(self, batch: list, progress) -> None:
        try:
            records = self.device.measure_kernels(batch, progress, within_s=self.remaining_s())
        except BudgetSpent:
            records = [None] * len(batch)
        except Exception as err:  # pylint: disable=broad-except  (kept as failures, this compile)
            LOG.warning("tvm-rammer: measuring %s failed (%s): they keep TVM's default choice",
                        ", ".join(sorted({j.operator or j.label for j in batch})), _short(err))
            records = [{"valid": False, "error": None, "reason": f"measure failed: {_short(err)}"}
                       for _ in batch]
        items, keys = [], {job.key for job in batch}
        for job, record in zip(batch, records):
            if record is None:  # not measured (the budget ran out before it was)
                if self.over_budget():
                    self._not_measured(kernels=[job.label])
                continue
            items.append(("kernel", job.key, self.device.id, record))
            self._measured.add(("kernel", job.key))
            known = job.reference_key in keys or self._lookup("kernel", job.reference_key)[0]
            if job.reference_key and record.get("default_us") is not None and not known:
                keys.add(job.reference_key)
                ref = {"kernel_us": record["default_us"], "valid": True, "error": 0.0,
                       "reference": True}
                items.append(("kernel", job.reference_key, self.device.id, ref))
                self._measured.add(("kernel", job.reference_key))
        self._put(items)

    # --- operator records (``operator_record``): which versions a later compile makes ----------
    def operator_record(self, key: str) -> dict | None:
        """The operator record (``operator_record.KIND``) under ``key``, or None (always None
        after :meth:`ignore_operator_records`)."""
        if self._records_ignored:
            return None
        record = self._lookup(OPERATOR_KIND, key)[0]
        return record if isinstance(record, dict) else None

    def mark(self) -> tuple:
        """What :meth:`ignore_operator_records` rewinds to: the questions asked so far (the
        rProgram budget, the keys asked, the counts, what the budget left unmeasured)."""
        return (self.rprogram_budget, set(self._asked), Counter(self.counts),
                copy.deepcopy(self._unmeasured), set(self._prefetched))

    def ignore_operator_records(self, mark: tuple | None = None) -> None:
        """Read no operator record from now on (``backend.build_rprograms`` after a
        ``deferred.LateVersionError``: every operator's versions made again, the full path),
        and, with a :meth:`mark`, ask every question again as from there (so the compile made
        again asks and is answered as the full path; what was measured stays measured)."""
        self._records_ignored = True
        self._drop_prebuilt()  # the compile starts again: what it started early is not timed
        if mark is not None:
            self.rprogram_budget, asked, counts, unmeasured, prefetched = mark
            self._asked, self.counts, self._unmeasured = set(asked), Counter(counts), \
                copy.deepcopy(unmeasured)
            self._prefetched = set(prefetched)

    def has_kernel_record(self, key: str) -> bool:
        """Whether an rKernel version has a kernel record that is not a failure."""
        record = self._lookup("kernel", key)[0]
        return record is not None and not is_failure(record)

    def note_operator(self, operator: str, key: str, versions: Sequence, reference_key,
                      dlight_only: bool = False) -> None:
        """Write ``operator``'s record under ``key`` once :meth:`prepare` has measured (with a
        device only): ``versions`` are (name, source, func_key, launch fields:
        ``deferred.lowered_fields``) of every version made, in order;
        their predicted times come from :meth:`prepare`'s jobs; ``dlight_only``: only the
        pipeline's version was made (the record says so: ``operator_record``)."""
        if self.device is not None:
            self._operators[operator] = (key, list(versions), reference_key, dlight_only)

    def _write_operators(self, jobs: Sequence[KernelJob]) -> None:
        """The records of the operators noted (see ``operator_record``), written when new or
        changed; which versions have kernel records is read after this compile's measuring."""
        if not self._operators:
            return
        predicted = {(job.operator, job.key): job.predicted_us for job in jobs}
        items = []
        for operator, (key, versions, reference_key, dlight_only) in self._operators.items():
            entries = [{"name": name, "source": source, "key": vkey, "lowered": fields,
                        "predicted_us": predicted.get((operator, vkey))}
                       for name, source, vkey, fields in versions]
            measured = {e["name"]: self._lookup("kernel", e["key"])[0] for e in entries
                        if self.has_kernel_record(e["key"])}
            timed = {n: r["kernel_us"] for n, r in measured.items()
                     if r.get("valid") is True and r.get("kernel_us") is not None}
            record = {"format": OPERATOR_FORMAT, "operator": operator, "versions": entries,
                      "reference_key": reference_key,
                      "measured": sorted(measured), "fastest": min(timed, key=timed.get) if timed else None}
            if dlight_only:
                record["dlight_only"] = True
            if self._lookup(OPERATOR_KIND, key)[0] != record:
                items.append((OPERATOR_KIND, key, self.device.id, record))
        self._operators = {}
        self._put(items)

    def kernel(self, key: str) -> tuple:
        """(record, source) of an rKernel version, or (None, None) when unknown."""
        record, source = self._lookup("kernel", key)
        if record is not None:
            self.counts[source] += 1
        return record, source

    def default_time(self, reference_keys: Sequence[str]) -> float | None:
        """The summed time (us) of TVM's default kernels for these operators, each timed alone (a
        launch included); None when any is unknown."""
        total = 0.0
        for key in reference_keys:
            record = self._lookup("kernel", key)[0] if key else None
            if record is None or record.get("kernel_us") is None:
                return None
            total += float(record["kernel_us"])
        return total

    def rprogram_time(self, key: str, measure: Callable[[], float | None] | None,
                      force: bool = False) -> tuple:
        """(time_us, source) of an rProgram: recorded, or measured with ``measure()``, for the
        first ``rprogram_budget`` distinct keys asked (always when ``force``, while
        ``budget_s`` lasts); (None, None) otherwise."""
        record, source = self._lookup("rprogram", key)
        if not force and key not in self._asked:
            # every new request counts, measured or read: a second compile asks the same
            # questions in the same order, gets the same answers, and measures nothing
            if self.rprogram_budget <= 0:
                return None, None
            self._asked.add(key)
            self.rprogram_budget -= 1
        if record is not None:
            return (None, None) if is_failure(record) else (float(record["time_us"]), source)
        if self.device is None or measure is None or (not force and key not in self._asked):
            return None, None
        if self.over_budget():
            self._not_measured(rprograms=1)
            return None, None
        try:
            measured = measure()
        except BudgetSpent:  # ran out while it was built or run: abandoned, not a failure
            self._not_measured(rprograms=1)
            return None, None
        except LateVersionError:  # not the plan's failure: the compile is done again, records off
            raise
        except Exception as err:  # pylint: disable=broad-except  (analytical for this plan)
            LOG.warning("tvm-rammer: timing an rProgram failed (%s): its analytical time is used",
                        _short(err))
            measured = None
        if measured is None:
            self._failed[("rprogram", key)] = {"reason": "run failed"}
            return None, None
        self._put([("rprogram", key, self.device.id, {"time_us": float(measured)})])
        self._measured.add(("rprogram", key))
        self.counts["rprograms profiled"] += 1
        return float(measured), "profiled"

    def record_rprogram(self, key: str, time_us: float) -> None:
        """Record a measured rProgram time under ``key`` (a second key of the same kernel)."""
        if self.device is not None and self._lookup("rprogram", key)[0] is None:
            self._put([("rprogram", key, self.device.id, {"time_us": float(time_us)})])
            self._measured.add(("rprogram", key))

    def plan_profile(self, graph, build_and_time: Callable | None) -> Callable:
        """The ``profile`` argument of ``policy.schedule``: a plan's measured time (us), or None
        (the policy then uses its analytical time). Its ``prefetch(plan)`` starts building a plan
        that ``profile`` is about to be asked for (``build_and_time.start_build``, when the back
        end gives one): the policy names the plans of a comparison first, so they build side by
        side, then asks for each in turn."""

        def profile(plan):
            if not active():  # past the budget: analytical, without hashing the whole plan
                return None
            measure = None if build_and_time is None else (lambda: build_and_time(plan))
            return self.rprogram_time(plan_key(plan, graph), measure)[0]

        def prefetch(plan) -> None:
            start = getattr(build_and_time, "start_build", None)
            if start is None or not self.measures or not active():
                return
            key = plan_key(plan, graph)
            if key in self._prefetched or key in self._asked:
                return
            if sum(k not in self._asked for k in self._prefetched) >= self.rprogram_budget:
                return  # the ones named already take what is left of rprogram_budget
            self._prefetched.add(key)  # named: a plan with a record takes budget when asked too
            if self._lookup("rprogram", key)[0] is not None:
                return  # nothing to build
            try:
                start(plan)
            except LateVersionError:  # as when it is measured: the compile is done again
                raise
            except Exception as err:  # pylint: disable=broad-except  (measuring it builds it again)
                LOG.debug("tvm-rammer: an rProgram's build did not start early: %s", _short(err))

        def active() -> bool:
            """False once the time budget is spent on a device, or once ``rprogram_budget``
            distinct plans have been asked (every new plan is then analytical anyway; a plan
            asked before could still be answered, but one side of a comparison measured and the
            other analytical is no comparison): the policy stops asking, and stops building
            whole plans (each the size of the rProgram so far) only to hash them."""
            if self.measures and self.over_budget():
                self._unmeasured["policy"] = True
                return False
            return self.rprogram_budget > 0

        profile.active = active
        profile.prefetch = prefetch
        return profile

    def flush(self) -> None:
        """Write pending records; a database that refuses costs one warning."""
        try:
            self.db.flush()
        except Exception as err:  # pylint: disable=broad-except
            self._warn_once("write", f"tvm-rammer: profile database {getattr(self.db, 'path', None)} "
                            f"not writable ({_short(err)}): this compilation's measurements are "
                            "kept in memory only")

    def close(self) -> None:
        """:meth:`finish`, and release the device's worker processes (when it has any)."""
        self.finish()
        self._device_call("close", "closing the measuring device", LOG.warning)

    def summary(self) -> dict:
        """Counts of times by source, plus the device they are keyed by."""
        return {"device": self.device_id.key if self.device_id else None,
                **{k: self.counts.get(k, 0) for k in ("profiled", "database", "shipped")}}


def _names(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` names, then how many more."""
    names = sorted(set(names))
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _short(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]


def _batches(jobs: list, size: int) -> list:
    """``jobs`` cut into batches of about ``size``, never splitting an operator's jobs."""
    batches, current, last = [], [], None
    for job in jobs:
        op = job.operator or job.label.split(":", 1)[0]
        if current and len(current) >= size and op != last:
            batches.append(current)
            current = []
        current.append(job)
        last = op
    if current:
        batches.append(current)
    return batches
