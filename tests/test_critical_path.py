"""The critical path of a schedule: the pure longest-path function and what inspect reports."""
import pytest

from tvm_rammer.config import RammerConfig
from tvm_rammer.scheduling.critical_path import (critical_path, last_chain, rounds_us,
                                      rprogram_critical_paths)
from tvm_rammer.views.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model

TARGET = "rammer/nvidia-h100"


def test_longest_chain_wins_over_the_most_expensive_operator():
    # 0 -> 1 -> 2 -> 4 (three cheap hops) against 0 -> 3 -> 4 (one costly operator)
    preds = {1: [0], 2: [1], 3: [0], 4: [2, 3]}
    cost = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.5, 4: 1.0}
    path = critical_path([0, 1, 2, 3, 4], preds, cost, barrier_us=1.0)
    assert path.operators == (0, 1, 2, 4)
    assert path.predicted_us == pytest.approx(4 * 1.0 + 3 * 1.0)
    without_barriers = critical_path([0, 1, 2, 3, 4], preds, cost, barrier_us=0.0)
    assert without_barriers.operators == (0, 3, 4)
    assert without_barriers.predicted_us == pytest.approx(4.5)


def test_predecessors_outside_the_program_cost_nothing():
    path = critical_path([5, 6], {5: [1, 2], 6: [5]}, {5: 2.0, 6: 3.0}, barrier_us=0.5)
    assert path.operators == (5, 6) and path.predicted_us == pytest.approx(5.5)
    assert critical_path([], {}, {}, 0.8).predicted_us == 0.0


def test_order_that_is_not_topological_is_rejected():
    with pytest.raises(ValueError, match="topological order"):
        critical_path([1, 0], {1: [0]}, {0: 1.0, 1: 1.0}, 0.8)
    with pytest.raises(ValueError, match="barrier_us"):
        critical_path([0], {}, {0: 1.0}, -1.0)


def test_last_chain_splits_the_finish_into_rtasks_barriers_and_waiting():
    # 0 -> 1, 2 alone; 1 is ready at 3 + 1 (barrier) but ends at 8 with 2 us of work: it waited 2 us
    finish = {0: 3.0, 1: 8.0, 2: 5.0}
    chain = last_chain(finish, {1: [0], 0: [9]}, {0: 3.0, 1: 2.0, 2: 5.0}, barrier_us=1.0)
    assert chain.operators == (0, 1)  # predecessor 9 is not in this rProgram
    assert (chain.rtask_us, chain.barrier_us, chain.waiting_us, chain.finish_us) == \
        pytest.approx((5.0, 1.0, 2.0, 8.0))
    # the predecessor that finished last is the one followed back
    chain = last_chain({0: 1.0, 1: 6.0, 2: 9.0}, {2: [0, 1]}, {0: 1.0, 1: 6.0, 2: 1.0}, 0.5)
    assert chain.operators == (1, 2) and chain.waiting_us == pytest.approx(1.5)
    assert last_chain({}, {}, {}, 0.8).finish_us == 0.0
    with pytest.raises(ValueError, match="barrier_us"):
        last_chain({0: 1.0}, {}, {0: 1.0}, -1.0)


def test_the_policys_timeline_splits_exactly_along_its_last_chain():
    """On random DAGs the wavefront policy's finish times decompose with no remainder: every
    operator of the chain waited >= 0 and the chain ends when the rProgram's timeline ends."""
    from test_policy import random_case
    from tvm_rammer.scheduling.policy import schedule

    for seed in range(20):
        graph, vdevice, config = random_case(seed)
        for plan in schedule(graph, vdevice, config):
            op_us = {op: rounds_us(k.time_us, k.num_rtasks, plan.num_veus)
                     for op, k in plan.kernels(graph).items()}
            chain = last_chain(plan.op_finish, graph.preds, op_us, config.cost.barrier_us)
            assert set(plan.op_finish) == set(plan.ops)
            assert chain.finish_us == pytest.approx(max(plan.op_finish.values()))
            assert chain.rtask_us + chain.barrier_us + chain.waiting_us == \
                pytest.approx(chain.finish_us)
            assert chain.waiting_us >= -1e-9
            ready = 0.0
            for k, op in enumerate(chain.operators):  # each operator waited >= 0 on its own
                if k:
                    ready = plan.op_finish[chain.operators[k - 1]] + config.cost.barrier_us
                assert plan.op_finish[op] - op_us[op] - ready >= -1e-9


def report(kernel, ops, num_veus=4):
    return {"kernel": kernel, "num_veus": num_veus,
            "operators": [{"name": n, "rtasks": r, "time_us_per_rtask": t} for n, r, t in ops]}


def test_programs_add_up_and_rounds_count_when_rtasks_exceed_veus():
    reports = [report("rammer_rprogram1", [("relu", 1, 1.0)]),
               report("rammer_rprogram0", [("matmul", 8, 2.0), ("add", 1, 1.0)])]
    operators = [(0, "matmul", []), (1, "add", [0]), (2, "relu", [1])]
    paths = rprogram_critical_paths(reports, operators, barrier_us=0.5)
    first, second = paths["programs"]
    assert first["kernel"] == "rammer_rprogram0" and first["path"] == ["matmul", "add"]
    assert first["predicted_us"] == pytest.approx(2 * 2.0 + 0.5 + 1.0)  # 8 rTasks on 4 vEUs
    assert first["work_us"] == pytest.approx((8 * 2.0 + 1.0) / 4)
    assert second["predicted_us"] == pytest.approx(1.0)  # the edge from rProgram 0 is a launch
    assert paths["operators"] == 3 and paths["predicted_us"] == pytest.approx(6.5)


def test_reports_that_do_not_match_the_graph_give_none():
    reports = [report("rammer_rprogram0", [("matmul", 1, 1.0)])]
    assert rprogram_critical_paths(reports, [(0, "conv2d", [])], 0.8) is None
    assert rprogram_critical_paths(reports, [], 0.8) is None


@pytest.fixture(scope="module")
def lstm_inspections():
    model = get_model("lstm_tc", **REDUCED["lstm_tc"])
    off = RammerConfig(tail_fusion=False, split_concat_matmul=False)
    return inspect_model(model, TARGET), inspect_model(model, TARGET, off)


@pytest.fixture(scope="module")
def lstm_without_epilogue():
    model = get_model("lstm_tc", **REDUCED["lstm_tc"])
    return inspect_model(model, TARGET, RammerConfig(gemv_epilogue=False))


def test_inspect_reports_the_critical_path_of_the_model_and_of_each_rprogram(lstm_inspections):
    summary, _ = lstm_inspections
    path = summary["critical_path"]
    programs = [p["critical_path"] for p in summary["programs"]]
    assert path["operators"] == sum(p["operators"] for p in programs) >= 1
    assert path["predicted_us"] == pytest.approx(sum(p["predicted_us"] for p in programs), abs=1e-2)
    for program, cp in zip(summary["programs"], programs):
        assert len(cp["path"]) == cp["operators"]
        assert cp["predicted_us"] <= program["predicted_us"]  # the policy's time bounds it
        assert cp["work_us"] <= program["predicted_us"]


def test_lstm_steps_are_at_most_three_dependent_operators(lstm_inspections):
    """The issue's bound: at most 3 dependent rTasks per LSTM step on the critical path (the
    wavefront's longest path crosses layers + seq_len - 1 steps), and the rewrites shorten it."""
    on, off = lstm_inspections
    kw = REDUCED["lstm_tc"]
    steps = kw["layers"] + kw["seq_len"] - 1
    assert on["critical_path"]["operators"] <= 3 * steps + 1  # + slicing the input's first step
    assert off["critical_path"]["operators"] > on["critical_path"]["operators"]


def test_the_gemv_epilogue_makes_a_step_one_dependent_operator(lstm_inspections,
                                                              lstm_without_epilogue):
    """With each cell's GEMV in its tail, the wavefront's longest path costs one operator per
    step along the time direction (two per layer: the input half, then the cell), against two
    per step without it; it starts with the first layer's batched input GEMM (3 operators)."""
    on, _ = lstm_inspections
    kw = REDUCED["lstm_tc"]
    seq_len, layers = kw["seq_len"], kw["layers"]
    assert on["critical_path"]["operators"] <= 3 + (seq_len - 1) + 2 * (layers - 1)
    assert lstm_without_epilogue["critical_path"]["operators"] > on["critical_path"]["operators"]
    assert on["critical_path"]["predicted_us"] < lstm_without_epilogue["critical_path"]["predicted_us"]
