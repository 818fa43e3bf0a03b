"""SqueezeNet 1.1 (Iandola et al. 2016; the v1.1 of the SqueezeNet repository), as in IOS."""

from ._builder import GraphBuilder

# (squeeze, expand) channels of the eight fire modules; a max pool precedes fires 0, 2 and 4.
_FIRES = ((16, 64), (16, 64), (32, 128), (32, 128), (48, 192), (48, 192), (64, 256), (64, 256))


def _fire(g, x, c_in, squeeze, expand):
    """Fire module: 1x1 squeeze + ReLU, then parallel 1x1 and 3x3 expands + ReLU, concatenated."""
    s = g.conv(x, c_in, squeeze, 1, relu=True)
    return g.concat([g.conv(s, squeeze, expand, 1, relu=True),
                     g.conv(s, squeeze, expand, 3, relu=True)])


def squeezenet(batch=1, image_size=224, width=1.0, num_classes=1000, seed=0):
    """SqueezeNet 1.1 for ImageNet 224x224 (IOS, MLSys'21, Table 2: 10 blocks, Conv-ReLU).

    conv 3x3/2 (64) + ReLU, max pool 3/2 (ceil mode), fire x2, pool, fire x2, pool, fire x4,
    conv 1x1 to classes + ReLU, global average pool. Dropout omitted (inference). `width` scales
    all channel counts for tests.
    """
    def w(ch):
        return max(1, int(round(ch * width)))

    g = GraphBuilder("squeezenet", seed)
    x = g.input("input", [batch, 3, image_size, image_size])
    x = g.conv(x, 3, w(64), 3, stride=2, pad=0, relu=True)
    c = w(64)
    for i, (sq, ex) in enumerate(_FIRES):
        if i in (0, 2, 4):
            x = g.maxpool(x, 3, 2, ceil_mode=1)
        x = _fire(g, x, c, w(sq), w(ex))
        c = 2 * w(ex)
    x = g.conv(x, c, num_classes, 1, relu=True)
    return g.build([g.flatten(g.global_avgpool(x))])
