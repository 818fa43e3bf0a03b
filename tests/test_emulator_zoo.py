"""Every reduced zoo model and the demo through tvm-rammer's pipeline on the CPU emulator.

Each model of ``tvm_rammer.models.REDUCED`` (AlexNet, GoogLeNet and Inception-v3 included) is
compiled by the rammer pipeline for a small vDevice (2 SMs x 2 vEUs: every CUDA thread is a fiber,
so the preset's hundreds of 256-thread vEUs would take minutes), its CUDA run on the emulator and
compared with onnxruntime at float32's tolerance (``numerics.model_tolerance``: 1e-4 relative);
the 16-branch demo runs at its preset vDevice; two models run end to end in float16
(``RammerConfig(precision="float16")``, tolerance 2e-2). ``pytest -s`` prints one ``EMU`` line per
model (error, emulated wall seconds: not GPU times, g++ seconds).
"""

import shutil

import pytest

from tvm_rammer import RammerConfig
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import model_tolerance_of, onnx_reference, random_inputs

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
    reason="the emulator builds kernels with a C++ compiler (none on PATH)")

SMALL = dict(num_sms=2, veus_per_sm=2)
# Emulated with valid token ids and positions, and marked slow, in test_transformer_models.py.
TRANSFORMERS = ("gpt2_decode", "llama_decode", "bert_base")
FLOAT16 = ("resnext29", "alexnet")


def _emulated_error(name, proto, config):
    from tvm_rammer.checks import emulator

    feeds = random_inputs(proto, 0)
    result = emulator.emulate(proto, feeds, config=config)
    ref = onnx_reference(proto, feeds)
    assert len(result.outputs) == len(ref)
    err = max(relative_error(o, r) for o, r in zip(result.outputs, ref))
    tol = model_tolerance_of(proto, config)
    print(f"\nEMU {name} ({config.precision if config else 'float32'}, "
          f"{'preset vDevice' if config is None or config.num_sms is None else SMALL}): max rel "
          f"err {err:.2e} (tolerance {tol:.0e}), emulated {result.emulated_wall_s:.2f} s, g++ "
          f"{result.gxx_seconds:.1f} s, {len(result.launches)} launches")
    if name == "nasnet_cifar":  # (test_emulator.py emulated a smaller NASNet for this; dropped)
        assert len(result.launches) == 1  # one rProgram
    return err, tol


@pytest.mark.parametrize("name", sorted(set(REDUCED) - set(TRANSFORMERS)))
def test_reduced_zoo_model_matches_onnxruntime(name):
    err, tol = _emulated_error(name, get_model(name, **REDUCED[name]), RammerConfig(**SMALL))
    assert tol == 1e-4 and err <= tol


def test_demo_at_its_preset_vdevice():
    err, tol = _emulated_error("branches16 (demo)", get_model("branches", n=16), None)
    assert err <= tol


@pytest.mark.parametrize("name", FLOAT16)
def test_float16_end_to_end(name):
    config = RammerConfig(precision="float16", **SMALL)
    err, tol = _emulated_error(name, get_model(name, **REDUCED[name]), config)
    assert tol == 2e-2 and err <= tol
    assert err > 1e-5  # computed in half precision indeed (float32 would be ~1e-7)
