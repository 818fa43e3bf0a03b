"""Nimble as a baseline system: TVM's default kernels launched ahead of time on several CUDA streams,
captured into one CUDA graph and replayed (Kwon et al., "Nimble: Lightweight and Parallel GPU Task
Scheduling for Deep Learning", NeurIPS'20, section 4).

Stream assignment (:func:`stream_assignment`, pure, tested on the CPU). Nimble's Algorithm 1:

1. the minimum equivalent graph G' of the operator DAG (:func:`minimum_equivalent_graph`: the
   fewest edges with the same reachability; for a DAG its transitive reduction, which is unique);
2. the bipartite graph B with an edge x_u -> y_v for every edge (u, v) of G';
3. a maximum matching M of B (:func:`maximum_matching`, augmenting paths);
4. every matched edge joins its two operators into one set;
5. one stream per set.

Operators that do not depend on each other so always run on different streams ("maximum logical
concurrency"), and among the assignments that do so this one needs the fewest cross-stream
synchronisations: |E'| - |M|, one per edge of G' between two streams (Nimble's Theorems 1-4).

The executor (:class:`NimbleExecutor`, needs a CUDA GPU and cuda-python). TVM 0.27's Relax VM
launches every kernel on the device's one current stream, so it cannot run Nimble's schedule.
Instead the executor takes ``main`` after TVM's default legalisation, fusion and dlight
(:func:`default_kernels`: every operator one ``call_tir``), builds its PrimFuncs with
``tvm.tirx.build`` and calls them itself: all tensors allocated ahead of time, each kernel on its
operator's stream (TVM launches on the stream set with ``Device.set_raw_stream``), an event
recorded after a kernel whose successor runs on another stream and waited for by that stream
(``cudaEventRecord`` / ``cudaStreamWaitEvent``; TVM's ``Device_StreamSyncFromTo`` records at the
tail of the source stream, not after one kernel), the whole issue captured into one CUDA graph
(``cudaStreamBeginCapture`` on the first stream, which the others join with an event) and replayed
with ``cudaGraphLaunch``. TVM's runtime has no stream capture or event API in Python; cuda-python
provides them (``pip install cuda-python``).

The streams are non-blocking: TVM copies tensors on the legacy stream, which neither waits for
them nor breaks their capture. Every CUDA runtime call goes through :func:`cuda_call`, which raises
:class:`NimbleCudaError` naming the call and CUDA's error; a failed capture is ended and TVM's
current stream given back, so one failure does not break what runs next. :func:`bench_nimble`
marks its column failed (stage and reason) with one warning naming the model. On ``llvm`` the same
executor runs TVM's CPU kernels with a stand-in ``cudart`` (tests/nimble_fake_cudart.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

__all__ = ["StreamAssignment", "minimum_equivalent_graph", "maximum_matching", "stream_assignment",
           "kernel_target", "default_kernels", "NimbleExecutor", "NimbleCudaError", "cuda_call",
           "stream_handle", "nimble_available", "bench_nimble", "NIMBLE"]

NIMBLE = "nimble"


@dataclass(frozen=True)
class StreamAssignment:
    """Nimble's stream assignment of a DAG.

    Attributes:
        stream_of: operator -> stream index (streams numbered by their first operator).
        streams: per stream, its operators in the given topological order.
        meg_edges: the edges of the minimum equivalent graph, sorted.
        syncs: the edges of ``meg_edges`` between two streams: the synchronisations (an event
            after the first operator, waited for by the second one's stream).
    """

    stream_of: dict
    streams: list
    meg_edges: list
    syncs: list


def _closed_preds(nodes: Sequence, preds: Mapping) -> dict:
    inside = set(nodes)
    position = {n: k for k, n in enumerate(nodes)}
    found = {}
    for n in nodes:
        ps = sorted({p for p in preds.get(n, ()) if p in inside}, key=position.__getitem__)
        for p in ps:
            if position[p] >= position[n]:
                raise ValueError(f"node {p} precedes node {n}; pass the nodes in a topological order")
        found[n] = ps
    return found


def minimum_equivalent_graph(nodes: Sequence, preds: Mapping) -> list:
    """The edges (u, v) of the minimum equivalent graph of the DAG (``nodes`` in a topological order,
    ``preds[v]`` the nodes v reads; others ignored): those with no other path from u to v."""
    preds = _closed_preds(nodes, preds)
    position = {n: k for k, n in enumerate(nodes)}
    succs = {n: [] for n in nodes}
    for v in nodes:
        for u in preds[v]:
            succs[u].append(v)
    reach = {}  # bit mask of the nodes reachable from n by a path of one edge or more
    for u in reversed(nodes):
        mask = 0
        for v in succs[u]:
            mask |= (1 << position[v]) | reach[v]
        reach[u] = mask
    edges = []
    for u in nodes:
        for v in succs[u]:
            bit = 1 << position[v]
            if not any(reach[w] & bit for w in succs[u] if w != v):
                edges.append((u, v))
    return sorted(edges, key=lambda e: (position[e[0]], position[e[1]]))


def maximum_matching(left: Sequence, edges: Sequence) -> dict:
    """A maximum matching of the bipartite graph with ``edges`` (left, right): right -> left.

    Kuhn's augmenting paths, iterative (paths can be as long as the graph is deep), trying left
    vertices and their edges in the given order (deterministic)."""
    adj = {u: [] for u in left}
    for u, v in edges:
        adj[u].append(v)
    owner: dict = {}
    for root in left:
        came = {root: (None, None)}  # left vertex -> (right vertex it was reached by, its finder)
        stack = [(root, iter(adj[root]))]
        seen: set = set()
        found = None
        while stack and found is None:
            u, todo = stack[-1]
            for v in todo:
                if v in seen:
                    continue
                seen.add(v)
                if v not in owner:
                    found = (u, v)
                else:
                    came[owner[v]] = (v, u)
                    stack.append((owner[v], iter(adj[owner[v]])))
                break
            else:
                stack.pop()
        if found is not None:  # flip the augmenting path back to the root
            u, v = found
            while u is not None:
                owner[v] = u
                v, u = came[u]
    return owner


def stream_assignment(nodes: Sequence, preds: Mapping) -> StreamAssignment:
    """Nimble's Algorithm 1 (module docstring) on the DAG of ``nodes`` (a topological order)."""
    nodes = list(nodes)
    if len(set(nodes)) != len(nodes):
        raise ValueError("stream_assignment: every node may appear once")
    edges = minimum_equivalent_graph(nodes, preds)
    matched = maximum_matching(nodes, edges)  # v -> u: v runs right after u on u's stream
    nxt = {u: v for v, u in matched.items()}
    stream_of: dict = {}
    streams: list = []
    for n in nodes:
        if n in matched:
            continue  # its stream starts at the head of its matched chain
        streams.append([])
        cur = n
        while cur is not None:
            stream_of[cur] = len(streams) - 1
            streams[-1].append(cur)
            cur = nxt.get(cur)
    syncs = [(u, v) for u, v in edges if stream_of[u] != stream_of[v]]
    return StreamAssignment(stream_of, streams, edges, syncs)


# --- the executor (GPU) ----------------------------------------------------------------------------

def _is_cpu(target) -> bool:
    import tvm

    if isinstance(target, str):
        return target.split()[0] == "llvm"
    return isinstance(target, tvm.target.Target) and target.kind.name == "llvm"


def kernel_target(target):
    """The target the kernels are built for: a CUDA target (tag, dict or Target, rammer or not)
    without the rammer key, or ``llvm`` (the CPU stand-in of the tests: TVM's CPU kernels, run
    when called, with the stream calls going to a fake ``cudart``)."""
    import tvm

    from ..target import plain_target

    if _is_cpu(target):
        return tvm.target.Target("llvm")
    return plain_target(target)


def default_kernels(mod, target):
    """``mod`` after TVM's default CUDA legalisation, fusion and dlight (the kernels TVM's default
    pipeline would launch), before the VM lowering: ``main`` is one dataflow block of call_tirs.
    On ``llvm`` (:func:`kernel_target`), TVM's CPU legalisation and fusion: the same operators,
    without dlight's GPU schedules."""
    import tvm

    target = kernel_target(target)
    if target.kind.name == "llvm":
        from tvm.relax.backend.cpu_generic import pipeline as backend
    else:
        from tvm.relax.backend.cuda import pipeline as backend
    with target:
        seq = tvm.transform.Sequential(backend.library_dispatch_passes(target)
                                       + backend.legalize_passes(target))
        return seq(mod)


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return None
    return cudart


def nimble_available() -> str:
    """'' when the executor can run here, else why not."""
    from ..host.gpu import gpu_available

    if not gpu_available():
        return "timing needs a GPU: none visible"
    if _cudart() is None:
        return ("nimble needs cuda-python for CUDA events and graph capture, which TVM's runtime "
                "does not expose (pip install cuda-python)")
    return ""


class NimbleCudaError(RuntimeError):
    """A CUDA runtime call of the executor returned an error: ``call`` is its name, ``error``
    CUDA's name and description of the code (``cudaErrorStreamCaptureInvalidated: operation
    failed due to a previous error during capture``)."""

    def __init__(self, call: str, error: str):
        super().__init__(f"nimble: {call} failed with {error}")
        self.call = call
        self.error = error


def _error_text(cudart, err) -> str:
    """'cudaErrorX: description' for a cudaError_t (cuda-python returns both as (err, bytes))."""
    def ask(name):
        try:
            result = getattr(cudart, name)(err)
        except Exception:  # noqa: BLE001 (a description is best effort; the code is still named)
            return ""
        value = result[-1] if isinstance(result, tuple) else result
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")

    name = ask("cudaGetErrorName") or f"CUDA error {int(err)}"
    text = ask("cudaGetErrorString")
    return f"{name}: {text}" if text else name


def cuda_call(cudart, name: str, *args):
    """``cudart.<name>(*args)`` under cuda-python's conventions (cuda-bindings 12 and 13 return a
    tuple: the ``cudaError_t``, then the values): the value (None when there is none, a tuple when
    there are several). Raises NimbleCudaError naming the call and CUDA's error, TypeError naming
    the call and the argument types when the bindings refuse an argument."""
    fn = getattr(cudart, name, None)
    if fn is None:
        raise NimbleCudaError(name, "not found in this cuda-python (pip install -U cuda-python)")
    try:
        result = fn(*args)
    except TypeError as err:
        kinds = ", ".join(type(a).__name__ for a in args)
        raise TypeError(f"nimble: {name}({kinds}): {err}") from err
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if err != cudart.cudaError_t.cudaSuccess:
        raise NimbleCudaError(name, _error_text(cudart, err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def stream_handle(stream) -> int:
    """The address of a CUDA stream (cuda-python's ``cudaStream_t``/``CUstream``, or an int) as
    the plain int TVM's ``Device.set_raw_stream`` takes (TVM 0.27 rejects ``ctypes.c_void_p``)."""
    return int(stream)


def _current_stream(dev) -> int:
    """TVM's current stream of ``dev`` (the one its CUDA kernels launch on: TVMFFIEnvGetStream)."""
    import tvm_ffi

    return int(tvm_ffi.get_raw_stream(dev))


class NimbleExecutor:
    """Nimble's ahead-of-time multi-stream schedule of a module's default kernels (module docstring).

    ``mod``: the output of :func:`default_kernels` for ``target``. Raises ValueError when ``main``
    holds a binding that is not a kernel call (a library call, control flow): the executor launches
    call_tirs only. ``cudart``: the CUDA runtime bindings (default cuda-python's; the CPU tests pass
    a stand-in). ``dev``: default ``tvm.cuda(0)`` (``tvm.cpu(0)`` on ``llvm``).

    Every CUDA runtime call that fails raises :class:`NimbleCudaError` naming the call; a failed
    :meth:`prepare` ends its capture and gives TVM back the stream it had. :meth:`close` (or a
    ``with`` block) frees the streams, events and graphs.
    """

    def __init__(self, mod, target, dev=None, cudart=None):
        import tvm

        from relay_passes.dataflow_graph import DataflowGraph

        self.cudart = cudart if cudart is not None else _cudart()
        if self.cudart is None:
            raise ValueError(nimble_available()
                             or "nimble needs cuda-python (pip install cuda-python)")
        target = kernel_target(target)
        if dev is None:
            dev = tvm.cpu(0) if target.kind.name == "llvm" else tvm.cuda(0)
        self.dev = dev
        func = mod["main"]
        graph = DataflowGraph.from_function(func, mod)
        bad = [n for n in graph.nodes if n.kind == "opaque"]
        if bad:
            raise ValueError(f"nimble: binding {bad[0].name} of main is not a kernel call "
                             f"({bad[0].reason}); the executor launches call_tir kernels only")
        self.graph = graph
        self.kernels = [n for n in graph.nodes if n.kind == "call_tir"]
        names = {}
        for node in self.kernels:
            names.setdefault(node.gvar.name_hint, mod[node.gvar])
        prims = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in names.items()})
        self.lib = tvm.tirx.build(prims, target)
        self.assignment = stream_assignment([n.index for n in self.kernels],
                                            {n.index: n.preds for n in self.kernels})
        self.params = list(func.params)
        self.outputs = [graph.tensor_of_expr(v) for v in _leaves(func.body.body)]
        self.tensors: dict = {}
        self.streams: list = []
        self._events: list = []
        self._graph = self._graph_exec = self._capturing = None

    # -- cudart with the error naming the call
    def _cuda(self, name: str, *args):
        return cuda_call(self.cudart, name, *args)

    def _event(self):
        event = self._cuda("cudaEventCreateWithFlags", self.cudart.cudaEventDisableTiming)
        self._events.append(event)
        return event

    def _allocate(self, inputs: Sequence[np.ndarray]) -> dict:
        import tvm

        if len(inputs) != len(self.params):
            raise ValueError(f"nimble: main takes {len(self.params)} inputs, got {len(inputs)}")
        tensors = {}
        for var, value in zip(self.params, inputs):
            tensors[self.graph.tensor_of_expr(var)] = tvm.runtime.tensor(np.asarray(value), self.dev)
        for node in self.kernels:
            for t in node.inputs:
                if t.is_constant and t not in tensors:  # TVM 0.27: a Constant's data is .value
                    tensors[t] = tvm.runtime.tensor(t.expr.value.numpy(), self.dev)
            for t in node.outputs:
                tensors[t] = tvm.runtime.empty([int(d) for d in t.shape], t.dtype, self.dev)
        return tensors

    def _issue(self, tensors: dict, streams: list) -> None:
        """Every kernel on its stream, events on the synchronised edges (Nimble's schedule). TVM
        launches a kernel on its current stream, set here with ``Device.set_raw_stream`` (the
        caller restores the one TVM had)."""
        a = self.assignment
        waits: dict = {}
        for u, v in a.syncs:
            waits.setdefault(v, []).append(u)
        events = {u: self._event() for u in sorted({u for u, _ in a.syncs})}
        for node in self.kernels:
            k = a.stream_of[node.index]
            stream = streams[k]
            for u in waits.get(node.index, ()):
                self._cuda("cudaStreamWaitEvent", stream, events[u], 0)
            self.dev.set_raw_stream(stream_handle(stream))
            name = node.gvar.name_hint
            try:
                self.lib[name](*[tensors[t] for t in node.inputs + node.outputs])
            except Exception as err:
                where = "while capturing the graph" if self._capturing is not None else "uncaptured"
                lines = [ln for ln in str(err).splitlines() if ln.strip()]
                raise RuntimeError(f"nimble: kernel {name} (binding {node.name}, stream {k}) "
                                   f"failed {where}: {type(err).__name__}: "
                                   f"{lines[-1] if lines else ''}") from err
            if node.index in events:
                self._cuda("cudaEventRecord", events[node.index], stream)

    def _capture(self) -> None:
        """The schedule captured into one CUDA graph: capture begins on the first stream, the others
        join it through a fork event and rejoin it through one event each before it ends."""
        cudart = self.cudart
        origin = self.streams[0]
        self._cuda("cudaStreamBeginCapture", origin,
                   cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
        self._capturing = origin
        fork = self._event()
        self._cuda("cudaEventRecord", fork, origin)
        for s in self.streams[1:]:
            self._cuda("cudaStreamWaitEvent", s, fork, 0)
        self._issue(self.tensors, self.streams)
        for s in self.streams[1:]:
            join = self._event()
            self._cuda("cudaEventRecord", join, s)
            self._cuda("cudaStreamWaitEvent", origin, join, 0)
        self._capturing = None  # cudaStreamEndCapture ends the capture, also when it fails
        self._graph = self._cuda("cudaStreamEndCapture", origin)
        self._graph_exec = self._cuda("cudaGraphInstantiate", self._graph, 0)

    def _abort_capture(self) -> None:
        """End a capture left open by a failure (best effort: the failure is what gets reported)."""
        origin, self._capturing = self._capturing, None
        if origin is None:
            return
        try:
            graph = self._cuda("cudaStreamEndCapture", origin)
            if graph is not None and int(graph):
                self._cuda("cudaGraphDestroy", graph)
        except Exception:  # noqa: BLE001 (an invalidated capture ends with an error of its own)
            pass

    def _poison(self) -> None:
        """Every floating-point kernel output set to NaN, so what :meth:`replay` returns was
        computed by the graph, not left over from the uncaptured run."""
        for node in self.kernels:
            for t in node.outputs:
                if np.dtype(t.dtype).kind == "f":
                    shape = [int(d) for d in t.shape]
                    self.tensors[t].copyfrom(np.full(shape, np.nan, dtype=t.dtype))

    def prepare(self, inputs: Sequence[np.ndarray]) -> None:
        """Allocate, run the schedule once uncaptured (loads the kernels), capture it into one
        CUDA graph on the streams of the assignment (non-blocking streams: TVM's copies on the
        legacy stream neither wait for them nor break their capture), then set the kernels'
        floating-point outputs to NaN. On failure: the capture is ended, TVM's stream restored."""
        self.close()
        cudart = self.cudart
        self.tensors = self._allocate(inputs)
        self.streams = [self._cuda("cudaStreamCreateWithFlags", cudart.cudaStreamNonBlocking)
                        for _ in self.assignment.streams]
        previous = _current_stream(self.dev)
        try:
            self._issue(self.tensors, self.streams)
            for s in self.streams:
                self._cuda("cudaStreamSynchronize", s)
            self._capture()
        except BaseException:
            self._abort_capture()
            raise
        finally:
            self.dev.set_raw_stream(previous)
        self._poison()

    def _check_prepared(self) -> None:
        if self._graph_exec is None:
            raise ValueError("nimble: call prepare(inputs) before replay() or time()")

    def replay(self) -> list:
        """One replay of the captured graph; the outputs as NumPy arrays."""
        self._check_prepared()
        self._cuda("cudaGraphLaunch", self._graph_exec, self.streams[0])
        self._cuda("cudaStreamSynchronize", self.streams[0])
        return [self.tensors[t].numpy() for t in self.outputs]

    def time(self, runs: int) -> list:
        """Latency samples (us) of ``max(10, runs)`` replays after 10 warm-up ones, timed with CUDA
        events on the first stream (where the graph is launched and ends)."""
        self._check_prepared()
        origin = self.streams[0]
        for _ in range(10):
            self._cuda("cudaGraphLaunch", self._graph_exec, origin)
        start = self._cuda("cudaEventCreate")
        self._events.append(start)
        end = self._cuda("cudaEventCreate")
        self._events.append(end)
        samples = []
        for _ in range(max(10, runs)):
            self._cuda("cudaEventRecord", start, origin)
            self._cuda("cudaGraphLaunch", self._graph_exec, origin)
            self._cuda("cudaEventRecord", end, origin)
            self._cuda("cudaEventSynchronize", end)
            samples.append(self._cuda("cudaEventElapsedTime", start, end) * 1e3)
        return samples

    def close(self) -> None:
        """Free the graphs, events and streams (every one is tried; the first failure is raised
        after). Called by :meth:`prepare` before it starts again and by a ``with`` block's end."""
        self._abort_capture()
        frees = []
        if self._graph_exec is not None:
            frees.append(("cudaGraphExecDestroy", self._graph_exec))
        if self._graph is not None:
            frees.append(("cudaGraphDestroy", self._graph))
        frees += [("cudaEventDestroy", e) for e in self._events]
        frees += [("cudaStreamDestroy", s) for s in self.streams]
        self._graph = self._graph_exec = None
        self._events, self.streams = [], []
        failure = None
        for call, handle in frees:
            try:
                self._cuda(call, handle)
            except Exception as err:  # noqa: BLE001 (free the rest, then report the first)
                failure = failure or err
        if failure is not None:
            raise failure

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 (the error that ended the block is the one to see)
                pass


def _leaves(expr) -> list:
    from tvm import relax

    if isinstance(expr, relax.Tuple):
        return [leaf for f in expr.fields for leaf in _leaves(f)]
    return [expr]


def _short(err: BaseException) -> str:
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


def bench_nimble(mod, target, timing: bool, inputs=None, runs: int = 200, check=None,
                 tolerance: float | None = None, name: str = "the model", cudart=None) -> dict:
    """The ``nimble`` column of ``tvm-bench`` for one imported model (``name``): compile (TVM's
    default kernels and the stream assignment: launches, streams, synchronisations), and on a GPU
    with cuda-python build the executor, check the outputs with ``check`` (max relative error;
    ``tolerance`` default float32's) and time the replays.

    A failure after the compile does not stop the benchmark: the result says ``status: failed``,
    the ``stage`` (build, prepare, replay, time) and the ``reason`` (the CUDA call and error), and
    one RuntimeWarning names the model. ``cudart``: a stand-in for cuda-python (tests)."""
    import time
    import warnings

    from relay_passes.dataflow_graph import DataflowGraph

    from .systems import _stats, tolerance_for

    tolerance = tolerance_for("float32") if tolerance is None else tolerance
    start = time.perf_counter()
    kernels_mod = default_kernels(mod, target)
    graph = DataflowGraph.from_function(kernels_mod["main"], kernels_mod)
    kernels = [n for n in graph.nodes if n.kind == "call_tir"]
    assignment = stream_assignment([n.index for n in kernels], {n.index: n.preds for n in kernels})
    result = {"status": "compiled", "compile_s": time.perf_counter() - start,
              "compile_stage": "TVM default kernels + Nimble stream assignment",
              "launches": len(kernels), "launch_note": "kernels captured into one CUDA graph",
              "streams": len(assignment.streams), "syncs": len(assignment.syncs)}
    if not timing:
        return result
    why = nimble_available() if cudart is None else ""
    if why:
        result.update(status="skipped", reason=why)
        return result
    stage, executor = "build", None
    try:
        start = time.perf_counter()
        executor = NimbleExecutor(kernels_mod, target, cudart=cudart)
        stage = "prepare"
        executor.prepare(inputs)
        result.update(build_s=time.perf_counter() - start)
        stage = "replay"
        outs = executor.replay()
        err = check(outs) if check is not None else 0.0
        result["max_rel_err"] = err
        if not err <= tolerance:
            result.update(status="mismatch", reason=f"max relative error {err:.3g} vs onnxruntime "
                                                     f"exceeds {tolerance:g}; not timed")
            return result
        stage = "time"
        stats = _stats(executor.time(runs))
        result.update(status="ok", latency_us=stats["median"], latency_stats=stats)
    except Exception as err:  # noqa: BLE001 (one column failed; the benchmark goes on)
        reason = _short(err)
        warnings.warn(f"nimble: {name}: {stage} failed ({reason}); its nimble column is marked "
                      "failed", RuntimeWarning, stacklevel=2)
        result.update(status="failed", stage=stage, reason=reason)
    finally:
        if executor is not None:
            try:
                executor.close()
            except Exception as err:  # noqa: BLE001 (the timings stand; the leak is reported)
                result["close_error"] = _short(err)
    return result
