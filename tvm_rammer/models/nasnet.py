"""NASNet-A for CIFAR-10 (Zoph et al., CVPR 2018), as in Rammer Table 1 and IOS."""

import numpy as np

from ._builder import GraphBuilder

# NASNet-A cells as in the authors' TF-slim code (nets/nasnet/nasnet.py): block b combines
# op[2b](hidden[idx[2b]]) + op[2b+1](hidden[idx[2b+1]]); hidden = [h_prev, h_cur, block0, ...];
# the cell output concatenates the hidden states marked 0 in `used`.
_NORMAL = dict(
    ops=("sep5", "sep3", "sep5", "sep3", "avg3", "none", "avg3", "avg3", "sep3", "none"),
    idx=(0, 1, 1, 1, 0, 1, 1, 1, 0, 0), used=(1, 0, 0, 0, 0, 0, 0))
_REDUCTION = dict(
    ops=("sep5", "sep7", "max3", "sep7", "avg3", "sep5", "none", "avg3", "sep3", "max3"),
    idx=(0, 1, 0, 1, 0, 1, 3, 2, 2, 0), used=(1, 1, 1, 0, 0, 0, 0))


def _factorized_reduction(g, x, c_in, filters):
    """Halve the spatial size with two 1x1 stride-2 paths, the second shifted by one pixel
    (pad the end, drop the first row/column), concatenated."""
    p1 = g.conv(x, c_in, filters // 2, 1, stride=2, pad=0)
    starts, ends, axes = (g.const(np.array(v, dtype=np.int64), "slice") for v in
                          ([1, 1], [np.iinfo(np.int64).max] * 2, [2, 3]))
    shifted = g.node("Slice", [x, starts, ends, axes])
    pads = g.const(np.array([0, 0, 0, 0, 0, 0, 1, 1], dtype=np.int64), "pads")
    shifted = g.node("Pad", [shifted, pads])
    p2 = g.conv(shifted, c_in, filters - filters // 2, 1, stride=2, pad=0)
    return g.concat([p1, p2])


def _op(g, x, op, filters, stride):
    """One NASNet-A operation on a `filters`-channel tensor."""
    if op.startswith("sep"):
        k = int(op[3:])
        x = g.sep_conv(g.relu(x), filters, filters, k, stride=stride)
        return g.sep_conv(g.relu(x), filters, filters, k)
    if op == "avg3":
        return g.avgpool(x, 3, stride, pad=1)
    if op == "max3":
        return g.maxpool(x, 3, stride, pad=1)
    if stride == 1:
        return x
    return g.conv(g.relu(x), filters, filters, 1, stride=stride, pad=0)


def _cell(g, spec, cur, prev, filters, reduction):
    """One cell on (name, channels, side) tensors; returns the output in the same form. The
    1x1 convs that bring both inputs to `filters` channels use gain 1 (not He's 2) so that the
    block sums do not make activations grow from cell to cell."""
    prev = prev or cur
    if prev[2] != cur[2]:
        h0 = _factorized_reduction(g, g.relu(prev[0]), prev[1], filters)
    elif prev[1] != filters:
        h0 = g.conv(g.relu(prev[0]), prev[1], filters, 1, gain=1.0)
    else:
        h0 = prev[0]
    hidden = [h0, g.conv(g.relu(cur[0]), cur[1], filters, 1, gain=1.0)]
    for b in range(5):
        pair = []
        for j in (2 * b, 2 * b + 1):
            i = spec["idx"][j]
            pair.append(_op(g, hidden[i], spec["ops"][j], filters, 2 if reduction and i < 2 else 1))
        hidden.append(g.add(*pair))
    out = [h for h, used in zip(hidden, spec["used"]) if not used]
    side = (cur[2] + 1) // 2 if reduction else cur[2]
    return g.concat(out), filters * len(out), side


def nasnet_cifar(batch=1, num_cells=6, num_conv_filters=32, image_size=32, num_classes=10, seed=0):
    """NASNet-A 6@768 on CIFAR-10 32x32 (Rammer Table 1: repeated cells 6, filters 768).

    Stem 3x3 conv (3 * num_conv_filters), three stages of `num_cells` normal cells with a
    reduction cell between stages (18 normal + 2 reduction cells), filters 32, 64, 128 so the
    last cell outputs 6 * 128 = 768 channels; ReLU, global average pool, FC-10. Cell wiring is
    NASNet-A's (normal and reduction cell, five blocks of two ops each). Separable convs are a
    depthwise Conv then a pointwise Conv, applied twice with ReLU before each (as in the paper).
    BatchNorm folded; auxiliary head and drop-path omitted (inference).
    """
    g = GraphBuilder("nasnet_cifar", seed)
    x = g.input("input", [batch, 3, image_size, image_size])
    c = 3 * num_conv_filters
    cur, prev = (g.conv(x, 3, c, 3), c, image_size), None
    filters = num_conv_filters
    for stage in range(3):
        if stage > 0:
            filters *= 2
            cur, prev = _cell(g, _REDUCTION, cur, prev, filters, True), cur
        for _ in range(num_cells):
            cur, prev = _cell(g, _NORMAL, cur, prev, filters, False), cur
    y = g.flatten(g.global_avgpool(g.relu(cur[0])))
    return g.build([g.gemm(y, cur[1], num_classes)])
