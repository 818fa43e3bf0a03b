"""``tvm-rammer generate``: greedy decoding with a compiled decode step, checked token by token.

In: an ONNX decode step of the zoo's form (``tvm_rammer.models.transformers``: inputs
``input_ids`` int64 [B, 1], ``position`` int64 [1], then the per-layer caches; outputs ``logits``
[B, 1, vocab], then the updated caches in the caches' order), a number of tokens, a target and a
``RammerConfig``. Out: the generated tokens, each step's logits' relative error against
onnxruntime, and the time of each step.

The loop (:func:`decode`) is the same on every back end: step ``i`` feeds the current token at
position ``i`` with the caches the previous step returned, takes the argmax of the logits as the
next token (per sequence of the batch), and hands the step's caches to the next step as they are.
A back end is a :class:`DecodeStep`: on a GPU (:class:`DeviceStep`) the caches stay device tensors
from step to step and only the logits come back to the host; the CPU emulator's step is handed in
by the caller (``emulate=``, ``checks.emulator.generate.emulated_step``: ``checks`` comes after
this stage). The reference (:func:`reference_logits`) runs onnxruntime over the same tokens, its
caches threaded through its own outputs; the compiled tokens equal onnxruntime's greedy tokens
exactly when onnxruntime's argmax picks the same token at every step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import onnx

from ..config import RammerConfig
from ..host.gpu import gpu_available
from ..numerics import relative_error
from .runner import model_tolerance_of, reference_session

__all__ = ["DecodeSignature", "decode_signature", "DecodeStep", "DeviceStep", "decode",
           "reference_logits", "check", "check_tokens", "generate", "result_of", "format_result",
           "WARMUP_STEPS"]

WARMUP_STEPS = 3  # GPU steps run (on caches of their own) before the timed generation
FORM = ("a decode step takes input_ids int64 [B, 1], position int64 [1], then the caches, and "
        "returns logits [B, 1, vocab], then the updated caches (as `tvm-rammer model gpt2_decode` "
        "or llama_decode writes it)")


@dataclass(frozen=True)
class DecodeSignature:
    """The shape of a decode step: ``batch`` B, ``vocab``, ``max_len`` (the caches' slot axis, 2),
    the caches' input and output names (in order) and their shapes and element type."""

    batch: int
    vocab: int
    max_len: int
    cache_inputs: tuple
    cache_outputs: tuple
    cache_shapes: tuple
    cache_dtype: str

    def zero_caches(self) -> list:
        """Empty caches (zeros) as numpy arrays, in the inputs' order."""
        return [np.zeros(shape, self.cache_dtype) for shape in self.cache_shapes]

    def feeds(self, tokens: np.ndarray, position: int) -> dict:
        """``input_ids`` [B, 1] and ``position`` [1] of one step."""
        return {"input_ids": np.asarray(tokens, np.int64).reshape(self.batch, 1),
                "position": np.array([position], np.int64)}


def _dims(value) -> list:
    return [d.dim_value if d.dim_value > 0 else None for d in value.type.tensor_type.shape.dim]


def _dtype(value) -> str:
    elem = value.type.tensor_type.elem_type
    return onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem else "unknown"


def _shown(value) -> str:
    return f"{value.name!r} {_dtype(value)} {['?' if d is None else d for d in _dims(value)]}"


def decode_signature(proto: onnx.ModelProto, name: str = "the model") -> DecodeSignature:
    """The :class:`DecodeSignature` of ``proto``; ValueError in one line naming what does not fit
    the decode-step form (see the module docstring) or a shape left symbolic."""
    inits = {t.name for t in proto.graph.initializer}
    inputs = [v for v in proto.graph.input if v.name not in inits]
    outputs = list(proto.graph.output)

    def unfit(what):
        return ValueError(f"{name} is not a decode step: {what}; {FORM}")

    if len(inputs) < 3 or [v.name for v in inputs[:2]] != ["input_ids", "position"]:
        raise unfit(f"its inputs are {', '.join(_shown(v) for v in inputs[:4])}"
                    + (" ..." if len(inputs) > 4 else ""))
    ids, pos, caches = inputs[0], inputs[1], inputs[2:]
    if _dtype(ids) != "int64" or len(_dims(ids)) != 2 or _dims(ids)[1] != 1 or \
            _dtype(pos) != "int64" or _dims(pos) != [1]:
        raise unfit(f"input_ids is {_shown(ids)}, position {_shown(pos)}")
    for value in inputs:
        if None in _dims(value):
            raise ValueError(f"{name}: input {_shown(value)} has a symbolic dimension: bind it "
                             "with --batch N or --input-shape NAME=DIMS")
    batch = _dims(ids)[0]
    shapes = tuple(tuple(_dims(c)) for c in caches)
    dtypes = {_dtype(c) for c in caches}
    if any(len(s) != 4 or s[0] != batch for s in shapes) or len(dtypes) != 1 or \
            not dtypes <= {"float32", "float16"}:
        raise unfit(f"its caches are {', '.join(_shown(c) for c in caches)} (each float32 or "
                    f"float16 [B={batch}, heads, max_len, head_dim], all of one type)")
    if len({s[2] for s in shapes}) != 1:
        raise unfit(f"its caches have different max_len (axis 2): {sorted({s[2] for s in shapes})}")
    if len(outputs) != 1 + len(caches):
        raise unfit(f"it has {len(caches)} caches and {len(outputs)} outputs (logits, then one "
                    "updated cache per cache)")
    logits = _dims(outputs[0])
    if len(logits) != 3 or logits[0] not in (batch, None) or logits[1] not in (1, None) or \
            logits[2] is None:
        raise unfit(f"its first output is {_shown(outputs[0])}, not the logits [B={batch}, 1, "
                    "vocab]")
    for cache, out in zip(caches, outputs[1:]):
        if out.type.tensor_type.HasField("shape") and _dims(out) != list(_dims(cache)):
            raise unfit(f"output {_shown(out)} is not the updated {_shown(cache)}")
    return DecodeSignature(batch=batch, vocab=logits[2], max_len=shapes[0][2],
                           cache_inputs=tuple(c.name for c in caches),
                           cache_outputs=tuple(o.name for o in outputs[1:]),
                           cache_shapes=shapes, cache_dtype=dtypes.pop())


def check_tokens(sig: DecodeSignature, tokens: int, prompt_token: int) -> None:
    """ValueError when ``tokens`` steps do not fit the caches (positions 0..tokens-1 < max_len) or
    the prompt token is not in the vocabulary."""
    if not 1 <= tokens <= sig.max_len:
        raise ValueError(f"--tokens {tokens}: the model's caches hold max_len={sig.max_len} "
                         f"positions, so generate 1 to {sig.max_len} tokens")
    if not 0 <= prompt_token < sig.vocab:
        raise ValueError(f"--prompt-token {prompt_token}: the model's vocabulary has "
                         f"{sig.vocab} tokens, give an id from 0 to {sig.vocab - 1}")


class DecodeStep:
    """A compiled decode step as :func:`decode` drives it.

    ``place(caches)`` turns numpy caches into the step's own form (device tensors on a GPU);
    ``step(feeds, caches) -> (logits as numpy, caches in the step's form)`` runs one step, where
    ``feeds`` is :meth:`DecodeSignature.feeds`'s dict; ``host(caches)`` brings caches back as
    numpy (once, at the end, for the check); ``device`` names where it runs."""

    device = "?"

    def place(self, caches: list) -> list:
        return [np.array(c, copy=True) for c in caches]

    def step(self, feeds: dict, caches: list) -> tuple:
        raise NotImplementedError

    def host(self, caches: list) -> list:
        return [np.asarray(c) for c in caches]


class DeviceStep(DecodeStep):
    """A TVM executable on a TVM device (the local GPU for ``generate``): the caches are device
    tensors from step to step (a step's returned caches are the next step's arguments as they
    are); per token only ``input_ids`` and ``position`` go up (8 x (B + 1) bytes) and the
    logits come down."""

    def __init__(self, executable, dev):
        import tvm
        from tvm import relax

        self.device = str(dev.device_name)
        self._tvm, self._dev = tvm, dev
        self._vm = relax.VirtualMachine(executable, dev)

    def place(self, caches: list) -> list:
        return [self._tvm.runtime.tensor(c, self._dev) for c in caches]

    def step(self, feeds: dict, caches: list) -> tuple:
        from .runner import _launch

        args = [self._tvm.runtime.tensor(feeds["input_ids"], self._dev),
                self._tvm.runtime.tensor(feeds["position"], self._dev), *caches]
        out = list(_launch(self._vm, args, self._dev))
        return out[0].numpy(), out[1:]

    def host(self, caches: list) -> list:
        return [c.numpy() for c in caches]


def _next_tokens(logits: np.ndarray) -> np.ndarray:
    """Greedy choice: the argmax of the last position's logits, per sequence ([B])."""
    return np.asarray(logits).reshape(logits.shape[0], -1, logits.shape[-1])[:, -1].argmax(-1)


def decode(step: DecodeStep, sig: DecodeSignature, tokens: int, prompt_token: int = 0,
           thread_caches: bool = True) -> dict:
    """Greedy decoding of ``tokens`` steps from empty caches and ``prompt_token`` at position 0.

    Returns ``tokens`` ([steps][B]: the token fed at each step, then the last one chosen, so
    ``tokens[i + 1]`` is step i's choice), ``logits`` (per step, numpy), ``step_s`` (wall seconds
    of each step: feeding, running, logits on the host) and ``caches`` (the last step's, numpy).
    ``thread_caches=False`` feeds the empty caches to every step (a negative control: the check
    must see it)."""
    empty = sig.zero_caches()
    caches = step.place(empty)
    current = np.full(sig.batch, prompt_token, np.int64)
    fed, logits, times = [current], [], []
    for position in range(tokens):
        if not thread_caches:
            caches = step.place(empty)
        start = time.perf_counter()
        out, returned = step.step(sig.feeds(current, position), caches)
        times.append(time.perf_counter() - start)
        if thread_caches:
            caches = returned
        current = _next_tokens(out)
        fed.append(current)
        logits.append(out)
    return {"tokens": [t.tolist() for t in fed], "logits": logits, "step_s": times,
            "caches": step.host(returned)}


def reference_logits(proto: onnx.ModelProto, sig: DecodeSignature, fed: list) -> dict:
    """onnxruntime over the tokens ``fed`` (``decode``'s ``tokens``: step i is fed ``fed[i]``),
    its caches threaded through its own outputs. Returns ``logits`` (per step), ``choices`` (its
    argmax per step, [steps][B]) and ``caches`` (after the last step)."""
    run = reference_session(proto)
    caches = sig.zero_caches()
    logits, choices = [], []
    for position, current in enumerate(fed[:-1]):
        feeds = sig.feeds(current, position)
        feeds.update(zip(sig.cache_inputs, caches))
        out = run(feeds)
        logits.append(out[0])
        choices.append(_next_tokens(out[0]).tolist())
        caches = out[1:]
    return {"logits": logits, "choices": choices, "caches": caches}


def check(found: dict, ref: dict, tolerance: float) -> dict:
    """``decode``'s result against :func:`reference_logits`': per-step relative error of the
    logits, the last caches' error, whether the tokens are onnxruntime's greedy ones, ``ok``."""
    errors = [relative_error(o, r) for o, r in zip(found["logits"], ref["logits"])]
    cache_err = max((relative_error(o, r) for o, r in zip(found["caches"], ref["caches"])),
                    default=0.0)
    same = found["tokens"][1:] == ref["choices"]
    first = next((i for i, e in enumerate(errors) if not e <= tolerance), None)
    return {"step_rel_err": errors, "max_rel_err": max(errors), "cache_rel_err": cache_err,
            "tokens_match": same, "first_bad_step": first, "tolerance": tolerance,
            "ok": max(errors) <= tolerance and cache_err <= tolerance and same}


def _gpu_step(proto, target, config):
    import tvm

    from ..driver.frontend import compile as compile_model

    executable = compile_model(proto, target=target, config=config)
    return DeviceStep(executable, tvm.cuda(0))


def generate(model, tokens: int, target, config: RammerConfig | None = None,
             prompt_token: int = 0, emulate=None, name: str | None = None) -> dict:
    """Compile the decode step ``model`` (an ONNX path or ModelProto) once, decode ``tokens``
    tokens greedily and check every step against onnxruntime.

    ``emulate(proto, target, config) -> DecodeStep``: the CPU emulator's step, handed in by the
    CLI (``checks.emulator.generate.emulated_step``); without it a CUDA GPU is needed (ValueError
    saying to pass --emulate). On a GPU, :data:`WARMUP_STEPS` steps run first on caches of their
    own and ``median_token_us`` is the median step; on the emulator ``median_step_s`` is the
    emulator's wall time (the CPU's, not a GPU's). The result has :func:`check`'s keys too."""
    from ..driver.frontend import load_onnx
    from ..host import packages

    proto = load_onnx(model)
    name = name or (model if isinstance(model, str) else "the model")
    sig = decode_signature(proto, name)
    check_tokens(sig, tokens, prompt_token)
    if packages.missing("onnxruntime"):
        raise ValueError("generate checks every step's logits against onnxruntime, which is not "
                         "installed: pip install onnxruntime")
    on_gpu = emulate is None
    if on_gpu and not gpu_available():
        raise ValueError("no CUDA GPU is visible: pass --emulate to generate on the CPU emulator "
                         "(slow, checked the same way)")
    step = _gpu_step(proto, target, config) if on_gpu else emulate(proto, target, config)
    if on_gpu:
        decode(step, sig, min(WARMUP_STEPS, sig.max_len), prompt_token)
    found = decode(step, sig, tokens, prompt_token)
    ref = reference_logits(proto, sig, found["tokens"])
    return {"model": proto.graph.name, "batch": sig.batch, "prompt_token": prompt_token,
            **result_of(found, ref, model_tolerance_of(proto, config), step.device, on_gpu)}


def result_of(found: dict, ref: dict, tolerance: float, device: str, on_gpu: bool) -> dict:
    """What ``generate`` reports of :func:`decode`'s ``found`` and :func:`reference_logits`'
    ``ref``: ``device``, ``tokens``, :func:`check`'s keys, and the step times: on a GPU
    ``median_token_us`` and ``token_us``; else (the emulator) ``median_step_s`` and ``step_s``."""
    result = {"device": device, "tokens": found["tokens"], **check(found, ref, tolerance)}
    median = statistics.median(found["step_s"])
    if on_gpu:
        result["median_token_us"] = median * 1e6
        result["token_us"] = [s * 1e6 for s in found["step_s"]]
    else:
        result["median_step_s"] = median
        result["step_s"] = found["step_s"]
        result["times"] = "emulated wall seconds on this CPU, not GPU times"
    return result


def format_result(result: dict) -> str:
    """The tokens, each step's error and time, and the verdict."""
    seqs = list(zip(*result["tokens"]))
    lines = [f"device {result['device']}; every step's logits checked against onnxruntime "
             f"(tolerance {result['tolerance']:.0e})"]
    for b, seq in enumerate(seqs):
        label = "tokens" if len(seqs) == 1 else f"tokens[{b}]"
        lines.append(f"{label}: {seq[0]} (prompt) -> {' '.join(map(str, seq[1:]))}")
    gpu = "median_token_us" in result
    times = result["token_us"] if gpu else result["step_s"]
    for i, (err, t) in enumerate(zip(result["step_rel_err"], times)):
        when = f"{t:9.1f} us" if gpu else f"{t:7.3f} s emulated"
        lines.append(f"  step {i:3d} (position {i}): max rel err {err:.2e}  {when}")
    lines.append(f"per token: median {result['median_token_us']:.1f} us (after "
                 f"{WARMUP_STEPS} warm-up steps)" if gpu else
                 f"per step: median {result['median_step_s']:.3f} s on the CPU emulator "
                 "(not a GPU time)")
    if result["ok"]:
        lines.append(f"OK: logits max rel err {result['max_rel_err']:.2e}, caches "
                     f"{result['cache_rel_err']:.2e}; the tokens are onnxruntime's greedy ones")
    else:
        why = []
        if result["first_bad_step"] is not None:
            why.append(f"logits differ from step {result['first_bad_step']} (max rel err "
                       f"{result['max_rel_err']:.2e})")
        if result["cache_rel_err"] > result["tolerance"]:
            why.append(f"the last caches differ (rel err {result['cache_rel_err']:.2e})")
        if not result["tokens_match"]:
            why.append("the tokens are not onnxruntime's greedy ones")
        lines.append("MISMATCH: " + "; ".join(why))
    return "\n".join(lines)
