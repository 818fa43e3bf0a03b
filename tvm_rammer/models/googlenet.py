"""GoogLeNet / Inception-v1 (Szegedy et al., CVPR 2015), as in Opara."""

from ._builder import GraphBuilder

# name: (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj), from the paper's Table 1.
_INCEPTIONS = (
    ("3a", (64, 96, 128, 16, 32, 32)), ("3b", (128, 128, 192, 32, 96, 64)), ("pool", None),
    ("4a", (192, 96, 208, 16, 48, 64)), ("4b", (160, 112, 224, 24, 64, 64)),
    ("4c", (128, 128, 256, 24, 64, 64)), ("4d", (112, 144, 288, 32, 64, 64)),
    ("4e", (256, 160, 320, 32, 128, 128)), ("pool", None),
    ("5a", (256, 160, 320, 32, 128, 128)), ("5b", (384, 192, 384, 48, 128, 128)),
)


def _inception(g, x, c_in, cfg):
    """Four parallel branches: 1x1; 1x1 -> 3x3; 1x1 -> 5x5; 3x3 max pool -> 1x1; concatenated."""
    c1, r3, c3, r5, c5, pp = cfg
    b1 = g.conv(x, c_in, c1, 1, relu=True)
    b2 = g.conv(g.conv(x, c_in, r3, 1, relu=True), r3, c3, 3, relu=True)
    b3 = g.conv(g.conv(x, c_in, r5, 1, relu=True), r5, c5, 5, relu=True)
    b4 = g.conv(g.maxpool(x, 3, 1, pad=1), c_in, pp, 1, relu=True)
    return g.concat([b1, b2, b3, b4]), c1 + c3 + c5 + pp


def googlenet(batch=1, image_size=224, width=1.0, num_classes=1000, seed=0):
    """GoogLeNet for ImageNet 224x224 (Opara's GoogLeNet workload).

    Stem conv 7x7/2 (64), max pool, conv 1x1 (64), conv 3x3 (192), max pool, nine inception
    modules (3a-5b, the paper's Table 1 channels, 5x5 convs as in the paper rather than
    torchvision's 3x3), max pools between groups (ceil mode), global average pool, FC. BatchNorm
    folded; LRN, dropout and the auxiliary classifiers omitted. `width` scales channels for tests.
    """
    def w(ch):
        return max(1, int(round(ch * width)))

    g = GraphBuilder("googlenet", seed)
    x = g.input("input", [batch, 3, image_size, image_size])
    x = g.conv(x, 3, w(64), 7, stride=2, relu=True)
    x = g.maxpool(x, 3, 2, ceil_mode=1)
    x = g.conv(x, w(64), w(64), 1, relu=True)
    x = g.conv(x, w(64), w(192), 3, relu=True)
    x = g.maxpool(x, 3, 2, ceil_mode=1)
    c = w(192)
    for name, cfg in _INCEPTIONS:
        if name == "pool":
            x = g.maxpool(x, 3, 2, ceil_mode=1)
        else:
            x, c = _inception(g, x, c, tuple(w(ch) for ch in cfg))
    x = g.flatten(g.global_avgpool(x))
    return g.build([g.gemm(x, c, num_classes)])
