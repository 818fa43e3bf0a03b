"""The critical path of a schedule: the longest chain of dependent operators, as the policy costs it.

Pure: operator ids, their predecessors and their predicted times in; the longest path out. An
rProgram cannot finish before its longest chain of dependent operators has run, however many vEUs
it has: each operator on the chain costs one round of its rTasks (``time_us_per_rtask`` times
``ceil(rtasks / vEUs)``) and each dependency inside the rProgram one barrier wait (``barrier_us``,
the policy's cost of an rTask waiting on its predecessors' rTasks; policy.py adds the same). The
other bound is the work: every rTask's time spread over all vEUs (``work_us``). The policy's
predicted time is at least the larger of the two.

rPrograms run one after another (one persistent kernel each), so the model's critical path is the
sum of its rPrograms' paths: ``operators`` and ``predicted_us`` add up.

:func:`rprogram_critical_paths` takes the per-rProgram reports of ``tvm-rammer inspect``
(``report.rprogram_reports``) and the dependency graph the rProgram grouping saw (one ``(uid, name,
preds)`` per operator, in the order the policy placed them: wave by wave).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["CriticalPath", "LastChain", "critical_path", "last_chain", "rounds_us",
           "rprogram_critical_paths"]


def rounds_us(time_us_per_rtask: float, rtasks: int, num_veus: int) -> float:
    """What one operator costs on a chain: its rounds of rTasks on ``num_veus`` vEUs."""
    return time_us_per_rtask * math.ceil(rtasks / max(1, num_veus))


@dataclass(frozen=True)
class CriticalPath:
    """The longest chain: operator ids from first to last and its predicted time (us)."""

    operators: tuple
    predicted_us: float

    def __len__(self) -> int:
        return len(self.operators)


def critical_path(order: Sequence[int], preds: Mapping[int, Sequence[int]],
                  op_us: Mapping[int, float], barrier_us: float) -> CriticalPath:
    """Longest path through the operators ``order`` (a topological order): each operator costs
    ``op_us[op]``, each edge between two of them ``barrier_us``; predecessors outside ``order`` are
    ignored (they finished before, in an earlier rProgram). Ties go to the earlier operator."""
    if barrier_us < 0:
        raise ValueError(f"barrier_us={barrier_us} must be >= 0")
    position = {op: k for k, op in enumerate(order)}
    finish, via = {}, {}
    for op in order:
        start, best = 0.0, None
        for p in preds.get(op, ()):
            if p not in position:
                continue
            if position[p] >= position[op]:
                raise ValueError(f"operator {op} depends on {p}, which comes later in `order`; "
                                 "pass the operators in a topological order")
            ready = finish[p] + barrier_us
            if best is None or ready > start:
                start, best = ready, p
        finish[op], via[op] = start + op_us[op], best
    if not finish:
        return CriticalPath((), 0.0)
    last = max(order, key=lambda op: (finish[op], -position[op]))
    path = [last]
    while via[path[-1]] is not None:
        path.append(via[path[-1]])
    return CriticalPath(tuple(reversed(path)), finish[last])


@dataclass(frozen=True)
class LastChain:
    """Where the time of a placed rProgram goes along the chain that ends last.

    ``finish_us`` (when the last operator ends, from the rProgram's start) is exactly
    ``rtask_us + barrier_us + waiting_us``: the chain's rounds of rTasks, one barrier wait per
    dependency, and the time its operators, once ready, waited for vEUs busy with other rTasks."""

    operators: tuple
    rtask_us: float
    barrier_us: float
    waiting_us: float
    finish_us: float


def last_chain(finish: Mapping[int, float], preds: Mapping[int, Sequence[int]],
               op_us: Mapping[int, float], barrier_us: float) -> LastChain:
    """The chain through a placed schedule that ends last: from the operator that finishes last,
    back through the predecessor that finished last (the one it waited for), to an operator with
    no predecessor among ``finish``. ``finish``: op -> when its last rTask ends (the policy's
    ``RProgramPlan.op_finish``); ``op_us``: its rounds of rTasks (:func:`rounds_us`), as in
    :func:`critical_path`. An operator is ready ``barrier_us`` after its last predecessor
    finished (at 0 without one); what it finished later than ready + ``op_us`` it waited."""
    if barrier_us < 0:
        raise ValueError(f"barrier_us={barrier_us} must be >= 0")
    if not finish:
        return LastChain((), 0.0, 0.0, 0.0, 0.0)
    op = max(finish, key=lambda o: (finish[o], -o))
    chain = [op]
    while True:
        inside = [p for p in preds.get(chain[-1], ()) if p in finish]
        if not inside:
            break
        chain.append(max(inside, key=lambda o: (finish[o], -o)))
    chain.reverse()
    waiting, ready = 0.0, 0.0
    for k, o in enumerate(chain):
        if k:
            ready = finish[chain[k - 1]] + barrier_us
        waiting += finish[o] - op_us[o] - ready
    rtask = sum(op_us[o] for o in chain)
    return LastChain(tuple(chain), rtask, barrier_us * (len(chain) - 1), waiting, finish[op])


def _program_index(report: dict) -> int:
    """k of ``rammer_rprogram{k}`` (reports sort by name, so rprogram10 before rprogram2)."""
    digits = "".join(ch for ch in str(report.get("kernel", "")) if ch.isdigit())
    return int(digits) if digits else 0


def rprogram_critical_paths(reports: Sequence[dict], operators: Sequence[tuple],
                            barrier_us: float) -> dict | None:
    """Each rProgram's critical path and the model's, as JSON-able dicts.

    ``reports``: ``rammer.report`` dicts (``operators`` with ``name``, ``rtasks`` and
    ``time_us_per_rtask``; ``num_veus``). ``operators``: ``(uid, name, preds)`` of every placed
    operator, in the order the policy placed them (rProgram after rProgram, wave by wave), which is
    the order of the reports' operator lists. Returns ``{"operators", "predicted_us", "programs":
    [{"kernel", "operators", "predicted_us", "work_us", "path"}]}``, or None when the reports and
    ``operators`` do not line up (then nothing reliable can be said).
    """
    ordered = sorted(reports, key=_program_index)
    if sum(len(r["operators"]) for r in ordered) != len(operators):
        return None
    programs, total_ops, total_us, k = [], 0, 0.0, 0
    for report in ordered:
        entries = report["operators"]
        mine = operators[k:k + len(entries)]
        k += len(entries)
        if any(name != e["name"] for (_, name, _), e in zip(mine, entries)):
            return None
        veus = max(1, int(report["num_veus"]))
        op_us = {uid: rounds_us(e["time_us_per_rtask"], e["rtasks"], veus)
                 for (uid, _, _), e in zip(mine, entries)}
        preds = {uid: list(p) for uid, _, p in mine}
        names = {uid: name for uid, name, _ in mine}
        path = critical_path([uid for uid, _, _ in mine], preds, op_us, barrier_us)
        work = sum(e["time_us_per_rtask"] * e["rtasks"] for e in entries) / veus
        programs.append({"kernel": report["kernel"], "operators": len(path),
                         "predicted_us": round(path.predicted_us, 3), "work_us": round(work, 3),
                         "path": [names[uid] for uid in path.operators]})
        total_ops += len(path)
        total_us += path.predicted_us
    return {"operators": total_ops, "predicted_us": round(total_us, 3), "programs": programs}
