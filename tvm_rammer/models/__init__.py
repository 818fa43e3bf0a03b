"""Model zoo: ONNX models of the Rammer (OSDI'20), IOS, Nimble and Opara benchmarks, built with
`onnx.helper` and NumPy only (random, fixed-seed weights; opset 17, IR version 8, float32).

The transformers of issue 34 (`gpt2_decode`, `llama_decode`, `bert_base`) take int64 token ids;
`save_model` writes any model, with external data past ONNX's 2 GiB limit.

Every model function takes `batch` (default 1) and size arguments so tests can build a reduced
version; `get_model(name, batch=1, **kw)` looks one up by name in `MODELS`.
"""

from ._save import save_model
from .alexnet import alexnet
from .googlenet import googlenet
from .inception_v3 import inception_v3
from .micro import branches, two_branch
from .nasbench import nasbench_cell
from .nasnet import nasnet_cifar
from .randwire import randwire
from .registry import MODELS, REDUCED, get_model
from .resnext import resnext29
from .rnn import deepspeech2, lstm_tc, seq2seq
from .squeezenet import squeezenet
from .transformers import bert_base, gpt2_decode, llama_decode

__all__ = ["MODELS", "REDUCED", "get_model", "save_model", *MODELS]
