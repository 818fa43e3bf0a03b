"""Compile-time profiler (Rammer, OSDI'20, 3.2 "Compile-time profiling").

Three kinds of information, each with a function here:

1. an rTask's time on a vEU: :func:`measure_kernel` builds ONE scheduled PrimFunc for CUDA, runs it
   alone with ``time_evaluator`` on random inputs (kernel time ``kernel_us``, median of repeats) and
   derives the per-rTask time as

       rtask_us = kernel_us / ceil(num_rtasks / (num_sms * occupancy))

   i.e. the kernel's time divided by its number of full "rounds" of thread blocks on the device, where
   ``occupancy`` is the blocks per SM its threads, registers and shared memory allow (the vDevice
   rules). A kernel with fewer blocks than the device holds is one round: its rTask time is the kernel
   time. ``kernel_us`` includes what a lone launch costs on the device (event-timed, so not the host
   launch latency);
2. resources: registers and shared memory from ``compile_cuda_resources`` (nvcc ``-Xptxas -v``);
3. an rProgram's time: :func:`rprogram_profile` turns a build-and-time callback (the persistent-kernel
   codegen lives in ``codegen/``; the callback builds the kernel for a plan and times it on the GPU)
   into the ``profile`` callable of ``policy.schedule``, cached in the profile database.

:class:`Profiler` puts 1 and 2 behind the profile database: a kernel already in the database is not
measured again, and without a GPU the database or, failing that, the analytical cost model gives the
time. ``Profiler.counts`` says how many rKernel times came from each ("profiled", "database",
"analytical").
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm

from ..vdevice import VDevice
from .profile_db import ProfileDB

__all__ = ["Timing", "Profiler", "measure_kernel", "rtask_time", "local_gpu", "rprogram_profile",
           "plan_key"]

LOG = logging.getLogger("tvm_rammer")


@dataclass(frozen=True)
class Timing:
    """Time of one rTask of an rKernel and where it comes from."""

    rtask_us: float
    source: str  # "profiled", "database" or "analytical"
    registers: int | None = None
    kernel_us: float | None = None


def rtask_time(kernel_us: float, num_rtasks: int, threads: int, registers, shared_bytes: int,
               vdevice: VDevice) -> float:
    """Per-rTask time of a kernel timed alone (formula in the module docstring)."""
    per_sm = max(1, vdevice.occupancy(threads, registers, shared_bytes))
    rounds = math.ceil(num_rtasks / (vdevice.num_sms * per_sm))
    return kernel_us / max(1, rounds)


def local_gpu():
    """(device, name, arch) of CUDA device 0, or None when there is none."""
    try:
        dev = tvm.cuda(0)
        if not dev.exist:
            return None
        major, minor = str(dev.compute_version).split(".")
        return dev, str(dev.device_name), f"sm_{major}{minor}"
    except Exception:  # pylint: disable=broad-except  (no CUDA runtime in this TVM build)
        return None


def _random_args(func: tvm.tirx.PrimFunc, dev, rng: np.random.Generator) -> list:
    args = []
    for param in func.params:
        shape = [int(d) for d in param.ty.shape]
        dtype = str(param.ty.dtype)
        if dtype.startswith("float") or dtype.startswith("bfloat"):
            data = rng.uniform(-1, 1, size=shape).astype("float32").astype(dtype)
        elif dtype == "bool":
            data = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            data = rng.integers(0, 4, size=shape).astype(dtype)
        args.append(tvm.runtime.tensor(data, dev))
    return args


def measure_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target, dev, *, number: int = 20,
                   repeat: int = 5, resources: bool = True, arch: str | None = None) -> dict:
    """Build ``func`` (one scheduled kernel) for ``target``, time it alone on ``dev`` and read its
    registers. Returns ``dict(kernel_us, registers, shared_bytes)`` (registers None without nvcc)."""
    from tir_templates.cuda_resources import CudaCompileError, compile_cuda_resources

    func = func.with_attr("global_symbol", "rammer_profile")
    lib = tvm.tirx.build(tvm.IRModule({"rammer_profile": func}), target)
    args = _random_args(func, dev, np.random.default_rng(0))
    timer = lib.time_evaluator("rammer_profile", dev, number=number, repeat=repeat, min_repeat_ms=1)
    kernel_us = float(np.median(timer(*args).results)) * 1e6
    registers = shared = None
    if resources:
        try:
            source = str(lib.imports[0].inspect_source("cu")) if lib.imports else ""
            info = compile_cuda_resources(source, arch or str(target.attrs.get("arch", "sm_90")))
            registers, shared = info["registers"], info["shared_bytes"]
        except (CudaCompileError, Exception) as err:  # pylint: disable=broad-except
            LOG.info("tvm-rammer: no register count for a profiled kernel: %s", str(err).splitlines()[0])
    return {"kernel_us": kernel_us, "registers": registers, "shared_bytes": shared}


class Profiler:
    """rKernel times from the profile database, the GPU, or the analytical model (in that order).

    Parameters
    ----------
    db: the profile database (memory only when None).
    target: the CUDA target kernels are built for.
    measure: ``measure(func, lowered) -> dict(kernel_us, registers, shared_bytes)``; None = the local
        GPU through :func:`measure_kernel` when one is visible and ``use_gpu``, else nothing is
        measured. Tests pass a fake here.
    device: the device name records are keyed by; None = the local GPU's, else a device of the
        database with the target's arch.
    """

    def __init__(self, db: ProfileDB | None, target: tvm.target.Target, measure: Callable | None = None,
                 device: str | None = None, resources: bool = True, use_gpu: bool = True):
        self.db = db if db is not None else ProfileDB()
        self.target = target
        self.arch = str(target.attrs.get("arch", "sm_90"))
        self.counts: Counter = Counter()
        gpu = local_gpu() if measure is None and use_gpu else None
        if measure is None and gpu is not None:
            dev, name, arch = gpu
            self.arch = arch
            measure = lambda func, _lowered: measure_kernel(func, target, dev, resources=resources,  # noqa: E731
                                                            arch=arch)
            device = device or name
        self.measure = measure
        self.device = device or self.db.device_for_arch(self.arch) or f"unknown-{self.arch}"

    def timings(self, versions, vdevice: VDevice, analytical: Callable) -> list[Timing]:
        """One Timing per version (``tuning.versions.KernelVersion``). When any version of the operator
        has neither a record nor a way to be measured, every version uses ``analytical(version)`` so
        that one operator's versions are always compared on the same scale."""
        records = []
        for version in versions:
            measure = None
            if self.measure is not None:
                measure = (lambda v=version: self.measure(v.func, v.lowered))
            record, source = self.db.kernel_or_measure(version.key, self.device, measure, self.arch)
            records.append((record, source))
        if any(record is None for record, _ in records):
            self.counts["analytical"] += len(versions)
            return [Timing(analytical(v), "analytical") for v in versions]
        out = []
        for version, (record, source) in zip(versions, records):
            lowered = version.lowered
            registers = record.get("registers")
            shared = max(lowered.shared_bytes, int(record.get("shared_bytes") or 0))
            rtask_us = rtask_time(record["kernel_us"], lowered.num_rtasks, lowered.threads, registers,
                                  shared, vdevice)
            self.counts[source] += 1
            out.append(Timing(rtask_us, source, registers, record["kernel_us"]))
        return out

    def summary(self) -> dict:
        """Counts of rKernel times by source, plus the device they are keyed by."""
        return {"device": self.device, **{k: self.counts.get(k, 0)
                                          for k in ("profiled", "database", "analytical")}}


def plan_key(plan, graph) -> str:
    """A stable key of an rProgram plan: its table and the names (with hashes) of its rKernels."""
    kernels = {str(op): graph.ops[op].kernels[i].name for op, i in plan.selected.items()}
    blob = json.dumps({"program": plan.program.to_dict(), "kernels": kernels}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def rprogram_profile(graph, build_and_time: Callable | None, db: ProfileDB, device: str,
                     arch: str | None = None) -> Callable:
    """The ``profile`` argument of ``policy.schedule``: an rProgram plan's measured time in us.

    ``build_and_time(plan) -> float | None`` builds the persistent kernel of ``plan`` and times it on
    the GPU (None when it cannot); results are cached in ``db`` under :func:`plan_key`. With
    ``build_and_time=None`` only database hits are returned (None otherwise: the policy then uses its
    analytical time).
    """

    def profile(plan):
        key = plan_key(plan, graph)
        known = db.rprogram(key, device)
        if known is not None or build_and_time is None:
            return known
        measured = build_and_time(plan)
        if measured is not None:
            db.put_rprogram(key, device, measured, arch)
        return measured

    return profile
