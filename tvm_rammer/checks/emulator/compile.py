"""Compile for emulation: what ``tvm.compile`` does, keeping what the emulator needs.

``tvm.compile(mod, target)`` is ``relax.build``: the Relax pipeline for the target, VM code
generation, then ``tvm.tirx.build`` of the PrimFuncs (BindTarget, the TIR pipeline,
``split_host_device_mods``, the finalize passes, ``target.build.cuda``). Its executable hides the
Relax constants, so :func:`emulation_build` runs the same steps itself and keeps:

* the finalized Relax module (``main`` in VM form: alloc_storage / alloc_tensor, builtins, calls of
  the lowered PrimFuncs, constants), which :mod:`tvm_rammer.checks.emulator.interpret` executes;
* the host side of every PrimFunc, read just before ``tirx.MakePackedAPI``
  (:func:`tvm_rammer.checks.emulator.launches.host_functions`): the kernels each one launches;
* the CUDA source of the device module, made by TVM's ``target.build.cuda`` with the CUDA compile
  callback replaced for the duration of the build (``tvm_callback_cuda_compile``; nothing is
  compiled for a GPU) and restored afterwards. The host code is not generated: the emulator never
  runs it.

The same pipeline choice as ``tvm.compile``: ``pipeline="rammer"`` is tvm-rammer's
(:func:`tvm_rammer.driver.pipeline.rammer_pipeline` on the rammer target, with ``config``),
``"default"`` TVM's default pipeline on the plain CUDA target (for comparison), a
``tvm.transform.Pass`` any Relax pipeline, None a module lowered already.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx

from ...config import RammerConfig
from ...target import plain_target, resolve_target
from .launches import Launch, bind_launches, host_functions, kernel_names

__all__ = ["EmulationBuild", "emulation_build", "no_cuda_compile"]

tir_build = importlib.import_module("tvm.tirx.build")  # the module (tirx.build is its function)

CUDA_COMPILE_CALLBACK = "tvm_callback_cuda_compile"
_PACKED_API = "tirx.MakePackedAPI"


@dataclass
class EmulationBuild:
    """What the emulator runs: see the module docstring.

    ``relax_mod``: the finalized Relax module (its PrimFuncs are the ones the TIR pipeline took);
    ``hosts``: ``{PrimFunc name: launches.HostFunc}``; ``cuda_source``: the device module's CUDA;
    ``kernels``: its ``__global__`` functions; ``compile_seconds``: the Relax pipeline plus the TIR
    lowering and CUDA code generation; ``module``: the :class:`~tvm_rammer.checks.emulator.build.EmulatedModule`
    once :meth:`emulated` built it (``gxx_seconds``: its C++ build, 0.0 on a cache hit).
    """

    relax_mod: tvm.IRModule
    target: tvm.target.Target
    pipeline: str
    hosts: dict
    cuda_source: str
    kernels: tuple
    compile_seconds: float
    config: RammerConfig | None = None
    onnx: object = None  # the ONNX ModelProto (shapes bound) when built from one
    input_names: tuple = ()  # the ONNX inputs' names, in main's parameter order
    module: object = None
    gxx_seconds: float = 0.0
    _launches: list | None = field(default=None, repr=False)

    def emulated(self, opt: str | None = None):
        """The EmulatedModule of :attr:`cuda_source` (built with g++/clang++ on first use; the
        runtime caches builds by content); None for a module that launches no kernel (``main``
        only moves data: nothing to build)."""
        if self.module is None and self.kernels:
            from .build import build_module

            start = time.perf_counter()
            self.module = build_module(self.cuda_source, opt=opt)
            self.gxx_seconds = float(getattr(self.module, "build_seconds",
                                             time.perf_counter() - start))
        return self.module

    @property
    def main(self) -> relax.Function:
        return self.relax_mod["main"]

    def launches(self) -> list:
        """Every :class:`~tvm_rammer.checks.emulator.launches.Launch` of one run of ``main``, in order
        (constants by reference)."""
        if self._launches is None:
            self._launches = static_launches(self)
        return self._launches

    def launches_json(self) -> list:
        """:meth:`launches` as JSON-serialisable dicts."""
        return [launch.to_json() for launch in self.launches()]


def static_launches(build: EmulationBuild) -> list:
    """The launches of ``main``'s PrimFunc call sites in binding order (a call inside an ``If``
    counts once, as ``tvm_rammer.driver.launches`` counts)."""
    found: list[Launch] = []
    site = 0
    prims = {gv.name_hint for gv, f in build.relax_mod.functions_items()
             if isinstance(f, tirx.PrimFunc)}

    def on_call(call):
        nonlocal site
        op = call.op
        if isinstance(op, tvm.ir.GlobalVar) and op.name_hint in prims and op.name_hint in build.hosts:
            consts = [arg.value.numpy() if isinstance(arg, tvm.ir.Constant) and
                      hasattr(arg.value, "numpy") else None for arg in call.args]
            nodes = [arg if c is not None else None for arg, c in zip(call.args, consts)]
            found.extend(bind_launches(build.hosts[op.name_hint], site, consts, nodes))
            site += 1

    tvm_ffi.structural_walk(build.main.body, [(tvm.ir.Call, on_call)])
    return found


@contextlib.contextmanager
def no_cuda_compile():
    """Within: TVM's CUDA compile callback returns the source instead of compiling it (no NVRTC,
    no nvcc: the emulator needs the CUDA source only). The previous callback is restored after."""
    previous = tvm_ffi.get_global_func(CUDA_COMPILE_CALLBACK, allow_missing=True)

    def source_only(code, *_args):
        return code

    tvm_ffi.register_global_func(CUDA_COMPILE_CALLBACK, source_only, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(CUDA_COMPILE_CALLBACK, previous, override=True)
        else:
            tvm_ffi.remove_global_func(CUDA_COMPILE_CALLBACK)


def _relax_pipeline(pipeline, target, config, profiler):
    """(Relax pass or None, target to compile for, pipeline label)."""
    from ...codegen.tvm_default import default_pipeline
    from ...driver.pipeline import rammer_pipeline

    if pipeline == "rammer":
        rammer = resolve_target(target)
        return rammer_pipeline(rammer, config, profiler), rammer, "rammer"
    if pipeline == "default":  # a failure says why in one line (codegen.tvm_default.reason_of)
        plain = plain_target(resolve_target(target))
        return default_pipeline(plain), plain, "default"
    if pipeline is None:
        return None, resolve_target(target), "lowered"
    if isinstance(pipeline, tvm.transform.Pass):
        tgt = target if isinstance(target, tvm.target.Target) else resolve_target(target)
        return pipeline, tgt, pipeline.info.name
    raise ValueError(f"pipeline={pipeline!r}: use 'rammer', 'default', a tvm.transform.Pass or "
                     "None (a module lowered already)")


def _module(model, shapes, batch) -> tuple:
    """(Relax module, bound ONNX ModelProto or None, ONNX input names)."""
    from ...driver.frontend import import_onnx, load_onnx
    from ...onnx_prep.shapes import bind_shapes

    if isinstance(model, tvm.IRModule):
        if shapes or batch is not None:
            raise ValueError("shapes= and batch= bind an ONNX model's inputs; a Relax module's "
                             "shapes are already fixed (pass the ONNX model instead)")
        return model, None, ()
    proto = bind_shapes(load_onnx(model), shapes, batch)
    inits = {i.name for i in proto.graph.initializer}
    names = tuple(v.name for v in proto.graph.input if v.name not in inits)
    return import_onnx(proto), proto, names


def _lower_tir(tir_mod: tvm.IRModule, target: tvm.target.Target):
    """``tvm.tirx.build``'s steps 0 to 6 plus the device code generation: (module before
    MakePackedAPI, CUDA source)."""
    target_host = target.host if target.host is not None else tvm.target.Target(
        "llvm" if tvm.runtime.enabled("llvm") else "c")
    bound = target.with_host(target_host)
    mod = tirx.transform.BindTarget(bound)(tir_mod)
    kept = {}

    @tvm.instrument.pass_instrument
    class _Capture:
        """Keeps the module just before ``tirx.MakePackedAPI``."""

        def run_before_pass(self, module, info):
            if info.name == _PACKED_API:
                kept["module"] = module

    current = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(opt_level=current.opt_level, config=current.config,
                                   required_pass=list(current.required_pass),
                                   disabled_pass=list(current.disabled_pass),
                                   instruments=[*current.instruments, _Capture()]):
        pipeline, _finalize_host, finalize_device = tirx.get_tir_pipeline("default")
        mod = pipeline(mod)
        captured = kept.get("module")
        _host_mod, device_mods = tir_build.split_host_device_mods(mod)
        sources = []
        with no_cuda_compile():
            for dev_target, device_mod in device_mods.items():
                if dev_target.kind.name != "cuda":
                    raise ValueError(f"the emulator runs CUDA only; this module has device code for "
                                     f"{dev_target.kind.name}")
                if len(device_mod.functions) == 0:
                    continue
                device_mod = finalize_device()(device_mod)
                built = tir_build.codegen_build(device_mod, dev_target)
                sources.append(built.inspect_source())
    if captured is None:
        raise ValueError("the TIR pipeline ran no tirx.MakePackedAPI: the emulator cannot read the "
                         "host functions' launches")
    return captured, "\n".join(sources)


def emulation_build(model, target="rammer/nvidia-h100", config: RammerConfig | None = None, *,
                    pipeline="rammer", shapes: dict | None = None, batch: int | None = None,
                    profiler=None) -> EmulationBuild:
    """Compile ``model`` (an ONNX ModelProto / path / bytes, or a Relax IRModule) as
    ``tvm.compile`` would, for the emulator (see the module docstring).

    ``target``: anything ``tvm_rammer.compile`` takes; ``config``: the RammerConfig of the rammer
    pipeline (vDevice, options; ignored by the default pipeline); ``pipeline``: ``"rammer"``,
    ``"default"``, a Relax pass or None; ``shapes`` / ``batch`` bind an ONNX model's symbolic
    input dimensions. Returns an :class:`EmulationBuild` (its C++ module is built by
    :meth:`EmulationBuild.emulated`)."""
    start = time.perf_counter()
    mod, proto, names = _module(model, shapes, batch)
    passes, tgt, label = _relax_pipeline(pipeline, target, config, profiler)
    if passes is not None:
        with tgt:
            mod = passes(mod)
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ValueError("the module has no Relax function 'main' to emulate")
    tir = {gv: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    hosts, source = {}, ""
    if tir:
        captured, source = _lower_tir(tvm.IRModule(tir, attrs=mod.attrs), tgt)
        hosts = host_functions(captured)
    return EmulationBuild(relax_mod=mod, target=tgt, pipeline=label, hosts=hosts,
                          cuda_source=source, kernels=kernel_names(source),
                          compile_seconds=time.perf_counter() - start,
                          config=config if label == "rammer" else None, onnx=proto,
                          input_names=names)
