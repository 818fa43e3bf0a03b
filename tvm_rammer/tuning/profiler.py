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
  built and timed per compilation (each is a full nvcc build), the final ones always.

Where records come from is counted in ``Profiler.counts``: "profiled" (measured now), "database"
(the writable database), "shipped" (a read-only database, e.g. one shipped with tvm-rammer).
Without a device and without a record nothing is measured: the caller decides what that means
(``rkernels``: TVM's dlight schedule only, timed by the analytical model).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from ..gpu import DeviceId
from ..vdevice import VDevice
from .measure import KernelJob, MeasureDevice

__all__ = ["Timing", "Profiler", "rtask_time", "plan_key", "Progress"]

LOG = logging.getLogger("tvm_rammer")


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


def plan_key(plan, graph) -> str:
    """A stable key of an rProgram plan: its table and the names (with hashes) of its rKernels."""
    kernels = {str(op): graph.ops[op].kernels[i].name for op, i in plan.selected.items()}
    blob = json.dumps({"program": plan.program.to_dict(), "kernels": kernels}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


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
    """

    def __init__(self, db, device: MeasureDevice | None = None, arch: str = "sm_90a",
                 readonly: Sequence = (), rprogram_budget: int = 32, progress: bool = True):
        self.db, self.device = db, device
        self.counts: Counter = Counter()
        self.rprogram_budget = rprogram_budget
        self.progress = progress
        self._measured: set = set()
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
        for db, device, label in self.sources:
            record = db.get(kind, key, device)
            if record is not None:
                return record, ("profiled" if (kind, key) in self._measured else label)
        return None, None

    def prepare(self, jobs: Sequence[KernelJob]) -> None:
        """Check and time, in one batch, every job whose key (or reference key) has no record."""
        if self.device is None:
            return
        todo, seen = [], set()
        for job in jobs:
            if job.key in seen or self._lookup("kernel", job.key)[0] is not None:
                continue
            seen.add(job.key)
            todo.append(job)
        if not todo:
            return
        progress = Progress(len(todo), "tvm-rammer: profiling rKernels", self.progress)
        try:
            records = self.device.measure_kernels(todo, progress)
        finally:
            progress.close()
        items, keys = [], {job.key for job in todo}
        for job, record in zip(todo, records):
            if record is None:
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
        self.db.put_many(items)

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
        """(time_us, source) of an rProgram: recorded, or measured with ``measure()`` while the
        budget lasts (always when ``force``); (None, None) otherwise."""
        record, source = self._lookup("rprogram", key)
        if record is not None:
            return float(record["time_us"]), source
        if self.device is None or measure is None or (not force and self.rprogram_budget <= 0):
            return None, None
        if not force:
            self.rprogram_budget -= 1
        measured = measure()
        if measured is None:
            return None, None
        self.db.put("rprogram", key, self.device.id, {"time_us": float(measured)})
        self._measured.add(("rprogram", key))
        self.counts["rprograms profiled"] += 1
        return float(measured), "profiled"

    def plan_profile(self, graph, build_and_time: Callable | None) -> Callable:
        """The ``profile`` argument of ``policy.schedule``: a plan's measured time (us), or None
        (the policy then uses its analytical time)."""

        def profile(plan):
            measure = None if build_and_time is None else (lambda: build_and_time(plan))
            return self.rprogram_time(plan_key(plan, graph), measure)[0]

        return profile

    def flush(self) -> None:
        self.db.flush()

    def close(self) -> None:
        """Flush the database and release the device's worker processes (when it has any)."""
        self.flush()
        close = getattr(self.device, "close", None)
        if close is not None:
            close()

    def summary(self) -> dict:
        """Counts of times by source, plus the device they are keyed by."""
        return {"device": self.device_id.key if self.device_id else None,
                **{k: self.counts.get(k, 0) for k in ("profiled", "database", "shipped")}}
