"""The ``ios`` policy: IOS's stage partition (Ding et al., "IOS: Inter-Operator Scheduler for CNN
Acceleration", MLSys'21, section 4) placed with Rammer's rTask machinery.

IOS cuts the graph into *stages* run one after another; a stage's operators form *groups* (the
connected components of the stage: operators joined by an edge share a group), groups run
concurrently, a group's operators one after another. The last stage of an optimal schedule of a set
``S`` of operators is an *ending* of ``S`` (no edge leaves it towards the rest of ``S``), so

    cost[S] = min over endings E of S of  cost[S - E] + stage_latency(E),     cost[{}] = 0

memoised on ``S`` (IOS Algorithm 1). Pruning (IOS 4.3) keeps the endings with at most ``s`` groups of
at most ``r`` operators each (``PolicyConfig.ios_groups`` / ``ios_group_ops``; the paper's r = 3,
s = 8). :func:`ios_dp` is that programme for any stage cost; :func:`schedule` applies it with ours:

- ``stage_latency(E)`` (:func:`stage_cost`) is the larger of the stage's work (rTasks x rTask time,
  summed) spread over the vEUs its vEU shape gives and its longest chain (each operator
  ``ceil(rTasks / vEUs)`` rounds of its rTask time, ``barrier_us`` per edge inside the stage), plus
  ``barrier_us`` for the synchronisation that ends the stage: the two bounds SelectvEU's placement
  lies between. Each operator has its fastest rKernel (IOS chooses no kernels, cuDNN does; the most
  efficient one under ``selection="efficient"``), timed by the profile database where it has the
  rKernel and by the analytical model otherwise. IOS measures every candidate stage on the GPU;
  here that would be an nvcc build each, and even placing every candidate with SelectvEU costs
  milliseconds for the tens of thousands the programme visits, so the programme prices stages with
  this estimate; the final rPrograms are placed for real (SelectRKernels per stage, as Algorithm 1
  does per wave) and profiled as for every policy.
- Only IOS's "concurrent execution" strategy: its "operator merge" (several convolutions of one input
  fused into one wider kernel) is a kernel rewrite tvm-rammer does not make.
- Windows. IOS schedules a network block by block; here a window is a run of consecutive waves of
  several operators, bounded by single-operator waves (each a window of its own) and by
  ``graph.split_before``. A window whose programme would visit more than ``ios_budget`` (state,
  ending) pairs is cut into two halves (its waves, or a single wave's operators) solved one after the
  other, so the optimum is exact per window, not over the whole graph.
- The stages become the units of ``policy.schedule_units``: consecutive parts of one rProgram while
  Algorithm 1's merge rule keeps them together (``merge="never"``: one rProgram per stage, IOS's own
  stage-by-stage execution), with barrier-rTasks only on real dependencies. An operator of a later
  stage that does not depend on an earlier one may so start on a free vEU before that stage ends: the
  stage order is a placement order, not a grid-wide barrier.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping, Sequence

from ..policy import (OpGraph, PolicyConfig, Profile, RProgramPlan, _efficient_index, _fastest_index,
                      bfs_waves, schedule_units)
from ...abstractions.vdevice import VDevice

__all__ = ["OverBudget", "ios_dp", "ios_stages", "endings", "stage_cost", "schedule"]

MAX_WINDOW_OPS = 200  # deeper recursion than this is cut into windows (the programme recurses per stage)


class OverBudget(Exception):
    """The dynamic programme of a window visited more (state, ending) pairs than its budget."""


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _connected(mask: int, adj: Sequence[int]) -> bool:
    start = mask & -mask
    seen, todo = start, start
    while todo:
        low = todo & -todo
        todo ^= low
        new = adj[low.bit_length() - 1] & mask & ~seen
        seen |= new
        todo |= new
    return seen == mask


def _groups(remaining: int, succ: Sequence[int], adj: Sequence[int], max_ops: int) -> list[int]:
    """The candidate groups of an ending of ``remaining``: connected sets of at most ``max_ops``
    operators closed under successors within ``remaining``, as bit masks in increasing order.

    Every group of an ending is such a set (a successor of a group member inside ``remaining`` is in
    the ending and joined to the member by an edge), and disjoint ones are never adjacent, so the
    endings are exactly the unions of pairwise disjoint candidates. Grown one sink of the rest at a
    time over all successor-closed sets (connected or not), which reaches every one of them."""
    level = {1 << i for i in _bits(remaining) if not succ[i] & remaining}
    found = set(level)
    for _ in range(max_ops - 1):
        grown = set()
        for upset in level:
            rest = remaining & ~upset
            for i in _bits(rest):
                if not succ[i] & rest:
                    grown.add(upset | 1 << i)
        found |= grown
        level = grown
    return sorted(g for g in found if _connected(g, adj))


def endings(remaining: int, succ: Sequence[int], adj: Sequence[int], max_group_ops: int,
            max_groups: int) -> Iterator[int]:
    """Every ending of ``remaining`` (a bit mask over the window's operators) with at most
    ``max_groups`` groups of at most ``max_group_ops`` operators (IOS 4.3's pruning), each once."""
    groups = _groups(remaining, succ, adj, max_group_ops)

    def extend(start: int, used: int, count: int) -> Iterator[int]:
        for k in range(start, len(groups)):
            group = groups[k]
            if group & used:
                continue
            union = used | group
            yield union
            if count + 1 < max_groups:
                yield from extend(k + 1, union, count + 1)

    return extend(0, 0, 0)


def ios_dp(ops: Sequence[int], preds: Mapping[int, Sequence[int]],
           stage_cost: Callable[[tuple], float], max_group_ops: int = 3, max_groups: int = 8,
           budget: int | None = None) -> tuple[float, list[list[int]]]:
    """IOS's dynamic programme over ``ops`` (a topological order; predecessors outside ``ops`` are
    done before). Returns (the optimal total cost, its stages in execution order).

    ``stage_cost(stage)`` gets a stage's operators as a tuple in ``ops`` order. Raises
    :class:`OverBudget` once more than ``budget`` (state, ending) pairs were visited."""
    ops = list(ops)
    if len(set(ops)) != len(ops):
        raise ValueError("ios_dp: every operator may appear once in ops")
    index = {op: i for i, op in enumerate(ops)}
    succ = [0] * len(ops)
    pred = [0] * len(ops)
    for op in ops:
        for p in preds.get(op, ()):
            if p in index:
                if index[p] >= index[op]:
                    raise ValueError(f"ios_dp: op {p} precedes op {op}; pass ops in a topological order")
                succ[index[p]] |= 1 << index[op]
                pred[index[op]] |= 1 << index[p]
    adj = [s | p for s, p in zip(succ, pred)]
    latency: dict[int, float] = {}
    best: dict[int, tuple[float, int]] = {0: (0.0, 0)}
    visits = 0

    def stage(mask: int) -> float:
        if mask not in latency:
            cost = float(stage_cost(tuple(ops[i] for i in _bits(mask))))
            if not cost >= 0:
                raise ValueError(f"ios_dp: stage_cost returned {cost} for a stage; costs must be >= 0")
            latency[mask] = cost
        return latency[mask]

    def solve(remaining: int) -> float:
        nonlocal visits
        if remaining in best:
            return best[remaining][0]
        found = (math.inf, 0)
        for ending in endings(remaining, succ, adj, max_group_ops, max_groups):
            visits += 1
            if budget is not None and visits > budget:
                raise OverBudget(f"more than {budget} (state, ending) pairs")
            last = stage(ending)
            if last >= found[0]:
                continue
            total = solve(remaining & ~ending) + last
            if total < found[0]:
                found = (total, ending)
        best[remaining] = found
        return found[0]

    full = (1 << len(ops)) - 1
    total = solve(full)
    stages: list[list[int]] = []
    remaining = full
    while remaining:
        ending = best[remaining][1]
        stages.append([ops[i] for i in _bits(ending)])
        remaining &= ~ending
    return total, stages[::-1]


def _windows(graph: OpGraph) -> list[tuple[bool, list[list[int]]]]:
    """(starts a new segment, waves) of every window (module docstring), in order."""
    windows: list[tuple[bool, list[list[int]]]] = []
    run: list[list[int]] = []
    split = False

    def flush() -> None:
        nonlocal run, split
        if run:
            windows.append((split, run))
            run, split = [], False

    for index, wave in enumerate(graph.waves):
        if index in graph.split_before:
            flush()
            split = True
        if not wave:
            continue
        if len(wave) == 1:
            flush()
            run = [list(wave)]
            flush()
        else:
            run.append(list(wave))
    flush()
    return windows


def stage_cost(graph: OpGraph, vdevice: VDevice, config: PolicyConfig = PolicyConfig()
               ) -> Callable[[tuple], float]:
    """IOS's ``stage_latency`` on the vDevice (module docstring): a stage's operators (a tuple in a
    topological order) -> the larger of their work spread over the stage's vEUs and their longest
    chain, plus ``barrier_us``; infinity when they cannot share one vEU shape."""
    pick = _efficient_index if config.selection == "efficient" else _fastest_index
    kernel = {op: graph.ops[op].kernels[pick(graph.ops[op], vdevice, config)] for op in graph.ops}
    barrier = config.cost.barrier_us

    def stage_latency(stage: tuple) -> float:
        kernels = [kernel[op] for op in stage]
        try:
            veus = vdevice.num_sms * vdevice.occupancy(*vdevice.veu_shape(kernels, config.registers))
        except ValueError:
            return math.inf
        if config.max_veus is not None:
            veus = min(veus, config.max_veus)
        work = sum(k.num_rtasks * k.time_us for k in kernels) / veus
        finish: dict[int, float] = {}
        for op in stage:
            k = kernel[op]
            start = max((finish[p] + barrier for p in graph.preds_of(op) if p in finish), default=0.0)
            finish[op] = start + math.ceil(k.num_rtasks / veus) * k.time_us
        return max(work, max(finish.values())) + barrier

    return stage_latency


def ios_stages(graph: OpGraph, vdevice: VDevice, config: PolicyConfig = PolicyConfig()
               ) -> tuple[list[list[int]], set[int]]:
    """IOS's stages of ``graph`` (each in a placement order) and the stage indices where a segment of
    ``graph.split_before`` starts."""
    stage_latency = stage_cost(graph, vdevice, config)

    def solve(waves: list[list[int]]) -> list[list[int]]:
        ops = [op for wave in waves for op in wave]
        if len(ops) <= MAX_WINDOW_OPS:
            try:
                return ios_dp(ops, graph.preds, stage_latency, config.ios_group_ops,
                              config.ios_groups, config.ios_budget)[1]
            except OverBudget:
                pass
        if len(waves) > 1:
            half = len(waves) // 2
            return solve(waves[:half]) + solve(waves[half:])
        half = len(ops) // 2
        return solve([ops[:half]]) + solve([ops[half:]])

    stages: list[list[int]] = []
    splits: set[int] = set()
    for split, waves in _windows(graph):
        if split:
            splits.add(len(stages))
        for stage in solve(waves):
            stages.append([op for wave in bfs_waves(stage, graph.preds) for op in wave])
    return stages, splits


def schedule(graph: OpGraph, vdevice: VDevice, config: PolicyConfig = PolicyConfig(),
             profile: Profile | None = None) -> list[RProgramPlan]:
    """The ``ios`` policy: IOS's stages (:func:`ios_stages`) placed as the units of
    ``policy.schedule_units``."""
    stages, splits = ios_stages(graph, vdevice, config)
    return schedule_units(stages, graph, vdevice, config, profile, splits)
