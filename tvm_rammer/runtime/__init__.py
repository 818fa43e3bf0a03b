"""Run a tvm-rammer library built elsewhere, on TVM's runtime alone (issue 31's GPU side).

In: a library (``NAME.so``, exported by ``tvm.compile``), its manifest (``NAME.json``, format
``tvm-rammer-lib/1``) and its weights (the manifest's ``.npz``, or regenerated from the zoo model
it names with NumPy and ONNX). Out: outputs, the fault page's verdict, median latency, the error
against onnxruntime.

Imports only NumPy, TVM's runtime (``tvm.runtime``, ``tvm_ffi``), the standard library, ONNX and
onnxruntime (for the reference), ``tvm_rammer.models`` and ``tvm_rammer.lease.manifest`` (the
format's reader) and nothing else of tvm_rammer, so it works with ``TVM_USE_RUNTIME_LIB=1`` and on
a TVM without its compiler library::

    lib = tvm_rammer.runtime.load("alexnet.json")      # device from the manifest
    outputs = lib.run()                                 # seeded inputs, fault page checked
    lib.compare()["max_rel_err"]                        # against onnxruntime
    lib.time(200)                                       # median microseconds, page checked after

CLI: ``python3 -m tvm_rammer.runtime LIB.json [...] [--runs N] [--json OUT] [--no-reference]``.
"""

from .fault_page import KernelFault
from .library import Library, load
from .spec import LibrarySpec, read_spec

__all__ = ["load", "Library", "LibrarySpec", "read_spec", "KernelFault"]
