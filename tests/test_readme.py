"""The README's end-to-end example works as written: its commands compile the library (on the CPU),
and its Python block, in an interpreter that never imports tvm_rammer, loads that library and
matches onnxruntime (on a GPU)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tvm_rammer.cli import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## End to end", 1)[1].split("\n## ", 1)[0]


def _commands():
    block = re.search(r"```\n(tvm-rammer model .*?)```", SECTION, re.S).group(1)
    return [shlex.split(line.split("#")[0])[1:] for line in block.strip().splitlines()]


def _python_block():
    return re.search(r"example: end-to-end.*?```python\n(.*?)```", SECTION, re.S).group(1)


@pytest.fixture
def compiled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in _commands():
        assert main(argv) == 0, argv
    return tmp_path


def test_readme_commands_write_the_model_and_the_library(compiled):
    assert (compiled / "branches.onnx").stat().st_size > 0
    assert (compiled / "branches.so").stat().st_size > 0


@pytest.mark.gpu
def test_readme_python_block_runs_the_library_and_matches_onnxruntime(compiled):
    """In a fresh interpreter that never imports tvm_rammer (as the README promises: the library
    needs TVM's runtime only); this process has imported it, so the block does not run here."""
    check = "\nimport sys\nassert 'tvm_rammer' not in sys.modules, 'it imported tvm_rammer'\n"
    proc = subprocess.run([sys.executable, "-c", _python_block() + check], cwd=compiled,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "max abs error vs onnxruntime" in proc.stdout
