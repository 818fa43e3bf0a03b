"""The command line refuses bad input at once, with a message that says what to do; every flag is
documented; shapes and targets are accepted in the forms users type."""

import argparse
import json
import logging

import onnx
import pytest

from tvm_rammer import cli
from tvm_rammer.driver import frontend
from tvm_rammer.cli import build_parser, main
from tvm_rammer.config import MAX_SMS, MAX_VEUS_PER_SM, RammerConfig
from tvm_rammer.models import MODELS


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 4-branch model with a static and a symbolic ("N") batch."""
    folder = tmp_path_factory.mktemp("models")
    static, symbolic = folder / "small.onnx", folder / "small_n.onnx"
    assert main(["model", "branches", "--param", "n=4", "--param", "k=32", "--param", "n_out=32",
                 "-o", str(static)]) == 0
    model = onnx.load(static)
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    onnx.save(model, symbolic)
    return static, symbolic


def _exit_code(argv, capsys):
    """(exit code, stderr) whether main returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def _fail_compile(*_a, **_k):
    raise AssertionError("compiled although the output cannot be written")


def test_bad_output_directory_fails_before_compiling(small, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(frontend, "compile", _fail_compile)
    code, err = _exit_code(["compile", str(small[0]), "-o", str(tmp_path / "no" / "m.so")], capsys)
    assert code == 2 and "does not exist; create it first" in err
    code, err = _exit_code(["compile", str(small[0]), "-o", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in err
    code, err = _exit_code(["model", "branches", "-o", str(tmp_path / "no" / "m.onnx")], capsys)
    assert code == 2 and "does not exist" in err


def test_param_values_are_numbers_booleans_or_strings(tmp_path):
    out = tmp_path / "tanh.onnx"
    assert main(["model", "branches", "--param", "activation=tanh", "--param", "n=2",
                 "--param", "k=8", "--param", "n_out=8", "-o", str(out)]) == 0
    ops = {n.op_type for n in onnx.load(out).graph.node}
    assert "Tanh" in ops and "Relu" not in ops
    assert cli._param_value("16") == 16 and cli._param_value("0.5") == 0.5
    assert cli._param_value("true") is True and cli._param_value("False") is False
    assert cli._param_value("[1, 2]") == [1, 2] and cli._param_value("sum") == "sum"


def test_unknown_param_lists_the_builders_arguments(tmp_path, capsys):
    code, err = _exit_code(["model", "branches", "--param", "width=2",
                            "-o", str(tmp_path / "m.onnx")], capsys)
    assert code == 2 and "has no argument 'width'" in err and "activation" in err
    code, err = _exit_code(["model", "branches", "--param", "n", "-o", str(tmp_path / "m.onnx")],
                           capsys)
    assert code == 2 and "use NAME=VALUE" in err


@pytest.mark.parametrize("argv", [
    ["inspect", "M", "--batch", "0"], ["inspect", "M", "--batch", "-2"],
    ["compile", "M", "-o", "x.so", "--batch", "0"], ["model", "branches", "-o", "x", "--batch", "0"],
    ["inspect", "M", "--num-sms", "0"], ["inspect", "M", "--max-rtask-threads", "100"],
    ["run", "M", "--runs", "0"], ["demo", "--branches", "0"], ["bench", "--batch", "0"],
    ["inspect", "M", "--input-shape", "1x3x8x8"], ["inspect", "M", "--input-shape", "x=1xa"],
])
def test_out_of_range_flags_are_refused_by_the_parser(argv, small, capsys):
    argv = [str(small[0]) if a == "M" else a for a in argv]
    code, err = _exit_code(argv, capsys)
    assert code == 2 and "error:" in err


def test_config_bounds_say_what_to_use(small, capsys):
    code, err = _exit_code(["inspect", str(small[0]), "--veus-per-sm", "1000"], capsys)
    assert code == 2 and f"at most {MAX_VEUS_PER_SM} thread blocks" in err
    code, err = _exit_code(["inspect", str(small[0]), "--num-sms", "100000"], capsys)
    assert code == 2 and "use the GPU's SM count" in err
    with pytest.raises(ValueError, match="at most 32"):
        RammerConfig(veus_per_sm=MAX_VEUS_PER_SM + 1)
    with pytest.raises(ValueError, match=f"1 to {MAX_SMS}"):
        RammerConfig(num_sms=MAX_SMS + 1)
    with pytest.raises(TypeError, match="must be an integer"):
        RammerConfig(num_sms=1.5)
    with pytest.raises(ValueError, match="cannot be negative"):
        RammerConfig(launch_us=-1.0)
    assert RammerConfig(num_sms=MAX_SMS, veus_per_sm=MAX_VEUS_PER_SM).num_sms == MAX_SMS


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_every_flag_of_every_command_has_help_text():
    missing = []
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"flags without help: {missing}"


def test_model_help_lists_every_model_and_its_arguments(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["model", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for name in MODELS:
        assert f"  {name}: " in out
    assert "activation='relu'" in out


def test_cli_form_target_is_accepted_and_a_bad_one_names_the_forms_that_work(small, capsys):
    assert main(["inspect", str(small[0]), "--target", "cuda -arch=sm_80", "--no-profile",
                 "--json", "--brief"]) == 0
    assert json.loads(capsys.readouterr().out)["rprograms"] == 1
    code, err = _exit_code(["inspect", str(small[0]), "--target", "cuda -arch=sm_80 -nope=1"],
                           capsys)
    assert code == 2 and "'cuda -arch=sm_80'" in err and "rammer/nvidia-h100" in err


def test_symbolic_batch_bound_on_the_command_line(small, capsys, caplog):
    static, symbolic = small
    flags = ["--no-profile", "--json", "--brief"]
    assert main(["inspect", str(static), *flags]) == 0
    twin = json.loads(capsys.readouterr().out)
    for bind in (["--batch", "1"], ["--input-shape", "input=1x32"]):
        assert main(["inspect", str(symbolic), *bind, *flags]) == 0
        bound = json.loads(capsys.readouterr().out)
        assert (bound["rprograms"], bound["rtasks"], bound["launches"]) == \
            (twin["rprograms"], twin["rtasks"], twin["launches"])
    with caplog.at_level(logging.WARNING, logger="tvm_rammer"):
        assert main(["inspect", str(symbolic), *flags]) == 0
    unbound = json.loads(capsys.readouterr().out)
    assert unbound["rprograms"] == 0 and unbound["launches"] == unbound["default_launches"]
    assert "--batch 1" in caplog.text and "--input-shape input=1x32" in caplog.text


def test_unknown_input_name_lists_the_real_inputs(small, capsys):
    code, err = _exit_code(["inspect", str(small[1]), "--input-shape", "x=1x32"], capsys)
    assert code == 2 and "no input 'x'; its inputs are 'input'" in err


def test_cli_target_form_translates_to_tvms_dict_form():
    from tvm_rammer.target import cli_target_dict, resolve_target, target_arch

    assert cli_target_dict("cuda -arch=sm_80 -max_threads_per_block=512 -keys=cuda,gpu") == {
        "kind": "cuda", "arch": "sm_80", "max_threads_per_block": 512, "keys": ["cuda", "gpu"]}
    for not_cli in ("cuda", "rammer/nvidia-h100", '{"kind": "cuda"}', "cuda sm_80"):
        assert cli_target_dict(not_cli) is None
    target = resolve_target("cuda -arch=sm_90a -max_threads_per_block=512")
    assert target_arch(target) == "sm_90a" and int(target.attrs["max_threads_per_block"]) == 512
    assert "rammer" in tuple(target.keys)
