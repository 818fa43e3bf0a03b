// rammer_emu_mma.h: CPU emulation of the tensor-core PTX that TVM's CUDA code generator emits
// (ldmatrix, mma.sync, cp.async and the few scalar instructions of its predicated helpers).
//
// tvm_rammer/checks/emulator/ptx.py rewrites every inline-asm statement it knows into calls of the
// functions below (one `do { ... } while (0)` block per statement); anything else fails the build.
//
// Two layers:
//  * the fragment math (namespace rammer_emu_mma, functions `*_exec`): whole-warp operations on
//    arrays indexed by lane, written from the PTX ISA's fragment layouts (sections "Matrix
//    fragments for mma.m16n8k16 / mma.m16n8k8" and "ldmatrix"). No runtime needed: tests call
//    them directly (define RAMMER_EMU_MMA_MATH_ONLY before including this header).
//  * the per-lane entry points (ldmatrix, mma, cp_async*, ...) used by the translated source:
//    the warp collectives go through rammer_emu::warp_collective (EMU_DESIGN.md), each lane
//    passing its own registers; shared-memory addresses arrive as the 32-bit offsets of
//    __cvta_generic_to_shared and map back with rammer_emu::shared_ptr in the lane's own context.
//
// Values cross as 32-bit register bit patterns ("r" operands; "f" ones as their float bits).
// 16-bit elements: the lower-indexed element of a pair is in the low half of the register.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace rammer_emu_mma {

// ------------------------------------------------------------------------------ scalar helpers

// IEEE binary16 <-> float (round to nearest even), written out so no compiler extension is needed.
inline float f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return sign | (absx > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN / inf
  if (absx >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: inf
  if (absx < 0x38800000u) {                        // below the smallest normal: subnormal or 0
    if (absx < 0x33000000u) return sign;           // < 2^-25: rounds to zero
    uint32_t man = (absx & 0x7fffff) | 0x800000;
    int shift = 126 - (int)(absx >> 23);           // 14 + (113 - exp)
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return sign | (uint16_t)half;
  }
  uint32_t half = ((absx >> 23) - 112) << 10 | ((absx >> 13) & 0x3ff), rem = absx & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return sign | (uint16_t)half;
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Operand conversions of the translated asm: an "r"/"h"/"l"/"f"/"d" operand takes the bits of a
// same-sized value (as the register would hold them) and converts integers of other widths.
template <class R, class T>
inline R reg(const T& v) {
  if constexpr (std::is_pointer_v<T>) {
    return (R)(uintptr_t)v;
  } else if constexpr (sizeof(T) == sizeof(R) && std::is_trivially_copyable_v<T>) {
    R r;
    std::memcpy(&r, &v, sizeof(R));
    return r;
  } else {
    return (R)v;
  }
}

// Output write-back: the register's bits into the C++ lvalue of the asm output operand.
template <class T, class R>
inline void assign(T& dst, const R& v) {
  if constexpr (sizeof(T) == sizeof(R) && std::is_trivially_copyable_v<T>) {
    std::memcpy(&dst, &v, sizeof(R));
  } else {
    dst = (T)v;
  }
}

// ------------------------------------------------------------------------------ fragment math

enum Type : int { F32 = 0, F16 = 1, BF16 = 2 };

inline float elem_to_float(int type, uint16_t v) { return type == BF16 ? bf16_to_float(v) : f16_to_float(v); }
inline uint16_t half_of(uint32_t reg, int which) { return (uint16_t)(which ? reg >> 16 : reg & 0xffff); }

// ldmatrix.sync.aligned.m8n8.x{num}{.trans}.shared.b16 over a whole warp.
// rows[m * 8 + r] = the address of row r (8 consecutive 16-bit elements) of matrix m, as supplied
// by lane m * 8 + r; out[lane][m] = lane's register m: elements (lane / 4, 2 * (lane % 4) + {0, 1})
// of matrix m (of its transpose with .trans). Lanes with present[lane] == 0 receive nothing.
inline void ldmatrix_exec(int num, bool trans, const void* const* rows, uint32_t (*out)[4],
                          const bool* present) {
  for (int lane = 0; lane < 32; ++lane) {
    if (present && !present[lane]) continue;
    int r = lane / 4, c = 2 * (lane % 4);
    for (int m = 0; m < num; ++m) {
      uint16_t e[2];
      for (int j = 0; j < 2; ++j) {
        int row = trans ? c + j : r, col = trans ? r : c + j;
        std::memcpy(&e[j], (const unsigned char*)rows[m * 8 + row] + 2 * col, 2);
      }
      out[lane][m] = (uint32_t)e[0] | (uint32_t)e[1] << 16;
    }
  }
}

// mma.sync.aligned.m16n8k{K}.row.col.{dtype}.{atype}.{btype}.{ctype} over a whole warp, K = 8 or
// 16, 16-bit A/B (f16 or bf16), C/D f32 (4 registers) or f16 (2 registers of pairs).
// a[lane] / b[lane] / c[lane] / d[lane]: that lane's registers in the ISA's order.
//   groupID g = lane / 4, threadID_in_group t = lane % 4, element i of a fragment:
//   A (16 x K, row): row g + 8 * ((i / 2) % 2), col 2t + i % 2 + 8 * (i / 4)   (K = 16: a0..a7)
//                    row g + 8 * (i / 2),       col 2t + i % 2                 (K = 8:  a0..a3)
//   B (K x 8, col):  row 2t + i % 2 + 8 * (i / 2), col g                       (b0..b3 / b0..b1)
//   C, D (16 x 8):   row g + 8 * (i / 2), col 2t + i % 2                       (c0..c3)
// Products and sums in float; an f16 D is rounded once at the end.
inline int mma_a_regs(int k) { return k / 4; }
inline int mma_b_regs(int k) { return k / 8; }
inline int mma_c_regs(int type) { return type == F32 ? 4 : 2; }

inline void mma_exec(int k, int dtype, int atype, int btype, int ctype, const uint32_t (*a)[4],
                     const uint32_t (*b)[2], const uint32_t (*c)[4], uint32_t (*d)[4]) {
  float A[16][16] = {}, B[16][8] = {}, C[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 2 * mma_a_regs(k); ++i) {
      int row = k == 16 ? g + 8 * ((i / 2) % 2) : g + 8 * (i / 2);
      int col = 2 * t + i % 2 + (k == 16 ? 8 * (i / 4) : 0);
      A[row][col] = elem_to_float(atype, half_of(a[lane][i / 2], i % 2));
    }
    for (int i = 0; i < 2 * mma_b_regs(k); ++i)
      B[2 * t + i % 2 + 8 * (i / 2)][g] = elem_to_float(btype, half_of(b[lane][i / 2], i % 2));
    for (int i = 0; i < 4; ++i) {
      float v = ctype == F32 ? bits_to_float(c[lane][i])
                             : elem_to_float(ctype, half_of(c[lane][i / 2], i % 2));
      C[g + 8 * (i / 2)][2 * t + i % 2] = v;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    int g = lane / 4, t = lane % 4;
    uint16_t h[4];
    for (int i = 0; i < 4; ++i) {
      int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      float acc = C[row][col];
      for (int kk = 0; kk < k; ++kk) acc += A[row][kk] * B[kk][col];
      if (dtype == F32) {
        d[lane][i] = float_to_bits(acc);
      } else {
        h[i] = dtype == BF16 ? float_to_bf16(acc) : float_to_f16(acc);
      }
    }
    if (dtype != F32) {
      d[lane][0] = (uint32_t)h[0] | (uint32_t)h[1] << 16;
      d[lane][1] = (uint32_t)h[2] | (uint32_t)h[3] << 16;
    }
  }
}

}  // namespace rammer_emu_mma

#ifndef RAMMER_EMU_MMA_MATH_ONLY
// ------------------------------------------------------------------ per-lane entry points
// Need the runtime (rammer_emu::warp_collective, lane_id, shared_ptr, shared_base; threadIdx and
// blockDim), which the emulator's build includes before this header.

#include <deque>
#include <map>
#include <utility>
#include <vector>

#ifndef RAMMER_EMU_SITE
#error "rammer_emu_mma.h needs the emulator's runtime first (rammer_emu.h includes it in order)"
#endif

namespace rammer_emu_mma {

struct LdmatrixIn { const void* row; };
struct LdmatrixOut { uint32_t regs[4]; };
struct LdmatrixCtx { int num; bool trans; };

inline void ldmatrix_collective(const void* const* ins, void* const* outs, unsigned mask, const void* ctx) {
  (void)mask;
  const LdmatrixCtx* p = (const LdmatrixCtx*)ctx;
  const void* rows[32] = {};
  uint32_t out[32][4] = {};
  bool present[32];
  for (int lane = 0; lane < 32; ++lane) {
    present[lane] = outs[lane] != nullptr;
    if (ins[lane]) rows[lane] = ((const LdmatrixIn*)ins[lane])->row;
  }
  static const unsigned char zeros[16] = {};
  for (int i = 0; i < 8 * p->num; ++i)
    if (!rows[i]) rows[i] = zeros;  // a row whose lane is absent: reads as zeros
  ldmatrix_exec(p->num, p->trans, rows, out, present);
  for (int lane = 0; lane < 32; ++lane)
    if (outs[lane]) std::memcpy(((LdmatrixOut*)outs[lane])->regs, out[lane], sizeof(out[lane]));
}

// One lane's part of ldmatrix: `addr` its row address (meaningful for lanes < 8 * num), d its
// `num` destination registers.
inline void ldmatrix(const void* site, int num, bool trans, uint32_t addr, uint32_t* d) {
  LdmatrixIn in{nullptr};
  if ((int)rammer_emu::lane_id() < 8 * num) in.row = rammer_emu::shared_ptr(addr);
  LdmatrixOut out{};
  LdmatrixCtx ctx{num, trans};
  rammer_emu::warp_collective(site, 0xffffffffu, &in, &out, ldmatrix_collective, &ctx);
  for (int m = 0; m < num; ++m) d[m] = out.regs[m];
}

struct MmaIn { uint32_t a[4], b[2], c[4]; };
struct MmaOut { uint32_t d[4]; };
struct MmaCtx { int k, dtype, atype, btype, ctype; };

inline void mma_collective(const void* const* ins, void* const* outs, unsigned mask, const void* ctx) {
  (void)mask;
  const MmaCtx* p = (const MmaCtx*)ctx;
  uint32_t a[32][4] = {}, b[32][2] = {}, c[32][4] = {}, d[32][4] = {};
  for (int lane = 0; lane < 32; ++lane) {
    if (!ins[lane]) continue;  // an absent lane's fragment elements read as zeros
    const MmaIn* in = (const MmaIn*)ins[lane];
    std::memcpy(a[lane], in->a, sizeof(a[lane]));
    std::memcpy(b[lane], in->b, sizeof(b[lane]));
    std::memcpy(c[lane], in->c, sizeof(c[lane]));
  }
  mma_exec(p->k, p->dtype, p->atype, p->btype, p->ctype, a, b, c, d);
  for (int lane = 0; lane < 32; ++lane)
    if (outs[lane]) std::memcpy(((MmaOut*)outs[lane])->d, d[lane], sizeof(d[lane]));
}

// One lane's part of mma.sync.aligned.m16n8k{k}.row.col: its A, B, C registers in, D out.
inline void mma(const void* site, int k, int dtype, int atype, int btype, int ctype,
                const uint32_t* a, const uint32_t* b, const uint32_t* c, uint32_t* d) {
  MmaIn in{};
  std::memcpy(in.a, a, 4 * mma_a_regs(k));
  std::memcpy(in.b, b, 4 * mma_b_regs(k));
  std::memcpy(in.c, c, 4 * mma_c_regs(ctype));
  MmaOut out{};
  MmaCtx ctx{k, dtype, atype, btype, ctype};
  rammer_emu::warp_collective(site, 0xffffffffu, &in, &out, mma_collective, &ctx);
  std::memcpy(d, out.d, 4 * mma_c_regs(dtype));
}

// ------------------------------------------------------------------ cp.async (per thread)
// Copies are queued per CUDA thread and performed when a wait makes them complete (the ISA's
// weakest behaviour): `cp.async.commit_group` closes the open group, `cp.async.wait_group N`
// completes all but the N most recent committed groups, `cp.async.wait_all` everything. A kernel
// that reads the destination before waiting sees the old contents, as it may on a GPU.
// The queues are keyed by (the block's shared arena, the thread's index in the block); an entry is
// dropped once empty. One left non-empty by a kernel that exited without waiting (its copies would
// complete at kernel exit on a GPU, unobservably) is discarded by a later launch: each queue
// remembers the launch it belongs to (the runtime's launch start time).
struct AsyncCopy { void* dst; const void* src; int cp_size, src_size; };
struct AsyncQueue {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;
  long long launch_s = -1, launch_ns = -1;  // rammer_emu::g_launch.t0 of the owning launch
};
using AsyncKey = std::pair<const void*, unsigned>;

inline std::map<AsyncKey, AsyncQueue>& async_queues() {
  static std::map<AsyncKey, AsyncQueue> queues;  // one launch runs at a time (rammer_emu::g_launch)
  return queues;
}

inline AsyncKey async_key() {
  unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  return {(const void*)rammer_emu::shared_base(), tid};
}

inline AsyncQueue& async_queue() {
  AsyncQueue& q = async_queues()[async_key()];
  const auto& t0 = rammer_emu::g_launch.t0;
  if (q.launch_s != (long long)t0.tv_sec || q.launch_ns != (long long)t0.tv_nsec) {
    q = AsyncQueue{};  // new, or left over by an earlier launch
    q.launch_s = (long long)t0.tv_sec;
    q.launch_ns = (long long)t0.tv_nsec;
  }
  return q;
}

inline void async_release(AsyncQueue& q) {
  if (q.open.empty() && q.committed.empty()) async_queues().erase(async_key());
}

inline void run_copies(const std::vector<AsyncCopy>& copies) {
  for (const AsyncCopy& c : copies) {
    int n = c.src_size < c.cp_size ? c.src_size : c.cp_size;
    if (n > 0) std::memcpy(c.dst, c.src, n);
    if (n < c.cp_size) std::memset((unsigned char*)c.dst + (n > 0 ? n : 0), 0, c.cp_size - (n > 0 ? n : 0));
  }
}

// cp.async.{ca,cg}.shared.global [dst], [src], cp_size{, src_size}: src_size < cp_size zero-fills
// the rest of the cp_size bytes at dst.
inline void cp_async(uint32_t dst, const void* src, long long cp_size, long long src_size) {
  async_queue().open.push_back({rammer_emu::shared_ptr(dst), src, (int)cp_size, (int)src_size});
}

inline void cp_async_commit_group() {
  AsyncQueue& q = async_queue();
  q.committed.push_back(std::move(q.open));  // an empty group too: wait_group counts groups
  q.open.clear();
}

inline void cp_async_wait_group(long long n) {
  AsyncQueue& q = async_queue();
  while ((long long)q.committed.size() > n) {
    run_copies(q.committed.front());
    q.committed.pop_front();
  }
  async_release(q);
}

inline void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group(0);
}

// st.shared.{b32,u32,s32,v2.*,v4.*} [addr], {v...}
inline void st_shared_u32(uint32_t addr, const uint32_t* v, int n) {
  std::memcpy(rammer_emu::shared_ptr(addr), v, 4 * n);
}

}  // namespace rammer_emu_mma
#endif  // RAMMER_EMU_MMA_MATH_ONLY
