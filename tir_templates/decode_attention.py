"""Decode attention split over the KV length (flash-decoding), bounded by the current position.

One query token attends to a static cache of ``L`` slots of which only ``0..position`` count
(``relay_passes.decode_attention.DecodeAttentionSplit`` makes the calls). Two operators, two
rOperators, the second reading what the first writes:

1. :func:`partial_func` ``(q [B, H, 1, D], K [B, Hkv, L, D], V [B, Hkv, L, D], pos [P] int64)
   -> part [B, H, NC, D + 2]`` float32, ``NC = ceil(L / chunk)``, q of ``q_dtype``, K and V of
   ``kv_dtype`` (float32 or float16: read as they are, every product and sum in float32): for
   each (b, head, chunk) the running max ``m`` of the chunk's scaled scores, ``l = sum exp(s -
   m)`` and
   ``acc[d] = sum exp(s - m) V[d]`` (``part[..., 0]``, ``[..., 1]``, ``[..., 2:]``). Head ``h``
   reads kv head ``h // (H / Hkv)`` (grouped-query attention without a repeated copy). The slots
   attended are ``[0, lim)``, ``lim = min(pos, L - 1) + 1``; each chunk's loop runs over
   ``[start, min(start + chunk, lim))`` only, so a chunk past the position reads nothing of K, V
   (it writes the empty state ``m = finfo.min, l = 0, acc = 0``). A negative position (every slot
   masked in the graph: all scores ``finfo.min``, a uniform softmax) attends to all ``L`` slots
   with the scores 0, which is what the masked graph computes.
   With ``q_row`` / ``k_row`` / ``v_row`` (``relay_passes.decode_attention_row``) the parameters are
   ``(q, K, V, pos, krow, kidx, vrow, vidx[, cos, sin])``: q read from a row ``[B, 1, q_row]`` at
   ``q_off``, the caches as they were before the step's one-slot writes, and at the slot
   ``kidx`` / ``vidx`` name (normalized as the write normalizes it) the rows' k (``k_off``) and v
   (``v_off``) instead; with ``rope_rank`` q and that k rotated by HF's rotary embedding with
   ``cos`` / ``sin`` ``[1, .., 1, D]`` (:data:`WRITTEN_CACHE_PARAMS`: the caches' and indices'
   positions).
2. :func:`combine_func` ``(part, pos) -> out [B, H, 1, D]`` of ``out_dtype`` (computed in
   float32, rounded once at the store): ``M = max m_c``,
   ``out[d] = sum_c acc_c[d] exp(m_c - M) / sum_c l_c exp(m_c - M)`` over the chunks that hold
   attended slots. ``out_layout`` "b1hd" / "b1x" stores the same elements in the same order as
   ``[B, 1, H, D]`` / ``[B, 1, H * D]`` (the graph's transpose and reshape of one token's heads,
   which the pass folds into the combine).

Every function here is a scheduled PrimFunc (``tirx.is_scheduled``): blockIdx = rTasks. Two
layouts of each phase; which one is the default is the shape's ``warps``:

- ``warps`` > 0 (the pipeline's on 32-lane warps, CUDA: ``warps x 32`` = the vEU width it allows,
  ``D % 32 == 0``; ROCm's code generator has no ``tvm_warp_shuffle_xor``): phase 1 a warp per
  slot (:func:`warp_partial_func`: one rTask per (b, head, chunk), lane ``l`` holds dims ``l, l +
  32, ...``, so a warp reads a K / V row whole and in order; q . k a butterfly of xor shuffles;
  the warps' states merged through shared memory); phase 2 a warp per dim
  (:func:`warp_combine_func`: one rTask per (b, head, ``warps`` dims), lane = chunk, shuffles).
  Shuffles have no serial form: these run on a GPU or the CUDA emulator only.
- ``warps`` 0: phase 1 a thread per slot (:func:`thread_partial_func`: one rTask per (b, head,
  ``group`` consecutive chunks), each thread taking the chunk's slots ``tx, tx + threads, ...``
  with its own (m, l, acc[D]) in registers, then the threads' states merged through shared
  memory); phase 2 a thread per dim (:func:`thread_combine_func`: one rTask per (b, head)). These
  also run with their thread loops serial (llvm).

:func:`partial_versions` / :func:`combine_versions` list the variants the rKernel versions come
from (the warp layout first where the shape has warps, then the thread layouts); each has the same
parameters, so any of them can be chosen. The default is the first, what the pass makes.

The scores are ``(q . k) / scale`` or ``(q . k) * scale`` (``divide``), as the graph wrote them, so
results differ from the operator-by-operator graph by rounding only.

What the cost model sees: the worst case, ``position = L - 1`` (every chunk full). The position is
an input, unknown at compile time, and a decode step's time must hold for the last token too, so
the analytical model is charged what that step reads: each phase's SBlock declares its reads over
the whole K, V (``scheduling.rkernels.param_bytes`` takes those regions), and every loop has a
static extent with the bound as a guard inside (TVM's FLOP estimate counts the guarded body once
per iteration), never a data-dependent extent. A step at position ``p`` reads only
``(p + 1) / L`` of that on the device; a measured profile (a GPU lease) sees the position it was
run with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T

__all__ = ["DecodeAttentionShape", "KIND_ATTR", "chunk_for", "partial_func", "warp_partial_func",
           "thread_partial_func", "combine_func", "warp_combine_func", "thread_combine_func",
           "combine_warps", "partial_versions", "combine_versions", "schedule_of", "made_here",
           "WRITTEN_CACHE_PARAMS", "DecodeAttentionRule", "reference"]

FLOATS = ("float32", "float16")  # what q, K, V and out may be
KIND_ATTR = "rammer.decode_attention"  # "partial" / "combine": the functions made here
_PARAMS_ATTR = "rammer.decode_attention_params"  # the shape, to rebuild a version
F32_MIN = float(np.finfo(np.float32).min)
OPAQUE = 8  # op_pattern kOpaque: no fusion pass joins another operator to these
OUT_LAYOUTS = ("", "b1hd", "b1x")  # DecodeAttentionShape.out_shape


@dataclass(frozen=True)
class DecodeAttentionShape:
    """What both phases are made from: batch, query heads, kv heads, cache slots, head dim, slots
    per chunk, the scale and whether the scores are divided by it (else multiplied), the
    position's length (1: ``[1]``; 0: a scalar), the dtypes of q, of K and V, and of the result
    (each float32 or float16; the arithmetic is float32 whatever they are)."""

    batch: int
    heads: int
    kv_heads: int
    max_len: int
    head_dim: int
    chunk: int
    scale: float
    divide: bool
    pos_len: int = 1
    q_dtype: str = "float32"
    kv_dtype: str = "float32"
    out_dtype: str = "float32"
    warps: int = 0
    out_layout: str = ""
    q_row: int = 0
    q_off: int = 0
    k_row: int = 0
    k_off: int = 0
    v_row: int = 0
    v_off: int = 0
    idx_rank: int = 4
    idx_dtype: str = "int64"
    rope_rank: int = 0
    rope_dtype: str = "float32"

    def __post_init__(self):
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if min(self.batch, self.heads, self.kv_heads, self.max_len, self.head_dim,
               self.chunk) < 1 or self.heads % self.kv_heads or self.pos_len not in (0, 1) \
                or {self.q_dtype, self.kv_dtype, self.out_dtype} - set(FLOATS) \
                or self.warps < 0 or (self.warps and self.head_dim % 32) \
                or self.out_layout not in OUT_LAYOUTS \
                or min(self.q_row, self.q_off, self.k_row, self.k_off, self.v_row,
                       self.v_off) < 0 \
                or (self.q_row and self.q_off + q_width > self.q_row) \
                or bool(self.k_row) != bool(self.v_row) \
                or (self.k_row and (self.k_off + kv_width > self.k_row
                                    or self.v_off + kv_width > self.v_row)) \
                or self.idx_rank not in (3, 4) or self.idx_dtype not in ("int32", "int64") \
                or self.rope_rank not in (0, 1, 2, 3, 4) or self.rope_dtype not in FLOATS \
                or (self.rope_rank and (not self.q_row or not self.k_row
                                        or self.head_dim % 2)):
            raise ValueError(f"decode attention: invalid shape {self}")

    @property
    def chunks(self) -> int:
        return -(-self.max_len // self.chunk)

    def encode(self) -> str:
        return ",".join(str(v) for v in (self.batch, self.heads, self.kv_heads, self.max_len,
                                          self.head_dim, self.chunk, repr(self.scale),
                                          int(self.divide), self.pos_len, self.q_dtype,
                                          self.kv_dtype, self.out_dtype, self.warps,
                                          self.out_layout, self.q_row, self.q_off, self.k_row,
                                          self.k_off, self.v_row, self.v_off, self.idx_rank,
                                          self.idx_dtype, self.rope_rank, self.rope_dtype))

    @classmethod
    def decode(cls, text: str) -> "DecodeAttentionShape":
        b, h, kv, L, d, c, s, div, p, qt, kvt, ot, *rest = str(text).split(",")
        rows = [int(x) for x in rest[2:9]] + rest[9:10] + [int(x) for x in rest[10:11]] \
            + rest[11:12]
        return cls(int(b), int(h), int(kv), int(L), int(d), int(c), float(s), bool(int(div)),
                   int(p), qt, kvt, ot, int(rest[0]) if rest else 0, *rest[1:2], *rows)

    @property
    def q_buffer_shape(self) -> tuple:
        """The partial's ``q`` parameter: ``[B, H, 1, D]``, or the row ``[B, 1, q_row]`` it is a
        view of (``q_row``: one token's q at ``q_off``, head h's dims at ``q_off + h * D``)."""
        if self.q_row:
            return (self.batch, 1, self.q_row)
        return (self.batch, self.heads, 1, self.head_dim)

    @property
    def idx_shape(self) -> tuple:
        """A cache write's indices (ScatterND's, ``k_row`` only): ``[B, Hkv, 1, 3]`` or
        ``[B, Hkv, 3]``, component 2 the slot written for (b, kv head)."""
        lead = (self.batch, self.kv_heads) + ((1,) if self.idx_rank == 4 else ())
        return lead + (3,)

    @property
    def rope_shape(self) -> tuple:
        """The rotary embedding's cos and sin (``rope_rank``): ``[1, .., 1, D]``, broadcast over
        batch and heads (``take(table, position)`` and its ``expand_dims``)."""
        return (1,) * (self.rope_rank - 1) + (self.head_dim,)

    @property
    def out_shape(self) -> tuple:
        """The combine's ``out``: ``[B, H, 1, D]`` (``out_layout`` ""), ``[B, 1, H, D]``
        ("b1hd") or ``[B, 1, H * D]`` ("b1x"): the same elements in the same order (one query
        token), so a consumer's transpose and reshape of one token's heads are the combine's
        store."""
        b, h, d = self.batch, self.heads, self.head_dim
        return {"": (b, h, 1, d), "b1hd": (b, 1, h, d), "b1x": (b, 1, h * d)}[self.out_layout]


def chunk_for(max_len: int) -> int:
    """Slots per chunk for a cache of ``max_len``: about 16 chunks, 4 to 64 slots each (a power of
    two), so a long cache gives many rTasks and a short one still several."""
    chunk = 4
    while chunk < 64 and chunk * 16 < max_len:
        chunk *= 2
    return min(chunk, max(1, max_len))


def _pos_shape(shape):
    return (1,) if shape.pos_len == 1 else ()


def _limit(pos_value, max_len):
    """(slots attended, score multiplier): ``[0, min(p, L-1] + 1)`` and 1, or all L and 0 when
    ``p < 0`` (the graph's mask then masks every slot: a uniform softmax)."""
    lim = T.Select(pos_value < T.int64(0), T.int64(max_len),
                   T.min(pos_value, T.int64(max_len - 1)) + T.int64(1))
    use = T.Select(pos_value < T.int64(0), T.float32(0), T.float32(1))
    return T.Cast("int32", lim), use


def _out_at(shape, out, b, h, d):
    """The index of ``out[b, h, 0, d]`` in the combine's ``out`` (``shape.out_shape``)."""
    return {"": (b, h, 0, d), "b1hd": (b, 0, h, d), "b1x": (b, 0, h * shape.head_dim + d)}[
        shape.out_layout]


def _out_whole(shape, out):
    """All of the combine's ``out`` (the region its SBlock writes)."""
    return out[tuple(slice(0, n) for n in shape.out_shape)]


def _f32(value, dtype):
    """``value`` (a load of ``dtype``) as float32."""
    return value if dtype == "float32" else T.Cast("float32", value)


def _widest(fill: int) -> int:
    """The most threads of 32, 64 and 128 that ``fill`` work items (slots, columns) fill; 32 at
    least (a whole warp)."""
    return max(t for t in (32, 64, 128) if t == 32 or t <= fill)


SHARED_LIMIT = 48 * 1024  # static shared memory of a CUDA kernel (ptxas rejects more)


def _slot_threads(shape) -> tuple:
    """Thread counts of the thread-per-slot phase 1, the most first: 32, and 64 / 128 where a
    chunk fills them and their shared state (``threads x (D + 2)`` floats) fits
    :data:`SHARED_LIMIT` (128 threads at D = 128: 66,560 bytes, which ptxas rejects)."""
    return tuple(t for t in (128, 64, 32)
                 if t == 32 or (t <= shape.chunk and t * (shape.head_dim + 2) * 4 <= SHARED_LIMIT))


ROW_PARAMS = ("krow", "kidx", "vrow", "vidx")  # the partial's parameters that only ``k_row`` has
ROPE_PARAMS = ("cos", "sin")  # the partial's parameters that only ``rope_rank`` has
WRITTEN_CACHE_PARAMS = ((1, 5), (2, 7))  # with ``k_row``: (cache, its write's indices) positions


def _rope(shape, x, cos, sin, d):
    """float32 of the rotary embedding of one head ``x(e)`` (float32 of its element e) at dim
    ``d``, as HF's ``x * cos + rotate_half(x) * sin`` computes it, ``rotate_half(x) =
    cat(-x[D/2:], x[:D/2])``: the partner dim ``(d + D/2) % D``, negated below D/2. Without
    ``rope_rank``: ``x(d)``."""
    if not shape.rope_rank:
        return x(d)
    D, lead = shape.head_dim, (0,) * (shape.rope_rank - 1)
    half = D // 2
    rotated = T.Select(d < half, T.float32(-1), T.float32(1)) * x((d + half) % D)
    return x(d) * _f32(cos[lead + (d,)], shape.rope_dtype) \
        + rotated * _f32(sin[lead + (d,)], shape.rope_dtype)


def _q_at(shape, q, cos, sin, b, h, d):
    """float32 of ``q[b, h, 0, d]`` of the partial's ``q`` parameter (``q_row``: of the row it
    views; ``rope_rank``: rotated)."""
    if shape.q_row:
        base = shape.q_off + h * shape.head_dim
        return _rope(shape, lambda e: _f32(q[b, 0, base + e], shape.q_dtype), cos, sin, d)
    return _f32(q[b, h, 0, d], shape.q_dtype)


def _written_slot(shape, idx, b, g):
    """The slot (int64) the step's in-place write stores (b, kv head ``g``) at, normalized as it
    normalizes it (a negative index plus ``max_len``; out of ``[0, max_len)`` it writes nothing
    and no slot equals it); -1 without ``k_row``."""
    if not shape.k_row:
        return T.int64(-1)
    i = T.Cast("int64", idx[(b, g, 0, 2) if shape.idx_rank == 4 else (b, g, 2)])
    return T.Select(i < T.int64(0), i + T.int64(shape.max_len), i)


def _kv_at(shape, cache, row, off, written, b, g, slot, d, cos=None, sin=None):
    """float32 of ``cache[b, g, slot, d]``; with ``k_row``, at the slot the step writes
    (``written``), the row's element the write stores there instead (``row[b, 0, off + g * D +
    d]``, rotated where ``cos`` is given and the shape has ``rope_rank``): the cache is read
    beside its write, never waiting for it."""
    value = _f32(cache[b, g, slot, d], shape.kv_dtype)
    if not shape.k_row:
        return value
    base = off + g * shape.head_dim

    def element(e):
        return _f32(row[b, 0, base + e], shape.kv_dtype)

    new = _rope(shape, element, cos, sin, d) if cos is not None else element(d)
    return T.if_then_else(T.Cast("int64", slot) == written, new, value)


def _partial_reads(shape, q, k, v, pos, krow, kidx, vrow, vidx, cos, sin):
    """The regions the partial's SBlock reads: q's heads, the whole K and V (the worst case,
    module docstring), the position; with ``k_row`` the rows' k and v and the indices; with
    ``rope_rank`` cos and sin."""
    B, H, KV, L, D = shape.batch, shape.heads, shape.kv_heads, shape.max_len, shape.head_dim
    reads = [q[0:B, 0, shape.q_off:shape.q_off + H * D] if shape.q_row else q[0:B, 0:H, 0, 0:D],
             k[0:B, 0:KV, 0:L, 0:D], v[0:B, 0:KV, 0:L, 0:D],
             pos[()] if not shape.pos_len else pos[0:1]]
    if shape.k_row:
        whole = tuple(slice(0, n) for n in shape.idx_shape)
        reads += [krow[0:B, 0, shape.k_off:shape.k_off + KV * D], kidx[whole],
                  vrow[0:B, 0, shape.v_off:shape.v_off + KV * D], vidx[whole]]
    if shape.rope_rank:
        whole = tuple(slice(0, n) for n in shape.rope_shape)
        reads += [cos[whole], sin[whole]]
    return reads


def _finish_partial(func, shape):
    """The parsed partial with its attributes, without the row parameters where the shape has no
    ``k_row`` and without cos and sin where it has no ``rope_rank`` (its body never reads
    them)."""
    drop = (() if shape.k_row else ROW_PARAMS) + (() if shape.rope_rank else ROPE_PARAMS)
    if drop:
        func = tirx.PrimFunc([p for p in func.params if p.name not in drop], func.body,
                             func.ret_type, func.attrs)
    return func.without_attr("global_symbol").with_attrs({  # named by the module it joins
        "op_pattern": OPAQUE, KIND_ATTR: "partial", _PARAMS_ATTR: shape.encode()})


def partial_func(shape: DecodeAttentionShape, threads: int | None = None, group: int = 1,
                 bound_shift: int = 0) -> tirx.PrimFunc:
    """Phase 1 (module docstring), the default version when ``threads`` is None: a warp per slot
    (:func:`warp_partial_func`, ``shape.warps`` warps) where the shape has warps, else a thread per
    slot (:func:`thread_partial_func`, the most threads a chunk fills). ``threads`` / ``group``
    given: that thread-per-slot version. ``bound_shift`` moves the slot bound (tests' negative
    control: 1 reads one slot too many)."""
    if threads is None and group == 1 and shape.warps:
        return warp_partial_func(shape, shape.warps, bound_shift)
    return thread_partial_func(shape, threads, group, bound_shift)


def warp_partial_func(shape: DecodeAttentionShape, warps: int,
                      bound_shift: int = 0) -> tirx.PrimFunc:
    """Phase 1, a warp per slot: one rTask per (b, head, chunk) of ``warps`` x 32 threads; warp
    ``w`` takes the chunk's slots ``start + w, start + w + warps, ...``, lane ``l`` holds dims
    ``l, l + 32, ...`` of q (``D % 32 == 0``), so a warp reads a K or V row whole and in order
    (coalesced). q . k: each lane's partial sum, then a butterfly of five xor shuffles gives every
    lane the whole score; each warp keeps its running (m, l, acc[D / 32 a lane]) in registers.
    The warps' states are merged through shared memory (``warps x (D + 2)`` floats) into
    ``part[b, h, c, :]``, the same contract as :func:`thread_partial_func`'s. Runs on a GPU (or
    the CUDA emulator) only: the shuffles have no serial form."""
    B, H, KV, L, D, C = (shape.batch, shape.heads, shape.kv_heads, shape.max_len,
                         shape.head_dim, shape.chunk)
    if D % 32 or warps < 1:
        raise ValueError(f"decode attention: a warp per slot needs D % 32 == 0 and warps >= 1, "
                         f"got D={D}, warps={warps}")
    NC, G, W = shape.chunks, H // shape.kv_heads, int(warps)
    TH, DL = W * 32, D // 32
    per_warp = -(-C // W)
    scale, divide, P = float(shape.scale), bool(shape.divide), _pos_shape(shape)
    shift = int(bound_shift)
    QT, KT = shape.q_dtype, shape.kv_dtype
    QS, IS, IT = shape.q_buffer_shape, shape.idx_shape, shape.idx_dtype
    KR, VR, KO, VO = max(shape.k_row, 1), max(shape.v_row, 1), shape.k_off, shape.v_off
    RS, RT = shape.rope_shape if shape.rope_rank else (1,), shape.rope_dtype
    full = 0xFFFFFFFF

    def pos_load(pos):
        return pos[0] if P else pos[()]

    @T.prim_func(s_tir=True)
    def partial(q: T.Buffer(QS, QT), k: T.Buffer((B, KV, L, D), KT),
                v: T.Buffer((B, KV, L, D), KT), pos: T.Buffer(P, "int64"),
                krow: T.Buffer((B, 1, KR), KT), kidx: T.Buffer(IS, IT),
                vrow: T.Buffer((B, 1, VR), KT), vidx: T.Buffer(IS, IT), cos: T.Buffer(RS, RT),
                sin: T.Buffer(RS, RT), part: T.Buffer((B, H, NC, D + 2), "float32")):
        T.func_attr({"tirx.noalias": True})
        for task in T.thread_binding(B * H * NC, thread="blockIdx.x"):
            state = T.sblock_alloc_buffer((W, D + 2), "float32", scope="shared")
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                with T.sblock("partial"):
                    T.reads(*_partial_reads(shape, q, k, v, pos, krow, kidx, vrow, vidx, cos,
                                           sin))
                    T.writes(state[0:W, 0:D + 2])
                    m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    ls = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((DL,), "float32", scope="local")
                    qv = T.sblock_alloc_buffer((DL,), "float32", scope="local")
                    sc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    ws = T.sblock_alloc_buffer((2,), "int64", scope="local")
                    b = task // (H * NC)
                    h = task // NC % H
                    c = task % NC
                    w = tx // 32
                    lane = tx % 32
                    ws[0] = _written_slot(shape, kidx, b, h // G)
                    ws[1] = _written_slot(shape, vidx, b, h // G)
                    lim, use = _limit(pos_load(pos), L)
                    start = c * C
                    end = T.max(T.min(start + C, lim + shift), start)
                    m[0] = T.float32(F32_MIN)
                    ls[0] = T.float32(0)
                    for i in range(DL):
                        acc[i] = T.float32(0)
                        qv[i] = _q_at(shape, q, cos, sin, b, h, lane + i * 32)
                    for j in range(per_warp):
                        slot = start + w + j * W
                        if slot < end:  # the same for the warp's 32 lanes: no divergence
                            sc[0] = T.float32(0)
                            for i in range(DL):
                                sc[0] = sc[0] + qv[i] * _kv_at(shape, k, krow, KO, ws[0], b,
                                                               h // G, slot, lane + i * 32,
                                                               cos, sin)
                            for o in T.unroll(5):
                                sc[0] = sc[0] + T.tvm_warp_shuffle_xor(
                                    T.uint32(full), sc[0], T.shift_right(16, o), 32, 32)
                            if divide:
                                sc[0] = sc[0] / T.float32(scale) * use
                            else:
                                sc[0] = sc[0] * T.float32(scale) * use
                            mn = T.max(m[0], sc[0])
                            corr = T.exp(m[0] - mn)
                            pe = T.exp(sc[0] - mn)
                            ls[0] = ls[0] * corr + pe
                            for i in range(DL):
                                acc[i] = acc[i] * corr + pe * _kv_at(
                                    shape, v, vrow, VO, ws[1], b, h // G, slot, lane + i * 32)
                            m[0] = mn
                    if lane == 0:
                        state[w, 0] = m[0]
                        state[w, 1] = ls[0]
                    for i in range(DL):
                        state[w, 2 + lane + i * 32] = acc[i]
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads(state[0:W, 0:D + 2])
                    T.writes(part[0:B, 0:H, 0:NC, 0:D + 2])
                    mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    sm = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    b = task // (H * NC)
                    h = task // NC % H
                    c = task % NC
                    mx[0] = T.float32(F32_MIN)
                    for t in range(W):
                        mx[0] = T.max(mx[0], state[t, 0])
                    for i in range(-(-(D + 2) // TH)):
                        if tx + i * TH < D + 2:
                            sm[0] = T.float32(0)
                            for t in range(W):
                                sm[0] = sm[0] + state[t, tx + i * TH] * T.exp(
                                    state[t, 0] - mx[0])
                            part[b, h, c, tx + i * TH] = T.Select(tx + i * TH == 0, mx[0],
                                                                  sm[0])
    return _finish_partial(partial, shape)


def thread_partial_func(shape: DecodeAttentionShape, threads: int | None = None, group: int = 1,
                        bound_shift: int = 0) -> tirx.PrimFunc:
    """Phase 1, a thread per slot: one rTask per (b, head, ``group`` chunks), ``threads``
    threads (None: the most a chunk fills whose shared state fits, :func:`_slot_threads`), each
    thread taking the chunk's slots ``tx, tx + threads, ...`` with its whole (m, l, acc[D]) in
    registers, the threads' states merged through shared memory. Also runs with its thread loops
    serial (llvm)."""
    B, H, KV, L, D, C = (shape.batch, shape.heads, shape.kv_heads, shape.max_len,
                         shape.head_dim, shape.chunk)
    NC, G, TH = shape.chunks, H // shape.kv_heads, threads or _slot_threads(shape)[0]
    if NC % group:
        raise ValueError(f"decode attention: {NC} chunks are not a multiple of group={group}")
    tasks = B * H * (NC // group)
    per_thread = -(-C // TH)
    scale, divide, P = float(shape.scale), bool(shape.divide), _pos_shape(shape)
    shift = int(bound_shift)
    QT, KT = shape.q_dtype, shape.kv_dtype
    QS, IS, IT = shape.q_buffer_shape, shape.idx_shape, shape.idx_dtype
    KR, VR, KO, VO = max(shape.k_row, 1), max(shape.v_row, 1), shape.k_off, shape.v_off
    RS, RT = shape.rope_shape if shape.rope_rank else (1,), shape.rope_dtype

    def pos_load(pos):
        return pos[0] if P else pos[()]

    @T.prim_func(s_tir=True)
    def partial(q: T.Buffer(QS, QT), k: T.Buffer((B, KV, L, D), KT),
                v: T.Buffer((B, KV, L, D), KT), pos: T.Buffer(P, "int64"),
                krow: T.Buffer((B, 1, KR), KT), kidx: T.Buffer(IS, IT),
                vrow: T.Buffer((B, 1, VR), KT), vidx: T.Buffer(IS, IT), cos: T.Buffer(RS, RT),
                sin: T.Buffer(RS, RT), part: T.Buffer((B, H, NC, D + 2), "float32")):
        T.func_attr({"tirx.noalias": True})
        for task in T.thread_binding(tasks, thread="blockIdx.x"):
            state = T.sblock_alloc_buffer((TH, D + 2), "float32", scope="shared")
            for gi in range(group):
                for tx in T.thread_binding(TH, thread="threadIdx.x"):
                    with T.sblock("partial"):
                        T.reads(*_partial_reads(shape, q, k, v, pos, krow, kidx, vrow, vidx, cos,
                                           sin))
                        T.writes(state[tx, 0:D + 2])
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        ls = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((D,), "float32", scope="local")
                        sc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        ws = T.sblock_alloc_buffer((2,), "int64", scope="local")
                        b = task // (H * (NC // group))
                        h = task // (NC // group) % H
                        c = task % (NC // group) * group + gi
                        ws[0] = _written_slot(shape, kidx, b, h // G)
                        ws[1] = _written_slot(shape, vidx, b, h // G)
                        lim, use = _limit(pos_load(pos), L)
                        start = c * C
                        end = T.max(T.min(start + C, lim + shift), start)
                        m[0] = T.float32(F32_MIN)
                        ls[0] = T.float32(0)
                        for d in range(D):
                            acc[d] = T.float32(0)
                        for j in range(per_thread):
                            slot = start + tx + j * TH
                            if slot < end:
                                sc[0] = T.float32(0)
                                for d in range(D):
                                    sc[0] = sc[0] + _q_at(shape, q, cos, sin, b, h, d) * _kv_at(
                                        shape, k, krow, KO, ws[0], b, h // G, slot, d, cos, sin)
                                if divide:
                                    sc[0] = sc[0] / T.float32(scale) * use
                                else:
                                    sc[0] = sc[0] * T.float32(scale) * use
                                mn = T.max(m[0], sc[0])
                                corr = T.exp(m[0] - mn)
                                pe = T.exp(sc[0] - mn)
                                ls[0] = ls[0] * corr + pe
                                for d in range(D):
                                    acc[d] = acc[d] * corr + pe * _kv_at(
                                        shape, v, vrow, VO, ws[1], b, h // G, slot, d)
                                m[0] = mn
                        state[tx, 0] = m[0]
                        state[tx, 1] = ls[0]
                        for d in range(D):
                            state[tx, 2 + d] = acc[d]
                for tx in T.thread_binding(TH, thread="threadIdx.x"):
                    with T.sblock("merge"):
                        T.reads(state[0:TH, 0:D + 2])
                        T.writes(part[0:B, 0:H, 0:NC, 0:D + 2])
                        mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        sm = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        b = task // (H * (NC // group))
                        h = task // (NC // group) % H
                        c = task % (NC // group) * group + gi
                        mx[0] = T.float32(F32_MIN)
                        for t in range(TH):
                            mx[0] = T.max(mx[0], state[t, 0])
                        for i in range(-(-(D + 2) // TH)):
                            if tx + i * TH < D + 2:
                                sm[0] = T.float32(0)
                                for t in range(TH):
                                    sm[0] = sm[0] + state[t, tx + i * TH] * T.exp(
                                        state[t, 0] - mx[0])
                                part[b, h, c, tx + i * TH] = T.Select(tx + i * TH == 0, mx[0],
                                                                      sm[0])
    return _finish_partial(partial, shape)


def combine_func(shape: DecodeAttentionShape, threads: int | None = None) -> tirx.PrimFunc:
    """Phase 2 (module docstring), the default version when ``threads`` is None: a warp per dim
    (:func:`warp_combine_func`) where the shape has warps, else a thread per dim
    (:func:`thread_combine_func`, the most threads D fills); ``threads`` given: that
    thread-per-dim version."""
    if threads is None and shape.warps:
        return warp_combine_func(shape, combine_warps(shape))
    return thread_combine_func(shape, threads)


def combine_warps(shape: DecodeAttentionShape) -> int:
    """Warps of the default warp-per-dim combine: the most, up to ``shape.warps`` (phase 1's, the
    vEU width), that divide D."""
    return max(w for w in range(1, max(shape.warps, 1) + 1) if shape.head_dim % w == 0)


def warp_combine_func(shape: DecodeAttentionShape, warps: int) -> tirx.PrimFunc:
    """Phase 2, a warp per dim: one rTask per (b, head, ``warps`` consecutive dims) of ``warps``
    x 32 threads (``D % warps == 0``); warp ``w`` computes ``out[b, h, 0, d]``, ``d = g * warps +
    w``, its lane ``l`` taking chunks ``l, l + 32, ...``: the max of the chunks' ``m`` and the two
    sums (of ``l_c exp(m_c - M)`` and ``acc_c[d] exp(m_c - M)``) are butterflies of xor shuffles,
    no shared memory. More rTasks than a thread per dim (D / warps per head). Runs on a GPU (or
    the CUDA emulator) only."""
    B, H, L, D, C = shape.batch, shape.heads, shape.max_len, shape.head_dim, shape.chunk
    W = int(warps)
    if W < 1 or D % W:
        raise ValueError(f"decode attention: the combine's warps={warps} must divide D={D}")
    NC, P, G = shape.chunks, _pos_shape(shape), D // W
    rounds = -(-NC // 32)
    OT = shape.out_dtype
    full = 0xFFFFFFFF

    def pos_load(pos):
        return pos[0] if P else pos[()]

    def store(value):
        return value if OT == "float32" else T.Cast(OT, value)

    @T.prim_func(s_tir=True)
    def combine(part: T.Buffer((B, H, NC, D + 2), "float32"), pos: T.Buffer(P, "int64"),
                out: T.Buffer(shape.out_shape, OT)):
        T.func_attr({"tirx.noalias": True})
        for task in T.thread_binding(B * H * G, thread="blockIdx.x"):
            for tx in T.thread_binding(W * 32, thread="threadIdx.x"):
                with T.sblock("combine"):
                    T.reads(part[0:B, 0:H, 0:NC, 0:D + 2], pos[()] if not P else pos[0:1])
                    T.writes(_out_whole(shape, out))
                    mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    den = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    num = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    b = task // (H * G)
                    h = task // G % H
                    d = task % G * W + tx // 32
                    lane = tx % 32
                    lim, _use = _limit(pos_load(pos), L)
                    used = (lim + C - 1) // C
                    mx[0] = T.float32(F32_MIN)
                    for r in range(rounds):
                        if lane + r * 32 < used:
                            mx[0] = T.max(mx[0], part[b, h, lane + r * 32, 0])
                    for o in T.unroll(5):
                        mx[0] = T.max(mx[0], T.tvm_warp_shuffle_xor(
                            T.uint32(full), mx[0], T.shift_right(16, o), 32, 32))
                    den[0] = T.float32(0)
                    num[0] = T.float32(0)
                    for r in range(rounds):
                        if lane + r * 32 < used:
                            den[0] = den[0] + part[b, h, lane + r * 32, 1] * T.exp(
                                part[b, h, lane + r * 32, 0] - mx[0])
                            num[0] = num[0] + part[b, h, lane + r * 32, 2 + d] * T.exp(
                                part[b, h, lane + r * 32, 0] - mx[0])
                    for o in T.unroll(5):
                        den[0] = den[0] + T.tvm_warp_shuffle_xor(
                            T.uint32(full), den[0], T.shift_right(16, o), 32, 32)
                        num[0] = num[0] + T.tvm_warp_shuffle_xor(
                            T.uint32(full), num[0], T.shift_right(16, o), 32, 32)
                    if lane == 0:
                        out[_out_at(shape, out, b, h, d)] = store(num[0] / den[0])
    return combine.without_attr("global_symbol").with_attrs({  # named by the module it joins
        "op_pattern": OPAQUE, KIND_ATTR: "combine", _PARAMS_ATTR: shape.encode()})


def thread_combine_func(shape: DecodeAttentionShape, threads: int | None = None) -> tirx.PrimFunc:
    """Phase 2, a thread per dim: one rTask per (b, head), ``threads`` threads over D (None: the
    most D fills). Also runs with its thread loops serial (llvm)."""
    B, H, L, D, C = shape.batch, shape.heads, shape.max_len, shape.head_dim, shape.chunk
    NC, TH, P = shape.chunks, threads or _widest(shape.head_dim), _pos_shape(shape)
    per_thread = -(-D // TH)
    OT = shape.out_dtype

    def pos_load(pos):
        return pos[0] if P else pos[()]

    def store(value):
        return value if OT == "float32" else T.Cast(OT, value)

    @T.prim_func(s_tir=True)
    def combine(part: T.Buffer((B, H, NC, D + 2), "float32"), pos: T.Buffer(P, "int64"),
                out: T.Buffer(shape.out_shape, OT)):
        T.func_attr({"tirx.noalias": True})
        for task in T.thread_binding(B * H, thread="blockIdx.x"):
            for tx in T.thread_binding(TH, thread="threadIdx.x"):
                with T.sblock("combine"):
                    T.reads(part[0:B, 0:H, 0:NC, 0:D + 2], pos[()] if not P else pos[0:1])
                    T.writes(_out_whole(shape, out))
                    mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    den = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    num = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    b = task // H
                    h = task % H
                    lim, _use = _limit(pos_load(pos), L)
                    used = (lim + C - 1) // C
                    mx[0] = T.float32(F32_MIN)
                    for c in range(NC):
                        if c < used:
                            mx[0] = T.max(mx[0], part[b, h, c, 0])
                    den[0] = T.float32(0)
                    for c in range(NC):
                        if c < used:
                            den[0] = den[0] + part[b, h, c, 1] * T.exp(part[b, h, c, 0] - mx[0])
                    for i in range(per_thread):
                        if tx + i * TH < D:
                            num[0] = T.float32(0)
                            for c in range(NC):
                                if c < used:
                                    num[0] = num[0] + part[b, h, c, 2 + tx + i * TH] * T.exp(
                                        part[b, h, c, 0] - mx[0])
                            out[_out_at(shape, out, b, h, tx + i * TH)] = store(
                                num[0] / den[0])
    return combine.without_attr("global_symbol").with_attrs({  # named by the module it joins
        "op_pattern": OPAQUE, KIND_ATTR: "combine", _PARAMS_ATTR: shape.encode()})


def partial_versions(shape: DecodeAttentionShape) -> list:
    """(name, PrimFunc) of every phase-1 variant: where the shape has warps, a warp per slot with
    ``shape.warps`` warps first (the default, what :func:`partial_func` makes); then a thread per
    slot with 32, 64 or 128 threads (those a chunk fills and whose shared state fits
    :data:`SHARED_LIMIT`, 32 at least: whole warps), one or two
    chunks per rTask (two when the chunks pair up), the most threads first (the default of a
    shape without warps)."""
    found = []
    if shape.warps:
        found.append((f"decode_attention_w{shape.warps}", warp_partial_func(shape, shape.warps)))
    for threads in _slot_threads(shape):
        for group in (1, 2):
            if shape.chunks % group == 0 and (group == 1 or shape.chunks > 1):
                found.append((f"decode_attention_t{threads}g{group}",
                              thread_partial_func(shape, threads, group)))
    return found


def combine_versions(shape: DecodeAttentionShape) -> list:
    """(name, PrimFunc) of every phase-2 variant: where the shape has warps, a warp per dim
    (:func:`combine_warps` warps) first (the default, what :func:`combine_func` makes); then a
    thread per dim with 32 threads, and 64 / 128 where D fills them, the most threads first (the
    default of a shape without warps)."""
    found = []
    if shape.warps:
        warps = combine_warps(shape)
        found.append((f"decode_combine_w{warps}", warp_combine_func(shape, warps)))
    return found + [(f"decode_combine_t{t}", thread_combine_func(shape, t))
                    for t in (128, 64, 32) if t == 32 or t <= shape.head_dim]


def made_here(func):
    """``(kind, shape)`` of a function made here (kind "partial" or "combine"), else None."""
    attrs = getattr(func, "attrs", None)
    kind = attrs.get(KIND_ATTR, None) if attrs is not None else None
    if kind is None:
        return None
    return str(kind), DecodeAttentionShape.decode(attrs[_PARAMS_ATTR])


def schedule_of(func) -> list:
    """The variants of a function made here (its kind's :func:`partial_versions` or
    :func:`combine_versions`), or [] for any other function."""
    found = made_here(func)
    if found is None:
        return []
    kind, shape = found
    return partial_versions(shape) if kind == "partial" else combine_versions(shape)


def reference(q, k, v, pos, scale, divide):
    """NumPy (float64) decode attention as the masked graph computes it: q [B, H, 1, D], k, v
    [B, Hkv, L, D], ``pos`` an int; returns [B, H, 1, D]."""
    B, H, _, D = q.shape
    L = k.shape[2]
    rep = H // k.shape[1]
    kk, vv = np.repeat(k, rep, axis=1).astype(np.float64), np.repeat(v, rep, axis=1)
    s = np.einsum("bhd,bhld->bhl", q[:, :, 0].astype(np.float64), kk)
    s = s / scale if divide else s * scale
    s = s + np.where(np.arange(L) > pos, np.float64(F32_MIN), 0.0)[None, None]
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhl,bhld->bhd", p, vv)[:, :, None, :]


class DecodeAttentionRule:
    """A dlight-style rule (``apply(func, target, tunable)``): a function made here is already
    scheduled (its default version, the first of its kind's versions); it is kept as it is, marked
    as scheduled by ``decode_attention``. Returns None for any other function."""

    schedule_name = "decode_attention"  # default_schedule.SCHEDULED_BY_ATTR of what it keeps

    def apply(self, func, _target=None, _tunable=False):
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None \
                or func.attrs.get(KIND_ATTR, None) is None:
            return None
        return s_tir.Schedule(func)
