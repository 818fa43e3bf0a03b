"""Wavefront scheduling policy: Algorithm 1 of Rammer (OSDI'20, section 3.3).

Pure: an :class:`OpGraph` (rOperators, their predecessors, BFS waves) and a :class:`VDevice` in,
a list of :class:`RProgramPlan` (one per rProgram, each with its per-vEU queues) out.

    Schedule(G, D):                          -> schedule()
        for each wave W:
            P1 = ScheduleWave(W, Pcurr, D)     merge W into the current rProgram
            P2 = ScheduleWave(W, {}, D)        W alone in a new rProgram
            keep P1 if time(P1) <= time(Pcurr) + time(P2), else close Pcurr and go on with P2
    ScheduleWave(W, P, D):                   -> schedule_wave()
        SelectRKernels(W, P)                   -> select_rkernels()
        for op in W, for r in op.rTasks: Append(r, SelectvEU(op, P, D)) after Wait(r, preds' rTasks)

Choices this implementation makes where the paper leaves them open:

- time(P) is analytical unless a ``profile`` callable returns a measured time: the makespan of a
  per-vEU timeline (each rTask takes its rKernel's ``time_us``; an rTask whose operator has
  predecessors in the same rProgram starts after they all finish plus ``barrier_us``) plus
  ``launch_us`` per rProgram and ``grid_sync_us`` when it has barriers. So P1 against Pcurr + P2 weighs
  the barriers of a merge against the launch of one more kernel.
- SelectvEU picks the vEU where the rTask can start first, ties broken by the lowest vEU index.
- vEUs are sized by the widest selected rTask (paper 4.1.2), so adding a wave may lower the vEUs per
  SM; the plan is then rebuilt from its operators with the new vEU count.
- A wave whose rKernels cannot share one vEU shape (e.g. 1024 threads in one, 255 registers in
  another) is cut into chunks that can, each scheduled like a wave.
- An operator whose dependency would add more than ``max_waits_per_op`` barrier wait entries
  (all-to-all between many vEUs) is not merged: it starts a new rProgram.
- ``graph.split_before`` holds wave indices where an rProgram must start anew (an operator that cannot
  become rTasks runs there, between two rPrograms).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from .cost_model import CostModelConfig
from ..abstractions.rprogram import RProgram
from ..abstractions.rtask import RKernel, ROperator, RTask
from ..abstractions.vdevice import VDevice

__all__ = [
    "OpGraph",
    "PolicyConfig",
    "PartialPlan",
    "RProgramPlan",
    "schedule",
    "schedule_units",
    "bfs_waves",
    "schedule_wave",
    "select_rkernels",
    "select_veus",
    "materialize",
    "plan_time",
    "replace_cost",
]

Profile = Callable[["RProgramPlan"], "float | None"]
_SELECTIONS = ("paper", "fastest", "efficient")
_MERGES = ("paper", "always", "never")


@dataclass
class OpGraph:
    """The rOperator dataflow graph as the policy sees it.

    Attributes:
        ops: uid -> rOperator (only operators that can become rTasks).
        preds: uid -> predecessor uids; predecessors outside ``ops`` are ignored (``split_before``
            must separate them).
        waves: BFS fronts of op uids, in execution order; every op of ``ops`` in exactly one wave.
        split_before: indices of waves before which an rProgram must end.
    """

    ops: dict[int, ROperator]
    preds: dict[int, list[int]]
    waves: list[list[int]]
    split_before: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        for uid, op in self.ops.items():
            if op.uid != uid:
                raise ValueError(f"OpGraph.ops[{uid}] holds ROperator uid {op.uid}; key it by its uid")
        wave_of: dict[int, int] = {}
        for index, wave in enumerate(self.waves):
            for uid in wave:
                if uid not in self.ops:
                    raise ValueError(f"wave {index} names op {uid}, which is not in OpGraph.ops")
                if uid in wave_of:
                    raise ValueError(f"op {uid} is in waves {wave_of[uid]} and {index}; put it in exactly one")
                wave_of[uid] = index
        unplaced = sorted(set(self.ops) - set(wave_of))
        if unplaced:
            raise ValueError(f"ops {unplaced[:10]} are in no wave; every op of OpGraph.ops needs one")
        for uid, preds in self.preds.items():
            for pred in preds:
                if pred in wave_of and uid in wave_of and wave_of[pred] >= wave_of[uid]:
                    raise ValueError(
                        f"op {uid} (wave {wave_of[uid]}) depends on op {pred} (wave {wave_of[pred]}); "
                        "a predecessor must sit in an earlier wave"
                    )

    def preds_of(self, uid: int) -> list[int]:
        return list(self.preds.get(uid, ()))


@dataclass(frozen=True)
class PolicyConfig:
    """Options of the policy.

    Attributes:
        cost: fixed costs and throughput of the analytical model.
        max_veus: cap on vEUs per rProgram (None: every vEU the occupancy allows).
        registers: register count of the persistent kernel when known (None: the rKernels' own).
        max_waits_per_op: most barrier wait entries one operator may add to an rProgram, bounded by
            (vEUs its rTasks run on) x (vEUs its predecessors' rTasks ran on); a merge needing more
            starts a new rProgram instead (the kernel boundary is the all-to-all barrier), which keeps
            the rProgram table small. None: no limit.
        selection: "paper" (SelectRKernels), "fastest" or "efficient" (always that version).
        merge: "paper" (P1 vs Pcurr + P2), "always" (one rProgram per split) or "never" (one per wave).
        ios_group_ops, ios_groups: the ``ios`` policy's pruning (IOS, MLSys'21, 4.3): a stage has at
            most ``ios_groups`` groups (the paper's s; 8 in its experiments) of at most
            ``ios_group_ops`` operators each (the paper's r; 3).
        ios_budget: most (state, ending) transitions the ``ios`` policy's dynamic programme may
            visit in one window before the window is cut in two (``tvm_rammer.scheduling.policies.ios``).
        profile_margin: a choice between two plans asks ``profile`` for their times only when
            their analytical times are within this factor of each other (a clear choice is made
            analytically: measuring it could not change it). None: always ask.
        prefetch_lookahead: how many barrier-rTasks back an rTask's weight prefetch may be issued
            (``codegen.persistent.encode_program``'s rule, the same number): 1, at the barrier right
            before it; n, at the earliest of the last n barriers on its vEU since that vEU last
            ran an operator that prefetches. The rTask is then also credited the waits at those
            earlier barriers (:func:`select_veus`'s ``credit_us``): only the waits, never the
            rTasks run in between, which may be using DRAM themselves; and only barrier-rTasks
            :func:`materialize`'s RProgram keeps (a wait it drops is no barrier: ``_Barriers``).
    """

    cost: CostModelConfig = CostModelConfig()
    max_veus: int | None = None
    registers: int | None = None
    max_waits_per_op: int | None = 1 << 16
    selection: Literal["paper", "fastest", "efficient"] = "paper"
    merge: Literal["paper", "always", "never"] = "paper"
    ios_group_ops: int = 3
    ios_groups: int = 8
    ios_budget: int = 20000
    profile_margin: float | None = None
    prefetch_lookahead: int = 1

    def __post_init__(self) -> None:
        if self.selection not in _SELECTIONS:
            raise ValueError(f"PolicyConfig.selection={self.selection!r}; use one of {_SELECTIONS}")
        if self.merge not in _MERGES:
            raise ValueError(f"PolicyConfig.merge={self.merge!r}; use one of {_MERGES}")
        if self.max_veus is not None and (not isinstance(self.max_veus, int) or self.max_veus < 1):
            raise ValueError(f"PolicyConfig.max_veus={self.max_veus!r}; use None or an int >= 1")
        if self.max_waits_per_op is not None and (not isinstance(self.max_waits_per_op, int) or self.max_waits_per_op < 1):
            raise ValueError(f"PolicyConfig.max_waits_per_op={self.max_waits_per_op!r}; use None or an int >= 1")
        for name in ("ios_group_ops", "ios_groups", "ios_budget", "prefetch_lookahead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PolicyConfig.{name}={value!r}; use an int >= 1")
        if self.profile_margin is not None and not self.profile_margin >= 1:
            raise ValueError(f"PolicyConfig.profile_margin={self.profile_margin!r}; use None or a "
                             "factor >= 1")
        if not isinstance(self.cost, CostModelConfig):
            raise TypeError(f"PolicyConfig.cost must be a CostModelConfig, got {type(self.cost).__name__}")


@dataclass(frozen=True)
class PartialPlan:
    """An rProgram under construction: its waves, selected rKernels and per-vEU timeline.

    Immutable: :func:`schedule_wave` returns a new plan, so P1 can be tried without touching Pcurr.
    ``veu_of[op][rtask_id]`` is the vEU of each rTask, in the order the rTasks are appended.
    """

    waves: tuple[tuple[int, ...], ...]
    selected: Mapping[int, int]
    reason: Mapping[int, str]
    veus_per_sm: int
    num_veus: int
    free: tuple[float, ...]
    op_finish: Mapping[int, float]
    veu_of: Mapping[int, tuple[int, ...]]
    has_waits: bool
    shape: tuple[int, int, int] = (0, 0, 0)  # (threads, registers, shared bytes) the vEU is sized for
    # per vEU: its waits (us) at the barrier-rTasks since it last ran a prefetching operator, the
    # last ``prefetch_lookahead - 1`` of them (empty: none yet / no lookahead)
    waits: tuple[tuple[float, ...], ...] = ()
    # with a lookahead: which of an operator's waits :func:`materialize`'s RProgram keeps (a wait
    # on the vEU itself, or one a vEU's earlier barrier covers, is dropped: no barrier-rTask, no
    # prefetch, no credit), :class:`_Barriers`
    barriers: "_Barriers | None" = None

    @property
    def ops(self) -> list[int]:
        return [op for wave in self.waves for op in wave]

    @property
    def makespan_us(self) -> float:
        return max(self.free, default=0.0)

    def analytic_time_us(self, cost: CostModelConfig) -> float:
        """Makespan plus one launch, plus the grid sync of the step array when the plan has waits."""
        return self.makespan_us + cost.launch_us + (cost.grid_sync_us if self.has_waits else 0.0)


@dataclass
class RProgramPlan:
    """One rProgram of the schedule.

    Attributes:
        program: the per-vEU queues.
        ops: operator uids in the rProgram, in wave order.
        selected: op uid -> index of its selected rKernel.
        reason: op uid -> "fastest", "efficient" or "only" (a single rKernel).
        veus_per_sm, num_veus: the vDevice shape (vEUs sized by the widest selected rTask).
        predicted_us: profiled time when ``profiled``, else the analytical time.
        waves: the waves (or wave chunks) merged into this rProgram.
        op_finish: op uid -> when its last rTask ends in the policy's analytical timeline (us from
            the rProgram's start; ``critical_path.last_chain`` reads it).
    """

    program: RProgram
    ops: list[int]
    selected: dict[int, int]
    reason: dict[int, str]
    veus_per_sm: int
    num_veus: int
    predicted_us: float
    profiled: bool = False
    waves: list[list[int]] = field(default_factory=list)
    op_finish: dict[int, float] = field(default_factory=dict)

    def kernels(self, graph: OpGraph) -> dict[int, RKernel]:
        """op uid -> selected rKernel."""
        return {op: graph.ops[op].kernels[index] for op, index in self.selected.items()}

    def to_dict(self) -> dict:
        return {
            "ops": list(self.ops),
            "waves": [list(w) for w in self.waves],
            "selected": {str(k): v for k, v in self.selected.items()},
            "reason": {str(k): v for k, v in self.reason.items()},
            "veus_per_sm": self.veus_per_sm,
            "num_veus": self.num_veus,
            "predicted_us": self.predicted_us,
            "profiled": self.profiled,
            "program": self.program.to_dict(),
        }


def _veu_count(kernels: Sequence[RKernel], vdevice: VDevice, config: PolicyConfig) -> tuple[int, int]:
    """(vEUs per SM, vEUs) for a vEU sized for ``kernels``; raises ValueError when it does not fit."""
    per_sm = vdevice.veus_per_sm(kernels, config.registers)
    total = vdevice.num_sms * per_sm
    return per_sm, total if config.max_veus is None else min(total, config.max_veus)


def _fitting(op: ROperator, vdevice: VDevice, config: PolicyConfig) -> list[int]:
    indices = [i for i, k in enumerate(op.kernels) if vdevice.fits([k], config.registers)]
    if not indices:
        raise ValueError(
            f"no rKernel of op {op.uid} ({op.name}) fits on one SM of {vdevice}; leave the op out of the "
            "OpGraph (and split there) or give it a smaller rKernel"
        )
    return indices


def _fastest_index(op: ROperator, vdevice: VDevice, config: PolicyConfig) -> int:
    def alone(i: int) -> float:
        kernel = op.kernels[i]
        return math.ceil(kernel.num_rtasks / _veu_count([kernel], vdevice, config)[1]) * kernel.time_us

    return min(_fitting(op, vdevice, config), key=lambda i: (alone(i), i))


def _efficient_index(op: ROperator, vdevice: VDevice, config: PolicyConfig) -> int:
    return min(_fitting(op, vdevice, config), key=lambda i: (op.kernels[i].work_us, i))


def select_veus(free: list[float], ready: float, count: int, time_us: float,
                overlap_us: float = 0.0, credit_us: Sequence[float] | None = None) -> list[int]:
    """SelectvEU for ``count`` rTasks of one operator (paper 3.3): each goes to the vEU where it can start
    first, ``max(free[v], ready)``, ties broken by the lowest vEU index. Updates ``free`` in place.

    ``overlap_us`` (``RKernel.prefetch_us`` of an operator that waits at a barrier-rTask): the
    first rTask on each vEU, the one after the barrier, has its weights prefetched from the
    moment the vEU reaches the barrier (``free[v]``), so it ends at
    ``max(start, free[v] + overlap_us) + time_us - overlap_us`` (``cost_model``'s docstring).
    ``credit_us[v]``: the part of that read done already during vEU ``v``'s waits at earlier
    barrier-rTasks, where the prefetch was issued (``PolicyConfig.prefetch_lookahead``): it ends
    at ``max(start, free[v] + max(0, overlap_us - credit_us[v])) + time_us - overlap_us``."""
    if overlap_us > 0:
        return _select_overlapping(free, ready, count, time_us, overlap_us, credit_us)
    num = len(free)
    chosen: list[int] = []
    if all(f <= ready for f in free):
        for i in range(count):
            veu = i % num
            chosen.append(veu)
            free[veu] = ready + (i // num + 1) * time_us
        return chosen
    starts = np.maximum(np.asarray(free, dtype=np.float64), ready)
    order = np.argsort(starts, kind="stable")  # by start, ties by the lowest vEU
    if count <= num and starts[order[count - 1]] < starts[order[0]] + time_us:
        # every rTask starts before the first one ends: the heap below would take the count
        # earliest vEUs in this order, each once
        chosen = order[:count].tolist()
        for veu in chosen:
            free[veu] = float(starts[veu]) + time_us
        return chosen
    heap = [(float(starts[v]), v) for v in range(num)]
    heapq.heapify(heap)
    for _ in range(count):
        start, veu = heapq.heappop(heap)
        end = start + time_us
        free[veu] = end
        chosen.append(veu)
        heapq.heappush(heap, (end, veu))
    return chosen


def _select_overlapping(free: list[float], ready: float, count: int, time_us: float,
                        overlap_us: float, credit_us: Sequence[float] | None = None) -> list[int]:
    """:func:`select_veus` with a weight prefetch overlapping each vEU's barrier wait: the same
    choice (the earliest start, ties by the lowest vEU), other end times."""
    arrived = list(free)
    left = [max(0.0, overlap_us - (credit_us[v] if credit_us else 0.0)) for v in range(len(free))]
    first = [True] * len(free)
    heap = [(max(f, ready), v) for v, f in enumerate(free)]
    heapq.heapify(heap)
    chosen = []
    for _ in range(count):
        start, veu = heapq.heappop(heap)
        if first[veu]:
            end = max(start, arrived[veu] + left[veu]) + time_us - overlap_us
            first[veu] = False
        else:
            end = start + time_us
        free[veu] = end
        chosen.append(veu)
        heapq.heappush(heap, (end, veu))
    return chosen


def _place(base: PartialPlan | None, wave: Sequence[int], choice: Mapping[int, int], reasons: Mapping[int, str],
           graph: OpGraph, vdevice: VDevice, config: PolicyConfig) -> PartialPlan | None:
    """``base`` plus ``wave`` with rKernels ``choice``; None when the vEU shape no longer fits an SM or an
    operator would need more than ``config.max_waits_per_op`` wait entries."""
    selected = {**(base.selected if base else {}), **choice}
    shape = vdevice.veu_shape((graph.ops[op].kernels[i] for op, i in choice.items()), config.registers)
    if base is not None:
        shape = tuple(max(a, b) for a, b in zip(shape, base.shape))
    try:
        per_sm = vdevice.occupancy(*shape)
    except ValueError:
        return None
    num_veus = vdevice.num_sms * per_sm
    num_veus = num_veus if config.max_veus is None else min(num_veus, config.max_veus)
    waves = (base.waves if base else ()) + (tuple(wave),)
    lookahead = config.prefetch_lookahead
    if base is not None and base.num_veus == num_veus and (lookahead == 1 or base.barriers is not None):
        todo = [tuple(wave)]
        free, op_finish, veu_of, has_waits = list(base.free), dict(base.op_finish), dict(base.veu_of), base.has_waits
        waits = list(base.waits) or [()] * num_veus
        barriers = base.barriers.copy() if lookahead > 1 else None
    else:  # a new vEU count (or a base placed without a lookahead): placed again from its waves
        todo = list(waves)
        free, op_finish, veu_of, has_waits = [0.0] * num_veus, {}, {}, False
        waits = [()] * num_veus
        barriers = _Barriers(num_veus) if lookahead > 1 else None
    for part in todo:
        for op in part:
            kernel = graph.ops[op].kernels[selected[op]]
            inside = [p for p in graph.preds_of(op) if p in op_finish]
            ready = max(op_finish[p] for p in inside) + config.cost.barrier_us if inside else 0.0
            has_waits = has_waits or bool(inside)
            arrived = list(free)
            overlap = kernel.prefetch_us if inside else 0.0
            credit = None
            if overlap > 0 and barriers is not None:  # only where the code has the barrier
                sums = [sum(w) for w in waits]
                barred = barriers.emitting(inside, [v for v, w in enumerate(sums) if w > 0])
                credit = [w if v in barred else 0.0 for v, w in enumerate(sums)]
            veus = select_veus(free, ready, kernel.num_rtasks, kernel.time_us, overlap, credit)
            veu_of[op] = tuple(veus)
            behind = barriers.place(op, inside, veu_of) if barriers is not None else set()
            _track_waits(waits, set(veus), behind, graph.ops[op], arrived, ready, lookahead)
            if inside and config.max_waits_per_op is not None:
                entries = sum(_wait_entries(veu_of[p]) for p in inside)
                if len(set(veus)) * entries > config.max_waits_per_op:
                    return None
            op_finish[op] = max(free[v] for v in set(veus))
    return PartialPlan(
        waves=waves,
        selected=selected,
        reason={**(base.reason if base else {}), **reasons},
        veus_per_sm=per_sm,
        num_veus=num_veus,
        free=tuple(free),
        op_finish=op_finish,
        veu_of=veu_of,
        has_waits=has_waits,
        shape=shape,
        waits=tuple(waits),
        barriers=barriers,
    )


def _track_waits(waits: list, veus: set, behind: set, op: ROperator, arrived: list, ready: float,
                 lookahead: int) -> None:
    """Updates ``waits`` (``PartialPlan.waits``) once ``op``'s rTasks went to ``veus``: a
    prefetching operator (one with ``prefetch_inputs``, whose code issues prefetches) ends the
    window of each of its vEUs; any other operator adds, on each vEU of ``behind`` (those where
    its RProgram has a barrier-rTask before it, :class:`_Barriers`), its wait there,
    ``max(arrived[v], ready) - arrived[v]``, keeping the last ``lookahead - 1``."""
    if op.prefetch_inputs:
        for veu in veus:
            waits[veu] = ()
    elif lookahead > 1:
        for veu in behind:
            wait = max(arrived[veu], ready) - arrived[veu]
            waits[veu] = (waits[veu] + (wait,))[-(lookahead - 1):]


class _Barriers:
    """Which vEUs get a barrier-rTask before an operator's first rTask there, as
    :func:`materialize`'s ``RProgram.append`` decides it, without building the program: a
    predecessor on more than ``OP_WAIT_MIN_VEUS`` vEUs is waited for whole (dropped where the vEU
    waited for it whole already), another one at its last rTask on each vEU (dropped on the vEU
    itself, or where an earlier barrier of the vEU waited for that rTask or a later one there).
    The credit of an earlier barrier's prefetch (``PolicyConfig.prefetch_lookahead``) goes only
    where the code has those barriers. Positions are rTask counts per vEU (monotone in the
    program's orders)."""

    def __init__(self, num_veus: int) -> None:
        self.placed = [0] * num_veus  # rTasks on each vEU so far
        # op -> {vEU: index of its last rTask there}; None: an op waited for whole
        self.last_at: dict = {}
        # vEU -> {vEU u: index it waited for}; op waited for whole -> the vEUs that did (entries
        # are replaced, never changed in place: shared with the plans this one extends)
        self.seen: list = [{}] * num_veus
        self.waited_by: dict = {}

    def copy(self) -> "_Barriers":
        """A copy to extend."""
        other = _Barriers.__new__(_Barriers)
        other.placed, other.last_at = list(self.placed), dict(self.last_at)
        other.seen, other.waited_by = list(self.seen), dict(self.waited_by)
        return other

    def emitting(self, preds, veus) -> set:
        """Those of ``veus`` where an operator waiting for ``preds`` (placed) would get a
        barrier-rTask."""
        whole = [self.waited_by.get(p, frozenset()) for p in preds if self.last_at[p] is None]
        positions = [self.last_at[p] for p in preds if self.last_at[p] is not None]
        covered = frozenset.intersection(*whole) if whole else None
        found = set()
        for veu in veus:
            if covered is not None and veu not in covered:
                found.add(veu)
                continue
            seen = self.seen[veu]
            if any(u != veu and seen.get(u, -1) < index
                   for last in positions for u, index in last.items()):
                found.add(veu)
        return found

    def place(self, op: int, preds, veu_of) -> set:
        """Records ``op``'s rTasks (``veu_of[op]``), each vEU's first one waiting for ``preds``;
        returns the vEUs that got a barrier-rTask."""
        veus = list(dict.fromkeys(veu_of[op]))
        behind = set()
        positions = []
        for pred in preds:
            last = self.last_at[pred]
            if last is not None:
                positions.append(last)
                continue
            done = self.waited_by.get(pred, frozenset())
            new = [v for v in veus if v not in done]
            if new:
                behind.update(new)
                self.waited_by[pred] = done.union(new)
        for veu in veus if positions else ():
            seen, frontier = self.seen[veu], {}
            for last in positions:
                for u, index in last.items():
                    if u != veu and seen.get(u, -1) < index and frontier.get(u, -1) < index:
                        frontier[u] = index
            if frontier:
                behind.add(veu)
                self.seen[veu] = {**seen, **frontier}
        last = {}
        for veu in veu_of[op]:
            last[veu] = self.placed[veu]
            self.placed[veu] += 1
        self.last_at[op] = None if _waits_whole(veu_of[op]) else last
        return behind


OP_WAIT_MIN_VEUS = 4


def _waits_whole(veus: Sequence[int]) -> bool:
    """Whether a predecessor placed on ``veus`` is waited for whole (one operator-completion counter)
    rather than at its last rTask on each of its vEUs: when it is spread over more than
    ``OP_WAIT_MIN_VEUS`` vEUs (both mean "every rTask of it finished")."""
    return len(set(veus)) > OP_WAIT_MIN_VEUS


def _wait_entries(veus: Sequence[int]) -> int:
    """Wait entries one barrier needs for a predecessor placed on ``veus``."""
    return 1 if _waits_whole(veus) else len(set(veus))


def materialize(plan: PartialPlan, graph: OpGraph, config: PolicyConfig, profile: Profile | None = None) -> RProgramPlan:
    """Build the plan's RProgram with Append and Wait (paper 3.3, Algorithm 1 lines 15-18).

    Each rTask waits for the last rTask of its predecessors on every vEU (Wait keeps only the last of
    consecutive rTasks), or, for a predecessor spread over many vEUs, for the whole predecessor
    (``RProgram.wait_for_ops``: one counter); only an operator's first rTask on a vEU waits, as later
    ones follow it.
    """
    program = RProgram(plan.num_veus)
    for op in plan.ops:
        frontier: dict[int, tuple[int, RTask]] = {}
        whole: dict[int, int] = {}
        for pred in graph.preds_of(op):
            if pred in plan.veu_of and _waits_whole(plan.veu_of[pred]):
                whole[pred] = len(plan.veu_of[pred])
                continue
            for task in program.tasks_of(pred):
                veu, order = program.location(task)
                if veu not in frontier or frontier[veu][0] < order:
                    frontier[veu] = (order, task)
        waits = [task for _, task in frontier.values()]
        waited: set[int] = set()
        for rtask_id, veu in enumerate(plan.veu_of[op]):
            task = RTask(op, rtask_id)
            if (waits or whole) and veu not in waited:
                if waits:
                    program.wait(task, waits)
                if whole:
                    program.wait_for_ops(task, whole)
                waited.add(veu)
            program.append(task, veu)
    cost = config.cost
    analytic = plan.makespan_us + cost.launch_us + (cost.grid_sync_us if program.num_barriers else 0.0)
    result = RProgramPlan(
        program=program,
        ops=plan.ops,
        selected=dict(plan.selected),
        reason=dict(plan.reason),
        veus_per_sm=plan.veus_per_sm,
        num_veus=plan.num_veus,
        predicted_us=analytic,
        waves=[list(w) for w in plan.waves],
        op_finish=dict(plan.op_finish),
    )
    if profile is not None:
        _profiled(result, profile)
    return result


def plan_time(plan: PartialPlan | None, graph: OpGraph, config: PolicyConfig, profile: Profile | None = None) -> float:
    """time(P) of Algorithm 1: profiled when ``profile`` returns a time, else analytical; infinity for
    ``None`` (a plan whose vEU shape does not fit)."""
    if plan is None:
        return math.inf
    if profile is None:
        return plan.analytic_time_us(config.cost)
    return materialize(plan, graph, config, profile).predicted_us


def _asking(profile: Profile | None) -> bool:
    """Whether ``profile`` may still answer: a profiler's ``plan_profile`` says ``active()`` False
    once its budget is spent, and then no plan is materialized only to be asked (an rProgram the
    size of the model, each time)."""
    return profile is not None and getattr(profile, "active", lambda: True)()


def _close(a: float, b: float, config: PolicyConfig) -> bool:
    """Whether two analytical times are within ``config.profile_margin`` of each other (always
    when it is None): only then can measuring them change the choice."""
    if config.profile_margin is None:
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    low, high = sorted((a, b))
    return high <= config.profile_margin * max(low, 1e-9)


def _faster(a: PartialPlan | None, b: PartialPlan | None, graph: OpGraph, config: PolicyConfig,
            profile: Profile | None) -> bool:
    """time(a) < time(b): both profiled when their analytical times are close (:func:`_close`),
    else both analytical (one scale for both sides either way)."""
    ta, tb = plan_time(a, graph, config), plan_time(b, graph, config)
    if _close(ta, tb, config) and _asking(profile):
        ta, tb = plan_time(a, graph, config, profile), plan_time(b, graph, config, profile)
    return ta < tb


def select_rkernels(wave: Sequence[int], plan: PartialPlan | None, graph: OpGraph, vdevice: VDevice,
                    config: PolicyConfig, profile: Profile | None = None) -> tuple[dict[int, int], dict[int, str]]:
    """SelectRKernels (paper 3.3): the fastest rKernels when all their rTasks together do not fill the
    vEUs; otherwise the most efficient ones if the plan with them is faster. Returns (op -> kernel index,
    op -> reason)."""
    return _select_and_place(wave, plan, graph, vdevice, config, profile)[:2]


def _select_and_place(wave, plan, graph, vdevice, config, profile):
    def label(op: int, name: str) -> str:
        return "only" if len(graph.ops[op].kernels) == 1 else name

    fastest = {op: _fastest_index(graph.ops[op], vdevice, config) for op in wave}
    efficient = {op: _efficient_index(graph.ops[op], vdevice, config) for op in wave}
    fast_reason = {op: label(op, "fastest") for op in wave}
    eff_reason = {op: label(op, "efficient") for op in wave}
    if config.selection == "fastest":
        return fastest, fast_reason, _place(plan, wave, fastest, fast_reason, graph, vdevice, config)
    if config.selection == "efficient":
        return efficient, eff_reason, _place(plan, wave, efficient, eff_reason, graph, vdevice, config)
    with_fastest = _place(plan, wave, fastest, fast_reason, graph, vdevice, config)
    rtasks = sum(graph.ops[op].kernels[i].num_rtasks for op, i in fastest.items())
    best = (fastest, fast_reason, with_fastest)
    if not (efficient == fastest or (with_fastest is not None and rtasks <= with_fastest.num_veus)):
        with_efficient = _place(plan, wave, efficient, eff_reason, graph, vdevice, config)
        if _faster(with_efficient, with_fastest, graph, config, profile):
            best = (efficient, eff_reason, with_efficient)
    return _prefer_plan_shape(best, wave, plan, graph, vdevice, config, profile, label)


def _prefer_plan_shape(best, wave, plan, graph, vdevice, config, profile, label):
    """SelectRKernels(W, P) looks at P too: the versions that keep P's vEU shape (no fewer vEUs per
    SM) may make the merged plan faster than the standalone-fastest ones, which can shrink every vEU
    of P (a 64-thread rKernel next to 256-thread ones)."""
    if plan is None:
        return best
    threads, regs, smem = plan.shape

    def keeps_shape(k: RKernel) -> bool:
        k_regs = config.registers or (vdevice.default_registers if k.registers is None else k.registers)
        try:
            return vdevice.occupancy(max(threads, k.threads), max(regs, k_regs),
                                     max(smem, k.shared_bytes)) == plan.veus_per_sm
        except ValueError:
            return False

    shaped = {}
    for op in wave:
        keep = [i for i, k in enumerate(graph.ops[op].kernels) if keeps_shape(k)]
        if not keep:
            return best
        shaped[op] = min(keep, key=lambda i, op=op: (
            math.ceil(graph.ops[op].kernels[i].num_rtasks / plan.num_veus)
            * graph.ops[op].kernels[i].time_us, i))
    if shaped == best[0]:
        return best
    reasons = {op: label(op, "fits") for op in wave}
    with_shaped = _place(plan, wave, shaped, reasons, graph, vdevice, config)
    if with_shaped is None:
        return best
    if best[2] is None or _faster(with_shaped, best[2], graph, config, profile):
        return shaped, reasons, with_shaped
    return best


def schedule_wave(wave: Sequence[int], plan: PartialPlan | None, graph: OpGraph, vdevice: VDevice,
                  config: PolicyConfig = PolicyConfig(), profile: Profile | None = None) -> PartialPlan | None:
    """ScheduleWave (Algorithm 1): ``plan`` (None: a new rProgram) extended with ``wave``. Returns None
    when the wave cannot join ``plan`` (no common vEU shape, or too many wait entries)."""
    return _select_and_place(wave, plan, graph, vdevice, config, profile)[2]


def _chunks(wave: Sequence[int], graph: OpGraph, vdevice: VDevice, config: PolicyConfig) -> list[list[int]]:
    """Cut ``wave`` into runs of ops whose primary rKernels fit one vEU shape together."""
    pick = _efficient_index if config.selection == "efficient" else _fastest_index
    chunks: list[list[int]] = []
    kernels: list[RKernel] = []
    for op in wave:
        kernel = graph.ops[op].kernels[pick(graph.ops[op], vdevice, config)]
        if chunks and vdevice.fits(kernels + [kernel], config.registers):
            chunks[-1].append(op)
            kernels.append(kernel)
        else:
            chunks.append([op])
            kernels = [kernel]
    return chunks


def schedule(graph: OpGraph, vdevice: VDevice, config: PolicyConfig = PolicyConfig(),
             profile: Profile | None = None) -> list[RProgramPlan]:
    """Schedule (Algorithm 1): the rPrograms, in execution order, covering every op of ``graph`` once."""
    return schedule_units(graph.waves, graph, vdevice, config, profile, graph.split_before)


def schedule_units(units: Sequence[Sequence[int]], graph: OpGraph, vdevice: VDevice,
                   config: PolicyConfig = PolicyConfig(), profile: Profile | None = None,
                   split_before: Iterable[int] = ()) -> list[RProgramPlan]:
    """Algorithm 1's loop over ``units`` instead of the BFS waves: each unit is scheduled like a wave
    (SelectRKernels, SelectvEU, P1 vs Pcurr + P2); an rProgram ends before each index of
    ``split_before``. Other policies (``tvm_rammer.scheduling.policies``) order and group the operators their
    own way and hand the result here, so every policy places rTasks with the same primitives.

    Every op of ``graph`` must be in exactly one unit, each unit in an order where an operator's
    predecessors come before it (in an earlier unit or earlier in the same one)."""
    split_before = set(split_before)
    plans: list[RProgramPlan] = []
    current: PartialPlan | None = None

    def close() -> None:
        nonlocal current
        if current is not None:
            plans.append(materialize(current, graph, config, profile))
        current = None

    for index, wave in enumerate(units):
        if index in split_before:
            close()
        for chunk in _chunks(wave, graph, vdevice, config):
            alone = schedule_wave(chunk, None, graph, vdevice, config, profile)
            assert alone is not None, f"chunk {chunk} fits one vEU shape by construction"
            merged = None
            if current is not None and config.merge != "never":
                merged = schedule_wave(chunk, current, graph, vdevice, config, profile)
            if merged is not None and (config.merge == "always" or _merge_pays(
                    merged, current, alone, graph, config, profile)):
                current = merged
                continue
            close()
            current = alone
    close()
    return plans


def _merge_pays(merged: PartialPlan, current: PartialPlan, alone: PartialPlan, graph: OpGraph,
                config: PolicyConfig, profile: Profile | None) -> bool:
    """Algorithm 1's time(P1) <= time(Pcurr) + time(P2): profiled when the two sides' analytical
    times are close (:func:`_close`), else analytical. A ``profile`` with a ``prefetch`` (the
    profiler's) is told the three plans before it is asked for each: their builds can then run
    side by side."""
    plans = (merged, current, alone)
    merged_time, current_time, alone_time = (plan_time(p, graph, config) for p in plans)
    if _close(merged_time, current_time + alone_time, config) and _asking(profile):
        results = [None if p is None else materialize(p, graph, config) for p in plans]
        prefetch = getattr(profile, "prefetch", None)
        for result in results if prefetch is not None else ():
            if result is not None:
                prefetch(result)
        merged_time, current_time, alone_time = (_profiled(r, profile) for r in results)
    return merged_time <= current_time + alone_time


def _profiled(result: RProgramPlan | None, profile: Profile) -> float:
    """``result``'s time (see :func:`plan_time`): measured by ``profile`` when it answers, else
    analytical; infinity for None."""
    if result is None:
        return math.inf
    measured = profile(result)
    if measured is not None:
        result.predicted_us = float(measured)
        result.profiled = True
    return result.predicted_us


def bfs_waves(ops: Iterable[int], preds: Mapping[int, Sequence[int]]) -> list[list[int]]:
    """BFS fronts (levels) of ``ops`` under ``preds`` (predecessors outside ``ops`` ignored): a valid
    ``OpGraph.waves`` for any subset of a graph's operators."""
    members = list(ops)
    inside = set(members)
    inner = {op: [p for p in preds.get(op, ()) if p in inside] for op in members}
    succs: dict[int, list[int]] = {op: [] for op in members}
    for op in members:
        for p in inner[op]:
            succs[p].append(op)
    missing = {op: len(inner[op]) for op in members}
    level = {op: 0 for op in members}
    todo = [op for op in members if not missing[op]]
    while todo:
        op = todo.pop()
        for s in succs[op]:
            level[s] = max(level[s], level[op] + 1)
            missing[s] -= 1
            if not missing[s]:
                todo.append(s)
    if any(missing.values()):
        raise ValueError("bfs_waves: the predecessors form a cycle; an operator graph is a DAG")
    waves: dict[int, list[int]] = {}
    for op in members:
        waves.setdefault(level[op], []).append(op)
    return [waves[k] for k in sorted(waves)]


def replace_cost(config: PolicyConfig, **costs: float) -> PolicyConfig:
    """``config`` with some fields of its cost model replaced (e.g. ``launch_us=0``)."""
    return replace(config, cost=replace(config.cost, **costs))
