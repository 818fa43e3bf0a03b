"""Each dispatch entry's rKernel body as its own ``__device__ __noinline__`` function
(``RammerConfig.rkernel_functions``, ``tvm_rammer.codegen.rkernel_functions``).

The generated CUDA has one device function per dispatch entry, each called from the dispatch loop,
and no other (control: the option off has none); the thread-local arrays move into the functions;
models give onnxruntime's outputs on the CPU emulator with the option on. Negative controls: a call
that passes the wrong rtask_id gives a wrong result; ``__noinline__`` is added to the outlined
functions only.
"""

import json
import re
import shutil

import pytest

from tvm_rammer import RammerConfig
from tvm_rammer.codegen import rkernel_functions
from tvm_rammer.models import get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import onnx_reference, random_inputs

needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
    reason="the emulator builds kernels with a C++ compiler (none on PATH)")

TOL = 1e-4
SMALL = dict(num_sms=2, veus_per_sm=1)  # a vDevice pinned by hand: every rProgram is built
MODELS = {
    "branches": dict(n=16),
    "squeezenet": dict(image_size=32, width=0.25, num_classes=10),
    "lstm_tc": dict(seq_len=4, input_size=32, hidden=32, layers=2),
}
_DEVICE_FN = re.compile(r'^extern "C" __device__ __noinline__ void (\w+_rkernel(\d+))\(([^)]*)\) \{',
                        re.MULTILINE)
_LOCAL = re.compile(r"^\s*alignas\(\d+\) \w+ (\w+)\[", re.MULTILINE)  # a thread-local array


def _build(name, on: bool):
    from tvm_rammer.checks.emulator import emulation_build

    return emulation_build(get_model(name, **MODELS[name]),
                           config=RammerConfig(**SMALL, rkernel_functions=on))


_BUILDS = {}


def _shared_build(name, on: bool):
    """``_build(name, on)`` made once in this module, for the tests that patch nothing and only
    read (or emulate) the build: the device-function checks and the numerics of the same model."""
    if (name, on) not in _BUILDS:
        _BUILDS[name, on] = _build(name, on)
    return _BUILDS[name, on]


def _entries(build) -> int:
    """Dispatch entries (distinct rKernel bodies) of the build's one persistent kernel."""
    (func,) = [f for _, f in build.relax_mod.functions_items()
               if f.attrs is not None and "rammer.report" in f.attrs]
    return json.loads(str(func.attrs["rammer.report"]))["kernel_bodies"]


def _braced(source: str, start: int, what: str) -> str:
    """``source`` from the ``{`` at ``start`` to its matching ``}``."""
    depth = 0
    for i in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start: i + 1]
    raise AssertionError(f"{what}: no closing brace")


def _kernel_text(source: str, kernel: str) -> str:
    """The definition of ``__global__`` function ``kernel`` in ``source`` (to its closing brace)."""
    return _braced(source, source.index("{", source.index(f" {kernel}(", source.index("__global__"))),
                   kernel)


def _error(proto, result) -> float:
    feeds = random_inputs(proto, 0)
    ref = onnx_reference(proto, feeds)
    assert len(result.outputs) == len(ref)
    return max(relative_error(o, r) for o, r in zip(result.outputs, ref))


# --- the generated CUDA ------------------------------------------------------------------------

def test_noinline_on_the_outlined_functions_only():
    code = ('extern "C" __device__ void k_kernel_rkernel0(int a);\n'
            'extern "C" __device__ void k_kernel_rkernel12(float* __restrict__ p, int a) {\n'
            'extern "C" __device__ void helper(int a);\n'
            'extern "C" __global__ void __launch_bounds__(256) k_kernel_rkernel3(int a) {\n'
            '__device__ __noinline__ int rammer_wait_slow(int a);\n')
    out = rkernel_functions.noinline_source(code).splitlines()
    assert out[0] == 'extern "C" __device__ __noinline__ void k_kernel_rkernel0(int a);'
    assert out[1].startswith('extern "C" __device__ __noinline__ void k_kernel_rkernel12(')
    assert out[2:] == code.splitlines()[2:]  # other device functions and kernels: unchanged
    once = rkernel_functions.noinline_source(code)
    assert rkernel_functions.noinline_source(once) == once  # TVM's callback may run it twice


def test_postproc_runs_after_a_callback_registered_before():
    """``install_postproc`` keeps a ``tvm_callback_cuda_postproc`` registered before it (and runs
    it first); installing again does not wrap twice."""
    import tvm_ffi

    name = rkernel_functions._POSTPROC
    ours = tvm_ffi.get_global_func(name)
    code = 'extern "C" __device__ void k_kernel_rkernel0(int A);'
    tvm_ffi.register_global_func(name, lambda c, _t: str(c).replace("A", "B"), override=True)
    try:
        rkernel_functions.install_postproc()
        chained = tvm_ffi.get_global_func(name)
        rkernel_functions.install_postproc()
        assert tvm_ffi.get_global_func(name).same_as(chained)
        assert chained(code, None) == 'extern "C" __device__ __noinline__ void k_kernel_rkernel0(int B);'
    finally:
        tvm_ffi.register_global_func(name, ours, override=True)
        tvm_ffi.register_global_func(rkernel_functions._OURS, ours, override=True)
    assert ours(code, None) == 'extern "C" __device__ __noinline__ void k_kernel_rkernel0(int A);'


@pytest.mark.parametrize("name", ["squeezenet", "lstm_tc"])
def test_one_device_function_per_dispatch_entry(name):
    on, off = _shared_build(name, True), _build(name, False)
    (kernel,) = on.kernels
    defined = _DEVICE_FN.findall(on.cuda_source)
    entries = _entries(on)
    assert entries > 1 and sorted(int(k) for _, k, _ in defined) == list(range(entries))
    assert all(fn.startswith(f"{kernel}_rkernel") for fn, _, _ in defined)
    body = _kernel_text(on.cuda_source, kernel)
    for fn, _, params in defined:
        assert body.count(f"{fn}(") == 1, fn  # called once, from the dispatch loop
        assert "__shared__" not in params
    # the bodies' thread-local arrays moved into the functions: the kernel keeps only its own
    assert _LOCAL.findall(body) == ["rammer_stop_ptr"]
    # control: without the option, no device function and every body inside the kernel
    assert not re.search(r"_rkernel\d+\(", off.cuda_source)
    assert off.kernels == on.kernels
    assert len(_LOCAL.findall(_kernel_text(off.cuda_source, kernel))) > 1
    print(f"\n{name}: {entries} dispatch entries; CUDA {len(off.cuda_source)} -> "
          f"{len(on.cuda_source)} bytes")


# --- numerics on the emulator ------------------------------------------------------------------

@needs_cxx
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_match_onnxruntime_with_the_option_on(name):
    from tvm_rammer.checks.emulator import emulate

    build = _shared_build(name, True)
    assert _DEVICE_FN.search(build.cuda_source)
    result = emulate(build)
    err = _error(get_model(name, **MODELS[name]), result)
    print(f"\nEMU {name} (rkernel functions): max rel err {err:.2e}, "
          f"g++ {result.gxx_seconds:.1f} s, emulated {result.emulated_wall_s:.2f} s")
    assert len(result.launches) == 1 and err <= TOL


@needs_cxx
def test_wrong_rtask_id_in_the_calls_gives_a_wrong_result(monkeypatch):
    """Negative control: every call passes rtask_id 0 (each operator's first rTask, again and
    again): the emulated outputs no longer match."""
    from tvm import tirx
    from tvm_rammer.checks.emulator import emulate

    closure = rkernel_functions._closure

    def wrong(*closure_args):
        params, args, prologue, sunk = closure(*closure_args)
        args = [tirx.const(0, "int32") if getattr(a, "name", "") == "arg_a" else a for a in args]
        return params, args, prologue, sunk

    monkeypatch.setattr(rkernel_functions, "_closure", wrong)
    build = _build("squeezenet", True)
    assert re.search(r"_rkernel\d+\([^;]*, 0, ", _kernel_text(build.cuda_source, build.kernels[0]))
    err = _error(get_model("squeezenet", **MODELS["squeezenet"]), emulate(build))
    print(f"\nEMU squeezenet, rtask_id 0 in every call: max rel err {err:.2e}")
    assert err > 1e-2


@needs_cxx
def test_bodies_that_cannot_be_outlined_stay_inline(monkeypatch):
    """With thread-local arrays treated as an unsupported scope, the bodies that use one stay in
    the kernel, the others become functions, and the outputs are still right."""
    from tvm_rammer.checks.emulator import emulate

    monkeypatch.setattr(rkernel_functions, "_SINKABLE", ())
    build = _build("squeezenet", True)
    outlined = len(_DEVICE_FN.findall(build.cuda_source))
    assert 0 < outlined < _entries(build)
    err = _error(get_model("squeezenet", **MODELS["squeezenet"]), emulate(build))
    assert err <= TOL


def test_the_cli_turns_the_device_functions_off_and_leaves_them_on_by_default():
    from tvm_rammer import cli

    parser = cli.build_parser()
    for command in (["run", "m.onnx"], ["compile", "m.onnx", "-o", "m.so"], ["inspect", "m.onnx"]):
        assert cli._config(parser.parse_args(command)).rkernel_functions is True
        off = parser.parse_args(command + ["--no-rkernel-functions"])
        assert cli._config(off).rkernel_functions is False


# --- bodies shared by the kernels of several rPrograms -------------------------------------------

def _definition_text(source: str, kernel: str) -> str:
    """The body of ``__global__`` function ``kernel``'s definition (not a declaration) in ``source``."""
    return _braced(source, re.search(rf"\b{kernel}\([^;{{]*\)\s*\{{", source).end() - 1, kernel)


def _calls_by_kernel(build) -> dict:
    """{kernel: the set of device functions its body calls}."""
    return {k: set(re.findall(r"(\w+_rkernel\d+)\(", _definition_text(build.cuda_source, k)))
            for k in build.kernels}


@needs_cxx
def test_a_body_two_rprograms_hold_is_one_function_called_from_both(monkeypatch):
    """LSTM-TC with every wave its own rProgram (``merge="never"``): operators alike in different
    kernels have the same outlined body, defined once and called from each kernel; the model still
    gives onnxruntime's outputs on the emulator. Control: with the merging off, each kernel calls
    only functions of its own, and more are defined."""
    from tvm_rammer.checks.emulator import emulate, emulation_build

    name = "lstm_tc"
    config = RammerConfig(**SMALL, merge="never")
    outline, bounds = rkernel_functions.outline, []

    def recording(gvar, func):  # the launch bounds each callee records (SMALL: 1 vEU per SM)
        out = outline(gvar, func)
        bounds.extend((f.attrs or {}).get("rammer.min_blocks_per_sm") for g, f in out.items()
                      if g is not gvar)
        return out

    monkeypatch.setattr(rkernel_functions, "outline", recording)
    build = emulation_build(get_model(name, **MODELS[name]), config=config)
    assert bounds and all(b is not None and int(b) == 1 for b in bounds)
    defined = [fn for fn, _, _ in _DEVICE_FN.findall(build.cuda_source)]
    calls = _calls_by_kernel(build)
    assert len(build.kernels) > 1 and len(defined) == len(set(defined))
    assert set().union(*calls.values()) == set(defined)  # every call has its one definition
    shared = [fn for fn in defined if sum(fn in c for c in calls.values()) > 1]
    assert shared, "no body is shared by two kernels"
    err = _error(get_model(name, **MODELS[name]), emulate(build))
    assert err <= TOL

    monkeypatch.setattr(rkernel_functions, "_shared_callees", lambda callees: {})
    alone = emulation_build(get_model(name, **MODELS[name]), config=config)
    alone_defined = [fn for fn, _, _ in _DEVICE_FN.findall(alone.cuda_source)]
    assert len(alone_defined) > len(defined)
    assert all(all(fn.startswith(f"{k}_rkernel") for fn in c)
               for k, c in _calls_by_kernel(alone).items())
    print(f"\n{name}, merge=never: {len(build.kernels)} kernels, {len(alone_defined)} -> "
          f"{len(defined)} device functions ({len(shared)} shared); max rel err {err:.2e}")


def test_callees_of_kernels_with_other_launch_bounds_stay_apart():
    """Two callees alike but for their kernels' minimum blocks per SM (``__launch_bounds__``:
    ptxas compiles a callee once for all its callers) are not merged; alike in that too, they are."""
    import tvm
    from tvm import tirx

    def callee(min_blocks):
        x = tirx.Var("x", "int32")
        attrs = {"calling_conv": 0, "rammer.min_blocks_per_sm": min_blocks}
        return tirx.PrimFunc([x], tirx.Evaluate(x + 1)).with_attrs(attrs)

    a, b, c = (tvm.ir.GlobalVar(n) for n in ("k0_kernel_rkernel0", "k1_kernel_rkernel0",
                                              "k2_kernel_rkernel0"))
    assert rkernel_functions._shared_callees({a: callee(2), b: callee(4)}) == {}
    same = rkernel_functions._shared_callees({a: callee(2), b: callee(4), c: callee(2)})
    assert list(same) == [c] and same[c].same_as(a)


def test_the_launch_bounds_are_read_from_the_kernel_attribute_or_its_body():
    """After SplitHostDevice the minimum blocks per SM is the kernel's attribute; before, an
    AttrStmt of its body; neither: None."""
    from tvm import tirx

    x = tirx.Var("x", "int32")
    plain = tirx.PrimFunc([x], tirx.Evaluate(x))
    key = "tirx.launch_bounds_min_blocks_per_sm"
    assert rkernel_functions._min_blocks_per_sm(plain) is None
    assert rkernel_functions._min_blocks_per_sm(plain.with_attr(key, 3)) == 3
    wrapped = tirx.PrimFunc([x], tirx.AttrStmt(tirx.const(0, "int32"), key, tirx.const(2, "int32"),
                                               tirx.Evaluate(x)))
    assert rkernel_functions._min_blocks_per_sm(wrapped) == 2


def test_dropping_an_unused_allocation_may_leave_one_statement():
    """A body of an allocation nothing reads and one loop (GPT-2 small's) becomes the loop alone:
    TVM rejects a SeqStmt of one statement (the compile of GPT-2 small failed there); a body
    whose allocation is read keeps it (control)."""
    from tvm import tirx

    tmp = tirx.decl_buffer((4,), "float32", name="tmp", scope="local")
    out = tirx.decl_buffer((4,), "float32", name="out")
    i = tirx.Var("i", "int32")
    loop = tirx.For(i, 0, 4, tirx.ForKind.SERIAL,
                    tirx.BufferStore(out, tirx.const(1.0, "float32"), [i]))
    assert isinstance(rkernel_functions._drop_unused(tirx.SeqStmt([tirx.AllocBuffer(tmp), loop]),
                                                     [tmp]), tirx.For)
    used = tirx.For(i, 0, 4, tirx.ForKind.SERIAL, tirx.BufferStore(out, tirx.BufferLoad(tmp, [i]), [i]))
    kept = rkernel_functions._drop_unused(tirx.SeqStmt([tirx.AllocBuffer(tmp), used]), [tmp])
    assert isinstance(kept, tirx.SeqStmt) and len(kept.seq) == 2
