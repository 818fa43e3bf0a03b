"""RandWire-WS (Xie et al., ICCV 2019, "Exploring randomly wired neural networks"), as in IOS."""

import numpy as np

from ._builder import GraphBuilder


def watts_strogatz(n, k, p, rng):
    """Watts-Strogatz graph as networkx builds it: a ring lattice where each node links to its
    k/2 neighbours on each side, then every lattice edge (u, u+j) is rewired to (u, w), w random,
    with probability p. Returned as a DAG: sorted edges (a, b), a < b (the paper's orientation)."""
    if k % 2 or not 0 < k < n:
        raise ValueError(f"Watts-Strogatz needs an even k with 0 < k < n; got n={n}, k={k}")
    edges = {frozenset((u, (u + j) % n)) for u in range(n) for j in range(1, k // 2 + 1)}
    for j in range(1, k // 2 + 1):
        for u in range(n):
            v = (u + j) % n
            if frozenset((u, v)) not in edges or rng.random() >= p:
                continue
            free = [w for w in range(n) if w != u and frozenset((u, w)) not in edges]
            if free:
                edges.remove(frozenset((u, v)))
                edges.add(frozenset((u, int(rng.choice(free)))))
    return sorted(tuple(sorted(e)) for e in edges)


def _stage(g, x, c_in, c_out, n, k, p, rng):
    """One randomly wired stage. Nodes without predecessors read the stage input (stride 2);
    a node sums its inputs (plain ONNX `Sum`), then ReLU, 3x3 separable conv, folded BatchNorm.
    The stage output is the average of the nodes without successors."""
    edges = watts_strogatz(n, k, p, rng)
    preds = [[a for a, b in edges if b == v] for v in range(n)]
    has_succ = {a for a, _ in edges}
    out = []
    for v in range(n):
        if preds[v]:
            y = g.sep_conv(g.relu(g.sum([out[u] for u in preds[v]])), c_out, c_out, 3,
                           gain=1.0 / len(preds[v]))
        else:
            y = g.sep_conv(g.relu(x), c_in, c_out, 3, stride=2)
        out.append(y)
    sinks = [out[v] for v in range(n) if v not in has_succ]
    y = g.sum(sinks)
    if len(sinks) > 1:
        y = g.mul(y, g.const(np.array(1.0 / len(sinks), dtype=np.float32), "avg"))
    return y


def randwire(batch=1, nodes=32, k=4, p=0.75, channels=78, image_size=224, num_classes=1000,
             graph_seed=0, seed=0):
    """RandWire-WS small regime for ImageNet 224x224 (IOS Table 2: 3 blocks, Relu-SepConv).

    conv1 3x3/2 (C/2), conv2 3x3/2 (C), then three random stages of `nodes` nodes with C, 2C,
    4C channels, each graph WS(N=32, K=4, P=0.75) drawn from `graph_seed`, then 1x1 conv to
    1280, global average pool, FC. Deviation: a node's input aggregation is a plain sum (the
    paper's sigmoid-weighted sum with its learned weights at their initial value, up to scale);
    the depthwise weights are scaled by 1/in-degree instead so activations stay O(1).
    """
    rng = np.random.default_rng(graph_seed)
    g = GraphBuilder("randwire", seed)
    x = g.input("input", [batch, 3, image_size, image_size])
    x = g.conv(x, 3, channels // 2, 3, stride=2, relu=True)
    x = g.conv(x, channels // 2, channels, 3, stride=2, relu=True)
    c = channels
    for mult in (1, 2, 4):
        x = _stage(g, x, c, channels * mult, nodes, k, p, rng)
        c = channels * mult
    x = g.conv(g.relu(x), c, 1280, 1, relu=True)
    x = g.flatten(g.global_avgpool(x))
    return g.build([g.gemm(x, 1280, num_classes)])
