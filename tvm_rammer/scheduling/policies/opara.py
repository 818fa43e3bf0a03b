"""The ``opara`` policy: Opara's resource- and interference-aware launch order (Chen et al., "Opara:
Exploiting Operator Parallelism for Expediting DNN Inference on GPUs", 2023, section 3.3, Algorithm 2)
placed with Rammer's rTask machinery.

Opara keeps two lists of operators whose predecessors have all been launched, one of memory-intensive
and one of compute-intensive ones, takes from the two lists in turn (skipping an empty one), each
time the operator that needs the fewest GPU resources, and launches it; its successors join the
lists as they become ready. The launch order so interleaves compute- and memory-bound operators
among those that can run in parallel, small ones first, so that big ones do not block them.

How this maps here:

- Memory- or compute-intensive (:func:`is_compute_intensive`): Opara reads an offline table of
  operator types; here an operator is compute-intensive when its arithmetic intensity
  ``ROperator.flops / ROperator.bytes`` reaches the device's balance point (peak FLOP/s over memory
  bandwidth of the cost model, 20 FLOP/byte on an H100's defaults); without FLOPs or bytes it
  counts as memory-intensive.
- GPU resources (:func:`resource_demand`): Opara profiles a block's threads, registers and shared
  memory; here it is the share of the device the operator's rTasks occupy at once: rTasks x the
  largest fraction of an SM's threads, registers or shared memory one rTask takes, over the SMs
  (its fastest rKernel, with the registers ptxas measured when the profile has them).
- The launch order (:func:`launch_order`) is computed per segment of ``graph.split_before``, then cut
  into units, the longest runs of consecutive operators of which none depends on another, and these
  are placed with ``policy.schedule_units`` (SelectRKernels, SelectvEU and the merge rule of
  Algorithm 1) in that order: an operator's rTasks take the vEUs where they start first, after
  every operator launched before it.
"""
from __future__ import annotations

from typing import Sequence

from ..policy import OpGraph, PolicyConfig, Profile, RProgramPlan, _fastest_index, schedule_units
from ...abstractions.rtask import ROperator
from ...abstractions.vdevice import VDevice

__all__ = ["is_compute_intensive", "resource_demand", "launch_order", "opara_units", "schedule"]


def is_compute_intensive(op: ROperator, config: PolicyConfig = PolicyConfig()) -> bool:
    """Whether ``op`` is compute-bound on the cost model's device (module docstring)."""
    if not op.flops or not op.bytes:
        return False
    balance = config.cost.peak_tflops_fp32 * 1e12 / (config.cost.mem_bw_gbps * 1e9)
    return op.flops / op.bytes >= balance


def resource_demand(op: ROperator, vdevice: VDevice, config: PolicyConfig = PolicyConfig()) -> float:
    """Share of the device the rTasks of ``op``'s fastest rKernel occupy (module docstring); 1.0
    is every thread, register or byte of shared memory of every SM."""
    kernel = op.kernels[_fastest_index(op, vdevice, config)]
    registers = config.registers or kernel.registers or vdevice.default_registers
    per_rtask = max(kernel.threads / vdevice.max_threads_per_sm,
                    kernel.threads * registers / vdevice.regs_per_sm,
                    kernel.shared_bytes / vdevice.smem_per_sm)
    return kernel.num_rtasks * per_rtask / vdevice.num_sms


def launch_order(graph: OpGraph, ops: Sequence[int], vdevice: VDevice,
                 config: PolicyConfig = PolicyConfig()) -> list[int]:
    """Opara's Algorithm 2 over ``ops`` (predecessors outside ``ops`` count as launched): memory- and
    compute-intensive ready operators in turn, memory-intensive first, the least demanding of the
    list each time (ties: the earlier in ``ops``)."""
    position = {op: k for k, op in enumerate(ops)}
    missing = {op: sum(1 for p in set(graph.preds_of(op)) if p in position) for op in ops}
    succs: dict[int, list[int]] = {op: [] for op in ops}
    for op in ops:
        for p in set(graph.preds_of(op)):
            if p in position:
                succs[p].append(op)
    key = {op: (resource_demand(graph.ops[op], vdevice, config), position[op]) for op in ops}
    compute = {op: is_compute_intensive(graph.ops[op], config) for op in ops}
    ready: dict[bool, list[int]] = {False: [], True: []}  # by is_compute_intensive
    for op in ops:
        if not missing[op]:
            ready[compute[op]].append(op)
    order: list[int] = []
    turn = False  # memory-intensive first
    while ready[False] or ready[True]:
        if not ready[turn]:
            turn = not turn
        pick = min(ready[turn], key=key.__getitem__)
        ready[turn].remove(pick)
        order.append(pick)
        for succ in succs[pick]:
            missing[succ] -= 1
            if not missing[succ]:
                ready[compute[succ]].append(succ)
        turn = not turn
    if len(order) != len(ops):
        raise ValueError("launch_order: the predecessors of ops form a cycle; an operator graph is a DAG")
    return order


def _segments(graph: OpGraph) -> list[list[int]]:
    segments: list[list[int]] = []
    for index, wave in enumerate(graph.waves):
        if index == 0 or index in graph.split_before:
            segments.append([])
        segments[-1].extend(wave)
    return [s for s in segments if s]


def opara_units(graph: OpGraph, vdevice: VDevice, config: PolicyConfig = PolicyConfig()
                ) -> tuple[list[list[int]], set[int]]:
    """The launch order cut into units of mutually independent consecutive operators, and the unit
    indices where a segment of ``graph.split_before`` starts."""
    units: list[list[int]] = []
    splits: set[int] = set()
    for segment in _segments(graph):
        splits.add(len(units))
        current: list[int] = []
        members: set[int] = set()
        for op in launch_order(graph, segment, vdevice, config):
            if members.intersection(graph.preds_of(op)):
                units.append(current)
                current, members = [], set()
            current.append(op)
            members.add(op)
        if current:
            units.append(current)
    splits.discard(0)
    return units, splits


def schedule(graph: OpGraph, vdevice: VDevice, config: PolicyConfig = PolicyConfig(),
             profile: Profile | None = None) -> list[RProgramPlan]:
    """The ``opara`` policy: Opara's launch order (:func:`launch_order`) placed as the units of
    ``policy.schedule_units``."""
    units, splits = opara_units(graph, vdevice, config)
    return schedule_units(units, graph, vdevice, config, profile, splits)
