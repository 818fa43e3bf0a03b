"""Inception-v3 (Szegedy et al., CVPR 2016), as in IOS, Nimble and Opara."""

from ._builder import GraphBuilder


class _Net:
    """Holds the builder and the channel scale so the module helpers stay one-liners."""

    def __init__(self, g, width):
        self.g = g
        self.width = width

    def w(self, ch):
        return max(1, int(round(ch * self.width)))

    def conv(self, x, c_in, c_out, k, stride=1, pad=None):
        """BasicConv2d: conv + folded BN + ReLU; `c_out` is scaled here, `c_in` is not."""
        return self.g.conv(x, c_in, self.w(c_out), k, stride=stride, pad=pad, relu=True)

    def avgpool_branch(self, x, c_in, c_out):
        return self.conv(self.g.avgpool(x, 3, 1, pad=1, count_include_pad=1), c_in, c_out, 1)

    def block_a(self, x, c, pool_features):
        w, g = self.w, self.g
        b1 = self.conv(x, c, 64, 1)
        b5 = self.conv(self.conv(x, c, 48, 1), w(48), 64, 5)
        b3 = self.conv(self.conv(self.conv(x, c, 64, 1), w(64), 96, 3), w(96), 96, 3)
        bp = self.avgpool_branch(x, c, pool_features)
        return g.concat([b1, b5, b3, bp]), w(64) + w(64) + w(96) + w(pool_features)

    def block_b(self, x, c):
        w, g = self.w, self.g
        b3 = self.conv(x, c, 384, 3, stride=2, pad=0)
        bd = self.conv(self.conv(x, c, 64, 1), w(64), 96, 3)
        bd = self.conv(bd, w(96), 96, 3, stride=2, pad=0)
        return g.concat([b3, bd, g.maxpool(x, 3, 2)]), w(384) + w(96) + c

    def block_c(self, x, c, c7):
        w, g = self.w, self.g
        b1 = self.conv(x, c, 192, 1)
        b7 = self.conv(self.conv(x, c, c7, 1), w(c7), c7, (1, 7))
        b7 = self.conv(b7, w(c7), 192, (7, 1))
        bd = self.conv(x, c, c7, 1)
        for k in ((7, 1), (1, 7), (7, 1)):
            bd = self.conv(bd, w(c7), c7, k)
        bd = self.conv(bd, w(c7), 192, (1, 7))
        bp = self.avgpool_branch(x, c, 192)
        return g.concat([b1, b7, bd, bp]), 4 * w(192)

    def block_d(self, x, c):
        w, g = self.w, self.g
        b3 = self.conv(self.conv(x, c, 192, 1), w(192), 320, 3, stride=2, pad=0)
        b7 = self.conv(self.conv(x, c, 192, 1), w(192), 192, (1, 7))
        b7 = self.conv(self.conv(b7, w(192), 192, (7, 1)), w(192), 192, 3, stride=2, pad=0)
        return g.concat([b3, b7, g.maxpool(x, 3, 2)]), w(320) + w(192) + c

    def block_e(self, x, c):
        w, g = self.w, self.g
        b1 = self.conv(x, c, 320, 1)
        b3 = self.conv(x, c, 384, 1)
        b3 = g.concat([self.conv(b3, w(384), 384, (1, 3)), self.conv(b3, w(384), 384, (3, 1))])
        bd = self.conv(self.conv(x, c, 448, 1), w(448), 384, 3)
        bd = g.concat([self.conv(bd, w(384), 384, (1, 3)), self.conv(bd, w(384), 384, (3, 1))])
        bp = self.avgpool_branch(x, c, 192)
        return g.concat([b1, b3, bd, bp]), w(320) + 4 * w(384) + w(192)


def inception_v3(batch=1, image_size=299, width=1.0, num_classes=1000, seed=0):
    """Inception-v3 for ImageNet 299x299 (IOS Table 2: 11 blocks; Nimble; Opara).

    The torchvision layout: stem (3x3/2 32, 3x3 32, 3x3 64, pool, 1x1 80, 3x3 192, pool),
    Mixed_5b-5d (A), 6a (B), 6b-6e (C, c7 = 128, 160, 160, 192), 7a (D), 7b-7c (E), global average
    pool, FC. BatchNorm folded; auxiliary classifier and dropout omitted. `width` scales the
    channels; `image_size` must be at least 75.
    """
    if image_size < 75:
        raise ValueError(f"image_size={image_size} is too small for Inception-v3; use >= 75")
    g = GraphBuilder("inception_v3", seed)
    n = _Net(g, width)
    x = g.input("input", [batch, 3, image_size, image_size])
    x = n.conv(x, 3, 32, 3, stride=2, pad=0)
    x = n.conv(x, n.w(32), 32, 3, pad=0)
    x = n.conv(x, n.w(32), 64, 3)
    x = g.maxpool(x, 3, 2)
    x = n.conv(x, n.w(64), 80, 1)
    x = n.conv(x, n.w(80), 192, 3, pad=0)
    x = g.maxpool(x, 3, 2)
    x, c = n.block_a(x, n.w(192), 32)
    x, c = n.block_a(x, c, 64)
    x, c = n.block_a(x, c, 64)
    x, c = n.block_b(x, c)
    for c7 in (128, 160, 160, 192):
        x, c = n.block_c(x, c, c7)
    x, c = n.block_d(x, c)
    x, c = n.block_e(x, c)
    x, c = n.block_e(x, c)
    x = g.flatten(g.global_avgpool(x))
    return g.build([g.gemm(x, c, num_classes)])
