"""The emulator's tensor-core PTX (``tvm_rammer/checks/emulator/ptx.py`` + ``include/rammer_emu_mma.h``).

* Fragment math against numpy: the header's whole-warp ``mma_exec`` / ``ldmatrix_exec`` (built
  with g++ into a small shared library) on fragments laid out here from the PTX ISA's tables
  (written independently of the header's formulas), for mma m16n8k16 / m16n8k8 with f32 and f16
  accumulation (bf16 too) and ldmatrix x1/x2/x4 with and without .trans; the half conversions
  against numpy's float16 bit for bit. Negative controls: two lanes swapped in a fragment and a
  wrong row address each make the comparison fail.
* ``translate``: every asm statement it knows becomes emulation calls, unknown PTX raises
  EmulatorError quoting the statement, preprocessor regions known to be inactive are left alone.
* Through the runtime (``tvm_rammer.checks.emulator.build.build_module`` + ``launch``): hand-written
  kernels with TVM's exact asm text (ldmatrix + mma per warp, cp.async with zero fill and
  commit/wait groups; a kernel reading before its wait sees the old contents) and one fp16
  tensor-core rKernel version of ``tir_templates/mma_templates.py`` built by TVM against numpy.
"""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from tvm_rammer.checks.emulator import ptx
from tvm_rammer.checks.emulator.errors import EmulatorError

INCLUDE = os.path.join(os.path.dirname(ptx.__file__), "include")
F32, F16, BF16 = 0, 1, 2

SHIM = r"""
#define RAMMER_EMU_MMA_MATH_ONLY
#include "rammer_emu_mma.h"
using namespace rammer_emu_mma;
extern "C" {
void t_mma(int k, int dt, int at, int bt, int ct, const uint32_t* a, const uint32_t* b,
           const uint32_t* c, uint32_t* d) {
  mma_exec(k, dt, at, bt, ct, (const uint32_t(*)[4])a, (const uint32_t(*)[2])b,
           (const uint32_t(*)[4])c, (uint32_t(*)[4])d);
}
void t_ldmatrix(int num, int trans, const uint16_t* smem, const int* row_elems, uint32_t* out) {
  const void* rows[32];
  for (int i = 0; i < 32; ++i) rows[i] = smem + row_elems[i];
  ldmatrix_exec(num, trans != 0, rows, (uint32_t(*)[4])out, nullptr);
}
void t_f2h(const float* x, uint16_t* y, int n) { for (int i = 0; i < n; ++i) y[i] = float_to_f16(x[i]); }
void t_h2f(const uint16_t* x, float* y, int n) { for (int i = 0; i < n; ++i) y[i] = f16_to_float(x[i]); }
void t_f2bf(const float* x, uint16_t* y, int n) { for (int i = 0; i < n; ++i) y[i] = float_to_bf16(x[i]); }
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The header's fragment math as a shared library (g++, no runtime)."""
    work = tmp_path_factory.mktemp("ptx_shim")
    (work / "shim.cpp").write_text(SHIM)
    cxx = os.environ.get("CXX", "g++")
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-I", INCLUDE, "shim.cpp", "-o", "shim.so"],
                   cwd=work, check=True, capture_output=True)
    return ctypes.CDLL(str(work / "shim.so"))


def _p(arr):
    return arr.ctypes.data_as(ctypes.c_void_p)


# ----------------------------------------------------------------- fragment layouts (PTX ISA)
# "Matrix fragments for mma.m16n8k16 with floating point type" / "... m16n8k8": groupID = laneid >> 2,
# threadID_in_group = laneid % 4. Written as the ISA's tables, element by element.

def _a_position(lane, i, k):
    """(row, col) of A fragment element a_i of `lane` (16 x k, .row)."""
    g, t = lane >> 2, lane % 4
    if k == 16:  # a0..a7
        row = g if i in (0, 1, 4, 5) else g + 8
        col = t * 2 + (i & 1) if i < 4 else t * 2 + (i & 1) + 8
    else:        # m16n8k8: a0..a3
        row = g if i < 2 else g + 8
        col = t * 2 + (i & 1)
    return row, col


def _b_position(lane, i, k):
    """(row, col) of B fragment element b_i (k x 8, .col)."""
    g, t = lane >> 2, lane % 4
    row = t * 2 + (i & 1) if i < 2 else t * 2 + (i & 1) + 8
    return row, g


def _c_position(lane, i):
    """(row, col) of C/D fragment element c_i (16 x 8)."""
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


def _bits16(x, dtype):
    if dtype == BF16:
        return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact: inputs are bf16
    return np.asarray(x, np.float16).view(np.uint16)


def _pack(elements, nregs, dtype):
    """32 lanes x (2 * nregs) 16-bit elements -> 32 x 4 registers (element 2r in the low half)."""
    bits = _bits16(elements, dtype).astype(np.uint32)
    regs = np.zeros((32, 4), np.uint32)
    regs[:, :nregs] = bits[:, 0::2] | (bits[:, 1::2] << 16)
    return regs


def _unpack16(regs, nregs, dtype):
    lo, hi = regs[:, :nregs] & 0xFFFF, regs[:, :nregs] >> 16
    bits = np.stack([lo, hi], axis=-1).reshape(32, 2 * nregs).astype(np.uint16)
    if dtype == BF16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def fragments(A, B, C, k, atype, ctype):
    """A (16 x k), B (k x 8), C (16 x 8) -> per-lane registers as the ISA lays them out."""
    a = np.array([[A[_a_position(l, i, k)] for i in range(k // 2)] for l in range(32)], np.float32)
    b = np.array([[B[_b_position(l, i, k)] for i in range(k // 4)] for l in range(32)], np.float32)
    c = np.array([[C[_c_position(l, i)] for i in range(4)] for l in range(32)], np.float32)
    c_regs = np.zeros((32, 4), np.uint32)
    if ctype == F32:
        c_regs[:] = c.view(np.uint32)
    else:
        c_regs = _pack(c, 2, ctype)
    return _pack(a, k // 4, atype), _pack(b, k // 8, atype), c_regs


def d_matrix(d_regs, dtype):
    """Per-lane D registers -> the 16 x 8 matrix."""
    vals = d_regs.view(np.float32) if dtype == F32 else _unpack16(d_regs, 2, dtype)
    D = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        for i in range(4):
            D[_c_position(lane, i)] = vals[lane, i]
    return D


def _random_operands(rng, k, atype, ctype):
    def elems(shape, dtype):
        x = rng.standard_normal(shape).astype(np.float32)
        if dtype == BF16:
            return ((x.view(np.uint32) >> 16) << 16).view(np.float32)  # truncated to bf16
        return x.astype(np.float16).astype(np.float32)
    return elems((16, k), atype), elems((k, 8), atype), elems((16, 8), ctype if ctype != F32 else F16) * 4


def run_mma(lib, k, dtype, atype, ctype, a, b, c):
    d = np.zeros((32, 4), np.uint32)
    b2 = np.ascontiguousarray(b[:, :2])
    lib.t_mma(k, dtype, atype, atype, ctype, _p(np.ascontiguousarray(a)), _p(b2), _p(np.ascontiguousarray(c)), _p(d))
    return d


@pytest.mark.parametrize("k, dtype, atype, ctype", [
    (16, F32, F16, F32), (16, F16, F16, F16), (8, F32, F16, F32), (8, F16, F16, F16),
    (16, F32, BF16, F32), (16, F32, F16, F16)])
def test_mma_matches_numpy(lib, k, dtype, atype, ctype):
    rng = np.random.default_rng(k * 10 + dtype * 3 + atype + 7 * ctype)
    A, B, C = _random_operands(rng, k, atype, ctype)
    a, b, c = fragments(A, B, C, k, atype, ctype)
    D = d_matrix(run_mma(lib, k, dtype, atype, ctype, a, b, c), dtype)
    expected = A.astype(np.float64) @ B.astype(np.float64) + C
    if dtype == F32:
        np.testing.assert_allclose(D, expected, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the float32 result to float16
        np.testing.assert_array_equal(D, expected.astype(np.float32).astype(np.float16).astype(np.float32))


def test_a_wrong_fragment_layout_is_caught(lib):
    """Negative control: the same comparison fails when two lanes' A registers are swapped
    (the layout a wrong translation or a wrong ldmatrix would produce)."""
    rng = np.random.default_rng(1)
    A, B, C = _random_operands(rng, 16, F16, F32)
    a, b, c = fragments(A, B, C, 16, F16, F32)
    expected = A @ B + C
    good = d_matrix(run_mma(lib, 16, F32, F16, F32, a, b, c), F32)
    np.testing.assert_allclose(good, expected, rtol=1e-5, atol=1e-5)
    swapped = a.copy()
    swapped[[0, 5]] = swapped[[5, 0]]
    bad = d_matrix(run_mma(lib, 16, F32, F16, F32, swapped, b, c), F32)
    assert not np.allclose(bad, expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(bad, expected, rtol=1e-2, atol=1e-2)


def ldmatrix_expected(tile, rows, num, trans):
    """Per the ISA: matrix m's row r is at rows[8m + r]; lane l receives, per matrix, the elements
    (l // 4, 2 (l % 4) + {0, 1}) of the matrix (of its transpose with .trans)."""
    out = np.zeros((32, 4), np.uint32)
    flat = tile.reshape(-1)
    for m in range(num):
        M = np.stack([flat[rows[8 * m + r]: rows[8 * m + r] + 8] for r in range(8)])
        if trans:
            M = M.T
        for lane in range(32):
            e0, e1 = M[lane // 4, 2 * (lane % 4)], M[lane // 4, 2 * (lane % 4) + 1]
            out[lane, m] = int(e0) | (int(e1) << 16)
    return out


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_matches_the_isa(lib, num, trans):
    rng = np.random.default_rng(num + 10 * trans)
    tile = rng.integers(0, 2 ** 16, (64, 40), dtype=np.uint16)  # padded rows like TVM's (40 halves)
    # each supplying lane points at a random row and 8-aligned column of the tile
    rows = np.array([r * 40 + c for r, c in zip(rng.permutation(64)[:32], rng.integers(0, 4, 32) * 8)], np.int32)
    out = np.zeros((32, 4), np.uint32)
    lib.t_ldmatrix(num, int(trans), _p(tile), _p(rows), _p(out))
    np.testing.assert_array_equal(out, ldmatrix_expected(tile, rows, num, trans))
    # negative control: another row address for one supplying lane changes what lanes receive
    wrong = rows.copy()
    wrong[3] = rows[3] + 40
    assert not np.array_equal(ldmatrix_expected(tile, wrong, num, trans), out)


def test_ldmatrix_x4_then_mma_is_tvms_16x16_fragment(lib):
    """ldmatrix.x4 of a 16x16 tile with TVM's row addresses (lane l -> row l % 16, column
    8 * (l // 16)) gives exactly the A fragment of m16n8k16: the pairing TVM's kernels rely on."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    rows = np.array([(l % 16) * 16 + 8 * (l // 16) for l in range(32)], np.int32)
    out = np.zeros((32, 4), np.uint32)
    lib.t_ldmatrix(4, 0, _p(A.view(np.uint16)), _p(rows), _p(out))
    a, _, _ = fragments(A.astype(np.float32), np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32), 16, F16, F32)
    np.testing.assert_array_equal(out, a)


def test_half_conversions_match_numpy(lib):
    every = np.arange(2 ** 16, dtype=np.uint16)
    got = np.zeros(every.size, np.float32)
    lib.t_h2f(_p(every), _p(got), every.size)
    want = every.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all()
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 10 ** rng.uniform(-9, 5, 20000),
                        want[~np.isnan(want)], want[~np.isnan(want)] * (1 + 2 ** -11),  # ties
                        [65504, 65519.99, 65520, 1e-8, -3e-8, 6e-8, np.inf, -np.inf]]).astype(np.float32)
    h = np.zeros(x.size, np.uint16)
    lib.t_f2h(_p(x), _p(h), x.size)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h, x.astype(np.float16).view(np.uint16))
    bf = np.zeros(x.size, np.uint16)
    lib.t_f2bf(_p(x), _p(bf), x.size)
    finite = np.isfinite(x)
    back = (bf.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(back[finite] - x[finite]) <= np.abs(x[finite]) * 2 ** -8)


# ------------------------------------------------------------------------------- translate()
# TVM's own asm text (tvm/backend/cuda codegen: PrintLoadMatrixAssembly, PrintMMAAssembly, the
# legacy cp.async helpers and the commit/wait helpers), as it appears in generated sources.
LDMATRIX = r'''
  {
    unsigned int addr = __cvta_generic_to_shared((&(((half*)smem)[off])));
    __asm__ __volatile__(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
      "{%0, %1, %2, %3}, [%4];\n"
      : "=r"(((unsigned *)(frag + 0))[0]), "=r"(((unsigned *)(frag + 0))[1]), "=r"(((unsigned *)(frag + 0))[2]), "=r"(((unsigned *)(frag + 0))[3])
      : "r"(addr)
    );
  }
'''
MMA = r'''
  {
    __asm__ __volatile__(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      :  "=f"(((float *)(acc + 0))[0]), "=f"(((float *)(acc + 0))[1]), "=f"(((float *)(acc + 0))[2]), "=f"(((float *)(acc + 0))[3])
      : "r"(((unsigned *)(a + 0))[0]), "r"(((unsigned *)(a + 0))[1]), "r"(((unsigned *)(a + 0))[2]), "r"(((unsigned *)(a + 0))[3]), "r"(((unsigned *)(b + 0))[0]), "r"(((unsigned *)(b + 0))[1]), "f"(((float *)(acc + 0))[0]), "f"(((float *)(acc + 0))[1]), "f"(((float *)(acc + 0))[2]), "f"(((float *)(acc + 0))[3]));
  }
'''
CP_ASYNC_PRED = r'''
__forceinline__ __device__ void ptx_cp_async_legacy_pred_cg_16_2_2(void* dst, int dst_off, void* src, int src_off, int predicate) {
  uint8_t* dst_p = (uint8_t*)dst + dst_off * 2;
  uint8_t* src_p = (uint8_t*)src + src_off * 2;
  unsigned int dst_addr = __cvta_generic_to_shared(dst_p);
  __asm__ __volatile__(
    "{\n"
    " .reg .pred p;\n"
    " setp.eq.u32 p, %3, 1;\n"
    " @p cp.async.cg.shared.global [%0], [%1], %2;\n"
    " @!p st.shared.v4.u32 [%0], {%4, %4, %4, %4};\n"
    "}\n"
    :: "r"(dst_addr), "l"(src_p), "n"(16), "r"(predicate), "r"(0)
  );
}
'''
COMMIT_WAIT = r'''
__forceinline__ __device__ void tvm_builtin_ptx_cp_async_commit_group_async_commit_group() {
  asm volatile("cp.async.commit_group;" :  : );
}
__forceinline__ __device__ void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_1() {
  asm volatile("cp.async.wait_group 1;" :  :  : "memory");
}
'''


def _no_asm_left(text):
    return not any(s.active is not False for s in ptx.find_asm(text))


@pytest.mark.parametrize("snippet", [LDMATRIX, MMA, CP_ASYNC_PRED, COMMIT_WAIT],
                         ids=["ldmatrix", "mma", "cp_async_pred", "commit_wait"])
def test_tvms_asm_is_translated_on_the_same_lines(snippet):
    body = ptx.translate(snippet)
    assert body.count("\n") == snippet.count("\n")  # diagnostics keep their line numbers
    assert _no_asm_left(body) and "rammer_emu_mma::" in body
    found = ptx.find_asm(snippet)
    assert found and all(s.line == snippet.count("\n", 0, s.start) + 1 for s in found)


def test_translated_calls_say_what_the_ptx_says():
    body = ptx.translate(LDMATRIX + MMA + CP_ASYNC_PRED + COMMIT_WAIT)
    assert "rammer_emu_mma::ldmatrix(&rammer_ptx_site_1, 4, false," in body
    assert ("rammer_emu_mma::mma(&rammer_ptx_site_2, 16, rammer_emu_mma::F32, rammer_emu_mma::F16, "
            "rammer_emu_mma::F16, rammer_emu_mma::F32,") in body
    assert "if (rammer_r_p) rammer_emu_mma::cp_async(" in body
    assert "if (!rammer_r_p) { const uint32_t rammer_v[4]" in body
    assert "cp_async_commit_group()" in body and "cp_async_wait_group(((long long)1))" in body
    # the outputs are written back to TVM's lvalues after the collective
    assert "rammer_emu_mma::assign(((float *)(acc + 0))[3], rammer_op3);" in body


def test_unknown_ptx_fails_at_build_time_quoting_the_statement():
    source = LDMATRIX + r'''
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
'''
    line = LDMATRIX.count("\n") + 2
    with pytest.raises(EmulatorError, match=rf"(?s)cannot run this inline PTX.*wgmma\.fence\.sync\.aligned.*line {line} of the CUDA source.*"
                                            r'asm volatile\("wgmma\.fence\.sync\.aligned;" ::: "memory"\)'):
        ptx.translate(source)
    # a known opcode with a form the emulator does not run is refused too, not guessed
    with pytest.raises(EmulatorError, match=r"ldmatrix \.x2 needs 2 destination"):
        ptx.translate('asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0}, [%1];" : "=r"(x) : "r"(a));')
    with pytest.raises(EmulatorError, match="m16n8k32"):
        ptx.translate('asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0}, {%1}, {%2}, {%3};" '
                      ': "=r"(d) : "r"(a), "r"(b), "r"(c));')


def test_asm_in_inactive_preprocessor_regions_is_left_alone():
    helper = r'''
__device__ __forceinline__ void rammer_named_barrier(int id, int nthreads) {
#ifdef RAMMER_EMULATE
  rammer_emu::bar_sync(id, nthreads, __LINE__);
#else
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(nthreads) : "memory");
#endif
}
#if defined(RAMMER_EMULATE) && 0
  asm volatile("trap;");
#elif !defined(RAMMER_EMULATE)
  asm volatile("exit;");
#endif
'''
    assert ptx.translate(helper) == helper  # nothing translated, nothing refused
    # the same helper without the emulation branch is refused: our own PTX is never rewritten
    with pytest.raises(EmulatorError, match="bar.sync"):
        ptx.translate(helper.replace("#ifdef RAMMER_EMULATE", "#ifdef SOMETHING_ELSE"))
    with pytest.raises(EmulatorError, match=r"bar\.sync"):
        ptx.translate(helper, defines={})


def test_undecidable_regions_are_translated_or_refused_naming_the_condition():
    guarded = r'''
#if (__CUDA_ARCH__ >= 800)
  asm volatile("cp.async.wait_all;" ::: "memory");
#else
  asm volatile("membar.gl;" ::: "memory");
#endif
'''
    with pytest.raises(EmulatorError, match=r"(?s)cannot decide \(#else \(of #if \(__CUDA_ARCH__ >= 800\)\)\).*membar\.gl"):
        ptx.translate(guarded)
    out = ptx.translate(guarded, defines={"RAMMER_EMULATE": "1", "__CUDA_ARCH__": "900"})
    assert "cp_async_wait_all()" in out and 'asm volatile("membar.gl;"' in out
    # macros #defined by the source itself are followed
    local = '#define USE_ASYNC 0\n#if USE_ASYNC\n  asm volatile("membar.gl;");\n#endif\n'
    assert ptx.translate(local) == local


def test_directives_inside_an_asm_statement_keep_both_branches():
    """Older TVM put ``#if TVM_ENABLE_L2_PREFETCH`` between the template strings of cp.async."""
    source = r'''
    __asm__ __volatile__(
      #if TVM_ENABLE_L2_PREFETCH
        "cp.async.cg.shared.global.L2::128B [%0], [%1], %2;"
      #else
        "cp.async.cg.shared.global [%0], [%1], %2;"
      #endif
        :: "r"(addr), "l"((void*)(src)), "n"(16)
    );
'''
    out = ptx.translate(source)
    assert out.count("rammer_emu_mma::cp_async(") == 2 and "#if TVM_ENABLE_L2_PREFETCH" in out
    assert out.rstrip().endswith("#endif\n;")  # whichever branch, one statement ended by the source's ';'
    assert _no_asm_left(out)


def test_asm_labels_barriers_and_macro_bodies():
    label = 'extern "C" int renamed(int) __asm__("real_symbol");\n'
    assert ptx.translate(label) == label
    barrier = 'asm volatile("" ::: "memory");\n'
    assert 'asm volatile("" ::: "memory")' in ptx.translate(barrier)
    with pytest.raises(EmulatorError, match="macro definition"):
        ptx.translate('#define FENCE() asm volatile("fence.proxy.async;" ::: "memory")\n')
    # the preamble's `#define __asm__ asm` is no asm statement
    assert ptx.translate("#define __asm__ asm\n#define __volatile__ volatile\n").startswith("#define")
    # strings and comments that mention asm are not statements
    text = 'const char* s = "asm volatile(\\"trap;\\")"; // asm("trap;")\n/* __asm__("exit;") */\n'
    assert ptx.find_asm(text) == [] and ptx.translate(text) == text
    with pytest.raises(TypeError, match="str"):
        ptx.translate(b"asm")


# ------------------------------------------------------------------ through the runtime
# Hand-written kernels around TVM's exact asm text, built and launched by the emulator's runtime.
MMA_KERNELS = r'''
// D(16x8 f32) = A(16x16, row-major) B + C, B given as Bt (8 x 16: [n][k]): ldmatrix.x4 for A with
// TVM's row addresses, ldmatrix.x2 for B (rows = n), mma m16n8k16 f32 (TVM's MMA_f16f16f32_TRANS_B).
extern "C" __global__ void __launch_bounds__(32) mma_k16_f32(half* __restrict__ A, half* __restrict__ Bt, float* __restrict__ C, float* __restrict__ D) {
  __shared__ __align__(16) half A_s[256];
  __shared__ __align__(16) half B_s[128];
  for (int i = threadIdx.x; i < 256; i += 32) A_s[i] = A[i];
  for (int i = threadIdx.x; i < 128; i += 32) B_s[i] = Bt[i];
  __syncthreads();
  unsigned a[4], b[2];
  float acc[4];
  int g = threadIdx.x / 4, t = threadIdx.x % 4;
  for (int i = 0; i < 4; ++i) acc[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
  {
    unsigned int addr = __cvta_generic_to_shared((&(A_s[(threadIdx.x % 16) * 16 + 8 * (threadIdx.x / 16)])));
    __asm__ __volatile__(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
      "{%0, %1, %2, %3}, [%4];\n"
      : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
      : "r"(addr)
    );
  }
  {
    unsigned int addr = __cvta_generic_to_shared((&(B_s[(threadIdx.x % 8) * 16 + 8 * ((threadIdx.x / 8) % 2)])));
    __asm__ __volatile__(
      "ldmatrix.sync.aligned.m8n8.x2.shared.b16"
      "{%0, %1}, [%2];\n"
      : "=r"(b[0]), "=r"(b[1])
      : "r"(addr)
    );
  }
  {
    __asm__ __volatile__(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      :  "=f"(acc[0]), "=f"(acc[1]), "=f"(acc[2]), "=f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]));
  }
  for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = acc[i];
}

// D(16x8 f16) = A(16x16) B(16x8, [k][n] row-major: ldmatrix.x2.trans) + C(16x8 f16): f16 accumulate.
extern "C" __global__ void __launch_bounds__(32) mma_k16_f16(half* __restrict__ A, half* __restrict__ B, half* __restrict__ C, half* __restrict__ D) {
  __shared__ __align__(16) half A_s[256];
  __shared__ __align__(16) half B_s[128];
  for (int i = threadIdx.x; i < 256; i += 32) A_s[i] = A[i];
  for (int i = threadIdx.x; i < 128; i += 32) B_s[i] = B[i];
  __syncthreads();
  unsigned a[4], b[2], c[2], d[2];
  int g = threadIdx.x / 4, t = threadIdx.x % 4;
  c[0] = ((unsigned*)C)[(g * 8 + 2 * t) / 2];
  c[1] = ((unsigned*)C)[((g + 8) * 8 + 2 * t) / 2];
  unsigned int addr_a = __cvta_generic_to_shared(&A_s[(threadIdx.x % 16) * 16 + 8 * (threadIdx.x / 16)]);
  __asm__ __volatile__("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr_a));
  unsigned int addr_b = __cvta_generic_to_shared(&B_s[(threadIdx.x % 16) * 8]);
  __asm__ __volatile__("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                       : "=r"(b[0]), "=r"(b[1]) : "r"(addr_b));
  __asm__ __volatile__(
    "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16"
    "{%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%8, %9};\n"
    : "=r"(d[0]), "=r"(d[1])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]));
  ((unsigned*)D)[(g * 8 + 2 * t) / 2] = d[0];
  ((unsigned*)D)[((g + 8) * 8 + 2 * t) / 2] = d[1];
}

// D(16x8 f32) = A(16x8: ldmatrix.x2) Bt(8x8 [n][k]: ldmatrix.x1) + 0: mma m16n8k8.
extern "C" __global__ void __launch_bounds__(32) mma_k8_f32(half* __restrict__ A, half* __restrict__ Bt, float* __restrict__ D) {
  __shared__ __align__(16) half A_s[128];
  __shared__ __align__(16) half B_s[64];
  for (int i = threadIdx.x; i < 128; i += 32) A_s[i] = A[i];
  for (int i = threadIdx.x; i < 64; i += 32) B_s[i] = Bt[i];
  __syncthreads();
  unsigned a[2], b[1];
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int g = threadIdx.x / 4, t = threadIdx.x % 4;
  unsigned int addr_a = __cvta_generic_to_shared(&A_s[(threadIdx.x % 16) * 8]);
  __asm__ __volatile__("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                       : "=r"(a[0]), "=r"(a[1]) : "r"(addr_a));
  unsigned int addr_b = __cvta_generic_to_shared(&B_s[(threadIdx.x % 8) * 8]);
  __asm__ __volatile__("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(b[0]) : "r"(addr_b));
  __asm__ __volatile__(
    "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
    : "=f"(acc[0]), "=f"(acc[1]), "=f"(acc[2]), "=f"(acc[3])
    : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]));
  for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = acc[i];
}
'''

ASYNC_KERNEL = r'''
__forceinline__ __device__ void ptx_cp_async_legacy_pred_cg_16_4_4(void* dst, int dst_off, void* src, int src_off, int predicate) {
  uint8_t* dst_p = (uint8_t*)dst + dst_off * 4;
  uint8_t* src_p = (uint8_t*)src + src_off * 4;
  unsigned int dst_addr = __cvta_generic_to_shared(dst_p);
  __asm__ __volatile__(
    "{\n"
    " .reg .pred p;\n"
    " setp.eq.u32 p, %3, 1;\n"
    " @p cp.async.cg.shared.global [%0], [%1], %2;\n"
    " @!p st.shared.v4.u32 [%0], {%4, %4, %4, %4};\n"
    "}\n"
    :: "r"(dst_addr), "l"(src_p), "n"(16), "r"(predicate), "r"(0)
  );
}
__forceinline__ __device__ void tvm_builtin_ptx_cp_async_commit_group_async_commit_group() {
  asm volatile("cp.async.commit_group;" :  : );
}
__forceinline__ __device__ void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_1() {
  asm volatile("cp.async.wait_group 1;" :  :  : "memory");
}
__forceinline__ __device__ void tvm_builtin_ptx_cp_async_wait_group_async_wait_group_0() {
  asm volatile("cp.async.wait_group 0;" :  :  : "memory");
}
// One warp. Group 0: thread t copies x[4t..4t+3] (16 B; predicate t % 3 != 0, else TVM's zero fill)
// to s[4t..]; group 1: y[t] (4 B, the src-size form: src_size[t] bytes copied, the rest zero-filled)
// to s[128 + t]. mode 0: cp.async.wait_all; 1: wait_group 1 (group 1 may still be in flight);
// 2: no wait. Then the block's view of s goes to out (before the final wait of every thread).
extern "C" __global__ void __launch_bounds__(32) async_copy(float* __restrict__ x, float* __restrict__ y, int* __restrict__ src_size, float* __restrict__ out, int mode) {
  __shared__ __align__(16) float s[160];
  int t = threadIdx.x;
  for (int i = t; i < 160; i += 32) s[i] = -1.0f;
  __syncthreads();
  ptx_cp_async_legacy_pred_cg_16_4_4(s, 4 * t, x, 4 * t, t % 3 != 0);
  tvm_builtin_ptx_cp_async_commit_group_async_commit_group();
  {
    unsigned int dst_addr = __cvta_generic_to_shared(s + 128 + t);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst_addr), "l"(y + t), "r"(src_size[t]));
  }
  tvm_builtin_ptx_cp_async_commit_group_async_commit_group();
  if (mode == 0) asm volatile("cp.async.wait_all;" ::: "memory");
  else if (mode == 1) tvm_builtin_ptx_cp_async_wait_group_async_wait_group_1();
  __syncthreads();
  for (int i = t; i < 160; i += 32) out[i] = s[i];
  __syncthreads();
  tvm_builtin_ptx_cp_async_wait_group_async_wait_group_0();
}
// mode 0: copies x into s and exits without waiting; mode 1: s = -2, waits for everything, s -> out
// (a later launch must not complete the earlier launch's copies into its own shared memory).
extern "C" __global__ void __launch_bounds__(32) async_leftover(float* __restrict__ x, float* __restrict__ out, int mode) {
  __shared__ __align__(16) float s[128];
  int t = threadIdx.x;
  if (mode == 0) {
    ptx_cp_async_legacy_pred_cg_16_4_4(s, 4 * t, x, 4 * t, 1);
    tvm_builtin_ptx_cp_async_commit_group_async_commit_group();
    return;
  }
  for (int i = t; i < 128; i += 32) s[i] = -2.0f;
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  for (int i = t; i < 128; i += 32) out[i] = s[i];
}
'''


SCALAR_KERNEL = r'''
// TVM's predicated 32-bit global load (InjectPTXLDG32) and a %laneid read.
extern "C" __global__ void __launch_bounds__(64) ldg32(float* __restrict__ x, float* __restrict__ out, unsigned* __restrict__ lanes) {
  float v;
  int t = threadIdx.x;
  asm volatile (
      "{.reg .pred p;\n"
      " setp.ne.b32 p, %2, 0;\n"
      " @!p mov.b32 %0, 0;\n"
      " @p ld.global.nc.f32 %0, [%1];}\n"
      : "=f"(v)
      : "l"((void*)(x + t)), "r"((int)(t % 3 != 0))
  );
  out[t] = v;
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  // translated statements stay single statements (if / else without braces)
  if (t < 0) asm volatile("" : "+r"(lane) :: "memory"); else lanes[t] = lane;
  if (t < 0) asm volatile("cp.async.wait_all;" ::: "memory"); else lanes[t] += 0;
}
'''


@pytest.fixture(scope="module")
def kernels():
    from tvm_rammer.checks.emulator.build import build_module
    return build_module(MMA_KERNELS + ASYNC_KERNEL + SCALAR_KERNEL)


def _one_warp(module, name, args):
    module.launch(name, args, grid=(1, 1, 1), block=(32, 1, 1))


def test_warp_mma_kernels_match_numpy(kernels):
    rng = np.random.default_rng(5)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    Bt = rng.standard_normal((8, 16)).astype(np.float16)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = np.zeros((16, 8), np.float32)
    _one_warp(kernels, "mma_k16_f32", [A, Bt, C, D])
    np.testing.assert_allclose(D, A.astype(np.float32) @ Bt.astype(np.float32).T + C, rtol=1e-5, atol=1e-5)

    B = rng.standard_normal((16, 8)).astype(np.float16)
    C16 = rng.standard_normal((16, 8)).astype(np.float16)
    D16 = np.zeros((16, 8), np.float16)
    _one_warp(kernels, "mma_k16_f16", [A, B, C16, D16])
    expected = (A.astype(np.float64) @ B.astype(np.float64) + C16).astype(np.float32).astype(np.float16)
    np.testing.assert_allclose(D16.astype(np.float32), expected.astype(np.float32), rtol=1e-3, atol=1e-3)

    A8 = rng.standard_normal((16, 8)).astype(np.float16)
    Bt8 = rng.standard_normal((8, 8)).astype(np.float16)
    D8 = np.zeros((16, 8), np.float32)
    _one_warp(kernels, "mma_k8_f32", [A8, Bt8, D8])
    np.testing.assert_allclose(D8, A8.astype(np.float32) @ Bt8.astype(np.float32).T, rtol=1e-5, atol=1e-5)


def test_cp_async_copies_complete_at_their_wait(kernels):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(128).astype(np.float32)
    y = rng.standard_normal(32).astype(np.float32)
    src_size = np.where(np.arange(32) % 2 == 0, 4, 0).astype(np.int32)
    group0 = np.where((np.arange(128) // 4) % 3 != 0, x, 0)   # predicate false: TVM's zero fill
    group1 = np.where(src_size == 4, y, 0)                     # src-size 0: zero fill
    outs = []
    for mode in range(3):
        out = np.zeros(160, np.float32)
        _one_warp(kernels, "async_copy", [x, y, src_size, out, np.int32(mode)])
        outs.append(out)
    np.testing.assert_array_equal(outs[0], np.concatenate([group0, group1]))
    # wait_group 1: the older group is complete, the newer one not yet (old contents, -1)
    np.testing.assert_array_equal(outs[1], np.concatenate([group0, np.full(32, -1, np.float32)]))
    # no wait: a read of a cp.async destination sees the old contents (a missing wait shows);
    # TVM's zero fill is a plain st.shared, done at once
    stale = np.where((np.arange(128) // 4) % 3 != 0, -1, 0).astype(np.float32)
    np.testing.assert_array_equal(outs[2], np.concatenate([stale, np.full(32, -1, np.float32)]))


# ------------------------------------------------- a TVM-built tensor-core rKernel, end to end

def _async_stages(func):
    """`func` with the first stage of its software pipeline asynchronous (TVM then copies global to
    shared memory with cp.async and waits with commit/wait groups)."""
    import tvm
    import tvm_ffi

    def mark(loop):
        if "software_pipeline_stage" not in loop.annotations:
            return loop
        annotations = dict(loop.annotations, software_pipeline_async_stages=[0])
        return tvm.tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, loop.body, loop.thread_binding,
                            annotations)
    return func.with_body(tvm_ffi.structural_map(func.body, (tvm.tirx.For, mark)))


def _tensor_core_kernel(name, config, asynchronous=False):
    """(CUDA source, LoweredKernel, the operator's PrimFunc): one version of
    tir_templates/mma_templates.py for OPS[name] (+ bias + ReLU, float16), in a one-rTask-per-block
    wrapper (block = the rTask's threads, its shared pool dynamic), as TVM generates it."""
    sys.path.insert(0, os.path.dirname(__file__))
    import tvm
    from test_tensor_cores import _wrapper, fused16
    from tir_templates.mma_templates import schedule_gemm_mma
    from tir_templates.prelower import prelower
    from tvm_rammer.codegen.resources import module_cuda_source

    func = fused16(name)
    scheduled = schedule_gemm_mma(func, *config)
    if asynchronous:
        scheduled = _async_stages(scheduled)
    kernel = prelower(scheduled, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}), name)
    threads = kernel.block[0] * kernel.block[1]
    wrapped = _wrapper(kernel, "shared.dyn", veu_threads=threads).with_attr("global_symbol", "v")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    return module_cuda_source(tvm.tirx.build(tvm.IRModule({"v": wrapped}), target)), kernel, func


def _run_tensor_core_kernel(source, kernel, func, seed=0):
    """(emulated output, numpy reference) of relu(f16(A @ B) + bias) -> float32."""
    import re

    from tvm_rammer.checks.emulator.build import build_module
    module = build_module(source)
    signature = re.search(r"v_kernel\(([^)]*)\)", source).group(1)
    # the wrapper names parameter i "<name>_<i>"; TVM orders the kernel's parameters its own way
    order = [int(re.search(r"_(\d+)_ptr$", arg.strip()).group(1)) for arg in signature.split(",")]
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in func.params[:-1]]
    A, B, bias = inputs
    expected = np.maximum((A.astype(np.float32) @ B.astype(np.float32)).astype(np.float16) + bias, 0)
    out = np.zeros([int(d) for d in func.params[-1].shape], str(func.params[-1].dtype))
    arrays = inputs + [out]
    threads = kernel.block[0] * kernel.block[1]
    module.launch("v_kernel", [arrays[i] for i in order], grid=(kernel.num_rtasks, 1, 1),
                  block=(threads, 1, 1), dyn_smem=kernel.shared_bytes)
    return out.astype(np.float32), expected.astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name, config, asynchronous", [
    ("matmul", (2, 2, 2, 2, 32), False), ("dense_b8", (1, 1, 1, 1, 64), False),
    ("matmul", (1, 2, 2, 2, 32), False), ("matmul", (1, 2, 2, 2, 32), True)])
def test_a_tvm_built_tensor_core_rkernel_runs_in_the_emulator(name, config, asynchronous):
    """A float16 tensor-core version of mma_templates (ldmatrix.x4 + mma m16n8k16 f32 per warp,
    shared tiles, fused bias + ReLU) built by TVM, run on the CPU, against numpy at float16
    tolerance; with two A registers swapped in its mma asm the same comparison fails.

    (1, 2, 2, 2, 32): StorageRewrite declares views on the B tile (the accumulator tile reuses its
    memory); rtask_rewrite placed them at pool offset 0, over the A tiles, until views took their
    allocation's offset (every output was wrong, on a GPU too). Asynchronous: TVM's cp.async copies
    (16 bytes, commit/wait groups) fill the A tiles; their destination offset, counted in float16
    elements, was taken as bytes of the uint8 pool until rtask_rewrite converted it."""
    source, kernel, func = _tensor_core_kernel(name, config, asynchronous)
    kinds = {ptx._instructions(s.template)[0].split("{")[0].split()[0]
             for s in ptx.find_asm(source) if not ptx._parse_statement(s, source) and s.template}
    assert {"ldmatrix.sync.aligned.m8n8.x4.shared.b16", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"} <= kinds
    if asynchronous:
        assert {"cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group"} <= kinds
    got, expected = _run_tensor_core_kernel(source, kernel, func)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
    assert np.abs(expected).max() > 1  # not a vacuous comparison of zeros
    # negative control: a wrong A fragment (registers a0 and a1 exchanged) is caught
    wrong = source.replace("{%0, %1, %2, %3}, {%4, %5, %6, %7}", "{%0, %1, %2, %3}, {%5, %4, %6, %7}")
    assert wrong != source
    bad, expected = _run_tensor_core_kernel(wrong, kernel, func)
    assert not np.allclose(bad, expected, rtol=1e-2, atol=1e-2)


def test_predicated_global_load_and_laneid(kernels):
    x = np.arange(1, 65, dtype=np.float32)
    out = np.full(64, np.nan, np.float32)
    lanes = np.zeros(64, np.uint32)
    kernels.launch("ldg32", [x, out, lanes], grid=(1, 1, 1), block=(64, 1, 1))
    np.testing.assert_array_equal(out, np.where(np.arange(64) % 3 != 0, x, 0))
    np.testing.assert_array_equal(lanes, np.arange(64) % 32)


def test_copies_a_kernel_never_waited_for_do_not_reach_a_later_launch(kernels):
    x = np.arange(128, dtype=np.float32)
    out = np.zeros(128, np.float32)
    _one_warp(kernels, "async_leftover", [x, out, np.int32(0)])
    _one_warp(kernels, "async_leftover", [x, out, np.int32(1)])
    np.testing.assert_array_equal(out, np.full(128, -2, np.float32))
