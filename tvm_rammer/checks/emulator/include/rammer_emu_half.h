// rammer_emu_half.h: __half / __half2 / __nv_bfloat16 for the CPU emulator (through _Float16 and bits).
// Each operation rounds to the type (as the GPU does); arithmetic is carried out in float.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

struct __half_raw { unsigned short x; };

struct __half {
  _Float16 v;
  __half() = default;
  constexpr __half(const __half_raw& r) : v(__builtin_bit_cast(_Float16, r.x)) {}
  __half(float f) : v(static_cast<_Float16>(f)) {}
  __half(double f) : v(static_cast<_Float16>(f)) {}
  __half(int f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(unsigned int f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(long long f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(unsigned long long f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(short f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(unsigned short f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(long f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(bool f) : v(static_cast<_Float16>(f ? 1.0f : 0.0f)) {}
  operator float() const { return static_cast<float>(v); }
  operator __half_raw() const { return __half_raw{__builtin_bit_cast(unsigned short, v)}; }
  explicit operator bool() const { return static_cast<float>(v) != 0.0f; }
  __half& operator=(float f) { v = static_cast<_Float16>(f); return *this; }
  __half& operator=(double f) { v = static_cast<_Float16>(f); return *this; }
  __half& operator=(int f) { v = static_cast<_Float16>(static_cast<float>(f)); return *this; }
  __half& operator+=(const __half& o) { v = static_cast<_Float16>(float(*this) + float(o)); return *this; }
  __half& operator-=(const __half& o) { v = static_cast<_Float16>(float(*this) - float(o)); return *this; }
  __half& operator*=(const __half& o) { v = static_cast<_Float16>(float(*this) * float(o)); return *this; }
  __half& operator/=(const __half& o) { v = static_cast<_Float16>(float(*this) / float(o)); return *this; }
};
static_assert(sizeof(__half) == 2, "__half must be 2 bytes");

inline __half operator+(const __half& a, const __half& b) { return __half(float(a) + float(b)); }
inline __half operator-(const __half& a, const __half& b) { return __half(float(a) - float(b)); }
inline __half operator*(const __half& a, const __half& b) { return __half(float(a) * float(b)); }
inline __half operator/(const __half& a, const __half& b) { return __half(float(a) / float(b)); }
inline __half operator-(const __half& a) { return __half(-float(a)); }
inline __half operator+(const __half& a) { return a; }
inline bool operator==(const __half& a, const __half& b) { return float(a) == float(b); }
inline bool operator!=(const __half& a, const __half& b) { return float(a) != float(b); }
inline bool operator<(const __half& a, const __half& b) { return float(a) < float(b); }
inline bool operator<=(const __half& a, const __half& b) { return float(a) <= float(b); }
inline bool operator>(const __half& a, const __half& b) { return float(a) > float(b); }
inline bool operator>=(const __half& a, const __half& b) { return float(a) >= float(b); }
inline __half& operator++(__half& a) { a = __half(float(a) + 1.0f); return a; }
inline __half& operator--(__half& a) { a = __half(float(a) - 1.0f); return a; }

struct __align__(4) __half2 {
  __half x, y;
  __half2() = default;
  __half2(const __half& a, const __half& b) : x(a), y(b) {}
};
inline __half2 operator+(const __half2& a, const __half2& b) { return {a.x + b.x, a.y + b.y}; }
inline __half2 operator-(const __half2& a, const __half2& b) { return {a.x - b.x, a.y - b.y}; }
inline __half2 operator*(const __half2& a, const __half2& b) { return {a.x * b.x, a.y * b.y}; }
inline __half2 operator/(const __half2& a, const __half2& b) { return {a.x / b.x, a.y / b.y}; }
inline __half2 operator-(const __half2& a) { return {-a.x, -a.y}; }
inline __half2& operator+=(__half2& a, const __half2& b) { a = a + b; return a; }
inline __half2& operator-=(__half2& a, const __half2& b) { a = a - b; return a; }
inline __half2& operator*=(__half2& a, const __half2& b) { a = a * b; return a; }
inline __half2& operator/=(__half2& a, const __half2& b) { a = a / b; return a; }
inline bool operator==(const __half2& a, const __half2& b) { return a.x == b.x && a.y == b.y; }
inline bool operator!=(const __half2& a, const __half2& b) { return !(a == b); }

typedef __half half;
typedef __half2 half2;
typedef __half_raw __half2_raw_lo;

inline float __half2float(__half h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half_rz(float f) {
  __half h(f);
  if (std::fabs(float(h)) > std::fabs(f)) {  // rounded away from zero: step back one ulp
    unsigned short b = __builtin_bit_cast(unsigned short, h.v);
    b = static_cast<unsigned short>(b - 1);
    h.v = __builtin_bit_cast(_Float16, b);
  }
  return h;
}
inline __half __double2half(double d) { return __half(d); }
inline __half __int2half_rn(int i) { return __half(i); }
inline __half __uint2half_rn(unsigned i) { return __half(i); }
inline __half __ll2half_rn(long long i) { return __half(i); }
inline int __half2int_rn(__half h) { return static_cast<int>(std::nearbyint(float(h))); }
inline int __half2int_rz(__half h) { return static_cast<int>(float(h)); }
inline unsigned __half2uint_rz(__half h) { return static_cast<unsigned>(float(h)); }
inline short __half_as_short(__half h) { return __builtin_bit_cast(short, h.v); }
inline unsigned short __half_as_ushort(__half h) { return __builtin_bit_cast(unsigned short, h.v); }
inline __half __short_as_half(short s) { __half h; h.v = __builtin_bit_cast(_Float16, s); return h; }
inline __half __ushort_as_half(unsigned short s) { __half h; h.v = __builtin_bit_cast(_Float16, s); return h; }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return {__half(a), __half(a)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline __half2 __half2half2(__half a) { return {a, a}; }
inline __half2 make_half2(__half a, __half b) { return {a, b}; }
inline float __low2float(__half2 a) { return float(a.x); }
inline float __high2float(__half2 a) { return float(a.y); }
inline __half __low2half(__half2 a) { return a.x; }
inline __half __high2half(__half2 a) { return a.y; }

inline __half __hadd(__half a, __half b) { return a + b; }
inline __half __hsub(__half a, __half b) { return a - b; }
inline __half __hmul(__half a, __half b) { return a * b; }
inline __half __hdiv(__half a, __half b) { return a / b; }
inline __half __hneg(__half a) { return -a; }
inline __half __hfma(__half a, __half b, __half c) { return __half(std::fmaf(float(a), float(b), float(c))); }
inline __half __habs(__half a) { return __half(std::fabs(float(a))); }
inline __half __hmax(__half a, __half b) { return float(a) > float(b) ? a : (std::isnan(float(b)) ? a : b); }
inline __half __hmin(__half a, __half b) { return float(a) < float(b) ? a : (std::isnan(float(b)) ? a : b); }
inline bool __heq(__half a, __half b) { return a == b; }
inline bool __hne(__half a, __half b) { return a != b; }
inline bool __hlt(__half a, __half b) { return a < b; }
inline bool __hle(__half a, __half b) { return a <= b; }
inline bool __hgt(__half a, __half b) { return a > b; }
inline bool __hge(__half a, __half b) { return a >= b; }
inline bool __hisnan(__half a) { return std::isnan(float(a)); }
inline int __hisinf(__half a) { float f = float(a); return std::isinf(f) ? (f > 0 ? 1 : -1) : 0; }
inline __half2 __hadd2(__half2 a, __half2 b) { return a + b; }
inline __half2 __hsub2(__half2 a, __half2 b) { return a - b; }
inline __half2 __hmul2(__half2 a, __half2 b) { return a * b; }
inline __half2 __h2div(__half2 a, __half2 b) { return a / b; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; }
inline __half2 __hmax2(__half2 a, __half2 b) { return {__hmax(a.x, b.x), __hmax(a.y, b.y)}; }
inline __half2 __hmin2(__half2 a, __half2 b) { return {__hmin(a.x, b.x), __hmin(a.y, b.y)}; }
inline __half2 __habs2(__half2 a) { return {__habs(a.x), __habs(a.y)}; }
inline __half2 __hneg2(__half2 a) { return {-a.x, -a.y}; }

#define RAMMER_EMU_HALF_UNARY(name, fn) inline __half name(__half a) { return __half(fn(float(a))); }
RAMMER_EMU_HALF_UNARY(hexp, std::exp)
RAMMER_EMU_HALF_UNARY(hexp2, std::exp2)
RAMMER_EMU_HALF_UNARY(hexp10, [](float x) { return std::pow(10.0f, x); })
RAMMER_EMU_HALF_UNARY(hlog, std::log)
RAMMER_EMU_HALF_UNARY(hlog2, std::log2)
RAMMER_EMU_HALF_UNARY(hlog10, std::log10)
RAMMER_EMU_HALF_UNARY(hsqrt, std::sqrt)
RAMMER_EMU_HALF_UNARY(hrsqrt, [](float x) { return 1.0f / std::sqrt(x); })
RAMMER_EMU_HALF_UNARY(hrcp, [](float x) { return 1.0f / x; })
RAMMER_EMU_HALF_UNARY(hsin, std::sin)
RAMMER_EMU_HALF_UNARY(hcos, std::cos)
RAMMER_EMU_HALF_UNARY(htanh, std::tanh)  // CUDA 12.8+: TVM writes it for a float16 tanh
RAMMER_EMU_HALF_UNARY(hfloor, std::floor)
RAMMER_EMU_HALF_UNARY(hceil, std::ceil)
RAMMER_EMU_HALF_UNARY(htrunc, std::trunc)
RAMMER_EMU_HALF_UNARY(hrint, std::nearbyint)
#undef RAMMER_EMU_HALF_UNARY
inline __half2 h2exp(__half2 a) { return {hexp(a.x), hexp(a.y)}; }
inline __half2 h2log(__half2 a) { return {hlog(a.x), hlog(a.y)}; }
inline __half2 h2sqrt(__half2 a) { return {hsqrt(a.x), hsqrt(a.y)}; }
inline __half2 h2rsqrt(__half2 a) { return {hrsqrt(a.x), hrsqrt(a.y)}; }

// math overloads CUDA provides for half through its float conversions
inline __half fabs(__half a) { return __habs(a); }

// ---- bfloat16: bits of the upper half of a float, round to nearest even
struct __nv_bfloat16_raw { unsigned short x; };
struct __nv_bfloat16 {
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    unsigned int u = __builtin_bit_cast(unsigned int, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = static_cast<unsigned short>((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = static_cast<unsigned short>(u >> 16);
  }
  __nv_bfloat16(double f) : __nv_bfloat16(static_cast<float>(f)) {}
  __nv_bfloat16(int f) : __nv_bfloat16(static_cast<float>(f)) {}
  __nv_bfloat16(const __half& h) : __nv_bfloat16(float(h)) {}
  operator float() const { return __builtin_bit_cast(float, static_cast<unsigned int>(bits) << 16); }
  __nv_bfloat16& operator+=(const __nv_bfloat16& o) { *this = __nv_bfloat16(float(*this) + float(o)); return *this; }
  __nv_bfloat16& operator*=(const __nv_bfloat16& o) { *this = __nv_bfloat16(float(*this) * float(o)); return *this; }
};
inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __nv_bfloat16(float(a) + float(b)); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __nv_bfloat16(float(a) - float(b)); }
inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __nv_bfloat16(float(a) * float(b)); }
inline __nv_bfloat16 operator/(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __nv_bfloat16(float(a) / float(b)); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a) { return __nv_bfloat16(-float(a)); }
inline bool operator<(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) < float(b); }
inline bool operator>(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) > float(b); }
inline bool operator<=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) <= float(b); }
inline bool operator>=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) >= float(b); }
inline bool operator==(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) == float(b); }
inline bool operator!=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return float(a) != float(b); }
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
inline float __bfloat162float(__nv_bfloat16 a) { return float(a); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) > float(b) ? a : b; }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return float(a) < float(b) ? a : b; }
