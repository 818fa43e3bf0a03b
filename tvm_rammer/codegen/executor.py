"""A reference executor of the persistent kernel's rProgram table (no GPU needed).

It decodes the int32 table the persistent kernel reads (``codegen.persistent``'s layout) and runs it
with simulated vEUs under many interleavings: random rTask durations, vEU speeds and adversarial
orders (one very slow vEU, speeds by vEU index, all rTasks of zero length with random tie-breaks).
What it checks, on the table itself and not on the policy's bookkeeping:

* every instruction decodes, each rTask instruction names exactly one operator of the rProgram
  (found from the tensors its kernel parameters are bound to: arena offsets read from the table);
* every rTask of every operator runs exactly once; nobody writes an input or the constants
  (except an operator writing in place, ``"inplace"``, into the input it names);
* every barrier-rTask is released and every vEU reaches the end of its list (no deadlock);
* every rTask starts only after every rTask of each operator producing one of its inputs has
  finished, per tensor, with producers taken from the Relax dataflow graph (the manifest);
* two tensors whose bytes overlap in one buffer (an arena) are never live at the same time.

The input is the rProgram's *manifest*: plain JSON-able data the back end attaches to each
persistent PrimFunc as the attribute ``rammer.manifest`` (:func:`build_manifest`), holding the
table, the kernel's buffers (slots), its dispatch entries' parameter bindings and, per operator, the
tensors of its parameters with their places. :func:`manifests` reads them back from any lowered
module; :func:`check` runs the trials and returns the problems found (empty: all good).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field

import numpy as np

from .persistent import BARRIER_KIND, INST_WORDS

MANIFEST_ATTR = "rammer.manifest"
MODES = ("random", "one_slow_veu", "speed_by_index", "zero_length", "reverse_speed")


class TableError(ValueError):
    """The table or its execution breaks an invariant (the message says which, where)."""


@dataclass(frozen=True)
class Wait:
    """A barrier-rTask: for every pair ``(vEU, step)`` wait until ``state[vEU] >= step``; for a pair
    ``(-(k+1), n)`` until operator counter ``k`` reached ``n``."""

    pairs: tuple


@dataclass(frozen=True)
class Task:
    """An rTask: ``rtask_id`` of dispatch entry ``entry``; ``publish`` > 0: the step it publishes;
    ``offsets_at``: table index of its operator's arena offsets; ``counter``: the operator counter
    it adds 1 to when it finishes (-1: none). (The table's operator record is [counter, offsets].)"""

    entry: int
    rtask_id: int
    publish: int
    offsets_at: int
    counter: int = -1


# --- decoding ---------------------------------------------------------------------------------

def decode_table(table, num_veus: int) -> list:
    """``prog[vEU]``: the vEU's instructions (:class:`Wait` / :class:`Task`), decoded from the int32
    table (layout: ``codegen.persistent``'s module docstring). TableError on a malformed table."""
    table = np.asarray(table, dtype=np.int64)
    if num_veus < 1 or table.size < num_veus + 1:
        raise TableError(f"table of {table.size} ints cannot hold the {num_veus + 1} vEU offsets")
    starts = [int(x) for x in table[: num_veus + 1]]
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise TableError(f"vEU offsets {starts[:8]}... are not non-decreasing from 0")
    base = num_veus + 1
    end = base + INST_WORDS * starts[-1]
    if end > table.size:
        raise TableError(f"{starts[-1]} instructions need {end} ints, the table has {table.size}")
    prog = []
    for veu in range(num_veus):
        items = []
        for i in range(starts[veu], starts[veu + 1]):
            kind, a, b, c = (int(x) for x in table[base + INST_WORDS * i: base + INST_WORDS * (i + 1)])
            where = f"vEU {veu} instruction {i - starts[veu]}"
            if kind == BARRIER_KIND:
                if b < 0 or a < end or a + 2 * b > table.size:
                    raise TableError(f"{where}: barrier wait list [{a}, +{b} pairs) outside the table")
                pairs = tuple((int(table[a + 2 * j]), int(table[a + 2 * j + 1])) for j in range(b))
                items.append(Wait(pairs))
            elif kind > 0:
                if a < 0 or b < 0 or not end <= c < table.size:
                    raise TableError(f"{where}: rTask fields (rtask_id {a}, publish {b}, record at "
                                     f"{c}) out of range")
                items.append(Task(kind - 1, a, b, c + 1, int(table[c])))
            else:
                raise TableError(f"{where}: unknown instruction kind {kind}")
        prog.append(items)
    return prog


# --- the manifest -----------------------------------------------------------------------------

def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else max(1, np.dtype(dtype).itemsize)


def _nbytes(shape, dtype) -> int:
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) * _itemsize(str(dtype))


def _tensor_id(graph, tensor, where) -> str:
    """A name unique within the rProgram: producer name#index:output, param:NAME or const@OFFSET
    (the constant's byte offset in the constants blob)."""
    if tensor.producer is not None:
        return f"{graph.nodes[tensor.producer].name}#{tensor.producer}:{tensor.index}"
    if tensor.is_constant:
        return f"const@{where[1]}"
    return f"param:{tensor.expr.name_hint if hasattr(tensor.expr, 'name_hint') else tensor.expr}"


def build_manifest(graph, node_ids, tensors, spec, table, num_veus: int, num_rtasks: dict) -> dict:
    """The JSON-able manifest of one rProgram (see the module docstring): ``graph`` the
    DataflowGraph, ``node_ids`` its operators, ``tensors`` the codegen TensorPlan, ``spec`` the
    PersistentKernelSpec, ``table`` the encoded program, ``num_rtasks[op]`` the rTask counts."""
    slots = [{"name": s.name, "shape": [int(d) for d in s.shape], "dtype": s.dtype,
              "nbytes": _nbytes(s.shape, s.dtype),
              "role": ("input" if k < spec.num_inputs else "output")} for k, s in
             enumerate(spec.tensors)]
    for s in slots:
        if s["name"] in ("weights", "work"):
            s["role"] = "constants" if s["name"] == "weights" else "work"
    entries = []
    for entry in spec.entries:
        params = []
        for param, binding in zip(entry.kernel.params, entry.bindings):
            params.append({"slot": binding.slot, "offset": binding.offset,
                           "table_pos": binding.table_pos, "dtype": str(param.dtype),
                           "nbytes": _nbytes(param.shape, param.dtype)})
        entries.append({"kernel": entry.kernel.name, "params": params})
    tensor_info, ops = {}, {}
    members = set(node_ids)
    written_into = {out: node.inputs[k] for node in (graph.nodes[op] for op in node_ids)
                    for out, k in zip(node.outputs, node.inplace)}
    for op in node_ids:
        node = graph.nodes[op]
        ids = []
        # an in-place operator's parameters are its inputs, those it writes listed in "inplace"
        for t in [*node.inputs, *([] if node.inplace else node.outputs)]:
            slot, offset = tensors.where[t]
            tid = _tensor_id(graph, t, (slot, offset))
            tensor_info[tid] = {"slot": slot, "offset": 0 if offset is None else offset,
                                "nbytes": _nbytes(t.shape, t.dtype), "dtype": t.dtype,
                                "producer": t.producer if t.producer in members else None}
            if t in written_into:  # the same bytes as the tensor it was written into
                tensor_info[tid]["aliases"] = _tensor_id(graph, written_into[t], (slot, offset))
            ids.append(tid)
        ops[str(op)] = {"name": node.name, "num_rtasks": int(num_rtasks[op]),
                        "reads": len(node.inputs), "params": ids,
                        **({"inplace": list(node.inplace)} if node.inplace else {})}
    return {"kernel": spec.name, "num_veus": int(num_veus),
            "table": [int(x) for x in np.asarray(table)], "slots": slots, "entries": entries,
            "tensors": tensor_info, "ops": ops}


def manifests(mod) -> list:
    """The manifests attached to the persistent kernels of a lowered module, by kernel name."""
    from tvm import tirx

    found = []
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and MANIFEST_ATTR in func.attrs:
            found.append(json.loads(str(func.attrs[MANIFEST_ATTR])))
            found[-1].setdefault("kernel", gv.name_hint)
    return sorted(found, key=lambda m: m["kernel"])


# --- static resolution ------------------------------------------------------------------------

@dataclass
class _Program:
    """A decoded table with every rTask instruction resolved to its operator."""

    prog: list
    op_of: dict  # (vEU, pc) -> op uid (str)
    ops: dict
    deps: dict  # op -> producer ops inside the rProgram
    ranges: dict  # op -> [(slot, start, end, writes)]
    problems: list = field(default_factory=list)


def _op_key(manifest, op: dict, entry: dict):
    """The (offsets tuple) an instruction of ``entry`` carries for ``op``, or None when ``op``'s
    tensors do not sit where the entry's fixed bindings put them."""
    tensors = manifest["tensors"]
    if len(entry["params"]) != len(op["params"]):
        return None
    offsets = {}
    for binding, tid in zip(entry["params"], op["params"]):
        t = tensors[tid]
        if t["slot"] != binding["slot"]:
            return None
        size = _itemsize(binding["dtype"])
        if binding["table_pos"] is not None:
            if t["offset"] % size:
                return None
            offsets[binding["table_pos"]] = t["offset"] // size
        elif binding["offset"] is not None:
            if binding["offset"] * size != t["offset"]:
                return None
        elif t["offset"] != 0:
            return None
    return tuple(offsets[k] for k in range(len(offsets)))


def _param_ranges(manifest, entry: dict, offsets: tuple, reads: int, inplace=()) -> list:
    """[(slot, start byte, end byte, writes)] of one instruction's kernel parameters (``inplace``:
    the positions among the reads that the operator also writes)."""
    out = []
    for p, binding in enumerate(entry["params"]):
        size = _itemsize(binding["dtype"])
        if binding["table_pos"] is not None:
            start = offsets[binding["table_pos"]] * size
        elif binding["offset"] is not None:
            start = binding["offset"] * size
        else:
            start = 0
        out.append((binding["slot"], start, start + binding["nbytes"], p >= reads or p in inplace))
    return out


def resolve(manifest: dict) -> _Program:
    """Decode the table and resolve every rTask to its operator; static problems are collected."""
    table = np.asarray(manifest["table"], dtype=np.int64)
    prog = decode_table(table, manifest["num_veus"])
    ops, entries, tensors, slots = (manifest["ops"], manifest["entries"], manifest["tensors"],
                                    manifest["slots"])
    problems = []
    by_key = {}
    for uid, op in ops.items():
        keys = [(k, key) for k, entry in enumerate(entries)
                if (key := _op_key(manifest, op, entry)) is not None]
        for k, key in keys:
            if (k, key) in by_key:
                problems.append(f"operators {ops[by_key[(k, key)]]['name']} and {op['name']} bind "
                                f"identical tensors through entry {k}: the table cannot tell them apart")
            by_key[(k, key)] = uid
        for tid in op["params"]:
            info = tensors[tid]
            if info["slot"] >= len(slots) or info["offset"] + info["nbytes"] > slots[info["slot"]]["nbytes"]:
                problems.append(f"{op['name']}: tensor {tid} [{info['offset']}, +{info['nbytes']}) "
                                f"lies outside buffer {info['slot']}")
    op_of, ranges, seen, counter_of = {}, {}, {}, {}
    for veu, items in enumerate(prog):
        for pc, item in enumerate(items):
            if not isinstance(item, Task):
                continue
            where = f"vEU {veu} instruction {pc}"
            if item.entry >= len(entries):
                problems.append(f"{where}: dispatch entry {item.entry} does not exist "
                                f"({len(entries)} entries)")
                continue
            entry = entries[item.entry]
            count = sum(b["table_pos"] is not None for b in entry["params"])
            offsets = tuple(int(x) for x in table[item.offsets_at: item.offsets_at + count])
            uid = by_key.get((item.entry, offsets))
            if uid is None:
                problems.append(f"{where}: rTask of entry {item.entry} ({entry['kernel']}) with arena "
                                f"offsets {offsets} binds no operator's tensors")
                continue
            op = ops[uid]
            if item.publish not in (0, pc + 1):
                problems.append(f"{where}: publishes step {item.publish}, not its order + 1 = {pc + 1}")
            counter_of.setdefault(uid, item.counter)
            if counter_of[uid] != item.counter:
                problems.append(f"{where}: rTask of {op['name']} counts on counter {item.counter}, "
                                f"another of its rTasks on {counter_of[uid]}")
            if not 0 <= item.rtask_id < op["num_rtasks"]:
                problems.append(f"{where}: rTask {item.rtask_id} of {op['name']} is outside its "
                                f"{op['num_rtasks']} rTasks")
            key = (uid, item.rtask_id)
            if key in seen:
                problems.append(f"rTask {item.rtask_id} of {op['name']} appears twice: at "
                                f"{seen[key]} and {where}")
            seen[key] = where
            op_of[(veu, pc)] = uid
            ranges.setdefault(uid, _param_ranges(manifest, entry, offsets, op["reads"],
                                                 op.get("inplace", ())))
    counted = [c for c in counter_of.values() if c >= 0]
    if len(counted) != len(set(counted)):
        problems.append("two operators count on one operator-completion counter")
    for uid, op in ops.items():
        missing = [i for i in range(op["num_rtasks"]) if (uid, i) not in seen]
        if missing:
            problems.append(f"{op['name']}: rTask(s) {missing[:8]} never run (not in the table)")
    read_only = {k for k, s in enumerate(slots) if s["role"] in ("input", "constants")}
    for uid, rs in ranges.items():
        in_place = {int(tensors[ops[uid]["params"][p]]["slot"]) for p in ops[uid].get("inplace", ())}
        for slot, _, _, writes in rs:
            if writes and slot in read_only and not (slot in in_place
                                                     and slots[slot]["role"] == "input"):
                problems.append(f"{ops[uid]['name']} writes buffer {slots[slot]['name']}, which is "
                                f"{slots[slot]['role']} (read-only)")
    deps = {uid: sorted({str(tensors[tid]["producer"]) for tid in op["params"][: op["reads"]]
                         if tensors[tid]["producer"] is not None} - {uid})
            for uid, op in ops.items()}
    return _Program(prog, op_of, ops, deps, ranges, problems)


# --- simulated execution ----------------------------------------------------------------------

def _speeds(num_veus: int, mode: str, rng) -> np.ndarray:
    """Time per unit of work of each vEU."""
    if mode == "one_slow_veu":
        speeds = np.ones(num_veus)
        speeds[rng.integers(num_veus)] = 1000.0
        return speeds
    if mode == "speed_by_index":
        return 1.0 + np.arange(num_veus, dtype=float)
    if mode == "reverse_speed":
        return 1.0 + np.arange(num_veus, dtype=float)[::-1]
    if mode == "zero_length":
        return np.zeros(num_veus)
    return rng.lognormal(0.0, 1.0, num_veus)


def execute(manifest: dict, rng=None, mode: str = "random", program: _Program | None = None) -> dict:
    """Run the table once with simulated vEUs; TableError at the first violation.

    Returns {"makespan": simulated time, "rtasks": rTasks run, "waits": barrier-rTasks passed}.
    """
    rng = np.random.default_rng(rng)
    prog = program if program is not None else resolve(manifest)
    if prog.problems:
        raise TableError(prog.problems[0])
    num_veus = manifest["num_veus"]
    ops = prog.ops
    speed = _speeds(num_veus, mode, rng)
    work = {uid: rng.lognormal(0.0, 0.5) for uid in ops}
    state = [0] * num_veus
    pc = [0] * num_veus
    done_count = {uid: 0 for uid in ops}
    first_start, last_end = {}, {}
    waiting = [[] for _ in range(num_veus)]  # waiting[u]: (vEU, step) blocked until state[u] >= step
    counters: dict = {}  # operator counter k -> rTasks finished
    counter_waiting: dict = {}  # k -> [(vEU, count)]

    def reached(o, s):
        return (0 <= o < num_veus and state[o] >= s) or (o < 0 and counters.get(-o - 1, 0) >= s)
    events = []  # (time, tie-break, kind, vEU, payload)

    def push(time, kind, veu, payload=None):
        heapq.heappush(events, (time, float(rng.random()), kind, veu, payload))

    for veu in range(num_veus):
        push(0.0, "next", veu)
    rtasks = waits = 0
    now = 0.0
    while events:
        now, _, kind, veu, payload = heapq.heappop(events)
        if kind == "end":
            uid, publish, counter = payload
            done_count[uid] += 1
            last_end[uid] = now
            if counter >= 0:
                counters[counter] = counters.get(counter, 0) + 1
                still = []
                for other, count in counter_waiting.pop(counter, []):
                    if count <= counters[counter]:
                        push(now, "next", other)
                    else:
                        still.append((other, count))
                if still:
                    counter_waiting[counter] = still
            if publish:
                if publish <= state[veu]:
                    raise TableError(f"vEU {veu} publishes step {publish} after step {state[veu]}")
                state[veu] = publish
                still = []
                for other, step in waiting[veu]:
                    if step <= publish:
                        push(now, "next", other)
                    else:
                        still.append((other, step))
                waiting[veu] = still
            push(now, "next", veu)
            continue
        items = prog.prog[veu]
        if pc[veu] >= len(items):
            continue
        item = items[pc[veu]]
        if isinstance(item, Wait):
            unmet = next(((o, s) for o, s in item.pairs if not reached(o, s)), None)
            if unmet is None:
                pc[veu] += 1
                waits += 1
                push(now, "next", veu)
            elif 0 <= unmet[0] < num_veus:
                waiting[unmet[0]].append((veu, unmet[1]))
            elif unmet[0] < 0:
                counter_waiting.setdefault(-unmet[0] - 1, []).append((veu, unmet[1]))
            continue
        uid = prog.op_of[(veu, pc[veu])]
        for dep in prog.deps[uid]:
            if done_count[dep] < ops[dep]["num_rtasks"]:
                raise TableError(
                    f"race: rTask {item.rtask_id} of {ops[uid]['name']} (vEU {veu} instruction "
                    f"{pc[veu]}) starts at t={now:.3g} while {ops[dep]['num_rtasks'] - done_count[dep]}"
                    f" rTask(s) of {ops[dep]['name']}, which produces one of its inputs, have not "
                    f"finished (mode {mode})")
        first_start.setdefault(uid, now)
        pc[veu] += 1
        rtasks += 1
        duration = speed[veu] * work[uid] * (0.0 if mode == "zero_length" else rng.lognormal(0, 0.3))
        push(now + duration, "end", veu, (uid, item.publish, item.counter))
    stuck = [v for v in range(num_veus) if pc[v] < len(prog.prog[v])]
    if stuck:
        detail = "; ".join(
            f"vEU {v} at instruction {pc[v]} waits for "
            f"{[(o, s) for o, s in prog.prog[v][pc[v]].pairs if not reached(o, s)]}"
            for v in stuck[:4] if isinstance(prog.prog[v][pc[v]], Wait))
        raise TableError(f"deadlock: {len(stuck)} vEU(s) never finish (mode {mode}): {detail}")
    _check_live_overlaps(manifest, prog, first_start, last_end)
    return {"makespan": now, "rtasks": rtasks, "waits": waits}


def _check_live_overlaps(manifest, prog, first_start, last_end) -> None:
    """Two tensors with overlapping bytes in one buffer must never be live at the same time."""
    tensors, ops = manifest["tensors"], prog.ops
    readers = {}
    for uid, op in ops.items():
        for tid in op["params"][: op["reads"]]:
            readers.setdefault(tid, []).append(uid)
    live = []
    for tid, t in tensors.items():
        producer = None if t["producer"] is None else str(t["producer"])
        users = readers.get(tid, []) + ([producer] if producer else [])
        if not users or t["nbytes"] == 0:
            continue
        start = first_start.get(producer, -math.inf) if producer else -math.inf
        end = max(last_end.get(u, math.inf) for u in users) if producer else math.inf
        live.append((t["slot"], t["offset"], t["offset"] + t["nbytes"], start, end, tid))
    live.sort()
    for i, (slot, lo, hi, start, end, tid) in enumerate(live):
        for other in live[i + 1:]:
            if other[0] != slot or other[1] >= hi:
                break
            if tensors[tid].get("aliases") == other[5] or tensors[other[5]].get("aliases") == tid:
                continue  # written in place: the new contents of the old tensor's bytes
            if other[3] < end and start < other[4]:
                raise TableError(f"arena overlap: {tid} [{lo}, {hi}) and {other[5]} "
                                 f"[{other[1]}, {other[2]}) share bytes of buffer "
                                 f"{manifest['slots'][slot]['name']} while both are live")


def check(manifest: dict, trials: int = 16, seed: int = 0) -> list:
    """Problems found in one rProgram: static ones, then the first violation of each simulated
    run (``trials`` runs cycling through the adversarial modes). [] = correct under every run."""
    try:
        program = resolve(manifest)
    except TableError as err:
        return [str(err)]
    if program.problems:
        return list(program.problems)
    problems = []
    for trial in range(trials):
        mode = MODES[trial % len(MODES)]
        try:
            execute(manifest, np.random.default_rng([seed, trial]), mode, program)
        except TableError as err:
            if str(err) not in problems:
                problems.append(str(err))
    return problems


def check_module(mod, trials: int = 16, seed: int = 0) -> dict:
    """{kernel name: problems} for every persistent kernel of a lowered module."""
    return {m["kernel"]: check(m, trials, seed) for m in manifests(mod)}
