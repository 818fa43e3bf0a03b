"""Inside the persistent kernel: which rTask ran on which vEU and SM, and when (predicted or measured).

To a profiler a persistent kernel is one long kernel. This module opens it:

- :func:`schedule_of` (called by the back end) describes one rProgram for the timeline: every vEU's
  instructions in table order (rTasks and barrier-rTasks), each operator's name, rKernel version,
  predicted per-rTask time and predecessors. It travels as the JSON attribute ``rammer.schedule`` of
  the persistent PrimFunc (like ``rammer.report``), so :func:`schedules_of` reads it back from a
  lowered module;
- :func:`predict` simulates one schedule on the CPU: each vEU runs its queue in order, an rTask takes
  its rKernel's predicted time, a barrier-rTask ends ``barrier_us`` after the last rTask it waits for
  has ended (at once when they all ended before the vEU got there), as the policy's cost model
  (``policy.select_veus``) assumes; an rTask right after a barrier-rTask whose operator has
  ``prefetch_us`` (its weights prefetched while the vEU waited) ends at
  ``max(its start, the barrier's start + prefetch_us) + rtask_us - prefetch_us``, as the policy
  charges it, less the vEU's waits at the earlier barrier-rTasks its prefetch was issued at
  (``prefetch_lookahead``, ``policy.PolicyConfig``); rPrograms follow one another ``launch_us``
  apart;
- :func:`decode` reads the buffer an instrumented kernel (``RammerConfig(timeline=True)``,
  ``codegen.persistent``) writes: per instruction, in table order, ``(start ns, end ns, SM id)`` of
  ``%globaltimer``/``%smid`` recorded by the vEU's first thread;
- both give a :class:`Timeline` (one per rProgram) of :class:`Slice` s, one per rTask and per
  barrier-rTask; :func:`shares` is the per-vEU busy / barrier-wait / idle split, and
  :func:`in_context_records` the measured in-context rTask times for the profile database.

The writers (Perfetto JSON, PNG) are in :mod:`tvm_rammer.views.timeline_view`. Pure Python and NumPy.

Measured times are ``%globaltimer`` readings: the PTX ISA defines it as a global nanosecond timer
(one clock for all SMs) but promises no update rate, so very short rTasks may show as zero-length
slices; the instrumentation itself (two timer reads and three stores per instruction, by one
thread) lengthens each instruction a little. Where the predicted timeline cannot know: the SM a vEU lands on is the hardware block scheduler's
choice; predicted slices place vEU ``v`` on SM ``v mod num_sms`` (blocks spread across the SMs
first), the measured ones say where it really ran.
"""
from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..codegen.cuda_helpers import TIMELINE_WORDS  # int64 words per instruction: start, end, SM

__all__ = ["SCHEDULE_ATTR", "TIMELINE_WORDS", "Slice", "Timeline", "schedule_of", "schedules_of",
           "predict", "predict_all", "decode", "decode_all", "shares", "in_context_records"]

SCHEDULE_ATTR = "rammer.schedule"
FORMAT = "tvm-rammer-schedule/1"


@dataclass(frozen=True)
class Slice:
    """One rTask or barrier-rTask on one vEU: ``kind`` is "rtask" or "barrier"; times in us."""

    kernel: str
    veu: int
    sm: int
    order: int
    kind: str
    start_us: float
    end_us: float
    op: int | None = None
    name: str = "barrier-rTask"
    rtask_id: int | None = None
    version: str | None = None
    waits: tuple = ()

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass(frozen=True)
class Timeline:
    """The slices of one rProgram's persistent kernel, ``source`` "predicted" or "measured";
    ``ops`` is the schedule's operator table (uid -> name, version, rtasks, preds, ...)."""

    kernel: str
    source: str
    num_veus: int
    num_sms: int
    slices: tuple
    ops: dict = field(default_factory=dict, compare=False)

    @property
    def start_us(self) -> float:
        return min((s.start_us for s in self.slices), default=0.0)

    @property
    def end_us(self) -> float:
        return max((s.end_us for s in self.slices), default=0.0)

    @property
    def span_us(self) -> float:
        return self.end_us - self.start_us


# --- what the back end records ------------------------------------------------------------------

def _version(kernel) -> str:
    """The version part of an rKernel's name ("op:version#hash" in ``rkernels``), else its source."""
    name = str(kernel.name)
    return name.split(":", 1)[1] if ":" in name else str(kernel.source)


def schedule_of(index: int, kernel: str, plan, op_graph, num_veus: int, num_sms: int,
                config) -> dict:
    """The JSON-able description of one rProgram the timeline needs (module docstring).

    ``plan`` is a ``policy.RProgramPlan``, ``op_graph`` its ``policy.OpGraph``, ``num_veus`` the
    vEUs of the emitted kernel (trailing empty ones dropped, as in its table), ``config`` the
    ``RammerConfig`` (``barrier_us``, ``launch_us``). ``prog`` uses ``RProgram.to_dict``'s items:
    ``["task", op, rtask_id]`` and ``["barrier", [[vEU, order], ...], [[op, rTasks], ...]]`` (the
    second list: whole operators waited for).
    """
    ops = {}
    for op in plan.ops:
        rkernel = op_graph.ops[op].kernels[plan.selected[op]]
        ops[str(op)] = {"name": op_graph.ops[op].name, "version": _version(rkernel),
                        "kernel": str(rkernel.name), "rtasks": int(rkernel.num_rtasks),
                        "rtask_us": float(rkernel.time_us),
                        "prefetch_us": float(rkernel.prefetch_us),
                        "prefetches": bool(op_graph.ops[op].prefetch_inputs),
                        "preds": [int(p) for p in op_graph.preds_of(op)]}
    return {"format": FORMAT, "index": int(index), "kernel": kernel, "num_veus": int(num_veus),
            "veus_per_sm": int(plan.veus_per_sm), "num_sms": int(num_sms),
            "barrier_us": float(config.barrier_us), "launch_us": float(config.launch_us),
            "prefetch_lookahead": int(getattr(config, "prefetch_lookahead", 1)),
            "predicted_us": float(plan.predicted_us), "ops": ops,
            "prog": plan.program.to_dict()["prog"][:num_veus]}


def schedules_of(mod) -> list:
    """The schedules of a lowered module's persistent kernels, in execution order."""
    from tvm import tirx

    found = []
    for _, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and SCHEDULE_ATTR in func.attrs:
            found.append(json.loads(str(func.attrs[SCHEDULE_ATTR])))
    return sorted(found, key=lambda s: s["index"])


def _check(schedule: dict) -> None:
    if not isinstance(schedule, dict) or schedule.get("format") != FORMAT:
        found = schedule.get("format") if isinstance(schedule, dict) else type(schedule).__name__
        raise ValueError(f"not an rProgram schedule of format {FORMAT!r} (got {found!r}); "
                         "take it from timeline.schedules_of(lowered module)")


def _task_slice(schedule, veu, sm, order, item, start, end) -> Slice:
    info = schedule["ops"][str(item[1])]
    return Slice(schedule["kernel"], veu, sm, order, "rtask", start, end, op=int(item[1]),
                 name=info["name"], rtask_id=int(item[2]), version=info["version"])


def _barrier_slice(schedule, veu, sm, order, item, start, end) -> Slice:
    ops = item[2] if len(item) > 2 else []
    return Slice(schedule["kernel"], veu, sm, order, "barrier", start, end,
                 waits=tuple(tuple(w) for w in item[1]) + tuple(("op", int(op)) for op, _ in ops))


# --- predicted ------------------------------------------------------------------------------------

def predict(schedule: dict, offset_us: float = 0.0) -> Timeline:
    """The predicted timeline of one rProgram, its kernel starting at ``offset_us`` (module docstring).

    Every vEU runs its queue in order; a barrier-rTask at time ``t`` ends at
    ``max(t, last end of the rTasks it waits for + barrier_us)``. Raises ValueError on a schedule
    whose waits form a cycle (``RProgram.validate`` rejects those before code is built)."""
    _check(schedule)
    prog, barrier_us = schedule["prog"], schedule["barrier_us"]
    num_sms = schedule["num_sms"]
    ends: dict = {}
    op_end: dict = {}  # op -> (rTasks finished, latest end)
    slices = []
    free = [float(offset_us)] * len(prog)
    pos = [0] * len(prog)
    blocked: dict = {}
    barrier_start: dict = {}  # vEU -> when it reached its latest barrier-rTask
    lookahead = int(schedule.get("prefetch_lookahead", 1))
    waits = [[] for _ in prog]  # per vEU: its barrier waits since it last ran a prefetching op
    ready = deque(range(len(prog)))

    def op_finished(op):
        done, _ = op_end.get(int(op), (0, 0.0))
        return done >= schedule["ops"][str(op)]["rtasks"]

    while ready:
        veu = ready.popleft()
        sm = veu % num_sms
        while pos[veu] < len(prog[veu]):
            order, item = pos[veu], prog[veu][pos[veu]]
            start = free[veu]
            if item[0] == "barrier":
                op_waits = item[2] if len(item) > 2 else []
                missing = next((tuple(w) for w in item[1] if tuple(w) not in ends), None)
                if missing is None:
                    missing = next((("op", int(op)) for op, _ in op_waits if not op_finished(op)), None)
                if missing is not None:
                    blocked.setdefault(missing, []).append(veu)
                    break
                last = max([ends[tuple(w)] for w in item[1]]
                           + [op_end[int(op)][1] for op, _ in op_waits])
                end = max(start, last + barrier_us)
                barrier_start[veu] = start
                waits[veu].append(end - start)
                slices.append(_barrier_slice(schedule, veu, sm, order, item, start, end))
            else:
                info = schedule["ops"][str(item[1])]
                end = start + info["rtask_us"]
                overlap = info.get("prefetch_us", 0.0)
                if overlap > 0 and order > 0 and prog[veu][order - 1][0] == "barrier":
                    arrived = barrier_start[veu]  # its prefetch began when the vEU got there,
                    # or at an earlier barrier, whose waits count (not what ran in between)
                    credit = sum(waits[veu][-lookahead:-1]) if lookahead > 1 else 0.0
                    end = (max(start, arrived + max(0.0, overlap - credit)) + info["rtask_us"]
                           - overlap)
                if info.get("prefetches", overlap > 0):
                    waits[veu] = []
                slices.append(_task_slice(schedule, veu, sm, order, item, start, end))
                done, latest = op_end.get(int(item[1]), (0, 0.0))
                op_end[int(item[1])] = (done + 1, max(latest, end))
                if op_finished(item[1]):
                    ready.extend(blocked.pop(("op", int(item[1])), ()))
            ends[(veu, order)] = free[veu] = end
            pos[veu] += 1
            ready.extend(blocked.pop((veu, order), ()))
    stuck = [v for v in range(len(prog)) if pos[v] < len(prog[v])]
    if stuck:
        raise ValueError(f"{schedule['kernel']}: the waits of vEUs {stuck[:5]} never complete "
                         "(a cycle); the schedule is not a valid rProgram")
    return Timeline(schedule["kernel"], "predicted", len(prog), num_sms, tuple(slices),
                    schedule["ops"])


def predict_all(schedules) -> list:
    """Predicted timelines of a model's rPrograms, one after the other, ``launch_us`` apart (the
    ordinary kernels between them are not shown)."""
    timelines, at = [], 0.0
    for schedule in schedules:
        one = predict(schedule, at)
        timelines.append(one)
        at = max(one.end_us, at) + schedule["launch_us"]
    return timelines


# --- measured -------------------------------------------------------------------------------------

def _as_records(schedule: dict, buffer) -> np.ndarray:
    words = np.asarray(buffer)
    count = sum(len(q) for q in schedule["prog"])
    if words.ndim != 1 or words.size != count * TIMELINE_WORDS:
        raise ValueError(f"{schedule['kernel']}: timeline buffer of shape {words.shape} does not match "
                         f"its {count} instructions x {TIMELINE_WORDS} words; pass the buffer the "
                         "instrumented build of this same schedule returned")
    return words.astype(np.int64).reshape(count, TIMELINE_WORDS)


def decode(schedule: dict, buffer, t0_ns: int | None = None) -> Timeline:
    """The measured timeline of one rProgram from its instrumented kernel's buffer
    (``int64[instructions * 3]``: start ns, end ns, SM id per instruction in table order), times
    relative to ``t0_ns`` (default: its first start)."""
    _check(schedule)
    records = _as_records(schedule, buffer)
    if records.size and (np.any(records[:, 0] <= 0) or np.any(records[:, 1] < records[:, 0])
                         or np.any(records[:, 2] < 0)):
        bad = int(np.nonzero((records[:, 0] <= 0) | (records[:, 1] < records[:, 0])
                             | (records[:, 2] < 0))[0][0])
        raise ValueError(f"{schedule['kernel']}: instruction {bad} of the timeline buffer was not "
                         f"recorded (start, end, SM = {records[bad].tolist()}); did the kernel run to "
                         "the end?")
    t0 = int(records[:, 0].min()) if t0_ns is None and records.size else int(t0_ns or 0)
    slices, i = [], 0
    for veu, queue in enumerate(schedule["prog"]):
        for order, item in enumerate(queue):
            start, end, sm = (int(x) for x in records[i])
            make = _barrier_slice if item[0] == "barrier" else _task_slice
            slices.append(make(schedule, veu, sm, order, item, (start - t0) / 1e3, (end - t0) / 1e3))
            i += 1
    return Timeline(schedule["kernel"], "measured", len(schedule["prog"]), schedule["num_sms"],
                    tuple(slices), schedule["ops"])


def decode_all(schedules, buffers: dict) -> list:
    """Measured timelines of one run: ``buffers`` maps kernel name -> its timeline buffer; all on
    one clock, starting at the run's first recorded instruction."""
    missing = [s["kernel"] for s in schedules if s["kernel"] not in buffers]
    if missing:
        raise ValueError(f"no timeline buffer for {missing}; the run returned {sorted(buffers)}")
    starts = [int(_as_records(s, buffers[s["kernel"]])[:, 0].min()) for s in schedules
              if sum(len(q) for q in s["prog"])]
    t0 = min(starts) if starts else 0
    return [decode(s, buffers[s["kernel"]], t0) for s in schedules]


# --- summaries ------------------------------------------------------------------------------------

def shares(timeline: Timeline) -> dict:
    """Per-vEU shares of the kernel's span (first start to last end over all vEUs): busy (rTasks),
    wait (barrier-rTasks), idle (the rest), and their means over the vEUs."""
    span = timeline.span_us
    busy = [0.0] * timeline.num_veus
    wait = [0.0] * timeline.num_veus
    sm = [None] * timeline.num_veus
    for s in timeline.slices:
        (busy if s.kind == "rtask" else wait)[s.veu] += s.duration_us
        sm[s.veu] = s.sm
    veus = []
    for v in range(timeline.num_veus):
        b, w = (busy[v] / span, wait[v] / span) if span > 0 else (0.0, 0.0)
        veus.append({"veu": v, "sm": sm[v], "busy": round(b, 4), "wait": round(w, 4),
                     "idle": round(max(0.0, 1.0 - b - w), 4)})

    def mean(key):
        return round(sum(v[key] for v in veus) / len(veus), 4) if veus else 0.0

    return {"kernel": timeline.kernel, "source": timeline.source, "span_us": round(span, 3),
            "rtasks": sum(s.kind == "rtask" for s in timeline.slices),
            "barriers": sum(s.kind == "barrier" for s in timeline.slices),
            "busy": mean("busy"), "wait": mean("wait"), "idle": mean("idle"), "veus": veus}


def in_context_records(measured, schedules) -> dict:
    """Measured in-context rTask times for the profile database (kind "in_context"), keyed by rKernel
    (``op:version#hash``, the name the policy knew it by): the median, mean, min and max time of its
    rTasks as they ran inside the persistent kernels, next to the per-rTask time the policy used."""
    predicted = {}
    for schedule in schedules:
        for info in schedule["ops"].values():
            predicted[info["kernel"]] = info
    times: dict = {}
    where: dict = {}
    for timeline in measured:
        if timeline.source != "measured":
            raise ValueError(f"{timeline.kernel}: in-context times come from measured timelines, "
                             f"not {timeline.source} ones")
        schedule = next(s for s in schedules if s["kernel"] == timeline.kernel)
        for s in timeline.slices:
            if s.kind == "rtask":
                key = schedule["ops"][str(s.op)]["kernel"]
                times.setdefault(key, []).append(s.duration_us)
                where.setdefault(key, set()).add(timeline.kernel)
    records = {}
    for key, values in times.items():
        records[key] = {"in_context": True, "rtask_us": statistics.median(values),
                        "rtask_us_mean": statistics.fmean(values), "rtask_us_min": min(values),
                        "rtask_us_max": max(values), "count": len(values),
                        "predicted_rtask_us": predicted[key]["rtask_us"],
                        "operator": predicted[key]["name"], "rprograms": sorted(where[key])}
    return records
