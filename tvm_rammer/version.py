"""The version of tvm-rammer: its one source (``setup.py`` reads it, ``tvm_rammer.__version__`` and
``tvm-rammer --version`` print it). Imports nothing."""

__version__ = "0.1.0"
