"""The tvm-rammer command line: inspect's JSON, compile's library, clear errors."""

import json

import pytest

from tvm_rammer.cli import main


@pytest.fixture(scope="module")
def branches16(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "branches16.onnx"
    assert main(["model", "branches", "--param", "n=16", "-o", str(path)]) == 0
    return path


def test_inspect_json_on_sixteen_gemv_branches(branches16, capsys):
    assert main(["inspect", str(branches16), "--target", "rammer/nvidia-h100", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rprograms"] == 1
    assert summary["launches"] == 1
    assert summary["default_launches"] >= 16
    assert len(summary["rtasks"]) == 1 and summary["rtasks"][0] >= 256
    assert summary["veus"][0] >= 256 and summary["unplaced"] == []
    (program,) = summary["programs"]
    for op in program["operators"]:  # the version chosen for each operator, and why
        assert op["reason"] in ("fastest", "efficient", "fits", "only") and op["rtasks"] >= 1
    assert program["predicted_us"] > 0


def test_inspect_brief_json_keeps_the_critical_path(branches16, capsys):
    assert main(["inspect", str(branches16), "--json", "--brief"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "programs" not in summary
    path = summary["critical_path"]
    assert path["operators"] >= 2  # a GEMV branch, then the join
    assert 0 < path["predicted_us"]


def test_inspect_text_lists_every_operator(branches16, capsys):
    assert main(["inspect", str(branches16)]) == 0
    text = capsys.readouterr().out
    assert "rPrograms: 1" in text
    assert text.count("fused_matmul_relu") >= 16


def test_compile_writes_a_library(branches16, tmp_path):
    out = tmp_path / "model.so"
    assert main(["compile", str(branches16), "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.onnx"), "--target", "llvm"]) == 2
    assert main(["model", "no_such_model", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "valid names" in capsys.readouterr().err
