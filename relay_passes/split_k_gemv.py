"""SplitKGEMV: a decode step's narrow GEMV becomes a partial product over row blocks and their sum.

A decode step is a chain of GEMVs ``x [1, K] @ W [K, N]``, one at a time. dlight's GEMV schedule
gives such an operator ``ceil(N / 16)`` rTasks (16 output columns each): GPT-2 small's attention
projection and fc2 (N = 768) get 48 rTasks on the H100's 528 vEUs, so 480 vEUs idle while the
weight streams in, and the cost model (each rTask its vEU's share of bandwidth) charges fc2 17.9 us
for 4.7 MB of fp16 weights. An operator's rTasks are independent, so splitting the reduction over
several rTasks needs two operators: here the K rows of W are cut into S blocks of ``K / S`` rows,

    y = matmul(x, W)   ->   p = call_tir(split_k_partial, [x, W'])   # [S, 1, N], S x the rTasks
                            y = sum(p, axis=0)                         # [1, N] (x's rank)

with ``W' = reshape(W, [S, K/S, N])`` a constant (W's own bytes; no copy of data: a reshape) and
``split_k_partial`` the batched GEMV ``p[s, 0, n] = sum_k x[.., s * K/S + k] * W'[s, k, n]``
(unscheduled TE; dlight's GEMV rule gives it S x ``N / 16`` rTasks), which reads x as it is: a
``reshape(x, [S, 1, K/S])`` in front of a batched ``matmul`` would be an operator of its own
(FuseOps joins no reshape to a LayerNorm before it), one more dependent step. The sum is a small
reduction that FuseOps joins with the GEMV's epilogue (bias, residual add, cast, GELU), which it
would have joined anyway. The weight bytes read are the same; ``S x N`` partial sums more are
written and read. The partials are accumulated in the matmul's ``out_dtype``, and in float32
where the result is float16 (then cast back once, after the sum). The summation order changes
(float rounding).

The one-operator form (``nt``, the pipeline's). Two dependent steps each cost a barrier and a
dependent rTask on the critical path; where a layout exists the chosen GEMV becomes one operator
instead, over the weight transposed once at compile time:

    y = matmul(x, W)   ->   y = call_tir(nt_gemv, [x, Wt])   # Wt = W^T [N, K], a constant

``nt_gemv`` is ``y[.., n] = sum_k x[.., k] * Wt[n, k]`` (accumulated as the partials are, float32
for float16, then cast once), a TE compute whose reduction block is annotated with ``r``, the
rows of Wt per rTask that ``tir_templates.nt_gemv.NTGEMV`` schedules (each row's K contiguous:
the lanes of whole warps read it in vectors and sum across threads): ``r`` the fewest rows that
divide N, give ``N / r`` rTasks within ``veus`` (one round: GPT-2 small's N 768 r 2, 384 rTasks;
Llama-1B's N 2048 r 4, 512) and lay ``threads / r`` lanes (whole warps) over K exactly
(:func:`nt_rows`). Its epilogue (bias, residual add, cast) and an elementwise prologue join it in
FuseOps as for any GEMV. With W a weight parameter, Wt is a ``permute_dims`` binding that
LiftWeightTransforms moves into ``transform_params``. Where no ``r`` exists (N over ``veus`` x
the warps of an rTask) the GEMV is split as above.

Which matmuls. ``relax.matmul(x, W)`` in a function's dataflow blocks with ``W`` a Constant (or a
weight parameter past ``num_input``, ``relay_passes.lift_weights``: then ``W'`` is a ``reshape``
binding on it, which LiftWeightTransforms moves into ``transform_params``) of static shape
``[K, N]`` (or a cast / transpose of a weight parameter: weights apart at precision float16,
a transposed weight; LiftWeightTransforms moves both), and ``x`` of static shape
``[1, ..., 1, K]`` (one row: M = 1, batch 1; never a GEMM), when the GEMVs that may run at the same time as it do not fill the vEUs: its *wave* (its own
estimated rTasks plus those of every matmul with a weight that is neither its ancestor nor its
descendant in the dataflow, estimated ``ceil(M / c) * ceil(N / c)``, ``c = columns_per_rtask``)
is below ``veus``. So an RNN's GEMVs, which its wavefront runs side by side (and whose recurrent
halves GEMVEpilogueFusion wants plain), are left alone; a decoder's chain of GEMVs is split. A
GEMV that shares its wave with another (parallel branches, Llama's Q, K, V) is split only with
``parallel``: the wave spreads over the vEUs with no step added, and what the model predicts for
splitting it is close (the 16-GEMV branches demo: 13.17 -> 13.06 us), a choice for a measurement;
the pipeline leaves them. S: the divisor of K (``K / S >= min_rows``) with the least time as
the cost model charges it (``scheduling.cost_model.rtask_time_us``: each rTask reads its share
of the weight at its vEU's share of ``mem_bw``, plus ``rtask_us``, in ``ceil(wave * S / veus)``
rounds), the smallest among equals; so one round of fewer rTasks than
the vEUs beats two rounds of a few more (GPT-2 small's fc2: S 8, 384 rTasks, 2.7 us; S 12, 576
rTasks, two rounds, 3.9 us). Only where it pays: that time falls by more than ``step_us``, the
dependent step the sum adds (the pipeline: a barrier and a dependent rTask). A small model's
GEMVs (the reduced test models') are left alone. With ``leave_norm_rows`` (the pipeline: when
NormGEMVFusion runs) a GEMV whose row is a row norm is left to that pass, which makes the norm
its prologue (no step of its own, and its schedule already has N / vec rTasks: GPT-2 small's QKV
576): a *row norm* is ``layer_norm`` / ``rms_norm``, or elementwise ops (casts, multiply, add,
divide, sqrt, rsqrt, power) over a ``mean`` / ``sum`` / ``variance`` of the last axis (an RMSNorm
as exported), within a few bindings of the row. Only where that pass can take it: the row within
its ``MAX_ROW_BYTES``, no output of the function, read by weight matmuls alone (a post-LN norm
also read by the residual add is split: the fusion leaves it a step of its own).

In: Relax with high-level ops, after ToMixedPrecision and FoldConstantOps (the weights constants
of their final dtype), before LegalizeOps. ``veus``: the vEUs to fill (``driver.pipeline``: the
vDevice's SMs x the vEUs per SM of an rTask of ``max_rtask_threads``), ``step_us``, ``rtask_us``
and ``mem_bw_gbps`` (the pipeline: the cost model's). Out: the same computation
with each chosen matmul replaced as above (``nt``: by the one operator where it has a layout);
the module unchanged when none is chosen.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te

from tir_templates.nt_gemv import NT_GEMV_ANNOTATION, nt_gemv_layout

from .known_values import static_shape
from .lift_weights import weight_params
from .norm_gemv import MAX_ROW_BYTES

__all__ = ["SplitKGEMV", "plan_splits", "nt_rows", "nt_gemv_func"]

MATMUL = tvm.ir.Op.get("relax.matmul")
CONSTANT = tvm.ir.expr.Constant


def _static_shape(expr):
    """Dims of a tensor expr as ints, or None when the shape is not static."""
    return static_shape(expr.ty)


def _is_matmul(value):
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
        and value.op.same_as(MATMUL)


def _weight_matmul(value, weights):
    """``(M, K, N)`` of ``matmul(x, W)`` with W a constant or weight parameter of static shape
    ``[K, N]`` and x of static shape ``[..., K]`` (M: the product of x's other dims), or None."""
    if not _is_matmul(value):
        return None
    x, w = value.args
    if not (isinstance(w, CONSTANT) or w in weights):
        return None
    w_shape, x_shape = _static_shape(w), _static_shape(x)
    if w_shape is None or x_shape is None or len(w_shape) != 2 or not x_shape \
            or x_shape[-1] != w_shape[0]:
        return None
    return int(np.prod(x_shape[:-1], dtype=np.int64)), w_shape[0], w_shape[1]


def _ceil(a, b):
    return -(-a // b)


def _gemv_us(nbytes, own, wave, s, veus, cost):
    """The cost model's time of a GEMV reading ``nbytes`` of weight in ``own * s`` rTasks whose
    wave has ``wave * s``: ``ceil(wave * s / veus)`` rounds of one rTask's read (its share of the
    bytes at its vEU's share of ``mem_bw_gbps`` GB/s = 1e3 bytes per us) and ``rtask_us``."""
    step_us, rtask_us, mem_bw_gbps = cost
    del step_us
    read = nbytes / (own * s) / (mem_bw_gbps * 1e3 / veus)
    return _ceil(wave * s, veus) * (read + rtask_us)


def _choose_s(k, nbytes, own, wave, veus, min_rows, cost):
    """The number of row blocks (module docstring), or None (no divisor, or no time saved)."""
    divisors = [s for s in range(2, k // max(min_rows, 1) + 1) if k % s == 0]
    if not divisors:
        return None
    best = min(divisors, key=lambda s: (_gemv_us(nbytes, own, wave, s, veus, cost), s))
    saved = _gemv_us(nbytes, own, wave, 1, veus, cost) - _gemv_us(nbytes, own, wave, best, veus,
                                                                   cost)
    return best if saved > cost[0] else None


_WEIGHT_TRANSFORMS = {"relax.astype", "relax.permute_dims"}
_NORMS = {"relax.nn.layer_norm", "relax.nn.rms_norm"}
_ROW_REDUCTIONS = {"relax.mean", "relax.sum", "relax.variance"}
_ELEMENTWISE = {"relax.astype", "relax.multiply", "relax.add", "relax.subtract", "relax.divide",
                "relax.sqrt", "relax.rsqrt", "relax.power"}


def _is_norm_row(expr, lookup, depth: int = 8) -> bool:
    """``expr`` (a var) is a row norm (module docstring), following at most ``depth`` bindings."""
    if depth <= 0 or not isinstance(expr, relax.Var):
        return False
    value = lookup(expr)
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return False
    name = value.op.name
    if name in _NORMS:
        return True
    if name in _ROW_REDUCTIONS:
        axes = value.attrs.axis
        rank = len(_static_shape(value.args[0]) or ())
        return axes is not None and rank > 0 and [int(a) % rank for a in axes] == [rank - 1]
    if name in _ELEMENTWISE:
        return any(_is_norm_row(arg, lookup, depth - 1) for arg in value.args)
    return False


def _fusable_norm_row(x, k, readers, values, outputs) -> bool:
    """``x`` (a matmul's row, K values) is a row norm NormGEMVFusion can take: a row norm whose
    normalised row fits ``MAX_ROW_BYTES``, not an output of the function, read only as the row of
    weight matmuls (a norm also read by a residual add, as in a post-LN block, stays a step of its
    own there, so its GEMVs are split)."""
    if not isinstance(x, relax.Var) or x in outputs or not _is_norm_row(x, values.get):
        return False
    if k * np.dtype(str(x.ty.dtype)).itemsize > MAX_ROW_BYTES:
        return False
    return all(_is_matmul(values[r]) and values[r].args[0].same_as(x)
               and not values[r].args[1].same_as(x) for r in readers.get(x, ()))


def plan_splits(func: relax.Function, veus: int, columns_per_rtask: int = 16,
                min_rows: int = 32, step_us: float = 0.0, mem_bw_gbps: float = 3000.0,
                rtask_us: float = 0.0, leave_norm_rows: bool = False,
                parallel: bool = False) -> dict:
    """{matmul Call: S} for the GEMVs of ``func`` to split (module docstring); {} when none."""
    weights = set(weight_params(func))
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return {}
    bindings = [b for block in body.blocks for b in block.bindings]
    for b in bindings:  # a weight's cast / transpose (ToMixedPrecision's) is a weight too
        value = b.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
                and value.op.name in _WEIGHT_TRANSFORMS and value.args[0] in weights:
            weights.add(b.var)
    matmuls = []  # (binding index, call, M, K, N)
    for n, binding in enumerate(bindings):
        found = _weight_matmul(binding.value, weights)
        if found is not None:
            matmuls.append((n, binding.value, *found))
    if not any(m == 1 and _ceil(nn, columns_per_rtask) < veus for _, _, m, _, nn in matmuls):
        return {}
    # ancestors of every binding, as a bitset over the matmuls (bit j: matmuls[j])
    bit = {n: 1 << j for j, (n, *_) in enumerate(matmuls)}
    position = {b.var: n for n, b in enumerate(bindings)}
    ancestors = [0] * len(bindings)
    readers = {}  # var -> the vars of the bindings reading it
    for n, binding in enumerate(bindings):
        acc = 0
        for var in relax.analysis.free_vars(binding.value):
            readers.setdefault(var, []).append(binding.var)
            d = position.get(var)
            if d is not None:
                acc |= ancestors[d] | bit.get(d, 0)
        ancestors[n] = acc
    outputs = set(relax.analysis.free_vars(body.body))
    rtasks = [_ceil(m, columns_per_rtask) * _ceil(nn, columns_per_rtask)
              for _, _, m, _, nn in matmuls]
    values = {b.var: b.value for b in bindings}
    plan = {}
    for j, (n, call, m, k, nn) in enumerate(matmuls):
        if m != 1 or k == 0 or nn == 0 or rtasks[j] >= veus:  # zero-size: nothing to read
            continue
        if leave_norm_rows and _fusable_norm_row(call.args[0], k, readers, values, outputs):
            continue
        wave = rtasks[j]
        for i, (other, *_) in enumerate(matmuls):
            if i != j and not ancestors[n] >> i & 1 and not ancestors[other] >> j & 1:
                wave += rtasks[i]
                if wave >= veus or not parallel:
                    break
        if wave >= veus or (wave > rtasks[j] and not parallel):
            continue
        nbytes = k * nn * np.dtype(str(call.args[1].ty.dtype)).itemsize
        s = _choose_s(k, nbytes, rtasks[j], wave, veus, min_rows,
                      (step_us, rtask_us, mem_bw_gbps))
        if s is not None:
            plan[call] = s
    return plan


def partial_func(x_shape, s: int, n: int, in_dtype: str, out_dtype: str, block_shift: int = 0,
                 w_dtype: str | None = None):
    """The partial GEMV over ``s`` row blocks: ``x`` of shape ``x_shape`` ``[1, ..., 1, K]``
    (``in_dtype``), ``w`` ``[s, K/s, n]`` (``w_dtype``, default ``in_dtype``: a matmul with an
    out_dtype may take two) -> ``p [s, 1, n]`` with ``p[b, 0, j] = sum_k x[.., b * K/s + k] *
    w[b, k, j]``, accumulated in ``out_dtype`` (inputs cast to it, as a legalized matmul with an
    out_dtype). A PrimFunc (unscheduled). ``block_shift`` (tests' negative control only): W's
    block b meets x's block ``(b + block_shift) mod s``."""
    w_dtype = w_dtype or in_dtype
    rows = int(x_shape[-1]) // s
    i64 = [tvm.tirx.IntImm("int64", d) for d in (s, rows, n, 1)]  # as legalized operators' buffers
    x = te.placeholder([tvm.tirx.IntImm("int64", int(d)) for d in x_shape], in_dtype, name="x")
    w = te.placeholder(i64[:3], w_dtype, name="w")
    k = te.reduce_axis((tvm.tirx.IntImm("int64", 0), i64[1]), name="k")
    lead = [tvm.tirx.IntImm("int64", 0)] * (len(x_shape) - 1)

    def block(b):
        return (b + block_shift) % i64[0] if block_shift else b

    def cast(value):
        return value if value.dtype == out_dtype else value.astype(out_dtype)

    p = te.compute((i64[0], i64[3], i64[2]), lambda b, i, j: te.sum(
        cast(x[(*lead, block(b) * rows + k)]) * cast(w[b, k, j]), axis=k), name="split_k_partial")
    return te.create_prim_func([x, w, p]).without_attr("global_symbol")  # named by its module


def nt_rows(n: int, k: int, itemsize: int, veus: int, threads: int = 256) -> int | None:
    """Rows of Wt per rTask of the one-operator form (module docstring): the fewest (so the most
    rTasks, ``N / r``) that divide N, fit one round of ``veus`` and have a layout of whole warps
    of ``threads`` over K (``tir_templates.nt_gemv.nt_gemv_layout``); None when none does."""
    rows = 1
    while rows <= threads // 32:
        if n % rows == 0 and n // rows <= veus and nt_gemv_layout(k, rows, itemsize, threads):
            return rows
        rows *= 2
    return None


def nt_gemv_func(x_shape, n: int, rows: int, in_dtype: str, out_dtype: str,
                 w_dtype: str | None = None):
    """The GEMV over a transposed weight: ``x`` of shape ``x_shape`` ``[1, ..., 1, K]``
    (``in_dtype``), ``wt`` ``[n, K]`` (``w_dtype``, default ``in_dtype``) -> ``y [1, ..., 1, n]``
    with ``y[.., j] = sum_k x[.., k] * wt[j, k]``, accumulated in ``out_dtype`` (inputs cast to
    it). Its reduction block is annotated ``NT_GEMV_ANNOTATION = rows`` (the schedule's rows of wt
    per rTask, ``tir_templates.nt_gemv``). A PrimFunc (unscheduled)."""
    w_dtype = w_dtype or in_dtype
    i64 = lambda d: tvm.tirx.IntImm("int64", int(d))  # noqa: E731  (as legalized buffers)
    x = te.placeholder([i64(d) for d in x_shape], in_dtype, name="x")
    wt = te.placeholder([i64(n), i64(x_shape[-1])], w_dtype, name="wt")
    k = te.reduce_axis((i64(0), i64(x_shape[-1])), name="k")

    def cast(value):
        return value if value.dtype == out_dtype else value.astype(out_dtype)

    y = te.compute([i64(d) for d in x_shape[:-1]] + [i64(n)], lambda *idx: te.sum(
        cast(x[(*idx[:-1], k)]) * cast(wt[idx[-1], k]), axis=k), name="nt_gemv",
        attrs={NT_GEMV_ANNOTATION: int(rows)})
    return te.create_prim_func([x, wt, y]).without_attr("global_symbol")  # named by its module


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Replaces the planned matmuls; W's blocks shared by every matmul of the same W and S."""

    def __init__(self, mod):
        super().__init__(mod)
        self.plan = {}
        self.blocks = {}
        self.funcs = {}
        self.rewrites = 0
        self.nt = None  # (veus, threads) of the one-operator form; None: split-K only

    def _partial(self, x_shape, s, n, in_dtype, out_dtype, w_dtype):
        key = (tuple(x_shape), s, n, in_dtype, out_dtype, w_dtype)
        if key not in self.funcs:
            self.funcs[key] = self.builder_.add_func(
                partial_func(x_shape, s, n, in_dtype, out_dtype, w_dtype=w_dtype),
                "split_k_partial")
        return self.funcs[key]

    def _weight_blocks(self, weight, s):
        key = (weight, s)
        if key not in self.blocks:
            k, n = _static_shape(weight)
            if isinstance(weight, CONSTANT):
                data = weight.value.numpy()
                self.blocks[key] = relax.const(data.reshape(s, k // s, n), str(data.dtype))
            else:  # a weight parameter: LiftWeightTransforms moves the reshape out
                self.blocks[key] = self.builder_.emit(relax.op.reshape(weight, [s, k // s, n]))
        return self.blocks[key]

    def _transposed(self, weight):
        key = (weight, "T")
        if key not in self.blocks:
            if isinstance(weight, CONSTANT):
                data = weight.value.numpy()
                self.blocks[key] = relax.const(np.ascontiguousarray(data.T), str(data.dtype))
            else:  # a weight parameter: LiftWeightTransforms moves the transpose out
                self.blocks[key] = self.builder_.emit(relax.op.permute_dims(weight, [1, 0]))
        return self.blocks[key]

    def _nt_gemv(self, x, weight, out_shape, acc, dtype):
        """The one-operator form of the module docstring, or None where it has no layout."""
        k, n = _static_shape(weight)
        w_dtype = str(weight.ty.dtype)
        rows = nt_rows(n, k, np.dtype(w_dtype).itemsize, *self.nt)
        if rows is None:
            return None
        key = ("nt", tuple(_static_shape(x)), n, rows, str(x.ty.dtype), acc, w_dtype)
        if key not in self.funcs:
            self.funcs[key] = self.builder_.add_func(
                nt_gemv_func(_static_shape(x), n, rows, str(x.ty.dtype), acc, w_dtype), "nt_gemv")
        shape = list(_static_shape(x)[:-1]) + [n]
        total = relax.call_tir(self.funcs[key], [x, self._transposed(weight)],
                               relax.TensorType(shape, acc))
        if acc != dtype:
            total = relax.op.astype(self.builder_.emit(total), dtype)
        if list(out_shape) != shape:
            total = relax.op.reshape(self.builder_.emit(total), out_shape)
        return total

    def visit_call_(self, call):
        s = self.plan.get(call)
        new = super().visit_call_(call)
        if s is None:
            return new
        x, weight = new.args
        _, n = _static_shape(weight)
        out_shape = _static_shape(call)
        dtype = str(call.ty.dtype)
        acc = "float32" if dtype == "float16" else dtype
        if self.nt is not None:
            total = self._nt_gemv(x, weight, out_shape, acc, dtype)
            if total is not None:
                self.rewrites += 1
                return self.builder_.normalize(total)
        func = self._partial(_static_shape(x), s, n, str(x.ty.dtype), acc, str(weight.ty.dtype))
        partial = self.builder_.emit(relax.call_tir(
            func, [x, self._weight_blocks(weight, s)], relax.TensorType((s, 1, n), acc)))
        total = relax.op.sum(partial, axis=[0], keepdims=len(out_shape) == 3)
        if acc != dtype:
            total = relax.op.astype(self.builder_.emit(total), dtype)
        if len(out_shape) not in (2, 3):
            total = relax.op.reshape(self.builder_.emit(total), out_shape)
        self.rewrites += 1
        return self.builder_.normalize(total)


@tvm.transform.module_pass(opt_level=0, name="SplitKGEMV")
class SplitKGEMV:
    """Split the reduction of every narrow decode-step GEMV over S row blocks (module docstring).

    ``veus``: the vEUs a GEMV's rTasks should fill; ``columns_per_rtask``: output columns per rTask
    of the unsplit GEMV's schedule (dlight's GEMV rule: 16); ``min_rows``: fewest rows of W per
    block; ``step_us``: the least time a split must save (0: any); ``rtask_us``: the cost
    model's overhead per rTask; ``mem_bw_gbps``: the bandwidth the weight's read is charged at;
    ``leave_norm_rows``: leave a GEMV whose row is a row norm to NormGEMVFusion; ``parallel``:
    split a GEMV that shares its wave with others too; ``nt``: make a chosen GEMV the one
    operator over the transposed weight where it has a layout (``threads`` a rTask), split-K
    where not."""

    def __init__(self, veus: int, columns_per_rtask: int = 16, min_rows: int = 32,
                 step_us: float = 0.0, mem_bw_gbps: float = 3000.0, rtask_us: float = 0.0,
                 leave_norm_rows: bool = False, parallel: bool = False, nt: bool = False,
                 threads: int = 256):
        if veus < 1 or columns_per_rtask < 1 or min_rows < 1:
            raise ValueError(f"SplitKGEMV(veus={veus}, columns_per_rtask={columns_per_rtask}, "
                             f"min_rows={min_rows}): each must be >= 1")
        if not step_us >= 0 or not rtask_us >= 0 or not mem_bw_gbps > 0:
            raise ValueError(f"SplitKGEMV(step_us={step_us}, rtask_us={rtask_us}, mem_bw_gbps="
                             f"{mem_bw_gbps}): use times >= 0 and mem_bw_gbps > 0")
        self.veus, self.columns_per_rtask, self.min_rows = veus, columns_per_rtask, min_rows
        self.step_us, self.mem_bw_gbps, self.rtask_us = step_us, mem_bw_gbps, rtask_us
        self.leave_norm_rows, self.parallel = leave_norm_rows, parallel
        self.nt, self.threads = nt, threads

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the planned matmuls of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod)
        rewriter.nt = (self.veus, self.threads) if self.nt else None
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            plan = plan_splits(func, self.veus, self.columns_per_rtask, self.min_rows,
                               self.step_us, self.mem_bw_gbps, self.rtask_us,
                               self.leave_norm_rows, self.parallel)
            if not plan:
                continue
            rewriter.plan = plan
            rewriter.blocks = {}
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get() if rewriter.rewrites else mod
