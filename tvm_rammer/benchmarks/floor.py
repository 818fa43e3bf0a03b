"""A lower bound on a model's latency from its graph and the device's peaks.

Input: a Relax module as imported from ONNX. ``op_costs`` runs ``LegalizeOps`` and ``FoldConstant``
(constant subgraphs are not run-time work) and reads every ``call_tir`` of ``main``'s dataflow block
through ``relay_passes.dataflow_graph.DataflowGraph``:

* FLOPs of an operator: ``tvm.s_tir.analysis.estimate_tir_flops`` of its PrimFunc;
* bytes of an operator: of each distinct tensor argument and output, the bytes its PrimFunc
  accesses (``scheduling.rkernels.param_bytes``: the region its blocks read or write, so a
  Gather / ``take`` of one token reads one row of its table, not the table; the whole tensor
  where the region cannot be bounded). A PrimFunc with a reshape pattern (``relax.analysis.has_reshape_pattern``) costs nothing: TVM's
  ``RewriteDataflowReshape`` turns it into a view, so charging it would break the bound.

``floor(costs, peaks)`` takes the largest of three bounds, none of which a schedule can beat:

* compute: total FLOPs / peak FLOP/s;
* memory: every weight and every graph input read once (the most of it any one operator
  accesses: an embedding table that only a Gather reads costs the rows gathered), every graph
  output written once, / peak bandwidth;
* critical path: the longest path through the dataflow graph where each operator costs
  ``max(flops / peak, bytes / bandwidth)`` (operators on one path cannot overlap).

Peaks are measured on the GPU when there is one (``measure_peaks``) and otherwise the datasheet
values of the target's GPU (``nominal_peaks``), labelled as nominal.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from relay_passes.dataflow_graph import DataflowGraph

# Datasheet values, FP32 without tensor cores (the models run in float32): NVIDIA H100 SXM5 80 GB
# (67 TFLOP/s FP32, 3.35 TB/s HBM3) and H200 SXM 141 GB (67 TFLOP/s FP32, 4.8 TB/s HBM3e).
NOMINAL = {
    "h100": dict(flops_per_s=67e12, bytes_per_s=3.35e12,
                 source="nominal: NVIDIA H100 SXM5 datasheet, FP32 non-tensor 67 TFLOP/s, "
                        "HBM3 3.35 TB/s"),
    "h200": dict(flops_per_s=67e12, bytes_per_s=4.8e12,
                 source="nominal: NVIDIA H200 SXM datasheet, FP32 non-tensor 67 TFLOP/s, "
                        "HBM3e 4.8 TB/s"),
}


@dataclass(frozen=True)
class Peaks:
    """Device peaks used by the floor; ``source`` says whether measured or nominal (and how)."""

    flops_per_s: float
    bytes_per_s: float
    source: str
    measured: bool = False
    l2_bytes_per_s: float | None = None  # reads of an L2-resident buffer (the cost model's l2_bw)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class OpCost:
    """One operator of the graph: its node index, name, FLOPs, bytes and predecessors."""

    index: int
    name: str
    flops: float
    bytes: float
    preds: tuple


@dataclass(frozen=True)
class GraphCost:
    """Per-operator costs, plus the bytes of reading each weight/input and writing each output."""

    ops: tuple
    io_bytes: float
    opaque: tuple  # names of the bindings that are neither call_tir nor aliases (not costed)

    @property
    def flops(self) -> float:
        return float(sum(op.flops for op in self.ops))


def _tensor_bytes(ty) -> float:
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return 0.0
    dims = [int(v.value) if isinstance(v, tirx.IntImm) else None for v in shape.values]
    if any(d is None for d in dims):
        return 0.0  # symbolic: no static lower bound; 0 keeps the floor a lower bound
    return float(np.prod(dims, dtype=np.float64)) * tvm.DataType(str(ty.dtype)).bits / 8


def _accessed_bytes(func, tensors: list) -> dict:
    """tensor -> bytes ``func`` accesses of it (``tensors``: its call's arguments and outputs,
    lined up with its parameters; the largest access where a tensor is passed twice); the whole
    tensor where ``param_bytes`` cannot tell (the parameters do not line up)."""
    from ..scheduling.rkernels import param_bytes

    per = None
    if len(tensors) == len(func.params):
        try:
            per = param_bytes(func)
        except Exception:  # pylint: disable=broad-except  (an unusual PrimFunc: whole tensors)
            per = None
    out = {}
    for k, t in enumerate(tensors):
        nbytes = _tensor_bytes(t.ty) if per is None else min(float(per[k]), _tensor_bytes(t.ty))
        out[t] = max(out.get(t, 0.0), nbytes)
    return out


def legalized(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` after LegalizeOps and FoldConstant: every operator a call_tir of a PrimFunc."""
    mod = relax.transform.LegalizeOps()(mod)
    return relax.transform.FoldConstant()(mod)


def op_costs(mod: tvm.IRModule, legalize: bool = True) -> GraphCost:
    """FLOPs and bytes of every operator of ``mod["main"]`` (see the module docstring)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    if legalize:
        mod = legalized(mod)
    graph = DataflowGraph.from_function(mod["main"], mod)
    flops_of = {}
    ops, opaque = [], []
    io, read = {}, {}
    for node in graph.nodes:
        for t in node.inputs:
            if t.producer is None:  # a weight (constant) or a graph input, read once
                io[t] = _tensor_bytes(t.ty)
        if node.kind == "alias":
            ops.append(OpCost(node.index, node.name, 0.0, 0.0, tuple(node.preds)))
            continue
        if node.kind != "call_tir":
            opaque.append(node.name)
            ops.append(OpCost(node.index, node.name, 0.0, 0.0, tuple(node.preds)))
            continue
        func = mod[node.gvar]
        if node.gvar.name_hint not in flops_of:
            if relax.analysis.has_reshape_pattern(func):
                flops_of[node.gvar.name_hint] = None
            else:
                flops_of[node.gvar.name_hint] = float(
                    estimate_tir_flops(tvm.IRModule({"main": func})))
        flops = flops_of[node.gvar.name_hint]
        if flops is None:  # a view after RewriteDataflowReshape
            ops.append(OpCost(node.index, node.name, 0.0, 0.0, tuple(node.preds)))
            continue
        accessed = _accessed_bytes(func, list(node.inputs) + list(node.outputs))
        for t in node.inputs:
            if t.producer is None:
                read[t] = max(read.get(t, 0.0), accessed[t])
        ops.append(OpCost(node.index, node.name, flops, float(sum(accessed.values())),
                          tuple(node.preds)))
    for t, nbytes in read.items():  # read only by call_tirs: the most one of them accesses
        if all(n.kind == "call_tir" for n in graph.nodes if t in n.inputs):
            io[t] = min(io[t], nbytes)
    for t in graph.graph_outputs:
        io[t] = _tensor_bytes(t.ty)
    return GraphCost(tuple(ops), float(sum(io.values())), tuple(opaque))


def floor(cost: GraphCost, peaks: Peaks) -> dict:
    """The three bounds and their maximum, in microseconds, with the totals they come from."""
    finish = {}
    for op in cost.ops:  # binding order is a topological order
        own = max(op.flops / peaks.flops_per_s, op.bytes / peaks.bytes_per_s)
        finish[op.index] = own + max((finish[p] for p in op.preds), default=0.0)
    compute = cost.flops / peaks.flops_per_s
    memory = cost.io_bytes / peaks.bytes_per_s
    critical = max(finish.values(), default=0.0)
    return {
        "flops": cost.flops,
        "bytes": cost.io_bytes,
        "ops": sum(1 for op in cost.ops if op.flops or op.bytes),
        "uncosted_ops": list(cost.opaque),
        "compute_us": compute * 1e6,
        "memory_us": memory * 1e6,
        "critical_path_us": critical * 1e6,
        "floor_us": max(compute, memory, critical) * 1e6,
        "bound": max((("compute", compute), ("memory", memory), ("critical_path", critical)),
                     key=lambda kv: kv[1])[0],
    }


def nominal_peaks(target) -> Peaks:
    """Datasheet peaks of the target's GPU (H200 when the target names one, H100 otherwise)."""
    text = str(target).lower()
    key = "h200" if "h200" in text else "h100"
    return Peaks(**NOMINAL[key], measured=False)


def measure_peaks(dev=None, copy_mib: int = 1024, matmul_n: int = 8192, repeat: int = 20) -> Peaks:
    """Measured bandwidth (device-to-device copy) and FP32 matmul throughput on the GPU.

    Bandwidth: a ``copy_mib`` MiB ``tvm.runtime.tensor`` copied with ``copyto`` on the device,
    median of ``repeat`` copies, counted as read + write. FLOP/s: the fastest of an ``matmul_n``^3
    FP32 matmul from torch (TF32 off) when torch imports, and one compiled by TVM's default CUDA
    pipeline (dlight), each timed as a median after warm-up.
    """
    dev = dev or tvm.cuda(0)
    n = copy_mib * (1 << 20) // 4
    src = tvm.runtime.tensor(np.ones(n, "float32"), dev)
    dst = tvm.runtime.empty((n,), "float32", dev)
    for _ in range(3):
        src.copyto(dst)
    dev.sync()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        src.copyto(dst)
        dev.sync()
        samples.append(time.perf_counter() - start)
    bandwidth = 2 * n * 4 / float(np.median(samples))
    del src, dst
    flops, how = 0.0, []
    tvm_rate = _tvm_matmul_rate(dev, matmul_n)
    if tvm_rate:
        flops, how = tvm_rate, [f"TVM dlight matmul {matmul_n}^3 {tvm_rate / 1e12:.1f} TFLOP/s"]
    torch_rate = _torch_matmul_rate(matmul_n)
    if torch_rate:
        how.append(f"torch matmul {torch_rate / 1e12:.1f} TFLOP/s")
        flops = max(flops, torch_rate)
    if not flops:
        raise RuntimeError("could not time any matmul on the GPU")
    l2_rate = l2_read_rate(dev)
    if l2_rate:
        how.append(f"L2 reads of a {L2_MIB} MiB buffer {l2_rate / 1e12:.2f} TB/s")
    return Peaks(flops, bandwidth, measured=True, l2_bytes_per_s=l2_rate or None,
                 source=f"measured: D2D copy of {copy_mib} MiB {bandwidth / 1e12:.2f} TB/s; "
                        + "; ".join(how))


L2_MIB = 16  # fits the H100's L2 (50 MB; 25 MB per partition) with room to spare
L2_PASSES = 32


def l2_read_kernel(mib: int = L2_MIB, passes: int = L2_PASSES, blocks: int = 1056,
                   threads: int = 256) -> tirx.PrimFunc:
    """A kernel that reads a ``mib`` MiB float32 buffer ``passes`` times (coalesced: thread ``t``
    of the grid reads elements ``t, t + T, ...``) and writes one sum per thread: after the first
    pass the buffer comes from L2, so its time is L2 read bandwidth (``l2_read_rate``). The
    cost model's ``CostModelConfig.l2_bw_gbps`` is the figure this measures.

    Pass ``p`` reads a thread's elements starting at its ``p``-th (``(k + p) mod per_thread``):
    the same bytes every pass, but addresses that depend on the pass, so nvcc cannot hoist the
    loads out of the pass loop (with ``k`` alone it read the buffer once and counted 32 passes:
    ~32x the real bandwidth). And block ``b`` reads the slice of block ``(b + p) mod blocks``: a
    block's own slice (15 KiB, 8 blocks an SM) fits in the SM's L1, and TVM's reads of a
    read-only buffer (``ld.global.nc``) are cached there, so re-reading it measured L1, not L2
    (17.7 TB/s on the H200, 2026-11-25); an SM's blocks never share a slice within 32 passes.
    Reads ``per_thread * blocks * threads`` elements per pass (:func:`l2_bytes_per_pass`)."""
    from tvm.script import tirx as T

    n = mib * (1 << 20) // 4
    total = blocks * threads
    per_thread = n // total

    @T.prim_func(s_tir=True)
    def read_l2(x: T.Buffer((n,), "float32"), out: T.Buffer((total,), "float32")):
        T.func_attr({"global_symbol": "read_l2", "tirx.noalias": True})
        acc = T.sblock_alloc_buffer((total,), "float32", scope="local")
        for b in T.thread_binding(blocks, thread="blockIdx.x"):
            for t in T.thread_binding(threads, thread="threadIdx.x"):
                for p, k in T.grid(passes, per_thread):
                    with T.sblock("read"):
                        vb, vt, vp, vk = T.axis.remap("SSRR", [b, t, p, k])
                        with T.init():
                            acc[vb * threads + vt] = T.float32(0)
                        acc[vb * threads + vt] = acc[vb * threads + vt] + x[
                            T.floormod(vk + vp, per_thread) * total
                            + T.floormod(vb + vp, blocks) * threads + vt]
                with T.sblock("write"):
                    vb, vt = T.axis.remap("SS", [b, t])
                    out[vb * threads + vt] = acc[vb * threads + vt]

    return read_l2


def l2_bytes_per_pass(mib: int = L2_MIB, blocks: int = 1056, threads: int = 256) -> int:
    """Bytes one pass of :func:`l2_read_kernel` reads (whole elements per thread: the buffer's
    tail past ``per_thread * blocks * threads`` is not read)."""
    total = blocks * threads
    return (mib * (1 << 20) // 4 // total) * total * 4


def l2_read_rate(dev) -> float:
    """Bytes per second the whole GPU reads from an L2-resident buffer (0.0 when it cannot be
    timed): :func:`l2_read_kernel`, median of a few runs after a warm-up run."""
    try:
        func = l2_read_kernel()
        target = tvm.target.Target.from_device(dev)
        lib = tvm.tirx.build(tvm.IRModule({"read_l2": func}), target)
        x_shape, out_shape = (int(p.ty.shape[0]) for p in func.params)
        x = tvm.runtime.tensor(np.ones(x_shape, "float32"), dev)
        out = tvm.runtime.empty((out_shape,), "float32", dev)
        lib["read_l2"](x, out)
        median = lib.time_evaluator("read_l2", dev, number=5, repeat=5)(x, out).median
        return L2_PASSES * l2_bytes_per_pass() / median
    except Exception:  # a peak we cannot measure is left out
        return 0.0


def _tvm_matmul_rate(dev, n: int) -> float:
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Matmul:  # noqa: D401 - TVMScript module
        @R.function
        def main(a: R.Tensor((n, n), "float32"), b: R.Tensor((n, n), "float32")):
            with R.dataflow():
                c = R.matmul(a, b)
                R.output(c)
            return c

    try:
        target = tvm.target.Target.from_device(dev)
        ex = tvm.compile(Matmul, target=target, relax_pipeline="default")
        vm = relax.VirtualMachine(ex, dev)
        rng = np.random.default_rng(0)
        a = tvm.runtime.tensor(rng.standard_normal((n, n)).astype("float32"), dev)
        b = tvm.runtime.tensor(rng.standard_normal((n, n)).astype("float32"), dev)
        vm["main"](a, b)
        median = vm.time_evaluator("main", dev, number=3, repeat=5)(a, b).median
        return 2.0 * n ** 3 / median
    except Exception:  # a peak we cannot measure is left to the other source
        return 0.0


def _torch_matmul_rate(n: int) -> float:
    try:
        import torch
    except ImportError:
        return 0.0
    if not torch.cuda.is_available():
        return 0.0
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n ** 3 / float(np.median(times))
