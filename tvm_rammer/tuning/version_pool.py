"""Making operators' rKernel versions in worker processes, several operators at once.

A profiled compile makes every version of every operator (``versions.kernel_versions``: dlight
variants, templates, each prelowered) before it measures any: on reduced SqueezeNet 296 prelowered
versions, about as long as building and measuring them, in one Python thread. The operators are
independent, so this module makes them in a process pool (the measuring device's build processes
when it has them: a GPU host has 16 cores) and hands back the same :class:`~.versions.KernelVersion`
objects the main process would have made.

In: :class:`VersionRequest` per operator (its pipeline schedule, its unscheduled PrimFunc, the
rKernel target, whether TVM's default kernel is wanted as the reference). Out: per operator that a
worker made in time, a :class:`MadeVersions` (the versions, the reference or None); the caller
makes the others itself, as it would without workers. Each worker's answer is one ``save_json`` of
all the TIR objects of an operator, so the variables a lowered body shares with its parameters and
thread bindings stay shared after the trip; structural hashes (``func_key``) are unchanged.
"""
from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass

import tvm
from tvm import tirx

from tir_templates.prelower import LoweredKernel

from ..target import target_spec
from .versions import KernelVersion, VersionOptions, func_key, kernel_versions

__all__ = ["VersionRequest", "MadeVersions", "make_versions", "make_versions_in_pool"]


@dataclass(frozen=True)
class VersionRequest:
    """One operator's versions to make: ``kernel_versions(name, target, scheduled=scheduled,
    unscheduled=unscheduled, options=options)`` and, with ``reference_target``, TVM's default
    kernel of ``unscheduled`` for that (plain) target."""

    name: str
    target: tvm.target.Target
    scheduled: tirx.PrimFunc
    unscheduled: tirx.PrimFunc | None
    options: VersionOptions = VersionOptions()
    reference_target: tvm.target.Target | None = None


@dataclass(frozen=True)
class MadeVersions:
    """What a request made: its versions (``kernel_versions``' order) and the reference kernel
    (None when not asked or when TVM's default schedule does not apply) with its key."""

    versions: list
    reference: tirx.PrimFunc | None = None
    reference_key: str | None = None


def make_versions(request: VersionRequest) -> MadeVersions:
    """The request made in this process (what a worker runs)."""
    from tir_templates.default_schedule import schedule_like_default

    versions = kernel_versions(request.name, request.target, scheduled=request.scheduled,
                               unscheduled=request.unscheduled, options=request.options)
    reference = None
    if request.reference_target is not None and request.unscheduled is not None:
        reference = schedule_like_default(request.unscheduled, request.reference_target)
    return MadeVersions(versions, reference, func_key(reference) if reference is not None else None)


# --- the trip through a worker: plain data and one JSON of TIR objects per operator ---------------

def _spec(target: tvm.target.Target | None):
    return None if target is None else target_spec(target)


def _pack_request(request: VersionRequest) -> tuple:
    funcs = [request.scheduled] + ([request.unscheduled] if request.unscheduled is not None else [])
    return (request.name, _spec(request.target), tvm.ir.save_json(funcs), request.options,
            _spec(request.reference_target))


def _worker(name: str, target_spec: dict, funcs_json: str, options: VersionOptions,
            reference_spec: dict | None) -> dict:
    funcs = list(tvm.ir.load_json(funcs_json))
    request = VersionRequest(name, tvm.target.Target(target_spec), funcs[0],
                             funcs[1] if len(funcs) > 1 else None, options,
                             tvm.target.Target(reference_spec) if reference_spec else None)
    made = make_versions(request)
    objects, plain = [], []
    for v in made.versions:
        low = v.lowered
        objects.append([v.func, low.body, list(low.params), list(low.param_buffers),
                        list(low.block_vars.values()), list(low.thread_vars.values())])
        plain.append({"name": v.name, "source": v.source, "lowered_name": low.name,
                      "block_axes": list(low.block_vars), "thread_axes": list(low.thread_vars),
                      "grid": list(low.grid), "block": list(low.block),
                      "shared_bytes": low.shared_bytes, "has_sync": low.has_sync,
                      "volatile_shared": low.volatile_shared})
    reference = [made.reference] if made.reference is not None else []
    return {"json": tvm.ir.save_json([objects, reference]), "versions": plain,
            "reference_key": made.reference_key}


def _unpack(answer: dict) -> MadeVersions:
    objects, reference = tvm.ir.load_json(answer["json"])
    versions = []
    for (func, body, params, buffers, block_vars, thread_vars), p in zip(objects, answer["versions"]):
        lowered = LoweredKernel(p["lowered_name"], body, tuple(params), tuple(buffers),
                                dict(zip(p["block_axes"], block_vars)),
                                dict(zip(p["thread_axes"], thread_vars)),
                                tuple(p["grid"]), tuple(p["block"]), p["shared_bytes"],
                                p["has_sync"], p["volatile_shared"])
        versions.append(KernelVersion(p["name"], p["source"], func, lowered))
    ref = reference[0] if len(reference) else None
    return MadeVersions(versions, ref, answer["reference_key"])


def make_versions_in_pool(requests: list, pool: cf.Executor, submit=None,
                          within_s: float | None = 600.0) -> dict:
    """name -> :class:`MadeVersions` of every request a worker made within ``within_s`` seconds
    (None: no limit) of the call; the others are left out, for the caller to make in its own
    process as it would without workers (a request that raised in its worker, one not submitted
    because the pool broke, an answer past the deadline or one that does not load), so the pool
    can only make a compile faster, never change its result or its errors. ``submit(pool, fn,
    *args)`` submits (default ``pool.submit``; the measuring device passes its own, which starts
    workers with a clean ``__main__``)."""
    import time

    deadline = None if within_s is None else time.monotonic() + within_s
    submit = submit or (lambda p, fn, *args: p.submit(fn, *args))
    futures = {}
    for request in requests:
        try:
            futures[request.name] = submit(pool, _worker, *_pack_request(request))
        except Exception:  # pylint: disable=broad-except  (not submitted: the caller makes it)
            break
    found: dict = {}
    for name, future in futures.items():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            found[name] = _unpack(future.result(timeout=left))
        except Exception:  # pylint: disable=broad-except  (left out: the caller makes it)
            future.cancel()
    return found
