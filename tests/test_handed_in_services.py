"""The services a lower stage gets from a higher one without importing it (issue 32).

- the back end's check of rKernel versions on the CPU emulator is the one ``checks.emulator``
  registers when imported (and a missing registration is one clear error, not an import);
- ``run.runner.demo`` without a GPU runs what its caller hands in (the CLI: the emulator), and
  with nothing handed in prints the schedule only.
"""

import pytest

import tvm_rammer  # noqa: F401  (imports checks.emulator, which registers its check)
from tvm_rammer.checks.emulator import versions as emulated_versions
from tvm_rammer.driver import backend
from tvm_rammer.run import runner


def test_importing_tvm_rammer_registers_the_emulators_version_check():
    factory = backend._VERSION_CHECKER["factory"]
    assert factory is emulated_versions._validator
    validator = factory("rammer/nvidia-h100")
    assert isinstance(validator, emulated_versions.EmulatedValidator)
    assert validator.target == "rammer/nvidia-h100" and validator.records == {}


def test_without_a_registered_check_emulate_versions_says_what_to_import(monkeypatch):
    monkeypatch.setattr(backend, "_VERSION_CHECKER", {})
    with pytest.raises(ValueError, match="import tvm_rammer.checks.emulator"):
        backend._check_on_emulator({}, "rammer/nvidia-h100")


def test_demo_without_a_gpu_runs_what_the_caller_hands_in(monkeypatch, capsys):
    monkeypatch.setattr(runner, "gpu_available", lambda: False)
    calls = []

    def emulate(model, target, config):
        calls.append((model.graph.name, target, config))
        return 7

    assert runner.demo("rammer/nvidia-h100", None, branches=2, emulate=emulate) == 7
    assert len(calls) == 1 and calls[0][1:] == ("rammer/nvidia-h100", None)
    assert "rProgram" in capsys.readouterr().out  # the schedule is printed first

    assert runner.demo("rammer/nvidia-h100", None, branches=2) == 0  # nothing handed in
    assert "compiled and scheduled only" in capsys.readouterr().out
