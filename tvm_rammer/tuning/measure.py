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

Nothing here waits without a deadline, and no failure is left to poison what follows:

- every wait on a build or a run has a timeout (``build_timeout_s``, ``run_timeout_s``); a job past
  it is a failure ("timed out"), and its worker processes are killed;
- the profiler's budget is a deadline too (``within_s`` of :meth:`~MeasureDevice.measure_kernels`
  and :meth:`~MeasureDevice.time_kernel`): past it no build or run starts, the builds and the run
  in flight are abandoned (their processes killed), and the jobs not measured come back as None
  (:meth:`~MeasureDevice.measure_kernels`) or :class:`BudgetSpent` is raised
  (:meth:`~MeasureDevice.time_kernel`): not measured is not a failure;
- a batch of kernels whose build fails or times out costs no kernel but the one at fault: each
  kernel of the batch is then built as a job of its own, with its own ``build_timeout_s``; a build
  whose processes were killed for another build's timeout is submitted once more; when a batch's
  one nvcc run fails, each kernel's resources are compiled alone (its own numbers or its own error);
- any failure of a job in the runner (an exception, an illegal address that leaves the CUDA
  context dead, a crash, a timeout) restarts the runner, so the next job gets a fresh context;
- a persistent kernel timed by :meth:`~CudaDevice.time_kernel` gets an empty fault page
  (``tvm_rammer.codegen.faults``) and the page is read after its warm-up run: a barrier wait (or the
  prologue's grid barrier) that timed out makes the candidate invalid (no time), instead of ~100
  timed waits of ``wait_timeout_ms``;
- worker processes are started with a clean ``__main__`` (:func:`_clean_main`), so a user's
  script without an ``if __name__ == "__main__"`` guard is not run again in each worker;
- versions are checked at a tolerance for their outputs' dtype (:func:`tolerance_for`);
- a version that is its operator's default kernel (``key == reference_key``: the pipeline's
  dlight version, most often) is built once, as one kernel of its batch, with its resources, and
  run once: not compared with itself, timed once (its ``default_us`` is its ``kernel_us``).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import types
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import tvm
from tvm import tirx

from ..host.gpu import DeviceId, LocalGPU
from ..target import target_arch, target_spec
from ..numerics import KERNEL_TOLERANCE, relative_error, seeded_array

__all__ = ["KernelJob", "MeasureDevice", "CudaDevice", "BudgetSpent", "param_specs", "tolerance_for",
           "deadline_in"]

LOG = logging.getLogger("tvm_rammer")
ENTRY = "rammer_measured"
FAULT_PAGE_PARAM = "rammer_fault_page"  # codegen.persistent's name of the fault page parameter
# a version may differ from TVM's default kernel by rounding only: float32 at KERNEL_TOLERANCE,
# half precision at its own (10 mantissa bits for float16, 7 for bfloat16)
DTYPE_TOLERANCES = {"float16": 1e-2, "bfloat16": 2e-2}
VERSION_WORKERS_FROM = 4  # build processes from which versions are made in them (version_workers)


class BudgetSpent(RuntimeError):
    """The profiling budget ran out before a build or a run could finish: nothing was measured,
    and nothing failed (the caller goes on as without a device)."""


def deadline_in(within_s: float | None) -> float | None:
    """The ``time.monotonic()`` deadline ``within_s`` seconds from now (None: no deadline)."""
    return None if within_s is None else time.monotonic() + max(0.0, float(within_s))


def _left(deadline: float | None, timeout: float) -> tuple:
    """(seconds to wait, whether the deadline rather than ``timeout`` bounds the wait); raises
    :class:`BudgetSpent` when the deadline has passed (nothing new starts after it)."""
    if deadline is None:
        return timeout, False
    left = deadline - time.monotonic()
    if left <= 0:
        raise BudgetSpent("the profiling budget is spent")
    return (left, True) if left < timeout else (timeout, False)


def tolerance_for(dtypes, base: float = KERNEL_TOLERANCE) -> float:
    """The relative error a version's outputs of these dtypes may have against TVM's default
    kernel: ``base`` (float32 rounding) or, with a half-precision output, that dtype's own."""
    return max([base, *(DTYPE_TOLERANCES.get(str(d), base) for d in dtypes)])


@dataclass(frozen=True)
class KernelJob:
    """One rKernel version to check and time: ``func`` (scheduled), ``reference`` (TVM's default
    kernel for the same operator, or None), the operator's ``num_outputs`` (the last parameters);
    ``operator``, ``predicted_us`` and ``base`` let the profiler measure only what can change a
    choice (``profiler.decisive_jobs``)."""

    key: str
    label: str
    func: tirx.PrimFunc
    reference: tirx.PrimFunc | None
    reference_key: str | None
    num_outputs: int
    operator: str = ""            # the operator's name: the profiler measures operators whole
    predicted_us: float | None = None  # the analytical time of the whole kernel (decisive_jobs)
    base: bool = False            # the pipeline's dlight version of the operator


class MeasureDevice(Protocol):
    """What the profiler needs of a device (see the module docstring)."""

    id: DeviceId

    def measure_kernels(self, jobs: Sequence[KernelJob], progress: Callable[[int], None],
                        within_s: float | None = None) -> list:
        """One record per job (``kernel_us``, ``registers``, ``shared_bytes``, ``valid``, ``error``,
        and the reference's ``default_us``), or None where nothing could be measured; past
        ``within_s`` seconds from the call nothing new starts and what runs is abandoned (None)."""

    def time_kernel(self, func: tirx.PrimFunc, fixed: dict,
                    within_s: float | None = None) -> float | None:
        """Median time (us) of one call of ``func`` with ``fixed`` parameters (name -> array) and
        seeded others; None when it cannot run; :class:`BudgetSpent` when it could not be built
        and timed within ``within_s`` seconds.

        Optional, where a device can build ahead (``CudaDevice``): ``prebuild(func)`` starts the
        build of a kernel ``time_kernel`` will be asked for (the same object), and
        ``drop_prebuilt()`` forgets those not timed (``Profiler.prebuild``)."""


def param_specs(func: tirx.PrimFunc) -> list:
    """(name, shape, dtype) of every parameter of a kernel PrimFunc (all are buffers)."""
    return [(str(p.name), [int(d) for d in p.ty.shape], str(p.ty.dtype)) for p in func.params]


# --- worker side (separate processes; plain data in and out) -------------------------------------

@contextlib.contextmanager
def _compiles(target):
    """While a worker builds: the nvcc logs (ptxas's ``-v`` lines) of the module compiles, as a
    list the body reads after the build.

    Where nvcc is how this host compiles CUDA (``host.cuda_compile.nvcc_keeps_log``), TVM's compile
    callback (``tvm_callback_cuda_compile``, which a build calls on a GPU host) compiles with TVM's
    own nvcc command and keeps its output (``nvcc_with_log``): the registers of a kernel are then
    read from the compile that makes it, and a batch needs no second nvcc run for them. A module
    TVM kept uncompiled (a host without the NVIDIA driver) can be compiled so after the build
    (:func:`_built`), as a GPU host's build compiles it: what profile_cost.py measures building
    costs with (``CudaDevice(compile_source=True)``)."""
    import tvm_ffi

    from ..host import cuda_compile

    logs: list = []
    if not cuda_compile.nvcc_keeps_log():
        yield logs
        return
    real = tvm_ffi.get_global_func(cuda_compile.CALLBACK, allow_missing=True)

    def compile_with_log(code, *_):
        binary, log = cuda_compile.nvcc_with_log(str(code), target)
        logs.append(log)
        return binary

    tvm_ffi.register_global_func(cuda_compile.CALLBACK, compile_with_log, override=True)
    try:
        yield logs
    finally:
        tvm_ffi.register_global_func(cuda_compile.CALLBACK, real or cuda_compile.compile_callback,
                                     override=True)


def _built(mod, target, compile_source: bool) -> tuple:
    """``(module, nvcc logs)`` of ``mod`` built for ``target`` in a worker (:func:`_compiles`);
    with ``compile_source``, a module TVM kept uncompiled (no CUDA runtime here) is compiled
    after the build as a GPU host's build compiles it."""
    import tvm_ffi

    from ..host import cuda_compile
    from ..codegen.resources import module_cuda_source

    with _compiles(target) as logs:
        lib = tvm.tirx.build(mod, target)
        if compile_source and not logs and not cuda_compile.tvm_builds_cuda():
            with target:
                tvm_ffi.get_global_func(cuda_compile.CALLBACK)(module_cuda_source(lib))
    return lib, logs


def _build_worker(mod_json: str, target_spec: dict, path: str, resources: bool,
                  compile_source: bool = False) -> dict:
    """Build ``mod_json`` (a TIR IRModule of one kernel, :data:`ENTRY`) for the target and export
    it to ``path``: ``{"path", "entry"}`` and, with ``resources``, its registers, shared bytes and
    spills (or ``resources_error``): from the build's own nvcc run where it kept its log
    (:func:`_compiles`), else from a compile of its CUDA source. ``compile_source``: see
    :func:`_built`."""
    from tir_templates.cuda_resources import parse_ptxas_info

    target = tvm.target.Target(target_spec)
    mod = tvm.ir.load_json(mod_json)
    lib, logs = _built(mod, target, compile_source)
    lib.export_library(path)
    info = {"path": path, "entry": ENTRY}
    if resources:
        try:
            info.update(parse_ptxas_info(logs[-1]) if logs else _resources(lambda: lib, target))
        except Exception:  # pylint: disable=broad-except  (a log without the lines: compile them)
            info.update(_resources(lambda: lib, target))
    return info


def _resources(build, target) -> dict:
    """Registers, shared bytes, spills and stack bytes of the CUDA kernels of ``build()`` (a built
    module: its CUDA source through ``nvcc -Xptxas -v``), or ``{"resources_error": ...}`` when the
    build or nvcc fails (resources are optional)."""
    from tir_templates.cuda_resources import compile_cuda_resources

    from ..codegen.resources import module_cuda_source

    try:
        return compile_cuda_resources(module_cuda_source(build()), target_arch(target))
    except Exception as err:  # pylint: disable=broad-except
        return {"resources_error": str(err).splitlines()[0] if str(err) else type(err).__name__}


def _batch_build_worker(mod_json: str, target_spec: dict, path: str, resources: list,
                        compile_source: bool = False) -> list:
    """Build the kernels of ``mod_json`` (entry name -> PrimFunc) into one library at ``path``:
    one TVM build, one link and one nvcc run: the resources of the entries in ``resources`` are
    read from the build's own nvcc log where it kept one (:func:`_compiles`), else from one
    ``nvcc -Xptxas -v`` of the module's source for all. One item per entry (in sorted name order):
    ``{"path", "entry", registers...}``. A batch that does not build raises: the host then builds
    each of its kernels as its own job (:meth:`CudaDevice._member_result`). When that nvcc run
    fails, each kernel's resources are compiled on its own (:func:`_own_resources`): each keeps
    its resources or its own error. ``compile_source``: see :func:`_built`."""
    target = tvm.target.Target(target_spec)
    mod = tvm.ir.load_json(mod_json)
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    lib, logs = _built(mod, target, compile_source)
    lib.export_library(path)
    items = [{"path": path, "entry": name} for name in names]
    if resources:
        from tir_templates import cuda_resources

        from ..codegen.resources import module_cuda_source

        try:
            found = cuda_resources.parse_ptxas_functions(logs[-1]) if logs else \
                cuda_resources.compile_cuda_resources_per_kernel(module_cuda_source(lib),
                                                                 target_arch(target))
        except Exception:  # pylint: disable=broad-except  (one kernel's nvcc error: each alone)
            found = None
        for item in items:
            if item["entry"] not in resources:
                continue
            if found is None:
                item.update(_own_resources(mod, item["entry"], target))
                continue
            mine = [r for k, r in found.items() if k == item["entry"] or k.startswith(item["entry"] + "_kernel")]
            if mine:
                item.update(registers=max(r["registers"] for r in mine),
                            shared_bytes=max(r["shared_bytes"] for r in mine),
                            spills=sum(r["spills"] for r in mine))
            else:
                item["resources_error"] = "no ptxas line for this kernel"
    return items


def _own_resources(mod, name: str, target) -> dict:
    """Entry ``name`` of ``mod`` compiled alone (CUDA codegen and nvcc, no link): its
    :func:`_resources`."""
    return _resources(lambda: tvm.tirx.build(tvm.IRModule({name: mod[name]}), target), target)


_LOADED: dict = {}
_DEFAULT_US: dict = {}  # (reference path, entry) -> its time: each default kernel is timed once


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


def _time(lib, dev, args, number: int, repeat: int, entry: str = ENTRY) -> float:
    timer = lib.time_evaluator(entry, dev, number=number, repeat=repeat, min_repeat_ms=1)
    return float(np.median(timer(*args).results)) * 1e6


def _run_kernel_worker(job: dict) -> dict:
    """Check a built version against its built reference and time both (runs in the runner).
    A version whose reference is the same built kernel (``ref_path`` and ``ref_entry`` its own)
    is TVM's default kernel: valid with error 0, timed once (:func:`_default_kernel_record`)."""
    dev = tvm.cuda(0)
    specs, num_out = job["specs"], job["num_outputs"]
    first_out = len(specs) - num_out
    inputs = _arrays(specs[:first_out], np.random.default_rng(job["seed"]), {})
    record: dict = {}
    lib = _load(job["path"])
    entry, ref_entry = job.get("entry", ENTRY), job.get("ref_entry", ENTRY)
    if job.get("ref_path") and (job["ref_path"], ref_entry) == (job["path"], entry):
        return _default_kernel_record(job, lib, dev, inputs)
    version_args = [tvm.runtime.tensor(a, dev) for a in
                    inputs + _arrays(specs[first_out:], np.random.default_rng(1), {},
                                             fill_outputs_from=0)]
    lib[entry](*version_args)
    dev.sync()
    if job.get("ref_path"):
        ref = _load(job["ref_path"])
        ref_args = [tvm.runtime.tensor(a, dev) for a in
                    inputs + [np.zeros(s, d) for _, s, d in specs[first_out:]]]
        ref[ref_entry](*ref_args)
        dev.sync()
        error = max((relative_error(v.numpy(), r.numpy())
                     for v, r in zip(version_args[first_out:], ref_args[first_out:])), default=0.0)
        tolerance = tolerance_for([d for _, _, d in specs[first_out:]], job["tolerance"])
        record.update(error=error, valid=bool(error <= tolerance), tolerance=tolerance)
        record["default_us"] = _default_time((job["ref_path"], ref_entry), ref, dev, ref_args, job)
    else:
        record.update(error=None, valid=None)
    record["kernel_us"] = _time(lib, dev, version_args, job["number"], job["repeat"], entry)
    return record


def _default_time(key: tuple, lib, dev, args: list, job: dict) -> float:
    """The time of TVM's default kernel ``key`` (library path, entry), timed once per runner."""
    if key not in _DEFAULT_US:
        _DEFAULT_US[key] = _time(lib, dev, args, job["number"], job["repeat"], key[1])
    return _DEFAULT_US[key]


def _default_kernel_record(job: dict, lib, dev, inputs: list) -> dict:
    """The record of a version that is its operator's default kernel (one build for both): not
    compared with itself (valid, error 0), timed once, and that time is its ``default_us`` too
    (the time of :data:`_DEFAULT_US` when this kernel was timed already as a reference)."""
    specs, entry = job["specs"], job.get("entry", ENTRY)
    outputs = specs[len(specs) - job["num_outputs"]:]
    args = [tvm.runtime.tensor(a, dev) for a in inputs + [np.zeros(s, d) for _, s, d in outputs]]
    us = _default_time((job["path"], entry), lib, dev, args, job)
    return {"error": 0.0, "valid": True, "tolerance": tolerance_for([d for _, _, d in outputs],
                                                                     job["tolerance"]),
            "default_us": us, "kernel_us": us}


def _empty_fault_page(specs: list, fixed: dict) -> dict:
    """``fixed`` with an empty fault page for a persistent kernel that takes one."""
    if any(name == FAULT_PAGE_PARAM for name, _, _ in specs) and FAULT_PAGE_PARAM not in fixed:
        from ..codegen.faults import empty_page

        return {**fixed, FAULT_PAGE_PARAM: empty_page()}
    return fixed


def _check_fault_page(specs: list, args: list) -> None:
    """Raise when the kernel recorded a fault (a barrier wait that timed out) in its page."""
    for (name, _, _), arg in zip(specs, args):
        if name == FAULT_PAGE_PARAM:
            page = arg.numpy()
            if int(page[0]) != 0:
                raise RuntimeError(f"timed out: a barrier wait or the grid barrier gave up (fault page "
                                   f"{page[:9].tolist()})")


def _time_kernel_worker(path: str, specs: list, fixed: dict, number: int, repeat: int) -> float:
    dev = tvm.cuda(0)
    lib = _load(path)
    fixed = _empty_fault_page(specs, fixed)
    args = [tvm.runtime.tensor(a, dev) for a in _arrays(specs, np.random.default_rng(0), fixed)]
    lib[ENTRY](*args)  # warm-up (and the first cooperative launch)
    dev.sync()
    _check_fault_page(specs, args)  # a wait that gave up: invalid, never ~100 more timed waits
    us = _time(lib, dev, args, number, repeat)
    _check_fault_page(specs, args)
    return us


# --- host side -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _clean_main():
    """While worker processes start: a ``__main__`` with no file and no spec, so ``spawn`` does not
    import the user's script in each worker (which, without a ``__main__`` guard, would compile
    again and break the pool). Our workers' functions live in importable modules."""
    main = sys.modules.get("__main__")
    if main is None or (getattr(main, "__file__", None) is None
                        and getattr(main, "__spec__", None) is None):
        yield
        return
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _spawn_pool(workers: int) -> cf.ProcessPoolExecutor:
    """A spawn pool; submit to it inside :func:`_clean_main` (workers start on submit)."""
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def _submit(pool: cf.ProcessPoolExecutor, fn, *args) -> cf.Future:
    with _clean_main():
        return pool.submit(fn, *args)


def _kill(pool: cf.ProcessPoolExecutor | None) -> None:
    """Stop ``pool`` without waiting for its jobs: its processes are killed (a hung kernel or a
    dead CUDA context never ends on its own)."""
    if pool is None:
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=5)


class _Job:
    """A build job the host waits for: its ``future`` and how to ``submit`` it again. A job whose
    processes were lost (its pool killed for another job's timeout, or broken) is submitted once
    more (:meth:`CudaDevice._wait_job`): that loss is not its own failure."""

    def __init__(self, submit: Callable[[], cf.Future]):
        self.submit = submit
        self.future = submit()
        self.resubmitted = False


class _Batch:
    """A batch of ``(func, resources)`` kernels (:meth:`CudaDevice._submit_batches`): its ``job``
    (one build of all) and, once that failed, ``alone``: one job per kernel."""

    def __init__(self, chunk: Sequence[tuple], job: _Job):
        self.chunk, self.job = list(chunk), job
        self.alone: list | None = None


class _Member:
    """The build of kernel ``index`` of a :class:`_Batch`, as :meth:`CudaDevice._build_result`
    waits for it: its item of the batch's build or, when the batch failed, its own build."""

    def __init__(self, batch: _Batch, index: int):
        self.batch, self.index = batch, index


def _lost(err: BaseException) -> bool:
    """Whether a build ended because its processes were lost (cancelled, or its pool broken)
    rather than by its own failure."""
    return isinstance(err, (cf.CancelledError, BrokenProcessPool))


def _build_items(jobs: Sequence[KernelJob]) -> tuple:
    """What :meth:`CudaDevice.measure_kernels` builds for ``jobs``: ``(items, builds)``, the
    ``(func, resources)`` items in build order and, per job, ``(version item, reference item or
    None)``. Each operator's reference comes right before its versions (the runner's first
    (version, reference) pair waits for the fewest builds); one item per kernel key, so a version
    that is its operator's default kernel (``key == reference_key``) is built once for both, and
    with its resources (wanted for versions, not for references)."""
    items: list = []
    index: dict = {}  # kernel key -> its item

    def item(func, key, resources: bool) -> int:
        if key not in index:
            index[key] = len(items)
            items.append([func, resources])
        items[index[key]][1] |= resources
        return index[key]

    builds = []
    for job in jobs:
        ref = None if job.reference is None else item(job.reference, job.reference_key, False)
        builds.append((item(job.func, job.key, True), ref))
    return [tuple(i) for i in items], builds


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
    tolerance: the float32 tolerance of a version's outputs (:func:`tolerance_for` widens it for
        half precision).
    build_timeout_s, run_timeout_s: the longest wait for one build, one run job (a version and its
        reference checked and timed, or a persistent kernel's warm-up and timing); past it the job
        is a failure and its worker is killed.
    compile_source: compile every built module's CUDA source even where TVM keeps it uncompiled
        (a host without the NVIDIA driver), as a GPU host's build compiles it: to measure on a CPU
        what building costs on a GPU host (scripts/profile_cost.py); a GPU host compiles anyway.
    batch_size: the most kernels of :meth:`measure_kernels` built together (one TVM build, one
        link and one nvcc run per batch; the kernels of a batch that fails or times out are then
        built each as a job of its own).
    """

    def __init__(self, gpu: LocalGPU, target: tvm.target.Target, build_workers: int | None = None,
                 number: int = 20, repeat: int = 5, tolerance: float = KERNEL_TOLERANCE,
                 build_timeout_s: float = 600.0, run_timeout_s: float = 120.0,
                 batch_size: int = 8, compile_source: bool = False):
        self.id = gpu.id
        self._target_spec = target_spec(target)
        self._workers = max(1, min(build_workers or os.cpu_count() or 1, 16))
        self.number, self.repeat, self.tolerance = number, repeat, tolerance
        self.build_timeout_s, self.run_timeout_s = build_timeout_s, run_timeout_s
        self._dir = tempfile.mkdtemp(prefix="tvm_rammer_measure_")
        self._builder: cf.ProcessPoolExecutor | None = None
        self._runner: cf.ProcessPoolExecutor | None = None
        self._count = 0  # kernels submitted for building
        self.batches = 0  # build jobs (a batch of kernels each, or one persistent kernel)
        self.batch_size = batch_size
        self.compile_source = compile_source
        self._prebuilt: dict = {}  # id(func) -> (func, _Job): prebuild's builds, for time_kernel

    # processes
    def _build_pool(self) -> cf.ProcessPoolExecutor:
        if self._builder is None:
            self._builder = _spawn_pool(self._workers)
        return self._builder

    def version_workers(self) -> tuple:
        """``(pool, submit)`` for making operators' versions in the build processes
        (``tuning.version_pool``; they are idle until the versions exist to be built), or
        ``(None, None)`` with fewer than ``VERSION_WORKERS_FROM`` of them: on a small machine the
        workers' start, the trips and the main process's own share of the cores would take what
        the parallelism gives."""
        if self._workers < VERSION_WORKERS_FROM:
            return None, None
        return self._build_pool(), _submit

    def _run(self, fn, *args, deadline: float | None = None):
        """``fn(*args)`` in the runner process, within ``run_timeout_s`` (and before ``deadline``,
        a ``time.monotonic()`` time). Any failure (an exception, a crash, a dead CUDA context, a
        timeout) restarts the runner and raises: the job's own exception, RuntimeError ("timed
        out: ...", "run failed: ...") for a timeout or crash, :class:`BudgetSpent` past
        ``deadline`` (nothing is started after it)."""
        timeout, by_budget = _left(deadline, self.run_timeout_s)
        if self._runner is None:
            self._runner = _spawn_pool(1)
        try:
            return _submit(self._runner, fn, *args).result(timeout=timeout)
        except cf.TimeoutError:
            self._restart_runner()
            if by_budget:
                raise BudgetSpent("the profiling budget ran out during a run (runner killed)") from None
            raise RuntimeError(f"timed out: no result within {self.run_timeout_s:g} s (runner "
                               "killed and restarted)") from None
        except BrokenProcessPool:
            self._restart_runner()
            raise RuntimeError("run failed: the kernel crashed the GPU runner process "
                               "(restarted)") from None
        except Exception:
            self._restart_runner()  # the CUDA context may be dead (an illegal address): a fresh one
            raise

    def _restart_runner(self) -> None:
        _kill(self._runner)
        self._runner = None

    def _build_result(self, build, deadline: float | None = None) -> dict:
        """A build's result (a future, or a :class:`_Member` of a batch) within ``build_timeout_s``
        (and before ``deadline``); past it the build pool is killed (the next build starts a new
        one) and RuntimeError raised (BudgetSpent past ``deadline``: every build in flight is
        abandoned)."""
        if isinstance(build, _Member):
            return self._member_result(build, deadline)
        return self._wait(build, deadline)

    def _wait(self, future, deadline: float | None = None):
        """``future``'s result within ``build_timeout_s`` and before ``deadline`` (see
        :meth:`_build_result`)."""
        if future.done():  # built already: its result (or its error), the budget aside
            return future.result()
        try:
            timeout, by_budget = _left(deadline, self.build_timeout_s)
            return future.result(timeout=timeout)
        except (cf.TimeoutError, BudgetSpent) as err:
            _kill(self._builder)
            self._builder = None
            if isinstance(err, BudgetSpent) or by_budget:
                raise BudgetSpent("the profiling budget ran out during a build (build processes "
                                  "killed)") from None
            raise RuntimeError(f"timed out: the build took more than {self.build_timeout_s:g} s "
                               "(build processes killed)") from None

    def _wait_job(self, job: _Job, deadline: float | None = None):
        """:meth:`_wait` on ``job``; a job whose processes were lost (another build's timeout
        killed them) is submitted once more, unless past ``deadline`` (BudgetSpent)."""
        try:
            return self._wait(job.future, deadline)
        except Exception as err:  # pylint: disable=broad-except
            if not _lost(err) or job.resubmitted:
                raise
        _left(deadline, self.build_timeout_s)  # nothing new starts past the deadline
        job.future, job.resubmitted = job.submit(), True
        return self._wait(job.future, deadline)

    def _member_result(self, member: _Member, deadline: float | None = None) -> dict:
        """One kernel of a batch: its item of the batch's build; when the batch failed (an error,
        a timeout), its own build, each kernel of the batch a job of its own (with its own
        ``build_timeout_s``), so a kernel that breaks or hangs the batch's build costs only
        itself. A batch of one kernel is not built again: its failure is its own."""
        batch = member.batch
        if batch.alone is None:
            try:
                return self._wait_job(batch.job, deadline)[member.index]
            except BudgetSpent:
                raise
            except Exception as err:  # pylint: disable=broad-except
                if len(batch.chunk) == 1:
                    raise
                _left(deadline, self.build_timeout_s)  # nothing new starts past the deadline
                LOG.info("tvm-rammer: a batch of %d kernels did not build (%s): each is built "
                         "alone", len(batch.chunk), _first_line(err))
                batch.alone = [self._guarded_job(lambda f=f, r=r: self._submit_build(f, r))
                               for f, r in batch.chunk]
        return self._wait_job(batch.alone[member.index], deadline)

    def close(self) -> None:
        """Stop the worker processes without waiting for a running (possibly hung) job."""
        for pool in (self._builder, self._runner):
            _kill(pool)
        self._builder = self._runner = None
        self._prebuilt.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _submit_build(self, func: tirx.PrimFunc, resources: bool):
        self._count += 1
        self.batches += 1
        path = os.path.join(self._dir, f"k{self._count}.so")
        mod = tvm.IRModule({ENTRY: func.with_attr("global_symbol", ENTRY)})
        return _submit(self._build_pool(), _build_worker, tvm.ir.save_json(mod), self._target_spec,
                       path, resources, self.compile_source)

    # MeasureDevice
    def measure_kernels(self, jobs: Sequence[KernelJob], progress: Callable[[int], None],
                        within_s: float | None = None) -> list:
        deadline = deadline_in(within_s)
        if within_s is not None and within_s <= 0:
            return [None] * len(jobs)  # the budget is spent: not even a build starts
        items, builds = _build_items(jobs)
        members = self._submit_batches(items)
        records, spent = [], False
        for job, (build, ref) in zip(jobs, builds):
            if spent:  # the budget ran out: the rest of the batch is not measured
                records.append(None)
                continue
            try:
                record = self._measure_one(job, members[build],
                                           None if ref is None else members[ref], deadline)
            except BudgetSpent:
                _kill(self._builder)  # abandon the batch's builds in flight
                self._builder = None
                record, spent = None, True
            except Exception as err:  # pylint: disable=broad-except  (one job's failure is its own)
                LOG.warning("tvm-rammer: measuring %s failed: %s", job.label, _first_line(err))
                record = {"valid": False, "error": None, "reason": f"measure failed: {_first_line(err)}"}
            records.append(record)
            if record is not None:
                progress(1)
        return records

    def _submit_batches(self, items: Sequence[tuple]) -> list:
        """One :class:`_Member` per ``(func, resources)`` item, for :meth:`_build_result`. The
        items are built in batches (one TVM build, link and nvcc per batch: nvcc's start-up and
        headers are paid once per batch instead of once per kernel) of at most ``batch_size``
        kernels, and at least two batches per build process, so the runner can start on the
        first while the rest build."""
        size = max(1, min(self.batch_size, -(-len(items) // (2 * self._workers))))
        members = []
        for begin in range(0, len(items), size):
            chunk = items[begin:begin + size]
            batch = _Batch(chunk, self._guarded_job(lambda c=chunk: self._submit_batch(c)))
            members += [_Member(batch, i) for i in range(len(chunk))]
        return members

    def _guarded_job(self, submit: Callable[[], cf.Future]) -> _Job:
        """A :class:`_Job` of ``submit``: a build future, or a future holding the exception when it
        cannot even be submitted (serialisation, a broken pool: the next submit gets a new one)."""
        def guarded() -> cf.Future:
            try:
                return submit()
            except Exception as err:  # pylint: disable=broad-except
                failed: cf.Future = cf.Future()
                failed.set_exception(err)
                if isinstance(err, BrokenProcessPool):
                    self._builder = None
                return failed
        return _Job(guarded)

    def _submit_batch(self, chunk: Sequence[tuple]) -> cf.Future:
        self._count += len(chunk)
        self.batches += 1
        path = os.path.join(self._dir, f"b{self.batches}.so")
        names = [f"{ENTRY}_{i:04d}" for i in range(len(chunk))]
        mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, (f, _) in zip(names, chunk)})
        return _submit(self._build_pool(), _batch_build_worker, tvm.ir.save_json(mod),
                       self._target_spec, path, [n for n, (_, res) in zip(names, chunk) if res],
                       self.compile_source)

    def _measure_one(self, job: KernelJob, build, ref_build, deadline: float | None = None) -> dict | None:
        """One job's record; :class:`BudgetSpent` when ``deadline`` passes before it is measured."""
        try:
            info = self._build_result(build, deadline)
        except BudgetSpent:
            raise
        except Exception as err:  # pylint: disable=broad-except  (a version that does not build)
            LOG.info("tvm-rammer: %s does not build for the device: %s", job.label, _first_line(err))
            return {"valid": False, "error": None, "reason": f"build failed: {_first_line(err)}"}
        ref_path, ref_entry = None, ENTRY
        if ref_build is build:  # the version is its operator's default kernel: one build, one run
            ref_path, ref_entry = info["path"], info.get("entry", ENTRY)
        elif ref_build is not None:
            try:
                ref_info = self._build_result(ref_build, deadline)
                ref_path, ref_entry = ref_info["path"], ref_info.get("entry", ENTRY)
            except BudgetSpent:
                raise
            except Exception as err:  # pylint: disable=broad-except
                LOG.info("tvm-rammer: TVM's default kernel for %s does not build: %s", job.label,
                         _first_line(err))
        payload = {"path": info["path"], "entry": info.get("entry", ENTRY), "ref_path": ref_path,
                   "ref_entry": ref_entry, "specs": param_specs(job.func),
                   "num_outputs": job.num_outputs, "seed": 0, "tolerance": self.tolerance,
                   "number": self.number, "repeat": self.repeat}
        try:
            record = self._run(_run_kernel_worker, payload, deadline=deadline)
        except BudgetSpent:
            raise
        except Exception as err:  # pylint: disable=broad-except
            LOG.warning("tvm-rammer: %s failed on the device: %s", job.label, _first_line(err))
            reason = _first_line(err)
            timed_out = reason.startswith("RuntimeError: timed out")
            return {"valid": False, "error": None,
                    "reason": f"timed out: {reason}" if timed_out else f"run failed: {reason}"}
        record.update(registers=info.get("registers"), shared_bytes=info.get("shared_bytes"),
                      spills=info.get("spills"))
        if record.get("valid") is False:
            record["reason"] = (f"output differs from TVM's default kernel: relative error "
                                f"{record['error']:.2e} > {record.get('tolerance', self.tolerance):.0e}")
        return record

    def prebuild(self, func: tirx.PrimFunc) -> None:
        """Start building ``func`` (a persistent kernel :meth:`time_kernel` will be asked to time)
        in the build processes now, so that the kernels a choice compares build side by side;
        :meth:`time_kernel` of the same object waits for that build instead of starting one."""
        self._prebuilt[id(func)] = (func, self._guarded_job(lambda: self._submit_build(func, False)))

    def drop_prebuilt(self) -> None:
        """Forget the builds :meth:`prebuild` started that were not timed (those not running yet
        are cancelled): the compile asks no more (it ended, or starts again)."""
        for _, job in self._prebuilt.values():
            job.future.cancel()
        self._prebuilt.clear()

    def _quiet(self, deadline: float | None) -> None:
        """Wait for every started build (:meth:`prebuild`) to end, within ``deadline``, so that a
        timing runs on a host with no build running beside it (as without prebuilds); a build
        that fails or is lost is left to the timing that needs it."""
        for _, job in list(self._prebuilt.values()):
            try:
                self._wait(job.future, deadline)
            except BudgetSpent:
                raise
            except Exception:  # pylint: disable=broad-except  (its own timing sees it)
                pass

    def time_kernel(self, func: tirx.PrimFunc, fixed: dict,
                    within_s: float | None = None) -> float | None:
        deadline = deadline_in(within_s)
        started = self._prebuilt.pop(id(func), None)
        try:
            _left(deadline, self.build_timeout_s)  # spent: BudgetSpent before any build starts
            if started is not None and started[0] is func:
                path = self._wait_job(started[1], deadline)["path"]
            else:
                path = self._build_result(self._submit_build(func, False), deadline)["path"]
            self._quiet(deadline)
            return self._run(_time_kernel_worker, path, param_specs(func), fixed, self.number,
                             self.repeat, deadline=deadline)
        except BudgetSpent:
            raise
        except Exception as err:  # pylint: disable=broad-except
            LOG.warning("tvm-rammer: could not time %s on the device: %s",
                        (func.attrs or {}).get("global_symbol", "a kernel"), _first_line(err))
            return None
