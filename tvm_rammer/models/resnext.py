"""ResNeXt-29 for CIFAR-10 (Xie et al., CVPR 2017), as in Rammer Table 1."""

from ._builder import GraphBuilder


def _block(g, x, c_in, width, c_out, cardinality, stride):
    """Bottleneck: 1x1 (width) -> 3x3 grouped (cardinality groups, stride) -> 1x1 (c_out), plus
    the shortcut (1x1 projection when the shape changes), then ReLU. The last conv of the
    residual branch uses gain 0.5 so the sum of 9 blocks keeps activations O(1)."""
    y = g.conv(x, c_in, width, 1, relu=True)
    y = g.conv(y, width, width, 3, stride=stride, group=cardinality, relu=True)
    y = g.conv(y, width, c_out, 1, gain=0.5)
    if stride != 1 or c_in != c_out:
        x = g.conv(x, c_in, c_out, 1, stride=stride, gain=1.0)
    return g.relu(g.add(y, x))


def resnext29(batch=1, cardinality=16, bottleneck_width=64, base_channels=64,
              blocks_per_stage=3, image_size=32, num_classes=10, seed=0):
    """ResNeXt-29 16x64d on CIFAR-10 32x32 (Rammer Table 1: layers 29, cardinality 16,
    bottleneck width 64d).

    Stem 3x3 conv (64), three stages of three bottleneck blocks (strides 1, 2, 2) whose grouped
    3x3 conv is one Conv with `group=cardinality`; stage i has a bottleneck of
    cardinality * bottleneck_width * 2^i channels and outputs 4 * base_channels * 2^i; then global
    average pool and FC-10. 29 = 3 * 3 * 3 + 2 layers. BatchNorm is folded into the convs.
    The other arguments shrink the network for tests.
    """
    g = GraphBuilder("resnext29", seed)
    x = g.input("input", [batch, 3, image_size, image_size])
    x = g.conv(x, 3, base_channels, 3, relu=True)
    c = base_channels
    for stage in range(3):
        width = cardinality * bottleneck_width * 2 ** stage
        c_out = 4 * base_channels * 2 ** stage
        for i in range(blocks_per_stage):
            stride = 2 if stage > 0 and i == 0 else 1
            x = _block(g, x, c, width, c_out, cardinality, stride)
            c = c_out
    x = g.flatten(g.global_avgpool(x))
    return g.build([g.gemm(x, c, num_classes)])
