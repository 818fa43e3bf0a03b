"""One persistent CUDA kernel per rProgram (Rammer section 4.1.2, "vDevice and vEU on CUDA GPU").

The kernel is built directly in lowered TIR and goes through TVM's ordinary CUDA build afterwards:

* grid = the vEUs (``blockIdx.x``), block = the widest rTask's thread count (``threadIdx.x``);
* the rProgram ``prog[vEU][order]`` is *data*: a constant int32 table passed as an argument (see
  :func:`encode_program`), so the code holds each rKernel body once, whatever the placement; a
  different placement of the same operators reuses the same kernel code;
* each vEU walks its instruction list: an rTask instruction runs the rKernel body of one operator
  for one ``rtask_id`` (``tir_templates.rtask_rewrite.instantiate``), then ``__syncthreads`` (the
  shared-memory pool is reused by the next rTask), then, only if some barrier-rTask waits for it,
  publishes ``step[vEU] = order + 1``; a barrier-rTask instruction polls its wait list
  (``cuda_helpers.WAIT_SOURCE``) and ends with ``__syncthreads``;
* the step array is a fresh per-run buffer (a call_tir output): each vEU zeroes its own entry and
  one grid barrier follows (``cuda_helpers.GRID_SYNC_SOURCE``: a software barrier on three words of
  the module's fault page, not cooperative groups, whose headers cost nvcc most of a second per
  build); its words are 0 again after each barrier, so runs after runs reuse them, but two runs of
  one VM at the same time on two streams would share them (each VM has its own page);
  rPrograms without barrier-rTasks skip this prologue;
* cooperative launch (``tirx.kernel_launch_params``): a grid whose vEUs cannot all be co-resident
  fails at launch with CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE instead of hanging;
* instrumented build (``PersistentKernelSpec.timeline``, a separate kernel: the normal one has none
  of this): one more output parameter ``int64[num_instructions * 3]`` after the step state; the
  first thread of a vEU writes (start ns, end ns, SM id) of instruction ``i`` (table order) at
  ``3 * i`` (``cuda_helpers.RECORD_SOURCE``; decoded by ``tvm_rammer.scheduling.timeline``).
* a shared-memory pool larger than 48 KB (tensor-core rTasks with large tiles) is allocated as
  dynamic shared memory ("shared.dyn"): TVM passes its size at launch and opts the kernel in.
* ``PersistentKernelSpec.rkernel_functions`` (``RammerConfig.rkernel_functions``; CUDA only): each
  dispatch entry's body is marked here and becomes a ``__device__ __noinline__`` function of its
  own at the end of the TIR pipeline, called from the dispatch loop (``rkernel_functions``); the
  pool is then always dynamic shared memory, which each function declares again.
* faults: a barrier-rTask that waits past ``wait_timeout_ns`` records the fault in the step array's
  extra words and in the module's fault page (an extra input, ``tvm_rammer.codegen.faults``), every vEU
  skips its remaining instructions and the kernel ends normally (``cuda_helpers``): the host then
  raises an error naming the vEU and the rTask, and the CUDA context stays usable. The prologue's
  grid barrier has the same time limit (fault 2; the vEUs that gave up skip their instructions, the
  error word stops the others).

Operators that share one rKernel share one kernel body ("dispatch entry"): the tensors in which
they differ live in an arena (the rProgram's intermediates in one uint8 work buffer, its constants in
one uint8 blob), at per-operator element offsets stored in the table (``tir_templates.arena``).

Table layout (int32)::

    [0, V]                 first instruction of vEU v is at offsets[v], one past its last at offsets[v+1]
    [V+1, V+1+4*I)         instructions (kind, a, b, c): kind 0 = barrier-rTask, a = table index of its
                           first wait pair, b = number of pairs, c = table index of its prefetch
                           record (0: none); kind k+1 = rTask of dispatch
                           entry k, a = rtask_id, b = step to publish (0 = nobody waits for it),
                           c = table index of the operator's record
    [.., ..+2*W)           wait pairs of all barrier-rTasks: <vEU, step> (wait until state[vEU] >=
                           step) or <-(k+1), count> (wait until operator counter k >= count)
    [.., ..)               one record per operator: its counter k (-1 when no barrier waits for the
                           whole operator), then its arena offsets (elements)
    [.., end)              prefetch records (``PersistentKernelSpec.prefetch_slot``): the number of
                           ranges, then <first line, lines> per range (128-byte lines of the
                           weights blob) that the rTask after the barrier-rTask reads

Weights prefetched across barriers (``RammerConfig(prefetch_weights=True)``, CUDA only): a
barrier-rTask whose next rTask reads constants (the weights blob, ``codegen.tensors``) first has
its threads issue ``prefetch.global.L2`` for that rTask's share of them (rTask r of n: bytes
``[size * r / n, size * (r + 1) / n)`` of each constant, so an operator's rTasks together name it
whole), then polls (``cuda_helpers.PREFETCH_SOURCE``); the cost model overlaps that read with the
wait (``scheduling.cost_model``). With ``RammerConfig.prefetch_lookahead`` n > 1 the prefetch
moves up to n - 1 barrier-rTasks earlier on the same vEU, past operators that prefetch nothing
(an attention and its combine), so their waits overlap it too (:func:`prefetch_points`). Tensors
produced in the rProgram are never named.

The state (a per-run call_tir output) is int32[V + STATE_WORDS + K]: the step of each vEU, the
error word and the fault record (``cuda_helpers.STATE_WORDS`` words), then the K
operator-completion counters. Each rTask of a counted operator adds 1 to its counter
(release, after ``__syncthreads``), so one counter wait replaces a wait on every vEU the operator
ran on (``BarrierRTask.ops``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import tirx

from ..abstractions.rprogram import RProgram
from ..abstractions.rtask import BarrierRTask, RTask
from tir_templates.arena import rebase

from . import cuda_helpers, rkernel_functions
from .dialect import dialect_for
from .tir_pipeline import PRELOWERED_ATTR

INT32 = "int32"
BARRIER_KIND = 0
STATIC_SHARED_BYTES = 48 * 1024  # more than this must be dynamic shared memory
INST_WORDS = 4


@dataclass(frozen=True)
class TensorSlot:
    """A tensor that the persistent kernel reads or writes (one kernel parameter)."""

    name: str
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class Binding:
    """Where one kernel parameter's tensor is: a kernel parameter of its own (``slot``), or the
    arena ``slot`` at a fixed element ``offset``, or at the operator's ``table_pos``-th offset."""

    slot: int
    offset: int | None = None
    table_pos: int | None = None

    @property
    def in_arena(self) -> bool:
        return self.offset is not None or self.table_pos is not None


@dataclass(frozen=True)
class DispatchEntry:
    """One kernel body of the rProgram: a lowered rKernel and where its parameters' tensors are.
    Several operators may run through one entry (their arena offsets differ). One rTask of the
    entry runs ``blocks`` of the kernel's thread blocks in turn: rtask_id r covers blocks
    ``r * blocks`` to ``r * blocks + blocks - 1`` (the last rTask stops at the kernel's grid)."""

    kernel: object  # tir_templates.prelower.LoweredKernel
    bindings: tuple  # Binding per kernel parameter
    blocks: int = 1

    @property
    def num_offsets(self) -> int:
        return sum(b.table_pos is not None for b in self.bindings)


@dataclass(frozen=True)
class PersistentKernelSpec:
    """Everything the code of one persistent kernel depends on (the placement is not part of it)."""

    name: str
    tensors: tuple  # TensorSlot, inputs first
    num_inputs: int
    entries: tuple  # DispatchEntry; dispatch index k <-> instruction kind k + 1
    veu_threads: int
    wait_timeout_ns: int = 10_000_000_000  # a barrier-rTask gives up after this long (globaltimer)
    timeline: bool = False  # instrumented build: per-instruction start/end/SM (module docstring)
    rkernel_functions: bool = True  # each entry's body its own device function (rkernel_functions.py)
    prefetch_slot: int | None = None  # the weights blob (an input slot) barriers prefetch from

    def __post_init__(self):
        if not self.entries:
            raise ValueError(f"rProgram {self.name} has no operators")
        widest = max(e.kernel.threads for e in self.entries)
        if self.veu_threads < widest:
            raise ValueError(
                f"vEU width {self.veu_threads} is narrower than the widest rTask ({widest} threads)")
        if not 0 <= self.num_inputs <= len(self.tensors):
            raise ValueError(f"num_inputs={self.num_inputs} outside [0, {len(self.tensors)}]")
        if self.prefetch_slot is not None and not (
                0 <= self.prefetch_slot < self.num_inputs
                and self.tensors[self.prefetch_slot].dtype == "uint8"):
            raise ValueError(f"prefetch_slot={self.prefetch_slot} is not a uint8 input slot (the "
                             "weights blob)")

    @property
    def shared_bytes(self) -> int:
        """Shared-memory pool: sized to the largest rTask, reused by all (paper 4.1.3)."""
        return max(e.kernel.shared_bytes for e in self.entries)


def prefetch_lines(ranges, rtask_id: int, num_rtasks: int, fraction: float = 1.0) -> tuple:
    """The <first line, lines> pairs (``cuda_helpers.PREFETCH_LINE_BYTES``-byte lines of the weights
    blob) rTask ``rtask_id`` of ``num_rtasks`` prefetches: its share ``[size * r / n,
    size * (r + 1) / n)`` of each ``(byte offset, bytes)`` range, or the leading ``fraction`` of
    that share (weights beyond what the L2 holds: ``ROperator.prefetch_fraction``), empty shares
    left out."""
    line = cuda_helpers.PREFETCH_LINE_BYTES
    pairs = []
    for offset, size in ranges:
        lo = offset + size * rtask_id // num_rtasks
        hi = offset + size * (rtask_id + 1) // num_rtasks
        if fraction < 1:
            hi = lo + int((hi - lo) * fraction)
        if hi > lo:
            pairs.append((lo // line, (hi - 1) // line - lo // line + 1))
    return tuple(pairs)


def prefetch_points(queue, prefetching, lookahead: int = 1) -> dict:
    """Where each prefetch of one vEU's ``queue`` is issued: order of a barrier-rTask -> the rTask
    whose weights it prefetches. An rTask of an operator in ``prefetching`` right after a
    barrier-rTask is prefetched at the earliest of the last ``lookahead`` barrier-rTasks before it
    since the queue's previous rTask of such an operator (``PolicyConfig.prefetch_lookahead``:
    the waits of a chain of operators without weights, an attention's, all overlap the read of
    the next weights; the cost model credits those waits only)."""
    points, barriers = {}, []
    for order, task in enumerate(queue):
        if isinstance(task, BarrierRTask):
            barriers.append(order)
        elif isinstance(task, RTask) and task.op in prefetching:
            if barriers and barriers[-1] == order - 1:
                points[barriers[max(0, len(barriers) - lookahead)]] = task
            barriers = []
    return points


def encode_program(program: RProgram, dispatch: dict, num_veus: int | None = None,
                   prefetch: dict | None = None, lookahead: int = 1) -> np.ndarray:
    """The rProgram as the kernel's int32 table.

    ``dispatch`` maps operator uid -> (dispatch index, arena offsets of that operator). ``num_veus``
    may drop trailing vEUs whose queues are empty (they would idle in the grid sync).
    ``prefetch`` maps operator uid -> (its rTask count, ``((byte offset, bytes), ...)`` of the
    constants it reads in the weights blob[, the fraction of each share prefetched]): a
    barrier-rTask followed by an rTask of such an operator gets a prefetch record
    (:func:`prefetch_lines`), or an earlier barrier-rTask of its vEU (:func:`prefetch_points`,
    ``lookahead``); None or {}: no barrier prefetches.
    """
    prefetch = prefetch or {}
    num_veus = len(program.prog) if num_veus is None else num_veus
    if any(program.prog[num_veus:]):
        raise ValueError(f"cannot drop vEUs >= {num_veus}: they have rTasks")
    awaited = program.awaited()
    counter = {op: k for k, op in enumerate(program.awaited_ops())}
    insts, waits, offsets_of, wait_at = [], [], {}, {}
    records = []
    for op, (_, offsets) in dispatch.items():
        offsets_of[op] = len(records)
        records.extend((counter.get(op, -1), *offsets))
    fetches, fetch_at = [], {}  # prefetch records (flat) and record -> its index in them
    starts = [0]
    for veu, queue in enumerate(program.prog[:num_veus]):
        points = prefetch_points(queue, prefetch, lookahead) if prefetch else {}
        for order, task in enumerate(queue):
            if isinstance(task, BarrierRTask):
                key = (task.waits, task.ops)
                if key not in wait_at:  # identical wait lists are stored once
                    wait_at[key] = len(waits)
                    waits.extend((other, other_order + 1) for other, other_order in task.waits)
                    waits.extend((-(counter[op] + 1), count) for op, count in task.ops)
                after = points.get(order)
                lines = ()
                if after is not None:
                    num_rtasks, ranges, *fraction = prefetch[after.op]
                    lines = prefetch_lines(ranges, after.rtask_id, num_rtasks, *fraction)
                fetch = -1
                if lines:
                    if lines not in fetch_at:
                        fetch_at[lines] = len(fetches)
                        fetches.extend((len(lines), *(w for pair in lines for w in pair)))
                    fetch = fetch_at[lines]
                insts.append((BARRIER_KIND, wait_at[key], len(task.waits) + len(task.ops), fetch))
            elif isinstance(task, RTask):
                publish = order + 1 if (veu, order) in awaited else 0
                insts.append((dispatch[task.op][0] + 1, task.rtask_id, publish, offsets_of[task.op]))
            else:
                raise TypeError(f"prog[{veu}][{order}] is {type(task).__name__}, not an rTask")
        starts.append(len(insts))
    inst_base = num_veus + 1
    wait_base = inst_base + INST_WORDS * len(insts)
    record_base = wait_base + 2 * len(waits)
    fetch_base = record_base + len(records)
    table = np.zeros(fetch_base + len(fetches), dtype=np.int64)
    table[:inst_base] = starts
    if insts:
        body = np.asarray(insts, dtype=np.int64)
        barrier = body[:, 0] == BARRIER_KIND
        body[barrier, 1] = wait_base + 2 * body[barrier, 1]  # pair index -> absolute table index
        body[~barrier, 3] += record_base
        fetching = barrier & (body[:, 3] >= 0)
        body[fetching, 3] += fetch_base  # record index -> absolute table index (> 0)
        body[barrier & ~fetching, 3] = 0
        table[inst_base:wait_base] = body.reshape(-1)
    if waits:
        table[wait_base:record_base] = np.asarray(waits, dtype=np.int64).reshape(-1)
    table[record_base:fetch_base] = records
    table[fetch_base:] = fetches
    info = np.iinfo(np.int32)
    if table.size and (table.max() > info.max or table.min() < info.min):
        raise ValueError("the rProgram table does not fit int32 (arena larger than 2 GiB?)")
    return table.astype(np.int32)


def num_counters(program: RProgram) -> int:
    """Operator-completion counters the kernel of ``program`` keeps (``BarrierRTask.ops``)."""
    return len(program.awaited_ops())


def has_barriers(table: np.ndarray, num_veus: int) -> bool:
    """Whether an encoded rProgram contains any barrier-rTask."""
    offsets = table[: num_veus + 1]
    kinds = table[num_veus + 1: num_veus + 1 + INST_WORDS * int(offsets[-1]): INST_WORDS]
    return bool(np.any(kinds == BARRIER_KIND))


def waiting_barriers(table: np.ndarray, num_veus: int) -> list:
    """Table indices of the barrier-rTask instructions that wait for at least one pair, in table
    order (the fault injection of the tests and the emulator's negative controls edit them)."""
    base = num_veus + 1
    return [at for at in range(base, base + INST_WORDS * int(table[num_veus]), INST_WORDS)
            if table[at] == BARRIER_KIND and table[at + 2] > 0]


def _uniform(cond):
    """Mark a block-uniform condition, so TVM's ThreadSync may keep barriers inside it."""
    return tirx.call_intrin("bool", "tirx.tvm_thread_invariant", cond)


def _sync():
    return tirx.Evaluate(tirx.call_intrin(INT32, "tirx.tvm_storage_sync", "shared"))


def _ptr(buf):
    return tirx.address_of(tirx.BufferLoad(buf, [tirx.const(0, INT32)]))


def _entry_body(entry, buffers, table, rtask_id, offsets_at, tid, veu_threads, pool, instantiate):
    """One rTask of a dispatch entry; arena-bound parameters are rebased onto their arena, at the
    offsets that follow the counter in the operator's record at ``offsets_at``."""
    data, rebases = [], []
    for p, (param, binding) in enumerate(zip(entry.kernel.params, entry.bindings)):
        if not binding.in_arena:
            data.append(buffers[binding.slot])
            continue
        holder = tirx.decl_buffer(param.shape, str(param.dtype), name=f"{param.name}_arena{p}")
        offset = (tirx.const(binding.offset, INT32) if binding.offset is not None
                  else tirx.BufferLoad(table, [offsets_at + 1 + binding.table_pos]))
        data.append(holder)
        rebases.append((holder, buffers[binding.slot], offset))
    if entry.blocks == 1:
        stmt = instantiate(entry.kernel, data, rtask_id, tid, veu_threads, pool)
    else:  # a coarsened rTask: its blocks one after the other, the shared pool reused by each
        j = tirx.Var("block_in_rtask", INT32)
        block = rtask_id * entry.blocks + j
        one = instantiate(entry.kernel, data, block, tid, veu_threads, pool)
        stmt = tirx.For(j, 0, entry.blocks, tirx.ForKind.SERIAL, tirx.SeqStmt([
            tirx.IfThenElse(_uniform(block < entry.kernel.num_rtasks), one, None), _sync()]))
    for holder, arena, offset in rebases:
        stmt = rebase(stmt, holder, arena, offset)
    return stmt


def _flat_view(buf):
    """A view declared on an input's data, so the body names every input's data Var.

    TVM's RewriteDataflowReshape asks ``HasReshapePattern`` (which only accepts s_tir functions)
    about every call_tir whose callee names exactly one of its input arguments' data Vars in the
    body; a persistent kernel one of whose operators reads nothing (TVM simplified it away) would
    hit that. With the table and every input named, the count is never one."""
    return tirx.decl_buffer(buf.shape, buf.dtype, name=f"{buf.name}_in", data=buf.data)


def build_persistent_func(spec: PersistentKernelSpec, num_veus: int, table_len: int,
                          with_barriers: bool, instantiate: Callable,
                          veus_per_sm: int | None = None,
                          num_instructions: int | None = None,
                          counters: int = 0, dialect=None) -> tirx.PrimFunc:
    """The persistent PrimFunc of ``spec`` for ``num_veus`` vEUs and a table of ``table_len`` ints.

    Parameters: the input tensors, the program table, with barriers the fault page
    (``int32[cuda_helpers.PAGE_WORDS]``, a constant the module owns), the output tensors, the state
    (``int32[num_veus + cuda_helpers.STATE_WORDS + counters]``: the steps, the fault record, then
    ``counters`` operator-completion counters; see the module docstring).
    ``instantiate`` is ``tir_templates.rtask_rewrite.instantiate``. ``veus_per_sm`` becomes
    ``__launch_bounds__(veu_threads, veus_per_sm)``: nvcc then keeps the registers low enough for
    that many vEUs to be resident on every SM, which the cooperative launch relies on.
    ``dialect`` (``codegen.dialect``; default: the one of the target in scope) makes the helper
    calls, the grid barrier and the rTask instantiation of the device.
    With ``spec.timeline`` the timeline buffer (``int64[num_instructions * 3]``) is the last
    parameter; ``num_instructions`` (the table's ``offsets[num_veus]``) is then required.
    """
    if spec.timeline and not num_instructions:
        raise ValueError(f"{spec.name}: an instrumented (timeline) kernel needs num_instructions")
    dialect = dialect or dialect_for(tvm.target.Target.current(allow_none=True))
    instantiate = dialect.instantiate(instantiate)
    buffers = [tirx.decl_buffer(t.shape, t.dtype, name=t.name) for t in spec.tensors]
    table = tirx.decl_buffer((table_len,), INT32, name="rammer_program")
    program = tirx.decl_buffer((table_len,), INT32, name="rammer_program_view", data=table.data)
    counter_base = num_veus + cuda_helpers.STATE_WORDS
    state = tirx.decl_buffer((counter_base + counters,), INT32, name="rammer_state")
    page = tirx.decl_buffer((cuda_helpers.PAGE_WORDS,), INT32, name="rammer_fault_page")
    stop = tirx.decl_buffer((1,), INT32, name="rammer_stop", scope="local")
    veu = tirx.Var("veu", INT32)
    tid = tirx.Var("tid", INT32)
    outline = spec.rkernel_functions and dialect.kind == "cuda"
    pool = None
    if spec.shared_bytes:  # dynamic when outlined: each body's function declares it again
        pool = tirx.decl_buffer((spec.shared_bytes,), "uint8", name="rammer_smem",
                                scope="shared.dyn" if outline or spec.shared_bytes >
                                STATIC_SHARED_BYTES else "shared")

    pc = tirx.Var("pc", INT32)
    kind, arg_a, arg_b, arg_c = (tirx.Var(n, INT32) for n in ("kind", "arg_a", "arg_b", "arg_c"))
    start = tirx.BufferLoad(program, [veu])
    inst = num_veus + 1 + (start + pc) * INST_WORDS
    timeline = record = None
    if spec.timeline:
        timeline = tirx.decl_buffer((num_instructions * cuda_helpers.TIMELINE_WORDS,), "int64",
                                    name="rammer_timeline")
        began = tirx.Var("began", "int64")
        record = tirx.IfThenElse(tid == 0, tirx.Evaluate(dialect.call(
            cuda_helpers.RECORD_NAME, _ptr(timeline), start + pc, began,
            source_code=cuda_helpers.RECORD_SOURCE)), None)
    fetch = []
    if spec.prefetch_slot is not None and dialect.kind == "cuda":  # module docstring
        fetch = [tirx.IfThenElse(_uniform(arg_c > 0), tirx.Evaluate(dialect.call(
            cuda_helpers.PREFETCH_NAME, _ptr(buffers[spec.prefetch_slot]), _ptr(program), arg_c,
            tid, tirx.const(spec.veu_threads, INT32), source_code=cuda_helpers.PREFETCH_SOURCE)),
            None)]
    cases = [tirx.IfThenElse(_uniform(kind == BARRIER_KIND), tirx.SeqStmt([
        *fetch,
        tirx.Evaluate(dialect.call(
            cuda_helpers.WAIT_NAME, _ptr(program), _ptr(state), arg_a, arg_b,
            tirx.const(spec.veu_threads, INT32), tid, veu, tirx.const(num_veus, INT32), pc,
            inst + INST_WORDS, tirx.const(spec.wait_timeout_ns, "int64"), _ptr(page),
            tirx.const(kernel_id(spec.name), INT32), source_code=cuda_helpers.WAIT_SOURCE)),
        _sync(),
        *([record] if record else []),
        tirx.BufferStore(stop, dialect.call(
            cuda_helpers.STOPPED_NAME, _ptr(state), tirx.const(num_veus, INT32), tid,
            source_code=cuda_helpers.STOPPED_SOURCE, return_type=INT32), [0])]), None)]
    for k, entry in enumerate(spec.entries):
        rtask = _entry_body(entry, buffers, program, arg_a, arg_c, tid, spec.veu_threads, pool,
                            instantiate)
        if outline:
            rtask = rkernel_functions.mark(rtask, k)
        signal = tirx.IfThenElse(_uniform(arg_b > 0), tirx.IfThenElse(tid == 0, tirx.Evaluate(
            dialect.call(cuda_helpers.SIGNAL_NAME, _ptr(state), veu, arg_b,
                                   source_code=cuda_helpers.SIGNAL_SOURCE)), None), None)
        count = []
        if counters:
            which = tirx.BufferLoad(program, [arg_c])
            count = [tirx.IfThenElse(_uniform(which >= 0), tirx.IfThenElse(tid == 0, tirx.Evaluate(
                dialect.call(cuda_helpers.COUNT_NAME, _ptr(state), counter_base + which,
                                       source_code=cuda_helpers.COUNT_SOURCE)), None), None)]
        cases.append(tirx.IfThenElse(_uniform(kind == k + 1), tirx.SeqStmt(
            [rtask, _sync(), *([record] if record else []), *count, signal]), None))
    step = tirx.SeqStmt([tirx.Bind(kind, tirx.BufferLoad(program, [inst])),
                         tirx.Bind(arg_a, tirx.BufferLoad(program, [inst + 1])),
                         tirx.Bind(arg_b, tirx.BufferLoad(program, [inst + 2])),
                         tirx.Bind(arg_c, tirx.BufferLoad(program, [inst + 3])),
                         *([tirx.Bind(began, dialect.call(
                             cuda_helpers.TIMER_NAME, source_code=cuda_helpers.TIMER_SOURCE,
                             return_type="int64"))] if record else []),
                         *(cases if with_barriers else cases[1:])])
    if with_barriers:  # after a fault every vEU skips the rest of its instructions
        step = tirx.IfThenElse(_uniform(tirx.BufferLoad(stop, [0]) == 0), step, None)
    loop = tirx.For(pc, 0, tirx.BufferLoad(program, [veu + 1]) - start, tirx.ForKind.SERIAL, step)
    stmts = [tirx.DeclBuffer(program, data=table.data)]
    inputs = buffers[: spec.num_inputs]
    if inputs:  # see _flat_view
        stmts += [tirx.DeclBuffer(_flat_view(b), data=b.data) for b in inputs]
    if pool is not None:
        stmts.append(tirx.AllocBuffer(pool))
    if with_barriers:
        stmts += [tirx.AllocBuffer(stop), tirx.BufferStore(stop, tirx.const(0, INT32), [0]),
                  tirx.IfThenElse(tid == 0, tirx.BufferStore(state, tirx.const(0, INT32), [veu]), None),
                  tirx.IfThenElse(tirx.all(veu == 0, tid == 0),
                                  tirx.BufferStore(state, tirx.const(0, INT32), [num_veus]), None)]
        if counters:  # every thread of the grid zeroes counters i, i + grid size, ...
            grid = num_veus * spec.veu_threads
            i = tirx.Var("counter_round", INT32)
            index = (i * num_veus + veu) * spec.veu_threads + tid
            stmts.append(tirx.For(i, 0, -(-counters // grid), tirx.ForKind.SERIAL, tirx.IfThenElse(
                index < counters, tirx.BufferStore(state, tirx.const(0, INT32),
                                                   [counter_base + index]), None)))
        stmts.append(tirx.BufferStore(stop, dialect.grid_sync(
            _ptr(page), _ptr(state), num_veus, tid, spec.wait_timeout_ns, kernel_id(spec.name)), [0]))
    stmts.append(loop)
    body = tirx.SeqStmt(stmts)
    if veus_per_sm is not None:
        body = tirx.AttrStmt(tirx.const(0, INT32), "tirx.launch_bounds_min_blocks_per_sm",
                             tirx.const(veus_per_sm, INT32), body)
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(0, spec.veu_threads), tid, 1, "threadIdx.x"),
                         "thread_extent", spec.veu_threads, body)
    body = tirx.AttrStmt(tirx.IterVar(tvm.ir.Range(0, num_veus), veu, 1, "blockIdx.x"),
                         "thread_extent", num_veus, body)
    outputs = buffers[spec.num_inputs:]
    fault = [page] if with_barriers else []
    extra = [timeline] if timeline is not None else []
    func = tirx.PrimFunc([*inputs, table, *fault, *outputs, state, *extra], body)
    func = func.with_attrs({
        "global_symbol": spec.name,
        "tirx.noalias": True,
        "tirx.is_scheduled": True,
        "op_pattern": 8,  # opaque: no later Relax pass may fuse into it
        "tirx.kernel_launch_params": ["tirx.use_cooperative_launch"],
        "rammer.num_veus": num_veus,
        "rammer.veu_threads": spec.veu_threads,
        "rammer.state_words": counter_base + counters,
        "rammer.fault_page": bool(with_barriers),
        PRELOWERED_ATTR: True,  # tvm.compile skips the s_tir passes prelower ran (tir_pipeline.py)
    })
    if timeline is not None:
        func = func.with_attr("rammer.timeline_words", num_instructions * cuda_helpers.TIMELINE_WORDS)
    return dialect.finalize(func)


def kernel_id(name: str) -> int:
    """The number a persistent kernel reports itself by in the fault page: the ``k`` of
    ``rammer_rprogram<k>`` (0 for other names)."""
    digits = re.search(r"(\d+)$", name)
    return int(digits.group(1)) if digits else 0
