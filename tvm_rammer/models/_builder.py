"""`GraphBuilder`: a small helper that builds ONNX graphs with random weights.

Every model in the zoo is built with it, so each model file only states its structure. Weights come
from one `np.random.default_rng(seed)` per builder and are He-scaled (ReLU layers) or Xavier-scaled
(recurrent and linear layers), so activations stay O(1) and numeric comparisons between back ends
are meaningful. Convolutions stand for Conv + BatchNorm with the BatchNorm already folded: one Conv
with a bias.

Names are unique per builder (`<prefix>_<counter>`). Tensor names are plain strings; the builder
does not track shapes: callers pass channel counts, and `build()` fills in the output shapes by
ONNX shape inference.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8


class GraphBuilder:
    """Accumulates inputs, initializers and nodes; `build()` returns an `onnx.ModelProto`."""

    def __init__(self, name, seed=0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.inputs = []
        self.initializers = []
        self.nodes = []
        self._count = 0

    def _unique(self, prefix):
        self._count += 1
        return f"{prefix}_{self._count}"

    def input(self, name, shape):
        """Declare a float32 graph input of a static `shape`; returns its name."""
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def const(self, array, prefix="c"):
        """Add `array` as an initializer (float64 becomes float32); returns its name."""
        array = np.asarray(array)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        name = self._unique(prefix)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, shape, fan_in, gain=2.0, prefix="w"):
        """Random normal weight with variance `gain / fan_in` (He for gain 2, Xavier-like for 1)."""
        std = np.sqrt(gain / fan_in)
        return self.const(self.rng.normal(0.0, std, size=shape).astype(np.float32), prefix)

    def bias(self, n, prefix="b"):
        """Small random bias (the folded BatchNorm shift)."""
        return self.const(self.rng.normal(0.0, 0.01, size=(n,)).astype(np.float32), prefix)

    def node(self, op_type, inputs, n_outputs=1, **attrs):
        """Append one node; returns its output name, or a list of names when `n_outputs > 1`."""
        name = self._unique(op_type.lower())
        outputs = [name] if n_outputs == 1 else [f"{name}_o{i}" for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, **attrs))
        return outputs[0] if n_outputs == 1 else outputs

    def relu(self, x):
        return self.node("Relu", [x])

    def sigmoid(self, x):
        return self.node("Sigmoid", [x])

    def tanh(self, x):
        return self.node("Tanh", [x])

    def add(self, a, b):
        return self.node("Add", [a, b])

    def mul(self, a, b):
        return self.node("Mul", [a, b])

    def sum(self, xs):
        """Elementwise sum (ONNX `Sum`); a single tensor is returned as is."""
        return xs[0] if len(xs) == 1 else self.node("Sum", xs)

    def concat(self, xs, axis=1):
        return xs[0] if len(xs) == 1 else self.node("Concat", xs, axis=axis)

    def conv(self, x, c_in, c_out, k, stride=1, pad=None, group=1, relu=False, gain=2.0):
        """Conv with a bias (BatchNorm folded), optional ReLU after. `k`, `stride`, `pad` may be
        ints or (h, w) pairs; `pad=None` means "same" padding for odd kernels."""
        kh, kw = (k, k) if isinstance(k, int) else k
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        if pad is None:
            pad = (kh // 2, kw // 2)
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        fan_in = (c_in // group) * kh * kw
        w = self.weight((c_out, c_in // group, kh, kw), fan_in, gain)
        y = self.node("Conv", [x, w, self.bias(c_out)], kernel_shape=[kh, kw],
                      strides=[sh, sw], pads=[ph, pw, ph, pw], group=group)
        return self.relu(y) if relu else y

    def sep_conv(self, x, c_in, c_out, k, stride=1, gain=1.0):
        """Separable convolution: depthwise KxK Conv (group = channels, weight gain `gain`) then
        pointwise 1x1 Conv (He gain)."""
        y = self.conv(x, c_in, c_in, k, stride=stride, group=c_in, gain=gain)
        return self.conv(y, c_in, c_out, 1)

    def maxpool(self, x, k, stride, pad=0, ceil_mode=0):
        return self.node("MaxPool", [x], kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4, ceil_mode=ceil_mode)

    def avgpool(self, x, k, stride, pad=0, count_include_pad=0):
        """Average pool; by default the padding is not counted (TensorFlow "SAME" semantics)."""
        return self.node("AveragePool", [x], kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4, count_include_pad=count_include_pad)

    def global_avgpool(self, x):
        return self.node("GlobalAveragePool", [x])

    def flatten(self, x):
        return self.node("Flatten", [x], axis=1)

    def reshape(self, x, shape):
        return self.node("Reshape", [x, self.const(np.array(shape, dtype=np.int64), "shape")])

    def gemm(self, x, n_in, n_out, gain=1.0):
        """Fully connected layer `x @ W + b` on a [rows, n_in] tensor."""
        w = self.weight((n_in, n_out), n_in, gain)
        return self.node("Gemm", [x, w, self.bias(n_out)])

    def matmul(self, x, n_in, n_out, gain=1.0):
        """`x @ W` with a fresh [n_in, n_out] weight (no bias)."""
        return self.node("MatMul", [x, self.weight((n_in, n_out), n_in, gain)])

    def lstm_weights(self, n_in, hidden):
        """Weights of one LSTM layer: W [n_in + hidden, 4 * hidden] and b [4 * hidden]; shared by
        every time step of the layer. Gate order in W's columns: input, forget, cell, output.
        The forget gate's bias is 1 (TensorFlow's `forget_bias`) and W has gain 2, which keeps
        hidden states O(0.1-1) through ten stacked layers instead of vanishing."""
        w = self.weight((n_in + hidden, 4 * hidden), n_in + hidden, gain=2.0, prefix="lstm_w")
        b = np.zeros(4 * hidden, dtype=np.float32)
        b[hidden:2 * hidden] = 1.0
        return w, self.const(b, "lstm_b")

    def lstm_cell(self, x, h, c, weights):
        """One unrolled LSTM step as TensorFlow graphs build it: gates = [x, h] @ W + b (one
        MatMul), split into four, sigmoid/tanh, c' = f*c + i*g, h' = o*tanh(c'). `x` is one
        [batch, n] tensor or a list of them (concatenated with h). Returns (h', c')."""
        w, b = weights
        xs = [x] if isinstance(x, str) else list(x)
        gates = self.add(self.node("MatMul", [self.concat(xs + [h]), w]), b)
        i, f, g, o = self.node("Split", [gates], n_outputs=4, axis=1)
        c_new = self.add(self.mul(self.sigmoid(f), c), self.mul(self.sigmoid(i), self.tanh(g)))
        h_new = self.mul(self.sigmoid(o), self.tanh(c_new))
        return h_new, c_new

    def zeros(self, shape):
        """A constant zero tensor (initial LSTM states)."""
        return self.const(np.zeros(shape, dtype=np.float32), "zeros")

    def build(self, outputs):
        """Return the model with `outputs` (names) as graph outputs, shapes filled by inference."""
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, outs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="tvm_rammer.models")
        model.ir_version = IR_VERSION
        shapes = {v.name: v for v in self._infer(model).graph.output}
        del model.graph.output[:]
        model.graph.output.extend(shapes[o] for o in outputs)
        return model

    def _infer(self, model):
        """Shape inference on a copy whose float initializers are declared as inputs instead
        (their values are not needed), so large models are not serialised with their weights."""
        light = onnx.ModelProto()
        light.CopyFrom(model)
        floats = [t for t in light.graph.initializer if t.data_type == TensorProto.FLOAT]
        light.graph.input.extend(
            helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in floats)
        kept = [t for t in light.graph.initializer if t.data_type != TensorProto.FLOAT]
        del light.graph.initializer[:]
        light.graph.initializer.extend(kept)
        return onnx.shape_inference.infer_shapes(light)
