"""MetaSchedule tuning of a model's operators, for more (and faster) rKernel versions.

``tune(model, target, trials, work_dir)`` imports the model, runs the rammer pipeline up to (not
including) dlight, so the tuned workloads are exactly the unscheduled PrimFuncs that
``versions.StashUnscheduled`` keeps, extracts one MetaSchedule task per distinct PrimFunc and tunes
them (``ms.tune.tune_tasks``) into a JSON database in ``work_dir``. The tasks are tuned for the
rKernel target (``tvm_rammer.target.rkernel_target``: threads per block capped at
``max_rtask_threads``), so a tuned record never widens the vEUs, and with ``precision="float16"`` the
pipeline prefix includes ``ToMixedPrecision``: the float16 operators are tuned. ``versions.kernel_versions`` then
turns the best distinct schedules of each operator into rKernel versions (``--tuning-db DIR``).

MetaSchedule measures every candidate on a GPU: either the local one or, with ``rpc``, the devices of
an RPC tracker. Without either :func:`tune` fails at once with :data:`NO_DEVICE` instead of
searching for hours with nothing to measure on.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import tvm

from ..config import RammerConfig
from ..host.gpu import local_gpu

__all__ = ["RPCTracker", "NO_DEVICE", "pre_schedule_module", "extract_tasks", "tune"]

LOG = logging.getLogger("tvm_rammer")
NO_DEVICE = ("tvm-rammer tune needs a CUDA GPU to measure the candidate schedules on, and none is "
             "visible; run it on a GPU machine or pass --rpc-tracker HOST:PORT --rpc-key KEY")


@dataclass(frozen=True)
class RPCTracker:
    """An RPC tracker whose devices (registered under ``key``) measure the candidates."""

    host: str
    port: int
    key: str

    @classmethod
    def parse(cls, address: str, key: str | None) -> "RPCTracker":
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--rpc-tracker {address!r}: use HOST:PORT, e.g. 127.0.0.1:9190")
        if not key:
            raise ValueError("--rpc-tracker needs --rpc-key KEY (the key the devices registered with)")
        return cls(host, int(port), key)


def pre_schedule_module(mod: tvm.IRModule, target: tvm.target.Target, config: RammerConfig) -> tvm.IRModule:
    """``mod`` through the rammer pipeline's passes before dlight (the unscheduled PrimFuncs)."""
    from ..driver.pipeline import rammer_passes

    passes = []
    for pass_ in rammer_passes(target, config):
        name = pass_.info.name
        if "ApplyDefaultSchedule" in name or name == "StashUnscheduled":
            break
        passes.append(pass_)
    with target:
        return tvm.transform.Sequential(passes)(mod)


def extract_tasks(mod: tvm.IRModule, target: tvm.target.Target, config: RammerConfig) -> list:
    """One MetaSchedule task per distinct unscheduled PrimFunc of the rammer pipeline, each for the
    rKernel target (threads per block capped at ``config.max_rtask_threads``)."""
    from tvm.s_tir import meta_schedule as ms

    from ..target import rkernel_target

    return ms.relax_integration.extract_tasks(pre_schedule_module(mod, target, config),
                                              rkernel_target(target, config))


def _builder_runner(rpc: RPCTracker | None):
    from tvm.s_tir import meta_schedule as ms

    if rpc is None:
        return "local", "local"
    config = ms.runner.RPCConfig(tracker_host=rpc.host, tracker_port=rpc.port, tracker_key=rpc.key,
                                 session_timeout_sec=60)
    return ms.builder.LocalBuilder(), ms.runner.RPCRunner(rpc_config=config)


def tune(model, target, trials: int, work_dir: str, rpc: RPCTracker | None = None,
         config: RammerConfig | None = None, progress=print):
    """Tune every operator of ``model`` (ONNX path/ModelProto or Relax module) with MetaSchedule.

    ``trials`` is the global trial budget (shared by the tasks by weight). Writes and returns the JSON
    database in ``work_dir``. Raises ValueError(:data:`NO_DEVICE`) without a GPU or ``rpc``.
    """
    from tvm.s_tir import meta_schedule as ms

    from ..driver.frontend import import_onnx
    from ..target import resolve_target

    if trials < 1:
        raise ValueError(f"--trials {trials}: give at least 1 trial")
    if rpc is None and local_gpu() is None:
        raise ValueError(NO_DEVICE)
    config = config or RammerConfig()
    target = resolve_target(target)
    mod = model if isinstance(model, tvm.IRModule) else import_onnx(model)
    tasks = extract_tasks(mod, target, config)
    if not tasks:
        raise ValueError("the model has no operator MetaSchedule can tune")
    progress(f"tvm-rammer tune: {len(tasks)} tasks, {trials} trials, database in {work_dir}")
    for k, task in enumerate(tasks):
        progress(f"  task {k + 1}/{len(tasks)}: {task.task_name} (weight {task.weight})")
    os.makedirs(work_dir, exist_ok=True)
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, work_dir)
    builder, runner = _builder_runner(rpc)
    database = ms.tune.tune_tasks(tasks=contexts, task_weights=weights, work_dir=work_dir,
                                  max_trials_global=trials, builder=builder, runner=runner)
    progress(f"tvm-rammer tune: done; {len(database)} records in {work_dir} (use --tuning-db {work_dir})")
    return database
