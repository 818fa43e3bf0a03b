"""CNNs as frameworks export them: BatchNormalization, Dropout, Flatten + Gemm(transB=1), Pad, Clip,
LRN, Softmax, wide Concat, channel shuffle, initializers listed as graph inputs, opsets 7 to 21.

Two sources of the same four structures (torchvision's ResNet-50 bottlenecks, DenseNet-121 dense
blocks, Inception-v2 (BN-Inception) blocks, ShuffleNet-v2 units), at any width and resolution:

* ``mirror(name, opset, ...)``: built with ``onnx.helper`` in the form ``torch.onnx.export`` writes at
  that opset (attributes that became inputs, ``spatial`` on old BatchNormalization, Dropout with its
  mask output, initializers as inputs when ``initializers_as_inputs``). Needs only onnx and NumPy:
  these run in CI.
* ``torch_model(name, ...)`` + ``export(module, opset)``: the same networks in plain ``torch.nn``
  (torchvision itself does not import beside the CPU torch here), exported by ``torch.onnx`` with
  BatchNormalization kept (``do_constant_folding=False``: no Conv+BN fusion by the exporter). Tests
  that need torch skip without it.

``FULL`` holds the real sizes (ResNet-50, DenseNet-121, ...) for one-off measurements;
``REDUCED_CNN`` the small ones the tests use.
"""
from __future__ import annotations

import io

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSETS = (7, 9, 11, 13, 17, 21)

FULL = {
    "resnet50": dict(width=64, layers=(3, 4, 6, 3), image_size=224, classes=1000),
    "densenet121": dict(growth=32, blocks=(6, 12, 24, 16), init_features=64, image_size=224,
                        classes=1000),
    "inception_v2": dict(width=1.0, blocks=4, image_size=224, classes=1000),
    "shufflenet_v2": dict(channels=(24, 116, 232, 464, 1024), repeats=(4, 8, 4), image_size=224,
                          classes=1000),
}
REDUCED_CNN = {
    "resnet50": dict(width=8, layers=(1, 1, 1, 1), image_size=32, classes=10),
    "densenet121": dict(growth=4, blocks=(2, 3), init_features=8, image_size=32, classes=10),
    "inception_v2": dict(width=0.125, blocks=3, image_size=32, classes=10),
    "shufflenet_v2": dict(channels=(8, 16, 32, 64, 64), repeats=(2, 1, 1), image_size=32,
                          classes=10),
}


def ir_version_for(opset: int) -> int:
    """The IR version ``torch.onnx`` (and onnx.helper) pairs with an opset."""
    return {7: 3, 8: 3, 9: 4, 10: 5, 11: 6, 12: 7, 13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8,
            19: 9, 20: 9, 21: 10}[opset]


# --- onnx.helper mirrors --------------------------------------------------------------------------

class ExportStyleGraph:
    """An ONNX graph written the way an exporter writes it at ``opset``."""

    def __init__(self, name, opset, seed=0):
        self.name, self.opset = name, opset
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self._count = 0

    def _fresh(self, prefix):
        self._count += 1
        return f"{prefix}.{self._count}"

    def const(self, array, prefix="c"):
        name = self._fresh(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op, inputs, n_out=1, **attrs):
        outs = [self._fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=self._fresh(op), **attrs))
        return outs[0] if n_out == 1 else outs

    def conv(self, x, cin, cout, k, stride=1, pad=None, groups=1, bias=False):
        kh, kw = (k, k) if isinstance(k, int) else k
        ph, pw = (kh // 2, kw // 2) if pad is None else ((pad, pad) if isinstance(pad, int) else pad)
        w = self.rng.normal(0, np.sqrt(2.0 / (cin // groups * kh * kw)),
                            (cout, cin // groups, kh, kw)).astype("float32")
        ins = [x, self.const(w, "weight")]
        if bias:
            ins.append(self.const(self.rng.normal(0, 0.05, cout).astype("float32"), "bias"))
        return self.node("Conv", ins, kernel_shape=[kh, kw], strides=[stride, stride],
                         pads=[ph, pw, ph, pw], group=groups, dilations=[1, 1])

    def bn(self, x, c):
        """Inference BatchNormalization with trained-looking statistics."""
        params = [self.rng.uniform(0.5, 1.5, c), self.rng.normal(0, 0.1, c),
                  self.rng.normal(0, 0.1, c), self.rng.uniform(0.5, 2.0, c)]
        ins = [x] + [self.const(p.astype("float32"), n) for p, n in
                     zip(params, ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"))]
        attrs = dict(epsilon=1e-5, momentum=0.9)
        if self.opset < 9:
            attrs["spatial"] = 1
        return self.node("BatchNormalization", ins, **attrs)

    def relu(self, x):
        return self.node("Relu", [x])

    def clip(self, x, lo, hi):
        """ReLU6-style Clip: bounds as attributes before opset 11, as inputs from 11 on."""
        if self.opset < 11:
            return self.node("Clip", [x], min=float(lo), max=float(hi))
        return self.node("Clip", [x, self.const(np.float32(lo)), self.const(np.float32(hi))])

    def cbr(self, x, cin, cout, k, stride=1, pad=None, groups=1, relu=True):
        y = self.bn(self.conv(x, cin, cout, k, stride, pad, groups), cout)
        return self.relu(y) if relu else y

    def maxpool(self, x, k, stride, pad=0):
        return self.node("MaxPool", [x], kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4)

    def avgpool(self, x, k, stride, pad=0):
        return self.node("AveragePool", [x], kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4)

    def pad(self, x, pads):
        """Constant-mode Pad: pads as an attribute before opset 11, as an input from 11 on."""
        if self.opset < 11:
            return self.node("Pad", [x], pads=list(pads), mode="constant", value=0.0)
        return self.node("Pad", [x, self.const(np.array(pads, dtype="int64"))], mode="constant")

    def concat(self, xs):
        return self.node("Concat", xs, axis=1)

    def split2(self, x, c):
        """Two equal channel halves (ShuffleNet's channel split): sizes as an attribute before
        opset 13, as an input from 13 on."""
        if self.opset < 13:
            return self.node("Split", [x], n_out=2, axis=1, split=[c // 2, c // 2])
        return self.node("Split", [x, self.const(np.array([c // 2, c // 2], dtype="int64"))],
                         n_out=2, axis=1)

    def reshape(self, x, shape):
        return self.node("Reshape", [x, self.const(np.array(shape, dtype="int64"))])

    def dropout(self, x):
        """Dropout with its (unused) mask output, as exporters leave it in inference graphs."""
        if self.opset < 12:
            return self.node("Dropout", [x], n_out=2, ratio=0.2)[0]
        return self.node("Dropout", [x, self.const(np.float32(0.2))], n_out=2)[0]

    def head(self, x, c, classes, softmax=True):
        """GlobalAveragePool, Dropout, Flatten, Gemm(transB=1), Softmax: the classifier exporters
        write for ``avgpool -> flatten -> dropout -> fc``."""
        y = self.node("Flatten", [self.dropout(self.node("GlobalAveragePool", [x]))], axis=1)
        w = self.rng.normal(0, np.sqrt(1.0 / c), (classes, c)).astype("float32")
        b = self.rng.normal(0, 0.05, classes).astype("float32")
        y = self.node("Gemm", [y, self.const(w, "fc.weight"), self.const(b, "fc.bias")],
                      alpha=1.0, beta=1.0, transB=1)
        return self.node("Softmax", [y], axis=1) if softmax else y

    def model(self, x_shape, out, initializers_as_inputs=False, batch="N"):
        """The checked ModelProto; ``batch`` names the leading dim of input and output (an int
        makes it static)."""
        x_shape = [batch, *x_shape[1:]]
        inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, x_shape)]
        if initializers_as_inputs or ir_version_for(self.opset) < 4:
            inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                       for t in self.inits]
        graph = helper.make_graph(self.nodes, self.name, inputs,
                                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                                  self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="tests.exported_cnns")
        model.ir_version = ir_version_for(self.opset)
        inferred = onnx.shape_inference.infer_shapes(model)
        model.graph.output[0].CopyFrom(inferred.graph.output[0])
        onnx.checker.check_model(model)
        return model


def _resnet50(g, width, layers, image_size, classes):
    """torchvision ResNet-50: 7x7 stem, Bottleneck(1x1, 3x3, 1x1, x4 expansion) stages with a
    1x1 conv + BN downsample, global pool, fc. The stem's max-pool padding is an explicit Pad."""
    x = g.cbr("input", 3, width, 7, stride=2)
    x = g.maxpool(g.pad(x, [0, 0, 1, 1, 0, 0, 1, 1]), 3, 2)
    cin = width
    for stage, blocks in enumerate(layers):
        planes = width * 2 ** stage
        for i in range(blocks):
            stride = 2 if stage > 0 and i == 0 else 1
            y = g.cbr(x, cin, planes, 1)
            y = g.cbr(y, planes, planes, 3, stride=stride)
            y = g.cbr(y, planes, planes * 4, 1, relu=False)
            short = x if (stride == 1 and cin == planes * 4) else \
                g.cbr(x, cin, planes * 4, 1, stride=stride, pad=0, relu=False)
            x = g.relu(g.node("Add", [y, short]))
            cin = planes * 4
    return g.head(x, cin, classes), [1, 3, image_size, image_size]


def _densenet121(g, growth, blocks, init_features, image_size, classes):
    """torchvision DenseNet-121: pre-activation dense layers (BN-ReLU-Conv1x1-BN-ReLU-Conv3x3) whose
    input is the Concat of every earlier feature map of the block (wide Concats), transitions
    BN-ReLU-Conv1x1-AvgPool, final BN-ReLU, pool, fc. BatchNormalization here mostly follows a
    Concat, not a Conv: it cannot be folded into weights, only decomposed."""
    x = g.maxpool(g.cbr("input", 3, init_features, 7, stride=2), 3, 2, pad=1)
    c = init_features
    for b, n in enumerate(blocks):
        feats = [x]
        for _ in range(n):
            cat = feats[0] if len(feats) == 1 else g.concat(feats)
            y = g.conv(g.relu(g.bn(cat, c + growth * (len(feats) - 1))),
                       c + growth * (len(feats) - 1), 4 * growth, 1)
            y = g.conv(g.relu(g.bn(y, 4 * growth)), 4 * growth, growth, 3)
            feats.append(y)
        x, c = g.concat(feats), c + growth * n
        if b < len(blocks) - 1:
            x = g.avgpool(g.conv(g.relu(g.bn(x, c)), c, c // 2, 1), 2, 2)
            c //= 2
    return g.head(g.relu(g.bn(x, c)), c, classes), [1, 3, image_size, image_size]


INCEPTION_BLOCKS = ((64, 64, 64, 64, 96, 32, 1), (64, 64, 96, 64, 96, 64, 1),
                    (0, 128, 160, 64, 96, 0, 2), (224, 64, 96, 96, 128, 128, 1))


def _inception_v2(g, width, blocks, image_size, classes):
    """BN-Inception (Inception-v2): conv-BN-ReLU everywhere, an LRN in the stem (as the GoogLeNet
    stem it grew from), blocks of 1x1 | 1x1-3x3 | 1x1-3x3-3x3 | avgpool(pad)-1x1 joined by Concat,
    and stride-2 blocks whose pool branch is a max-pool."""
    def c(n):
        return max(4, int(n * width))

    x = g.maxpool(g.cbr("input", 3, c(64), 7, stride=2), 3, 2, pad=1)
    x = g.node("LRN", [x], size=5, alpha=1e-4, beta=0.75, bias=1.0)
    x = g.cbr(g.cbr(x, c(64), c(64), 1), c(64), c(192), 3)
    x = g.maxpool(x, 3, 2, pad=1)
    cin = c(192)
    for (b1, r3, b3, rd, bd, pool, stride) in INCEPTION_BLOCKS[:blocks]:
        outs = []
        if b1:
            outs.append(g.cbr(x, cin, c(b1), 1))
        outs.append(g.cbr(g.cbr(x, cin, c(r3), 1), c(r3), c(b3), 3, stride=stride))
        y = g.cbr(g.cbr(x, cin, c(rd), 1), c(rd), c(bd), 3)
        outs.append(g.cbr(y, c(bd), c(bd), 3, stride=stride))
        if stride == 1:
            outs.append(g.cbr(g.avgpool(x, 3, 1, pad=1), cin, c(pool), 1))
        else:
            outs.append(g.maxpool(x, 3, 2, pad=1))
        x = g.concat(outs)
        cin = (c(b1) if b1 else 0) + c(b3) + c(bd) + (c(pool) if stride == 1 else cin)
    return g.head(x, cin, classes), [1, 3, image_size, image_size]


def _shuffle(g, x, c, hw):
    """channel_shuffle(x, 2) as torch exports it: Reshape, Transpose, Reshape."""
    y = g.reshape(x, [-1, 2, c // 2, hw, hw])
    y = g.node("Transpose", [y], perm=[0, 2, 1, 3, 4])
    return g.reshape(y, [-1, c, hw, hw])


def _shufflenet_v2(g, channels, repeats, image_size, classes):
    """torchvision ShuffleNet-v2: stride-2 units (two branches, both with a depthwise 3x3 + BN) and
    stride-1 units (channel Split, one branch), each ending in a Concat and a channel shuffle; a
    ReLU6-style Clip before the pool stands for MobileNet-style exports."""
    x = g.maxpool(g.cbr("input", 3, channels[0], 3, stride=2), 3, 2, pad=1)
    hw = ((image_size + 1) // 2 + 1) // 2
    cin = channels[0]
    for stage, n in enumerate(repeats):
        cout = channels[stage + 1]
        half = cout // 2
        for i in range(n):
            if i == 0:
                hw = (hw + 1) // 2
                left = g.cbr(g.cbr(x, cin, cin, 3, stride=2, groups=cin, relu=False), cin, half, 1)
                right = g.cbr(x, cin, half, 1)
                right = g.cbr(right, half, half, 3, stride=2, groups=half, relu=False)
                right = g.cbr(right, half, half, 1)
            else:
                left, right = g.split2(x, cout)
                right = g.cbr(right, half, half, 1)
                right = g.cbr(right, half, half, 3, groups=half, relu=False)
                right = g.cbr(right, half, half, 1)
            x = _shuffle(g, g.concat([left, right]), cout, hw)
            cin = cout
    x = g.clip(g.cbr(x, cin, channels[-1], 1, relu=False), 0.0, 6.0)
    return g.head(x, channels[-1], classes), [1, 3, image_size, image_size]


_MIRRORS = {"resnet50": _resnet50, "densenet121": _densenet121, "inception_v2": _inception_v2,
            "shufflenet_v2": _shufflenet_v2}


def mirror(name, opset=13, batch="N", initializers_as_inputs=False, seed=0, **sizes):
    """The onnx.helper export-style model ``name`` at ``opset`` (sizes default to REDUCED_CNN).
    ``batch``: the input's leading dim, symbolic by default as exporters write it."""
    g = ExportStyleGraph(name, opset, seed)
    out, shape = _MIRRORS[name](g, **{**REDUCED_CNN[name], **sizes})
    return g.model(shape, out, initializers_as_inputs, batch)


# --- torch definitions (torchvision-style, plain torch.nn) ----------------------------------------

def torch_model(name, **sizes):
    """The torch.nn network ``name`` in eval mode with randomised BatchNorm statistics."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    sizes = {**REDUCED_CNN[name], **sizes}
    image = sizes.pop("image_size")

    def cbr(cin, cout, k, stride=1, groups=1, relu=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, *([nn.ReLU()] if relu else []))

    def head(c, classes):
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                             nn.Linear(c, classes), nn.Softmax(dim=1))

    class Bottleneck(nn.Module):
        def __init__(self, cin, planes, stride):
            super().__init__()
            self.body = nn.Sequential(cbr(cin, planes, 1), cbr(planes, planes, 3, stride),
                                      cbr(planes, planes * 4, 1, relu=False))
            self.down = None if stride == 1 and cin == planes * 4 else \
                cbr(cin, planes * 4, 1, stride, relu=False)

        def forward(self, x):
            return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))

    class DenseLayer(nn.Module):
        def __init__(self, cin, growth):
            super().__init__()
            self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(),
                                      nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                      nn.BatchNorm2d(4 * growth), nn.ReLU(),
                                      nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False))

        def forward(self, feats):
            return self.body(torch.cat(feats, 1))

    class DenseBlock(nn.Module):
        def __init__(self, cin, growth, n):
            super().__init__()
            self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(n))

        def forward(self, x):
            feats = [x]
            for layer in self.layers:
                feats.append(layer(feats))
            return torch.cat(feats, 1)

    class Inception(nn.Module):
        def __init__(self, cin, b1, r3, b3, rd, bd, pool, stride):
            super().__init__()
            self.b1 = cbr(cin, b1, 1) if b1 else None
            self.b3 = nn.Sequential(cbr(cin, r3, 1), cbr(r3, b3, 3, stride))
            self.bd = nn.Sequential(cbr(cin, rd, 1), cbr(rd, bd, 3), cbr(bd, bd, 3, stride))
            self.pool = nn.Sequential(nn.AvgPool2d(3, 1, 1), cbr(cin, pool, 1)) if stride == 1 \
                else nn.MaxPool2d(3, 2, 1)

        def forward(self, x):
            outs = ([self.b1(x)] if self.b1 is not None else []) + \
                [self.b3(x), self.bd(x), self.pool(x)]
            return torch.cat(outs, 1)

    class ShuffleUnit(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            half = cout // 2
            self.stride = stride
            self.left = nn.Sequential(cbr(cin, cin, 3, 2, cin, relu=False), cbr(cin, half, 1)) \
                if stride == 2 else None
            cr = cin if stride == 2 else half
            self.right = nn.Sequential(cbr(cr, half, 1), cbr(half, half, 3, stride, half, False),
                                       cbr(half, half, 1))

        def forward(self, x):
            if self.stride == 2:
                out = torch.cat([self.left(x), self.right(x)], 1)
            else:
                a, b = x.chunk(2, dim=1)
                out = torch.cat([a, self.right(b)], 1)
            n, c, h, w = out.shape
            return out.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)

    if name == "resnet50":
        width, classes = sizes["width"], sizes["classes"]
        layers, cin = [cbr(3, width, 7, 2), nn.MaxPool2d(3, 2, 1)], width
        for stage, blocks in enumerate(sizes["layers"]):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width * 2 ** stage,
                                         2 if stage > 0 and i == 0 else 1))
                cin = width * 2 ** stage * 4
        net = nn.Sequential(*layers, head(cin, classes))
    elif name == "densenet121":
        growth, c = sizes["growth"], sizes["init_features"]
        layers = [cbr(3, c, 7, 2), nn.MaxPool2d(3, 2, 1)]
        for b, n in enumerate(sizes["blocks"]):
            layers.append(DenseBlock(c, growth, n))
            c += growth * n
            if b < len(sizes["blocks"]) - 1:
                layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]
                c //= 2
        net = nn.Sequential(*layers, nn.BatchNorm2d(c), nn.ReLU(), head(c, sizes["classes"]))
    elif name == "inception_v2":
        def ch(n):
            return max(4, int(n * sizes["width"]))
        # no LRN here (BN-Inception has none): torch exports LocalResponseNorm as a Shape/If/Pad
        # subgraph that TVM's ONNX frontend cannot import; the mirror has the ONNX LRN op
        layers = [cbr(3, ch(64), 7, 2), nn.MaxPool2d(3, 2, 1),
                  cbr(ch(64), ch(64), 1), cbr(ch(64), ch(192), 3), nn.MaxPool2d(3, 2, 1)]
        cin = ch(192)
        for (b1, r3, b3, rd, bd, pool, stride) in INCEPTION_BLOCKS[:sizes["blocks"]]:
            layers.append(Inception(cin, ch(b1) if b1 else 0, ch(r3), ch(b3), ch(rd), ch(bd),
                                    ch(pool), stride))
            cin = (ch(b1) if b1 else 0) + ch(b3) + ch(bd) + (ch(pool) if stride == 1 else cin)
        net = nn.Sequential(*layers, head(cin, sizes["classes"]))
    elif name == "shufflenet_v2":
        chans = sizes["channels"]
        layers, cin = [cbr(3, chans[0], 3, 2), nn.MaxPool2d(3, 2, 1)], chans[0]
        for stage, n in enumerate(sizes["repeats"]):
            for i in range(n):
                layers.append(ShuffleUnit(cin, chans[stage + 1], 2 if i == 0 else 1))
                cin = chans[stage + 1]
        layers += [cbr(cin, chans[-1], 1, relu=False), nn.ReLU6()]
        net = nn.Sequential(*layers, head(chans[-1], sizes["classes"]))
    else:
        raise ValueError(f"unknown network {name!r}; valid: {sorted(_MIRRORS)}")
    with torch.no_grad():  # trained-looking statistics, so folding them is not a no-op
        for mod in net.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0, 0.1)
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 2.0)
    return net.eval(), (1, 3, image, image)


def export(net, shape, opset, dynamic_batch=True, initializers_as_inputs=False):
    """``torch.onnx.export`` (the TorchScript exporter) with BatchNormalization kept; the batch dim
    is the symbolic ``N`` when ``dynamic_batch``."""
    import torch

    buf = io.BytesIO()
    torch.onnx.export(net, (torch.randn(*shape),), buf, dynamo=False, opset_version=opset,
                      input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "N"}, "output": {0: "N"}} if dynamic_batch else None,
                      do_constant_folding=False, keep_initializers_as_inputs=initializers_as_inputs)
    return onnx.load_from_string(buf.getvalue())
