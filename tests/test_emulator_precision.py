"""Model tolerances by precision: ``run --emulate`` checks a float16 model at float16's bound.

``numerics.model_tolerance`` is the one place: float32 1e-4, float16 2e-2 relative against
onnxruntime (``RammerConfig.precision`` or a model whose inputs/outputs are stored in float16).
Negative control: a real mismatch at float16 is still reported (MISMATCH, exit 1).
"""

import json
import shutil

import onnx
import pytest

from tvm_rammer.models import get_model
from tvm_rammer.numerics import MODEL_TOLERANCES, model_tolerance
from tvm_rammer.run.runner import model_tolerance_of

SMALL = ["--num-sms", "2", "--veus-per-sm", "1"]
needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
    reason="the emulator builds kernels with a C++ compiler (none on PATH)")


def test_model_tolerance_by_precision_and_dtype():
    from tvm_rammer import RammerConfig

    assert model_tolerance("float32") == MODEL_TOLERANCES["float32"] == 1e-4
    assert model_tolerance("float16") == MODEL_TOLERANCES["float16"] == 2e-2
    assert model_tolerance("float32", ["float32", "int64"]) == 1e-4
    assert model_tolerance("float32", ["float16"]) == 2e-2  # a model stored in half precision
    with pytest.raises(ValueError, match="precision='float64': choose one of"):
        model_tolerance("float64")
    proto = get_model("branches", n=2)
    assert model_tolerance_of(proto) == 1e-4
    assert model_tolerance_of(proto, RammerConfig(precision="float16")) == 2e-2


@pytest.fixture(scope="module")
def branches2_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("precision") / "b2.onnx"
    onnx.save(get_model("branches", n=2), str(path))
    return str(path)


@needs_cxx
def test_float16_model_passes_at_float16_tolerance(branches2_path, capsys):
    from tvm_rammer.cli import main

    code = main(["run", branches2_path, "--emulate", "--json", "--precision", "float16", *SMALL])
    out = json.loads(capsys.readouterr().out)
    err = out["rammer"]["max_rel_err"]
    print(f"\nEMU branches2 float16: max rel err {err:.2e} (tolerance {out['tolerance']})")
    assert out["tolerance"] == 2e-2
    assert code == 0 and out["ok"] and err <= 2e-2
    assert err > 1e-4  # really computed in half precision: float32's bound would have failed it


@needs_cxx
def test_float16_real_mismatch_is_still_reported(branches2_path, capsys, monkeypatch):
    """Negative control: outputs 10% off the reference fail float16's bound too."""
    from tvm_rammer.cli import main
    from tvm_rammer.checks.emulator import run as emulated

    real = emulated.onnx_reference
    monkeypatch.setattr(emulated, "onnx_reference",
                        lambda proto, feeds: [r * 1.1 for r in real(proto, feeds)])
    code = main(["run", branches2_path, "--emulate", "--precision", "float16", *SMALL])
    out = capsys.readouterr().out
    assert code == 1
    assert "MISMATCH" in out.splitlines()[-1] and "tolerance 2e-02" in out.splitlines()[-1]
