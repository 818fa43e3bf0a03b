"""rProgram: per-vEU rTask queues built with the Append and Wait interfaces (Rammer, OSDI'20, 3.2-3.3).

``prog[vEU][order]`` is the paper's two-dimensional array: the ``order``-th item vEU ``vEU`` runs.
Items are :class:`RTask` and :class:`BarrierRTask`; a barrier-rTask takes an order slot like any
rTask (Figure 9: vEU 0 runs Matmul 0 and 1 at orders 0 and 1, its barrier at order 2, Conv at 3).

- ``append(task, veu)`` puts an rTask at the end of a vEU's queue.
- ``wait(task, preds)`` makes a not yet appended rTask wait for already appended rTasks; the wait is
  turned into ONE barrier-rTask right before the task when it is appended (paper 3.3). Only the last
  awaited rTask of each vEU is kept (a vEU runs its rTasks in order, so waiting for the last one of
  several consecutive ones waits for all); an rTask on the vEU the task itself runs on needs no wait;
  and a position this vEU already waited for (or a later one on the same vEU) is not waited for again.
- ``wait_for_ops(task, ops)`` makes it wait for every rTask of whole operators (one counter each in
  the kernel instead of one position per vEU); an operator this vEU already waited for is not
  waited for again. Both kinds of wait of one task share its one barrier-rTask.

``validate`` checks the invariants codegen relies on, in time linear in the program size.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping, Sequence

import numpy as np

from .rtask import BarrierRTask, RTask

__all__ = ["RProgram", "ScheduleError", "Item"]

Item = RTask | BarrierRTask


class ScheduleError(ValueError):
    """An rProgram breaks an invariant: a missing or duplicated rTask, a bad barrier, a deadlock or an
    uncovered data dependency."""


class RProgram:
    """``prog[vEU][order]`` with the paper's Append and Wait interfaces (paper 3.2, 3.3)."""

    def __init__(self, num_veus: int) -> None:
        if isinstance(num_veus, bool) or not isinstance(num_veus, int) or num_veus < 1:
            raise ValueError(f"RProgram needs num_veus >= 1, got {num_veus!r}")
        self.num_veus = num_veus
        self.prog: list[list[Item]] = [[] for _ in range(num_veus)]
        self._location: dict[RTask, tuple[int, int]] = {}
        self._pending: dict[RTask, dict[int, int]] = {}
        # _waited[v][u] = highest order of vEU u that vEU v already waited for.
        self._waited: list[dict[int, int]] = [{} for _ in range(num_veus)]
        self._pending_ops: dict[RTask, dict[int, int]] = {}
        self._waited_ops: list[set[int]] = [set() for _ in range(num_veus)]
        self._tasks_of: dict[int, list[RTask]] = {}

    @classmethod
    def from_lists(cls, prog: Sequence[Sequence[Item]]) -> "RProgram":
        """An rProgram holding exactly ``prog`` (for tests and deserialisation); check it with :meth:`validate`."""
        program = cls(len(prog))
        for veu, items in enumerate(prog):
            for item in items:
                if not isinstance(item, (RTask, BarrierRTask)):
                    raise TypeError(f"prog[{veu}] holds {item!r}; items must be RTask or BarrierRTask")
                order = len(program.prog[veu])
                program.prog[veu].append(item)
                if isinstance(item, RTask):
                    program._location.setdefault(item, (veu, order))
                    program._tasks_of.setdefault(item.op, []).append(item)
        return program

    def _check_veu(self, veu: int) -> None:
        if isinstance(veu, bool) or not isinstance(veu, int) or not 0 <= veu < self.num_veus:
            raise ValueError(f"vEU {veu!r} is outside 0..{self.num_veus - 1}")

    def wait(self, task: RTask, preds: Iterable[RTask]) -> None:
        """Make ``task`` wait for ``preds`` (all already appended); materialised at ``append(task, ...)``."""
        if not isinstance(task, RTask):
            raise TypeError(f"wait() takes an RTask, got {task!r}")
        if task in self._location:
            raise ValueError(f"{task} is already appended at {self._location[task]}; call wait() before append()")
        pending = self._pending.setdefault(task, {})
        for pred in preds:
            if pred not in self._location:
                raise ValueError(f"{task} waits for {pred}, which is not appended yet; append predecessors first")
            veu, order = self._location[pred]
            if pending.get(veu, -1) < order:
                pending[veu] = order

    def wait_for_ops(self, task: RTask, ops: Mapping[int, int]) -> None:
        """Make ``task`` wait until every rTask of each operator in ``ops`` (uid -> its rTask count)
        finished; materialised at ``append(task, ...)`` in the same barrier-rTask as ``wait``'s."""
        if not isinstance(task, RTask):
            raise TypeError(f"wait_for_ops() takes an RTask, got {task!r}")
        if task in self._location:
            raise ValueError(f"{task} is already appended at {self._location[task]}; wait before append()")
        pending = self._pending_ops.setdefault(task, {})
        for op, count in ops.items():
            if op == task.op:
                raise ValueError(f"{task} cannot wait for its own operator {op}")
            pending[op] = count

    def append(self, task: Item, veu: int) -> int:
        """Append ``task`` to vEU ``veu``, preceded by one barrier-rTask for its pending waits; returns its order."""
        self._check_veu(veu)
        if isinstance(task, BarrierRTask):
            for other, order in task.waits:
                self._note_waited(veu, other, order)
            self._waited_ops[veu].update(op for op, _ in task.ops)
            self.prog[veu].append(task)
            return len(self.prog[veu]) - 1
        if not isinstance(task, RTask):
            raise TypeError(f"append() takes an RTask or a BarrierRTask, got {task!r}")
        if task in self._location:
            raise ValueError(f"{task} is already appended at {self._location[task]}; every rTask runs once")
        pending = self._pending.pop(task, {})
        seen = self._waited[veu]
        waits = tuple(
            (other, order) for other, order in sorted(pending.items()) if other != veu and seen.get(other, -1) < order
        )
        pending_ops = self._pending_ops.pop(task, {})
        done_ops = self._waited_ops[veu]
        ops = tuple((op, count) for op, count in sorted(pending_ops.items()) if op not in done_ops)
        if waits or ops:
            for other, order in waits:
                self._note_waited(veu, other, order)
            done_ops.update(op for op, _ in ops)
            self.prog[veu].append(BarrierRTask(waits, ops))
        order = len(self.prog[veu])
        self.prog[veu].append(task)
        self._location[task] = (veu, order)
        self._tasks_of.setdefault(task.op, []).append(task)
        return order

    def _note_waited(self, veu: int, other: int, order: int) -> None:
        if self._waited[veu].get(other, -1) < order:
            self._waited[veu][other] = order

    def location(self, task: RTask) -> tuple[int, int]:
        """``(vEU, order)`` of an appended rTask."""
        if task not in self._location:
            raise KeyError(f"{task} is not in this rProgram")
        return self._location[task]

    def tasks_of(self, op: int) -> list[RTask]:
        """The rTasks of operator ``op``, in append order."""
        return list(self._tasks_of.get(op, ()))

    @property
    def ops(self) -> list[int]:
        """Operator uids in the order their first rTask was appended."""
        return list(self._tasks_of)

    def awaited(self) -> set[tuple[int, int]]:
        """Positions some barrier-rTask waits for: codegen publishes completion only there."""
        return {pos for items in self.prog for item in items if isinstance(item, BarrierRTask) for pos in item.waits}

    def awaited_ops(self) -> list[int]:
        """Operators some barrier-rTask waits for whole (each gets a completion counter), in the
        order of their first wait."""
        found: dict[int, None] = {}
        for items in self.prog:
            for item in items:
                if isinstance(item, BarrierRTask):
                    found.update((op, None) for op, _ in item.ops)
        return list(found)

    @property
    def num_barriers(self) -> int:
        return sum(isinstance(item, BarrierRTask) for items in self.prog for item in items)

    @property
    def num_rtasks(self) -> int:
        return sum(isinstance(item, RTask) for items in self.prog for item in items)

    def to_dict(self) -> dict:
        """JSON-able summary: ``prog`` as ``[["task", op, rtask_id] | ["barrier", [[vEU, order], ...],
        [[op, count], ...]]]`` per vEU."""
        def encode(item: Item) -> list:
            if isinstance(item, RTask):
                return ["task", item.op, item.rtask_id]
            return ["barrier", [list(pos) for pos in item.waits], [list(op) for op in item.ops]]

        return {
            "num_veus": self.num_veus,
            "ops": self.ops,
            "num_rtasks": self.num_rtasks,
            "num_barriers": self.num_barriers,
            "prog": [[encode(item) for item in items] for items in self.prog],
        }

    def validate(self, num_rtasks: Mapping[int, int], preds: Mapping[int, Sequence[int]]) -> None:
        """Raise :class:`ScheduleError` unless the program is correct.

        ``num_rtasks[op]`` is the rTask count of every operator of this program; ``preds[op]`` its
        predecessor operators (those outside the program are ignored: rProgram boundaries order them).
        Checked: every rTask exactly once; barriers wait only for existing rTasks; the happens-before
        graph (program order per vEU plus waits) is acyclic, i.e. no deadlock; every rTask of a
        predecessor operator happens before every rTask of its successor.
        """
        self._check_tasks(num_rtasks)
        self._check_barriers(num_rtasks)
        self._simulate(num_rtasks, preds)

    def _check_tasks(self, num_rtasks: Mapping[int, int]) -> None:
        where: dict[RTask, tuple[int, int]] = {}
        for veu, items in enumerate(self.prog):
            for order, item in enumerate(items):
                if not isinstance(item, RTask):
                    continue
                if item.op not in num_rtasks:
                    raise ScheduleError(f"{item} at (vEU {veu}, order {order}) belongs to no operator of this program")
                if not 0 <= item.rtask_id < num_rtasks[item.op]:
                    raise ScheduleError(
                        f"{item} at (vEU {veu}, order {order}) is outside op {item.op}'s {num_rtasks[item.op]} rTasks"
                    )
                if item in where:
                    raise ScheduleError(f"duplicate {item}: at (vEU {veu}, order {order}) and {where[item]}")
                where[item] = (veu, order)
        for op, count in num_rtasks.items():
            missing = [i for i in range(count) if RTask(op, i) not in where]
            if missing:
                raise ScheduleError(f"missing rTask(s) of op {op}: ids {missing[:10]}{'...' if len(missing) > 10 else ''}")

    def _check_barriers(self, num_rtasks: Mapping[int, int]) -> None:
        for veu, items in enumerate(self.prog):
            for order, item in enumerate(items):
                if not isinstance(item, BarrierRTask):
                    continue
                if not item.waits and not item.ops:
                    raise ScheduleError(f"barrier at (vEU {veu}, order {order}) waits for nothing")
                for op, count in item.ops:
                    if num_rtasks.get(op) != count:
                        raise ScheduleError(
                            f"barrier at (vEU {veu}, order {order}) waits for {count} rTasks of op {op}, "
                            f"which has {num_rtasks.get(op, 'no rTask in this program')}")
                for pos in item.waits:
                    other, at = pos
                    if not (0 <= other < self.num_veus and 0 <= at < len(self.prog[other])):
                        raise ScheduleError(f"barrier at (vEU {veu}, order {order}) waits for {pos}, which does not exist")
                    if not isinstance(self.prog[other][at], RTask):
                        raise ScheduleError(
                            f"barrier at (vEU {veu}, order {order}) waits for {pos}, which is a barrier, not an rTask"
                        )

    def _simulate(self, num_rtasks: Mapping[int, int], preds: Mapping[int, Sequence[int]]) -> None:
        """Run the program in one topological pass with vector clocks.

        ``clock[v][u]`` = highest order of vEU u known finished before vEU v's next item (the entry for
        v itself is its position). Clock arrays are copy-on-write (replaced only at a barrier), so the
        snapshot kept at an awaited position is a reference plus that position's order, released once
        every barrier waiting for it has used it. An operator's dependency is checked once per
        (op, vEU), at the op's first rTask on that vEU (later ones only know more).
        """
        num_veus = self.num_veus
        last = {op: np.full(num_veus, -1, dtype=np.int64) for op in num_rtasks}
        first: dict[tuple[int, int], int] = {}
        for veu, items in enumerate(self.prog):
            for order, item in enumerate(items):
                if isinstance(item, RTask):
                    last[item.op][veu] = order
                    first.setdefault((item.op, veu), order)
        required: dict[int, tuple[np.ndarray, list[int]]] = {}
        for op in num_rtasks:
            inside = [p for p in preds.get(op, ()) if p in num_rtasks]
            if inside:
                required[op] = (np.max([last[p] for p in inside], axis=0), inside)
        uses: dict[tuple[int, int], int] = {}
        for items in self.prog:
            for item in items:
                if isinstance(item, BarrierRTask):
                    for key in item.waits:
                        uses[key] = uses.get(key, 0) + 1
        snapshots: dict[tuple[int, int], np.ndarray] = {}
        empty = np.full(num_veus, -1, dtype=np.int64)
        # whole-operator waits: the clock that knows every rTask of the op finished, and how many did
        awaited_ops = {op for items in self.prog for item in items
                       if isinstance(item, BarrierRTask) for op, _ in item.ops}
        op_clock = {op: empty.copy() for op in awaited_ops}
        op_done = dict.fromkeys(awaited_ops, 0)
        blocked_op: dict[int, list[int]] = {}
        clock = [empty] * num_veus
        pos = [0] * num_veus
        blocked: dict[tuple[int, int], list[int]] = {}
        unmet = [0] * num_veus
        ready = deque(range(num_veus))

        def wake(waiters):
            for waiter in waiters:
                unmet[waiter] -= 1
                if unmet[waiter] == 0:
                    ready.append(waiter)

        while ready:
            veu = ready.popleft()
            items = self.prog[veu]
            while pos[veu] < len(items):
                order = pos[veu]
                item = items[order]
                if isinstance(item, BarrierRTask):
                    missing = [(v, o) for v, o in item.waits if pos[v] <= o]
                    missing_ops = [op for op, count in item.ops if op_done[op] < count]
                    if missing or missing_ops:
                        unmet[veu] = len(missing) + len(missing_ops)
                        for key in missing:
                            blocked.setdefault(key, []).append(veu)
                        for op in missing_ops:
                            blocked_op.setdefault(op, []).append(veu)
                        break
                    merged = clock[veu].copy()
                    for key in item.waits:
                        np.maximum(merged, snapshots[key], out=merged)
                        merged[key[0]] = max(merged[key[0]], key[1])
                        uses[key] -= 1
                        if not uses[key]:
                            del snapshots[key]
                    for op, _ in item.ops:
                        np.maximum(merged, op_clock[op], out=merged)
                    clock[veu] = merged
                elif item.op in required and first[(item.op, veu)] == order:
                    self._check_dependency(item, veu, order, clock[veu], *required[item.op], last)
                pos[veu] = order + 1
                if (veu, order) in uses:
                    snapshots[(veu, order)] = clock[veu]
                if isinstance(item, RTask) and item.op in op_clock:
                    known = op_clock[item.op]
                    np.maximum(known, clock[veu], out=known)
                    known[veu] = max(known[veu], order)
                    op_done[item.op] += 1
                    if op_done[item.op] == num_rtasks[item.op]:
                        wake(blocked_op.pop(item.op, ()))
                wake(blocked.pop((veu, order), ()))
        stuck = [v for v in range(num_veus) if pos[v] < len(self.prog[v])]
        if stuck:
            details = "; ".join(
                f"vEU {v} at order {pos[v]} waits for "
                f"{[w for w in self.prog[v][pos[v]].waits if pos[w[0]] <= w[1]]}"
                f"{[f'op {op}' for op, n in self.prog[v][pos[v]].ops if op_done[op] < n]}"
                for v in stuck[:5]
            )
            raise ScheduleError(f"deadlock: the waits form a cycle, {len(stuck)} vEU(s) never finish: {details}")

    @staticmethod
    def _check_dependency(task: RTask, veu: int, order: int, known: np.ndarray, need: np.ndarray,
                          pred_ops: list[int], last: Mapping[int, np.ndarray]) -> None:
        late = need > known
        late[veu] = need[veu] > order - 1
        if late.any():
            other = int(np.nonzero(late)[0][0])
            seen = order - 1 if other == veu else known[other]
            pred = next(p for p in pred_ops if last[p][other] > seen)
            raise ScheduleError(
                f"uncovered dependency op {pred} -> op {task.op}: {task} at (vEU {veu}, order {order}) may start "
                f"before op {pred}'s rTask at (vEU {other}, order {int(last[pred][other])}) finishes; add a wait"
            )
