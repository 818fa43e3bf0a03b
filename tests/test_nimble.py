"""Nimble as a baseline (tvm_rammer.benchmarks.nimble): the minimum equivalent graph and the stream
assignment against brute force on small DAGs, the bench columns nimble / ios / opara on the CPU, and
the GPU executor and the policies' numerics against onnxruntime (gated)."""
import contextlib
import io
import itertools
import json
import random

import pytest

from tvm_rammer import cli
from tvm_rammer.benchmarks import nimble
from tvm_rammer.benchmarks.harness import BenchOptions
from tvm_rammer.benchmarks.systems import ALL_SYSTEMS, SYSTEMS
from tvm_rammer.models import REDUCED, get_model


def small_dag(seed, n):
    rng = random.Random(seed)
    return list(range(n)), {v: sorted(u for u in range(v) if rng.random() < 0.4) for v in range(n)}


def reachable(nodes, edges):
    """(u, v) pairs with a path of one edge or more, by transitive closure."""
    reach = set(edges)
    for w in nodes:
        for u in nodes:
            for v in nodes:
                if (u, w) in reach and (w, v) in reach:
                    reach.add((u, v))
    return reach


def graph_edges(preds):
    return {(u, v) for v, ps in preds.items() for u in ps}


def test_minimum_equivalent_graph_keeps_reachability_with_the_fewest_edges():
    for seed in range(60):
        nodes, preds = small_dag(seed, random.Random(seed).randint(1, 8))
        edges = graph_edges(preds)
        meg = set(nimble.minimum_equivalent_graph(nodes, preds))
        assert meg <= edges
        assert reachable(nodes, meg) == reachable(nodes, edges), f"seed {seed}"
        for e in meg:  # every edge is needed
            assert reachable(nodes, meg - {e}) != reachable(nodes, edges), f"seed {seed}: {e} redundant"


def chain_partitions(nodes, reach):
    """Every partition of ``nodes`` into streams of mutually ordered nodes (maximum logical
    concurrency: two nodes without a path between them never share a stream)."""
    def comparable(u, v):
        return (u, v) in reach or (v, u) in reach

    def extend(k, streams):
        if k == len(nodes):
            yield [list(s) for s in streams]
            return
        n = nodes[k]
        for s in streams:
            if all(comparable(n, m) for m in s):
                s.append(n)
                yield from extend(k + 1, streams)
                s.pop()
        streams.append([n])
        yield from extend(k + 1, streams)
        streams.pop()

    return extend(0, [])


def test_stream_assignment_has_maximum_concurrency_and_the_fewest_synchronisations():
    for seed in range(60):
        nodes, preds = small_dag(seed, random.Random(seed).randint(1, 7))
        edges = graph_edges(preds)
        reach = reachable(nodes, edges)
        a = nimble.stream_assignment(nodes, preds)
        assert sorted(n for s in a.streams for n in s) == nodes
        for u, v in itertools.combinations(nodes, 2):
            if (u, v) not in reach and (v, u) not in reach:
                assert a.stream_of[u] != a.stream_of[v], f"seed {seed}: independent {u}, {v} share a stream"
        for s in a.streams:
            assert s == sorted(s), "a stream holds its operators in topological order"
            assert all((u, v) in set(a.meg_edges) for u, v in zip(s, s[1:])), "a stream is a path of G'"
        meg = set(a.meg_edges)
        fewest = min(sum(1 for u, v in meg if not any(u in s and v in s for s in part))
                     for part in chain_partitions(nodes, reach))
        assert len(a.syncs) == fewest, f"seed {seed}"
        assert set(a.syncs) == {(u, v) for u, v in meg if a.stream_of[u] != a.stream_of[v]}


def test_stream_assignment_of_a_diamond_and_bad_input():
    a = nimble.stream_assignment(list("abcd"), {"b": ["a"], "c": ["a"], "d": ["a", "b", "c"]})
    assert a.meg_edges == [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]  # a -> d is implied
    assert a.streams == [["a", "b", "d"], ["c"]]
    assert a.syncs == [("a", "c"), ("c", "d")]
    with pytest.raises(ValueError, match="topological order"):
        nimble.stream_assignment([1, 0], {1: [0], 0: [1]})


def test_nimble_columns_are_opt_in_and_the_cli_compiles_them_on_the_cpu(tmp_path):
    from tvm_rammer.host.gpu import gpu_available

    assert BenchOptions().selected_systems() == SYSTEMS
    assert BenchOptions(systems=("nimble", "tvm-rammer", "ios")).selected_systems() == \
        ("tvm-rammer", "ios", "nimble")
    assert set(ALL_SYSTEMS) - set(SYSTEMS) == {"ios", "opara", "nimble"}
    if gpu_available():
        pytest.skip("checks the CPU path")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["bench", "branches", "--reduced", "--out", str(tmp_path), "--no-progress",
                         "--no-chart", "--systems", "tvm-default,tvm-rammer,ios,opara,nimble"])
    assert code == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    results = doc["models"][0]["results"]
    assert doc["systems"] == ["tvm-default", "tvm-rammer", "ios", "opara", "nimble"]
    for name in ("tvm-rammer", "ios", "opara"):
        assert results[name]["status"] == "compiled" and results[name]["launches"] == 1
    branches = REDUCED["branches"]["n"]
    assert results["nimble"]["status"] == "compiled"
    assert results["nimble"]["launches"] == results["tvm-default"]["launches"]
    assert results["nimble"]["streams"] >= branches  # the parallel branches on streams of their own


def test_nimble_executor_says_what_it_needs_without_a_gpu():
    from tvm_rammer.host.gpu import gpu_available

    if gpu_available():
        pytest.skip("checks the CPU path")
    assert "GPU" in nimble.nimble_available()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["branches", "two_branch", "squeezenet"])
def test_nimble_executor_matches_onnxruntime(name):
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference, random_inputs

    if nimble._cudart() is None:
        pytest.skip("needs cuda-python")
    proto = get_model(name, **REDUCED[name])
    feeds = random_inputs(proto, 0)
    inputs = [feeds[v.name] for v in proto.graph.input if v.name in feeds]
    kernels = nimble.default_kernels(import_onnx(proto), "rammer/nvidia-h100")
    with nimble.NimbleExecutor(kernels, "nvidia/nvidia-h100") as executor:
        executor.prepare(inputs)  # ends with the kernels' outputs set to NaN
        outs = executor.replay()  # so these come from the graph
        ref = onnx_reference(proto, feeds)
        assert max(relative_error(o, r) for o, r in zip(outs, ref)) <= 1e-4
        assert len(executor.time(20)) == 20


@pytest.mark.gpu
def test_nimble_bench_column_is_checked_and_timed_on_the_gpu(recwarn):
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference, random_inputs

    if nimble._cudart() is None:
        pytest.skip("needs cuda-python")
    proto = get_model("branches", **REDUCED["branches"])
    feeds = random_inputs(proto, 0)
    inputs = [feeds[v.name] for v in proto.graph.input if v.name in feeds]
    ref = onnx_reference(proto, feeds)
    result = nimble.bench_nimble(import_onnx(proto), "rammer/nvidia-h100", True, inputs, runs=20,
                                 check=lambda outs: max(relative_error(o, r)
                                                        for o, r in zip(outs, ref)),
                                 name="branches")
    assert result["status"] == "ok", result.get("reason")
    assert result["latency_us"] > 0 and not [w for w in recwarn if "nimble" in str(w.message)]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["ios", "opara"])
@pytest.mark.parametrize("name", ["branches", "nasnet_cifar", "inception_v3"])
def test_policies_compile_to_kernels_that_match_onnxruntime(policy, name):
    import tvm
    from tvm import relax

    import tvm_rammer
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference, random_inputs

    proto = get_model(name, **REDUCED[name])
    feeds = random_inputs(proto, 0)
    inputs = [feeds[v.name] for v in proto.graph.input if v.name in feeds]
    ex = tvm_rammer.compile(proto, target="rammer/nvidia-h100", config=RammerConfig(policy=policy))
    dev = tvm.cuda(0)
    out = relax.VirtualMachine(ex, dev)["main"](*[tvm.runtime.tensor(x, dev) for x in inputs])
    outs = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
    ref = onnx_reference(proto, feeds)
    assert max(relative_error(o, r) for o, r in zip(outs, ref)) <= 1e-4
