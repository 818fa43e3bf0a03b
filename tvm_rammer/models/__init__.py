"""Model zoo: ONNX models of the Rammer (OSDI'20), IOS, Nimble and Opara benchmarks, built with
`onnx.helper` and NumPy only (random, fixed-seed weights; opset 17, IR version 8, float32).

Every model function takes `batch` (default 1) and size arguments so tests can build a reduced
version; `get_model(name, batch=1, **kw)` looks one up by name in `MODELS`.
"""

from .alexnet import alexnet
from .googlenet import googlenet
from .inception_v3 import inception_v3
from .micro import branches, two_branch
from .nasbench import nasbench_cell
from .nasnet import nasnet_cifar
from .randwire import randwire
from .resnext import resnext29
from .rnn import deepspeech2, lstm_tc, seq2seq
from .squeezenet import squeezenet

MODELS = {
    "resnext29": resnext29,
    "nasnet_cifar": nasnet_cifar,
    "alexnet": alexnet,
    "deepspeech2": deepspeech2,
    "lstm_tc": lstm_tc,
    "seq2seq": seq2seq,
    "inception_v3": inception_v3,
    "squeezenet": squeezenet,
    "googlenet": googlenet,
    "randwire": randwire,
    "nasbench_cell": nasbench_cell,
    "branches": branches,
    "two_branch": two_branch,
}


def get_model(name, batch=1, **kw):
    """Build the model registered as `name` with `batch` and its keyword arguments."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name](batch=batch, **kw)


__all__ = ["MODELS", "get_model", *MODELS]
