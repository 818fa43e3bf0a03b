"""The fuzzer: random graphs through the whole pipeline, every table checked by the executor."""
import json
import os

import onnx
import pytest

from tvm_rammer.checks import fuzz
from tvm_rammer.cli import main as cli_main

GRAPHS, SEED = 100, 0  # more: benchmarks/results/fuzz-*.json (1,000 graphs, seed 20261123)


def test_a_seeded_batch_of_random_graphs_has_no_failure(tmp_path):
    result = fuzz.fuzz(GRAPHS, SEED, jobs=2, trials=8, out_dir=str(tmp_path), progress=False)
    detail = [(f["index"], f["stage"], f["problems"][:1]) for f in result["failures"]]
    assert result["failures"] == [], detail
    assert result["ok"] >= GRAPHS * 0.95  # a few may be refused by TVM's ONNX frontend
    assert result["rprograms"] >= GRAPHS  # the tables checked are real ones
    assert not os.listdir(tmp_path)


def test_graphs_are_deterministic_valid_and_varied():
    first, _ = fuzz.random_graph(5, 7)
    again, _ = fuzz.random_graph(5, 7)
    assert first.SerializeToString() == again.SerializeToString()
    onnx.checker.check_model(first)
    styles, ops, multi_output, shared = set(), set(), 0, 0
    for i in range(60):
        model, desc = fuzz.random_graph(1, i)
        onnx.checker.check_model(model)
        styles.add(desc["style"])
        ops.update(n.op_type for n in model.graph.node)
        multi_output += any(len(n.output) > 1 for n in model.graph.node)
        names = [x for n in model.graph.node for x in n.input]
        shared += any(names.count(init.name) > 1 for init in model.graph.initializer)
    assert styles == set(fuzz.STYLES)
    assert {"MatMul", "Split", "Concat", "Reshape", "Sum", "Constant", "Conv", "Softmax"} <= ops
    assert multi_output and shared


def _contains(op_type):
    return lambda model: any(n.op_type == op_type for n in model.graph.node)


def test_minimise_keeps_the_failure_and_drops_the_rest():
    model = next(m for m, _ in (fuzz.random_graph(2, i) for i in range(50))
                 if _contains("Softmax")(m) and len(m.graph.node) > 6)
    small = fuzz.minimise(model, _contains("Softmax"), budget=200)
    onnx.checker.check_model(small)
    assert _contains("Softmax")(small)
    assert len(small.graph.node) < len(model.graph.node)
    assert len(small.graph.node) <= 3


def test_a_failing_graph_is_saved_minimised_with_its_seed(tmp_path, monkeypatch):
    model, _ = fuzz.random_graph(3, 1)
    calls = []

    def fake_check(model_bytes, options, trials=8, gpu=False, seed=0, emulate=False):
        calls.append(1)
        proto = onnx.load_from_string(model_bytes)
        bad = any(n.op_type in ("MatMul", "Gemm", "Concat") for n in proto.graph.node)
        return {"status": "fail" if bad else "ok", "stage": "executor", "problems": ["injected"]}

    monkeypatch.setattr(fuzz, "check_graph", fake_check)
    record = {"status": "fail", "stage": "executor", "problems": ["injected"]}
    path = fuzz._save_failure(str(tmp_path), 3, 1, model, record, {"num_sms": 2}, 8, False)
    saved = onnx.load(path)
    meta = json.loads(open(path[:-5] + ".json").read())
    assert meta["seed"] == 3 and meta["index"] == 1 and meta["problems"] == ["injected"]
    assert meta["nodes"] == len(saved.graph.node) <= meta["original_nodes"]
    assert calls


def test_cli_prints_the_count_line(capsys, tmp_path):
    assert cli_main(["fuzz", "--graphs", "2", "--seed", "4", "--out", str(tmp_path), "-q"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "2 graphs, 0 failures"


def test_gpu_flag_without_a_gpu_is_a_clear_error(capsys):
    from tvm_rammer.host.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    assert fuzz.main(["--graphs", "1", "--gpu"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_the_stress_run_says_plainly_when_there_is_no_gpu(capsys):
    from tvm_rammer.checks import stress
    from tvm_rammer.host.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: scripts/gpu_check.sh --stress runs it")
    assert stress.main(["--parts", "threads"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
