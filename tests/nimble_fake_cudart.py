"""A CPU stand-in for cuda-python's CUDA runtime bindings (``cuda.bindings.runtime`` of
cuda-bindings 13), for the tests of tvm_rammer.benchmarks.nimble: the executor's issue, capture and
replay run through it without a GPU, with TVM's CPU kernels in place of the CUDA ones.

What it keeps of cuda-bindings 13 (checked against the real module where it is installed,
tests/test_nimble_capture.py): every call returns a tuple, the ``cudaError_t`` first, then the
values (``(err,)`` when there are none); handles are objects (``cudaStream_t``, ``cudaEvent_t``,
``cudaGraph_t``, ``cudaGraphExec_t``) that ``int()`` turns into their address; flags must be
ints; the number of arguments is the real one; ``cudaGetErrorName``/``cudaGetErrorString`` return
``(cudaSuccess, bytes)``; error codes and texts are the real ones. Stricter than the real one: a
handle argument must be of its own kind (a stream may also be an int, 0 the legacy stream), where
the real bindings take any handle and fail later on the GPU.

What it models of stream capture (CUDA Programming Guide, "Stream Capture"): capture begins on one
stream; a stream joins it by waiting on an event recorded in it; work issued to a capturing stream
becomes a graph node depending on the stream's last nodes and on the events it waited for; the
capture ends on the stream where it began, with every joined stream's work joined back
(``cudaErrorStreamCaptureUnjoined`` otherwise). Illegal while capturing (recorded in ``illegal``,
and the capture invalidated as CUDA does): synchronising a capturing stream or a captured event,
waiting on an event recorded outside the capture (``cudaErrorStreamCaptureIsolation``), merging
two captures, the legacy stream while a blocking stream captures
(``cudaErrorStreamCaptureImplicit``).
Kernel launches are reported by the test through :meth:`FakeCudart.launch` with TVM's current
stream (what TVM's CUDA launcher reads); one on the legacy or an unknown stream while a capture is
open runs at once, outside the graph, and is recorded in ``illegal``.

A graph launch runs its kernel nodes on the CPU in an adversarial order: every node as early as
its recorded dependencies allow (a consumer right after its last recorded producer), so a missing
dependency makes a consumer read an input that is not written yet.
"""
from __future__ import annotations

import enum
import inspect
import itertools

cudaStreamDefault = 0
cudaStreamNonBlocking = 1
cudaEventDefault = 0
cudaEventDisableTiming = 2


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInvalidResourceHandle = 400
    cudaErrorIllegalState = 401
    cudaErrorStreamCaptureUnsupported = 900
    cudaErrorStreamCaptureInvalidated = 901
    cudaErrorStreamCaptureMerge = 902
    cudaErrorStreamCaptureUnmatched = 903
    cudaErrorStreamCaptureUnjoined = 904
    cudaErrorStreamCaptureIsolation = 905
    cudaErrorStreamCaptureImplicit = 906
    cudaErrorCapturedEvent = 907


_TEXT = {
    0: b"no error", 1: b"invalid argument", 400: b"invalid resource handle",
    401: b"the operation cannot be performed in the present state",
    900: b"operation not permitted when stream is capturing",
    901: b"operation failed due to a previous error during capture",
    902: b"operation would result in a merge of separate capture sequences",
    903: b"capture was not ended in the same stream as it began",
    904: b"capturing stream has unjoined work",
    905: b"dependency created on uncaptured work in another stream",
    906: b"operation would make the legacy stream depend on a capturing blocking stream",
    907: b"operation not permitted on an event last recorded in a capturing stream",
}


class cudaStreamCaptureMode(enum.IntEnum):
    cudaStreamCaptureModeGlobal = 0
    cudaStreamCaptureModeThreadLocal = 1
    cudaStreamCaptureModeRelaxed = 2


class cudaStreamCaptureStatus(enum.IntEnum):
    cudaStreamCaptureStatusNone = 0
    cudaStreamCaptureStatusActive = 1
    cudaStreamCaptureStatusInvalidated = 2


class _Handle:
    def __init__(self, init_value=0):
        self._address = int(init_value)

    def __int__(self):
        return self._address

    def getPtr(self):
        return self._address

    def __eq__(self, other):
        return type(other) is type(self) and int(other) == self._address

    def __hash__(self):
        return hash((type(self).__name__, self._address))

    def __repr__(self):
        return f"<{type(self).__name__} {self._address:#x}>"


class cudaStream_t(_Handle):
    pass


class cudaEvent_t(_Handle):
    pass


class cudaGraph_t(_Handle):
    pass


class cudaGraphExec_t(_Handle):
    pass


class _Capture:
    def __init__(self, origin, blocking):
        self.origin, self.nodes = origin, []
        self.blocking, self.invalid = blocking, None


class _CudaFailure(Exception):
    def __init__(self, err, why=""):
        super().__init__(why)
        self.err, self.why = err, why


def _api(fn):
    """A call returning ``(cudaSuccess, *values)``, or ``(err,)``/``(err, None)`` on a failure."""
    def call(self, *args):
        self.calls.append((fn.__name__, args))
        try:
            injected = self._injected(fn.__name__)
            if injected is not None:
                raise _CudaFailure(injected, "injected by the test")
            values = fn(self, *args)
        except _CudaFailure as failure:
            self.failures.append((fn.__name__, failure.err, failure.why))
            return (failure.err,) + ((None,) if fn.__name__ in self._VALUED else ())
        return (cudaError_t.cudaSuccess,) + (() if values is None else (values,))
    call.__name__ = fn.__name__
    call.__signature__ = inspect.signature(fn)
    return call


class FakeCudart:
    """The stand-in module: the functions the executor calls plus ``launch`` (a kernel, issued
    by TVM on its current stream), ``illegal`` (what was done that capture forbids), ``failures``,
    ``calls``, ``graphs`` (per graph, its kernel nodes) and :meth:`live` (handles not freed)."""

    cudaError_t = cudaError_t
    cudaStreamCaptureMode = cudaStreamCaptureMode
    cudaStreamCaptureStatus = cudaStreamCaptureStatus
    cudaStream_t, cudaEvent_t, cudaGraph_t, cudaGraphExec_t = (
        cudaStream_t, cudaEvent_t, cudaGraph_t, cudaGraphExec_t)
    cudaStreamDefault, cudaStreamNonBlocking = cudaStreamDefault, cudaStreamNonBlocking
    cudaEventDefault, cudaEventDisableTiming = cudaEventDefault, cudaEventDisableTiming
    _VALUED = {"cudaStreamCreateWithFlags", "cudaEventCreate", "cudaEventCreateWithFlags",
               "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaEventElapsedTime",
               "cudaStreamIsCapturing", "cudaGetErrorName", "cudaGetErrorString"}

    def __init__(self):
        self._next = itertools.count(0x1000, 0x10)
        self.streams: dict = {}   # address -> {"flags", "capture", "frontier", "live"}
        self.events: dict = {}    # address -> {"capture", "deps", "live"}
        self.graphs: dict = {}    # address -> list of nodes (name, fn, args, deps, stream)
        self.execs: dict = {}     # address -> the graph's nodes
        self.illegal: list = []
        self.failures: list = []
        self.calls: list = []
        self.launched: list = []  # (kernel name, stream address, "run" | "captured")
        self._inject: dict = {}   # call name -> (error, only while capturing)

    # -- test controls
    def inject(self, name, error=cudaError_t.cudaErrorInvalidValue, capturing=False):
        """The next call of ``name`` (the next one while a capture is open, with ``capturing``)
        fails with ``error``."""
        self._inject[name] = (error, capturing)

    def _injected(self, name):
        if name in self._inject:
            error, capturing = self._inject[name]
            if not capturing or self._open_captures():
                del self._inject[name]
                return error
        return None

    def live(self) -> set:
        """Handles created and not destroyed."""
        return ({("stream", a) for a, s in self.streams.items() if s["live"]}
                | {("event", a) for a, e in self.events.items() if e["live"]}
                | {("graph", a) for a in self.graphs} | {("exec", a) for a in self.execs})

    def capturing(self) -> list:
        """Addresses of the streams still in a capture."""
        return [a for a, s in self.streams.items() if s["capture"] is not None]

    # -- argument checks (TypeError, as cuda-python raises for an argument it cannot take)
    def _stream(self, stream, allow_legacy=True):
        if stream is None or (isinstance(stream, int) and not isinstance(stream, bool)):
            address = int(stream or 0)
        elif isinstance(stream, cudaStream_t):
            address = int(stream)
        else:
            raise TypeError(f"Argument 'stream' is not instance of type (expected "
                            f"<class 'int'>, or cudaStream_t, found {type(stream).__name__})")
        if address == 0:
            if not allow_legacy:
                raise _CudaFailure(cudaError_t.cudaErrorStreamCaptureUnsupported,
                                   "the legacy stream cannot be captured")
            return None
        state = self.streams.get(address)
        if state is None or not state["live"]:
            raise _CudaFailure(cudaError_t.cudaErrorInvalidResourceHandle, f"stream {address:#x}")
        return state

    def _handle(self, kind, value, table, what):
        if not isinstance(value, kind):
            raise TypeError(f"Argument '{what}' is not instance of type (expected "
                            f"{kind.__name__}, found {type(value).__name__})")
        state = table.get(int(value))
        if state is None or (isinstance(state, dict) and not state.get("live", True)):
            raise _CudaFailure(cudaError_t.cudaErrorInvalidResourceHandle, f"{what} {value!r}")
        return state

    @staticmethod
    def _flags(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("an integer is required")
        return value

    def _open_captures(self):
        found = []
        for s in self.streams.values():
            if s["capture"] is not None and s["capture"] not in found:
                found.append(s["capture"])
        return found

    def _illegal(self, call, err, why, capture=None):
        self.illegal.append((call, why))
        for cap in ([capture] if capture is not None else self._open_captures()):
            cap.invalid = cap.invalid or err
        raise _CudaFailure(err, why)

    def _legacy_use(self, call):
        """The legacy stream synchronises with every blocking stream: illegal while one captures."""
        for cap in self._open_captures():
            if cap.blocking:
                self._illegal(call, cudaError_t.cudaErrorStreamCaptureImplicit,
                              "the legacy stream used while a blocking stream captures", cap)

    def _check_capture(self, state):
        cap = state["capture"] if state is not None else None
        if cap is not None and cap.invalid is not None:
            raise _CudaFailure(cudaError_t.cudaErrorStreamCaptureInvalidated, "capture invalidated")
        return cap

    # -- the runtime API
    @_api
    def cudaGetErrorName(self, error):
        return cudaError_t(int(error)).name.encode()

    @_api
    def cudaGetErrorString(self, error):
        return _TEXT.get(int(error), b"unknown error")

    @_api
    def cudaStreamCreateWithFlags(self, flags):
        address = next(self._next)
        self.streams[address] = {"flags": self._flags(flags), "capture": None, "frontier": set(),
                                 "live": True}
        return cudaStream_t(address)

    @_api
    def cudaStreamDestroy(self, stream):
        state = self._stream(stream)
        if state is None:
            raise _CudaFailure(cudaError_t.cudaErrorInvalidResourceHandle, "the legacy stream")
        state["live"] = False

    def _new_event(self):
        address = next(self._next)
        self.events[address] = {"capture": None, "deps": frozenset(), "live": True,
                                "recorded": False}
        return cudaEvent_t(address)

    @_api
    def cudaEventCreate(self):
        return self._new_event()

    @_api
    def cudaEventCreateWithFlags(self, flags):
        self._flags(flags)
        return self._new_event()

    @_api
    def cudaEventDestroy(self, event):
        self._handle(cudaEvent_t, event, self.events, "event")["live"] = False

    @_api
    def cudaEventRecord(self, event, stream):
        ev = self._handle(cudaEvent_t, event, self.events, "event")
        state = self._stream(stream)
        if state is None:
            self._legacy_use("cudaEventRecord")
        cap = self._check_capture(state)
        ev["capture"], ev["recorded"] = cap, True
        ev["deps"] = frozenset(state["frontier"]) if cap is not None else frozenset()

    @_api
    def cudaStreamWaitEvent(self, stream, event, flags):
        ev = self._handle(cudaEvent_t, event, self.events, "event")
        self._flags(flags)
        state = self._stream(stream)
        if state is None:
            self._legacy_use("cudaStreamWaitEvent")
            return
        cap = self._check_capture(state)
        if not ev["recorded"]:
            return  # an event never recorded is complete: no dependency
        source = ev["capture"]
        if source is not None and source not in self._open_captures():
            source = None  # recorded in a capture that has ended: uncaptured work now
        if cap is None:
            if source is not None:  # the stream joins the capture
                state["capture"], state["frontier"] = source, set(ev["deps"])
            return
        if source is None:
            self._illegal("cudaStreamWaitEvent", cudaError_t.cudaErrorStreamCaptureIsolation,
                          "a capturing stream waits on an event recorded outside the capture", cap)
        if source is not cap:
            self._illegal("cudaStreamWaitEvent", cudaError_t.cudaErrorStreamCaptureMerge,
                          "waits on an event of another capture", cap)
        state["frontier"] |= ev["deps"]

    @_api
    def cudaStreamSynchronize(self, stream):
        state = self._stream(stream)
        if state is None:
            self._legacy_use("cudaStreamSynchronize")
        elif state["capture"] is not None:
            self._illegal("cudaStreamSynchronize", cudaError_t.cudaErrorStreamCaptureUnsupported,
                          "synchronises a capturing stream", state["capture"])

    @_api
    def cudaEventSynchronize(self, event):
        ev = self._handle(cudaEvent_t, event, self.events, "event")
        if ev["capture"] is not None and ev["capture"] in self._open_captures():
            self._illegal("cudaEventSynchronize", cudaError_t.cudaErrorCapturedEvent,
                          "synchronises a captured event", ev["capture"])

    @_api
    def cudaEventElapsedTime(self, start, end):
        for event in (start, end):
            ev = self._handle(cudaEvent_t, event, self.events, "event")
            if ev["capture"] is not None and ev["capture"] in self._open_captures():
                raise _CudaFailure(cudaError_t.cudaErrorCapturedEvent, "a captured event")
        return 0.001 * max(1, len(self.launched))  # ms; a deterministic stand-in

    @_api
    def cudaStreamBeginCapture(self, stream, mode):
        if not isinstance(mode, int):
            raise TypeError("Argument 'mode' is not instance of type cudaStreamCaptureMode")
        cudaStreamCaptureMode(int(mode))
        state = self._stream(stream, allow_legacy=False)
        if state["capture"] is not None:
            raise _CudaFailure(cudaError_t.cudaErrorIllegalState, "already capturing")
        state["capture"] = _Capture(id(state), blocking=not state["flags"] & cudaStreamNonBlocking)
        state["frontier"] = set()

    @_api
    def cudaStreamIsCapturing(self, stream):
        state = self._stream(stream)
        cap = state["capture"] if state is not None else None
        if cap is None:
            return cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
        return (cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated if cap.invalid
                else cudaStreamCaptureStatus.cudaStreamCaptureStatusActive)

    @_api
    def cudaStreamEndCapture(self, stream):
        state = self._stream(stream)
        cap = state["capture"] if state is not None else None
        if cap is None:
            raise _CudaFailure(cudaError_t.cudaErrorIllegalState, "the stream is not capturing")
        if cap.origin != id(state):
            cap.invalid = cap.invalid or cudaError_t.cudaErrorStreamCaptureUnmatched
            raise _CudaFailure(cudaError_t.cudaErrorStreamCaptureUnmatched, "not the origin")
        members = [s for s in self.streams.values() if s["capture"] is cap]
        reach, todo = set(), list(state["frontier"])
        while todo:  # the nodes the origin's last work depends on
            n = todo.pop()
            if n not in reach:
                reach.add(n)
                todo.extend(cap.nodes[n]["deps"])
        unjoined = any(not s["frontier"] <= reach for s in members)
        for s in members:
            s["capture"], s["frontier"] = None, set()
        if cap.invalid is not None:
            raise _CudaFailure(cudaError_t.cudaErrorStreamCaptureInvalidated, "invalidated")
        if unjoined:
            raise _CudaFailure(cudaError_t.cudaErrorStreamCaptureUnjoined, "unjoined work")
        address = next(self._next)
        self.graphs[address] = list(cap.nodes)
        return cudaGraph_t(address)

    @_api
    def cudaGraphDestroy(self, graph):
        self._handle(cudaGraph_t, graph, self.graphs, "graph")
        del self.graphs[int(graph)]

    @_api
    def cudaGraphInstantiate(self, graph, flags):
        nodes = self._handle(cudaGraph_t, graph, self.graphs, "graph")
        self._flags(flags)
        address = next(self._next)
        self.execs[address] = list(nodes)
        return cudaGraphExec_t(address)

    @_api
    def cudaGraphExecDestroy(self, graph_exec):
        self._handle(cudaGraphExec_t, graph_exec, self.execs, "graphExec")
        del self.execs[int(graph_exec)]

    @_api
    def cudaGraphLaunch(self, graph_exec, stream):
        nodes = self._handle(cudaGraphExec_t, graph_exec, self.execs, "graphExec")
        state = self._stream(stream)
        if state is not None and state["capture"] is not None:
            self._illegal("cudaGraphLaunch", cudaError_t.cudaErrorStreamCaptureUnsupported,
                          "a graph launched into a capture (not in Nimble's flow)")
        for n in _eager_order(nodes):
            nodes[n]["fn"](*nodes[n]["args"])

    # -- kernels (reported by the test's wrapper around the executor's kernels)
    def launch(self, stream_address: int, name: str, fn, args):
        """TVM launched kernel ``name`` on stream ``stream_address`` (its current stream): run it,
        or record it as a node when that stream captures."""
        state = self.streams.get(stream_address) if stream_address else None
        cap = state["capture"] if state is not None else None
        if cap is None:
            if self._open_captures():
                where = ("the legacy stream" if not stream_address
                         else "a stream outside the capture")
                self.illegal.append(("kernel " + name, f"launched on {where} while capturing "
                                     "(runs now, not in the graph)"))
                if not stream_address:
                    for c in self._open_captures():
                        if c.blocking:
                            c.invalid = c.invalid or cudaError_t.cudaErrorStreamCaptureImplicit
            self.launched.append((name, stream_address, "run"))
            return fn(*args)
        if cap.invalid is not None:  # what TVM's launcher raises on cuLaunchKernelEx's error
            raise RuntimeError("CUDALaunch Error: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
        cap.nodes.append({"name": name, "fn": fn, "args": args, "stream": stream_address,
                          "deps": frozenset(state["frontier"])})
        state["frontier"] = {len(cap.nodes) - 1}
        self.launched.append((name, stream_address, "captured"))
        return None


def _eager_order(nodes) -> list:
    """A topological order of the graph's nodes that runs each as soon as its recorded
    dependencies have run (a consumer right after its last producer; among the nodes ready at the
    start, capture order)."""
    waiting = {n: set(node["deps"]) for n, node in enumerate(nodes)}
    users: dict = {}
    for n, deps in waiting.items():
        for d in deps:
            users.setdefault(d, []).append(n)
    stack = [n for n in reversed(range(len(nodes))) if not waiting[n]]
    order = []
    while stack:
        n = stack.pop()
        order.append(n)
        ready = []
        for u in users.get(n, ()):
            waiting[u].discard(n)
            if not waiting[u]:
                ready.append(u)
        stack.extend(reversed(ready))
    assert len(order) == len(nodes), "a captured graph is acyclic"
    return order


class CapturingLib:
    """The executor's kernels (``ex.lib``) reporting each call to ``fake.launch`` with TVM's
    current stream of ``dev`` (``tvm_ffi.get_raw_stream``: what TVM's CUDA launcher reads)."""

    def __init__(self, lib, fake: FakeCudart, dev):
        self.lib, self.fake, self.dev = lib, fake, dev

    def __getitem__(self, name):
        import tvm_ffi

        fn = self.lib[name]

        def launch(*args):
            return self.fake.launch(int(tvm_ffi.get_raw_stream(self.dev)), name, fn, args)
        return launch
