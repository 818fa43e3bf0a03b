"""Microbenchmarks for the project's acceptance tests: independent GEMV/GEMM branches."""

from ._builder import GraphBuilder

_ACTIVATIONS = ("relu", "sigmoid", "tanh", "none")
_JOINS = ("sum", "add_chain", "concat")


def branches(n=16, m=1, k=256, n_out=256, activation="relu", join="sum", batch=1, seed=0):
    """`n` parallel branches `act(x @ W_i)`, x: [batch * m, k], W_i: [k, n_out], then joined.

    Source: this project's microbenchmark (the inter-operator parallelism of Rammer section 2, in
    its simplest form). `join` is "sum" (one ONNX `Sum`, output [batch*m, n_out]), "add_chain"
    (a chain of n-1 `Add`s) or "concat" (`Concat` on axis 1, output [batch*m, n * n_out]).
    `activation` is "relu", "sigmoid", "tanh" or "none".
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {_ACTIVATIONS}")
    if join not in _JOINS:
        raise ValueError(f"join={join!r} is not supported; use one of {_JOINS}")
    if n < 1:
        raise ValueError(f"n={n} branches: need at least 1")
    g = GraphBuilder("branches", seed)
    x = g.input("input", [batch * m, k])
    outs = []
    for _ in range(n):
        y = g.matmul(x, k, n_out, gain=2.0 if activation == "relu" else 1.0)
        outs.append(y if activation == "none" else g.node(activation.capitalize(), [y]))
    if join == "sum":
        y = g.sum(outs)
    elif join == "concat":
        y = g.concat(outs, axis=1)
    else:
        y = outs[0]
        for o in outs[1:]:
            y = g.add(y, o)
    return g.build([y])


def two_branch(batch=1, rows=64, k=128, n_out=256, seed=0):
    """x: [batch * rows, k] -> two independent `Relu(x @ W_i)`, W_i: [k, n_out] -> `Add`.

    Source: this project's smallest two-branch example (Rammer Figure 1 in miniature).
    """
    g = GraphBuilder("two_branch", seed)
    x = g.input("input", [batch * rows, k])
    a = g.relu(g.matmul(x, k, n_out, gain=2.0))
    b = g.relu(g.matmul(x, k, n_out, gain=2.0))
    return g.build([g.add(a, b)])
