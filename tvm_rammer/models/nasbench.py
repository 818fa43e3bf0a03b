"""NASBench-101-style random cells (Ying et al., ICML 2019), for many-module studies."""

import numpy as np

from ._builder import GraphBuilder

_OPS = ("conv3x3", "conv1x1", "maxpool3x3")
_JOINS = ("concat", "sum")


def random_cell(seed, max_ops=9):
    """Draw a cell: a list of (op, predecessors) in topological order, vertex 0 being the input
    and op i being vertex i + 1, plus the list of sink vertices that feed the output. Every op
    has at least one predecessor; each earlier vertex is a predecessor with probability 1/2."""
    if max_ops < 1:
        raise ValueError(f"max_ops={max_ops}: a cell needs at least one operator")
    rng = np.random.default_rng([seed, 1])
    n_ops = int(rng.integers(1, max_ops + 1))
    cell = []
    for v in range(1, n_ops + 1):
        preds = [u for u in range(v) if rng.random() < 0.5] or [int(rng.integers(v))]
        cell.append((_OPS[int(rng.integers(len(_OPS)))], preds))
    used = {u for _, preds in cell for u in preds}
    sinks = [v for v in range(1, n_ops + 1) if v not in used]
    return cell, sinks


def nasbench_cell(seed=0, max_ops=9, batch=1, channels=128, image_size=32, join="concat"):
    """One random NASBench-style module: 1 to `max_ops` operators drawn from {conv3x3-BN-ReLU,
    conv1x1-BN-ReLU, maxpool3x3}, wired by a random DAG (structure and weights from `seed`).
    A vertex sums its inputs; the sinks are joined by "concat" (then a 1x1 projection back to
    `channels`) or "sum". Deviation from NASBench-101: every vertex keeps `channels` channels
    (no channel splitting) and there is no input-to-output skip edge.
    """
    if join not in _JOINS:
        raise ValueError(f"join={join!r} is not supported; use one of {_JOINS}")
    cell, sinks = random_cell(seed, max_ops)
    g = GraphBuilder(f"nasbench_cell_{seed}", seed)
    vals = [g.input("input", [batch, channels, image_size, image_size])]
    for op, preds in cell:
        x = g.sum([vals[u] for u in preds])
        if op == "maxpool3x3":
            y = g.maxpool(x, 3, 1, pad=1)
        else:
            y = g.conv(x, channels, channels, 3 if op == "conv3x3" else 1, relu=True,
                       gain=2.0 / len(preds))
        vals.append(y)
    outs = [vals[v] for v in sinks]
    if join == "sum" or len(outs) == 1:
        return g.build([g.sum(outs)])
    y = g.conv(g.concat(outs), channels * len(outs), channels, 1, gain=1.0)
    return g.build([y])
