"""Benchmark harness: the floor on hand-computable graphs, CUDA-graph launch counting, the results
document's schema, the table, the CLI on the CPU (compiles, counts, says timing needs a GPU),
per-model timeouts, and the GPU path (gated)."""

import contextlib
import io
import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_rammer import cli
from tvm_rammer.benchmarks import floor as fl
from tvm_rammer.benchmarks.harness import NO_GPU, REDUCED, SCHEMA, BenchOptions, run_bench
from tvm_rammer.benchmarks.output import add_derived, format_table, write_chart, write_json
from tvm_rammer.benchmarks.progress import Progress
from tvm_rammer.benchmarks.systems import SYSTEMS, tvm_systems
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.models import get_model

def _matmul_model(m, k, n):
    w = numpy_helper.from_array(np.ones((k, n), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_floor_of_one_matmul_is_flops_and_bytes_by_hand():
    m, k, n = 64, 128, 32
    cost = fl.op_costs(import_onnx(_matmul_model(m, k, n)))
    assert cost.flops == 2 * m * k * n
    assert cost.io_bytes == 4 * (m * k + k * n + m * n)
    peaks = fl.Peaks(flops_per_s=1e12, bytes_per_s=1e11, source="test")
    f = fl.floor(cost, peaks)
    assert f["compute_us"] == pytest.approx(2 * m * k * n / 1e12 * 1e6)
    assert f["memory_us"] == pytest.approx(4 * (m * k + k * n + m * n) / 1e11 * 1e6)
    assert f["floor_us"] == pytest.approx(max(f["compute_us"], f["memory_us"]))
    assert f["bound"] == "memory"


def test_floor_critical_path_follows_the_longest_branch_not_the_sum():
    # two_branch rows=4, k=16, n_out=8: two MatMul+Relu branches joined by Add; 2 FLOP/s, 1 B/s.
    cost = fl.op_costs(import_onnx(get_model("two_branch", rows=4, k=16, n_out=8)))
    f = fl.floor(cost, fl.Peaks(flops_per_s=2.0, bytes_per_s=1.0, source="test"))
    matmul = max(2 * 4 * 16 * 8 / 2, 4 * (4 * 16 + 16 * 8 + 4 * 8))  # 512 s vs 896 s
    relu = max(4 * 8 / 2, 4 * (32 + 32))
    add = max(4 * 8 / 2, 4 * 3 * 32)
    assert f["critical_path_us"] == pytest.approx((matmul + relu + add) * 1e6)  # 1536 s, not 2944
    assert f["flops"] == 2 * 1024 + 3 * 32
    assert f["bytes"] == 4 * (4 * 16 + 2 * 16 * 8 + 4 * 8)  # input, two weights, output: 1408
    assert f["floor_us"] == f["critical_path_us"] and f["bound"] == "critical_path"


def _gather_model(vocab, d, also_matmul):
    table = numpy_helper.from_array(np.arange(vocab * d, dtype=np.float32).reshape(vocab, d), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["row"], axis=0)]
    outputs = [helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, d])]
    if also_matmul:  # a tied LM head: the same table read whole
        nodes.append(helper.make_node("MatMul", ["row", "table_t"], ["logits"]))
        nodes.insert(0, helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, vocab]))
    graph = helper.make_graph(nodes, "gather", [helper.make_tensor_value_info(
        "ids", TensorProto.INT64, [1])], outputs, [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_floor_charges_a_gather_the_rows_it_reads_not_its_table():
    vocab, d = 1000, 16
    cost = fl.op_costs(import_onnx(_gather_model(vocab, d, also_matmul=False)))
    # one row of the table read, the output row written, the index and the importer's small
    # index-wrapping constants; the table is 64,000 bytes
    assert 2 * 4 * d <= cost.io_bytes < 3 * 4 * d
    take = max(cost.ops, key=lambda op: op.bytes)
    assert 2 * 4 * d <= take.bytes < 3 * 4 * d
    # control: the same table also read whole (a tied LM head) is charged whole
    tied = fl.op_costs(import_onnx(_gather_model(vocab, d, also_matmul=True)))
    assert tied.io_bytes >= 4 * vocab * d


def test_nominal_peaks_are_labelled_nominal():
    h100 = fl.nominal_peaks("rammer/nvidia-h100")
    assert (h100.flops_per_s, h100.bytes_per_s, h100.measured) == (67e12, 3.35e12, False)
    assert h100.source.startswith("nominal:")
    assert fl.nominal_peaks("rammer/nvidia-h200").bytes_per_s == 4.8e12


def test_cuda_graph_launches_count_captured_kernels_as_kernels():
    model = get_model("resnext29", **REDUCED["resnext29"])
    mod = import_onnx(model)
    default, graph, _ = tvm_systems("rammer/nvidia-h100", RammerConfig())
    plain = default.launches(default.lower(mod))["launches"]
    counted = graph.launches(graph.lower(mod))
    assert counted["graph_replays"] >= 1 and counted["captured_kernels"] > 0
    assert counted["launches"] == plain  # same kernels, some of them replayed from a graph
    assert counted["captured_kernels"] + counted["kernels_outside_graphs"] == plain


def _gpu_doc():
    def ok(lat):
        return {"status": "ok", "latency_us": lat, "compile_s": 1.0, "launches": 3,
                "max_rel_err": 1e-6}

    doc = {"schema": SCHEMA, "date": "2000-01-01", "git_commit": "0123456789abcdef",
           "target": "rammer/nvidia-h100", "batch": 1, "timing": True, "timing_note": "",
           "device": {"gpu": True, "name": "NVIDIA H100 80GB HBM3"},
           "peaks": {"flops_per_s": 5e13, "bytes_per_s": 3e12, "source": "measured: test"},
           "systems": list(SYSTEMS),
           "models": [{"name": "alexnet", "floor": {"floor_us": 10.0}, "results": {
               "tvm-default": ok(100.0), "tvm-cudagraph": ok(80.0), "tvm-rammer": ok(40.0),
               "torch-eager": ok(200.0),
               "torch-cudagraph": {"status": "failed", "reason": "RuntimeError: boom"}}}]}
    return add_derived(doc)


def test_derived_columns_speedups_and_floor_multiples():
    model = _gpu_doc()["models"][0]
    rammer = model["results"]["tvm-rammer"]
    assert rammer["speedup_vs_default"] == pytest.approx(2.5)
    assert rammer["vs_floor"] == pytest.approx(4.0)
    assert model["best_other"] == "tvm-cudagraph"
    assert model["rammer_vs_best_other"] == pytest.approx(2.0)
    assert model["results"]["torch-cudagraph"]["speedup_vs_default"] is None


def test_table_rows_are_models_columns_are_systems():
    text = format_table(_gpu_doc())
    header = next(line for line in text.splitlines() if line.startswith("model"))
    assert header.split()[:3] == ["model", "floor", "us"]
    assert all(s in header for s in SYSTEMS)
    row = next(line for line in text.splitlines() if line.startswith("alexnet"))
    assert "40.0 (4.0xF) 2.50x" in row and "FAIL" in row and "2.00x vs tvm-cudagraph" in row
    assert "alexnet / torch-cudagraph: failed: RuntimeError: boom" in text
    assert NO_GPU not in text


def test_chart_is_written_when_matplotlib_imports(tmp_path):
    pytest.importorskip("matplotlib")
    path, why = write_chart(_gpu_doc(), tmp_path / "chart.png")
    assert why == "" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_file_is_named_by_date_device_and_batch(tmp_path):
    path = write_json(_gpu_doc(), tmp_path)
    assert path.name == "2000-01-01-nvidia-h100-80gb-hbm3-batch1.json"
    assert json.loads(path.read_text())["schema"] == SCHEMA


def test_progress_writes_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(4, stream=out)
    p.stage("alexnet: lower tvm-default")
    p.advance()
    p.stage("alexnet: lower tvm-rammer")
    p.close()
    assert out.getvalue().splitlines() == ["[0/4] alexnet: lower tvm-default",
                                           "[1/4] alexnet: lower tvm-rammer"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["bench", "two_branch", "branches", "--reduced", "--out", str(out),
                         "--no-progress"])
    return code, stdout.getvalue(), out


def test_cli_bench_on_cpu_compiles_counts_and_says_timing_needs_a_gpu(cpu_run):
    from tvm_rammer.host.gpu import gpu_available

    if gpu_available():
        pytest.skip("the CPU-only message is printed only without a GPU")
    code, text, out = cpu_run
    assert code == 0
    assert "timing needs a GPU: none visible" in text
    files = list(out.glob("*-cpu-batch1.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert [m["name"] for m in doc["models"]] == ["two_branch", "branches"]
    for model in doc["models"]:
        for system in ("tvm-default", "tvm-rammer"):
            result = model["results"][system]
            assert result["status"] == "compiled", result
            assert isinstance(result["launches"], int) and result["launches"] >= 1
            assert result["compile_s"] > 0
        assert model["results"]["tvm-rammer"]["launches"] <= \
            model["results"]["tvm-default"]["launches"]
        assert model["results"]["torch-eager"]["status"] == "skipped"


def test_results_document_schema(cpu_run):
    _, _, out = cpu_run
    doc = json.loads(next(out.glob("*.json")).read_text())
    assert doc["schema"] == SCHEMA
    for key in ("date", "timestamp", "git_commit", "device", "peaks", "target", "batch", "runs",
                "reduced", "config", "systems", "timing", "timing_note", "models"):
        assert key in doc, key
    assert doc["git_commit"] == "unknown" or len(doc["git_commit"]) == 40
    assert doc["systems"] == list(SYSTEMS)
    assert {"flops_per_s", "bytes_per_s", "source", "measured"} <= set(doc["peaks"])
    model = doc["models"][0]
    assert {"name", "kwargs", "onnx_nodes", "import_s", "floor", "results", "best_other",
            "rammer_vs_best_other"} <= set(model)
    assert {"flops", "bytes", "compute_us", "memory_us", "critical_path_us", "floor_us",
            "bound"} <= set(model["floor"])
    for result in model["results"].values():
        assert result["status"] in ("ok", "compiled", "failed", "timeout", "skipped", "mismatch")
        assert {"vs_floor", "speedup_vs_default"} <= set(result)


def test_cli_bad_model_name_exits_2_listing_valid_names(capsys):
    assert cli.main(["bench", "no_such_net"]) == 2
    err = capsys.readouterr().err
    assert "unknown model(s) 'no_such_net'" in err
    assert "valid names:" in err and "resnext29" in err and "two_branch" in err


def test_bad_options_raise_with_the_fix():
    with pytest.raises(ValueError, match="unknown system"):
        BenchOptions(models=("two_branch",), systems=("tvm-fast",))
    with pytest.raises(ValueError, match="batch=0"):
        BenchOptions(models=("two_branch",), batch=0)


def test_a_model_past_its_timeout_is_recorded_and_the_run_goes_on():
    options = BenchOptions(models=("two_branch",), reduced=True, timeout_s=0.5,
                           systems=("tvm-default",))
    doc = run_bench(options)
    result = doc["models"][0]["results"]["tvm-default"]
    assert result["status"] == "timeout"
    assert result["reason"].startswith("timeout: exceeded --timeout 0.5 s during")


def test_in_process_run_without_timeout():
    options = BenchOptions(models=("two_branch",), reduced=True, timeout_s=0,
                           systems=("tvm-default", "tvm-cudagraph"))
    doc = run_bench(options)
    results = doc["models"][0]["results"]
    assert set(results) == {"tvm-default", "tvm-cudagraph"}
    assert results["tvm-default"]["launches"] == 2
    assert doc["models"][0]["floor"]["floor_us"] > 0


@pytest.mark.gpu
def test_gpu_bench_checks_then_times_every_tvm_system(tmp_path):
    options = BenchOptions(models=("two_branch",), reduced=True, runs=20,
                           systems=("tvm-default", "tvm-cudagraph", "tvm-rammer"))
    doc = run_bench(options)
    assert doc["timing"] and doc["peaks"]["measured"]
    for system, result in doc["models"][0]["results"].items():
        assert result["status"] == "ok", (system, result)
        assert result["max_rel_err"] <= 1e-3
        assert result["latency_stats"]["samples"] >= 10
    assert write_json(doc, tmp_path).exists()


def test_l2_read_kernel_reads_every_element_once_per_pass():
    """The kernel behind the floor's measured L2 bandwidth (the cost model's l2_bw_gbps): each
    of the grid's threads sums a strided share of the buffer once per pass, pass p the share of
    block b + p (so every pass reads the whole buffer once; checked on the
    CPU with the thread loops made serial), and it builds for sm_90a as one kernel."""
    import tvm
    from conftest_tir import serial_threads

    func = fl.l2_read_kernel(mib=1, passes=3, blocks=4, threads=32)
    serial = serial_threads(func)
    lib = tvm.tirx.build(tvm.IRModule({"read_l2": serial}), "llvm")
    x = np.random.default_rng(0).standard_normal((1 << 20) // 4).astype("float32")
    out = tvm.runtime.tensor(np.zeros(128, "float32"))
    lib["read_l2"](tvm.runtime.tensor(x), out)
    # pass p: block b sums block (b + p)'s column slice (its own slice would stay in the SM's L1)
    slices = x.reshape(-1, 4, 32).sum(axis=0)  # [block, thread]
    expected = sum(np.roll(slices, -p, axis=0) for p in range(3)).reshape(-1)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4)
    assert not np.allclose(expected, 3 * slices.reshape(-1), rtol=1e-4)  # the old kernel's sums
    cuda = tvm.tirx.build(tvm.IRModule({"read_l2": func}),
                          tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    source = str(cuda.imports[0].inspect_source())
    assert source.count("__global__") == 2 and source.count("read_l2_kernel(") == 2  # decl + def
