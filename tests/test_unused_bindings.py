"""remove_unused_bindings: the dataflow bindings nothing reads go, transitively; outputs, match_casts
and non-dataflow blocks stay (Before/Expected, and the same result as TVM's remove_all_unused)."""
import tvm
from tvm import relax
from tvm.script import relax as R

from relay_passes.unused_bindings import remove_unused_bindings


@tvm.script.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4,), "float32"), y: R.Tensor(("n",), "float32")):
        with R.dataflow():
            dead0 = R.add(x, x)
            dead1 = R.multiply(dead0, x)            # read only by the dead dead2: goes too
            dead2 = R.exp(dead1)
            kept = R.add(x, R.const(1.0, "float32"))
            shaped = R.match_cast(y, R.Tensor((4,), "float32"))  # unused, but a match_cast: stays
            out = R.multiply(kept, kept)
            unused_output = R.add(x, x)              # a block output (not a DataflowVar): stays
            R.output(out, unused_output)
        return out


@tvm.script.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4,), "float32"), y: R.Tensor(("n",), "float32")):
        with R.dataflow():
            kept = R.add(x, R.const(1.0, "float32"))
            shaped = R.match_cast(y, R.Tensor((4,), "float32"))
            out = R.multiply(kept, kept)
            unused_output = R.add(x, x)
            R.output(out, unused_output)
        return out


def test_dead_chains_go_and_outputs_and_match_casts_stay():
    after = remove_unused_bindings(Before["main"])
    tvm.ir.assert_structural_equal(after, Expected["main"])


def test_nothing_unused_gives_the_same_function():
    tvm.ir.assert_structural_equal(remove_unused_bindings(Expected["main"]), Expected["main"])


def test_the_same_as_tvms_remove_all_unused_on_a_model():
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.models import REDUCED, get_model

    mod = import_onnx(get_model("lstm_tc", **REDUCED["lstm_tc"]))
    mod = relax.transform.LegalizeOps()(mod)
    main = mod["main"]
    bindings = list(main.body.blocks[0].bindings)
    # every third binding re-bound under a fresh, unread DataflowVar: dead copies of real work
    extra = [relax.VarBinding(relax.DataflowVar(f"dead{k}", b.var.ty), b.value)
             for k, b in enumerate(bindings[::3]) if isinstance(b, relax.VarBinding)]
    block = relax.DataflowBlock(bindings + extra)
    noisy = relax.BlockBuilder().normalize(relax.Function(
        main.params, relax.SeqExpr([block], main.body.body), main.ret_ty, main.is_pure, main.attrs))
    ours = remove_unused_bindings(noisy)
    assert len(ours.body.blocks[0].bindings) < len(block.bindings)
    tvm.ir.assert_structural_equal(ours, relax.analysis.remove_all_unused(noisy))
