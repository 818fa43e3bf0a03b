"""Bad input to every command (issue 33): one line naming the problem and the fix, exit code 2, no
traceback, nothing half-written.

Every command taking an ONNX file (compile, inspect, run, run --emulate, tune) gets each of: a
missing file, a non-ONNX file, a truncated ONNX file, an operator neither TVM nor onnxruntime knows
(a custom domain), an unbound symbolic dimension, a wrong --input-shape, an empty graph, a graph
whose output is its input. ``bench``, ``model`` and ``fuzz`` get their own bad arguments. The CLI
runs in-process (``cli.main``); ``capfd`` sees what onnxruntime's C++ would print on fd 2. ``run``
and ``tune`` need a GPU: where the check should come after the model's own, the GPU is faked (the
model fails before any device is used).
"""
import os

import onnx
import pytest
from onnx import TensorProto, helper

from tvm_rammer.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


def _model(nodes, inputs, outputs, opsets=()):
    graph = helper.make_graph(nodes, "bad", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), *opsets])
    model.ir_version = 9
    return model


def _value(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{case: path} of the bad models, and "good" (x[2, 4] -> Relu)."""
    folder = tmp_path_factory.mktemp("bad")
    good = _model([helper.make_node("Relu", ["x"], ["y"])], [_value("x", [2, 4])],
                  [_value("y", [2, 4])])
    models = {
        "good": good,
        "custom": _model([helper.make_node("FooBar", ["x"], ["y"], domain="com.example")],
                         [_value("x", [2, 4])], [_value("y", [2, 4])],
                         [helper.make_opsetid("com.example", 1)]),
        "symbolic": _model([helper.make_node("Relu", ["x"], ["y"])], [_value("x", ["N", 4])],
                           [_value("y", ["N", 4])]),
        "empty": _model([], [], []),
        "identity": _model([], [_value("x", [2, 4])], [_value("x", [2, 4])]),
    }
    paths = {"missing": str(folder / "nope.onnx")}
    for name, model in models.items():
        paths[name] = str(folder / f"{name}.onnx")
        onnx.save(model, paths[name])
    paths["text"] = str(folder / "text.onnx")
    with open(paths["text"], "w", encoding="utf-8") as f:
        f.write("this is not an ONNX model\n")
    data = good.SerializeToString()
    paths["truncated"] = str(folder / "truncated.onnx")
    with open(paths["truncated"], "wb") as f:
        f.write(data[:len(data) // 2])
    return paths


def _argv(command, path, out_dir):
    return {"compile": ["compile", path, "-o", os.path.join(out_dir, "model.so"), "--no-profile"],
            "inspect": ["inspect", path, "--no-profile"],
            "run": ["run", path, "--runs", "1"],
            "emulate": ["run", path, "--emulate", "--no-profile"],
            "tune": ["tune", path, "--trials", "1", "--work-dir", os.path.join(out_dir, "tune")],
            }[command]


def _run(argv, capfd):
    """(exit code, stdout, stderr) of the CLI, argparse's exits included."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    out, err = capfd.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    """The one ``error:`` line of stderr (warnings aside); fails on a traceback or a second line."""
    assert "Traceback" not in err and "onnxruntime_src" not in err and "[E:onnxruntime" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, err
    if lines[0].startswith("usage:"):  # argparse: its usage block, then the error line
        lines = lines[lines.index(errors[0]):]
    others = [ln for ln in lines if ln not in errors and not ln.startswith("tvm-rammer: warning:")]
    assert not others, err
    return errors[0]


@pytest.fixture
def fake_gpu(monkeypatch):
    """``run`` and ``tune`` past their GPU check: the model must fail before any device is used."""
    monkeypatch.setattr("tvm_rammer.run.runner.gpu_available", lambda: True)
    monkeypatch.setattr("tvm_rammer.tuning.tune.local_gpu", lambda: object())
    monkeypatch.setattr("tvm_rammer.host.preflight.check", lambda *_a, **_k: [])


COMMANDS = ("compile", "inspect", "run", "emulate", "tune")
# (case, what the one error line says): refused while loading the file, before anything else
FILE_CASES = [
    ("missing", "does not exist; check the path"),
    ("text", "is not a readable ONNX model"),
    ("truncated", "was cut short; export or copy it again"),
    ("empty", "has no graph outputs (0 nodes): there is nothing to compile"),
    ("identity", "computes nothing: its output 'x' is a graph input or constant"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case, says", FILE_CASES)
def test_a_bad_file_is_one_line_and_exit_2(files, tmp_path, capfd, case, says, command):
    code, out, err = _run(_argv(command, files[case], str(tmp_path)), capfd)
    assert code == 2, (out, err)
    assert says in _one_error_line(err)
    assert os.listdir(tmp_path) == []  # no library, no partial file, no tuning directory


@pytest.mark.parametrize("command, says", [
    ("compile", "TVM's ONNX frontend cannot import this model"),
    ("inspect", "TVM's ONNX frontend cannot import this model"),
    ("run", "TVM's ONNX frontend cannot import this model"),
    ("emulate", "onnxruntime cannot run this model"),
    ("tune", "TVM's ONNX frontend cannot import this model"),
])
def test_an_operator_nobody_knows_is_named_in_one_line(files, tmp_path, capfd, fake_gpu,
                                                       command, says):
    code, out, err = _run(_argv(command, files["custom"], str(tmp_path)), capfd)
    assert code == 2, (out, err)
    line = _one_error_line(err)  # and no onnxruntime C++ log on fd 2
    assert says in line and "FooBar" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["run", "emulate"])
def test_an_unbound_dimension_is_named_where_a_run_needs_numbers(files, tmp_path, capfd,
                                                                 fake_gpu, command):
    code, out, err = _run(_argv(command, files["symbolic"], str(tmp_path)), capfd)
    assert code == 2, (out, err)
    line = _one_error_line(err)
    assert "symbolic shape Nx4 (N unbound)" in line and "--input-shape x=1x4" in line


def test_an_unbound_dimension_compiles_with_a_warning_naming_it(files, capfd, caplog):
    """rPrograms need static shapes: TVM's default pipeline compiles it, and the warning says how
    to bind N (not an error: the library works for every N)."""
    code, out, err = _run(["inspect", files["symbolic"], "--no-profile"], capfd)
    assert code == 0 and out.startswith("rPrograms: 0") and "Traceback" not in err
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "'x' is Nx4" in warned and "--input-shape x=1x4" in warned


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag, says", [
    ("y=2x4", "the model has no input 'y'; its inputs are 'x'"),
    ("x=2x4x1", "input 'x' has rank 2 (Nx4); the shape given, 2x4x1, has rank 3"),
    ("x=0x4", "write positive integers joined by 'x'"),
])
def test_a_wrong_input_shape_is_one_line(files, tmp_path, capfd, command, flag, says):
    code, out, err = _run(_argv(command, files["symbolic"], str(tmp_path)) + ["--input-shape", flag],
                          capfd)
    assert code == 2, (out, err)
    assert says in _one_error_line(err)
    assert os.listdir(tmp_path) == []


def test_a_static_dimension_contradicted_is_one_line(files, tmp_path, capfd):
    code, out, err = _run(["inspect", files["good"], "--input-shape", "x=3x4"], capfd)
    assert code == 2
    assert "input 'x' has the static size 2 on axis 0 (2x4); the shape given, 3x4, says 3" in \
        _one_error_line(err)


@pytest.mark.parametrize("argv, says", [
    (["model", "nosuch", "-o", "{out}/m.onnx"], "unknown model 'nosuch'; valid names: alexnet"),
    (["model", "branches", "--param", "n=abc", "-o", "{out}/m.onnx"],
     "--param n='abc': model 'branches' takes int for n (default 16)"),
    (["model", "branches", "--param", "width=2", "-o", "{out}/m.onnx"],
     "has no argument 'width'"),
    (["model", "branches", "--param", "n", "-o", "{out}/m.onnx"], "use NAME=VALUE"),
    (["model", "branches", "--param", "n=-3", "-o", "{out}/m.onnx"], "need at least 1"),
    (["model", "branches", "--batch", "-1", "-o", "{out}/m.onnx"], "-1 must be >= 1"),
    (["bench", "nosuch", "--out", "{out}/b"], "unknown model(s) 'nosuch'"),
    (["bench", "alexnet", "--runs", "-1", "--out", "{out}/b"], "runs=-1: use at least 1"),
    (["bench", "alexnet", "--timeout", "-1", "--out", "{out}/b"], "timeout=-1.0: use seconds > 0"),
    (["bench", "alexnet", "--systems", "nosuch", "--out", "{out}/b"], "unknown system(s) ['nosuch']"),
    (["fuzz", "--graphs", "-1", "--out", "{out}/f"], "argument --graphs: -1 must be >= 1"),
    (["fuzz", "--graphs", "0", "--out", "{out}/f"], "argument --graphs: 0 must be >= 1"),
    (["fuzz", "--jobs", "0", "--out", "{out}/f"], "argument --jobs: 0 must be >= 1"),
    (["fuzz", "--trials", "-2", "--out", "{out}/f"], "argument --trials: -2 must be >= 1"),
    (["fuzz", "--timeout", "-1", "--out", "{out}/f"], "argument --timeout: -1 must be > 0 seconds"),
])
def test_other_commands_refuse_their_bad_arguments(tmp_path, capfd, argv, says):
    code, out, err = _run([a.replace("{out}", str(tmp_path)) for a in argv], capfd)
    assert code == 2, (out, err)
    assert says in _one_error_line(err)
    assert os.listdir(tmp_path) == []


def test_an_output_file_appears_only_complete(tmp_path, monkeypatch):
    """`compile -o` (``host.cross.export``) and `model -o` (``models.save_model``) write under a
    temporary name and rename: a write that dies halfway leaves no file at all. Negative control
    for each: the same write finishing leaves exactly the file."""
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    from tvm_rammer.host import cross
    from tvm_rammer.models import _save, save_model

    relu = _model([helper.make_node("Relu", ["x"], ["y"])], [_value("x", [1, 4])],
                  [_value("y", [1, 4])])
    ex = tvm.compile(from_onnx(relu), target="llvm")

    class DiesHalfway:  # what export_library does when the linker dies after writing a part
        mod = ex.mod

        def export_library(self, path, **_kwargs):
            with open(path, "wb") as f:
                f.write(b"half")
            raise RuntimeError("the linker died")

    out = tmp_path / "lib"
    out.mkdir()
    with pytest.raises(RuntimeError, match="the linker died"):
        cross.export(DiesHalfway(), str(out / "m.so"), "llvm")
    assert os.listdir(out) == []
    cross.export(ex, str(out / "m.so"), "llvm")
    assert os.listdir(out) == ["m.so"]

    onnx_save = onnx.save

    def save_half(model, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(_save.onnx, "save", save_half)
    models = tmp_path / "models"
    models.mkdir()
    with pytest.raises(OSError, match="disk full"):
        save_model(relu, str(models / "m.onnx"))
    assert os.listdir(models) == []
    monkeypatch.setattr(_save.onnx, "save", onnx_save)
    save_model(relu, str(models / "m.onnx"))
    assert os.listdir(models) == ["m.onnx"] and onnx.load(str(models / "m.onnx")).graph.node


def test_the_good_model_passes_the_same_checks(files, tmp_path, capfd):
    """Negative control: the checks above refuse bad input, not input."""
    code, out, err = _run(["inspect", files["good"], "--no-profile"], capfd)
    assert code == 0 and out.startswith("rPrograms: ") and "error" not in err
