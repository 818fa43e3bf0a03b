"""Small ONNX graphs for the tests: branchy models whose wave structure is known by construction.

Every builder returns an `onnx.ModelProto` (opset 17, IR version 9, so onnxruntime accepts it) with
float32 weights as initializers drawn from a seeded RNG. `random_inputs(model, seed)` makes matching
NumPy inputs (dynamic dimensions get size 1).

Also the shared steps of the relay_passes tests: `to_relax` (import + LegalizeOps +
AnnotateTIROpPattern + FoldConstant), `gpu_schedule` (dlight for sm_90a, no GPU needed),
`run_tvm_cpu` / `run_onnxruntime` (numerical references), and `mixed_relax_module` (a BlockBuilder
main with bindings that cannot become rTasks).
"""
import numpy as np
import onnx
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, te, tirx, topi
from tvm.relax.frontend.onnx import from_onnx
from tvm.s_tir import dlight as dl

OPSET = 17
IR_VERSION = 9
ACTIVATIONS = ("Relu", "Sigmoid", "Tanh")


class _Graph:
    """Accumulates nodes and initializers and hands out fresh tensor names."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self._count = 0

    def name(self, prefix):
        """A fresh tensor name."""
        self._count += 1
        return f"{prefix}{self._count}"

    def weight(self, *shape):
        """A new random float32 initializer, scaled to keep activations O(1); returns its name."""
        fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
        data = (self.rng.standard_normal(shape) / np.sqrt(fan_in)).astype("float32")
        name = self.name("w")
        self.inits.append(numpy_helper.from_array(data, name))
        return name

    def int64s(self, values):
        """A new int64 initializer (shapes for Reshape); returns its name."""
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.array(values, dtype="int64"), name))
        return name

    def op(self, op_type, inputs, **attrs):
        """Append one node with a single output; returns the output name."""
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def model(self, inputs, outputs, name):
        """Wrap the graph into a checked ModelProto. inputs/outputs: [(name, shape)]."""
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
            initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        return model


def _gemv_branch(g, x, hidden, act):
    """x @ W (+ activation): one GEMV branch."""
    y = g.op("MatMul", [x, g.weight(hidden, hidden)])
    return g.op(act, [y]) if act else y


def two_branch(hidden=256, seed=0):
    """Add(relu(x @ W0), relu(x @ W1)): two independent GEMV+ReLU branches joined by one Add."""
    return parallel_branches(2, join="add_chain", hidden=hidden, seed=seed)


def parallel_branches(n, join="add_chain", hidden=256, act="Relu", seed=0):
    """n parallel GEMV(+act) branches on the same input x[1, hidden], joined by
    'add_chain' (((b0+b1)+b2)+...), 'sum' (one ONNX Sum) or 'concat' (Concat on axis 1)."""
    g = _Graph(seed)
    branches = [_gemv_branch(g, "x", hidden, act) for _ in range(n)]
    if join == "add_chain":
        out = branches[0]
        for b in branches[1:]:
            out = g.op("Add", [out, b])
        out_shape = [1, hidden]
    elif join == "sum":
        out, out_shape = g.op("Sum", branches), [1, hidden]
    elif join == "concat":
        out, out_shape = g.op("Concat", branches, axis=1), [1, hidden * n]
    else:
        raise ValueError(f"join={join!r} is not one of 'add_chain', 'sum', 'concat'")
    return g.model([("x", [1, hidden])], [(out, out_shape)], f"parallel_{n}_{join}")


def diamond(hidden=128, seed=0):
    """a = x @ W0; Mul(sigmoid(a @ W1), tanh(a @ W2)): one fork, two branches, one join."""
    g = _Graph(seed)
    a = g.op("MatMul", ["x", g.weight(hidden, hidden)])
    left = _gemv_branch(g, a, hidden, "Sigmoid")
    right = _gemv_branch(g, a, hidden, "Tanh")
    out = g.op("Mul", [left, right])
    return g.model([("x", [1, hidden])], [(out, [1, hidden])], "diamond")


def dynamic_batch(hidden=64, seed=0):
    """relu(x @ W) with x[N, hidden]: N is a symbolic dimension."""
    g = _Graph(seed)
    out = _gemv_branch(g, "x", hidden, "Relu")
    return g.model([("x", ["N", hidden])], [(out, ["N", hidden])], "dynamic_batch")


def _conv_pool(g, x, hidden):
    """[1, hidden] -> reshape to [1, 4, s, s] -> Conv3x3 -> MaxPool3x3 (stride 1) -> [1, hidden]."""
    side = int(round(np.sqrt(hidden // 4)))
    assert 4 * side * side == hidden, "conv variant needs hidden = 4 * s * s"
    img = g.op("Reshape", [x, g.int64s([1, 4, side, side])])
    conv = g.op("Conv", [img, g.weight(4, 4, 3, 3)], pads=[1, 1, 1, 1])
    pool = g.op("MaxPool", [conv], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return g.op("Reshape", [pool, g.int64s([1, hidden])])


def _random_step(g, pool, hidden):
    """Append one randomly chosen operator reading random earlier tensors; returns its output."""
    pick = lambda: pool[int(g.rng.integers(len(pool)))]  # noqa: E731
    kind = str(g.rng.choice(["MatMul", "Add", "Mul", "Act", "Concat", "Softmax", "ConvPool"]))
    if kind == "MatMul":
        return g.op("MatMul", [pick(), g.weight(hidden, hidden)])
    if kind in ("Add", "Mul"):
        return g.op(kind, [pick(), pick()])
    if kind == "Act":
        return g.op(str(g.rng.choice(ACTIVATIONS)), [pick()])
    if kind == "Concat":
        cat = g.op("Concat", [pick(), pick()], axis=1)
        return g.op("MatMul", [cat, g.weight(2 * hidden, hidden)])
    if kind == "Softmax":
        return g.op("Softmax", [pick()], axis=-1)
    return _conv_pool(g, pick(), hidden)


def random_dag(seed, num_ops=12, hidden=64):
    """A random DAG of `num_ops` steps over [1, hidden] tensors (MatMul, Add, Mul, Relu/Sigmoid/Tanh,
    Concat+MatMul, Softmax, Reshape+Conv+MaxPool+Reshape). Every tensor nobody reads is an output."""
    g = _Graph(seed)
    pool = ["x"]
    for _ in range(num_ops):
        pool.append(_random_step(g, pool, hidden))
    read = {name for node in g.nodes for name in node.input}
    outputs = [(t, [1, hidden]) for t in pool[1:] if t not in read]
    return g.model([("x", [1, hidden])], outputs, f"random_dag_{seed}")


def random_inputs(model, seed=0):
    """{input name: float32 array} for `model`; symbolic dimensions get size 1."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in inp.type.tensor_type.shape.dim]
        feeds[inp.name] = rng.standard_normal(dims).astype("float32")
    return feeds


def run_onnxruntime(model, feeds):
    """Reference outputs of `model` from onnxruntime on the CPU, in graph output order."""
    model.ir_version = min(model.ir_version, 10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def to_relax(model):
    """Import `model` with weights as constants, then LegalizeOps, AnnotateTIROpPattern and
    FoldConstant: the IR that BranchPreservingFusion expects."""
    mod = from_onnx(model, keep_params_in_input=False)
    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
           relax.transform.FoldConstant()]
    return tvm.transform.Sequential(seq)(mod)


def gpu_schedule(mod):
    """dlight default GPU schedules for sm_90a (no GPU needed: schedules only)."""
    rules = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                    dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        return rules(mod)


def run_tvm_cpu(mod, feeds):
    """Build `mod` (not GPU-scheduled) for llvm with the default pipeline and run `main` on
    `feeds` (in parameter order); returns a list of NumPy outputs."""
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]


def mixed_relax_module():
    """A main with a tir_vars call_tir, a tuple-output split read through TupleGetItem, a
    call_dps_packed, an unscheduled call_tir and a Tuple output; built with BlockBuilder."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    y = relax.Var("y", relax.TensorType([1, 8], "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit_te(lambda t: te.compute((n * 2, 4), lambda i, j: t[i // 2, j]), x)
            s = bb.emit_te(topi.split, y, 2, 1)
            s0 = bb.emit(relax.TupleGetItem(s, 0))
            s1 = bb.emit(relax.TupleGetItem(s, 1))
            z = bb.emit_te(topi.add, s0, s1)
            p = bb.emit(relax.call_dps_packed("my_ext", relax.Tuple([z]),
                                              relax.TensorType([1, 4], "float32")))
            w = bb.emit_te(topi.exp, p)
            out = bb.emit_output(relax.Tuple([a, p, w]))
        bb.emit_func_output(out)
    return bb.get()


def single_node(op, x_shape, y_shape, inits=(), opset=OPSET, **attrs):
    """One ONNX node ``op`` reading input ``X`` (float32, ``x_shape``) and the initializers
    ``inits`` (``{name: array}``, in the node's input order), writing ``Y`` (float32, ``y_shape``)."""
    node = helper.make_node(op, ["X", *inits], ["Y"], **attrs)
    graph = helper.make_graph(
        [node], op.lower(), [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()] if inits else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = IR_VERSION
    return model


def _axes(*axes):
    return {"axes": np.array(axes, np.int64)}


# Reductions over a few elements (fewer than 32 threads per rTask: warp shuffles under early exit)
# and powers of possibly negative bases (CUDA's fast math computes powf(x, y) as 2^(y log2 x)):
# the GPU tests' and the emulator tests' small models, each of them a single node.
SMALL_REDUCTIONS = {
    "mvn": lambda: single_node("MeanVarianceNormalization", [3, 3, 3, 1], [3, 3, 3, 1]),
    "mvn_axes23": lambda: single_node("MeanVarianceNormalization", [2, 3, 5, 1], [2, 3, 5, 1],
                                      axes=[2, 3]),
    "pow_const3": lambda: single_node("Pow", [3, 4], [3, 4], {"E": np.float32(3.0)}),
    "pow_tensor": lambda: single_node(  # integer exponents, odd, even, zero and negative
        "Pow", [3, 4], [3, 4], {"E": np.array([[0, 1, 2, 3]] * 2 + [[4, -1, 5, 2]], np.float32)}),
    "reduce_mean": lambda: single_node("ReduceMean", [3, 5, 3], [3, 1, 3], _axes(1), opset=18),
    "reduce_max": lambda: single_node("ReduceMax", [3, 9, 2], [3, 1, 2], _axes(1), opset=18),
    "reduce_l2": lambda: single_node("ReduceL2", [3, 7], [3, 1], _axes(1), opset=18),
    "reduce_sum_square": lambda: single_node("ReduceSumSquare", [3, 7], [3, 1], _axes(1), opset=18),
    "softmax": lambda: single_node("Softmax", [4, 5], [4, 5], axis=1),
    "layer_norm": lambda: single_node("LayerNormalization", [4, 6], [4, 6],
                                      {"scale": np.linspace(0.5, 1.5, 6, dtype=np.float32)}),
    "instance_norm": lambda: single_node("InstanceNormalization", [2, 3, 5], [2, 3, 5],
                                         {"s": np.ones(3, np.float32), "b": np.zeros(3, np.float32)}),
}
