"""Scheduling policies as plug-ins (tvm_rammer.scheduling.policies): every policy's rPrograms pass the invariant
checker on random DAGs; IOS's dynamic programme equals brute force on small graphs; Opara's launch
order on a crafted graph; the registry, RammerConfig.policy and --policy; the Relax rewrite's emit
order for rPrograms that do not follow the waves; the predicted-time table on a reduced model."""
import dataclasses
import itertools
import math
import random

import pytest

from tvm_rammer import cli
from tvm_rammer.config import POLICIES as POLICY_NAMES
from tvm_rammer.config import RammerConfig
from tvm_rammer.scheduling.policies import POLICIES, get_policy, ios, opara
from tvm_rammer.scheduling.policy import OpGraph, PolicyConfig, bfs_waves
from tvm_rammer.abstractions.rtask import RKernel, ROperator
from tvm_rammer.abstractions.vdevice import VDevice

from test_policy import global_order, random_case

H100 = VDevice.for_arch("sm_90")


def check_plans(graph, plans, label):
    """Every op once, rPrograms in dependency order, each rProgram valid (the invariant checker) and
    free of deadlock when run naively."""
    plan_of = {op: i for i, plan in enumerate(plans) for op in plan.ops}
    assert sorted(plan_of) == sorted(graph.ops), f"{label}: every op in exactly one rProgram"
    assert sum(len(p.ops) for p in plans) == len(graph.ops)
    for op, preds in graph.preds.items():
        assert all(plan_of[p] <= plan_of[op] for p in preds), f"{label}: predecessor in a later rProgram"
    wave_of = {op: w for w, wave in enumerate(graph.waves) for op in wave}
    for split in graph.split_before:
        for plan in plans:
            waves = {wave_of[op] for op in plan.ops}
            assert not (min(waves) < split <= max(waves)), f"{label}: an rProgram crosses a split"
    for plan in plans:
        kernels = plan.kernels(graph)
        plan.program.validate({op: k.num_rtasks for op, k in kernels.items()}, graph.preds)
        global_order(plan.program.prog)


@pytest.mark.parametrize("name", ["ios", "opara"])
@pytest.mark.parametrize("first_seed", range(0, 120, 40))
def test_every_policy_passes_the_invariant_checker_on_random_dags(name, first_seed):
    for seed in range(first_seed, first_seed + 40):
        graph, vdevice, config = random_case(seed)
        if seed % 3 == 0:  # tiny budgets: the IOS windows are cut down to single operators
            config = dataclasses.replace(config, ios_budget=random.Random(seed).choice([1, 5, 40]))
        check_plans(graph, get_policy(name)(graph, vdevice, config), f"{name} seed {seed}")


def test_policies_are_deterministic():
    for seed in (3, 17, 101):
        graph, vdevice, config = random_case(seed)
        for policy in POLICIES.values():
            first = [p.to_dict() for p in policy(graph, vdevice, config)]
            assert first == [p.to_dict() for p in policy(graph, vdevice, config)]


# --- IOS ------------------------------------------------------------------------------------------

def components(stage, preds):
    """Connected components of ``stage`` (edges of ``preds`` inside it), by union-find."""
    parent = {op: op for op in stage}

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for op in stage:
        for p in preds.get(op, ()):
            if p in parent:
                parent[find(p)] = find(op)
    groups = {}
    for op in stage:
        groups.setdefault(find(op), []).append(op)
    return list(groups.values())


def is_ending(stage, remaining, preds):
    return not any(p in stage and v not in stage for v in remaining for p in preds.get(v, ()))


def pruned_endings(remaining, preds, r, s):
    """Every ending of ``remaining`` within IOS's pruning, by enumerating all subsets."""
    items = sorted(remaining)
    found = []
    for k in range(1, len(items) + 1):
        for subset in itertools.combinations(items, k):
            stage = set(subset)
            if not is_ending(stage, remaining, preds):
                continue
            groups = components(stage, preds)
            if len(groups) <= s and all(len(g) <= r for g in groups):
                found.append(frozenset(stage))
    return found


def brute_force(ops, preds, cost, r, s):
    """Best total cost over every partition into stages (the last stage an ending of the rest)."""
    order = {op: k for k, op in enumerate(ops)}
    memo = {}

    def best(remaining):
        if not remaining:
            return 0.0
        if remaining not in memo:
            memo[remaining] = min(best(remaining - e) + cost(tuple(sorted(e, key=order.get)))
                                  for e in pruned_endings(remaining, preds, r, s))
        return memo[remaining]

    return best(frozenset(ops))


def small_dag(seed, n):
    rng = random.Random(seed)
    preds = {v: sorted(u for u in range(v) if rng.random() < 0.35) for v in range(n)}
    return list(range(n)), preds


def random_stage_cost(seed):
    """A deterministic but arbitrary non-negative cost per stage."""
    def cost(stage):
        return random.Random(hash((seed, stage))).uniform(0.5, 10.0)
    return cost


def check_stages(ops, preds, stages, r, s):
    assert sorted(op for st in stages for op in st) == sorted(ops)
    remaining = set(ops)
    for stage in reversed(stages):
        assert is_ending(set(stage), remaining, preds)
        groups = components(stage, preds)
        assert len(groups) <= s and all(len(g) <= r for g in groups)
        remaining -= set(stage)


def test_ios_endings_are_exactly_the_pruned_endings_each_once():
    for seed in range(40):
        ops, preds = small_dag(seed, random.Random(seed).randint(1, 8))
        succ = [0] * len(ops)
        adj = [0] * len(ops)
        for v in ops:
            for u in preds[v]:
                succ[u] |= 1 << v
                adj[u] |= 1 << v
                adj[v] |= 1 << u
        for r, s in ((1, 1), (2, 2), (3, 8), (8, 8)):
            full = (1 << len(ops)) - 1
            got = [frozenset(i for i in ops if m >> i & 1) for m in ios.endings(full, succ, adj, r, s)]
            assert len(got) == len(set(got)), f"seed {seed}: an ending enumerated twice"
            assert set(got) == set(pruned_endings(frozenset(ops), preds, r, s)), f"seed {seed} r={r} s={s}"


@pytest.mark.parametrize("r,s", [(1, 8), (2, 2), (3, 8), (3, 1)])
def test_ios_dp_equals_brute_force_for_an_arbitrary_stage_cost(r, s):
    for seed in range(25):
        ops, preds = small_dag(seed, random.Random(seed).randint(1, 7))
        cost = random_stage_cost(seed)
        total, stages = ios.ios_dp(ops, preds, cost, r, s)
        assert total == pytest.approx(brute_force(ops, preds, cost, r, s)), f"seed {seed}"
        assert total == pytest.approx(sum(cost(tuple(st)) for st in stages))
        check_stages(ops, preds, stages, r, s)


def test_ios_dp_equals_brute_force_with_the_vdevice_stage_latency():
    checked = 0
    for seed in range(400):
        graph, vdevice, config = random_case(seed)
        if not 2 <= len(graph.ops) <= 7:
            continue
        ops = [op for wave in graph.waves for op in wave]
        cost = ios.stage_cost(graph, vdevice, config)
        total, stages = ios.ios_dp(ops, graph.preds, cost, 3, 8)
        assert total == pytest.approx(brute_force(ops, graph.preds, cost, 3, 8)), f"seed {seed}"
        check_stages(ops, graph.preds, stages, 3, 8)
        checked += 1
    assert checked >= 20


def test_ios_pruning_to_one_operator_per_stage_is_the_sequential_schedule():
    graph, vdevice, config = random_case(11)
    config = dataclasses.replace(config, ios_group_ops=1, ios_groups=1)
    stages, _ = ios.ios_stages(graph, vdevice, config)
    assert all(len(stage) == 1 for stage in stages)
    assert sorted(op for st in stages for op in st) == sorted(graph.ops)


def test_ios_puts_independent_small_operators_in_one_stage():
    # Four small independent operators and a chain after them: one stage for the four (together
    # they fill a quarter of the vEUs) beats four stages of one.
    kernel = RKernel("k", 8, 256, 32, 0, 5.0, "test")
    ops = {uid: ROperator(uid, f"op{uid}", [kernel]) for uid in range(5)}
    graph = OpGraph(ops, {4: [0, 1, 2, 3]}, [[0, 1, 2, 3], [4]])
    stages, _ = ios.ios_stages(graph, H100)
    assert stages == [[0, 1, 2, 3], [4]]


def test_ios_dp_rejects_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="topological order"):
        ios.ios_dp([1, 0], {1: [0]}, lambda st: 1.0)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        ios.ios_dp([0], {}, lambda st: -1.0)
    with pytest.raises(ios.OverBudget):
        ios.ios_dp(list(range(6)), {}, lambda st: 1.0, budget=3)
    with pytest.raises(ValueError, match="ios_groups"):
        PolicyConfig(ios_groups=0)


# --- Opara ----------------------------------------------------------------------------------------

def op(uid, rtasks, compute):
    kernel = RKernel(f"k{uid}", rtasks, 256, 32, 0, 2.0, "test")
    flops, nbytes = (1e9, 1e6) if compute else (1e6, 1e6)  # 1000 vs 1 FLOP per byte
    return ROperator(uid, f"op{uid}", [kernel], flops=flops, bytes=nbytes)


def crafted_graph(with_memory=True):
    """source (memory) -> c1 (compute, 64 rTasks), c2 (compute, 8), m1 (memory, 32), m2 (memory, 4)
    -> join (compute)."""
    ops = [op(0, 16, False), op(1, 64, True), op(2, 8, True), op(5, 16, True)]
    if with_memory:
        ops += [op(3, 32, False), op(4, 4, False)]
    middle = [o.uid for o in ops if o.uid in (1, 2, 3, 4)]
    return OpGraph({o.uid: o for o in ops}, {**{m: [0] for m in middle}, 5: middle},
                   [[0], middle, [5]])


def test_opara_classifies_by_arithmetic_intensity_and_sizes_by_device_share():
    graph = crafted_graph()
    assert [opara.is_compute_intensive(graph.ops[u]) for u in (0, 1, 2, 3, 4, 5)] == \
        [False, True, True, False, False, True]
    assert not opara.is_compute_intensive(ROperator(9, "x", [graph.ops[0].kernels[0]]))  # unknown
    # 8 rTasks of 256 threads (1/8 of an SM's 2048 threads each) on 132 SMs
    assert opara.resource_demand(graph.ops[2], H100) == pytest.approx(8 * (256 / 2048) / 132)
    assert opara.resource_demand(graph.ops[2], H100) < opara.resource_demand(graph.ops[1], H100)


def test_opara_interleaves_memory_and_compute_smallest_first():
    graph = crafted_graph()
    order = opara.launch_order(graph, [0, 1, 2, 3, 4, 5], H100)
    assert order == [0, 2, 4, 1, 3, 5]  # m, c (small), m (small), c, m, then the join
    units, splits = opara.opara_units(graph, H100)
    assert (units, splits) == ([[0], [2, 4, 1, 3], [5]], set())


def test_opara_takes_from_the_other_list_when_one_is_empty():
    graph = crafted_graph(with_memory=False)
    assert opara.launch_order(graph, [0, 1, 2, 5], H100) == [0, 2, 1, 5]


def test_opara_places_rtasks_in_its_launch_order():
    graph = crafted_graph()
    (plan,) = get_policy("opara")(graph, H100, PolicyConfig(merge="always"))
    assert plan.program.ops == [0, 2, 4, 1, 3, 5]
    (rammer,) = get_policy("rammer")(graph, H100, PolicyConfig(merge="always"))
    assert rammer.program.ops == [0, 1, 2, 3, 4, 5]  # Algorithm 1: the wave's own order


# --- registry, config, CLI ----------------------------------------------------------------------

def test_registry_names_match_the_config_and_bad_names_say_the_fix():
    assert tuple(POLICIES) == POLICY_NAMES == ("rammer", "ios", "opara")
    with pytest.raises(ValueError, match=r"unknown policy 'greedy'; choose one of rammer, ios, opara"):
        get_policy("greedy")
    with pytest.raises(ValueError, match=r"policy='greedy': choose one of"):
        RammerConfig(policy="greedy")
    assert RammerConfig().policy == "rammer"


def test_cli_policy_flag_reaches_the_config():
    args = cli.build_parser().parse_args(["inspect", "m.onnx", "--policy", "ios"])
    assert cli._config(args).policy == "ios"
    args = cli.build_parser().parse_args(["inspect", "m.onnx"])
    assert cli._config(args).policy == "rammer"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["inspect", "m.onnx", "--policy", "greedy"])


def test_bfs_waves_are_valid_opgraph_waves():
    graph, _, _ = random_case(7)
    waves = bfs_waves(list(graph.ops), graph.preds)
    OpGraph(graph.ops, graph.preds, waves)  # validates: every pred in an earlier wave
    assert waves == graph.waves


# --- the Relax rewrite's emit order ---------------------------------------------------------------

def test_rprogram_with_a_lower_level_operator_is_emitted_after_the_rprogram_it_reads():
    from tvm import relax, topi

    from relay_passes.dataflow_graph import DataflowGraph
    from relay_passes.group_rprograms import RProgramCall, _emit_order

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a1 = bb.emit_te(topi.exp, x)       # node 0, level 0
            a2 = bb.emit_te(topi.exp, a1)      # node 1, level 1
            b = bb.emit_te(topi.negative, x)   # node 2, level 0
            c = bb.emit_te(topi.add, a2, b)    # node 3, level 2
            out = bb.emit_output(c)            # node 4, alias
        bb.emit_func_output(out)
    mod = bb.get()
    graph = DataflowGraph.from_function(mod["main"], mod)
    # an IOS-like split: P = {1}, then Q = {2, 3}; Q's first operator has the lower level
    p = RProgramCall("p", None, (1,), (), (), (), level=1)
    q = RProgramCall("q", None, (2, 3), (), (), (), level=0)
    order = [item.name if kind == "rprogram" else item.index for kind, item in _emit_order(graph, [p, q])]
    assert order == [0, "p", "q", 4]


# --- the predicted-time table ---------------------------------------------------------------------

@pytest.mark.slow
def test_policy_table_runs_every_policy_through_the_checker_on_a_reduced_model():
    from tvm_rammer.benchmarks.policy_table import compare_policies, format_markdown, policy_input

    inputs = policy_input("squeezenet", reduced=True)
    rows = compare_policies(inputs)
    assert set(rows) == set(POLICIES)
    for row in rows.values():
        assert row["operators"] == len(inputs["op_graph"].ops) > 0
        assert row["rprograms"] >= 1 and row["launches"] == row["rprograms"] + inputs["ordinary"]
        assert math.isfinite(row["predicted_us"]) and row["predicted_us"] > 0
        chain = row["last_chain"]  # the chain ending last, within the predicted time
        assert chain["operators"] >= 1 and chain["waiting_us"] >= 0
        assert 0 < chain["rtask_us"] + chain["barrier_us"] + chain["waiting_us"] <= row["predicted_us"]
    table = format_markdown({"squeezenet (reduced)": rows})
    assert table.splitlines()[2].startswith("| squeezenet (reduced) |")
    assert table.splitlines()[-1].startswith("| squeezenet (reduced) |")
    assert compare_policies(inputs, ["opara"]).keys() == {"opara"}

