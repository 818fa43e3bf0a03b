"""The Nimble executor's issue, capture and replay on the CPU (tvm_rammer.benchmarks.nimble): TVM's
CPU kernels of the same default operators, the CUDA runtime replaced by a stand-in that keeps
cuda-bindings 13's conventions and forbids what stream capture forbids
(tests/nimble_fake_cudart.py).
Checked: outputs of the replayed graph against onnxruntime, every kernel captured once on its
stream, no illegal call during capture, TVM's stream given back, nothing leaked; negative controls
(missing synchronisations, kernels on the legacy stream, a failing call mid-capture, wrong argument
types) and the stand-in's own checks; its conformance with the real bindings where installed."""
import ctypes
import dataclasses
import inspect
import re

import numpy as np
import pytest
import tvm
import tvm_ffi

from nimble_fake_cudart import CapturingLib, FakeCudart, cudaError_t, cudaStreamCaptureMode
from tvm_rammer.benchmarks import nimble
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.numerics import relative_error
from tvm_rammer.run.runner import onnx_reference, random_inputs

SENTINEL = 0x5151  # TVM's stream of the CPU device before prepare(): it must be given back


def _model(name):
    proto = get_model(name, **REDUCED[name])
    feeds = random_inputs(proto, 0)
    inputs = [feeds[v.name] for v in proto.graph.input if v.name in feeds]
    return proto, inputs, onnx_reference(proto, feeds)


def _executor(proto, fake):
    ex = nimble.NimbleExecutor(nimble.default_kernels(import_onnx(proto), "llvm"), "llvm",
                               cudart=fake)
    ex.lib = CapturingLib(ex.lib, fake, ex.dev)
    return ex


def _error(outs, ref):
    return max(relative_error(o, r) for o, r in zip(outs, ref))


@pytest.fixture
def tvm_stream():
    dev = tvm.cpu(0)
    dev.set_raw_stream(SENTINEL)
    yield dev
    dev.set_raw_stream(0)


@pytest.mark.parametrize("name", ["branches", "two_branch", "squeezenet"])
def test_the_replayed_graph_matches_onnxruntime_with_every_kernel_captured_once_on_its_stream(
        name, tvm_stream):
    proto, inputs, ref = _model(name)
    fake = FakeCudart()
    ex = _executor(proto, fake)
    ex.prepare(inputs)
    assert fake.illegal == [] and fake.failures == []
    assert tvm_ffi.get_raw_stream(tvm_stream) == SENTINEL
    assert all(np.isnan(ex.tensors[t].numpy()).all() for t in ex.outputs), "outputs poisoned"
    (nodes,) = fake.execs.values()
    address = {k: int(s) for k, s in enumerate(ex.streams)}
    want = [(n.gvar.name_hint, address[ex.assignment.stream_of[n.index]]) for n in ex.kernels]
    assert [(n["name"], n["stream"]) for n in nodes] == want
    ran = [(k, s) for k, s, how in fake.launched if how == "run"]
    assert ran == want, "the uncaptured run issued every kernel on its stream too"
    assert _error(ex.replay(), ref) <= 1e-4
    assert len(ex.time(3)) == 10
    ex.close()
    assert fake.live() == set() and fake.capturing() == []


def test_without_its_synchronisations_the_graph_computes_garbage(tvm_stream):
    """Negative control: the replay order exposes a missing cross-stream dependency."""
    proto, inputs, ref = _model("branches")
    fake = FakeCudart()
    ex = _executor(proto, fake)
    assert ex.assignment.syncs
    ex.assignment = dataclasses.replace(ex.assignment, syncs=[])
    ex.prepare(inputs)
    assert fake.illegal == []
    assert not _error(ex.replay(), ref) <= 1e-4
    ex.close()


def test_kernels_left_on_the_legacy_stream_are_reported_and_not_in_the_graph(monkeypatch,
                                                                              tvm_stream):
    """Negative control: TVM launching on stream 0 (the stream never set) during the capture."""
    proto, inputs, ref = _model("two_branch")
    fake = FakeCudart()
    ex = _executor(proto, fake)
    monkeypatch.setattr(nimble, "stream_handle", lambda stream: 0)
    ex.prepare(inputs)
    assert [why for _, why in fake.illegal] == [
        "launched on the legacy stream while capturing (runs now, not in the graph)"] * 2
    assert list(fake.execs.values()) == [[]]
    assert not _error(ex.replay(), ref) <= 1e-4
    ex.close()


def test_a_call_failing_during_the_capture_is_named_and_leaves_no_capture_open(tvm_stream):
    proto, inputs, _ = _model("branches")
    fake = FakeCudart()
    ex = _executor(proto, fake)
    fake.inject("cudaEventRecord", capturing=True)
    with pytest.raises(nimble.NimbleCudaError,
                       match="nimble: cudaEventRecord failed with cudaErrorInvalidValue: invalid "
                             "argument"):
        ex.prepare(inputs)
    assert fake.capturing() == [] and fake.graphs == {}
    assert tvm_ffi.get_raw_stream(tvm_stream) == SENTINEL
    with pytest.raises(ValueError, match=r"call prepare\(inputs\) before replay"):
        ex.replay()
    ex.close()
    assert fake.live() == set()


def test_a_kernel_failing_during_the_capture_is_named(tvm_stream):
    proto, inputs, _ = _model("two_branch")
    fake = FakeCudart()
    ex = _executor(proto, fake)
    lib = ex.lib

    class Failing:
        def __getitem__(self, name):
            if fake.capturing():
                raise RuntimeError("CUDALaunch Error: CUDA_ERROR_INVALID_VALUE")
            return lib[name]

    ex.lib = Failing()
    with pytest.raises(RuntimeError, match=r"kernel fused_matmul_relu \(binding \w+, stream 0\) "
                                           r"failed while capturing the graph: .*INVALID_VALUE"):
        ex.prepare(inputs)
    assert fake.capturing() == [] and tvm_ffi.get_raw_stream(tvm_stream) == SENTINEL
    ex.close()
    assert fake.live() == set()


def test_cuda_call_names_the_call_on_a_refused_argument_and_an_unknown_function():
    fake = FakeCudart()
    stream = nimble.cuda_call(fake, "cudaStreamCreateWithFlags", fake.cudaStreamNonBlocking)
    event = nimble.cuda_call(fake, "cudaEventCreateWithFlags", fake.cudaEventDisableTiming)
    assert nimble.cuda_call(fake, "cudaStreamWaitEvent", stream, event, 0) is None
    with pytest.raises(TypeError, match=re.escape("nimble: cudaStreamWaitEvent(c_void_p, "
                                                  "cudaEvent_t, int)")):
        nimble.cuda_call(fake, "cudaStreamWaitEvent", ctypes.c_void_p(int(stream)), event, 0)
    with pytest.raises(TypeError, match="cudaEventRecord"):
        nimble.cuda_call(fake, "cudaEventRecord", stream, event)  # swapped
    with pytest.raises(TypeError, match="cudaStreamCreateWithFlags"):
        nimble.cuda_call(fake, "cudaStreamCreateWithFlags", None)
    with pytest.raises(nimble.NimbleCudaError, match="cudaGraphInstantiateWithFlags failed with "
                                                     "not found in this cuda-python"):
        nimble.cuda_call(fake, "cudaGraphInstantiateWithFlags", None, 0)
    with pytest.raises(nimble.NimbleCudaError, match="cudaEventDestroy failed with "
                                                     "cudaErrorInvalidResourceHandle"):
        nimble.cuda_call(fake, "cudaEventDestroy", fake.cudaEvent_t(0xdead))


# --- the stand-in's own checks (each proves a rule of capture can fail) --------------------------

def _capture(fake, flags=1):
    origin = fake.cudaStreamCreateWithFlags(flags)[1]
    side = fake.cudaStreamCreateWithFlags(flags)[1]
    assert fake.cudaStreamBeginCapture(
        origin, cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed) == (cudaError_t.cudaSuccess,)
    fork = fake.cudaEventCreateWithFlags(2)[1]
    fake.cudaEventRecord(fork, origin)
    fake.cudaStreamWaitEvent(side, fork, 0)
    return origin, side


def _kernel(fake, stream, log, name):
    fake.launch(int(stream), name, lambda: log.append(name), ())


def test_the_stand_in_captures_a_fork_and_join_and_replays_it_in_dependency_order():
    fake, log = FakeCudart(), []
    origin, side = _capture(fake)
    _kernel(fake, origin, log, "a")
    _kernel(fake, side, log, "b")
    join = fake.cudaEventCreateWithFlags(2)[1]
    fake.cudaEventRecord(join, side)
    fake.cudaStreamWaitEvent(origin, join, 0)
    _kernel(fake, origin, log, "c")
    err, graph = fake.cudaStreamEndCapture(origin)
    assert err == cudaError_t.cudaSuccess and log == [] and fake.illegal == []
    exe = fake.cudaGraphInstantiate(graph, 0)[1]
    assert fake.cudaGraphLaunch(exe, origin) == (cudaError_t.cudaSuccess,)
    assert log == ["a", "b", "c"]


@pytest.mark.parametrize("mistake, error", [
    ("sync", cudaError_t.cudaErrorStreamCaptureUnsupported),
    ("uncaptured event", cudaError_t.cudaErrorStreamCaptureIsolation),
    ("legacy stream", cudaError_t.cudaErrorStreamCaptureImplicit),
    ("unjoined", None),
])
def test_the_stand_in_refuses_what_capture_forbids(mistake, error):
    fake, log = FakeCudart(), []
    outside = fake.cudaEventCreateWithFlags(2)[1]
    fake.cudaEventRecord(outside, fake.cudaStreamCreateWithFlags(1)[1])
    origin, side = _capture(fake, flags=0 if mistake == "legacy stream" else 1)
    _kernel(fake, side, log, "b")
    if mistake == "sync":
        assert fake.cudaStreamSynchronize(side) == (error,)
    elif mistake == "uncaptured event":
        assert fake.cudaStreamWaitEvent(side, outside, 0) == (error,)
    elif mistake == "legacy stream":
        assert fake.cudaStreamSynchronize(0) == (error,)
    if error is not None:
        assert fake.illegal
    end = fake.cudaStreamEndCapture(origin)
    assert end == ((cudaError_t.cudaErrorStreamCaptureInvalidated if error is not None
                    else cudaError_t.cudaErrorStreamCaptureUnjoined), None)
    assert fake.capturing() == []


# --- the stand-in against the real bindings (where cuda-python is installed) -------------------

CALLS = ["cudaStreamCreateWithFlags", "cudaStreamDestroy", "cudaEventCreate",
         "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord", "cudaStreamWaitEvent",
         "cudaStreamSynchronize", "cudaEventSynchronize", "cudaEventElapsedTime",
         "cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaStreamIsCapturing",
         "cudaGraphInstantiate", "cudaGraphDestroy", "cudaGraphExecDestroy", "cudaGraphLaunch",
         "cudaGetErrorName", "cudaGetErrorString"]


def test_the_stand_in_keeps_the_real_bindings_names_arities_and_codes():
    real = pytest.importorskip("cuda.bindings.runtime")
    fake = FakeCudart()
    for name in CALLS:
        signature = getattr(real, name).__doc__.splitlines()[0]
        arity = len([p for p in re.search(r"\((.*)\)", signature).group(1).split(",") if p.strip()])
        assert len(inspect.signature(getattr(fake, name)).parameters) == arity, name
    for name in ("cudaStreamNonBlocking", "cudaStreamDefault", "cudaEventDisableTiming",
                 "cudaEventDefault"):
        assert getattr(fake, name) == getattr(real, name), name
    for e in cudaError_t:
        assert int(getattr(real.cudaError_t, e.name)) == int(e), e.name
        assert real.cudaGetErrorString(getattr(real.cudaError_t, e.name))[1] == \
            fake.cudaGetErrorString(e)[1], e.name
    for m in cudaStreamCaptureMode:
        assert int(getattr(real.cudaStreamCaptureMode, m.name)) == int(m)
    assert int(real.cudaStream_t(init_value=0x1230)) == 0x1230
    assert real.cudaStreamWaitEvent.__doc__.startswith("cudaStreamWaitEvent(stream, event,")


def test_every_call_of_a_run_is_one_the_real_bindings_accept(tvm_stream):
    """The executor's calls of a whole run (branches: streams, events, capture, replay, timing,
    close), made again with the real cuda-bindings and handles of the real types: no TypeError
    and a tuple whose first item is a cudaError_t. Without a GPU only (the handles are not real)."""
    real = pytest.importorskip("cuda.bindings.runtime")
    from tvm_rammer.host.gpu import gpu_available

    if gpu_available():
        pytest.skip("replays made-up handles: only where no GPU can be reached")
    proto, inputs, _ = _model("branches")
    fake = FakeCudart()
    with _executor(proto, fake) as ex:
        ex.prepare(inputs)
        ex.replay()
        ex.time(1)
    kinds = {"cudaStream_t", "cudaEvent_t", "cudaGraph_t", "cudaGraphExec_t"}
    made = set()
    for name, args in fake.calls:
        if name.startswith("cudaGetError"):
            continue
        made.add(name)
        real_args = [getattr(real, type(a).__name__)(init_value=int(a))
                     if type(a).__name__ in kinds else a for a in args]
        if name == "cudaStreamBeginCapture":
            real_args[1] = real.cudaStreamCaptureMode(int(args[1]))
        result = getattr(real, name)(*real_args)
        assert isinstance(result, tuple) and isinstance(result[0], real.cudaError_t), name
    assert made == set(CALLS) - {"cudaStreamIsCapturing", "cudaGetErrorName", "cudaGetErrorString"}


# --- the bench column ----------------------------------------------------------------------------

class _CapturingExecutor(nimble.NimbleExecutor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lib = CapturingLib(self.lib, self.cudart, self.dev)


def test_bench_column_times_a_checked_replay_and_marks_a_failure_with_one_warning(monkeypatch,
                                                                                  recwarn):
    proto, inputs, ref = _model("branches")
    monkeypatch.setattr(nimble, "NimbleExecutor", _CapturingExecutor)

    def check(outs):
        return _error(outs, ref)

    fake = FakeCudart()
    ok = nimble.bench_nimble(import_onnx(proto), "llvm", True, inputs, runs=3, check=check,
                             name="branches", cudart=fake)
    assert ok["status"] == "ok" and ok["max_rel_err"] <= 1e-4
    assert ok["latency_stats"]["samples"] == 10
    assert fake.live() == set() and len(recwarn) == 0

    fake = FakeCudart()
    fake.inject("cudaStreamBeginCapture")
    with pytest.warns(RuntimeWarning, match="nimble: branches: prepare failed") as caught:
        bad = nimble.bench_nimble(import_onnx(proto), "llvm", True, inputs, runs=3, check=check,
                                  name="branches", cudart=fake)
    assert len(caught) == 1
    assert bad["status"] == "failed" and bad["stage"] == "prepare"
    assert "cudaStreamBeginCapture failed with cudaErrorInvalidValue" in bad["reason"]
    assert bad["launches"] == ok["launches"] and bad["streams"] == ok["streams"]
    assert fake.live() == set() and fake.capturing() == []
