"""InPlaceWriteFusion: an in-place cache write and the injective group computing its update, one
call_tir_inplace after FuseTIR; numerics on llvm (the caller's cache written at the slot); the
update read elsewhere too is not fused (control)."""

import numpy as np
import tvm
from tvm import relax

from relay_passes.branch_fusion import BranchPreservingFusion
from relay_passes.cache_write import CacheSlotWrite
from relay_passes.inplace_fusion import InPlaceWriteFusion

SHAPE = (1, 2, 4, 3)  # [B, heads, max_len, head_dim]


def _module(update_read_elsewhere=False):
    """main(cache, x [1, 1, 2, 3], index [1, 2, 1, 3]) = ScatterElements(cache, index,
    transpose(x * 2), axis 2) (then + 1); with ``update_read_elsewhere`` the update is also
    returned."""
    bb = relax.BlockBuilder()
    cache = relax.Var("cache", relax.TensorType(SHAPE, "float32"))
    x = relax.Var("x", relax.TensorType((1, 1, 2, 3), "float32"))
    index = relax.Var("index", relax.TensorType((1, 2, 1, 3), "int64"))
    with bb.function("main", [cache, x, index]):
        with bb.dataflow():
            doubled = bb.emit(relax.op.multiply(x, relax.const(2.0, "float32")))
            update = bb.emit(relax.op.permute_dims(doubled, [0, 2, 1, 3]))
            written = bb.emit(relax.op.scatter_elements(cache, index, update, axis=2))
            out = relax.op.add(written, relax.const(1.0, "float32"))
            out = bb.emit_output(relax.Tuple([out, update]) if update_read_elsewhere else out)
        bb.emit_func_output(out)
    return bb.get()


def _lowered(mod):
    seq = tvm.transform.Sequential([
        CacheSlotWrite(inplace=True), relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        BranchPreservingFusion(), InPlaceWriteFusion(), relax.transform.FuseTIR()])
    return seq(mod)


def test_the_write_and_its_update_become_one_in_place_kernel():
    mod = _lowered(_module())
    text = mod["main"].script()
    assert text.count("R.call_tir_inplace(") == 1 and "_cache_write" in text, text
    assert "transpose" not in text.replace("transpose_cache_write", ""), text  # no kernel of its own
    ex = tvm.compile(mod, target="llvm")
    main = relax.VirtualMachine(ex, tvm.cpu())["main"]
    rng = np.random.default_rng(0)
    cache = rng.standard_normal(SHAPE).astype("float32")
    x = rng.standard_normal((1, 1, 2, 3)).astype("float32")
    for slot in (1, -1):
        index = np.full((1, 2, 1, 3), slot, np.int64)
        want = cache.copy()
        want[:, :, slot] = np.transpose(x * 2, (0, 2, 1, 3))[:, :, 0]
        callers = tvm.runtime.tensor(cache)
        out = main(callers, tvm.runtime.tensor(x), tvm.runtime.tensor(index))
        np.testing.assert_allclose(callers.numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(out.numpy(), want + 1, rtol=1e-6)


def test_an_update_read_elsewhere_stays_its_own_kernel():
    """Control: the update is also a result of main, so the write does not take its group (it
    takes the only other one: its indices' normalization)."""
    mod = _lowered(_module(update_read_elsewhere=True))
    text = mod["main"].script()
    assert "R.call_tir(fused_multiply_transpose" in text, text
    assert "R.call_tir_inplace(fused_less_add_where_cache_write" in text, text


def test_the_pipeline_writes_caches_in_place_and_the_flag_copies_them():
    """The rammer pipeline: CacheSlotWrite in place and InPlaceWriteFusion between the fusion
    passes and FuseTIR; ``inplace_cache=False`` (CLI ``--no-inplace-cache``) the copying form."""
    from tvm_rammer import cli
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.pipeline import graph_passes

    passes = graph_passes(RammerConfig())
    names = [p.info.name for p in passes]
    assert names.index("BranchPreservingFusion") < names.index("InPlaceWriteFusion") \
        < names.index("FuseTIR")
    write = passes[names.index("CacheSlotWrite")]
    assert write.inplace is True
    copying = graph_passes(RammerConfig(inplace_cache=False))
    assert next(p for p in copying if p.info.name == "CacheSlotWrite").inplace is False
    parser = cli.build_parser()
    for command in (["run", "m.onnx"], ["compile", "m.onnx", "-o", "m.so"], ["inspect", "m.onnx"]):
        assert cli._config(parser.parse_args(command)).inplace_cache is True
        assert cli._config(parser.parse_args(command + ["--no-inplace-cache"])).inplace_cache is False
