"""The zoo by name: ``MODELS`` (name -> builder), ``REDUCED`` (name -> the reduced size the tests
build) and ``get_model(name, batch=1, **kw)``."""

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
from .transformers import bert_base, gpt2_decode, llama_decode

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
    "gpt2_decode": gpt2_decode,
    "llama_decode": llama_decode,
    "bert_base": bert_base,
}


# Reduced configurations of every model: the same code paths, seconds to build and lower
# (tests and `tvm-rammer bench --reduced`).
REDUCED = {
    "resnext29": dict(cardinality=2, bottleneck_width=4, base_channels=8, blocks_per_stage=1,
                      image_size=16),
    "nasnet_cifar": dict(num_cells=1, num_conv_filters=8, image_size=16),
    "alexnet": dict(image_size=67, width=0.125, fc_width=64),
    "deepspeech2": dict(seq_len=6, n_freq=21, hidden=16, layers=2, conv_channels=4),
    "lstm_tc": dict(seq_len=5, input_size=16, hidden=16, layers=3),
    "seq2seq": dict(src_len=5, tgt_len=3, hidden=16, enc_layers=3, dec_layers=2),
    "inception_v3": dict(image_size=75, width=0.125),
    "squeezenet": dict(image_size=64, width=0.25),
    "googlenet": dict(image_size=64, width=0.125),
    "randwire": dict(nodes=8, channels=8, image_size=64),
    "nasbench_cell": dict(seed=3, channels=8, image_size=8),
    "branches": dict(n=4, k=16, n_out=8),
    "two_branch": dict(rows=4, k=16, n_out=8),
    "gpt2_decode": dict(layers=2, d_model=64, heads=4, vocab=96, max_len=16),
    "llama_decode": dict(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=128, vocab=96, max_len=16),
    "bert_base": dict(layers=2, d_model=64, heads=4, seq_len=16, vocab=96),
}


def get_model(name, batch=1, **kw):
    """Build the model registered as `name` with `batch` and its keyword arguments."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name](batch=batch, **kw)


__all__ = ["MODELS", "REDUCED", "get_model"]
