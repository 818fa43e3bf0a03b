// rammer_emu_cuda.h: the CUDA device surface that TVM-generated code uses, on top of rammer_emu_runtime.h.
// Synchronisation points record the source line of their call site (macros), for deadlock reports.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <climits>
#include <cfloat>
#include <algorithm>

// ---------------------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
#ifndef __CUDACC_VER_MAJOR__
#define __CUDACC_VER_MAJOR__ 12
#define __CUDACC_VER_MINOR__ 8  // 12.8: cuda_fp16.h has htanh (rammer_emu_half.h), TVM's preamble must not add it
#endif
#define CUDART_VERSION 12080
#define warpSize 32
#define RAMMER_EMU_SITE ([]() -> const void* { static const char rammer_emu_site_ = 0; return &rammer_emu_site_; }())

#include "rammer_emu_half.h"

// ---------------------------------------------------------------------------- vector types
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(const rammer_emu::uint3_t& u) : x(u.x), y(u.y), z(u.z) {}
};

#define RAMMER_EMU_VEC1(T, N, A) struct __align__(A) N##1 { T x; }; \
  inline N##1 make_##N##1(T x) { N##1 r; r.x = x; return r; }
#define RAMMER_EMU_VEC2(T, N, A) struct __align__(A) N##2 { T x, y; }; \
  inline N##2 make_##N##2(T x, T y) { N##2 r; r.x = x; r.y = y; return r; }
#define RAMMER_EMU_VEC3(T, N) struct N##3 { T x, y, z; }; \
  inline N##3 make_##N##3(T x, T y, T z) { N##3 r; r.x = x; r.y = y; r.z = z; return r; }
#define RAMMER_EMU_VEC4(T, N, A) struct __align__(A) N##4 { T x, y, z, w; }; \
  inline N##4 make_##N##4(T x, T y, T z, T w) { N##4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r; }
#define RAMMER_EMU_VECS(T, N, S) RAMMER_EMU_VEC1(T, N, S) RAMMER_EMU_VEC2(T, N, 2 * S) RAMMER_EMU_VEC3(T, N) \
  RAMMER_EMU_VEC4(T, N, (4 * S > 16 ? 16 : 4 * S))
RAMMER_EMU_VECS(signed char, char, 1)
RAMMER_EMU_VECS(unsigned char, uchar, 1)
RAMMER_EMU_VECS(short, short, 2)
RAMMER_EMU_VECS(unsigned short, ushort, 2)
RAMMER_EMU_VECS(int, int, 4)
RAMMER_EMU_VECS(unsigned int, uint, 4)
RAMMER_EMU_VECS(long, long, 8)
RAMMER_EMU_VECS(unsigned long, ulong, 8)
RAMMER_EMU_VECS(long long, longlong, 8)
RAMMER_EMU_VECS(unsigned long long, ulonglong, 8)
RAMMER_EMU_VECS(float, float, 4)
RAMMER_EMU_VECS(double, double, 8)
#undef RAMMER_EMU_VECS
#undef RAMMER_EMU_VEC1
#undef RAMMER_EMU_VEC2
#undef RAMMER_EMU_VEC3
#undef RAMMER_EMU_VEC4

// ---------------------------------------------------------------------------- indices
#define threadIdx (::rammer_emu::g_cur->tidx)
#define blockIdx (::rammer_emu::g_cur->block->bidx)
#define blockDim (::rammer_emu::g_launch.bdim)
#define gridDim (::rammer_emu::g_launch.gdim)

// ---------------------------------------------------------------------------- synchronisation
#define __syncthreads() ::rammer_emu::syncthreads(__LINE__)
#define __syncthreads_or(p) ::rammer_emu::syncthreads_or((p) ? 1 : 0, __LINE__)
#define __syncthreads_and(p) ::rammer_emu::syncthreads_and((p) ? 1 : 0, __LINE__)
#define __syncthreads_count(p) ::rammer_emu::syncthreads_count((p) ? 1 : 0, __LINE__)
#define __nanosleep(ns) ::rammer_emu::spin_yield("__nanosleep", __LINE__)
#define __trap() ::rammer_emu::trap("__trap()", __LINE__)
#define __brkpt() ::rammer_emu::trap("__brkpt()", __LINE__)
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); ::rammer_emu::note_progress(); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); ::rammer_emu::note_progress(); }
inline long long clock64() { return static_cast<long long>(::rammer_emu::globaltimer()); }
inline unsigned long long __globaltimer() { return ::rammer_emu::globaltimer(); }

namespace rammer_emu {
// virtual %smid: the block's linear id modulo a nominal 132 SMs
inline unsigned smid() { return g_cur->block->linear % 132u; }
template <class T> inline T load_acquire(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <class T> inline T load_relaxed(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <class T> inline void store_release(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); note_progress(); }
template <class T> inline void red_add_release(T* p, T v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); note_progress(); }
template <class T> inline T fetch_add_acq_rel(T* p, T v) { T o = __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); note_progress(); return o; }

// ---- warp collectives of the CUDA surface (shuffles, votes, activemask, syncwarp)
struct ShflIn { uint64_t bits; int arg; int width; };
enum : int { SHFL_IDX = 0, SHFL_UP, SHFL_DOWN, SHFL_XOR };
constexpr uint64_t SHFL_UNDEFINED = 0x7fbadbad7fbadbadull;  // NaN as a float and as a double
template <int MODE> inline void shfl_fn(const void* const* ins, void* const* outs, unsigned mask, const void* ctx) {
  const size_t size = reinterpret_cast<size_t>(ctx);
  for (int l = 0; l < 32; ++l) {
    if (!outs[l]) continue;
    const ShflIn* in = static_cast<const ShflIn*>(ins[l]);
    int w = in->width;
    if (w <= 0 || w > 32 || (w & (w - 1))) w = 32;
    const int base = l & ~(w - 1);
    int src = l;
    if (MODE == SHFL_IDX) src = base + (in->arg & (w - 1));
    else if (MODE == SHFL_UP) src = (l - in->arg >= base) ? l - in->arg : l;
    else if (MODE == SHFL_DOWN) src = (l + in->arg < base + w) ? l + in->arg : l;
    else { src = l ^ in->arg; if (src < base || src >= base + w) src = l; }
    if (src != l && !(mask >> src & 1u)) {
      // the source lane does not take part: undefined on the GPU, a NaN pattern here, so that a
      // result depending on it shows (a source past the width is the lane's own value, as in CUDA)
      memcpy(outs[l], &SHFL_UNDEFINED, size);
      continue;
    }
    memcpy(outs[l], &static_cast<const ShflIn*>(ins[src])->bits, size);
  }
}
template <int MODE, class T>
inline T shfl(const void* site, int line, unsigned mask, T var, int arg, int width = 32) {
  static_assert(sizeof(T) <= 8, "__shfl_*sync of a type wider than 8 bytes");
  ShflIn in{0, arg, width};
  memcpy(&in.bits, &var, sizeof(T));
  T out;
  warp_collective_at(site, mask, &in, &out, &shfl_fn<MODE>, reinterpret_cast<const void*>(sizeof(T)), line);
  return out;
}
inline void activemask_fn(const void* const*, void* const* outs, unsigned mask, const void*) {
  for (int l = 0; l < 32; ++l) if (outs[l]) *static_cast<unsigned*>(outs[l]) = mask;
}
inline unsigned activemask(const void* site, int line) {
  unsigned out = 0;
  warp_collective_at(site, 0, nullptr, &out, &activemask_fn, nullptr, line);
  return out;
}
enum : int { VOTE_BALLOT = 0, VOTE_ANY, VOTE_ALL, VOTE_SYNC, MATCH_ANY, RED_ADD, RED_MIN, RED_MAX, RED_AND, RED_OR, RED_XOR, RED_UMIN, RED_UMAX };
inline void vote_fn(const void* const* ins, void* const* outs, unsigned mask, const void* ctx) {
  const int op = static_cast<int>(reinterpret_cast<intptr_t>(ctx));
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) if (ins[l] && *static_cast<const int64_t*>(ins[l])) ballot |= 1u << l;
  int64_t acc = 0;
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (!ins[l]) continue;
    const int64_t v = *static_cast<const int64_t*>(ins[l]);
    const uint32_t u = static_cast<uint32_t>(v);
    if (first) { acc = op >= RED_UMIN ? int64_t(u) : v; first = false; continue; }
    switch (op) {
      case RED_ADD: acc = int64_t(uint32_t(acc) + u); break;
      case RED_MIN: acc = std::min<int64_t>(acc, int32_t(v)); break;
      case RED_MAX: acc = std::max<int64_t>(acc, int32_t(v)); break;
      case RED_UMIN: acc = std::min<int64_t>(acc, u); break;
      case RED_UMAX: acc = std::max<int64_t>(acc, u); break;
      case RED_AND: acc &= v; break;
      case RED_OR: acc |= v; break;
      case RED_XOR: acc ^= v; break;
      default: break;
    }
  }
  for (int l = 0; l < 32; ++l) {
    if (!outs[l]) continue;
    int64_t r = 0;
    switch (op) {
      case VOTE_BALLOT: r = ballot; break;
      case VOTE_ANY: r = ballot != 0; break;
      case VOTE_ALL: r = ballot == mask; break;
      case VOTE_SYNC: r = 0; break;
      case MATCH_ANY: {
        unsigned m = 0;
        for (int k = 0; k < 32; ++k)
          if (ins[k] && *static_cast<const int64_t*>(ins[k]) == *static_cast<const int64_t*>(ins[l])) m |= 1u << k;
        r = m;
        break;
      }
      default: r = acc;
    }
    *static_cast<int64_t*>(outs[l]) = r;
  }
}
inline int64_t vote(const void* site, int line, int op, unsigned mask, int64_t v) {
  int64_t out = 0;
  warp_collective_at(site, mask, &v, &out, &vote_fn, reinterpret_cast<const void*>(intptr_t(op)), line);
  return out;
}
template <class T> inline int64_t bits64(T v) {
  int64_t r = 0;
  memcpy(&r, &v, sizeof(T) < 8 ? sizeof(T) : 8);
  return r;
}
}  // namespace rammer_emu

#define __activemask() ::rammer_emu::activemask(RAMMER_EMU_SITE, __LINE__)
#define __shfl_sync(m, ...) ::rammer_emu::shfl<::rammer_emu::SHFL_IDX>(RAMMER_EMU_SITE, __LINE__, (m), __VA_ARGS__)
#define __shfl_up_sync(m, ...) ::rammer_emu::shfl<::rammer_emu::SHFL_UP>(RAMMER_EMU_SITE, __LINE__, (m), __VA_ARGS__)
#define __shfl_down_sync(m, ...) ::rammer_emu::shfl<::rammer_emu::SHFL_DOWN>(RAMMER_EMU_SITE, __LINE__, (m), __VA_ARGS__)
#define __shfl_xor_sync(m, ...) ::rammer_emu::shfl<::rammer_emu::SHFL_XOR>(RAMMER_EMU_SITE, __LINE__, (m), __VA_ARGS__)
#define __shfl(...) ::rammer_emu::shfl<::rammer_emu::SHFL_IDX>(RAMMER_EMU_SITE, __LINE__, 0xffffffffu, __VA_ARGS__)
#define __shfl_up(...) ::rammer_emu::shfl<::rammer_emu::SHFL_UP>(RAMMER_EMU_SITE, __LINE__, 0xffffffffu, __VA_ARGS__)
#define __shfl_down(...) ::rammer_emu::shfl<::rammer_emu::SHFL_DOWN>(RAMMER_EMU_SITE, __LINE__, 0xffffffffu, __VA_ARGS__)
#define __shfl_xor(...) ::rammer_emu::shfl<::rammer_emu::SHFL_XOR>(RAMMER_EMU_SITE, __LINE__, 0xffffffffu, __VA_ARGS__)
#define __ballot_sync(m, p) static_cast<unsigned>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::VOTE_BALLOT, (m), (p) ? 1 : 0))
#define __any_sync(m, p) static_cast<int>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::VOTE_ANY, (m), (p) ? 1 : 0))
#define __all_sync(m, p) static_cast<int>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::VOTE_ALL, (m), (p) ? 1 : 0))
#define __uni_sync(m, p) static_cast<int>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::VOTE_ALL, (m), (p) ? 1 : 0))
#define __match_any_sync(m, v) static_cast<unsigned>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::MATCH_ANY, (m), ::rammer_emu::bits64(v)))
#define __reduce_add_sync(m, v) static_cast<unsigned>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::RED_ADD, (m), (v)))
#define __reduce_min_sync(m, v) static_cast<decltype(v)>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, std::is_signed<decltype(v)>::value ? ::rammer_emu::RED_MIN : ::rammer_emu::RED_UMIN, (m), (v)))
#define __reduce_max_sync(m, v) static_cast<decltype(v)>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, std::is_signed<decltype(v)>::value ? ::rammer_emu::RED_MAX : ::rammer_emu::RED_UMAX, (m), (v)))
#define __reduce_and_sync(m, v) static_cast<unsigned>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::RED_AND, (m), (v)))
#define __reduce_or_sync(m, v) static_cast<unsigned>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::RED_OR, (m), (v)))
#define __reduce_xor_sync(m, v) static_cast<unsigned>(::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::RED_XOR, (m), (v)))
#define __syncwarp(...) ((void)::rammer_emu::vote(RAMMER_EMU_SITE, __LINE__, ::rammer_emu::VOTE_SYNC, ::rammer_emu::syncwarp_mask(__VA_ARGS__), 0))
namespace rammer_emu {
inline unsigned syncwarp_mask() { return 0xffffffffu; }
inline unsigned syncwarp_mask(unsigned m) { return m; }
}  // namespace rammer_emu

// ---------------------------------------------------------------------------- atomics
// One OS thread runs a launch and fibers switch only at synchronisation points, so every
// read-modify-write is atomic by construction; __atomic builtins keep the compiler honest.
#define RAMMER_EMU_ATOMIC_ALL_SCOPES(ret, name, params, args) \
  inline ret name##_block params { return name args; } \
  inline ret name##_system params { return name args; }
template <class T> inline T rammer_emu_rmw_(T* p, T v, int op) {
  ::rammer_emu::note_progress();
  T old;
  memcpy(&old, p, sizeof(T));
  T nv = old;
  switch (op) {
    case 0: nv = old + v; break;
    case 1: nv = old - v; break;
    case 2: nv = v; break;
    case 3: nv = v < old ? v : old; break;
    case 4: nv = v > old ? v : old; break;
    default: break;
  }
  memcpy(p, &nv, sizeof(T));
  return old;
}
#define RAMMER_EMU_ATOMIC(T)                                                                    \
  inline T atomicAdd(T* p, T v) { return rammer_emu_rmw_<T>(p, v, 0); }                         \
  inline T atomicSub(T* p, T v) { return rammer_emu_rmw_<T>(p, v, 1); }                         \
  inline T atomicExch(T* p, T v) { return rammer_emu_rmw_<T>(p, v, 2); }                        \
  inline T atomicMin(T* p, T v) { return rammer_emu_rmw_<T>(p, v, 3); }                         \
  inline T atomicMax(T* p, T v) { return rammer_emu_rmw_<T>(p, v, 4); }                         \
  inline T atomicCAS(T* p, T cmp, T v) {                                                        \
    ::rammer_emu::note_progress();                                                              \
    T old = *p;                                                                                 \
    if (old == cmp) *p = v;                                                                     \
    return old;                                                                                 \
  }                                                                                             \
  RAMMER_EMU_ATOMIC_ALL_SCOPES(T, atomicAdd, (T* p, T v), (p, v))                               \
  RAMMER_EMU_ATOMIC_ALL_SCOPES(T, atomicSub, (T* p, T v), (p, v))                               \
  RAMMER_EMU_ATOMIC_ALL_SCOPES(T, atomicExch, (T* p, T v), (p, v))                              \
  RAMMER_EMU_ATOMIC_ALL_SCOPES(T, atomicMin, (T* p, T v), (p, v))                               \
  RAMMER_EMU_ATOMIC_ALL_SCOPES(T, atomicMax, (T* p, T v), (p, v))                               \
  RAMMER_EMU_ATOMIC_ALL_SCOPES(T, atomicCAS, (T* p, T c, T v), (p, c, v))
RAMMER_EMU_ATOMIC(int)
RAMMER_EMU_ATOMIC(unsigned int)
RAMMER_EMU_ATOMIC(long long)
RAMMER_EMU_ATOMIC(unsigned long long)
RAMMER_EMU_ATOMIC(unsigned short)
#undef RAMMER_EMU_ATOMIC
inline float atomicAdd(float* p, float v) { return rammer_emu_rmw_<float>(p, v, 0); }
inline double atomicAdd(double* p, double v) { return rammer_emu_rmw_<double>(p, v, 0); }
inline float atomicExch(float* p, float v) { return rammer_emu_rmw_<float>(p, v, 2); }
inline float atomicMax(float* p, float v) { return rammer_emu_rmw_<float>(p, v, 4); }
inline float atomicMin(float* p, float v) { return rammer_emu_rmw_<float>(p, v, 3); }
inline __half atomicAdd(__half* p, __half v) { ::rammer_emu::note_progress(); __half o = *p; *p = o + v; return o; }
inline __half2 atomicAdd(__half2* p, __half2 v) { ::rammer_emu::note_progress(); __half2 o = *p; *p = o + v; return o; }
RAMMER_EMU_ATOMIC_ALL_SCOPES(float, atomicAdd, (float* p, float v), (p, v))
RAMMER_EMU_ATOMIC_ALL_SCOPES(double, atomicAdd, (double* p, double v), (p, v))
RAMMER_EMU_ATOMIC_ALL_SCOPES(float, atomicExch, (float* p, float v), (p, v))
#define RAMMER_EMU_ATOMIC_BITS(T)                                                             \
  inline T atomicAnd(T* p, T v) { ::rammer_emu::note_progress(); T o = *p; *p = o & v; return o; } \
  inline T atomicOr(T* p, T v) { ::rammer_emu::note_progress(); T o = *p; *p = o | v; return o; }  \
  inline T atomicXor(T* p, T v) { ::rammer_emu::note_progress(); T o = *p; *p = o ^ v; return o; }
RAMMER_EMU_ATOMIC_BITS(int)
RAMMER_EMU_ATOMIC_BITS(unsigned int)
RAMMER_EMU_ATOMIC_BITS(unsigned long long)
#undef RAMMER_EMU_ATOMIC_BITS
inline unsigned int atomicInc(unsigned int* p, unsigned int v) {
  ::rammer_emu::note_progress(); unsigned o = *p; *p = o >= v ? 0 : o + 1; return o;
}
inline unsigned int atomicDec(unsigned int* p, unsigned int v) {
  ::rammer_emu::note_progress(); unsigned o = *p; *p = (o == 0 || o > v) ? v : o - 1; return o;
}

// ---------------------------------------------------------------------------- loads/stores with cache hints
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }
template <class T> inline unsigned int __cvta_generic_to_shared(const T* p) {
  return ::rammer_emu::shared_offset(static_cast<const void*>(p));
}
inline bool __isShared(const void* p) {
  const unsigned char* b = ::rammer_emu::shared_base();
  return p >= b && p < b + ::rammer_emu::SHARED_CAPACITY;
}
inline bool __isGlobal(const void* p) { return !__isShared(p); }

// ---------------------------------------------------------------------------- integer intrinsics
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(static_cast<unsigned>(x))) << 32) | __brev(static_cast<unsigned>(x >> 32));
}
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline int __mul24(int a, int b) { return static_cast<int>(static_cast<long long>((a << 8) >> 8) * ((b << 8) >> 8)); }
inline unsigned int __umul24(unsigned int a, unsigned int b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32); }
inline long long __mul64hi(long long a, long long b) { return static_cast<long long>((static_cast<__int128>(a) * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline int __hadd(int a, int b) { return static_cast<int>((static_cast<long long>(a) + b) >> 1); }
inline int __rhadd(int a, int b) { return static_cast<int>((static_cast<long long>(a) + b + 1) >> 1); }
inline unsigned int __uhadd(unsigned a, unsigned b) { return static_cast<unsigned>((static_cast<unsigned long long>(a) + b) >> 1); }
inline unsigned int __sad(int a, int b, unsigned c) { return (a > b ? a - b : b - a) + c; }
inline unsigned int __usad(unsigned a, unsigned b, unsigned c) { return (a > b ? a - b : b - a) + c; }
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += static_cast<signed char>(a >> (8 * i)) * static_cast<signed char>(b >> (8 * i));
  return c;
}
inline unsigned int __dp4a(unsigned a, unsigned b, unsigned c) {
  for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xff) * ((b >> (8 * i)) & 0xff);
  return c;
}

// ---------------------------------------------------------------------------- float intrinsics
inline float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
inline int __float_as_int(float x) { return __builtin_bit_cast(int, x); }
inline float __uint_as_float(unsigned x) { return __builtin_bit_cast(float, x); }
inline unsigned __float_as_uint(float x) { return __builtin_bit_cast(unsigned, x); }
inline double __longlong_as_double(long long x) { return __builtin_bit_cast(double, x); }
inline long long __double_as_longlong(double x) { return __builtin_bit_cast(long long, x); }
inline int __double2hiint(double x) { return static_cast<int>(__builtin_bit_cast(unsigned long long, x) >> 32); }
inline int __double2loint(double x) { return static_cast<int>(__builtin_bit_cast(unsigned long long, x)); }
inline double __hiloint2double(int hi, int lo) {
  return __builtin_bit_cast(double, (static_cast<unsigned long long>(static_cast<unsigned>(hi)) << 32) | static_cast<unsigned>(lo));
}
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
// __powf is 2^(y * log2 x) on the GPU (lg2.approx, ex2.approx): NaN for every x < 0 (even when
// y is an integer: __powf(-3, 2) is NaN, powf(-3, 2) is 9), NaN for x = 0 with y = 0.
inline float __powf(float x, float y) { return exp2f(y * log2f(x)); }
inline float __fdividef(float x, float y) { return x / y; }
inline float fdividef(float x, float y) { return x / y; }
inline double fdivide(double x, double y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rz(float a, float b) { return a + b; }
inline float __fmul_rz(float a, float b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float saturate(float x) { return __saturatef(x); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(nearbyintf(x)); }
inline unsigned __float2uint_rz(float x) { return static_cast<unsigned>(x); }
inline long long __float2ll_rn(float x) { return static_cast<long long>(nearbyintf(x)); }
inline long long __float2ll_rz(float x) { return static_cast<long long>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline double __int2double_rn(int x) { return static_cast<double>(x); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }
inline int __double2int_rn(double x) { return static_cast<int>(nearbyint(x)); }
inline int __double2int_rz(double x) { return static_cast<int>(x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752); }
inline float erfcxf(float x) { return expf(x * x) * erfcf(x); }
inline float sinpif(float x) { return sinf(x * 3.14159265358979323846f); }
inline float cospif(float x) { return cosf(x * 3.14159265358979323846f); }
inline double sinpi(double x) { return sin(x * 3.14159265358979323846); }
inline double cospi(double x) { return cos(x * 3.14159265358979323846); }
inline int __isnanf(float x) { return x != x; }
inline int __isinff(float x) { return std::isinf(x); }
inline int __finitef(float x) { return std::isfinite(x); }
inline int __signbitf(float x) { return std::signbit(x); }

// CUDA's overloaded min/max for every arithmetic type (device_functions.h)
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned>(a), b); }
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned>(b)); }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline short min(short a, short b) { return a < b ? a : b; }
inline short max(short a, short b) { return a > b ? a : b; }
inline signed char min(signed char a, signed char b) { return a < b ? a : b; }
inline signed char max(signed char a, signed char b) { return a > b ? a : b; }
inline unsigned char min(unsigned char a, unsigned char b) { return a < b ? a : b; }
inline unsigned char max(unsigned char a, unsigned char b) { return a > b ? a : b; }
inline unsigned short min(unsigned short a, unsigned short b) { return a < b ? a : b; }
inline unsigned short max(unsigned short a, unsigned short b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------- --use_fast_math
// TVM compiles every CUDA module with --use_fast_math (tvm/support/nvcc.py: always under NVRTC,
// under nvcc unless TVM_CUDA_NVCC_NO_FAST_MATH is set), and the GPU then computes powf as __powf
// (expf, logf, sinf, ... as __expf, __logf, __sinf too: those are the same functions here up to
// rounding, so they are left alone). powf is the one whose domain changes (NaN for every
// negative base), so the generated code's powf is the GPU's __powf here as well.
#define powf(x, y) __powf((x), (y))

// ---------------------------------------------------------------------------- cooperative groups
namespace cooperative_groups {
struct grid_group {
  void sync(int line = __builtin_LINE()) const { ::rammer_emu::grid_sync(line); }
  unsigned long long size() const { return ::rammer_emu::g_launch.total_threads; }
  unsigned long long num_threads() const { return size(); }
  unsigned long long thread_rank() const {
    const auto* f = ::rammer_emu::g_cur;
    return (unsigned long long)f->block->linear * ::rammer_emu::g_launch.threads_per_block + f->linear;
  }
  bool is_valid() const { return ::rammer_emu::g_launch.cooperative; }
  dim3 group_dim() const { return dim3(::rammer_emu::g_launch.gdim); }
};
inline grid_group this_grid() { return grid_group(); }
struct thread_block {
  void sync(int line = __builtin_LINE()) const { ::rammer_emu::syncthreads(line); }
  unsigned size() const { return ::rammer_emu::g_launch.threads_per_block; }
  unsigned num_threads() const { return size(); }
  unsigned thread_rank() const { return ::rammer_emu::g_cur->linear; }
  dim3 group_index() const { return dim3(::rammer_emu::g_cur->block->bidx); }
  dim3 thread_index() const { return dim3(::rammer_emu::g_cur->tidx); }
  dim3 group_dim() const { return dim3(::rammer_emu::g_launch.bdim); }
};
inline thread_block this_thread_block() { return thread_block(); }
template <class G> inline void sync(const G& g) { g.sync(); }
}  // namespace cooperative_groups
