"""Fuzz graphs executed: random ONNX graphs lowered for a small vDevice, their tables checked by the
executor and their CUDA run on the CPU emulator against onnxruntime (``tvm-rammer fuzz --emulate``).

Negative control: a reference the outputs do not match makes the graph fail at stage "emulate".
"""

import shutil

import onnx
import pytest

from tvm_rammer.checks import fuzz
from tvm_rammer.cli import main as cli_main

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
    reason="the emulator builds kernels with a C++ compiler (none on PATH)")

# 50 until 2026-11-28 (CI time: 152 s of a worker); more: benchmarks/results/fuzz-*.json (1,000
# graphs, emulated where TVM fails)
GRAPHS, SEED = 30, 0


def test_emulated_options_make_the_vdevice_small():
    big = {"max_rtask_threads": 512, "num_sms": 132, "veus_per_sm": 4, "merge": "paper"}
    assert fuzz.emulated_options(big) == {**big, "num_sms": 2, "veus_per_sm": 2}
    assert fuzz.emulated_options({**big, "num_sms": 1, "veus_per_sm": None})["veus_per_sm"] == 2
    assert fuzz.emulated_options({**big, "num_sms": 1})["num_sms"] == 1


def test_thirty_fuzz_graphs_run_on_the_emulator(tmp_path):
    result = fuzz.fuzz(GRAPHS, SEED, jobs=2, trials=2, out_dir=str(tmp_path), progress=False,
                       emulate=True)
    detail = [(f["index"], f["stage"], f["problems"][:1]) for f in result["failures"]]
    print(f"\nEMU fuzz: {result['emulated']} graphs executed, max rel err "
          f"{result['max_rel_err']:.2e}, C++ builds {result['gxx_s']} s, {result['seconds']} s")
    assert result["failures"] == [], detail
    assert result["emulated"] >= GRAPHS  # every graph executed and matched, not only its table
    assert 0.0 < result["max_rel_err"] <= 1e-4


def test_a_wrong_result_is_a_failure(monkeypatch):
    """Negative control of the emulated check (in this process: the reference shifted by 1)."""
    from tvm_rammer.run import runner

    real = runner.onnx_reference
    monkeypatch.setattr(runner, "onnx_reference",
                        lambda proto, feeds: [r + 1.0 for r in real(proto, feeds)])
    model, _ = fuzz.random_graph(SEED, 0)
    out = fuzz.check_graph(model.SerializeToString(), fuzz.random_config(SEED, 0), trials=1,
                           emulate=True)
    assert out["status"] == "fail" and out["stage"] == "emulate"
    assert "vs onnxruntime" in out["problems"][0]


def test_cli_emulate_and_gpu_are_exclusive(tmp_path, capsys):
    assert cli_main(["fuzz", "--graphs", "1", "--emulate", "--out", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "1 graphs, 0 failures" and "1 executed on the emulator" in out[-2]
    code = cli_main(["fuzz", "--graphs", "1", "--gpu", "--emulate", "--out", str(tmp_path), "-q"])
    assert code != 0 and "--gpu" in capsys.readouterr().err
