"""rKernel versions validated on the CPU emulator (issue 23 item 4): the profiler's validation step
without a GPU.

:func:`check_versions` takes the profiler's :class:`~tvm_rammer.tuning.measure.KernelJob` s (one
rKernel version ``func`` of an operator and ``reference``, TVM's default kernel for the same
operator) and runs both on the emulator with the conventions of ``tuning.measure``: the inputs
seeded from ``seed`` (``numerics.seeded_array``), the version's float outputs pre-filled with NaN
(an output it never writes fails the check), the reference's with zeros, the relative error
(``numerics.relative_error``) compared with ``measure.tolerance_for`` of the outputs' dtypes.
One record per job::

    {"valid": True | False | None, "max_rel_err": float | None, "reason": str | None}

``valid`` None: the emulator could not check the version (it does not lower or build for the
emulator, its reference does not, or the job has no reference); ``reason`` says why. A version
that deadlocks or writes past the end of a buffer is ``valid: False`` (it would on a GPU too).
Emulation gives no time: nothing here is a measurement.

Cost: every version and reference of one call is lowered into ONE CUDA module (each PrimFunc
renamed ``rammer_emu_v<i>`` / ``rammer_emu_r<i>``, so their kernels are unique) and built with one
g++ run (cached by content, ``emulator.build``). When that joint build fails, an error that names
one of the functions (``rammer_emu_r5``: its host function cannot be read) drops that function
(its record says why) and the rest are built together again; an error that names none makes the
functions build one by one. Either way one bad version costs its own record only. g++ costs about 1-3 s even for a tiny
kernel, so one module per version would cost more than the runs (measured: see
``tests/test_emulated_versions.py`` and ``benchmarks/README.md``).

Buffers are allocated with a guard region after them filled with a sentinel; a launch that changes
a guard wrote past the end of its buffer (reported invalid instead of corrupting the process's
heap unnoticed).

:class:`EmulatedValidator` wraps :func:`check_versions` for the back end (``RammerConfig
.emulate_versions``, CLI ``--emulate`` on ``inspect``/``compile``): its records are keyed by
version key, and a version not ``valid: True`` is never used (``backend.collect_operators``).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import tvm
from tvm import tirx

from ...driver.backend import register_version_checker
from ...numerics import KERNEL_TOLERANCE, relative_error, seeded_array
from .errors import EmulatorError

__all__ = ["check_versions", "EmulatedValidator", "GUARD_BYTES"]

LOG = logging.getLogger("tvm_rammer")
GUARD_BYTES = 1 << 16  # sentinel bytes after every buffer (a write past the end changes them)
_SENTINEL = 0x5A
_VERSION, _REFERENCE = "rammer_emu_v", "rammer_emu_r"
_OUR_NAME = re.compile(r"\brammer_emu_[vr]\d+\b")  # a function named in an error message
_JOINT_RETRIES = 8  # joint builds tried, each without the functions the last error named


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def _specs(func: tirx.PrimFunc) -> list:
    """(name, shape, dtype) of every parameter (``tuning.measure.param_specs``)."""
    from ...tuning.measure import param_specs

    return param_specs(func)


@dataclass
class _Built:
    """Host functions (``launches.HostFunc``) by PrimFunc name and the module holding them."""

    hosts: dict
    module: object
    cuda_source: str
    target: object


def _lower(funcs: dict, target) -> tuple:
    """(hosts, CUDA source) of ``funcs`` (name -> PrimFunc) lowered together for ``target``."""
    from .compile import _lower_tir
    from .launches import host_functions

    mod = tvm.IRModule({name: func.with_attr("global_symbol", name) for name, func in funcs.items()})
    captured, source = _lower_tir(mod, target)
    return host_functions(captured), source


def _build(funcs: dict, target, opt) -> _Built:
    from .build import build_module

    hosts, source = _lower(funcs, target)
    return _Built(hosts, build_module(source, opt=opt), source, target)


def _guarded(array: np.ndarray) -> tuple:
    """(view with ``array``'s contents, backing bytes with a sentinel guard after it)."""
    backing = np.full(array.nbytes + GUARD_BYTES, _SENTINEL, dtype=np.uint8)
    view = backing[:array.nbytes].view(array.dtype).reshape(array.shape)
    view[...] = array
    return view, backing


def _run(built: _Built, name: str, arrays: list, wall_limit_s: float) -> list:
    """Launch PrimFunc ``name`` on copies of ``arrays``; returns the copies after the run.
    Raises EmulatorError (a deadlock too) or RuntimeError("wrote past the end of ...")."""
    from .compile import EmulationBuild
    from .interpret import Interpreter

    guarded = [_guarded(np.ascontiguousarray(a)) for a in arrays]
    shell = EmulationBuild(relax_mod=tvm.IRModule(), target=built.target, pipeline="versions",
                           hosts=built.hosts, cuda_source=built.cuda_source,
                           kernels=built.module.kernels, compile_seconds=0.0)
    # one PrimFunc's launches with buffers bound as Relax would bind them (interpret.Interpreter)
    Interpreter(shell, built.module, wall_limit_s=wall_limit_s)._launch(  # pylint: disable=protected-access
        name, [view for view, _ in guarded])
    host = built.hosts[name]
    for (view, backing), param in zip(guarded, host.params):
        if np.any(backing[view.nbytes:] != _SENTINEL):
            raise RuntimeError(f"wrote past the end of parameter {param.name}")
    return [view for view, _ in guarded]


def _inputs(specs: list, num_outputs: int, seed: int) -> tuple:
    """(inputs, version outputs, reference outputs) by ``tuning.measure``'s conventions."""
    first_out = len(specs) - num_outputs
    rng = np.random.default_rng(seed)
    inputs = [seeded_array(shape, dtype, rng) for _, shape, dtype in specs[:first_out]]
    out_rng = np.random.default_rng(1)
    version_out = [np.full(shape, np.nan, dtype=dtype) if dtype.startswith("float")
                   else seeded_array(shape, dtype, out_rng) for _, shape, dtype in specs[first_out:]]
    ref_out = [np.zeros(shape, dtype=dtype) for _, shape, dtype in specs[first_out:]]
    return inputs, version_out, ref_out


def _build_all(jobs, target, opt, joint: bool = True) -> tuple:
    """(built module or per-function builds, build failures by name, reference names, seconds,
    g++ builds); ``joint`` False builds every function alone (for comparison)."""
    funcs, ref_names = {}, {}
    for i, job in enumerate(jobs):
        funcs[f"{_VERSION}{i}"] = job.func
        if job.reference is not None and job.reference_key not in ref_names:
            ref_names[job.reference_key] = f"{_REFERENCE}{len(ref_names)}"
            funcs[ref_names[job.reference_key]] = job.reference
    start = time.perf_counter()
    tried, failures = 0, {}
    while joint and funcs and tried < _JOINT_RETRIES:
        tried += 1
        try:
            built = _build(funcs, target, opt)
            return ({name: built for name in funcs}, failures, ref_names,
                    time.perf_counter() - start, tried)
        except Exception as err:  # pylint: disable=broad-except  (isolate the function that fails)
            named = [n for n in dict.fromkeys(_OUR_NAME.findall(str(err))) if n in funcs]
            LOG.info("tvm-rammer: the joint emulator build of %d kernels failed (%s)%s", len(funcs),
                     _first_line(err), f"; again without {named}" if named else
                     "; building them one by one")
            if not named:  # the error does not say which function: each alone
                break
            for name in named:  # the error names the function: the others stay in one build
                failures[name] = _first_line(err)
                funcs = {k: v for k, v in funcs.items() if k != name}
    per = {}
    for name, func in funcs.items():
        try:
            per[name] = _build({name: func}, target, opt)
        except Exception as err:  # pylint: disable=broad-except
            failures[name] = _first_line(err)
    return per, failures, ref_names, time.perf_counter() - start, tried + len(funcs)


def check_versions(jobs: Sequence, target, *, seed: int = 0, tolerance: float = KERNEL_TOLERANCE,
                   opt: str | None = None, wall_limit_s: float = 120.0, stats: dict | None = None,
                   joint: bool = True) -> list:
    """One record per job (see the module docstring), in order.

    ``jobs``: ``tuning.measure.KernelJob`` s; ``target``: the CUDA target they are lowered for (the
    compile's); ``seed``: of the inputs; ``tolerance``: the float32 tolerance (half precision is
    widened by ``tuning.measure.tolerance_for``); ``opt``: g++ optimisation (``emulator.build``);
    ``wall_limit_s``: per launch. ``stats`` (a dict), when given, gets ``build_s`` (lowering and
    g++), ``gxx_builds``, ``gxx_s`` (g++ alone, 0 on a cache hit), ``run_s`` and ``kernels``.
    ``joint`` False: one g++ build per function (to measure what the joint module saves).
    Raises ValueError when there is no C++ compiler."""
    from ...tuning.measure import tolerance_for

    from .build import _compiler

    jobs = list(jobs)
    if not jobs:
        return []
    try:
        _compiler()  # none at all: one clear error, not every version "not checkable"
    except EmulatorError as err:
        raise ValueError(f"checking kernel versions on the emulator (--emulate, "
                         f"RammerConfig.emulate_versions): {err}") from None
    built, failures, ref_names, build_s, builds = _build_all(jobs, target, opt, joint)
    gxx = {id(b.module): b.module.build_seconds for b in built.values()}
    start = time.perf_counter()
    references: dict = {}  # reference key -> (outputs, or the failure reason)
    records = []
    for i, job in enumerate(jobs):
        vname = f"{_VERSION}{i}"
        rname = ref_names.get(job.reference_key) if job.reference is not None else None
        specs = _specs(job.func)
        inputs, version_out, ref_out = _inputs(specs, job.num_outputs, seed)
        if rname is None:
            records.append({"valid": None, "max_rel_err": None,
                            "reason": "no reference: TVM's default kernel for the operator is unknown"})
            continue
        if job.reference_key not in references:
            if rname in failures:
                references[job.reference_key] = f"TVM's default kernel does not build for the " \
                                                f"emulator: {failures[rname]}"
            else:
                try:
                    references[job.reference_key] = _run(built[rname], rname, inputs + ref_out,
                                                         wall_limit_s)[len(inputs):]
                except Exception as err:  # pylint: disable=broad-except
                    references[job.reference_key] = f"TVM's default kernel fails on the emulator: " \
                                                    f"{_first_line(err)}"
        want = references[job.reference_key]
        if isinstance(want, str):
            records.append({"valid": None, "max_rel_err": None, "reason": want})
            continue
        if vname in failures:
            records.append({"valid": None, "max_rel_err": None,
                            "reason": f"does not build for the emulator: {failures[vname]}"})
            continue
        try:
            got = _run(built[vname], vname, inputs + version_out, wall_limit_s)[len(inputs):]
        except EmulatorError as err:
            deadlock = type(err).__name__ == "EmulatorDeadlock"
            records.append({"valid": False if deadlock else None, "max_rel_err": None,
                            "reason": ("deadlocks on the emulator: " if deadlock else
                                       "fails on the emulator: ") + _first_line(err)})
            continue
        except RuntimeError as err:  # a write past the end of a buffer
            records.append({"valid": False, "max_rel_err": None, "reason": str(err)})
            continue
        error = max((relative_error(g, w) for g, w in zip(got, want)), default=0.0)
        limit = tolerance_for([d for _, _, d in specs[len(inputs):]], tolerance)
        valid = bool(error <= limit)
        records.append({"valid": valid, "max_rel_err": error if np.isfinite(error) else None,
                        "reason": None if valid else
                        (f"output differs from TVM's default kernel on the emulator: relative "
                         f"error {error:.2e} > {limit:.0e}")})
    if stats is not None:
        stats.update(build_s=round(build_s, 3), gxx_builds=builds, gxx_s=round(sum(gxx.values()), 3),
                     run_s=round(time.perf_counter() - start, 3), kernels=len(jobs) + len(ref_names))
    return records


@dataclass
class EmulatedValidator:
    """The back end's seam (``RammerConfig.emulate_versions``): :meth:`validate` checks jobs on the
    emulator and keeps each record by the version's key; ``stats`` accumulates
    :func:`check_versions`' figures of every call."""

    target: object
    seed: int = 0
    tolerance: float = KERNEL_TOLERANCE
    opt: str | None = None
    joint: bool = True
    records: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def validate(self, jobs: Sequence) -> dict:
        """``{job.key: record}`` for ``jobs`` (records of keys checked before are reused)."""
        todo = [job for job in jobs if job.key not in self.records]
        stats: dict = {}
        for job, record in zip(todo, check_versions(todo, self.target, seed=self.seed,
                                                    tolerance=self.tolerance, opt=self.opt,
                                                    stats=stats, joint=self.joint)):
            self.records[job.key] = record
        for k, v in stats.items():
            self.stats[k] = round(self.stats.get(k, 0) + v, 3)
        return {job.key: self.records[job.key] for job in jobs}


def _validator(target) -> EmulatedValidator:
    """The back end's check of rKernel versions (``RammerConfig.emulate_versions``): looked up
    here at each call, so that a script replacing :class:`EmulatedValidator` is heard."""
    return EmulatedValidator(target)


register_version_checker(_validator)
