"""A lease library loaded on TVM's runtime alone: weights transformed once, then run, checked and
timed.

In: a manifest (``NAME.json``) and the library and weights it names. Out: :class:`Library`, whose
``run`` / ``time`` / ``check_fault`` / ``compare`` / ``evaluate`` are what a GPU host (and a user
deploying a library built elsewhere) calls. Calling convention (issue 31's contract):
``w = vm[transform](*raw)`` once on the device, then ``vm["main"](*inputs, *w)`` per run; without
a transform, ``main`` takes the raw weights.
"""

from __future__ import annotations

import os

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from . import fault_page
from .device import device_for, load_runtime_for
from .reference import onnx_reference, relative_error, seeded_inputs, tolerance_of
from .spec import LibrarySpec, read_spec
from .weights import raw_weights, zoo_model

__all__ = ["Library", "load"]


def _flatten(result) -> list:
    """The VM's result (a tensor or nested tuples of them) as tensors, in order."""
    if isinstance(result, (list, tuple)) or type(result).__name__ == "Array":
        return [x for r in result for x in _flatten(r)]
    return [result]


def _check_tensors(tensors: list, specs: tuple, what: str, spec: LibrarySpec) -> None:
    got = [f"{t.dtype}{list(t.shape)}" for t in tensors]
    want = [s.describe() for s in specs]
    if got != want:
        raise ValueError(f"{spec.library.name}: {what} are {got}, {spec.manifest.name} says "
                         f"{want}: the manifest does not describe this library; rebuild both")


def _launch_error(err: Exception) -> Exception:
    """A user's error for what TVM raised while running ``main``."""
    if "COOPERATIVE_LAUNCH_TOO_LARGE" in str(err):
        return ValueError("the persistent kernel's vEUs cannot all be resident on this GPU at once "
                          "(cooperative launch too large): the library was built for another GPU; "
                          "rebuild it for this GPU's target (or with fewer vEUs per SM)")
    return err


class Library:
    """One loaded library with its weights on the device (use :func:`load`)."""

    def __init__(self, spec: LibrarySpec, device=None, raw: list | None = None):
        """``device``: a ``tvm.runtime.Device`` (default: the manifest's device type, index 0);
        ``raw``: the raw weights as arrays (default: :func:`weights.raw_weights`)."""
        self.spec = spec
        if device is None:
            device = device_for(spec.device_type)
        else:
            load_runtime_for(spec.device_type)  # a device made by the caller: TVM's libraries
        self.device = device
        if not spec.library.is_file():
            raise ValueError(f"the library {spec.library} is missing: copy it beside "
                             f"{spec.manifest.name}")
        self._model = None
        if raw is None:
            regenerate = spec.raw_weights and spec.weights_file is None
            raw = raw_weights(spec, self._zoo_model_or_none() if regenerate else None)
        self.vm = VirtualMachine(tvm.runtime.load_module(str(spec.library)), self.device)
        self.weights = self._transform([tvm.runtime.tensor(w, self.device) for w in raw])

    def _zoo_model_or_none(self):
        if self._model is None and self.spec.model is not None:
            self._model = zoo_model(self.spec)
        return self._model

    def _transform(self, raw: list) -> list:
        """The weights ``main`` takes: ``transform(*raw)`` once (a function of one parameter
        taking all raw weights gets them as one tuple, as LiftTransformParams makes it)."""
        name = self.spec.transform
        if name is None:
            weights = raw
        else:
            try:
                func = self.vm[name]
            except AttributeError:
                raise ValueError(f"{self.spec.library.name} has no function {name!r} that "
                                 f"{self.spec.manifest.name} names as its transform: rebuild "
                                 "both") from None
            arity = self.vm._get_function_arity(name)
            weights = _flatten(func(raw) if arity == 1 and len(raw) != 1 else func(*raw))
        _check_tensors(weights, self.spec.weights, "the weights main takes", self.spec)
        return weights

    # --- runs -------------------------------------------------------------------------------

    def inputs(self, seed: int = 0) -> list:
        """Seeded inputs as NumPy arrays (``tvm_rammer.run.runner.random_inputs``' values)."""
        return seeded_inputs(self.spec, seed)

    def _args(self, inputs) -> list:
        inputs = self.inputs() if inputs is None else inputs
        if len(inputs) != len(self.spec.inputs):
            raise ValueError(f"{len(inputs)} inputs given, {self.spec.name} takes "
                             f"{[t.name for t in self.spec.inputs]}")
        return [tvm.runtime.tensor(np.asarray(x), self.device) for x in inputs] + self.weights

    def run(self, inputs=None) -> list:
        """``main`` once on ``inputs`` (arrays in manifest order; default: seeded); its outputs as
        NumPy arrays, after the fault page was checked (:class:`fault_page.KernelFault`)."""
        try:
            result = self.vm["main"](*self._args(inputs))
        except Exception as err:  # noqa: BLE001 (TVM raises its own error types)
            raise _launch_error(err) from None
        outputs = _flatten(result)
        _check_tensors(outputs, self.spec.outputs, "main's outputs", self.spec)
        arrays = [t.numpy() for t in outputs]  # waits for the device
        self.check_fault()
        return arrays

    def time(self, runs: int = 200, inputs=None) -> float:
        """Median latency of ``main`` in microseconds: TVM's time evaluator (one warm-up call,
        then 10 repeats of ``max(1, runs // 10)`` calls each), then the fault page is checked (a
        fault while timing is an error, not a short time)."""
        timer = self.vm.time_evaluator("main", self.device, number=max(1, runs // 10), repeat=10,
                                       min_repeat_ms=0)
        try:
            median = float(timer(*self._args(inputs)).median * 1e6)
        except Exception as err:  # noqa: BLE001
            raise _launch_error(err) from None
        self.check_fault()
        return median

    # --- the fault page ---------------------------------------------------------------------

    def fault(self) -> dict | None:
        """The fault recorded since the page was last cleared (None: none, or no page)."""
        if not self.spec.fault_page:
            return None
        try:
            page = self.vm[fault_page.PAGE_FUNC]()
        except AttributeError:
            raise ValueError(f"{self.spec.library.name} has no {fault_page.PAGE_FUNC} although "
                             f"{self.spec.manifest.name} says fault_page: true; rebuild both"
                             ) from None
        return fault_page.describe(page.numpy())

    def check_fault(self) -> None:
        """Raise :class:`fault_page.KernelFault` (kernel, vEU, instruction named) when a
        persistent kernel recorded a fault; the page is then cleared, so it is raised once."""
        record = self.fault()
        if record is None:
            return
        self.vm[fault_page.PAGE_FUNC]().copyfrom(fault_page.empty_page())
        raise fault_page.KernelFault(fault_page.message(record), record)

    # --- against a reference ----------------------------------------------------------------

    def reference(self, inputs, model=None) -> list:
        """onnxruntime's outputs for ``inputs``: of ``model`` (an ``onnx.ModelProto`` or a path),
        default the zoo model the manifest names."""
        if model is None:
            model = self._zoo_model_or_none()
            if model is None:
                raise ValueError(f"{self.spec.manifest.name} names no zoo model: pass the ONNX "
                                 "model the library was built from (--onnx PATH, model=)")
        elif not hasattr(model, "graph"):
            import onnx

            model = onnx.load(str(model))
        return onnx_reference(model, self.spec, inputs)

    def compare(self, reference=None, inputs=None, outputs=None) -> dict:
        """``max_rel_err`` of ``outputs`` (default: :meth:`run` on ``inputs``, default seeded)
        against ``reference`` (arrays, an ONNX model or its path; default: onnxruntime on the zoo
        model), with the tolerance and ``ok``."""
        inputs = self.inputs() if inputs is None else inputs
        outputs = self.run(inputs) if outputs is None else outputs
        if reference is None or hasattr(reference, "graph") or isinstance(reference,
                                                                         (str, os.PathLike)):
            reference = self.reference(inputs, reference)
        if len(reference) != len(outputs):
            raise ValueError(f"{len(outputs)} outputs, the reference has {len(reference)}")
        errors = [relative_error(o, r) for o, r in zip(outputs, reference)]
        tolerance = tolerance_of(self.spec)
        worst = max(errors) if errors else 0.0
        return {"max_rel_err": worst, "rel_errs": errors, "tolerance": tolerance,
                "ok": worst <= tolerance}

    def evaluate(self, runs: int = 200, reference: bool = True, seed: int = 0,
                 onnx_model=None) -> dict:
        """One row of the runner's report: run (fault checked), compare with onnxruntime (unless
        ``reference`` is False), time (fault checked after)."""
        inputs = self.inputs(seed)
        outputs = self.run(inputs)
        row = {"model": self.spec.name, "pipeline": self.spec.pipeline,
               "target": self.spec.target, "device": _device_name(self.device),
               "library": str(self.spec.library)}
        if reference:
            row.update(self.compare(onnx_model, inputs, outputs))
            row["reference"] = "onnxruntime"
        else:
            row["reference"] = None
        row["latency_us"] = self.time(runs, inputs)
        row["runs"] = runs
        return row


def _device_name(dev) -> str:
    try:
        name = dev.device_name
    except Exception:  # noqa: BLE001 (the CPU has none in some TVM builds)
        name = None
    return str(name) if name else str(dev)


def load(manifest, device=None) -> Library:
    """Load the library that the manifest ``NAME.json`` describes, with its weights transformed
    on ``device`` (default: the manifest's device type, index 0)."""
    return Library(read_spec(manifest), device)
