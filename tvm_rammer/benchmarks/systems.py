"""The systems compared: three TVM pipelines and two PyTorch modes of the same ONNX graph.

Every system is compiled, counted, checked against onnxruntime and timed the same way:

* ``lower``: the Relax pipeline only (timed; kernel launches are counted from its output);
* ``build``: ``relax.build`` of the lowered module to CUDA (no second pipeline run);
* ``run``: outputs compared with onnxruntime, then the median of many runs after warm-up.

Launch counting (``launches_per_inference``): ``tvm_rammer.driver.launches.count_launches`` for the plain
pipelines. With CUDA graphs a replay is one ``cudaGraphLaunch``, but what it runs on the GPU is
every kernel captured in it, so a replay counts as the number of kernels captured (the kernels of
the capture function, counted the same way) and the kernels left outside any graph count one each;
``cuda_graph_launches`` also reports the replays and captured kernels separately.

Precision: every system runs at ``RammerConfig.precision``. With "float16" the TVM baselines lower
the model converted by the same ``ToMixedPrecision`` the rammer pipeline applies (float16 storage,
float32 accumulation in conv2d/matmul) and PyTorch runs the module in half (``module.half()``,
inputs cast to half); outputs are compared with onnxruntime's float32 ones within
:func:`tolerance_for` (1e-3 in float32, 1e-2 in float16: float16 keeps 11 significant bits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax

from ..codegen.tvm_default import run_default
from ..config import RammerConfig
from ..driver.frontend import lower as lower_rammer
from ..target import plain_target
from ..driver.launches import count_cuda_graph_launches, count_launches
from ..driver.pipeline import mixed_precision_passes
from ..target import resolve_target

TVM_DEFAULT = "tvm-default"
TVM_CUDA_GRAPH = "tvm-cudagraph"
TVM_RAMMER = "tvm-rammer"
TORCH_EAGER = "torch-eager"
TORCH_CUDA_GRAPH = "torch-cudagraph"
IOS = "ios"  # the rammer pipeline with RammerConfig(policy="ios")
OPARA = "opara"  # the rammer pipeline with RammerConfig(policy="opara")
NIMBLE = "nimble"  # TVM's default kernels on Nimble's streams in one CUDA graph (benchmarks.nimble)
TVM_SYSTEMS = (TVM_DEFAULT, TVM_CUDA_GRAPH, TVM_RAMMER)
TORCH_SYSTEMS = (TORCH_EAGER, TORCH_CUDA_GRAPH)
SYSTEMS = TVM_SYSTEMS + TORCH_SYSTEMS
POLICY_SYSTEMS = (IOS, OPARA)  # the other scheduling policies on the same rTask machinery
EXTRA_SYSTEMS = POLICY_SYSTEMS + (NIMBLE,)  # run when named in --systems, not by default
ALL_SYSTEMS = SYSTEMS + EXTRA_SYSTEMS
DESCRIPTIONS = {
    TVM_DEFAULT: "TVM 0.27 default CUDA Relax pipeline (the paper's RammerBase)",
    TVM_CUDA_GRAPH: "TVM default pipeline with relax.backend.use_cuda_graph=True",
    TVM_RAMMER: "tvm-rammer pipeline (rPrograms as persistent kernels)",
    TORCH_EAGER: "PyTorch eager, ONNX graph converted by onnx2torch",
    TORCH_CUDA_GRAPH: "PyTorch CUDA-graph replay of the same module",
    IOS: "tvm-rammer pipeline with IOS's dynamic-programming stage partition (--policy ios)",
    OPARA: "tvm-rammer pipeline with Opara's resource-aware launch order (--policy opara)",
    NIMBLE: "TVM default kernels on Nimble's stream assignment, captured into one CUDA graph",
}
CUDA_GRAPH_CONFIG = {"relax.backend.use_cuda_graph": True}
TOLERANCES = {"float32": 1e-3, "float16": 1e-2}  # max relative error vs onnxruntime (float32)


def tolerance_for(precision: str) -> float:
    """The largest relative error vs onnxruntime accepted before a system is timed."""
    if precision not in TOLERANCES:
        raise ValueError(f"precision={precision!r}: choose one of {tuple(TOLERANCES)}")
    return TOLERANCES[precision]


@dataclass
class TVMSystem:
    """One TVM pipeline: how to lower a Relax module, for which target, under which PassContext."""

    name: str
    target: tvm.target.Target
    config: RammerConfig

    @property
    def pass_config(self) -> dict:
        return CUDA_GRAPH_CONFIG if self.name == TVM_CUDA_GRAPH else {}

    @property
    def is_rammer(self) -> bool:
        """The rammer pipeline (with Algorithm 1 or another policy of ``tvm_rammer.scheduling.policies``)."""
        return self.name in (TVM_RAMMER,) + POLICY_SYSTEMS

    @property
    def rammer_config(self) -> RammerConfig:
        return replace(self.config, policy=self.name) if self.name in POLICY_SYSTEMS else self.config

    @property
    def build_target(self) -> tvm.target.Target:
        return self.target if self.is_rammer else plain_target(self.target)

    def lower(self, mod: tvm.IRModule) -> tvm.IRModule:
        """The Relax pipeline only (what ``tvm.compile`` runs before code generation)."""
        with tvm.transform.PassContext(config=self.pass_config):
            if self.is_rammer:
                return lower_rammer(mod, self.target, self.rammer_config)
            plain = plain_target(self.target)
            with plain:
                mod = tvm.transform.Sequential(mixed_precision_passes(self.config))(mod)
            # a model TVM cannot compile: DefaultPipelineFailed, one line naming rule and function
            return run_default(relax.get_default_pipeline(plain), mod, plain)

    def build(self, lowered: tvm.IRModule):
        """CUDA code generation of an already lowered module (the pipeline is not run again)."""
        with tvm.transform.PassContext(config=self.pass_config):
            return relax.build(lowered, target=self.build_target, relax_pipeline=None)

    def launches(self, lowered: tvm.IRModule) -> dict:
        """``launches`` per inference (see the module docstring) and how they were counted."""
        if self.name == TVM_CUDA_GRAPH:
            return cuda_graph_launches(lowered)
        return {"launches": count_launches(lowered), "launch_note": "kernel launches"}


def tvm_systems(target, config: RammerConfig, names=TVM_SYSTEMS) -> list:
    """The TVM systems ``names`` for ``target`` (a rammer tag or any CUDA target): by default the
    three TVM pipelines; ``POLICY_SYSTEMS`` are the rammer pipeline with the ``ios`` and ``opara``
    policies."""
    target = resolve_target(target)
    return [TVMSystem(name, target, config) for name in names]


cuda_graph_launches = count_cuda_graph_launches


# --- running and timing ---------------------------------------------------------------------

def _flatten(result) -> list:
    if isinstance(result, (list, tuple)) or type(result).__name__ == "Array":
        return [x for r in result for x in _flatten(r)]
    return [result.numpy()]


def _stats(samples_us) -> dict:
    arr = np.asarray(samples_us, dtype=np.float64)
    return {"median": float(np.median(arr)), "min": float(arr.min()), "max": float(arr.max()),
            "mean": float(arr.mean()), "std": float(arr.std()), "samples": int(arr.size)}


def run_tvm(ex, inputs: list, dev, runs: int) -> tuple:
    """(outputs, latency stats in us): one checked call, warm-up, then ``time_evaluator``.

    ``time_evaluator`` runs ``number`` calls per sample after its own warm-up call; the median of
    ``repeat`` samples is reported (``runs`` calls in all, at least 10 samples).
    """
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    outs = _flatten(vm["main"](*args))  # also captures the CUDA graph, if any
    repeat = max(10, min(runs, 50))
    number = max(1, runs // repeat)
    timer = vm.time_evaluator("main", dev, number=number, repeat=repeat, min_repeat_ms=0,
                              cooldown_interval_ms=0)
    result = timer(*args)
    from ..codegen.faults import check  # a fault while timing: the time is not the model's
    check(vm)
    return outs, _stats([r * 1e6 for r in result.results])


def torch_available() -> str:
    """'' when torch (with CUDA) and onnx2torch import, else the reason they cannot be used."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed (pip install torch onnx2torch)"
    try:
        import onnx2torch  # noqa: F401
    except ImportError:
        return "onnx2torch is not installed (pip install onnx2torch)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


def torch_module(proto, precision: str = "float32"):
    """The ONNX graph as a torch module on the GPU (onnx2torch), in eval mode; in half for
    ``precision="float16"``."""
    from onnx2torch import convert

    tolerance_for(precision)  # validates it
    module = convert(proto).cuda().eval()
    return module.half() if precision == "float16" else module


def _module_dtype(module):
    import torch

    for param in module.parameters():
        return param.dtype
    return torch.float32


def run_torch(module, inputs: list, runs: int, cuda_graph: bool) -> tuple:
    """(outputs, latency stats in us) of eager or CUDA-graph replay, timed with CUDA events."""
    import torch

    dtype = _module_dtype(module)
    args = [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in inputs]
    args = [a.to(dtype) if a.is_floating_point() else a for a in args]
    with torch.inference_mode():
        if cuda_graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    module(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = module(*args)

            def call():
                graph.replay()
                return static_out
        else:
            def call():
                return module(*args)
        out = call()
        torch.cuda.synchronize()
        outs = [o.detach().float().cpu().numpy() if o.is_floating_point() else o.detach().cpu().numpy()
                for o in (out if isinstance(out, (list, tuple)) else [out])]
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        samples = []
        for _ in range(max(10, runs)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    return outs, _stats(samples)


def timed(fn, *args):
    """(result, seconds) of ``fn(*args)``."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
