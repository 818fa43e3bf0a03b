"""Whether an rProgram can beat TVM's default kernels when nothing is measured (RammerConfig.check_unmeasured).

Without measured times the back end keeps every operator on TVM's own dlight kernel
(``rkernels.operator_versions``), so an rProgram runs the *same kernels* as TVM's default pipeline,
only as rTasks on the rProgram's vEUs. It can win by the launches it saves and by running small
operators side by side; it loses where an operator's kernel would hold more thread blocks per SM as
an ordinary kernel than the rProgram has vEUs (a vEU is as wide as the widest rTask and its
registers are the largest body's: NASNet-CIFAR's 32,768-block convolutions, 256 threads at 18
registers, get 8 blocks per SM alone and 4 vEUs per SM in the rProgram) and where a block's fixed
latency, not its share of peak throughput, sets its time. The analytical cost model sees neither:
it times a block as its share of the device's peak. This module compares both sides in one model
that does:

- every thread block takes at least ``RammerConfig.block_us`` (a block's fixed latency: its loads
  issued and awaited, its ``__syncthreads``), else its analytical time;
- the rProgram: its own schedule replayed (``timeline.predict``) with each rTask at
  ``blocks x max(block time, block_us)`` plus the dispatch overhead, plus one launch;
- TVM's default: every operator one kernel, one launch each (``launch_us``), its blocks in rounds of
  as many blocks per SM as its threads and shared memory allow (registers not counted: the most the
  default could get), each block at the analytical time for that many co-resident blocks or
  ``block_us``.

Fed the shapes of the H200 run of 7f085df (``block_us`` = 1 us), this estimate puts NASNet-CIFAR,
SqueezeNet, AlexNet and ResNeXt-29 behind TVM's default and LSTM-TC and the 16-branch demo far ahead,
as measured (11,207 vs 6,663 us, 780 vs 500, 1,774 vs 1,307, 18,362 vs 13,451; 953 vs 40,158,
10.7 vs 85.9); the same classification for ``block_us`` from 0.5 to 2 us.
"""
from __future__ import annotations

import math

from . import timeline
from .rkernels import cost_config

__all__ = ["rprogram_estimate_us", "default_estimate_us", "check_plan"]


def _blocks(kernel) -> int:
    lowered = getattr(kernel, "payload", None)
    if lowered is not None and getattr(lowered, "num_rtasks", None):
        return int(lowered.num_rtasks)
    return int(kernel.num_rtasks) * int(kernel.blocks_per_rtask)


def _block_time(kernel, overhead: float) -> float:
    """Analytical time of one thread block of ``kernel`` at its rProgram vEU's share of the SM."""
    return max(0.0, (float(kernel.time_us) - overhead) / int(kernel.blocks_per_rtask))


def rprogram_estimate_us(plan, op_graph, vdevice, config) -> float:
    """The rProgram ``plan``'s time (us) with every block at least ``config.block_us``: its schedule
    replayed by ``timeline.predict``, plus one launch."""
    overhead = cost_config(config, vdevice).per_rtask_overhead_us
    num_veus = max((v + 1 for v, queue in enumerate(plan.program.prog) if queue), default=1)
    # a fresh description (its ops' dicts are the function's own): rtask_us is rewritten in place
    schedule = timeline.schedule_of(0, "estimate", plan, op_graph, num_veus, vdevice.num_sms, config)
    for op in plan.ops:
        kernel = op_graph.ops[op].kernels[plan.selected[op]]
        blocks = int(kernel.blocks_per_rtask)
        schedule["ops"][str(op)]["rtask_us"] = (
            blocks * max(_block_time(kernel, overhead), config.block_us) + overhead)
    return timeline.predict(schedule).end_us + config.launch_us


def default_estimate_us(plan, op_graph, vdevice, config) -> float:
    """The same operators as TVM's default kernels (module docstring), one launch each (us)."""
    overhead = cost_config(config, vdevice).per_rtask_overhead_us
    total = 0.0
    for op in plan.ops:
        kernel = op_graph.ops[op].kernels[plan.selected[op]]
        blocks = _blocks(kernel)
        per_sm = max(1, vdevice.occupancy(kernel.threads, 1, kernel.shared_bytes))
        rounds = math.ceil(blocks / (vdevice.num_sms * per_sm))
        sharing = max(1, min(per_sm, math.ceil(blocks / vdevice.num_sms)))  # blocks on one SM
        block = _block_time(kernel, overhead) * sharing / max(1, plan.veus_per_sm)
        total += rounds * max(block, config.block_us) + config.launch_us
    return total


def check_plan(plan, op_graph, vdevice, config) -> dict | None:
    """None when ``plan`` is estimated faster than its operators as TVM's default kernels, else the
    fallback record (kernel, operators, both estimates, reason) that leaves them ordinary kernels."""
    rammer_us = rprogram_estimate_us(plan, op_graph, vdevice, config)
    default_us = default_estimate_us(plan, op_graph, vdevice, config)
    if rammer_us < default_us:
        return None
    names = [op_graph.ops[op].name for op in plan.ops]
    return {"kernel": None, "operators": names, "rammer_us": rammer_us, "default_us": default_us,
            "source": "estimate",
            "reason": f"rProgram of {len(names)} operators estimated {rammer_us:.1f} us, not faster "
                      f"than TVM's default kernels ({default_us:.1f} us) with nothing measured "
                      "(tvm_rammer.scheduling.unmeasured_check): its operators stay TVM's default kernels; "
                      "profile on a GPU to decide on measured times"}
