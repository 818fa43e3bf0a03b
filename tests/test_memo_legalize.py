"""MemoLegalizeOps: the same module as TVM's LegalizeOps, legalizing each signature once."""

import numpy as np
import tvm
from tvm import relax

from relay_passes.memo_legalize import MemoLegalizeOps, _Memo
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.driver.pipeline import rammer_passes
from tvm_rammer.target import rammer_target

from onnx_builders import random_dag


def _chain_module(n_same=10):
    """``n_same`` adds of one signature, a multiply of another shape, adds of two constants."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    y = relax.Var("y", relax.TensorType((8, 4), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            h = x
            for _ in range(n_same):
                h = bb.emit(relax.op.add(h, x))
            t = bb.emit(relax.op.multiply(y, y))
            c1 = bb.emit(relax.op.add(h, relax.const(np.ones((4, 8), "float32"))))
            c2 = bb.emit(relax.op.add(c1, relax.const(np.full((4, 8), 2, "float32"))))
            out = bb.emit_output(relax.Tuple([c2, t]))
        bb.emit_func_output(out)
    return bb.get()


def _before_legalize(model):
    target = rammer_target("rammer/nvidia-h100")
    passes = rammer_passes(target, RammerConfig(profile=False))
    names = [p.info.name for p in passes]
    with target:
        return tvm.transform.Sequential(passes[: names.index("MemoLegalizeOps")])(model)


def test_same_module_as_legalize_ops_on_an_unrolled_lstm_and_a_random_dag():
    for mod in (_before_legalize(import_onnx(get_model("lstm_tc", **REDUCED["lstm_tc"]))),
                import_onnx(random_dag(3, num_ops=12)), _chain_module()):
        tvm.ir.assert_structural_equal(MemoLegalizeOps()(mod), relax.transform.LegalizeOps()(mod))


def test_each_signature_is_legalized_once():
    calls = []
    add = tvm.ir.Op.get("relax.add").get_attr("FLegalize")

    def counting(bb, call):
        calls.append(call)
        return add(bb, call)

    mod = _chain_module(n_same=10)
    out = relax.transform.LegalizeOps(customize_legalize_map={"relax.add": _Memo(counting)})(mod)
    # one (4,8)+(4,8) signature for the ten chained adds, one per distinct constant
    assert len(calls) == 3
    tvm.ir.assert_structural_equal(out, relax.transform.LegalizeOps()(mod))
    kernels = [gv for gv, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 2  # add (shared by all adds) and multiply
