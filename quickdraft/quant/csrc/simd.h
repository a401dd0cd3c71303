// quickdraft's 16-lane float vectors (F) and int32 vectors (I): one AVX-512 register, or two AVX2 registers (lanes
// 0-7 and 8-15), with the same arithmetic lane by lane and the same order in every reduction, so a kernel written over
// them gives the same bits built either way (csrc/kernels.cpp; tests/test_quant.py compares the two builds).
//
// Built with AVX-512 VNNI flags (quant/vnni.py) QD_AVX512 is 1; built with AVX2 + FMA + F16C it is 0. Nothing here
// contracts a multiply and an add (the extensions build with -ffp-contract=off): fmadd is the only fused operation.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define QD_AVX512 1
#else
#define QD_AVX512 0
#endif

namespace qd {

#if QD_AVX512

struct F { __m512 v; };
struct I { __m512i v; };

inline F fzero() { return {_mm512_setzero_ps()}; }
inline F fset(float a) { return {_mm512_set1_ps(a)}; }
inline F fload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void fstore(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F operator+(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F operator-(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F operator*(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F operator/(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a b + c, rounded once
inline F fmax(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F fabs(F a) { return {_mm512_abs_ps(a.v)}; }
inline __mmask16 first(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1); }
inline F fload_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }  // lanes >= n: 0
inline void fstore_first(float* p, F a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline F fkeep_first(F a, int64_t n) { return {_mm512_maskz_mov_ps(first(n), a.v)}; }
inline F fload_bf16(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline F fload_half_first(const uint16_t* p, int64_t n) {  // float16, lanes >= n: 0
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p))};
}
// where g < 0: a, else b
inline F fselect_negative(F g, F a, F b) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(g.v, _mm512_setzero_ps(), _CMP_LT_OQ), b.v, a.v)};
}
inline float reduce_add(F a) { return _mm512_reduce_add_ps(a.v); }  // GCC's tree, written out for AVX2 below
inline float reduce_max(F a) { return _mm512_reduce_max_ps(a.v); }
// The bf16 bit patterns of a, rounded to nearest even (no NaN handling), in the low 16 bits of each int32 lane.
inline __m512i bf16_bits(F a) {
  __m512i bits = _mm512_castps_si512(a.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}
inline void fstore_bf16(uint16_t* p, F a) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16_bits(a))); }
inline void fstore_bf16_nan(uint16_t* p, F a) {  // NaN lanes as PyTorch's NaN (0x7fc0)
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  _mm256_storeu_si256((__m256i*)p, _mm256_mask_mov_epi16(_mm512_cvtepi32_epi16(bf16_bits(a)), nan,
                                                          _mm256_set1_epi16(0x7fc0)));
}
inline F fround_bf16(F a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a), 16))}; }
// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * p(f), p a degree-6 polynomial of the
// fraction (relative error ~2e-7); below -87 it gives 0.
inline F scale_pow2(F p, F n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline F round_nearest(F a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

inline I izero() { return {_mm512_setzero_si512()}; }
inline I iset(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline I operator+(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I imin(I a, I b) { return {_mm512_min_epi32(a.v, b.v)}; }
inline I imax(I a, I b) { return {_mm512_max_epi32(a.v, b.v)}; }
inline I to_int(F a) { return {_mm512_cvtps_epi32(a.v)}; }  // round to nearest even
inline F to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I iload_first(const int32_t* p, int64_t n) { return {_mm512_maskz_loadu_epi32(first(n), p)}; }
inline int32_t reduce_add(I a) { return _mm512_reduce_add_epi32(a.v); }
inline I iload_i8(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline void istore_i8(int8_t* p, I a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(a.v)); }  // a in int8

// Lane i of the result: the 4 lanes 4i..4i+3 of each 128-bit block pairwise ([x0 + x2, y0 + y2, x1 + x3, y1 + y3] per
// block), then of those ([A_b, B_b, C_b, D_b] per block b), then the blocks: fold(a, b) = [a0 + a1, a2 + a3, b0 + b1,
// b2 + b3] in blocks.
inline F unpack_add_ps(F a, F b) { return {_mm512_add_ps(_mm512_unpacklo_ps(a.v, b.v), _mm512_unpackhi_ps(a.v, b.v))}; }
inline F unpack_add_pd(F a, F b) {
  const __m512d x = _mm512_castps_pd(a.v), y = _mm512_castps_pd(b.v);
  return {_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))};
}
inline F fold(F a, F b) {
  return {_mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x88), _mm512_shuffle_f32x4(a.v, b.v, 0xDD))};
}

#else  // AVX2 + FMA + F16C: each vector as two 8-lane halves

struct F { __m256 lo, hi; };
struct I { __m256i lo, hi; };

inline __m256i mask8(int64_t n) {  // lanes < n all ones
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n < 0 ? 0 : n > 8 ? 8 : n)), index);
}
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, F a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline F operator+(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F operator-(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F operator*(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F operator/(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F fmax(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F fabs(F a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F fload_first(const float* p, int64_t n) {
  if (n >= 16) return fload(p);
  return {_mm256_maskload_ps(p, mask8(n)), _mm256_maskload_ps(p + 8, mask8(n - 8))};
}
inline void fstore_first(float* p, F a, int64_t n) {
  _mm256_maskstore_ps(p, mask8(n), a.lo), _mm256_maskstore_ps(p + 8, mask8(n - 8), a.hi);
}
inline F fkeep_first(F a, int64_t n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(mask8(n))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(mask8(n - 8)))};
}
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline F fload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline F fload_half_first(const uint16_t* p, int64_t n) {
  uint16_t tmp[16] = {0};
  if (n < 16) {  // (no masked 16-bit load on AVX2: the tail through a copy)
    std::memcpy(tmp, p, sizeof(uint16_t) * n);
    p = tmp;
  }
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline F fselect_negative(F g, F a, F b) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(g.lo, z, _CMP_LT_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(g.hi, z, _CMP_LT_OQ))};
}
// GCC's _mm512_reduce_add_ps: the halves, then the 128-bit halves, then lanes (0, 2) and (1, 3), then those two.
inline float reduce_add(F a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_permute_ps(t8, 1));
}
inline float reduce_max(F a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_permute_ps(t8, _MM_SHUFFLE(0, 1, 0, 1))));  // each operand as GCC's has it
}
inline __m256i bf16_bits8(__m256 a) {
  __m256i bits = _mm256_castps_si256(a);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}
inline __m256i pack16(__m256i lo, __m256i hi) {  // 16 int32 lanes holding 16-bit values -> 16 uint16 in order
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}
inline void fstore_bf16(uint16_t* p, F a) { _mm256_storeu_si256((__m256i*)p, pack16(bf16_bits8(a.lo), bf16_bits8(a.hi))); }
inline void fstore_bf16_nan(uint16_t* p, F a) {
  const __m256i nan = _mm256_set1_epi32(0x7fc0);
  const __m256i lo = _mm256_blendv_epi8(bf16_bits8(a.lo), nan, _mm256_castps_si256(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q)));
  const __m256i hi = _mm256_blendv_epi8(bf16_bits8(a.hi), nan, _mm256_castps_si256(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)));
  _mm256_storeu_si256((__m256i*)p, pack16(lo, hi));
}
inline F fround_bf16(F a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.hi), 16))};
}
// p 2^n for whole n in -126..0 (what exp_nonpositive's n can be): 2^n is a normal float, so the product is rounded once,
// as vscalefps rounds it.
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F scale_pow2(F p, F n) { return {_mm256_mul_ps(p.lo, pow2_8(n.lo)), _mm256_mul_ps(p.hi, pow2_8(n.hi))}; }
inline F round_nearest(F a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I iset(int32_t a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
inline I operator+(I a, I b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I imin(I a, I b) { return {_mm256_min_epi32(a.lo, b.lo), _mm256_min_epi32(a.hi, b.hi)}; }
inline I imax(I a, I b) { return {_mm256_max_epi32(a.lo, b.lo), _mm256_max_epi32(a.hi, b.hi)}; }
inline I to_int(F a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline F to_float(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I iload_first(const int32_t* p, int64_t n) {
  if (n >= 16) return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))};
  return {_mm256_maskload_epi32(p, mask8(n)), _mm256_maskload_epi32(p + 8, mask8(n - 8))};
}
inline int32_t reduce_add(I a) {
  const __m256i t = _mm256_add_epi32(a.lo, a.hi);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
inline I iload_i8(const int8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))};
}
inline void istore_i8(int8_t* p, I a) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);  // 16 int16 in order
  _mm_storeu_si128((__m128i*)p, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

inline F unpack_add_ps(F a, F b) {
  return {_mm256_add_ps(_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.lo, b.lo)),
          _mm256_add_ps(_mm256_unpacklo_ps(a.hi, b.hi), _mm256_unpackhi_ps(a.hi, b.hi))};
}
inline __m256 unpack_add_pd8(__m256 a, __m256 b) {
  const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
inline F unpack_add_pd(F a, F b) { return {unpack_add_pd8(a.lo, b.lo), unpack_add_pd8(a.hi, b.hi)}; }
inline __m256 fold8(F a) {  // [a0 + a1, a2 + a3] in blocks
  return _mm256_add_ps(_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(a.lo, a.hi, 0x31));
}
inline F fold(F a, F b) { return {fold8(a), fold8(b)}; }

#endif

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * p(f), p a degree-6 polynomial of the
// fraction (relative error ~2e-7); below -87 it gives 0.
inline F exp_nonpositive(F x) {
  x = fmax(x, fset(-87.0f));
  const F t = x * fset(1.44269504088896341f);
  const F n = round_nearest(t);
  const F f = (t - n) * fset(0.69314718055994531f);  // in [-ln2/2, ln2/2]
  F p = fset(1.0f / 720);
  p = fmadd(p, f, fset(1.0f / 120));
  p = fmadd(p, f, fset(1.0f / 24));
  p = fmadd(p, f, fset(1.0f / 6));
  p = fmadd(p, f, fset(0.5f));
  p = fmadd(p, f, fset(1.0f));
  p = fmadd(p, f, fset(1.0f));
  return scale_pow2(p, n);
}

// P dot products' last step (P = 4, 8 or 16): lane l of the result is the sum of a[l]'s 16 lanes, always in the same
// order (pairs of lanes, then pairs of those, then blocks), whichever other vectors share the call.
template <int P>
inline F sum_lanes(const F* a) {
  static_assert(P == 4 || P == 8 || P == 16, "4, 8 or 16 vectors");
  F s[P / 2], u[P / 4], w[P / 8 > 0 ? P / 8 : 1];
  for (int m = 0; m < P / 2; ++m) s[m] = unpack_add_ps(a[2 * m], a[2 * m + 1]);
  for (int m = 0; m < P / 4; ++m) u[m] = unpack_add_pd(s[2 * m], s[2 * m + 1]);
  if constexpr (P == 4) {
    w[0] = fold(u[0], u[0]);
  } else {
    for (int m = 0; m < P / 8; ++m) w[m] = fold(u[2 * m], u[2 * m + 1]);
  }
  if constexpr (P == 16) {
    return fold(w[0], w[1]);
  } else {
    return fold(w[0], w[0]);
  }
}

}  // namespace qd
