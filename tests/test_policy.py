"""Wavefront policy (Algorithm 1, paper 3.3): invariants on random DAGs, SelectRKernels, the merge rule,
vEU re-sizing, determinism; and the analytical cost model it uses."""
import json
import random

import pytest

from tvm_rammer.scheduling.cost_model import CostModelConfig, rtask_time_us
from tvm_rammer.scheduling.policy import (OpGraph, PolicyConfig, replace_cost, schedule,
                                          schedule_wave, select_rkernels)
from tvm_rammer.abstractions.rtask import BarrierRTask, RKernel, ROperator, RTask
from tvm_rammer.abstractions.vdevice import VDevice

H100 = VDevice.for_arch("sm_90")


def kernel(rtasks, time_us, threads=1024, registers=64, shared=0, name="k"):
    return RKernel(name, rtasks, threads, registers, shared, time_us, "test")


def chain_graph(*ops_per_wave, preds=None, split_before=()):
    ops, waves = {}, []
    for wave in ops_per_wave:
        waves.append([])
        for uid, kernels in wave:
            ops[uid] = ROperator(uid, f"op{uid}", list(kernels))
            waves[-1].append(uid)
    return OpGraph(ops, preds or {}, waves, set(split_before))


def global_order(prog):
    """Run the program naively; return the step at which each (vEU, order) runs. Fails on deadlock."""
    pos, done, step, seq, finished = [0] * len(prog), set(), 0, {}, {}
    progress = True
    while progress:
        progress = False
        for veu, items in enumerate(prog):
            while pos[veu] < len(items):
                item = items[pos[veu]]
                if isinstance(item, BarrierRTask) and not (
                        all(w in done for w in item.waits)
                        and all(finished.get(op, 0) >= count for op, count in item.ops)):
                    break
                if isinstance(item, RTask):
                    finished[item.op] = finished.get(item.op, 0) + 1
                seq[(veu, pos[veu])] = step
                done.add((veu, pos[veu]))
                step, pos[veu], progress = step + 1, pos[veu] + 1, True
    assert all(pos[v] == len(items) for v, items in enumerate(prog)), "deadlock"
    return seq


def random_kernel(rng, vdevice):
    while True:
        k = RKernel(
            "r",
            rng.randint(1, 300),
            rng.choice([32, 64, 96, 128, 256, 512, 1024]),
            rng.choice([None, 16, 32, 64, 128, 255]),
            rng.choice([0, 0, 1024, 16384, 48000]),
            rng.uniform(0.5, 20.0),
            "random",
        )
        if vdevice.fits([k]):
            return k


def random_case(seed):
    rng = random.Random(seed)
    vdevice = VDevice(num_sms=rng.choice([1, 2, 3, 8]), smem_per_sm=rng.choice([102400, 233472]))
    num_ops = rng.randint(1, 25)
    level, preds, ops = {}, {}, {}
    for uid in range(num_ops):
        preds[uid] = sorted(p for p in range(uid) if rng.random() < 0.25)
        level[uid] = 1 + max((level[p] for p in preds[uid]), default=-1)
        ops[uid] = ROperator(uid, f"op{uid}", [random_kernel(rng, vdevice) for _ in range(rng.randint(1, 3))])
    waves = [[u for u in range(num_ops) if level[u] == lv] for lv in range(max(level.values()) + 1)]
    split = {i for i in range(len(waves)) if rng.random() < 0.2}
    config = PolicyConfig(
        cost=CostModelConfig(barrier_us=rng.choice([0.0, 0.8, 50.0]), launch_us=rng.choice([0.0, 4.0])),
        max_veus=rng.choice([None, None, 1, 5, 64]),
        selection=rng.choice(["paper", "fastest", "efficient"]),
        merge=rng.choice(["paper", "always", "never"]),
    )
    return OpGraph(ops, preds, waves, split), vdevice, config


@pytest.mark.parametrize("first_seed", range(0, 250, 25))
def test_random_dags_schedule_every_rtask_once_without_deadlock(first_seed):
    for seed in range(first_seed, first_seed + 25):
        graph, vdevice, config = random_case(seed)
        plans = schedule(graph, vdevice, config)
        plan_of = {op: i for i, plan in enumerate(plans) for op in plan.ops}
        assert sorted(plan_of) == sorted(graph.ops), f"seed {seed}: every op in exactly one rProgram"
        assert sum(len(p.ops) for p in plans) == len(graph.ops)
        for op, preds in graph.preds.items():
            assert all(plan_of[p] <= plan_of[op] for p in preds), f"seed {seed}: predecessor in a later rProgram"
        wave_of = {op: w for w, wave in enumerate(graph.waves) for op in wave}
        for i, plan in enumerate(plans):
            if i:
                first_wave = min(wave_of[op] for op in plan.ops)
                last_wave = max(wave_of[op] for op in plans[i - 1].ops)
                assert first_wave >= last_wave, f"seed {seed}: rPrograms follow the waves"
            kernels = plan.kernels(graph)
            assert plan.num_veus == plan.program.num_veus <= (config.max_veus or plan.num_veus)
            assert plan.veus_per_sm == vdevice.veus_per_sm(kernels.values())
            plan.program.validate({op: k.num_rtasks for op, k in kernels.items()}, graph.preds)
            seq = global_order(plan.program.prog)
            for veu, items in enumerate(plan.program.prog):
                for order, item in enumerate(items):
                    if isinstance(item, BarrierRTask):
                        assert all(seq[w] < seq[(veu, order)] for w in item.waits)
                        assert all(w[0] != veu for w in item.waits), "same-vEU waits are dropped"
                        assert len({w[0] for w in item.waits}) == len(item.waits), "one wait per vEU"
            for op in plan.ops:
                for pred in graph.preds.get(op, ()):
                    if pred in kernels:
                        latest = max(seq[plan.program.location(t)] for t in plan.program.tasks_of(pred))
                        earliest = min(seq[plan.program.location(t)] for t in plan.program.tasks_of(op))
                        assert latest < earliest


def test_schedule_is_deterministic():
    for seed in (3, 17, 101):
        graph, vdevice, config = random_case(seed)
        first = [p.to_dict() for p in schedule(graph, vdevice, config)]
        second = [p.to_dict() for p in schedule(graph, vdevice, config)]
        assert json.dumps(first) == json.dumps(second)


def test_sixteen_parallel_gemvs_share_one_rprogram_without_barriers():
    graph = chain_graph([(uid, [kernel(8, 3.0)]) for uid in range(16)])
    (plan,) = schedule(graph, H100)
    assert (plan.veus_per_sm, plan.num_veus) == (1, 132)
    assert plan.program.num_barriers == 0
    veus = {plan.program.location(RTask(op, i))[0] for op in range(16) for i in range(8)}
    assert len(veus) == 128, "each rTask on its own vEU"
    assert plan.reason == {op: "only" for op in range(16)}
    assert plan.predicted_us == pytest.approx(3.0 + CostModelConfig().launch_us)


# The paper's LSTM MatMul (3.3 / 5): fastest rKernel 1,024 rTasks at 4.28 us standalone, most efficient
# 16 rTasks at 7.46 us. On 132 vEUs, 1,024 rTasks take 8 rounds: 4.28 / 8 = 0.535 us per rTask.
LSTM_CONFIG = PolicyConfig(max_veus=132)


def lstm_matmul(uid):
    return (uid, [kernel(1024, 0.535, name="fast"), kernel(16, 7.46, name="efficient")])


def test_wide_wave_picks_the_most_efficient_rkernels_when_faster():
    graph = chain_graph([lstm_matmul(uid) for uid in range(8)])
    selected, reason = select_rkernels(graph.waves[0], None, graph, H100, LSTM_CONFIG)
    assert selected == {uid: 1 for uid in range(8)}
    assert set(reason.values()) == {"efficient"}
    (plan,) = schedule(graph, H100, LSTM_CONFIG)
    assert plan.selected == selected
    assert plan.predicted_us == pytest.approx(7.46 + 4.0)


def test_single_matmul_keeps_the_fastest_rkernel_when_efficient_is_slower():
    graph = chain_graph([lstm_matmul(0)])
    selected, reason = select_rkernels([0], None, graph, H100, LSTM_CONFIG)
    assert (selected, reason) == ({0: 0}, {0: "fastest"})
    (plan,) = schedule(graph, H100, LSTM_CONFIG)
    assert plan.predicted_us == pytest.approx(4.28 + 4.0)


def test_fastest_rkernels_that_do_not_fill_the_veus_are_taken_without_comparing():
    calls = []

    def profile(plan):
        calls.append(plan.ops)
        return None

    graph = chain_graph([(0, [kernel(64, 1.0), kernel(2, 40.0)]), (1, [kernel(64, 1.0), kernel(2, 40.0)])])
    selected, reason = select_rkernels([0, 1], None, graph, H100, LSTM_CONFIG, profile)
    assert selected == {0: 0, 1: 0} and set(reason.values()) == {"fastest"}
    assert calls == []


def test_selection_modes_force_a_version():
    graph = chain_graph([lstm_matmul(0)])
    (plan,) = schedule(graph, H100, PolicyConfig(max_veus=132, selection="efficient"))
    assert (plan.selected, plan.reason) == ({0: 1}, {0: "efficient"})
    graph = chain_graph([lstm_matmul(uid) for uid in range(8)])
    (plan,) = schedule(graph, H100, PolicyConfig(max_veus=132, selection="fastest"))
    assert set(plan.selected.values()) == {0}


def two_dependent_waves():
    # Producer on 132 vEUs, consumer with 132 rTasks: a merge needs barriers.
    return chain_graph([(0, [kernel(132, 2.0)])], [(1, [kernel(132, 2.0)])], preds={1: [0]})


def test_merge_rule_starts_a_new_rprogram_when_barriers_cost_more_than_a_launch():
    config = replace_cost(PolicyConfig(), launch_us=0.0, grid_sync_us=0.0, barrier_us=1e6)
    plans = schedule(two_dependent_waves(), H100, config)
    assert [p.ops for p in plans] == [[0], [1]]
    assert all(p.program.num_barriers == 0 for p in plans)


def test_merge_rule_merges_small_waves_with_default_costs():
    (plan,) = schedule(two_dependent_waves(), H100)
    assert plan.ops == [0, 1]
    assert plan.program.num_barriers > 0
    cost = CostModelConfig()
    assert plan.predicted_us == pytest.approx(2.0 + cost.barrier_us + 2.0 + cost.launch_us + cost.grid_sync_us)
    plan.program.validate({0: 132, 1: 132}, {1: [0]})


def test_an_all_to_all_dependency_is_one_operator_wait_per_consumer_veu():
    """132 consumer vEUs waiting for a producer on 132 vEUs: one operator-completion wait each (132
    entries), not 132 x 132 positions; over the wait limit the consumer starts a new rProgram."""
    (plan,) = schedule(two_dependent_waves(), H100, PolicyConfig(max_waits_per_op=132))
    barriers = [i for items in plan.program.prog for i in items if isinstance(i, BarrierRTask)]
    assert len(barriers) == 132 and all(not b.waits and len(b.ops) == 1 for b in barriers)
    assert len(schedule(two_dependent_waves(), H100, PolicyConfig(max_waits_per_op=131, merge="always"))) == 2


def test_a_predecessor_on_few_veus_is_waited_for_at_its_positions():
    few = chain_graph([(0, [kernel(4, 1.0)])], [(1, [kernel(132, 1.0)])], preds={1: [0]})
    (plan,) = schedule(few, H100, PolicyConfig(merge="always"))
    barriers = [i for items in plan.program.prog for i in items if isinstance(i, BarrierRTask)]
    assert barriers and all(not b.ops and 1 <= len(b.waits) <= 4 for b in barriers)


def test_merge_modes_and_split_points():
    huge_barrier = replace_cost(PolicyConfig(merge="always"), barrier_us=1e6)
    assert len(schedule(two_dependent_waves(), H100, huge_barrier)) == 1
    assert len(schedule(two_dependent_waves(), H100, PolicyConfig(merge="never"))) == 2
    split = chain_graph([(0, [kernel(8, 1.0)])], [(1, [kernel(8, 1.0)])], preds={1: [0]}, split_before={1})
    assert [p.ops for p in schedule(split, H100, PolicyConfig(merge="always"))] == [[0], [1]]


def test_a_wider_wave_resizes_the_veus_of_the_plan():
    narrow = kernel(200, 1.0, threads=128, registers=32)   # 16 vEUs per SM alone
    wide = kernel(4, 1.0, threads=1024, registers=64)      # 1 vEU per SM
    graph = chain_graph([(0, [narrow])], [(1, [wide])], preds={1: [0]})
    alone = schedule_wave([0], None, graph, H100)
    assert (alone.veus_per_sm, alone.num_veus) == (16, 2112)
    (plan,) = schedule(graph, H100, PolicyConfig(merge="always"))
    assert (plan.veus_per_sm, plan.num_veus) == (1, 132)
    assert all(plan.program.location(RTask(0, i))[0] < 132 for i in range(200))
    plan.program.validate({0: 200, 1: 4}, {1: [0]})


def test_a_wave_whose_rkernels_cannot_share_a_veu_is_cut():
    many_threads = kernel(4, 1.0, threads=1024, registers=32)
    many_registers = kernel(4, 1.0, threads=32, registers=255)
    graph = chain_graph([(0, [many_threads]), (1, [many_registers])])
    plans = schedule(graph, H100, PolicyConfig(merge="always"))
    assert [p.ops for p in plans] == [[0], [1]]


def test_profile_times_replace_the_analytical_ones():
    (plan,) = schedule(two_dependent_waves(), H100, profile=lambda plan: 1.0)
    assert (plan.predicted_us, plan.profiled) == (1.0, True)
    (plan,) = schedule(two_dependent_waves(), H100, profile=lambda plan: None)
    assert plan.profiled is False


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="PolicyConfig.selection='bogus'"):
        PolicyConfig(selection="bogus")
    with pytest.raises(ValueError, match="PolicyConfig.merge='sometimes'"):
        PolicyConfig(merge="sometimes")
    with pytest.raises(ValueError, match="PolicyConfig.max_waits_per_op=0"):
        PolicyConfig(max_waits_per_op=0)
    with pytest.raises(ValueError, match="op 0 is in waves 0 and 1"):
        chain_graph([(0, [kernel(1, 1.0)])], [(0, [kernel(1, 1.0)])])
    with pytest.raises(ValueError, match="a predecessor must sit in an earlier wave"):
        chain_graph([(0, [kernel(1, 1.0)]), (1, [kernel(1, 1.0)])], preds={1: [0]})
    too_big = chain_graph([(0, [kernel(1, 1.0, threads=1024, registers=128)])])
    with pytest.raises(ValueError, match="no rKernel of op 0"):
        schedule(too_big, H100)
    with pytest.raises(ValueError, match="RKernel.num_rtasks must be >= 1, got 0"):
        kernel(0, 1.0)
    with pytest.raises(ValueError, match="RKernel.time_us must be a finite positive"):
        kernel(1, float("nan"))
    with pytest.raises(ValueError, match="needs a non-empty list of RKernel"):
        ROperator(0, "empty", [])


def test_rkernel_versions_fastest_and_most_efficient():
    op = ROperator(0, "matmul", [kernel(1024, 0.535), kernel(16, 7.46)])
    assert op.fastest_index(132) == 0 and op.fastest(132) is op.kernels[0]
    assert op.fastest_index(16) == 1, "on 16 vEUs 1,024 rTasks take 64 rounds"
    assert op.most_efficient_index == 1 and op.most_efficient is op.kernels[1]
    assert op.kernels[0] == RKernel("k", 1024, 1024, 64, 0, 0.535, "test", payload=object())


def test_cost_model_roofline_per_veu():
    cost = CostModelConfig()
    # 1 GFLOP over 132 rTasks, one vEU per SM: each rTask gets 1/132 of 60 TFLOP/s -> 1e9 / 60e12 s.
    assert rtask_time_us(1e9, 0, 132, 1, cost) == pytest.approx(1e6 * 1e9 / 60e12 + 0.5)
    # Two vEUs per SM halve each vEU's share.
    assert rtask_time_us(1e9, 0, 132, 2, cost) == pytest.approx(2e6 * 1e9 / 60e12 + 0.5)
    # Memory bound: 3 GB at 3 TB/s.
    assert rtask_time_us(0, 3e9, 132, 1, cost) == pytest.approx(1000.0 + 0.5)
    with pytest.raises(ValueError, match="CostModelConfig.barrier_us must be >= 0, got -1"):
        CostModelConfig(barrier_us=-1)


def test_a_merged_wave_may_take_the_version_that_keeps_the_plans_vEU_shape():
    """SelectRKernels(W, P): the standalone-fastest 256-thread version would shrink P's vEUs from 16
    to 4 per SM (P holds 64-thread rTasks); the slower 64-thread version keeps them, and the merged
    rProgram is faster with it."""
    first = [(0, [kernel(2112, 3.0, threads=64)])]
    narrow, wide = kernel(4224, 1.2, threads=64, name="narrow"), kernel(528, 2.0, threads=256,
                                                                          name="wide")
    graph = chain_graph(first, [(1, [narrow, wide])], preds={1: [0]})
    config = PolicyConfig(max_waits_per_op=None)  # all-to-all waits between the two waves
    plan = schedule_wave([0], None, graph, H100, config)
    alone = schedule_wave([1], None, graph, H100, config)
    assert alone.selected[1] == 1  # standalone, the wide version is the fastest
    merged = schedule_wave([1], plan, graph, H100, config)
    assert merged.selected[1] == 0 and merged.reason[1] == "fits"
    assert merged.veus_per_sm == plan.veus_per_sm == 16


def test_select_veus_matches_a_plain_heap_on_random_timelines():
    import heapq

    from tvm_rammer.scheduling.policy import select_veus

    def reference(free, ready, count, time_us):
        heap = [(max(f, ready), v) for v, f in enumerate(free)]
        heapq.heapify(heap)
        chosen = []
        for _ in range(count):
            start, veu = heapq.heappop(heap)
            free[veu] = start + time_us
            chosen.append(veu)
            heapq.heappush(heap, (start + time_us, veu))
        return chosen

    rng = random.Random(7)
    for _ in range(500):
        num = rng.randint(1, 40)
        free = [rng.choice([0.0, 1.0, 2.5, rng.uniform(0, 10)]) for _ in range(num)]
        args = (rng.choice([0.0, 1.0, 3.0]), rng.randint(1, 3 * num), rng.choice([0.5, 1.0, 4.0]))
        mine, theirs = list(free), list(free)
        assert select_veus(mine, *args) == reference(theirs, *args)
        assert mine == theirs
