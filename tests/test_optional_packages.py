"""Optional packages degrade: each hidden in a fresh interpreter (an import hook that makes
`import <package>` raise ImportError, as if it were not installed), the command still succeeds and
says at the start what it skips. The GPU cases run on a GPU only."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tvm_rammer.host.gpu import gpu_available

ROOT = Path(__file__).resolve().parents[1]
HIDE = textwrap.dedent("""
    import sys

    class Hide:
        '''Makes `import X` (and X.sub) raise ImportError for the packages named in argv[1].'''
        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ImportError(f"No module named {name!r} (hidden by the test)")
            return None

    hidden = {n for n in sys.argv[1].split(",") if n}
    sys.meta_path.insert(0, Hide(hidden))
    for name in hidden:  # the hook works: the package cannot be imported
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} was not hidden")
    from tvm_rammer.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def first_said(stderr: str) -> str:
    """The first line tvm-rammer itself wrote to stderr (TVM's own log lines may come before)."""
    return next((ln for ln in stderr.splitlines() if ln.startswith("tvm-rammer:")), "")


def tvm_rammer_without(hidden: str, *argv, cwd) -> subprocess.CompletedProcess:
    """``tvm-rammer ARGV`` in a fresh interpreter where the comma-separated ``hidden`` packages
    cannot be imported."""
    return subprocess.run([sys.executable, "-c", HIDE, hidden, *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from tvm_rammer.cli import main

    folder = tmp_path_factory.mktemp("optional")
    assert main(["model", "branches", "--param", "n=2", "-o", str(folder / "b2.onnx")]) == 0
    return folder / "b2.onnx"


def test_inspect_timeline_without_matplotlib_writes_the_json_and_says_so_first(small_model):
    folder = small_model.parent
    proc = tvm_rammer_without("matplotlib", "inspect", small_model, "--timeline", "t", "--json",
                              "--no-profile", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first_said(proc.stderr).startswith("tvm-rammer: warning: matplotlib is not installed")
    assert "no PNG" in proc.stderr
    trace = json.loads((folder / "t.json").read_text())
    assert trace["traceEvents"] and not (folder / "t.png").exists()
    assert json.loads(proc.stdout)["timeline"]  # the shares are still reported
    # negative control: with matplotlib importable the same command draws the PNG
    shown = tvm_rammer_without("", "inspect", small_model, "--timeline", "u", "--no-profile",
                               cwd=folder)
    assert shown.returncode == 0, shown.stderr[-3000:]
    if not (folder / "u.png").exists():
        pytest.skip("matplotlib is not installed here: the control cannot draw")
    assert "tvm-rammer: warning" not in shown.stderr


def test_bench_without_torch_skips_its_columns_with_a_note(small_model, tmp_path):
    proc = tvm_rammer_without("torch", "bench", "branches", "--systems", "tvm-default,torch-eager",
                              "--timeout", "0", "--no-profile", "--no-progress", "--out", tmp_path,
                              cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first_said(proc.stderr).startswith("tvm-rammer: warning: torch is not installed "
                                  "(pip install torch onnx2torch): the torch-eager columns are "
                                  "skipped")
    assert "torch-eager: skipped: torch is not installed" in proc.stdout
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    model = doc["models"][0]["results"]
    assert model["torch-eager"]["status"] == "skipped"
    assert model["tvm-default"]["status"] in ("compiled", "ok")


def test_doctor_without_any_optional_package(tmp_path):
    proc = tvm_rammer_without("matplotlib,onnxruntime,torch,cuda", "doctor", "--json",
                              cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    for name, fix in (("matplotlib", "pip install matplotlib"),
                      ("onnxruntime", "pip install onnxruntime"),
                      ("torch", "pip install torch onnx2torch"),
                      ("cuda-python", "pip install cuda-python")):
        assert by[name]["status"] == "missing" and fix in by[name]["fix"]


def test_demo_without_onnxruntime_or_matplotlib_still_schedules(tmp_path):
    proc = tvm_rammer_without("onnxruntime,matplotlib", "demo", "--branches", "2",
                              "--no-profile", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rPrograms: 1" in proc.stdout
    if gpu_available():
        assert first_said(proc.stderr).startswith("tvm-rammer: warning: onnxruntime is not installed")
        assert "checked against TVM's default pipeline" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
def test_run_without_onnxruntime_checks_against_tvm_default(small_model):
    proc = tvm_rammer_without("onnxruntime", "run", small_model, "--runs", "10", "--no-profile",
                              "--json", cwd=small_model.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first_said(proc.stderr).startswith("tvm-rammer: warning: onnxruntime is not installed")
    result = json.loads(proc.stdout)
    assert result["reference"].startswith("TVM's default pipeline") and result["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
def test_run_timeline_without_matplotlib_writes_the_json(small_model):
    folder = small_model.parent
    proc = tvm_rammer_without("matplotlib", "run", small_model, "--runs", "10", "--no-profile",
                              "--timeline", "m", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first_said(proc.stderr).startswith("tvm-rammer: warning: matplotlib is not installed")
    assert (folder / "m.json").exists() and not (folder / "m.png").exists()
