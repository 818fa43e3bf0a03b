"""``tvm-rammer generate`` (issue 34, item 3): greedy decoding with a compiled decode step.

The reduced gpt2_decode runs 8 tokens on the CPU emulator, the step compiled once; every step's
logits match onnxruntime's (its caches threaded through its own outputs) and the tokens are the
greedy tokens of an independent onnxruntime loop written here. Negative control: feeding the empty
caches to every step instead of the returned ones is detected from the second step on. Bad input
(a model of another form, tokens out of range, no GPU without --emulate) is one line, exit 2.
"""

import json
import shutil

import numpy as np
import onnx
import pytest

from tvm_rammer.cli import main
from tvm_rammer.models import REDUCED, get_model, save_model
from tvm_rammer.run import generate

ort = pytest.importorskip("onnxruntime")
needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                               reason="the emulator builds kernels with a C++ compiler")
SMALL = ["--num-sms", "2", "--veus-per-sm", "2", "--no-profile"]  # a small vDevice: fast emulation


@pytest.fixture(scope="module")
def gpt2():
    return get_model("gpt2_decode", **REDUCED["gpt2_decode"])


@pytest.fixture(scope="module")
def gpt2_path(gpt2, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("generate") / "gpt2.onnx")
    save_model(gpt2, path)
    return path


def _ort_greedy(model, tokens, prompt=0):
    """onnxruntime's greedy tokens, written apart from run.generate: empty caches, the caches of
    step i are step i-1's outputs."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    caches = {v.name: np.zeros([d.dim_value for d in v.type.tensor_type.shape.dim], np.float32)
              for v in model.graph.input[2:]}
    out_names = [o.name for o in model.graph.output]
    token, found = prompt, [prompt]
    for position in range(tokens):
        outs = sess.run(None, {"input_ids": np.array([[token]], np.int64),
                               "position": np.array([position], np.int64), **caches})
        token = int(outs[0][0, -1].argmax())
        found.append(token)
        caches = {name.replace("present", "past"): o for name, o in zip(out_names[1:], outs[1:])}
    return found


def test_signature_of_the_zoo_decoders(gpt2):
    sig = generate.decode_signature(gpt2)
    assert (sig.batch, sig.vocab, sig.max_len, sig.cache_dtype) == (1, 96, 16, "float32")
    assert sig.cache_inputs == ("past_key_0", "past_value_0", "past_key_1", "past_value_1")
    assert sig.cache_outputs[0] == "present_key_0" and sig.cache_shapes[0] == (1, 4, 16, 16)
    llama = generate.decode_signature(get_model("llama_decode", **REDUCED["llama_decode"]))
    assert llama.cache_shapes[0] == (1, 2, 16, 16) and len(llama.cache_inputs) == 4


@pytest.fixture(scope="module")
def emulated(gpt2):
    """The reduced GPT-2's step compiled once for the emulator, on the vDevice SMALL gives."""
    from tvm_rammer import RammerConfig
    from tvm_rammer.checks.emulator.generate import emulated_step

    return emulated_step(gpt2, "rammer/nvidia-h100",
                         RammerConfig(num_sms=2, veus_per_sm=2, profile=False))


@needs_cxx
def test_generate_on_the_emulator_matches_onnxruntime_at_every_step(gpt2, gpt2_path, emulated,
                                                                     capsys, monkeypatch):
    """8 tokens, the reduced GPT-2 compiled once: every step's logits within float32's 1e-4 of
    onnxruntime's, the last caches too, and the tokens onnxruntime's greedy ones. The CLI hands in
    checks.emulator.generate.emulated_step with the flags' target and vDevice (the fixture's step,
    compiled with those, stands in for a second compilation)."""
    from tvm_rammer.checks.emulator import generate as emulated_generate

    asked = []

    def same_step(proto, target, config):
        asked.append((target, config.num_sms, config.veus_per_sm, config.profile))
        return emulated

    monkeypatch.setattr(emulated_generate, "emulated_step", same_step)
    runs = len(emulated.runs)
    assert main(["generate", gpt2_path, "--tokens", "8", "--emulate", "--json", *SMALL]) == 0
    assert asked == [("rammer/nvidia-h100", 2, 2, False)] and len(emulated.runs) == runs + 8
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "emulator" and result["ok"]
    assert len(result["step_rel_err"]) == 8 and max(result["step_rel_err"]) <= 1e-4
    assert result["cache_rel_err"] <= 1e-4 and result["tolerance"] == 1e-4
    assert [t[0] for t in result["tokens"]] == _ort_greedy(gpt2, 8)
    assert len(set(t[0] for t in result["tokens"])) > 1  # not one token repeated (a dead model)
    assert len(result["step_s"]) == 8 and "not GPU times" in result["times"]


@needs_cxx
def test_generate_in_float16_on_the_emulator(gpt2, gpt2_path, capsys):
    """--precision float16 on the fp32 export: checked at float16's tolerance (2e-2), computed in
    half indeed (errors well above float32's), the tokens still onnxruntime's greedy ones."""
    assert main(["generate", gpt2_path, "--tokens", "8", "--emulate", "--json",
                 "--precision", "float16", *SMALL]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["tolerance"] == 2e-2 and result["tokens_match"]
    assert 1e-5 < max(result["step_rel_err"]) <= 2e-2, result["step_rel_err"]
    assert [t[0] for t in result["tokens"]] == _ort_greedy(gpt2, 8)


@needs_cxx
def test_the_check_detects_caches_not_threaded(gpt2, emulated):
    """Negative control: the same emulated step fed the empty caches at every step. Step 0 (empty
    caches either way) still matches; from step 1 on the logits are not onnxruntime's threaded
    ones, and the check says so; threaded, the same step matches (the control's control)."""
    sig = generate.decode_signature(gpt2)
    step, runs = emulated, len(emulated.runs)
    for thread, ok in ((False, False), (True, True)):
        found = generate.decode(step, sig, 3, thread_caches=thread)
        ref = generate.reference_logits(gpt2, sig, found["tokens"])
        verdict = generate.check(found, ref, 1e-4)
        assert verdict["ok"] is ok, verdict
        assert verdict["step_rel_err"][0] <= 1e-4
        if not ok:
            assert verdict["first_bad_step"] == 1 and verdict["step_rel_err"][1] > 1e-2
            text = generate.format_result(generate.result_of(found, ref, 1e-4, "emulator",
                                                             on_gpu=False))
            assert "MISMATCH: logits differ from step 1" in text
    assert len(step.runs) == runs + 6  # one build, one emulator run per step


class _OnnxruntimeStep(generate.DecodeStep):
    """A step handed in by the caller: onnxruntime itself (no emulator, no C++ compiler)."""

    device = "onnxruntime step"

    def __init__(self, proto):
        from tvm_rammer.run.runner import reference_session

        self.sig, self.run = generate.decode_signature(proto), reference_session(proto)

    def step(self, feeds, caches):
        outs = self.run({**feeds, **dict(zip(self.sig.cache_inputs, caches))})
        return outs[0], outs[1:]


def test_generate_runs_the_step_its_caller_hands_in(gpt2):
    """``emulate=`` is a step factory (the CLI hands in the emulator's): generate calls it with the
    model, target and config, drives its steps and checks them; the loop's tokens are an
    independent onnxruntime loop's."""
    made = []

    def factory(proto, target, config):
        made.append((proto.graph.name, target, config))
        return _OnnxruntimeStep(proto)

    result = generate.generate(gpt2, 5, "rammer/nvidia-h100", None, prompt_token=7,
                               emulate=factory)
    assert made == [("gpt2_decode", "rammer/nvidia-h100", None)]
    assert result["ok"] and result["device"] == "onnxruntime step" and result["max_rel_err"] == 0
    assert [t[0] for t in result["tokens"]] == _ort_greedy(gpt2, 5, prompt=7)


def test_the_device_loop_keeps_the_caches_as_device_tensors(gpt2):
    """DeviceStep (the GPU's step) on TVM's CPU device, the model built by TVM's default llvm
    pipeline: every step's cache arguments are the very tensors the step before returned (no
    host round trip), never numpy arrays; the logits match onnxruntime's and the tokens are its
    greedy ones."""
    import tvm

    from tvm_rammer.driver.frontend import import_onnx

    class Recording(generate.DeviceStep):
        def __init__(self, *args):
            super().__init__(*args)
            self.given, self.returned = [], []

        def step(self, feeds, caches):
            logits, out = super().step(feeds, caches)
            self.given.append(list(caches))
            self.returned.append(out)
            return logits, out

    step = Recording(tvm.compile(import_onnx(gpt2), target="llvm"), tvm.cpu())
    sig = generate.decode_signature(gpt2)
    found = generate.decode(step, sig, 4)
    for before, after in zip(step.returned, step.given[1:]):
        assert all(a is b for a, b in zip(after, before))
    assert all(isinstance(c, tvm.runtime.Tensor) for given in step.given for c in given)
    verdict = generate.check(found, generate.reference_logits(gpt2, sig, found["tokens"]), 1e-4)
    assert verdict["ok"], verdict
    assert [t[0] for t in found["tokens"]] == _ort_greedy(gpt2, 4)


def test_a_model_of_another_form_is_one_line(tmp_path, capsys):
    path = str(tmp_path / "b.onnx")
    save_model(get_model("branches", **REDUCED["branches"]), path)
    assert main(["generate", path, "--tokens", "2", "--emulate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a decode step: its inputs are 'input'" in err
    assert "input_ids int64 [B, 1], position int64 [1]" in err


def test_a_decode_step_without_its_cache_outputs_is_refused(gpt2):
    broken = onnx.ModelProto()
    broken.CopyFrom(gpt2)
    del broken.graph.output[-1]
    with pytest.raises(ValueError, match=r"^the model is not a decode step: it has 4 caches and "
                                         r"4 outputs \(logits, then one updated cache"):
        generate.decode_signature(broken)
    swapped = onnx.ModelProto()
    swapped.CopyFrom(gpt2)
    swapped.graph.output[0].CopyFrom(gpt2.graph.output[1])
    with pytest.raises(ValueError, match=r"its first output is 'present_key_0' float32 "
                                         r"\[1, 4, 16, 16\], not the logits"):
        generate.decode_signature(swapped)


@pytest.mark.parametrize("flags, message", [
    (["--tokens", "0"], "--tokens 0: the model's caches hold max_len=16 positions, so generate 1 "
                        "to 16 tokens"),
    (["--tokens", "17"], "--tokens 17: the model's caches hold max_len=16"),
    (["--tokens", "4", "--prompt-token", "96"], "--prompt-token 96: the model's vocabulary has 96 "
                                                "tokens, give an id from 0 to 95"),
])
def test_bad_tokens_are_one_line(gpt2_path, capsys, flags, message):
    assert main(["generate", gpt2_path, "--emulate", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_without_a_gpu_it_says_to_pass_emulate(gpt2_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "gpu_available", lambda: False)
    assert main(["generate", gpt2_path, "--tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tvm-rammer: error: no CUDA GPU is visible: pass --emulate to generate on the "
                   "CPU emulator (slow, checked the same way)")


@pytest.mark.gpu
def test_generate_on_the_gpu_keeps_the_caches_on_the_device(gpt2_path, gpt2, capsys):
    """On a GPU: the caches the step returns are device tensors fed back as they are; the tokens
    are onnxruntime's greedy ones and the per-token latency is reported."""
    assert main(["generate", gpt2_path, "--tokens", "8", "--json", "--no-profile"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and max(result["step_rel_err"]) <= 1e-4
    assert [t[0] for t in result["tokens"]] == _ort_greedy(gpt2, 8)
    assert result["median_token_us"] > 0 and len(result["token_us"]) == 8
    from tvm_rammer import RammerConfig

    sig = generate.decode_signature(gpt2)
    step = generate._gpu_step(gpt2, "rammer/nvidia-h100", RammerConfig(profile=False))
    logits, caches = step.step(sig.feeds(np.zeros(1), 0), step.place(sig.zero_caches()))
    assert isinstance(logits, np.ndarray) and logits.shape == (1, 1, 96)
    assert all(not isinstance(c, np.ndarray) and "cuda" in str(c.device) for c in caches)
