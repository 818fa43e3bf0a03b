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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

__all__ = ["StreamAssignment", "minimum_equivalent_graph", "maximum_matching", "stream_assignment",
           "default_kernels", "NimbleExecutor", "nimble_available", "bench_nimble", "NIMBLE"]

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

def default_kernels(mod, target):
    """``mod`` after TVM's default CUDA legalisation, fusion and dlight (the kernels TVM's default
    pipeline would launch), before the VM lowering: ``main`` is one dataflow block of call_tirs."""
    import tvm
    from tvm.relax.backend.cuda import pipeline as cuda_backend

    from ..target import plain_target

    plain = plain_target(target)
    with plain:
        seq = tvm.transform.Sequential(cuda_backend.library_dispatch_passes(plain)
                                       + cuda_backend.legalize_passes(plain))
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
    from ..gpu import gpu_available

    if not gpu_available():
        return "timing needs a GPU: none visible"
    if _cudart() is None:
        return ("nimble needs cuda-python for CUDA events and graph capture, which TVM's runtime "
                "does not expose (pip install cuda-python)")
    return ""


def _ok(cudart, result):
    """The values of a cuda-python call, or RuntimeError naming the CUDA error."""
    if not isinstance(result, tuple):
        result = (result,)
    err, rest = result[0], result[1:]
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


def stream_handle(stream) -> int:
    """The address of a CUDA stream (cuda-python's ``cudaStream_t``/``CUstream``, or an int) as
    the plain int TVM's ``Device.set_raw_stream`` takes (TVM 0.27 rejects ``ctypes.c_void_p``)."""
    return int(stream)


class NimbleExecutor:
    """Nimble's ahead-of-time multi-stream schedule of a module's default kernels (module docstring).

    ``mod``: the output of :func:`default_kernels`. Raises ValueError when ``main`` holds a binding
    that is not a kernel call (a library call, control flow): the executor launches call_tirs only.
    """

    def __init__(self, mod, target, dev=None):
        import tvm

        from relay_passes.dataflow_graph import DataflowGraph

        from ..target import plain_target, resolve_target

        self.cudart = _cudart()
        if self.cudart is None:
            raise ValueError(nimble_available())
        target = plain_target(resolve_target(target))
        self.dev = dev or tvm.cuda(0)
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
        self._graph_exec = None

    def _allocate(self, inputs: Sequence[np.ndarray]) -> dict:
        import tvm

        if len(inputs) != len(self.params):
            raise ValueError(f"nimble: main takes {len(self.params)} inputs, got {len(inputs)}")
        tensors = {}
        for var, value in zip(self.params, inputs):
            tensors[self.graph.tensor_of_expr(var)] = tvm.runtime.tensor(np.asarray(value), self.dev)
        for node in self.kernels:
            for t in node.inputs:
                if t.is_constant and t not in tensors:
                    tensors[t] = tvm.runtime.tensor(t.expr.value.numpy(), self.dev)
            for t in node.outputs:
                tensors[t] = tvm.runtime.empty([int(d) for d in t.shape], t.dtype, self.dev)
        return tensors

    def _issue(self, tensors: dict, streams: list) -> None:
        """Every kernel on its stream, events on the synchronised edges (Nimble's schedule)."""
        cudart, a = self.cudart, self.assignment
        waits: dict = {}
        for u, v in a.syncs:
            waits.setdefault(v, []).append(u)
        needed = {u for u, _ in a.syncs}
        events = {u: _ok(cudart, cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
                  for u in needed}
        self._events = list(events.values())
        for node in self.kernels:
            stream = streams[a.stream_of[node.index]]
            for u in waits.get(node.index, ()):
                _ok(cudart, cudart.cudaStreamWaitEvent(stream, events[u], 0))
            self.dev.set_raw_stream(stream_handle(stream))
            self.lib[node.gvar.name_hint](*[tensors[t] for t in node.inputs + node.outputs])
            if node.index in events:
                _ok(cudart, cudart.cudaEventRecord(events[node.index], stream))

    def prepare(self, inputs: Sequence[np.ndarray]) -> None:
        """Allocate, run the schedule once uncaptured (loads the kernels), then capture it into one
        CUDA graph on the streams of the assignment."""
        cudart = self.cudart
        self.tensors = self._allocate(inputs)
        flags = cudart.cudaStreamNonBlocking
        self.streams = [_ok(cudart, cudart.cudaStreamCreateWithFlags(flags))
                        for _ in self.assignment.streams]
        self._issue(self.tensors, self.streams)
        for s in self.streams:
            _ok(cudart, cudart.cudaStreamSynchronize(s))
        origin = self.streams[0]
        _ok(cudart, cudart.cudaStreamBeginCapture(
            origin, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed))
        fork = _ok(cudart, cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
        _ok(cudart, cudart.cudaEventRecord(fork, origin))
        for s in self.streams[1:]:
            _ok(cudart, cudart.cudaStreamWaitEvent(s, fork, 0))
        self._issue(self.tensors, self.streams)
        for s in self.streams[1:]:
            join = _ok(cudart, cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
            _ok(cudart, cudart.cudaEventRecord(join, s))
            _ok(cudart, cudart.cudaStreamWaitEvent(origin, join, 0))
        graph = _ok(cudart, cudart.cudaStreamEndCapture(origin))
        self._graph_exec = _ok(cudart, cudart.cudaGraphInstantiate(graph, 0))
        self.dev.set_raw_stream(0)  # back to the default stream

    def replay(self) -> list:
        """One replay of the captured graph; the outputs as NumPy arrays."""
        cudart = self.cudart
        _ok(cudart, cudart.cudaGraphLaunch(self._graph_exec, self.streams[0]))
        _ok(cudart, cudart.cudaStreamSynchronize(self.streams[0]))
        return [self.tensors[t].numpy() for t in self.outputs]

    def time(self, runs: int) -> list:
        """Latency samples (us) of ``runs`` replays after 10 warm-up ones, timed with CUDA events."""
        cudart = self.cudart
        origin = self.streams[0]
        for _ in range(10):
            _ok(cudart, cudart.cudaGraphLaunch(self._graph_exec, origin))
        start = _ok(cudart, cudart.cudaEventCreate())
        end = _ok(cudart, cudart.cudaEventCreate())
        samples = []
        for _ in range(max(10, runs)):
            _ok(cudart, cudart.cudaEventRecord(start, origin))
            _ok(cudart, cudart.cudaGraphLaunch(self._graph_exec, origin))
            _ok(cudart, cudart.cudaEventRecord(end, origin))
            _ok(cudart, cudart.cudaEventSynchronize(end))
            samples.append(_ok(cudart, cudart.cudaEventElapsedTime(start, end)) * 1e3)
        return samples


def _leaves(expr) -> list:
    from tvm import relax

    if isinstance(expr, relax.Tuple):
        return [leaf for f in expr.fields for leaf in _leaves(f)]
    return [expr]


def bench_nimble(mod, target, timing: bool, inputs=None, runs: int = 200, check=None) -> dict:
    """The ``nimble`` column of ``tvm-rammer bench`` for one imported model: compile (TVM's default
    kernels and the stream assignment: launches, streams, synchronisations), and on a GPU with
    cuda-python check the outputs with ``check`` and time the replays."""
    import time

    from relay_passes.dataflow_graph import DataflowGraph

    from ..target import resolve_target
    from .systems import _stats

    target = resolve_target(target)
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
    why = nimble_available()
    if why:
        result.update(status="skipped", reason=why)
        return result
    start = time.perf_counter()
    executor = NimbleExecutor(kernels_mod, target)
    executor.prepare(inputs)
    result.update(build_s=time.perf_counter() - start)
    outs = executor.replay()
    err = check(outs) if check is not None else 0.0
    result["max_rel_err"] = err
    from .harness import TOLERANCE

    if not err <= TOLERANCE:
        result.update(status="mismatch", reason=f"max relative error {err:.3g} vs onnxruntime "
                                                 f"exceeds {TOLERANCE:g}; not timed")
        return result
    stats = _stats(executor.time(runs))
    result.update(status="ok", latency_us=stats["median"], latency_stats=stats)
    return result
