"""Measuring on a device: the one kernel timer of tvm-rammer (Rammer, OSDI'20, 3.2 "Compile-time
profiling").

A :class:`MeasureDevice` does two things for the profiler:

- :meth:`~MeasureDevice.measure_kernels`: for each :class:`KernelJob` (one rKernel version of an
  operator and TVM's default kernel for the same operator), build both, run both on the same seeded
  inputs, compare the outputs (the version is ``valid`` when its relative error is within
  ``numerics.KERNEL_TOLERANCE``), and time both alone;
- :meth:`~MeasureDevice.time_kernel`: time one persistent kernel (a whole rProgram) on its program
  table and seeded inputs.

:class:`CudaDevice` is the real one. Kernels are built in a process pool (TVM's CUDA codegen and
nvcc, in parallel); they are run and timed one at a time in a separate runner process, so timings do
not disturb each other and a kernel that faults on the GPU costs its own record (marked invalid),
not the compilation: the runner is restarted. Tests pass their own fake device instead.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import tvm
from tvm import tirx

from ..gpu import DeviceId, LocalGPU
from ..numerics import KERNEL_TOLERANCE, relative_error, seeded_array

__all__ = ["KernelJob", "MeasureDevice", "CudaDevice", "param_specs"]

LOG = logging.getLogger("tvm_rammer")
ENTRY = "rammer_measured"


@dataclass(frozen=True)
class KernelJob:
    """One rKernel version to check and time: ``func`` (scheduled), ``reference`` (TVM's default
    kernel for the same operator, or None), the operator's ``num_outputs`` (the last parameters)."""

    key: str
    label: str
    func: tirx.PrimFunc
    reference: tirx.PrimFunc | None
    reference_key: str | None
    num_outputs: int


class MeasureDevice(Protocol):
    """What the profiler needs of a device (see the module docstring)."""

    id: DeviceId

    def measure_kernels(self, jobs: Sequence[KernelJob], progress: Callable[[int], None]) -> list:
        """One record per job (``kernel_us``, ``registers``, ``shared_bytes``, ``valid``, ``error``,
        and the reference's ``default_us``), or None where nothing could be measured."""

    def time_kernel(self, func: tirx.PrimFunc, fixed: dict) -> float | None:
        """Median time (us) of one call of ``func`` with ``fixed`` parameters (name -> array) and
        seeded others; None when it cannot run."""


def param_specs(func: tirx.PrimFunc) -> list:
    """(name, shape, dtype) of every parameter of a kernel PrimFunc (all are buffers)."""
    return [(str(p.name), [int(d) for d in p.ty.shape], str(p.ty.dtype)) for p in func.params]


# --- worker side (separate processes; plain data in and out) -------------------------------------

def _build_worker(mod_json: str, target_spec: dict, path: str, resources: bool) -> dict:
    """Build ``mod_json`` (a TIR IRModule) for the target and export it to ``path``."""
    target = tvm.target.Target(target_spec)
    mod = tvm.ir.load_json(mod_json)
    lib = tvm.tirx.build(mod, target)
    lib.export_library(path)
    info = {"path": path}
    if resources:
        from tir_templates.cuda_resources import compile_cuda_resources

        from ..resources import module_cuda_source
        from ..target import target_arch

        try:
            info.update(compile_cuda_resources(module_cuda_source(lib), target_arch(target)))
        except Exception as err:  # pylint: disable=broad-except  (resources are optional)
            info["resources_error"] = str(err).splitlines()[0] if str(err) else type(err).__name__
    return info


_LOADED: dict = {}
_DEFAULT_US: dict = {}  # reference path -> its time: each operator's default kernel is timed once


def _load(path: str):
    if path not in _LOADED:
        _LOADED[path] = tvm.runtime.load_module(path)
    return _LOADED[path]


def _arrays(specs, rng, fixed: dict, fill_outputs_from: int | None = None) -> list:
    arrays = []
    for k, (name, shape, dtype) in enumerate(specs):
        if name in fixed:
            arrays.append(np.asarray(fixed[name]))
        elif fill_outputs_from is not None and k >= fill_outputs_from and dtype.startswith("float"):
            arrays.append(np.full(shape, np.nan, dtype=dtype))  # unwritten outputs fail the check
        else:
            arrays.append(seeded_array(shape, dtype, rng))
    return arrays


def _time(lib, dev, args, number: int, repeat: int) -> float:
    timer = lib.time_evaluator(ENTRY, dev, number=number, repeat=repeat, min_repeat_ms=1)
    return float(np.median(timer(*args).results)) * 1e6


def _run_kernel_worker(job: dict) -> dict:
    """Check a built version against its built reference and time both (runs in the runner)."""
    dev = tvm.cuda(0)
    specs, num_out = job["specs"], job["num_outputs"]
    first_out = len(specs) - num_out
    inputs = _arrays(specs[:first_out], np.random.default_rng(job["seed"]), {})
    record: dict = {}
    lib = _load(job["path"])
    version_args = [tvm.runtime.tensor(a, dev) for a in
                    inputs + _arrays(specs[first_out:], np.random.default_rng(1), {},
                                             fill_outputs_from=0)]
    lib[ENTRY](*version_args)
    dev.sync()
    if job.get("ref_path"):
        ref = _load(job["ref_path"])
        ref_args = [tvm.runtime.tensor(a, dev) for a in
                    inputs + [np.zeros(s, d) for _, s, d in specs[first_out:]]]
        ref[ENTRY](*ref_args)
        dev.sync()
        error = max((relative_error(v.numpy(), r.numpy())
                     for v, r in zip(version_args[first_out:], ref_args[first_out:])), default=0.0)
        record.update(error=error, valid=bool(error <= job["tolerance"]))
        if job["ref_path"] not in _DEFAULT_US:
            _DEFAULT_US[job["ref_path"]] = _time(ref, dev, ref_args, job["number"], job["repeat"])
        record["default_us"] = _DEFAULT_US[job["ref_path"]]
    else:
        record.update(error=None, valid=None)
    record["kernel_us"] = _time(lib, dev, version_args, job["number"], job["repeat"])
    return record


def _time_kernel_worker(path: str, specs: list, fixed: dict, number: int, repeat: int) -> float:
    dev = tvm.cuda(0)
    lib = _load(path)
    args = [tvm.runtime.tensor(a, dev) for a in _arrays(specs, np.random.default_rng(0), fixed)]
    lib[ENTRY](*args)  # warm-up (and the first cooperative launch)
    dev.sync()
    return _time(lib, dev, args, number, repeat)


# --- host side -----------------------------------------------------------------------------------

def _spawn_pool(workers: int) -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]


class CudaDevice:
    """The local CUDA GPU as a :class:`MeasureDevice` (see the module docstring).

    Parameters
    ----------
    gpu: the local GPU (``gpu.local_gpu()``).
    target: the CUDA target kernels are built for (its arch must be the GPU's).
    build_workers: processes building kernels in parallel (default: CPU count, at most 16).
    number, repeat: ``time_evaluator``'s calls per measurement and measurements (the median is kept).
    """

    def __init__(self, gpu: LocalGPU, target: tvm.target.Target, build_workers: int | None = None,
                 number: int = 20, repeat: int = 5, tolerance: float = KERNEL_TOLERANCE):
        self.id = gpu.id
        spec = dict(target.export())
        spec.pop("tag", None)
        spec["keys"] = list(spec.get("keys", ()))
        self._target_spec = spec
        self._workers = max(1, min(build_workers or os.cpu_count() or 1, 16))
        self.number, self.repeat, self.tolerance = number, repeat, tolerance
        self._dir = tempfile.mkdtemp(prefix="tvm_rammer_measure_")
        self._builder: cf.ProcessPoolExecutor | None = None
        self._runner: cf.ProcessPoolExecutor | None = None
        self._count = 0

    # processes
    def _build_pool(self) -> cf.ProcessPoolExecutor:
        if self._builder is None:
            self._builder = _spawn_pool(self._workers)
        return self._builder

    def _run(self, fn, *args):
        """``fn(*args)`` in the runner process; a crash restarts the runner and re-raises."""
        if self._runner is None:
            self._runner = _spawn_pool(1)
        try:
            return self._runner.submit(fn, *args).result()
        except BrokenProcessPool:
            self._runner.shutdown(cancel_futures=True)
            self._runner = None
            raise RuntimeError("the kernel crashed the GPU runner process (restarted)") from None

    def close(self) -> None:
        for pool in (self._builder, self._runner):
            if pool is not None:
                pool.shutdown(cancel_futures=True)
        self._builder = self._runner = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def _submit_build(self, func: tirx.PrimFunc, resources: bool):
        self._count += 1
        path = os.path.join(self._dir, f"k{self._count}.so")
        mod = tvm.IRModule({ENTRY: func.with_attr("global_symbol", ENTRY)})
        return self._build_pool().submit(_build_worker, tvm.ir.save_json(mod), self._target_spec,
                                         path, resources)

    # MeasureDevice
    def measure_kernels(self, jobs: Sequence[KernelJob], progress: Callable[[int], None]) -> list:
        refs = {}
        for job in jobs:
            if job.reference is not None and job.reference_key not in refs:
                refs[job.reference_key] = self._submit_build(job.reference, False)
        builds = [self._submit_build(job.func, True) for job in jobs]
        records = []
        for job, build in zip(jobs, builds):
            records.append(self._measure_one(job, build, refs.get(job.reference_key)))
            progress(1)
        return records

    def _measure_one(self, job: KernelJob, build, ref_build) -> dict | None:
        try:
            info = build.result()
        except Exception as err:  # pylint: disable=broad-except  (a version that does not build)
            LOG.info("tvm-rammer: %s does not build for the device: %s", job.label, _first_line(err))
            return {"valid": False, "error": None, "reason": f"build failed: {_first_line(err)}"}
        ref_path = None
        if ref_build is not None:
            try:
                ref_path = ref_build.result()["path"]
            except Exception as err:  # pylint: disable=broad-except
                LOG.info("tvm-rammer: TVM's default kernel for %s does not build: %s", job.label,
                         _first_line(err))
        payload = {"path": info["path"], "ref_path": ref_path, "specs": param_specs(job.func),
                   "num_outputs": job.num_outputs, "seed": 0, "tolerance": self.tolerance,
                   "number": self.number, "repeat": self.repeat}
        try:
            record = self._run(_run_kernel_worker, payload)
        except Exception as err:  # pylint: disable=broad-except
            LOG.warning("tvm-rammer: %s failed on the device: %s", job.label, _first_line(err))
            return {"valid": False, "error": None, "reason": f"run failed: {_first_line(err)}"}
        record.update(registers=info.get("registers"), shared_bytes=info.get("shared_bytes"),
                      spills=info.get("spills"))
        if record.get("valid") is False:
            record["reason"] = (f"output differs from TVM's default kernel: relative error "
                                f"{record['error']:.2e} > {self.tolerance:.0e}")
        return record

    def time_kernel(self, func: tirx.PrimFunc, fixed: dict) -> float | None:
        try:
            path = self._submit_build(func, False).result()["path"]
            return self._run(_time_kernel_worker, path, param_specs(func), fixed, self.number,
                             self.repeat)
        except Exception as err:  # pylint: disable=broad-except
            LOG.warning("tvm-rammer: could not time %s on the device: %s",
                        (func.attrs or {}).get("global_symbol", "a kernel"), _first_line(err))
            return None
