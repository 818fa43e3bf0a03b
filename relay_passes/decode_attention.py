"""DecodeAttentionSplit: a decode step's masked attention over a static KV cache becomes two calls,
a partial pass over the cache split into chunks and bounded by the position, and a combine
(flash-decoding; the kernels are ``tir_templates.decode_attention``'s).

Input: Relax with high-level ops (before LegalizeOps). The pattern, as HF's static-cache export
imports (``tvm_rammer.models.transformers._attend`` / ``_decode_mask``), every piece checked::

    kt     = permute_dims(K, axes=[0, 1, 3, 2])          K [B, H, L, D], or the GQA repeat below
    scores = matmul(q, kt)                               q [B, H, 1, D]: one query token
    scaled = divide(scores, c) | multiply(scores, c)     c a float constant of one element, or a
             (either operand order for multiply;     cast of one (ToMixedPrecision's
             or no scale)                            ``astype(const(4.0, "float32"), "float16")``)
    mask   = where(greater(R, pos), m, z)                R the int constant 0, 1, ..., L-1 (shape
                                                         [L]); pos an int64 tensor of one element;
                                                         m = finfo(dtype).min of m's own dtype,
                                                         z = 0 (constants)
    probs  = softmax(add(scaled, mask), axis=-1)         (either operand order for add)
    out    = matmul(probs, V)                            V [B, H, L, D] or the GQA repeat

    GQA repeat: reshape(broadcast_to(expand_dims(Kc, axis=2), [B, Hkv, n, L, D]), [B, Hkv n, L, D])
    of a cache Kc [B, Hkv, L, D] (HF's repeat_kv): the kernels read Kc with head h -> h // n.

Dtypes: float32 or float16 (q, the caches, the mask, the result: each its own). Between any two
steps above, and on K, V and the repeat's steps, casts from one float dtype to another
(``astype``) are passed through: a float16 export's Llama (``astype(softmax(astype(x,
"float32")), "float16")``, HF's upcast softmax) and a float32 export under ``precision="float16"``
(ToMixedPrecision: ``astype(matmul(q16, astype(K32ᵀ, "float16"), out_dtype="float32"),
"float16")``, the score cast up again before the float32 mask, the probabilities and V cast
down). The kernels read q as the graph gives it to the scores matmul, the caches before any cast
(float32 caches under ToMixedPrecision: no float16 copy of the whole cache is made any more), and
compute in float32; ``out`` keeps the matmul's dtype (its ``out_dtype``). ``mask`` may be the same
tensor for every layer. Output: ``out`` replaced by ``call_tir(combine, [call_tir(partial, [q, Kc,
Vc, pos]), pos])``; the bindings only the attention read are dropped.

What the rewrite relies on, and the pattern proves: the mask is 0 at slots ``<= pos`` and
``finfo.min`` after, added to every score row, so softmax gives the slots past ``pos`` weight 0:
``exp(s + finfo.min - max)`` is 0 in float32 for any finite score in float32, and for scores of
magnitude below ~32000 in float16 (``s - 65504`` is then below every unmasked score by more than
float32's ``exp`` underflow; past 65504 it is ``-inf``). For ``pos < 0`` every slot's score is
``finfo.min``, a uniform softmax in float32, which the kernels compute with scores 0 (in float16,
``s - 65504`` keeps some of the scores' differences: a negative position, which no decode step
has, is matched in float32 only). Results change by float rounding only: the softmax's sum is
taken in another order, and the casts' roundings of the scores and probabilities to float16 are
not made (the kernels keep float32 from the cache to the result).

Declined (the graph left as it is): any other mask (another constant than its dtype's finfo.min,
a range that is not 0..L-1, ``greater_equal``, a mask not broadcast along the last axis only), no
mask, a position that is not one int64 element, a weight parameter where a constant is required
(its value cannot be checked), several query tokens, dtypes other than float32 / float16 (or K
and V of two dtypes), symbolic shapes. A cast to or from an integer is not passed through (the
pattern must then hold without it). With the weights apart (``RammerConfig(weights="apart")``)
the scale and the mask's two constants are initializers, so weight parameters: declined.

``threads``: the vEU width the rProgram allows (``RammerConfig.max_rtask_threads``): where it
is given and the head dim is a multiple of 32, phase 1 is a warp per slot with ``threads // 32``
warps (``tir_templates.decode_attention.warp_partial_func``); else a thread per slot (the
kernels' default without warps). ``veus``: the vEUs to fill (SMs x vEUs per SM of an rTask of
``threads``); given, the chunk is :func:`chunk_to_fill`'s (one round of rTasks, as many as fit);
``chunk``: slots per chunk, overriding both (None and no ``veus``:
``tir_templates.decode_attention.chunk_for(L)``). ``fold_consumers``: the combine's only reader,
when it is a cast from float32 (or to the combine's own dtype), the transpose ``permute_dims(x,
[0, 2, 1, 3])`` of the one token's heads or a reshape to ``[B, 1, H, D]`` / ``[B, 1, H * D]`` /
``[B, H, 1, D]``, becomes the combine storing that dtype and layout (repeatedly: HF's ``astype``,
``transpose``, ``reshape`` after the attention become no kernel; the elements keep their order,
and the combine rounds its float32 result once, as the cast did).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax

from tir_templates.decode_attention import (KIND_ATTR, DecodeAttentionShape, chunk_for,
                                            combine_func, partial_func)

from .known_values import is_op as _is_op
from .known_values import static_dims as _shape
from .unused_bindings import remove_unused_bindings

__all__ = ["DecodeAttentionSplit", "chunk_to_fill"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
CONSTANT = tvm.ir.expr.Constant
FLOATS = ("float32", "float16")
MASK_MIN = {dtype: np.finfo(dtype).min for dtype in FLOATS}


def _dtype(expr):
    return str(getattr(expr.ty, "dtype", ""))


def _ints(values):
    return [int(v) for v in values]


def _scalar(expr):
    """The value of a float constant of one element (float32 or float16), or None."""
    if not isinstance(expr, CONSTANT) or _dtype(expr) not in FLOATS:
        return None
    data = expr.value.numpy()
    return data.reshape(-1)[0] if data.size == 1 else None


def chunk_to_fill(rows: int, max_len: int, veus: int, least: int = 1) -> int:
    """Slots per chunk (a power of two, ``least`` at least, e.g. one slot per warp) for ``rows``
    (batch x heads) attentions over ``max_len`` slots: the smallest, i.e. the most rTasks ``rows x
    ceil(max_len / chunk)``, that does not exceed ``veus`` (one round of rTasks); a chunk that
    holds every slot when even one chunk per row exceeds them."""
    chunk = 1
    while chunk < least:
        chunk *= 2
    while chunk < max_len and rows * -(-max_len // chunk) > veus:
        chunk *= 2
    return chunk


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Finds the pattern (module docstring) at every ``matmul(probs, V)``."""

    def __init__(self, mod, chunk, veus=None, threads=None):
        super().__init__(mod)
        self.chunk = chunk
        self.veus = veus
        self.threads = threads
        self.rewrites = 0
        self.combines = {}  # combine GlobalVar -> its shape

    def _layout(self, batch, heads, length, dim):
        """(chunk, warps) of an attention of this shape (module docstring)."""
        warps = self.threads // 32 if self.threads and dim % 32 == 0 else 0
        if self.chunk:
            return self.chunk, warps
        if self.veus is None:
            return chunk_for(length), warps
        return chunk_to_fill(batch * heads, length, self.veus, max(warps, 1)), warps

    def _bound(self, expr, name):
        """The call ``expr`` (a var) is bound to, when it is a call of op ``name``, looking through
        float-to-float casts; else None."""
        expr = self._uncast(expr)
        if not isinstance(expr, relax.Var):
            return None
        value = self.lookup_binding(expr)
        return value if _is_op(value, name) else None

    def _uncast(self, expr):
        """``expr`` with the float-to-float casts (``astype``) it is bound to passed through: the
        first value that is not such a cast."""
        while isinstance(expr, relax.Var) and _dtype(expr) in FLOATS:
            value = self.lookup_binding(expr)
            if not _is_op(value, "astype") or _dtype(value.args[0]) not in FLOATS:
                return expr
            expr = value.args[0]
        return expr

    def _constant(self, expr):
        """The value of a one-element float constant, or of a float cast of one (rounded to the
        cast's dtype, as the graph computes it); else None."""
        value = _scalar(expr)
        if value is not None or not isinstance(expr, relax.Var):
            return value
        cast = self.lookup_binding(expr)
        if not _is_op(cast, "astype") or _dtype(cast) not in FLOATS:
            return None
        value = _scalar(cast.args[0])
        return None if value is None else np.asarray(value).astype(_dtype(cast)).item()

    def _cache(self, x, want):
        """(cache, kv heads) of a [B, H, L, D] operand: itself, or the cache its GQA repeat
        repeats; None when it is neither."""
        if _shape(x) != want:
            return None
        reshape = self._bound(x, "reshape")
        if reshape is None:
            return self._uncast(x), want[1]
        bcast = self._bound(reshape.args[0], "broadcast_to")
        expand = None if bcast is None else self._bound(bcast.args[0], "expand_dims")
        if expand is None or _ints(expand.attrs.axis) != [2]:
            return None
        cache = self._uncast(expand.args[0])
        b, h, length, d = want
        c_shape = _shape(cache)
        if c_shape is None or len(c_shape) != 4 or c_shape[0] != b or c_shape[2:] != [length, d]:
            return None
        kv = c_shape[1]
        if h % kv or _shape(bcast) != [b, kv, h // kv, length, d]:
            return None
        return cache, kv

    def _mask(self, mask, length):
        """The position tensor when ``mask`` is where(greater(0..L-1, pos), finfo.min, 0) broadcast
        along the last axis only; else None."""
        where = self._bound(mask, "where")
        m_shape = _shape(mask)
        if where is None or m_shape is None or not m_shape or m_shape[-1] != length \
                or any(d != 1 for d in m_shape[:-1]) or _dtype(mask) not in FLOATS:
            return None
        low = where.args[1]
        if _scalar(low) is None or _scalar(low) != MASK_MIN[_dtype(low)] \
                or _scalar(where.args[2]) != 0:
            return None
        greater = self._bound(where.args[0], "greater")
        if greater is None:
            return None
        slots, pos = greater.args
        if not isinstance(slots, CONSTANT) or _dtype(slots) not in ("int32", "int64"):
            return None
        values = slots.value.numpy()
        if values.shape != (length,) or not np.array_equal(values, np.arange(length)):
            return None
        p_shape = _shape(pos)
        if _dtype(pos) != "int64" or p_shape not in ([], [1]):
            return None
        return pos

    def _scores(self, scaled):
        """(scores, scale, divide) of ``scaled``: divide / multiply by a constant, or none."""
        for name, divide in (("divide", True), ("multiply", False)):
            call = self._bound(scaled, name)
            if call is None:
                continue
            a, b = call.args
            if self._constant(b) is not None:
                return a, float(self._constant(b)), divide
            if not divide and self._constant(a) is not None:
                return b, float(self._constant(a)), divide
            return None
        return scaled, 1.0, False

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not _is_op(call, "matmul"):
            return call
        found = self._match(call)
        if found is None:
            return call
        q, k_cache, v_cache, pos, shape = found
        partial = self.builder_.add_func(partial_func(shape), "decode_attention_partial")
        combine = self.builder_.add_func(combine_func(shape), "decode_attention_combine")
        b, h, d, nc = shape.batch, shape.heads, shape.head_dim, shape.chunks
        part = self.builder_.emit(relax.call_tir(
            partial, [q, k_cache, v_cache, pos], relax.TensorType((b, h, nc, d + 2), "float32")))
        self.rewrites += 1
        self.combines[combine] = shape
        return relax.call_tir(combine, [part, pos],
                              relax.TensorType((b, h, 1, d), shape.out_dtype))

    def _match(self, out):
        probs, v = out.args
        softmax = self._bound(probs, "nn.softmax")
        if softmax is None or int(softmax.attrs.axis) not in (-1, 3):
            return None
        add = self._bound(softmax.args[0], "add")
        if add is None:
            return None
        for scaled, mask in (add.args, reversed(add.args)):
            p_shape = _shape(probs)
            if p_shape is None or len(p_shape) != 4 or p_shape[2] != 1:
                return None
            pos = self._mask(mask, p_shape[3])
            if pos is not None and _shape(scaled) == p_shape:
                break
        else:
            return None
        scores_scale = self._scores(scaled)
        if scores_scale is None:
            return None
        scores, scale, divide = scores_scale
        mm = self._bound(scores, "matmul")
        if mm is None or mm.attrs.out_dtype not in (None, "", "void", *FLOATS):
            return None
        q, kt = mm.args
        perm = self._bound(kt, "permute_dims")
        if perm is None or perm.attrs.axes is None or _ints(perm.attrs.axes) != [0, 1, 3, 2]:
            return None
        q_shape = _shape(q)
        if q_shape is None or len(q_shape) != 4 or q_shape[2] != 1:
            return None
        bsz, heads, _, dim = q_shape
        length = p_shape[3]
        want = [bsz, heads, length, dim]
        k = self._cache(perm.args[0], want)
        vv = self._cache(v, want)
        if k is None or vv is None or k[1] != vv[1] or _shape(out) != [bsz, heads, 1, dim]:
            return None
        if any(_dtype(x) not in FLOATS for x in (q, k[0], vv[0], scores, out)) \
                or _dtype(k[0]) != _dtype(vv[0]):
            return None
        chunk, warps = self._layout(bsz, heads, length, dim)
        shape = DecodeAttentionShape(bsz, heads, k[1], length, dim, chunk, scale, divide,
                                     len(_shape(pos)), _dtype(q), _dtype(k[0]), _dtype(out),
                                     warps)
        return q, k[0], vv[0], pos, shape


def _uses(func):
    """How many bindings (and the function's result) read each var of ``func``."""
    uses = {}
    exprs = [b.value for block in func.body.blocks for b in block.bindings] + [func.body.body]
    for expr in exprs:
        for var in relax.analysis.free_vars(expr):
            uses[var] = uses.get(var, 0) + 1
    return uses


_LAYOUT_OF_SHAPE = {  # out_layout by the result's shape (module docstring of the kernels)
    "": lambda b, h, d: [b, h, 1, d], "b1hd": lambda b, h, d: [b, 1, h, d],
    "b1x": lambda b, h, d: [b, 1, h * d]}


@relax.expr_functor.mutator
class _Folder(relax.PyExprMutator):
    """A combine's only reader that is a cast from float32 (or to its own dtype), the transpose
    ``permute_dims(x, [0, 2, 1, 3])`` of one token's heads, or a reshape to ``[B, 1, H, D]``,
    ``[B, 1, H * D]`` or ``[B, H, 1, D]`` becomes the combine itself, storing that dtype and
    layout (the same elements in the same order; the combine computes in float32 and rounds once,
    as the cast of its float32 result does)."""

    def __init__(self, mod, combines, uses):
        super().__init__(mod)
        self.combines = combines
        self.uses = uses
        self.folds = 0

    def _folded(self, call):
        """(combine GlobalVar, its shape, its args) of the combine call ``call``'s input is bound
        to when that input is read once; else None."""
        x = call.args[0]
        if not isinstance(x, relax.Var) or self.uses.get(x, 0) != 1:
            return None
        value = self.lookup_binding(x)
        if not isinstance(value, relax.Call) or not value.op.same_as(_CALL_TIR) \
                or value.args[0] not in self.combines:
            return None
        return value.args[0], self.combines[value.args[0]], list(value.args[1].fields)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        names = [n for n in ("astype", "permute_dims", "reshape") if _is_op(call, n)]
        found = self._folded(call) if names else None
        if found is None:
            return call
        _, shape, args = found
        new = None
        if names == ["astype"] and _dtype(call) in FLOATS \
                and shape.out_dtype in ("float32", _dtype(call)):
            new = dataclasses.replace(shape, out_dtype=_dtype(call))
        elif names == ["permute_dims"] and call.attrs.axes is not None \
                and _ints(call.attrs.axes) == [0, 2, 1, 3] and shape.out_layout == "":
            new = dataclasses.replace(shape, out_layout="b1hd")
        elif names == ["reshape"]:
            want = _shape(call)
            layouts = [k for k, f in _LAYOUT_OF_SHAPE.items()
                       if f(shape.batch, shape.heads, shape.head_dim) == want]
            new = dataclasses.replace(shape, out_layout=layouts[0]) if layouts else None
        if new is None:
            return call
        combine = self.builder_.add_func(combine_func(new), "decode_attention_combine")
        self.combines[combine] = new
        self.folds += 1
        return relax.call_tir(combine, args, relax.TensorType(list(new.out_shape),
                                                              new.out_dtype))


def without_uncalled(mod, kind: str):
    """``mod`` without the PrimFuncs of ``kind`` ("partial" / "combine": their ``KIND_ATTR``)
    that no Relax function calls any more (a call anywhere in the function: a branch of an
    ``If`` too)."""
    called = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            called.update(relax.analysis.all_global_vars(func))
    keep = {gv: f for gv, f in mod.functions_items()
            if gv in called or not isinstance(f, tvm.tirx.PrimFunc) or f.attrs is None
            or str(f.attrs.get(KIND_ATTR, "")) != kind}
    return tvm.IRModule(keep, attrs=mod.attrs, global_infos=mod.global_infos)


@tvm.transform.module_pass(opt_level=0, name="DecodeAttentionSplit")
class DecodeAttentionSplit:
    """Replace each masked decode attention over a static cache by the split kernels (see the
    module docstring: ``chunk``, ``veus``, ``threads``). Run on high-level Relax, before
    LegalizeOps."""

    def __init__(self, chunk: int | None = None, veus: int | None = None,
                 threads: int | None = None, fold_consumers: bool = False):
        for name, value in (("chunk", chunk), ("veus", veus)):
            if value is not None and value < 1:
                raise ValueError(f"DecodeAttentionSplit: {name}={value} must be positive")
        if threads is not None and (threads < 32 or threads % 32):
            raise ValueError(f"DecodeAttentionSplit: threads={threads} must be a positive "
                             "multiple of 32 (whole warps)")
        self.chunk, self.veus, self.threads = chunk, veus, threads
        self.fold_consumers = bool(fold_consumers)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.chunk, self.veus, self.threads)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                before = rewriter.rewrites
                new = rewriter.visit_expr(func)
                if rewriter.rewrites > before:
                    rewriter.builder_.update_func(gv, remove_unused_bindings(new))
        if not rewriter.rewrites:
            return mod
        mod = rewriter.builder_.get()
        if not self.fold_consumers:
            return mod
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                folder = _Folder(mod, rewriter.combines, _uses(func))
                new = folder.visit_expr(func)
                if folder.folds:
                    mod = folder.builder_.get()
                    mod.update_func(gv, remove_unused_bindings(new))
        return without_uncalled(mod, "combine")
