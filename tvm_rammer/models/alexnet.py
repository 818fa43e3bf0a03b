"""AlexNet (Krizhevsky et al., NIPS 2012), the ImageNet model of Rammer Table 1."""

from ._builder import GraphBuilder


def alexnet(batch=1, image_size=224, width=1.0, fc_width=4096, num_classes=1000, seed=0):
    """AlexNet for ImageNet 224x224 (Rammer Table 1: "paper parameter").

    Five convolutions with the paper's 96/256/384/384/256 filters (11x11 s4, 5x5, 3x3, 3x3, 3x3),
    three 3x3 s2 max pools, FC 4096-4096-1000. Deviations: single tower (no group=2 split across
    two GPUs), no local response normalisation, no dropout (inference); conv1 padding 2 so a
    224x224 input gives the paper's 55x55. `width` scales conv channels and `fc_width` the hidden
    FC layers (for small test builds).
    """
    c = [max(1, int(round(ch * width))) for ch in (96, 256, 384, 384, 256)]
    g = GraphBuilder("alexnet", seed)
    x = g.input("input", [batch, 3, image_size, image_size])
    x = g.conv(x, 3, c[0], 11, stride=4, pad=2, relu=True)
    x = g.maxpool(x, 3, 2)
    x = g.conv(x, c[0], c[1], 5, relu=True)
    x = g.maxpool(x, 3, 2)
    x = g.conv(x, c[1], c[2], 3, relu=True)
    x = g.conv(x, c[2], c[3], 3, relu=True)
    x = g.conv(x, c[3], c[4], 3, relu=True)
    x = g.maxpool(x, 3, 2)
    side = image_size
    side = (side + 4 - 11) // 4 + 1
    for _ in range(3):
        side = (side - 3) // 2 + 1
    if side < 1:
        raise ValueError(f"image_size={image_size} is too small for AlexNet; use at least 67")
    x = g.flatten(x)
    x = g.relu(g.gemm(x, c[4] * side * side, fc_width, gain=2.0))
    x = g.relu(g.gemm(x, fc_width, fc_width, gain=2.0))
    return g.build([g.gemm(x, fc_width, num_classes)])
