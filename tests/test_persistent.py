"""The rProgram table encoding and the persistent-kernel spec (no TVM build needed)."""

import numpy as np
import pytest

from tvm_rammer.codegen.persistent import (INST_WORDS, Binding, DispatchEntry,
                                           PersistentKernelSpec, TensorSlot, encode_program,
                                           has_barriers)
from tvm_rammer.codegen.executor import Wait, decode_table
from tvm_rammer.abstractions.rprogram import RProgram
from tvm_rammer.abstractions.rtask import RTask


def decode(table, num_veus, offsets_len=0):
    """The package's decoder (``executor.decode_table``) in tuple form: prog[vEU] = list of
    ("task", kind, rtask_id, publish[, offsets]) / ("wait", [(vEU, step), ...])."""
    prog = []
    for items in decode_table(table, num_veus):
        row = []
        for item in items:
            if isinstance(item, Wait):
                row.append(("wait", list(item.pairs)))
            elif offsets_len:
                offsets = tuple(int(x) for x in table[item.offsets_at: item.offsets_at + offsets_len])
                row.append(("task", item.entry + 1, item.rtask_id, item.publish, offsets))
            else:
                row.append(("task", item.entry + 1, item.rtask_id, item.publish))
        prog.append(row)
    return prog


def _plain(ops):
    """Dispatch map without arena offsets: op uid -> (entry index, ())."""
    return {op: (k, ()) for op, k in ops.items()}


def figure9_program():
    """Paper Figure 9: Matmul rTasks 0,1 on vEU 0, Relu 0..3 on vEU 1, then Conv 0/1 waiting."""
    p = RProgram(2)
    mm = [RTask(0, i) for i in range(2)]
    relu = [RTask(1, i) for i in range(4)]
    for t in mm:
        p.append(t, 0)
    for t in relu:
        p.append(t, 1)
    conv = [RTask(2, 0), RTask(2, 1)]
    for veu, t in enumerate(conv):
        p.wait(t, mm + relu)
        p.append(t, veu)
    return p


def test_encode_figure9_round_trip():
    program = figure9_program()
    table = encode_program(program, _plain({0: 0, 1: 1, 2: 2}))
    assert table.dtype == np.int32
    prog = decode(table, 2)
    # vEU 0: two matmul rTasks, a barrier on vEU 1's last relu (order 3 -> step 4), conv 0
    assert prog[0][0] == ("task", 1, 0, 0)
    assert prog[0][1] == ("task", 1, 1, 2)       # vEU 1 waits for it: publishes step 2
    assert prog[0][2] == ("wait", [(1, 4)])
    assert prog[0][3] == ("task", 3, 0, 0)
    assert prog[1][3] == ("task", 2, 3, 4)       # the last relu publishes step 4
    assert prog[1][4] == ("wait", [(0, 2)])
    assert [item[2] for item in prog[1][:3]] == [0, 1, 2]
    assert all(item[3] == 0 for item in prog[1][:3])  # nobody waits for them: no publish
    assert has_barriers(table, 2)


def test_encode_publishes_exactly_the_awaited_tasks():
    program = figure9_program()
    table = encode_program(program, _plain({0: 0, 1: 1, 2: 2}))
    published = {(v, item[3] - 1) for v, items in enumerate(decode(table, 2))
                 for item in items if item[0] == "task" and item[3]}
    assert published == program.awaited()


def test_encode_without_barriers_and_trailing_veus_dropped():
    p = RProgram(4)
    for i in range(3):
        p.append(RTask(7, i), i)
    table = encode_program(p, _plain({7: 0}), num_veus=3)
    assert not has_barriers(table, 3)
    assert decode(table, 3) == [[("task", 1, i, 0)] for i in range(3)]
    with pytest.raises(ValueError, match="have rTasks"):
        encode_program(p, _plain({7: 0}), num_veus=2)


def test_operators_sharing_a_body_carry_their_own_arena_offsets():
    p = RProgram(2)
    p.append(RTask(10, 0), 0)
    p.append(RTask(11, 0), 1)
    table = encode_program(p, {10: (0, (0, 64)), 11: (0, (128, 192))})
    prog = decode(table, 2, offsets_len=2)
    assert prog[0] == [("task", 1, 0, 0, (0, 64))]
    assert prog[1] == [("task", 1, 0, 0, (128, 192))]


def test_encode_rejects_foreign_items():
    p = RProgram.from_lists([[RTask(0, 0)]])
    p.prog[0].append("not a task")
    with pytest.raises(TypeError, match="not an rTask"):
        encode_program(p, _plain({0: 0}))


class _Kernel:
    def __init__(self, threads, shared_bytes=0, num_rtasks=4):
        self.threads, self.shared_bytes, self.num_rtasks = threads, shared_bytes, num_rtasks


def test_spec_sizes_the_pool_to_the_largest_rtask_and_checks_width():
    slots = (TensorSlot("a", (4,), "float32"), TensorSlot("b", (4,), "float32"))
    bindings = (Binding(0), Binding(1))
    entries = (DispatchEntry(_Kernel(128, 1024), bindings), DispatchEntry(_Kernel(256, 4096), bindings))
    spec = PersistentKernelSpec("p", slots, 1, entries, veu_threads=256)
    assert spec.shared_bytes == 4096
    with pytest.raises(ValueError, match="narrower than the widest rTask"):
        PersistentKernelSpec("p", slots, 1, entries, veu_threads=128)
    with pytest.raises(ValueError, match="no operators"):
        PersistentKernelSpec("p", slots, 1, (), veu_threads=128)


def test_identical_wait_lists_are_stored_once():
    p = RProgram(5)
    for v in range(3):
        p.append(RTask(0, v), v)
    for k, v in enumerate((3, 4)):  # both consumers wait on all three producers: one shared list
        p.wait(RTask(1, k), [RTask(0, u) for u in range(3)])
        p.append(RTask(1, k), v)
    table = encode_program(p, _plain({0: 0, 1: 1}))
    prog = decode(table, 5)
    waits = [item for items in prog for item in items if item[0] == "wait"]
    assert waits == [("wait", [(0, 1), (1, 1), (2, 1)])] * 2
    records = 2  # one per operator: its counter (-1: none), no arena offsets
    pairs_stored = (len(table) - 6 - INST_WORDS * sum(len(items) for items in prog) - records) // 2
    assert pairs_stored == 3


def test_operator_waits_become_counter_pairs_and_counted_operators_carry_their_counter():
    from tvm_rammer.codegen.persistent import num_counters

    p = RProgram(3)
    for v in range(3):
        p.append(RTask(0, v), v)
    for v in range(3):
        p.wait_for_ops(RTask(1, v), {0: 3})
        p.append(RTask(1, v), v)
    table = encode_program(p, _plain({0: 0, 1: 1}))
    assert num_counters(p) == 1
    prog = decode(table, 3)
    waits = [item for items in prog for item in items if item[0] == "wait"]
    assert waits == [("wait", [(-1, 3)])] * 3  # counter 0 must reach op 0's 3 rTasks
    base = 4 + INST_WORDS * sum(len(items) for items in prog)
    counters = {}
    for v in range(3):
        for i in range(table[v], table[v + 1]):
            kind, _, _, c = table[4 + INST_WORDS * i: 4 + INST_WORDS * (i + 1)]
            if kind:
                counters[int(kind) - 1] = int(table[c])
    assert counters == {0: 0, 1: -1}  # op 0 counts its rTasks, op 1 does not
    assert base + 2 + 2 == len(table)  # one stored pair, two one-word records
