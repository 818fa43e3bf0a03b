"""RProgram: Append/Wait semantics (paper 3.3, Figure 9) and validate() catching each broken invariant."""
import json

import pytest

from tvm_rammer.abstractions.rprogram import RProgram, ScheduleError
from tvm_rammer.abstractions.rtask import BarrierRTask, RTask

MATMUL, RELU, CONV = 0, 1, 2


def figure9() -> RProgram:
    """Figure 9: Matmul 0,1 on vEU 0, Relu 0..3 on vEU 1, Conv 0 on vEU 0 and Conv 1 on vEU 1, both
    waiting for Matmul and Relu."""
    program = RProgram(2)
    for i in range(2):
        program.append(RTask(MATMUL, i), 0)
    for i in range(4):
        program.append(RTask(RELU, i), 1)
    preds = [RTask(MATMUL, i) for i in range(2)] + [RTask(RELU, i) for i in range(4)]
    for i, veu in enumerate((0, 1)):
        program.wait(RTask(CONV, i), preds)
        program.append(RTask(CONV, i), veu)
    return program


def test_figure9_barriers_keep_only_the_last_task_of_the_other_veu():
    program = figure9()
    assert program.prog[0] == [RTask(MATMUL, 0), RTask(MATMUL, 1), BarrierRTask(((1, 3),)), RTask(CONV, 0)]
    assert program.prog[1] == [RTask(RELU, i) for i in range(4)] + [BarrierRTask(((0, 1),)), RTask(CONV, 1)]
    assert program.location(RTask(CONV, 1)) == (1, 5)
    assert program.awaited() == {(1, 3), (0, 1)}
    assert program.num_barriers == 2
    assert program.ops == [MATMUL, RELU, CONV]
    program.validate({MATMUL: 2, RELU: 4, CONV: 2}, {CONV: [MATMUL, RELU]})


def test_append_returns_the_order_after_the_barrier():
    program = RProgram(2)
    assert program.append(RTask(0, 0), 1) == 0
    program.wait(RTask(1, 0), [RTask(0, 0)])
    assert program.append(RTask(1, 0), 0) == 1  # barrier at order 0


def test_wait_on_consecutive_tasks_keeps_the_last():
    program = RProgram(2)
    for i in range(5):
        program.append(RTask(0, i), 0)
    program.wait(RTask(1, 0), [RTask(0, i) for i in (3, 0, 4, 1)])
    program.append(RTask(1, 0), 1)
    assert program.prog[1] == [BarrierRTask(((0, 4),)), RTask(1, 0)]


def test_wait_on_the_same_veu_is_dropped():
    program = RProgram(2)
    program.append(RTask(0, 0), 0)
    program.wait(RTask(1, 0), [RTask(0, 0)])
    program.append(RTask(1, 0), 0)
    assert program.prog[0] == [RTask(0, 0), RTask(1, 0)]
    assert program.num_barriers == 0


def test_wait_already_covered_by_an_earlier_barrier_is_dropped():
    program = RProgram(2)
    program.append(RTask(0, 0), 0)
    program.append(RTask(0, 1), 0)
    program.wait(RTask(1, 0), [RTask(0, 1)])
    program.append(RTask(1, 0), 1)
    program.wait(RTask(1, 1), [RTask(0, 0), RTask(0, 1)])
    program.append(RTask(1, 1), 1)
    assert program.prog[1] == [BarrierRTask(((0, 1),)), RTask(1, 0), RTask(1, 1)]


def test_one_barrier_for_several_veus():
    program = RProgram(3)
    program.append(RTask(0, 0), 0)
    program.append(RTask(0, 1), 1)
    program.wait(RTask(1, 0), [RTask(0, 1), RTask(0, 0)])
    program.append(RTask(1, 0), 2)
    assert program.prog[2] == [BarrierRTask(((0, 0), (1, 0))), RTask(1, 0)]


def test_interface_misuse_is_rejected():
    program = RProgram(2)
    with pytest.raises(ValueError, match="not appended yet"):
        program.wait(RTask(1, 0), [RTask(0, 0)])
    program.append(RTask(0, 0), 0)
    with pytest.raises(ValueError, match="already appended"):
        program.append(RTask(0, 0), 1)
    with pytest.raises(ValueError, match="call wait\\(\\) before append\\(\\)"):
        program.wait(RTask(0, 0), [])
    with pytest.raises(ValueError, match="vEU 2 is outside 0..1"):
        program.append(RTask(0, 1), 2)
    with pytest.raises(ValueError, match="num_veus >= 1"):
        RProgram(0)


def test_to_dict_is_json_able():
    summary = figure9().to_dict()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["prog"][0][2] == ["barrier", [[1, 3]], []]
    assert summary["num_rtasks"] == 8


# validate(): one hand-built broken program per invariant.
def test_validate_missing_rtask():
    program = RProgram.from_lists([[RTask(0, 0)], [RTask(0, 2)]])
    with pytest.raises(ScheduleError, match=r"missing rTask\(s\) of op 0: ids \[1\]"):
        program.validate({0: 3}, {})


def test_validate_duplicate_rtask():
    program = RProgram.from_lists([[RTask(0, 0), RTask(0, 1)], [RTask(0, 1)]])
    with pytest.raises(ScheduleError, match="duplicate RTask\\(op=0, rtask_id=1\\)"):
        program.validate({0: 2}, {})


def test_validate_rtask_outside_the_program_ops():
    with pytest.raises(ScheduleError, match="belongs to no operator"):
        RProgram.from_lists([[RTask(7, 0)]]).validate({}, {})
    with pytest.raises(ScheduleError, match="outside op 0's 1 rTasks"):
        RProgram.from_lists([[RTask(0, 0), RTask(0, 1)]]).validate({0: 1}, {})


def test_validate_barrier_on_a_barrier_or_nothing():
    on_barrier = RProgram.from_lists([[BarrierRTask(((1, 0),)), RTask(0, 0)], [BarrierRTask(((0, 1),)), RTask(0, 1)]])
    with pytest.raises(ScheduleError, match="which is a barrier, not an rTask"):
        on_barrier.validate({0: 2}, {})
    dangling = RProgram.from_lists([[RTask(0, 0)], [BarrierRTask(((0, 5),)), RTask(0, 1)]])
    with pytest.raises(ScheduleError, match="waits for \\(0, 5\\), which does not exist"):
        dangling.validate({0: 2}, {})


def test_validate_cycle_is_a_deadlock():
    # vEU 0 waits for vEU 1's second rTask, which sits after vEU 1's wait for vEU 0's second rTask.
    program = RProgram.from_lists(
        [
            [RTask(0, 0), BarrierRTask(((1, 2),)), RTask(1, 0)],
            [RTask(0, 1), BarrierRTask(((0, 2),)), RTask(1, 1)],
        ]
    )
    with pytest.raises(ScheduleError, match="deadlock: the waits form a cycle, 2 vEU"):
        program.validate({0: 2, 1: 2}, {})


def test_validate_wait_on_a_later_task_of_its_own_veu_deadlocks():
    program = RProgram.from_lists([[BarrierRTask(((0, 1),)), RTask(0, 0)]])
    with pytest.raises(ScheduleError, match="deadlock"):
        program.validate({0: 1}, {})


def test_validate_uncovered_dependency():
    # Op 1 on vEU 1 waits only for op 0's rTask on vEU 0, not for the one on vEU 2.
    program = RProgram.from_lists(
        [[RTask(0, 0)], [BarrierRTask(((0, 0),)), RTask(1, 0)], [RTask(0, 1)]]
    )
    with pytest.raises(ScheduleError, match="uncovered dependency op 0 -> op 1: .* \\(vEU 2, order 0\\)"):
        program.validate({0: 2, 1: 1}, {1: [0]})


def test_validate_dependency_order_on_the_same_veu():
    program = RProgram.from_lists([[RTask(1, 0), RTask(0, 0)]])
    with pytest.raises(ScheduleError, match="uncovered dependency op 0 -> op 1"):
        program.validate({0: 1, 1: 1}, {1: [0]})
    RProgram.from_lists([[RTask(0, 0), RTask(1, 0)]]).validate({0: 1, 1: 1}, {1: [0]})


def test_validate_transitive_cover_through_a_third_veu():
    # vEU 2 waits for vEU 1, which waited for vEU 0: op 0 -> op 2 is covered transitively.
    program = RProgram.from_lists(
        [
            [RTask(0, 0)],
            [BarrierRTask(((0, 0),)), RTask(1, 0)],
            [BarrierRTask(((1, 1),)), RTask(2, 0)],
        ]
    )
    program.validate({0: 1, 1: 1, 2: 1}, {1: [0], 2: [0, 1]})


def test_validate_ignores_predecessors_outside_the_program():
    RProgram.from_lists([[RTask(1, 0)]]).validate({1: 1}, {1: [0]})


def test_validate_is_linear_on_a_large_program():
    program = RProgram(132)
    for op in range(20):
        preds = program.tasks_of(op - 1) if op else []
        last = {}
        for task in preds:
            veu, order = program.location(task)
            last[veu] = task
        waited = set()
        for i in range(5000):
            task, veu = RTask(op, i), (i * 7 + op) % 132
            if last and veu not in waited:
                program.wait(task, last.values())
                waited.add(veu)
            program.append(task, veu)
    assert program.num_barriers > 0
    program.validate({op: 5000 for op in range(20)}, {op: [op - 1] for op in range(1, 20)})


# whole-operator waits (one completion counter instead of one position per vEU)
def _spread(num_veus=4, producers=8, consumers=4):
    """Op 0 spread over every vEU, op 1 after it on every vEU, waiting for op 0 whole."""
    program = RProgram(num_veus)
    for i in range(producers):
        program.append(RTask(0, i), i % num_veus)
    for i in range(consumers):
        task = RTask(1, i)
        program.wait_for_ops(task, {0: producers})
        program.append(task, i % num_veus)
    return program


def test_an_operator_wait_is_one_barrier_entry_per_vEU_and_validates():
    program = _spread()
    barriers = [item for items in program.prog for item in items if isinstance(item, BarrierRTask)]
    assert [b.ops for b in barriers] == [((0, 8),)] * 4 and all(not b.waits for b in barriers)
    assert program.awaited_ops() == [0] and program.awaited() == set()
    program.validate({0: 8, 1: 4}, {1: [0]})


def test_a_vEU_waits_for_an_operator_once():
    program = RProgram(2)
    program.append(RTask(0, 0), 0)
    program.append(RTask(0, 1), 1)
    for i in range(3):
        task = RTask(1, i)
        program.wait_for_ops(task, {0: 2})
        program.append(task, 0)
    assert program.num_barriers == 1
    program.validate({0: 2, 1: 3}, {1: [0]})


def test_operator_waits_with_a_wrong_count_or_a_cycle_are_rejected():
    wrong = RProgram.from_lists([[RTask(0, 0), BarrierRTask((), ((0, 3),)), RTask(1, 0)],
                                 [RTask(0, 1)]])
    with pytest.raises(ScheduleError, match="waits for 3 rTasks of op 0, which has 2"):
        wrong.validate({0: 2, 1: 1}, {1: [0]})
    cycle = RProgram.from_lists([[BarrierRTask((), ((1, 1),)), RTask(0, 0)],
                                 [BarrierRTask((), ((0, 1),)), RTask(1, 0)]])
    with pytest.raises(ScheduleError, match="deadlock.*op 1"):
        cycle.validate({0: 1, 1: 1}, {})
    with pytest.raises(ValueError, match="its own operator"):
        RProgram(1).wait_for_ops(RTask(0, 0), {0: 1})


def test_an_operator_wait_does_not_cover_another_operator():
    program = RProgram.from_lists([[RTask(0, 0), RTask(2, 0)],
                                   [RTask(1, 0), BarrierRTask((), ((0, 1),)), RTask(3, 0)]])
    with pytest.raises(ScheduleError, match="uncovered dependency op 2 -> op 3"):
        program.validate({0: 1, 1: 1, 2: 1, 3: 1}, {3: [0, 2]})
