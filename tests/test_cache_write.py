"""CacheSlotWrite: a one-slot cache scatter becomes one injective kernel with ONNX's semantics.

Structural (Before/Expected), numerics on llvm against numpy's ScatterND / ScatterElements (negative
indices included), what the pass declines (index components not proven, other reductions and
shapes: TVM's legalization, same numerics), and (slow) the reduced decoders compiled for
rammer/nvidia-h100 without a GPU: one launch, matching onnxruntime on the CPU emulator with both
cache writes, and a kernel writing the wrong slot detected there (negative control).
"""

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I, relax as R, tirx as T

from relay_passes import cache_write
from relay_passes.cache_write import CacheSlotWrite
from relay_passes.known_values import known_elements

SHAPE = (1, 2, 4, 3)  # [B, heads, max_len, head_dim]
BASE = [[[[0, 0, 0]], [[0, 1, 0]]]]  # (b, h, 0) for b = 0, h = 0..1: an exported index_put's


@I.ir_module
class Before:
    @R.function
    def main(cache: R.Tensor((1, 2, 4, 3), "float32"), new: R.Tensor((1, 2, 1, 3), "float32"),
             position: R.Tensor((1,), "int64")) -> R.Tensor((1, 2, 4, 3), "float32"):
        with R.dataflow():
            slot = R.multiply(position, R.const([0, 0, 1], "int64"))
            idx = R.add(R.const(BASE, "int64"), slot)
            out = R.scatter_nd(cache, idx, new, reduction="update")
            R.output(out)
        return out


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def cache_write(cache: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(3)), "float32"),
                    idx: T.Buffer((T.int64(1), T.int64(2), T.int64(1), T.int64(3)), "int64"),
                    new: T.Buffer((T.int64(1), T.int64(2), T.int64(1), T.int64(3)), "float32"),
                    T_cache_write: T.Buffer((T.int64(1), T.int64(2), T.int64(4), T.int64(3)),
                                            "float32")):
        T.func_attr({"tirx.noalias": True})
        for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(2), T.int64(4), T.int64(3)):
            with T.sblock("T_cache_write"):
                v0, v1, v2, v3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                T.reads(idx[v0, v1, T.int64(0), T.int64(2)], new[v0, v1, T.int64(0), v3],
                        cache[v0, v1, v2, v3])
                T.writes(T_cache_write[v0, v1, v2, v3])
                T_cache_write[v0, v1, v2, v3] = T.Select(
                    T.Select(idx[v0, v1, T.int64(0), T.int64(2)] < T.int64(0),
                             idx[v0, v1, T.int64(0), T.int64(2)] + T.int64(4),
                             idx[v0, v1, T.int64(0), T.int64(2)]) == v2,
                    new[v0, v1, T.int64(0), v3], cache[v0, v1, v2, v3])

    @R.function
    def main(cache: R.Tensor((1, 2, 4, 3), "float32"), new: R.Tensor((1, 2, 1, 3), "float32"),
             position: R.Tensor((1,), "int64")) -> R.Tensor((1, 2, 4, 3), "float32"):
        cls = Expected
        with R.dataflow():
            slot = R.multiply(position, R.const([0, 0, 1], "int64"))
            idx = R.add(R.const(BASE, "int64"), slot)
            out = R.call_tir(cls.cache_write, (cache, idx, new),
                             out_ty=R.Tensor((1, 2, 4, 3), "float32"))
            R.output(out)
        return out


def test_index_put_scatter_becomes_one_injective_kernel():
    tvm.ir.assert_structural_equal(CacheSlotWrite()(Before), Expected)


def _i64(value):
    return relax.const(np.asarray(value, np.int64), "int64")


def _scatter_nd_module(base, reduction="update", shape=SHAPE):
    """main(cache, new, position) = ScatterND(cache, base + position * (0, .., 0, 1), new)."""
    bb = relax.BlockBuilder()
    n = np.shape(base)[-1]
    cache = relax.Var("cache", relax.TensorType(shape, "float32"))
    upd_shape = tuple(np.shape(base)[:-1]) + tuple(shape[n:])
    new = relax.Var("new", relax.TensorType(upd_shape, "float32"))
    position = relax.Var("position", relax.TensorType((1,), "int64"))
    with bb.function("main", [cache, new, position]):
        with bb.dataflow():
            axis = np.zeros(n, np.int64)
            axis[-1] = 1
            slot = bb.emit(relax.op.multiply(position, _i64(axis)))
            idx = bb.emit(relax.op.add(_i64(base), slot))
            out = bb.emit_output(relax.op.scatter_nd(cache, idx, new, reduction=reduction))
        bb.emit_func_output(out)
    return bb.get()


def _scatter_elements_module(index_shape, axis=2, shape=SHAPE):
    """main(cache, new, index) = ScatterElements(cache, index, new, axis)."""
    bb = relax.BlockBuilder()
    cache = relax.Var("cache", relax.TensorType(shape, "float32"))
    new = relax.Var("new", relax.TensorType(index_shape, "float32"))
    index = relax.Var("index", relax.TensorType(index_shape, "int64"))
    with bb.function("main", [cache, new, index]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.scatter_elements(cache, index, new, axis=axis))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, *args):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _rewritten(mod):
    text = mod["main"].script()
    return "R.call_tir(cache_write" in text and "scatter" not in text


def test_scatter_nd_slot_write_is_onnx_scatter_nd_at_every_position():
    """Every slot, and -1 (the last slot, as the frontend's index normalisation reads it)."""
    rng = np.random.default_rng(0)
    cache = rng.standard_normal(SHAPE).astype("float32")
    new = rng.standard_normal((1, 2, 1, 3)).astype("float32")
    mod = CacheSlotWrite()(_scatter_nd_module(BASE))
    assert _rewritten(mod)
    for p in (0, 2, 3, -1):
        want = cache.copy()
        want[:, :, p] = new[:, :, 0]
        np.testing.assert_array_equal(_run(mod, cache, new, np.array([p], np.int64)), want)


def test_scatter_elements_slot_write_is_onnx_scatter_elements_per_element():
    """ScatterElements on axis 2 with a slot per element (not only per head): each (b, h, d)
    writes its own slot, negative indices counted from the end."""
    rng = np.random.default_rng(1)
    cache = rng.standard_normal(SHAPE).astype("float32")
    new = rng.standard_normal((1, 2, 1, 3)).astype("float32")
    index = rng.integers(-4, 4, size=(1, 2, 1, 3)).astype("int64")
    mod = CacheSlotWrite()(_scatter_elements_module((1, 2, 1, 3)))
    assert _rewritten(mod)
    want = cache.copy()
    for b, h, _, d in np.ndindex(index.shape):
        want[b, h, index[b, h, 0, d] % 4, d] = new[b, h, 0, d]
    np.testing.assert_array_equal(_run(mod, cache, new, index), want)


@pytest.mark.parametrize("base, why", [
    ([[[[0, 1, 0]], [[0, 0, 0]]]], "heads swapped: not the indices' own coordinates"),
    ([[[[0, 0, 0]], [[0, 0, 0]]]], "both heads write head 0 (duplicates)"),
    ([[[[0, 0, 0], [0, 0, 1]], [[0, 1, 0], [0, 1, 1]]]], "two slots per head"),
])
def test_scatters_it_cannot_prove_one_slot_are_left_to_tvm(base, why):
    """Leading components other than the coordinates, or more than one slot: not rewritten, and
    TVM's legalization computes ONNX's result (the swapped heads land swapped)."""
    mod = _scatter_nd_module(base)
    after = CacheSlotWrite()(mod)
    assert not _rewritten(after), why
    tvm.ir.assert_structural_equal(after, mod)
    rng = np.random.default_rng(2)
    cache = rng.standard_normal(SHAPE).astype("float32")
    new = rng.standard_normal(np.shape(base)[:-1] + (3,)).astype("float32")
    want = cache.copy()
    idx = np.asarray(base) + np.array([0, 0, 1])
    for pos in np.ndindex(idx.shape[:-1]):
        want[tuple(idx[pos])] = new[pos]
    np.testing.assert_array_equal(_run(after, cache, new, np.array([1], np.int64)), want)


def test_other_reductions_shapes_and_unknown_indices_are_left_alone():
    declined = [
        _scatter_nd_module(BASE, reduction="add"),
        _scatter_elements_module((1, 2, 2, 3)),      # two slots along the axis
        _scatter_elements_module((1, 1, 1, 3)),      # fewer heads than the cache
    ]
    bb = relax.BlockBuilder()  # ScatterND whose indices are an input: nothing proven
    cache = relax.Var("cache", relax.TensorType(SHAPE, "float32"))
    new = relax.Var("new", relax.TensorType((1, 2, 1, 3), "float32"))
    idx = relax.Var("idx", relax.TensorType((1, 2, 1, 3), "int64"))
    with bb.function("main", [cache, new, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.scatter_nd(cache, idx, new))
        bb.emit_func_output(out)
    declined.append(bb.get())
    for mod in declined:
        tvm.ir.assert_structural_equal(CacheSlotWrite()(mod), mod)


def test_known_elements_follow_the_frontends_negative_index_arithmetic():
    """where(idx < 0, idx + shape, idx) of base + position * (0, 0, 1): components 0 and 1 known
    (the constants), component 2 not (it is the position)."""
    bb = relax.BlockBuilder()
    position = relax.Var("position", relax.TensorType((1,), "int64"))
    with bb.function("main", [position]):
        with bb.dataflow():
            slot = bb.emit(relax.op.multiply(position, _i64([0, 0, 1])))
            idx = bb.emit(relax.op.add(_i64(BASE), slot))
            neg = bb.emit(relax.op.less(idx, relax.const(0, "int64")))
            wrapped = bb.emit(relax.op.add(idx, _i64([1, 2, 4])))
            out = bb.emit_output(relax.op.where(neg, wrapped, idx))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    bindings = {b.var: b.value for b in func.body.blocks[0].bindings}
    values, known = known_elements(bindings[func.body.blocks[0].bindings[-1].var], bindings.get)
    assert known[..., :2].all() and not known[..., 2].any()
    np.testing.assert_array_equal(values[..., :2], np.asarray(BASE)[..., :2])


def test_known_elements_trace_each_expression_once():
    """25 nested normalisations where(x < 0, x + 4, x) (each reads x three times: 3^25 paths)
    are traced in linear time, constants known through all of them; a chain too deep for
    Python's recursion proves nothing (declined, never a wrong proof)."""
    def chain(levels):
        bb = relax.BlockBuilder()
        position = relax.Var("position", relax.TensorType((1,), "int64"))
        with bb.function("main", [position]):
            with bb.dataflow():
                x = bb.emit(relax.op.add(_i64([2, -1, 0]),
                                         relax.op.multiply(position, _i64([0, 0, 1]))))
                for _ in range(levels):
                    neg = bb.emit(relax.op.less(x, _i64(0)))
                    x = bb.emit(relax.op.where(neg, relax.op.add(x, _i64(4)), x))
                out = bb.emit_output(x)
            bb.emit_func_output(out)
        block = bb.get()["main"].body.blocks[0]
        bindings = {b.var: b.value for b in block.bindings}
        return known_elements(bindings[block.bindings[-1].var], bindings.get)

    values, known = chain(25)
    assert known.tolist() == [True, True, False] and values[:2].tolist() == [2, 3]
    assert chain(2000) is None


def test_a_known_zero_decides_an_integer_product_not_a_float_one():
    """position * 0 is 0 whatever the position in int64; x * 0.0 is NaN for x = inf, so a float
    product with an unknown factor stays unknown (and so does what it is cast to)."""
    bb = relax.BlockBuilder()
    position = relax.Var("position", relax.TensorType((1,), "int64"))
    x = relax.Var("x", relax.TensorType((1,), "float32"))
    with bb.function("main", [position, x]):
        with bb.dataflow():
            ints = bb.emit(relax.op.multiply(position, _i64([0])))
            floats = bb.emit(relax.op.astype(
                bb.emit(relax.op.multiply(x, relax.const([0.0], "float32"))), "int64"))
            out = bb.emit_output(relax.op.add(ints, floats))
        bb.emit_func_output(out)
    block = bb.get()["main"].body.blocks[0]
    bindings = {b.var: b.value for b in block.bindings}
    values, known = known_elements(block.bindings[0].var, bindings.get)
    assert known.tolist() == [True] and values.tolist() == [0]
    assert known_elements(block.bindings[2].var, bindings.get)[1].tolist() == [False]


# In place: only the slot written, into the caller's cache (llvm).

def _vm(mod):
    return relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"]


def test_in_place_write_updates_the_callers_cache_and_returns_it():
    """inplace=True: R.call_tir_inplace of a kernel over the update only; the output is the
    caller's cache tensor itself, updated at the slot and nowhere else (every slot, and -1)."""
    mod = CacheSlotWrite(inplace=True)(_scatter_nd_module(BASE))
    text = mod.script()
    assert "R.call_tir_inplace(cls.cache_write_inplace" in text and "scatter" not in text
    assert "T.grid(T.int64(1), T.int64(2), T.int64(1), T.int64(3))" in text  # the update's, not the cache's
    main = _vm(mod)
    rng = np.random.default_rng(4)
    for p in (0, 3, -1):
        cache = rng.standard_normal(SHAPE).astype("float32")
        new = rng.standard_normal((1, 2, 1, 3)).astype("float32")
        want = cache.copy()
        want[:, :, p] = new[:, :, 0]
        callers = tvm.runtime.tensor(cache)
        out = main(callers, tvm.runtime.tensor(new), tvm.runtime.tensor(np.array([p], np.int64)))
        np.testing.assert_array_equal(callers.numpy(), want)
        assert out.same_as(callers)


def test_in_place_scatter_elements_writes_each_elements_slot():
    rng = np.random.default_rng(5)
    cache = rng.standard_normal(SHAPE).astype("float32")
    new = rng.standard_normal((1, 2, 1, 3)).astype("float32")
    index = rng.integers(-4, 4, size=(1, 2, 1, 3)).astype("int64")
    mod = CacheSlotWrite(inplace=True)(_scatter_elements_module((1, 2, 1, 3)))
    assert "R.call_tir_inplace" in mod.script()
    want = cache.copy()
    for b, h, _, d in np.ndindex(index.shape):
        want[b, h, index[b, h, 0, d] % 4, d] = new[b, h, 0, d]
    callers = tvm.runtime.tensor(cache)
    _vm(mod)(callers, tvm.runtime.tensor(new), tvm.runtime.tensor(index))
    np.testing.assert_array_equal(callers.numpy(), want)


def test_a_cache_read_elsewhere_is_not_written_in_place():
    """main returns the scattered cache and the old one's sum with it: writing in place would
    change what the sum reads, so the injective kernel is used and the caller's cache is kept."""
    bb = relax.BlockBuilder()
    cache = relax.Var("cache", relax.TensorType(SHAPE, "float32"))
    new = relax.Var("new", relax.TensorType((1, 2, 1, 3), "float32"))
    position = relax.Var("position", relax.TensorType((1,), "int64"))
    with bb.function("main", [cache, new, position]):
        with bb.dataflow():
            slot = bb.emit(relax.op.multiply(position, _i64([0, 0, 1])))
            idx = bb.emit(relax.op.add(_i64(BASE), slot))
            out = bb.emit(relax.op.scatter_nd(cache, idx, new))
            both = bb.emit_output(relax.op.add(out, cache))
        bb.emit_func_output(both)
    mod = CacheSlotWrite(inplace=True)(bb.get())
    assert "call_tir_inplace" not in mod.script() and _rewritten(mod)
    rng = np.random.default_rng(6)
    data = rng.standard_normal(SHAPE).astype("float32")
    upd = rng.standard_normal((1, 2, 1, 3)).astype("float32")
    callers = tvm.runtime.tensor(data)
    got = _vm(mod)(callers, tvm.runtime.tensor(upd), tvm.runtime.tensor(np.array([1], np.int64)))
    want = data.copy()
    want[:, :, 1] = upd[:, :, 0]
    np.testing.assert_array_equal(got.numpy(), want + data)
    np.testing.assert_array_equal(callers.numpy(), data)


def test_a_view_of_a_cache_read_elsewhere_is_not_written_in_place():
    """The scatter writes a reshape of the cache (a view of the caller's tensor in the VM) and the
    cache is read again after it: the view is read once, but writing it in place would change
    what the later read sees (and the caller's tensor), so the injective kernel is used."""
    bb = relax.BlockBuilder()
    cache = relax.Var("cache", relax.TensorType((1, 8, 3), "float32"))
    new = relax.Var("new", relax.TensorType((1, 2, 1, 3), "float32"))
    position = relax.Var("position", relax.TensorType((1,), "int64"))
    with bb.function("main", [cache, new, position]):
        with bb.dataflow():
            view = bb.emit(relax.op.reshape(cache, SHAPE))
            slot = bb.emit(relax.op.multiply(position, _i64([0, 0, 1])))
            idx = bb.emit(relax.op.add(_i64(BASE), slot))
            out = bb.emit(relax.op.scatter_nd(view, idx, new))
            both = bb.emit_output(relax.op.add(relax.op.reshape(out, (1, 8, 3)), cache))
        bb.emit_func_output(both)
    mod = CacheSlotWrite(inplace=True)(bb.get())
    assert "call_tir_inplace" not in mod.script() and _rewritten(mod)
    rng = np.random.default_rng(7)
    data = rng.standard_normal((1, 8, 3)).astype("float32")
    upd = rng.standard_normal((1, 2, 1, 3)).astype("float32")
    callers = tvm.runtime.tensor(data)
    got = _vm(mod)(callers, tvm.runtime.tensor(upd), tvm.runtime.tensor(np.array([1], np.int64)))
    want = data.reshape(SHAPE).copy()
    want[:, :, 1] = upd[:, :, 0]
    np.testing.assert_array_equal(got.numpy(), want.reshape(1, 8, 3) + data)
    np.testing.assert_array_equal(callers.numpy(), data)


def test_in_place_decode_step_on_llvm_updates_the_callers_caches():
    """The imported reduced gpt2_decode (1 layer) with inplace=True on llvm (TVM's default build):
    both caches written by call_tir_inplace (the frontend's shape_of of the cache is no read), the
    caller's cache tensors ARE the present outputs and equal onnxruntime's."""
    from tvm_rammer.driver import frontend
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.run.runner import onnx_reference

    model = get_model("gpt2_decode", **{**REDUCED["gpt2_decode"], "layers": 1})
    mod = CacheSlotWrite(inplace=True)(frontend.import_onnx(model))
    assert mod["main"].script().count("R.call_tir_inplace") == 2
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([6], np.int64)}
    rng = np.random.default_rng(7)
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    ref = onnx_reference(model, feeds)
    args = [tvm.runtime.tensor(feeds[v.name]) for v in model.graph.input]
    logits, key, value = _vm(mod)(*args)
    assert key.same_as(args[2]) and value.same_as(args[3])
    np.testing.assert_allclose(logits.numpy(), ref[0], rtol=1e-4, atol=1e-5)
    for cache, want, old in zip(args[2:], ref[1:], (feeds["past_key_0"], feeds["past_value_0"])):
        np.testing.assert_allclose(cache.numpy(), want, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(cache.numpy(), old)  # written, at slot 6 only
        np.testing.assert_array_equal(np.delete(cache.numpy(), 6, axis=2), np.delete(old, 6, axis=2))


# The reduced decoders: one persistent kernel per step, on the emulator.

def _late(original, shift_axis_of):
    """``original`` (a kernel maker of cache_write) whose every cache write lands one slot later."""
    import tvm_ffi
    from tvm import te, tirx

    def copying(data, indices, updates, **spec):
        last = indices.shape[-1] - 1  # ScatterND's slot component only
        later = te.compute(indices.shape, lambda *i: indices(*i) + tirx.Select(
            i[-1] == last, tirx.const(1, "int64"), tirx.const(0, "int64")), name="later")
        return original(data, later, updates, **spec)

    def in_place(*types, **spec):
        func = original(*types, **spec)
        axis = spec["axis"]

        def shift(store):
            index = list(store.indices)
            index[axis] = index[axis] + 1
            return tirx.BufferStore(store.buffer, store.value, index)
        return func.with_body(tvm_ffi.structural_map(func.body, (tirx.BufferStore, shift)))

    return in_place if shift_axis_of == "inplace" else copying


def _emulated(name, cache_kind, monkeypatch=None, wrong_slot=False, inplace=True,
              attention_row=True):
    """(launches, relative errors of the outputs vs onnxruntime, whether each output cache IS the
    emulator's input cache array (written in place), {operator: (rTasks, threads)} of the
    cache writes in the rProgram)."""
    import json

    from tvm_rammer import RammerConfig
    from tvm_rammer.checks import emulator
    from tvm_rammer.checks.emulator.interpret import Interpreter
    from tvm_rammer.driver.report import REPORT_ATTR
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.numerics import relative_error
    from tvm_rammer.run.runner import onnx_reference

    if wrong_slot:  # negative control: every cache write lands one slot later
        which = "slot_write_inplace" if inplace else "slot_write"
        monkeypatch.setattr(cache_write, which, _late(getattr(cache_write, which),
                                                      "inplace" if inplace else "copy"))
    seen = {"args": [], "out": None}
    argument, call = Interpreter._argument, Interpreter.__call__

    def recorded_argument(self, param, value):
        seen["args"].append(argument(self, param, value))
        return seen["args"][-1]

    def recorded_call(self, *args, **kwargs):
        seen["out"] = call(self, *args, **kwargs)
        return seen["out"]

    model = get_model(name, cache_write=cache_kind, **REDUCED[name])
    rng = np.random.default_rng(3)
    feeds = {"input_ids": np.array([[5]], np.int64), "position": np.array([6], np.int64)}
    for value in model.graph.input[2:]:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Interpreter, "_argument", recorded_argument)
        patch.setattr(Interpreter, "__call__", recorded_call)
        result = emulator.emulate(model, feeds, config=RammerConfig(
            num_sms=2, veus_per_sm=2, inplace_cache=inplace, attention_row=attention_row))
    ref = onnx_reference(model, feeds)
    errors = [relative_error(o, r) for o, r in zip(result.outputs, ref)]
    written = [out is arg for out, arg in zip(seen["out"][1:], seen["args"][2:])]
    writes = {}
    for _, func in result.build.relax_mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None \
                and REPORT_ATTR in func.attrs:
            for op in json.loads(str(func.attrs[REPORT_ATTR]))["operators"]:
                if "cache_write" in op["name"]:
                    writes.setdefault(op["name"], set()).add((op["rtasks"], op["threads"]))
    return len(result.launches), errors, written, writes


def _need_compiler():
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")


@pytest.mark.slow
@pytest.mark.parametrize("name, cache_kind", [  # each model and each cache write once
    ("gpt2_decode", "scatter_nd"), ("llama_decode", "scatter_elements"),
])
def test_reduced_decode_step_is_one_launch_writing_its_caches_in_place(name, cache_kind):
    """Before the pass: 11 (gpt2) and 13 (llama) launches, each cache write 2 kernels of its own.
    With the pipeline's default (``inplace_cache``): one launch, the caches written in place by
    rTasks of the rProgram (each output cache IS the caller's cache array), as many rTasks as
    the update needs (one here: 64 or 32 elements), not the cache (1024 or 512 elements: 4 or 2
    rTasks of 256 threads), each write one kernel with the group computing its update
    (InPlaceWriteFusion: ``fused_..._cache_write``, no dependent step of its own), and every
    output equal to onnxruntime's."""
    _need_compiler()
    launches, errors, written, writes = _emulated(name, cache_kind)
    assert launches == 1
    assert max(errors) <= 1e-4, errors
    assert written and all(written), written
    assert writes and all(found == {(1, 256)} for found in writes.values()), writes
    assert all(n.startswith("fused_") and n.endswith("_cache_write") for n in writes), writes


@pytest.mark.slow
def test_the_copying_cache_write_leaves_the_callers_caches_alone():
    """Control of the in-place check: ``inplace_cache=False`` (the copying select over the whole
    cache: 4 rTasks of 256 threads for 1024 elements) matches onnxruntime too, in one launch,
    but no output cache is the caller's array."""
    _need_compiler()
    launches, errors, written, writes = _emulated("gpt2_decode", "scatter_nd", inplace=False)
    assert launches == 1 and max(errors) <= 1e-4, errors
    assert written and not any(written), written
    assert {rtasks for found in writes.values() for rtasks, _ in found} == {4}, writes


@pytest.mark.slow
@pytest.mark.parametrize("inplace", [True, False])
def test_a_cache_write_one_slot_late_is_detected_on_the_emulator(monkeypatch, inplace):
    """Negative control: the same step with every slot written at position + 1 differs from
    onnxruntime in the caches (and so in the logits where the attention reads the written caches,
    ``attention_row=False``: it reads the slot at position)."""
    _need_compiler()
    launches, errors, _, _ = _emulated("gpt2_decode", "scatter_nd", monkeypatch, wrong_slot=True,
                                       inplace=inplace, attention_row=False)
    assert launches == 1
    assert min(errors[1:]) > 1e-2 and errors[0] > 1e-4, errors


@pytest.mark.slow
def test_the_attention_reads_the_row_beside_a_late_write(monkeypatch):
    """With ``attention_row`` (the default) the attention reads the step's k and v from the QKV
    row at the slot the indices name, never the written cache slot: a write landing one slot late
    shows in the caches only, the logits stay onnxruntime's (the same late write changes them
    when the attention reads the written caches, the control above)."""
    _need_compiler()
    launches, errors, _, _ = _emulated("gpt2_decode", "scatter_nd", monkeypatch, wrong_slot=True)
    assert launches == 1
    assert min(errors[1:]) > 1e-2 and errors[0] <= 1e-4, errors
