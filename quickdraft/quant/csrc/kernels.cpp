// quickdraft's CPU kernels for x86 CPUs, built twice from this one source (quant/vnni.py): for AVX-512 VNNI, and for
// AVX2 + FMA + F16C (every x86-64 CPU since 2013). Weight-only int8 and int4 linear layers, the attention of decode and
// verification passes, fused RMSNorm / SiLU-and-multiply / rotary steps, and the int4 grid fit. Each has a plain
// reference in Python (quickdraft/quant/vnni.py, models/transformer.py).
//
// Each call quantizes the activations per row (symmetric int8, one scale per row) and multiplies them with the integer
// weights as bytes (vpdpbusd, 64 unsigned x signed byte products an instruction; on AVX2 vpmaddubsw + vpmaddwd, 32),
// reading every weight once for all the rows: verifying k+1 tokens costs little more than decoding one.
//
// int8: weights u = q + 128 in 1..255 (q in -127..127, one scale per output row; the AVX2 build needs |q| <= 127).
//       y[m][n] = d[m] * s[n] * sum_k q[n][k] x[m][k]   (VNNI: sum_k u[n][k] x[m][k] - 128 * sum_k x[m][k])
// int4: weights q in 0..15 in groups of 32 along K, w = q * scale + lo (fp16 scale and lo per group),
//       packed in chunks of 128 (4 groups): byte 16g + i holds elements 32g + i (low nibble) and 32g + 16 + i
//       (high nibble), so both products of a chunk (low nibbles, high nibbles) add into the same group's
//       lanes and a chunk needs one conversion to float and one multiply-add per activation row.
//       y[m][n] = d[m] * sum_g (scale[n][g] * sum_{k in g} q[n][k] x[m][k] + lo[n][g] * sum_{k in g} x[m][k])
// where x are the int8 activations and d their row scales (a row of massive activations gets a second level
// of codes for its remainder, and its output sums both). Weights are tiled: each 4 output rows are
// interleaved in 64-byte pieces (and the int4 scales in pieces of 4), so a tile is one sequential stream
// for the hardware prefetcher. Each output is computed the same way whatever the number of rows, so
// batched verification gives bit-identical rows to one-at-a-time decoding; and the same way on both instruction sets:
// integer sums are exact whatever their order, and every float operation runs on 16-lane vectors (simd.h) in one
// order, so both builds give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using namespace qd;

constexpr int kMaxRows = 8;  // rows of activations per pass over a tile (VNNI: accumulators stay in registers)
constexpr int kTileN = 4;    // output rows per tile

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// A row whose largest |x| exceeds this many times its mean |x| gets a second level. Measured on the 1.5B
// target (perplexity over bf16, int8 / int4): none +2.0% / +4.3%, 20: +0.4% / +2.5% but 97% of the down
// projection's decode rows doubled (its inputs are heavy-tailed), 100: +0.1% / +3.6% with 13% doubled.
constexpr float kOutlierRatio = 100.0f;

// One row of K floats -> int8 codes q (round to nearest even of x / d, d = max |x| / 127), d, and the codes'
// sums per group.
void quantize_row(const float* x, int64_t K, int64_t group, int8_t* q, float* d, int32_t* sums) {
  F amax = fzero();
  for (int64_t k = 0; k < K; k += 16) amax = fmax(amax, fabs(fload(x + k)));
  const float dm = reduce_max(amax) / 127.0f;
  *d = dm;
  const F div = fset(dm == 0.0f ? 1.0f : dm);
  for (int64_t g = 0; g < K / group; ++g) {
    I acc = izero();
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      const I v = imax(imin(to_int(fload(x + k) / div), iset(127)), iset(-127));  // nearest even
      acc = acc + v;
      istore_i8(q + k, v);
    }
    sums[g] = reduce_add(acc);
  }
}

// Quantize x (M, K) bf16 row by row into "levels": q (<= 2M, K) int8, d, sums (per group of `group`), and the
// row each level belongs to; returns the number of levels. A row of massive activations (a few channels in
// the thousands, as LLMs put on their first token) would leave every other channel at 0 or +-1 with one
// scale: it gets a second level, the first level's remainder quantized on its own, so x ~ d1 q1 + d2 q2.
int64_t quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t group, int8_t* q, float* d, int32_t* sums,
                      int64_t* owner) {
  std::vector<float> row(K);
  int64_t levels = 0;
  for (int64_t m = 0; m < M; ++m) {
    F total = fzero();
    for (int64_t k = 0; k < K; k += 16) {
      const F v = fload_bf16(x + m * K + k);
      fstore(row.data() + k, v);
      total = total + fabs(v);
    }
    const int64_t first = levels++;
    quantize_row(row.data(), K, group, q + first * K, d + first, sums + first * (K / group));
    owner[first] = m;
    if (d[first] * 127.0f > kOutlierRatio * (reduce_add(total) / static_cast<float>(K))) {
      const F d1 = fset(d[first]);
      for (int64_t k = 0; k < K; k += 16)  // the remainder x - d1 q1
        fstore(row.data() + k, fload(row.data() + k) - d1 * to_float(iload_i8(q + first * K + k)));
      const int64_t second = levels++;
      quantize_row(row.data(), K, group, q + second * K, d + second, sums + second * (K / group));
      owner[second] = m;
    }
  }
  return levels;
}

// out[m] = bf16(sum of m's levels (+ bias)): the levels' float results res (levels, N) combined, 16 at a time
// (the same additions and rounding as the scalar tail).
void combine_levels(const float* res, const int64_t* owner, int64_t levels, int64_t N, const uint16_t* bias,
                    uint16_t* out) {
  for (int64_t v = 0; v < levels; ++v) {
    const bool two = v + 1 < levels && owner[v + 1] == owner[v];
    uint16_t* o = out + owner[v] * N;
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      F y = fload(res + v * N + n);
      if (two) y = y + fload(res + (v + 1) * N + n);
      if (bias) y = y + fload_bf16(bias + n);
      fstore_bf16_nan(o + n, y);
    }
    for (; n < N; ++n) {
      float y = res[v * N + n];
      if (two) y += res[(v + 1) * N + n];
      if (bias) y += bf16_to_float(bias[n]);
      o[n] = float_to_bf16(y);
    }
    v += two;
  }
}

// An int4 output: d[m] * (the float accumulators of its chunks + the lows' term, 16 groups at a time, the last ones
// masked), the same on both instruction sets.
inline float int4_output(F acc, const uint16_t* lows_n, const int32_t* sums_m, int64_t G, float d) {
  F z = fzero();
  for (int64_t g = 0; g < G; g += 16)
    z = fmadd(fload_half_first(lows_n + g, G - g), to_float(iload_first(sums_m + g, G - g)), z);
  return d * reduce_add(acc + z);
}

#if QD_AVX512

// The sums of the 16 lanes of a, b, c and d, as 4 lanes: one transposing tree instead of four reductions.
inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
  __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// Output rows r0 .. r0 + NT - 1 of a tile (NT = 4, or 2 so that 8 activation rows fit the registers)
// times activation rows m0 .. m0 + MT - 1. Integer sums are exact, so any tiling gives the same outputs.
// Over K from k0 to k1: the partial sums start at zero when k0 == 0, else from `state`, and go back to
// `state` unless k1 == K, where they become outputs.
template <int NT, int MT>
void int8_tile(const uint8_t* w, const float* scales, const int8_t* q, const float* d, const int32_t* sums,
               float* res, int64_t n0, int r0, int64_t m0, int64_t K, int64_t N,
               bool prefetch, int64_t k0, int64_t k1, __m512i* state) {
  __m512i acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = k0 == 0 ? _mm512_setzero_si512() : state[i * MT + j];
  const uint8_t* wt = w + n0 * K;  // the tile's 4 rows, interleaved in 64-byte pieces: one sequential stream
  for (int64_t k = k0; k < k1; k += 64) {
    __m512i xv[MT];
    for (int j = 0; j < MT; ++j) xv[j] = _mm512_loadu_si512(q + (m0 + j) * K + k);
    if (prefetch)  // the next tile's same piece, into L2: its fetch overlaps this tile's arithmetic
      for (int i = 0; i < kTileN; ++i) _mm_prefetch((const char*)(wt + kTileN * K + k * kTileN + i * 64), _MM_HINT_T1);
    for (int i = 0; i < NT; ++i) {
      __m512i wv = _mm512_loadu_si512(wt + k * kTileN + (r0 + i) * 64);
      for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv, xv[j]);
    }
  }
  if (k1 < K) {
    for (int i = 0; i < NT; ++i)
      for (int j = 0; j < MT; ++j) state[i * MT + j] = acc[i][j];
    return;
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int j = 0; j < MT; ++j) {
    int32_t dots[4];
    _mm_storeu_si128((__m128i*)dots, reduce4(acc[0][j], acc[1][j], NT > 2 ? acc[NT > 2 ? 2 : 0][j] : zero,
                                             NT > 3 ? acc[NT > 3 ? 3 : 0][j] : zero));
    for (int i = 0; i < NT; ++i) {
      int64_t n = n0 + r0 + i, m = m0 + j;
      res[m * N + n] = d[m] * scales[n] * static_cast<float>(dots[i] - 128 * sums[m]);
    }
  }
}

constexpr int64_t kBlockK = 2048;  // bytes of K per block: 4 rows of weights and 8 of activations fit L1

template <int MT>
void int8_rows(const uint8_t* w, const float* scales, const int8_t* q, const float* d, const int32_t* sums,
               float* res, int64_t n0, int64_t m0, int64_t K, int64_t N, bool prefetch) {
  if constexpr (MT <= 4) {
    int8_tile<4, MT>(w, scales, q, d, sums, res, n0, 0, m0, K, N, prefetch, 0, K, nullptr);
  } else {  // two passes of 4 and MT - 4 rows over each block of K, so the tile's weights come from L1 the
            // second time (8 rows x 2 outputs in one pass measured slower: activations re-read from L2)
    __m512i first[16], second[4 * (MT - 4)];
    for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
      const int64_t k1 = std::min(K, k0 + kBlockK);
      int8_tile<4, 4>(w, scales, q, d, sums, res, n0, 0, m0, K, N, false, k0, k1, first);
      int8_tile<4, MT - 4>(w, scales, q, d, sums, res, n0, 0, m0 + 4, K, N, prefetch, k0, k1, second);
    }
  }
}

template <int MT>
void int4_tile(const uint8_t* w, const uint16_t* scales, const uint16_t* lows, const int8_t* q, const float* d,
               const int32_t* sums, float* res, int64_t n0, int64_t nt, int64_t m0,
               int64_t K, int64_t N, bool prefetch) {
  const int64_t G = K / 32;
  __m512 acc[kTileN][MT];
  for (int i = 0; i < kTileN; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lanes 4g..4g+3: g
  const uint8_t* wt = w + n0 * (K / 2);  // the tile's 4 rows, interleaved in 64-byte pieces
  const uint16_t* st = scales + n0 * G;   // and their scales, 4 per row per piece
  for (int64_t k = 0; k < K; k += 128) {
    __m512i xlo[MT], xhi[MT];  // the activations facing the low nibbles (x[32g .. 32g + 15]) and the high ones
    for (int j = 0; j < MT; ++j) {
      const __m512i a = _mm512_loadu_si512(q + (m0 + j) * K + k), b = _mm512_loadu_si512(q + (m0 + j) * K + k + 64);
      xlo[j] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));
      xhi[j] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    }
    if (prefetch) {  // the next tile's same piece and scales, into L2
      for (int i = 0; i < kTileN; ++i)
        _mm_prefetch((const char*)(wt + kTileN * (K / 2) + (k / 2) * kTileN + i * 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(st + kTileN * G + (k / 32) * kTileN), _MM_HINT_T1);
    }
    for (int i = 0; i < kTileN; ++i) {
      __m512i packed = _mm512_loadu_si512(wt + (k / 2) * kTileN + i * 64);
      __m512i lo = _mm512_and_si512(packed, nibble);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      __m512 s4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(st + (k / 32) * kTileN + i * 4))));
      __m512 s = _mm512_permutexvar_ps(spread, s4);
      for (int j = 0; j < MT; ++j) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[j]), hi, xhi[j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < nt; ++i)
    for (int j = 0; j < MT; ++j)
      res[(m0 + j) * N + n0 + i] = int4_output(F{acc[i][j]}, lows + (n0 + i) * G, sums + (m0 + j) * G, G, d[m0 + j]);
}

#else  // AVX2: 16 registers of 8 lanes. A tile's rows and activation rows are taken in passes small enough for their
       // accumulators to stay in registers (NT x MT <= 4), over blocks of K whose weights stay in L1 between passes.
       // One activation row (a decoding step) is one pass over the 4 tile rows: the tile read as on AVX-512, one
       // sequential stream, prefetched kAhead tiles ahead (one tile ahead measured 5-10% slower in a model's step).

constexpr int64_t kBlockK = 2048;  // elements of K per block
constexpr int64_t kAhead = 2;  // tiles ahead prefetched

// Signed bytes times signed bytes without VNNI: vpmaddubsw takes unsigned times signed, so |x| times q with x's sign;
// a pair of products is at most 2 x 127 x 127, which int16 holds (unsigned codes u = q + 128 would overflow it).
inline __m256i dot_q8(__m256i acc, __m256i qw, __m256i x, __m256i xabs) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(qw, x)),
                                                 _mm256_set1_epi16(1)));
}

inline int32_t hsum8(__m256i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// Tile rows r0 .. r0 + NT - 1 times activation rows m0 .. m0 + MT - 1 over K from k0 to k1, each output's integer sum
// added to dots[i][j] (exact: any split of K gives the same total). q: codes, qabs: their absolute values.
template <int NT, int MT>
void int8_pass(const uint8_t* wt, const int8_t* q, const int8_t* qabs, int64_t K, int r0, int64_t m0, int64_t k0,
               int64_t k1, bool prefetch, int32_t dots[kTileN][kMaxRows], int j0) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // u = q + 128 -> q
  __m256i acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 64) {
    __m256i a0[MT], a1[MT];
    for (int j = 0; j < MT; ++j) {
      a0[j] = _mm256_loadu_si256((const __m256i*)(qabs + (m0 + j) * K + k));
      a1[j] = _mm256_loadu_si256((const __m256i*)(qabs + (m0 + j) * K + k + 32));
    }
    if (prefetch)  // the same piece kAhead tiles on, into L2
      for (int i = 0; i < kTileN; ++i)
        _mm_prefetch((const char*)(wt + kAhead * kTileN * K + k * kTileN + i * 64), _MM_HINT_T1);
    for (int i = 0; i < NT; ++i) {
      const uint8_t* p = wt + k * kTileN + (r0 + i) * 64;
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)p), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32)), flip);
      for (int j = 0; j < MT; ++j) {
        const int8_t* x = q + (m0 + j) * K + k;
        acc[i][j] = dot_q8(acc[i][j], w0, _mm256_loadu_si256((const __m256i*)x), a0[j]);
        acc[i][j] = dot_q8(acc[i][j], w1, _mm256_loadu_si256((const __m256i*)(x + 32)), a1[j]);
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) dots[r0 + i][j0 + j] += hsum8(acc[i][j]);
}

// A tile (4 output rows from n0) times activation rows m0 .. m0 + mt - 1 (mt <= 8): one row in one pass of 4 tile
// rows, pairs in two passes of 2.
void int8_tile(const uint8_t* w, const float* scales, const int8_t* q, const int8_t* qabs, const float* d, float* res,
               int64_t n0, int64_t m0, int mt, int64_t K, int64_t N, bool prefetch) {
  const uint8_t* wt = w + n0 * K;
  int32_t dots[kTileN][kMaxRows] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int j = 0; j < mt; j += 2) {
      const bool first = prefetch && j == 0;
      if (j + 1 == mt) {
        int8_pass<4, 1>(wt, q, qabs, K, 0, m0 + j, k0, k1, first, dots, j);
      } else {
        int8_pass<2, 2>(wt, q, qabs, K, 0, m0 + j, k0, k1, first, dots, j);
        int8_pass<2, 2>(wt, q, qabs, K, 2, m0 + j, k0, k1, false, dots, j);
      }
    }
  }
  for (int i = 0; i < kTileN; ++i)
    for (int j = 0; j < mt; ++j) {
      const int64_t n = n0 + i, m = m0 + j;
      res[m * N + n] = d[m] * scales[n] * static_cast<float>(dots[i][j]);
    }
}

// Each level's codes, per chunk of 128, in the order the nibbles face them: the low nibbles' x[32g .. 32g + 15] for
// g = 0..3, then the high nibbles' x[32g + 16 .. 32g + 31] (VNNI's kernel shuffles them so in registers).
void face_nibbles(const int8_t* q, int64_t levels, int64_t K, int8_t* out) {
  for (int64_t v = 0; v < levels; ++v)
    for (int64_t k = 0; k < K; k += 128)
      for (int g = 0; g < 4; ++g) {
        std::memcpy(out + v * K + k + 16 * g, q + v * K + k + 32 * g, 16);
        std::memcpy(out + v * K + k + 64 + 16 * g, q + v * K + k + 32 * g + 16, 16);
      }
}

// Tile rows r0 .. r0 + NT - 1 times activation rows m0 .. m0 + MT - 1 over K from k0 to k1, the float accumulators
// carried in state[i][j] from block to block (each lane's chunks in order, as on AVX-512). Each 32-bit lane sums the
// same 8 products as vpdpbusd's lane (pairs by vpmaddubsw, at most 2 x 15 x 127, then the low and high nibbles', then
// pairs by vpmaddwd), and goes through the same float multiply-add. xq: the codes as face_nibbles orders them.
template <int NT, int MT>
void int4_pass(const uint8_t* wt, const uint16_t* st, const int8_t* xq, int64_t K, int r0, int64_t m0, int64_t k0,
               int64_t k1, bool prefetch, F state[kTileN][kMaxRows], int j0) {
  const int64_t G = K / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i spread_lo = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // lanes 4g..4g+3: group g
  const __m256i spread_hi = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  F acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = state[r0 + i][j0 + j];
  for (int64_t k = k0; k < k1; k += 128) {
    if (prefetch) {  // the same piece and scales kAhead tiles on, into L2
      for (int i = 0; i < kTileN; ++i)
        _mm_prefetch((const char*)(wt + kAhead * kTileN * (K / 2) + (k / 2) * kTileN + i * 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(st + kAhead * kTileN * G + (k / 32) * kTileN), _MM_HINT_T1);
    }
    for (int i = 0; i < NT; ++i) {
      const uint8_t* p = wt + (k / 2) * kTileN + (r0 + i) * 64;
      const __m256i p0 = _mm256_loadu_si256((const __m256i*)p), p1 = _mm256_loadu_si256((const __m256i*)(p + 32));
      const __m256i lo0 = _mm256_and_si256(p0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(p0, 4), nibble);
      const __m256i lo1 = _mm256_and_si256(p1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(p1, 4), nibble);
      const __m256 s4 = _mm256_castps128_ps256(
          _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(st + (k / 32) * kTileN + (r0 + i) * 4))));
      const __m256 s_lo = _mm256_permutevar8x32_ps(s4, spread_lo), s_hi = _mm256_permutevar8x32_ps(s4, spread_hi);
      for (int j = 0; j < MT; ++j) {
        const int8_t* x = xq + (m0 + j) * K + k;
        const __m256i d0 = _mm256_madd_epi16(_mm256_add_epi16(
            _mm256_maddubs_epi16(lo0, _mm256_loadu_si256((const __m256i*)x)),
            _mm256_maddubs_epi16(hi0, _mm256_loadu_si256((const __m256i*)(x + 64)))), ones);
        const __m256i d1 = _mm256_madd_epi16(_mm256_add_epi16(
            _mm256_maddubs_epi16(lo1, _mm256_loadu_si256((const __m256i*)(x + 32))),
            _mm256_maddubs_epi16(hi1, _mm256_loadu_si256((const __m256i*)(x + 96)))), ones);
        acc[i][j].lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), s_lo, acc[i][j].lo);
        acc[i][j].hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s_hi, acc[i][j].hi);
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) state[r0 + i][j0 + j] = acc[i][j];
}

// A tile (4 output rows from n0) times activation rows m0 .. m0 + mt - 1 (mt <= 8): one row in one pass of the 4 tile
// rows, two in two passes of 2, more (by 4) in a pass per tile row (8% faster on 5 rows than passes of pairs).
void int4_tile(const uint8_t* w, const uint16_t* scales, const uint16_t* lows, const int8_t* xq, const float* d,
               const int32_t* sums, float* res, int64_t n0, int64_t m0, int mt, int64_t K, int64_t N, bool prefetch) {
  const int64_t G = K / 32;
  const uint8_t* wt = w + n0 * (K / 2);
  const uint16_t* st = scales + n0 * G;
  F state[kTileN][kMaxRows];
  for (int i = 0; i < kTileN; ++i)
    for (int j = 0; j < mt; ++j) state[i][j] = fzero();
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int j = 0; j < mt; j += 4) {
      const bool first = prefetch && j == 0;
      switch (std::min(4, mt - j)) {
        case 1: int4_pass<4, 1>(wt, st, xq, K, 0, m0 + j, k0, k1, first, state, j); break;
        case 2:
          int4_pass<2, 2>(wt, st, xq, K, 0, m0 + j, k0, k1, first, state, j);
          int4_pass<2, 2>(wt, st, xq, K, 2, m0 + j, k0, k1, false, state, j);
          break;
        case 3:
          for (int i = 0; i < kTileN; ++i) int4_pass<1, 3>(wt, st, xq, K, i, m0 + j, k0, k1, first && i == 0, state, j);
          break;
        default:
          for (int i = 0; i < kTileN; ++i) int4_pass<1, 4>(wt, st, xq, K, i, m0 + j, k0, k1, first && i == 0, state, j);
      }
    }
  }
  for (int i = 0; i < kTileN; ++i)
    for (int j = 0; j < mt; ++j)
      res[(m0 + j) * N + n0 + i] = int4_output(state[i][j], lows + (n0 + i) * G, sums + (m0 + j) * G, G, d[m0 + j]);
}

#endif

template <typename Tile>
void run_tiles(int64_t M, int64_t N, int64_t K, Tile tile) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  // about 64 KiB of weights per task at least, so two threads split a layer in large pieces
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * kTileN));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t n0 = t * kTileN, nt = std::min<int64_t>(kTileN, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        tile(n0, nt, m0, static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), m0 + kMaxRows >= M);
    }
  });
}

void check_input(const at::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be (M, ", K, ")");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous bfloat16");
  TORCH_CHECK(K % multiple == 0, "K must be a multiple of ", multiple);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  check_input(x, K, 64);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "scales must be float32 (N)");
  TORCH_CHECK(N % kTileN == 0, "N must be a multiple of ", kTileN);
  auto out = at::empty({M, N}, x.options());
  auto q = at::empty({2 * M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({2 * M}, x.options().dtype(at::kFloat));
  auto sums = at::empty({2 * M}, x.options().dtype(at::kInt));
  std::vector<int64_t> owner(2 * M);
  const int64_t L = quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, K, q.data_ptr<int8_t>(),
                                  d.data_ptr<float>(), sums.data_ptr<int32_t>(), owner.data());
  auto res = at::empty({L, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* op = res.data_ptr<float>();
#if QD_AVX512
  const int32_t* smp = sums.data_ptr<int32_t>();
  run_tiles(L, N, K, [&](int64_t n0, int64_t nt, int64_t m0, int mt, bool last) {
    switch (mt) {
      case 1: int8_rows<1>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      case 2: int8_rows<2>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      case 3: int8_rows<3>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      case 4: int8_rows<4>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      case 5: int8_rows<5>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      case 6: int8_rows<6>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      case 7: int8_rows<7>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last); break;
      default: int8_rows<8>(wp, sp, qp, dp, smp, op, n0, m0, K, N, last);
    }
  });
#else
  auto qabs = at::abs(q.narrow(0, 0, L));  // |codes| <= 127: vpmaddubsw's unsigned operand
  const int8_t* ap = qabs.data_ptr<int8_t>();
  run_tiles(L, N, K, [&](int64_t n0, int64_t, int64_t m0, int mt, bool last) {
    int8_tile(wp, sp, qp, ap, dp, op, n0, m0, mt, K, N, last);
  });
#endif
  combine_levels(op, owner.data(), L, N, bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                 reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& lows,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1) * 2;
  check_input(x, K, 128);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 (N, K / 2)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * K / 32,
              "scales must be float16 (N, K / 32)");
  TORCH_CHECK(lows.scalar_type() == at::kHalf && lows.is_contiguous() && lows.numel() == N * K / 32,
              "lows must be float16 (N, K / 32)");
  TORCH_CHECK(N % kTileN == 0, "N must be a multiple of ", kTileN);
  auto out = at::empty({M, N}, x.options());
  auto q = at::empty({2 * M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({2 * M}, x.options().dtype(at::kFloat));
  auto sums = at::empty({2 * M, K / 32}, x.options().dtype(at::kInt));
  std::vector<int64_t> owner(2 * M);
  const int64_t L = quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, 32, q.data_ptr<int8_t>(),
                                  d.data_ptr<float>(), sums.data_ptr<int32_t>(), owner.data());
  auto res = at::empty({L, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* lp = reinterpret_cast<const uint16_t*>(lows.data_ptr());
  const float* dp = d.data_ptr<float>();
  const int32_t* smp = sums.data_ptr<int32_t>();
  float* op = res.data_ptr<float>();
#if QD_AVX512
  const int8_t* qp = q.data_ptr<int8_t>();
  run_tiles(L, N, K, [&](int64_t n0, int64_t nt, int64_t m0_, int mt_, bool last_) {
    for (int64_t m0 = m0_; m0 < m0_ + mt_; m0 += 4) {  // 4 rows at a time: float accumulators fill the registers
      const int mt = static_cast<int>(std::min<int64_t>(4, m0_ + mt_ - m0));
      const bool last = last_ && m0 + 4 >= m0_ + mt_;
      switch (mt) {
        case 1: int4_tile<1>(wp, sp, lp, qp, dp, smp, op, n0, nt, m0, K, N, last); break;
        case 2: int4_tile<2>(wp, sp, lp, qp, dp, smp, op, n0, nt, m0, K, N, last); break;
        case 3: int4_tile<3>(wp, sp, lp, qp, dp, smp, op, n0, nt, m0, K, N, last); break;
        default: int4_tile<4>(wp, sp, lp, qp, dp, smp, op, n0, nt, m0, K, N, last);
      }
    }
  });
#else
  auto faced = at::empty({L, K}, q.options());
  face_nibbles(q.data_ptr<int8_t>(), L, K, faced.data_ptr<int8_t>());
  const int8_t* qp = faced.data_ptr<int8_t>();
  run_tiles(L, N, K, [&](int64_t n0, int64_t, int64_t m0, int mt, bool last) {
    int4_tile(wp, sp, lp, qp, dp, smp, op, n0, m0, mt, K, N, last);
  });
#endif
  combine_levels(op, owner.data(), L, N, bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                 reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

constexpr int kMinSpan = 11;

// Each group's int4 grid: the best of min-max over 15..kMinSpan steps, then `steps` least-squares refits of (scale, lo) for the current codes,
// kept where they lower the squared error (quickdraft/quant/int4.py `fit` is the reference).
inline float group_error(const float* w, float scale, float lo) {
  float e = 0.0f;
  for (int i = 0; i < 32; ++i) {
    float q = std::min(15.0f, std::max(0.0f, std::nearbyint((w[i] - lo) / scale)));
    float r = q * scale + lo - w[i];
    e += r * r;
  }
  return e;
}

std::tuple<at::Tensor, at::Tensor> int4_fit(const at::Tensor& w, int64_t steps) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(-1) == 32, "w must be float32 (..., 32)");
  const int64_t groups = w.numel() / 32;
  auto scale = at::empty({groups}, w.options()), lo = at::empty({groups}, w.options());
  const float* wp = w.data_ptr<float>();
  float *sp = scale.data_ptr<float>(), *lp = lo.data_ptr<float>();
  at::parallel_for(0, groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* x = wp + g * 32;
      float mn = x[0], mx = x[0], mean_w = 0.0f;
      for (int i = 0; i < 32; ++i) mn = std::min(mn, x[i]), mx = std::max(mx, x[i]), mean_w += x[i];
      mean_w /= 32.0f;
      float s = std::max((mx - mn) / 15.0f, 1e-8f), l = mn, err = group_error(x, s, l);
      for (int span = 14; span >= kMinSpan; --span) {  // a block whose codes span fewer steps
        float cs = std::max((mx - mn) / span, 1e-8f), ce = group_error(x, cs, mn);
        if (ce < err) s = cs, err = ce;
      }
      for (int64_t it = 0; it < steps; ++it) {
        float q[32], mean_q = 0.0f;
        for (int i = 0; i < 32; ++i) mean_q += (q[i] = std::min(15.0f, std::max(0.0f, std::nearbyint((x[i] - l) / s))));
        mean_q /= 32.0f;
        float var = 0.0f, cov = 0.0f;
        for (int i = 0; i < 32; ++i) var += (q[i] - mean_q) * (q[i] - mean_q), cov += (q[i] - mean_q) * (x[i] - mean_w);
        if (var <= 0.0f) break;
        float ns = std::max(cov / var, 1e-8f), nl = mean_w - ns * mean_q, ne = group_error(x, ns, nl);
        if (!(ne < err)) break;  // no better: later rounds would start from the same codes
        s = ns, l = nl, err = ne;
      }
      sp[g] = s, lp[g] = l;
    }
  });
  return {scale, lo};
}

// Attention of S new query rows over a KV cache, row i seeing positions 0 .. start + i (the last `window` of them
// when window > 0: a sliding-window layer): every (row, head) computed alone, the same way whatever S is, so a
// verification pass gives each row exactly what a one-token decoding step gives it. q (B, H, S, D) contiguous,
// already scaled for logits q.k / sqrt(D); keys/values (B, Hkv, >= start + S, D) with unit stride along D; D a
// multiple of 16 (at most 256).
//
// The (head, row) pairs that share a key-value head are taken together, a tile of TILE positions at a time: the
// tile is read from memory once (converted to float once) for all of them, not once per head and row, which is what
// bounds a long context's step. Each pair's arithmetic is still its own and in the same order (its scores position
// by position, each a 16-lane dot product summed by sum_lanes, its sum over positions in order), so the bits do not
// depend on which pairs share a tile or a register block, nor on how many positions' scores are summed together.
// Within a tile, several pairs take each key or value chunk from one load (score_block, value_block): measured on a
// 2-core AMD EPYC (Zen 4), 64 rows of 12 heads over 2,000 positions took 7.4-8.0 ms against 13.8 (AVX2 build:
// 9.0-10.3 against 12.7-15.4), the bits unchanged.
constexpr int64_t TILE = 32;  // positions a tile: TILE x D floats (16 KiB at D = 128) stay in L1 beside the scratch
constexpr int64_t PAIRS_MAX = 32;
// Register blocks. Scores: kPairs pairs against kPositions positions (kPairs x kPositions accumulators), each key
// chunk loaded once for the kPairs pairs. Weighted values: kValuePairs pairs x kChunks 16-lane chunks of a value row
// (accumulators), each value chunk loaded once for the kValuePairs pairs. AVX2's 16 registers hold one pair's.
constexpr int kPositions = 4;  // (score_block's max of a whole block reads 4)
static_assert(kPositions == 4, "score_block's max of a whole block reads got[0..3]");
constexpr int kPairs = QD_AVX512 ? 4 : 1;
constexpr int kValuePairs = QD_AVX512 ? 3 : 1;
constexpr int kChunks = QD_AVX512 ? 8 : 4;

// Scores of NB pairs (their scaled queries qs[p], D = 16 chunks floats each) over positions t .. t + kPositions - 1 of
// a float tile (row r at tile + (r - t0) D): score(p, u) = sum_lanes of the 16-lane products summed over the chunks in
// order, stored where u lies in [from[p], to[p]) (sj[p][u]) and taken into the pair's running max. The accumulators
// are locals whose address is never taken until the sums (so they stay in registers: an array passed on by pointer
// was stored to the stack at every step).
template <int NB>
inline void score_block(const float* const* qs, const float* tile, int64_t t0, int64_t t, int64_t chunks,
                        const int64_t* from, const int64_t* to, float* const* sj, float* mx) {
  F a[NB][kPositions];
#pragma GCC unroll 16
  for (int p = 0; p < NB; ++p)
#pragma GCC unroll 4
    for (int l = 0; l < kPositions; ++l) a[p][l] = fzero();
  const float* kt = tile + (t - t0) * chunks * 16;
  for (int64_t c = 0; c < chunks; ++c) {
    F k[kPositions];
#pragma GCC unroll 4
    for (int l = 0; l < kPositions; ++l) k[l] = fload(kt + l * chunks * 16 + 16 * c);
#pragma GCC unroll 16
    for (int p = 0; p < NB; ++p) {
      const F qc = fload(qs[p] + 16 * c);
#pragma GCC unroll 4
      for (int l = 0; l < kPositions; ++l) a[p][l] = fmadd(qc, k[l], a[p][l]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < NB; ++p) {
    F sums[kPositions];
#pragma GCC unroll 4
    for (int l = 0; l < kPositions; ++l) sums[l] = a[p][l];
    float got[16];
    fstore(got, sum_lanes<kPositions>(sums));
    if (t >= from[p] && t + kPositions <= to[p]) {  // all of them (the max is exact: any order gives its bits)
      std::memcpy(&sj[p][t], got, kPositions * sizeof(float));
      mx[p] = std::max(mx[p], std::max(std::max(got[0], got[1]), std::max(got[2], got[3])));
      continue;
    }
    for (int64_t u = std::max(t, from[p]); u < std::min(t + kPositions, to[p]); ++u) {
      sj[p][u] = got[u - t];
      mx[p] = std::max(mx[p], sj[p][u]);
    }
  }
}

// The weighted values of NB pairs over positions u0 .. u1 - 1 of a float tile (row u at tile + (u - t0) D), chunks
// c0 .. c0 + CG - 1 of their accumulators acc[p]: acc[p][c] += p(u) v(u) for u in order, each value chunk loaded once
// for the NB pairs (the sums held in locals meanwhile: see score_block).
template <int NB, int CG>
inline void value_block(float* const* acc, const float* const* sj, const float* tile, int64_t t0, int64_t u0,
                        int64_t u1, int64_t D, int64_t c0) {
  if (u0 >= u1) return;
  F ov[NB][CG];
#pragma GCC unroll 16
  for (int p = 0; p < NB; ++p)
#pragma GCC unroll 16
    for (int c = 0; c < CG; ++c) ov[p][c] = fload(acc[p] + 16 * (c0 + c));
  for (int64_t u = u0; u < u1; ++u) {
    F pu[NB];
#pragma GCC unroll 16
    for (int p = 0; p < NB; ++p) pu[p] = fset(sj[p][u]);
    const float* vu = tile + (u - t0) * D + 16 * c0;
#pragma GCC unroll 16
    for (int c = 0; c < CG; ++c) {
      const F v = fload(vu + 16 * c);
#pragma GCC unroll 16
      for (int p = 0; p < NB; ++p) ov[p][c] = fmadd(pu[p], v, ov[p][c]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < NB; ++p)
#pragma GCC unroll 16
    for (int c = 0; c < CG; ++c) fstore(acc[p] + 16 * (c0 + c), ov[p][c]);
}

// NB pairs' weighted values over a tile (positions t0 .. t1 - 1), chunks c0 .. c0 + CG - 1: each pair's positions in
// order (those before the pairs' common span alone, the common span together, those after it alone), so each pair's
// sums are what it gets alone.
template <int NB, int CG>
void values_of(float* const* acc, const float* const* sj, const int64_t* from, const int64_t* to, const float* tile,
               int64_t t0, int64_t D, int64_t c0) {
  int64_t lo = from[0], hi = to[0];
  for (int p = 1; p < NB; ++p) lo = std::max(lo, from[p]), hi = std::min(hi, to[p]);
  hi = std::max(hi, lo);
  for (int p = 0; p < NB; ++p)  // before the common span
    value_block<1, CG>(&acc[p], &sj[p], tile, t0, from[p], std::min(lo, to[p]), D, c0);
  value_block<NB, CG>(acc, sj, tile, t0, lo, hi, D, c0);
  for (int p = 0; p < NB; ++p)  // after it
    value_block<1, CG>(&acc[p], &sj[p], tile, t0, std::max(hi, from[p]), to[p], D, c0);
}

template <int CG>
void values_by(int nb, float* const* acc, const float* const* sj, const int64_t* from, const int64_t* to,
               const float* tile, int64_t t0, int64_t D, int64_t c0) {
  switch (nb) {
    case 1: values_of<1, CG>(acc, sj, from, to, tile, t0, D, c0); break;
#if QD_AVX512
    case 2: values_of<2, CG>(acc, sj, from, to, tile, t0, D, c0); break;
    default: values_of<kValuePairs, CG>(acc, sj, from, to, tile, t0, D, c0);
#else
    default: break;
#endif
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                            int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "bfloat16 tensors expected");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be contiguous (B, H, S, D)");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), Hkv = keys.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && H % Hkv == 0, "head size must be a multiple of 16, at most 256");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(2) >= start + S, "bad cache layout");
  auto out = at::empty_like(q);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(values.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t kb = keys.stride(0), kh = keys.stride(1), kt = keys.stride(2);
  const int64_t vb = values.stride(0), vh = values.stride(1), vt = values.stride(2);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t chunks = D / 16, per_group = (H / Hkv) * S;  // the (head, row) pairs of one key-value head
  // each group's pairs split into as many parts as keep every thread busy, and at most PAIRS_MAX pairs a part (their
  // scores are a part's scratch: PAIRS_MAX x the positions, in float)
  const int64_t for_threads = (at::get_num_threads() + B * Hkv - 1) / (B * Hkv);
  const int64_t for_scratch = (per_group + PAIRS_MAX - 1) / PAIRS_MAX;
  const int64_t parts = std::min<int64_t>(per_group, std::max<int64_t>(for_threads, for_scratch));
  const int64_t part_size = (per_group + parts - 1) / parts;
  at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(part_size * D), acc(part_size * D), tile(TILE * D);
    std::vector<std::vector<float>> scores(part_size);
    std::vector<int64_t> firsts(part_size), lasts(part_size), rows_of(part_size), heads_of(part_size);
    std::vector<float> maxes(part_size), invs(part_size);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / (Hkv * parts), g = (job / parts) % Hkv, part = job % parts;
      const int64_t p0 = part * part_size, n = std::min(per_group, p0 + part_size) - p0;
      if (n <= 0) continue;
      int64_t lo = INT64_MAX, hi = 0;  // the positions any pair of the part sees
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pair = p0 + j, h = g * (H / Hkv) + pair / S, i = pair % S;
        heads_of[j] = h, rows_of[j] = i;
        lasts[j] = start + i + 1;
        firsts[j] = window > 0 ? std::max<int64_t>(0, lasts[j] - window) : 0;
        lo = std::min(lo, firsts[j]), hi = std::max(hi, lasts[j]);
        scores[j].resize(lasts[j] - firsts[j] + 16);
        const uint16_t* qrow = qp + ((b * H + h) * S + i) * D;
        for (int64_t c = 0; c < chunks; ++c) fstore(&qs[j * D + 16 * c], fload_bf16(qrow + 16 * c) * fset(scale));
        maxes[j] = -INFINITY;
      }
      const uint16_t* kbase = kp + b * kb + g * kh;
      const uint16_t* vbase = vp + b * vb + g * vh;
      for (int64_t t0 = lo; t0 < hi; t0 += TILE) {  // scores, a tile of keys at a time
        const int64_t t1 = std::min(hi, t0 + TILE), blocks = (t1 - t0 + 15) / 16;
        for (int64_t t = t0; t < t0 + 16 * blocks; ++t)
          for (int64_t c = 0; c < chunks; ++c)
            fstore(&tile[(t - t0) * D + 16 * c], t < t1 ? fload_bf16(kbase + t * kt + 16 * c) : fzero());
        for (int64_t j0 = 0; j0 < n; j0 += kPairs) {  // kPairs pairs at a time, each its own positions
          const int nb = static_cast<int>(std::min<int64_t>(kPairs, n - j0));
          const float* qb[kPairs];
          float* sb[kPairs];
          int64_t fb[kPairs], tb[kPairs], first = INT64_MAX, last = 0;
          for (int p = 0; p < nb; ++p) {
            const int64_t j = j0 + p;
            qb[p] = &qs[j * D], sb[p] = scores[j].data() - firsts[j];
            fb[p] = std::max(t0, firsts[j]), tb[p] = std::min(t1, lasts[j]);
            if (fb[p] < tb[p]) first = std::min(first, fb[p]), last = std::max(last, tb[p]);
          }
          for (int64_t t = t0 + (first - t0) / kPositions * kPositions; t < last; t += kPositions) {
            switch (nb) {
              case 1: score_block<1>(qb, tile.data(), t0, t, chunks, fb, tb, sb, &maxes[j0]); break;
#if QD_AVX512
              case 2: score_block<2>(qb, tile.data(), t0, t, chunks, fb, tb, sb, &maxes[j0]); break;
              case 3: score_block<3>(qb, tile.data(), t0, t, chunks, fb, tb, sb, &maxes[j0]); break;
              default: score_block<kPairs>(qb, tile.data(), t0, t, chunks, fb, tb, sb, &maxes[j0]);
#endif
            }
          }
        }
      }
      for (int64_t j = 0; j < n; ++j) {  // each pair's weights: exp(score - max), and their sum in order
        const int64_t L = lasts[j] - firsts[j];
        float* sj = scores[j].data();
        const F mx = fset(maxes[j]);
        F total = fzero();
        int64_t t = 0;
        for (; t + 16 <= L; t += 16) {
          const F e = exp_nonpositive(fload(&sj[t]) - mx);
          fstore(&sj[t], e);
          total = total + e;
        }
        if (t < L) {
          const F e = fkeep_first(exp_nonpositive(fload_first(&sj[t], L - t) - mx), L - t);
          fstore_first(&sj[t], e, L - t);
          total = total + e;
        }
        invs[j] = 1.0f / reduce_add(total);
        std::fill(&acc[j * D], &acc[j * D] + D, 0.0f);
      }
      for (int64_t u0 = lo; u0 < hi; u0 += TILE) {  // the weighted values, a tile at a time, each pair in order
        const int64_t u1 = std::min(hi, u0 + TILE);
        for (int64_t u = u0; u < u1; ++u)
          for (int64_t c = 0; c < chunks; ++c)
            fstore(&tile[(u - u0) * D + 16 * c], fload_bf16(vbase + u * vt + 16 * c));
        for (int64_t j0 = 0; j0 < n; j0 += kValuePairs) {
          const int nb = static_cast<int>(std::min<int64_t>(kValuePairs, n - j0));
          float* ab[kValuePairs];
          const float* sb[kValuePairs];
          int64_t fb[kValuePairs], tb[kValuePairs];
          for (int p = 0; p < nb; ++p) {
            const int64_t j = j0 + p;
            ab[p] = &acc[j * D], sb[p] = scores[j].data() - firsts[j];
            fb[p] = std::max(u0, firsts[j]), tb[p] = std::max(fb[p], std::min(u1, lasts[j]));
          }
          for (int64_t c0 = 0; c0 < chunks; c0 += kChunks) {
            const int64_t cn = std::min<int64_t>(kChunks, chunks - c0);
            if (cn == kChunks) {
              values_by<kChunks>(nb, ab, sb, fb, tb, tile.data(), u0, D, c0);
            } else if (cn == 4 && kChunks != 4) {
              values_by<4>(nb, ab, sb, fb, tb, tile.data(), u0, D, c0);
            } else {  // another width: a pair at a time, its chunks in memory
              for (int p = 0; p < nb; ++p)
                for (int64_t u = fb[p]; u < tb[p]; ++u) {
                  const F pu = fset(sb[p][u]);
                  const float* vu = &tile[(u - u0) * D + 16 * c0];
                  for (int64_t c = 0; c < cn; ++c)
                    fstore(ab[p] + 16 * (c0 + c), fmadd(pu, fload(vu + 16 * c), fload(ab[p] + 16 * (c0 + c))));
                }
            }
          }
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        uint16_t* orow = op + ((b * H + heads_of[j]) * S + rows_of[j]) * D;
        for (int64_t c = 0; c < chunks; ++c) {
          float tmp[16];
          fstore(tmp, fload(&acc[j * D + 16 * c]) * fset(invs[j]));
          for (int e = 0; e < 16; ++e) orow[16 * c + e] = float_to_bf16(tmp[e]);
        }
      }
    }
  });
  return out;
}


// Small fused steps of a decode pass, each the same arithmetic as the PyTorch code it replaces
// (models/transformer.py), one call instead of 5-10 small ops.

// RMSNorm: w * bf16(x * rsqrt(mean(x^2) + eps)), x (rows, D) bf16, w (D) bf16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "contiguous bfloat16 expected");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(D % 16 == 0 && w.numel() == D, "D must be a multiple of 16");
  auto out = at::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = xp + r * D;
    F ss = fzero();
    for (int64_t k = 0; k < D; k += 16) {
      const F v = fload_bf16(row + k);
      ss = fmadd(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(reduce_add(ss) / static_cast<float>(D) + static_cast<float>(eps));
    for (int64_t k = 0; k < D; k += 16)
      fstore_bf16(op + r * D + k, fload_bf16(wp + k) * fround_bf16(fload_bf16(row + k) * fset(inv)));
  }
  return out;
}

// SiLU(gate) * up from the fused gate-and-up projection (rows, 2F): bf16(bf16(silu(g)) * u).
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.is_contiguous(), "contiguous bfloat16 expected");
  const int64_t F_ = gu.size(-1) / 2, rows = gu.numel() / (2 * F_);
  TORCH_CHECK(F_ % 16 == 0, "F must be a multiple of 16");
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = F_;
  auto out = at::empty(shape, gu.options());
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(gu.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const F one = fset(1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < F_; k += 16) {
      const F g = fload_bf16(gp + r * 2 * F_ + k), u = fload_bf16(gp + r * 2 * F_ + F_ + k);
      const F e = exp_nonpositive(fzero() - fabs(g));  // exp(-|g|)
      const F sig = fselect_negative(g, e, one) / (one + e);  // sigmoid(g)
      fstore_bf16(op + r * F_ + k, fround_bf16(g * sig) * u);
    }
  return out;
}

// Rotary ("neox" half split) of q and k from the fused projection, into (B, H, S, D) layouts:
// qkv (B, S, (Hq + 2 Hkv) D) bf16, cos and sin (S, D) float32 -> q (B, Hq, S, D), k and v (B, Hkv, S, D).
// out = bf16(x cos + rotate(x) sin), rotate(x) = (-x2, x1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rotary(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t Hq, int64_t Hkv) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() && qkv.dim() == 3, "qkv (B, S, W) bf16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "float32 contiguous cos and sin");
  const int64_t B = qkv.size(0), S = qkv.size(1), W = qkv.size(2), D = W / (Hq + 2 * Hkv), half = D / 2;
  TORCH_CHECK(D * (Hq + 2 * Hkv) == W && half % 16 == 0 && cos.size(0) == S && cos.size(1) == D, "bad shapes");
  auto q = at::empty({B, Hq, S, D}, qkv.options()), k = at::empty({B, Hkv, S, D}, qkv.options());
  auto v = at::empty({B, Hkv, S, D}, qkv.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(qkv.data_ptr());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  uint16_t* qp = reinterpret_cast<uint16_t*>(q.data_ptr());
  uint16_t* kp = reinterpret_cast<uint16_t*>(k.data_ptr());
  uint16_t* vp = reinterpret_cast<uint16_t*>(v.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t) {
      const uint16_t* row = xp + (b * S + t) * W;
      const float *c = cp + t * D, *sn = sp + t * D;
      for (int64_t h = 0; h < Hq + 2 * Hkv; ++h) {
        const uint16_t* x = row + h * D;
        uint16_t* dst = h < Hq ? qp + ((b * Hq + h) * S + t) * D
                      : h < Hq + Hkv ? kp + ((b * Hkv + h - Hq) * S + t) * D
                                     : vp + ((b * Hkv + h - Hq - Hkv) * S + t) * D;
        if (h >= Hq + Hkv) {
          std::memcpy(dst, x, D * sizeof(uint16_t));
          continue;
        }
        for (int64_t i = 0; i < half; i += 16) {
          const F x1 = fload_bf16(x + i), x2 = fload_bf16(x + half + i);
          fstore_bf16(dst + i, x1 * fload(c + i) + (fzero() - x2) * fload(sn + i));
          fstore_bf16(dst + half + i, x2 * fload(c + half + i) + x1 * fload(sn + half + i));
        }
      }
    }
  return {q, k, v};
}

// One decoder layer of a pass of S <= 64 tokens, in one call: the same kernels, in the same order and on the
// same inputs, as the layer's PyTorch modules (models/transformer.py Block with quantized linear layers),
// so its output is bit-identical; what it saves is the ~25 operator dispatches and module calls between them
// (about 0.15 ms a layer: a fifth of the draft's one-token step). w holds the two norms' weights, then 4
// tensors per linear layer (wqkv, wo, w13, w2): int4 (packed, scales, lows, bias) or int8 (codes, scales,
// unused, bias), as kinds says (4 or 8); an empty tensor stands for no bias. x (B, S, D) bf16; keys and
// values (B, Hkv, capacity, Dh) this layer's cache, written at start .. start + S - 1.
at::Tensor linear_of(const at::Tensor& x, at::TensorList w, int64_t first, int64_t kind) {
  const at::Tensor& bias = w[first + 3];
  const c10::optional<at::Tensor> b = bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  const int64_t K = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  at::Tensor out = kind == 4 ? int4_linear(x2, w[first], w[first + 1], w[first + 2], b) : int8_linear(x2, w[first], w[first + 1], b);
  return out.view({x.size(0), x.size(1), out.size(1)});
}

at::Tensor block_step(const at::Tensor& x, at::TensorList w, at::IntArrayRef kinds, double eps, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t Hq, int64_t Hkv, const at::Tensor& keys, const at::Tensor& values,
                      int64_t start) {
  TORCH_CHECK(w.size() == 18 && kinds.size() == 4, "w: 2 norms + 4 linear layers x 4 tensors; kinds: 4");
  TORCH_CHECK(x.dim() == 3 && keys.dim() == 4 && values.dim() == 4, "x (B, S, D), caches (B, Hkv, T, Dh)");
  const int64_t B = x.size(0), S = x.size(1);
  TORCH_CHECK(start + S <= keys.size(2), "positions beyond the cache");
  auto [q, k, v] = qkv_rotary(linear_of(rms_norm(x.contiguous(), w[0], eps), w, 2, kinds[0]).contiguous(), cos, sin, Hq, Hkv);
  keys.narrow(2, start, S).copy_(k);
  values.narrow(2, start, S).copy_(v);
  at::Tensor attn = decode_attention(q, keys.narrow(2, 0, start + S), values.narrow(2, 0, start + S), start, 0);
  attn = attn.transpose(1, 2).reshape({B, S, -1});
  at::Tensor h = at::add(x, linear_of(attn, w, 6, kinds[1]));
  at::Tensor gate_up = linear_of(rms_norm(h.contiguous(), w[1], eps), w, 10, kinds[2]);
  return at::add(h, linear_of(silu_mul(gate_up.contiguous()), w, 14, kinds[3]));
}

// One token of the gated delta rule (a Gated DeltaNet layer's recurrence, models/transformer.py) for every head:
// S' = d S + k (beta (v - d S^T k))^T, out = S'^T q, in float32, S (B, H, K, V) read once into out_state, another
// of the cache's preallocated slots (the old state is kept: the history rollbacks return to). Each head's K x V state
// fits the L2 cache, so its two sweeps cost one trip to memory. Reductions over K run in order k = 0..K-1: the same
// result whatever the pass.
at::Tensor gated_delta_step(const at::Tensor& state, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& decay, const at::Tensor& beta, at::Tensor& out_state) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&state, &q, &k, &v, &decay, &beta, &out_state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "contiguous float32 expected");
  TORCH_CHECK(out_state.sizes() == state.sizes() && out_state.data_ptr() != state.data_ptr(),
              "out_state: another tensor of the state's shape");
  const int64_t BH = state.size(0) * state.size(1), K = state.size(2), V = state.size(3);
  auto out = at::empty({state.size(0), state.size(1), V}, state.options());
  const float *sp = state.data_ptr<float>(), *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(),
              *vp = v.data_ptr<float>(), *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *np = out_state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> mem(V), delta(V);
    for (int64_t h = begin; h < end; ++h) {
      const float* S = sp + h * K * V;
      float* N = np + h * K * V;
      const float *qh = qp + h * K, *kh = kp + h * K, *vh = vp + h * V;
      const float d = dp[h], b = bp[h];
      std::fill(mem.begin(), mem.end(), 0.0f);
      for (int64_t i = 0; i < K; ++i) {
        const float ki = kh[i];
        for (int64_t j = 0; j < V; ++j) {
          const float t = S[i * V + j] * d;
          N[i * V + j] = t;
          mem[j] += t * ki;
        }
      }
      for (int64_t j = 0; j < V; ++j) delta[j] = (vh[j] - mem[j]) * b;
      float* o = op + h * V;
      std::fill(o, o + V, 0.0f);
      for (int64_t i = 0; i < K; ++i) {
        const float ki = kh[i], qi = qh[i];
        for (int64_t j = 0; j < V; ++j) {
          const float n = N[i * V + j] + ki * delta[j];
          N[i * V + j] = n;
          o[j] += qi * n;
        }
      }
    }
  });
  return out;
}

}  // namespace

// The library's name says which build it is (quant/vnni.py loads one or both): TORCH_LIBRARY pastes its argument
// unexpanded, hence the indirection.
#if QD_AVX512
#define QD_LIBRARY quickdraft_vnni
#else
#define QD_LIBRARY quickdraft_avx2_int
#endif
#define QD_TORCH_LIBRARY(name, m) TORCH_LIBRARY(name, m)
#define QD_TORCH_LIBRARY_IMPL(name, key, m) TORCH_LIBRARY_IMPL(name, key, m)

QD_TORCH_LIBRARY(QD_LIBRARY, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("qkv_rotary(Tensor qkv, Tensor cos, Tensor sin, int hq, int hkv) -> (Tensor, Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, int start, int window) -> Tensor");
  m.def("int4_fit(Tensor w, int steps) -> (Tensor, Tensor)");
  m.def("gated_delta_step(Tensor state, Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, "
        "Tensor(a!) out_state) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scales, Tensor lows, Tensor? bias) -> Tensor");
  m.def("block_step(Tensor x, Tensor[] w, int[] kinds, float eps, Tensor cos, Tensor sin, int hq, int hkv, "
        "Tensor(a!) keys, Tensor(b!) values, int start) -> Tensor");
}

QD_TORCH_LIBRARY_IMPL(QD_LIBRARY, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("int4_linear", int4_linear);
  m.impl("int4_fit", int4_fit);
  m.impl("gated_delta_step", gated_delta_step);
  m.impl("decode_attention", decode_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("qkv_rotary", qkv_rotary);
  m.impl("block_step", block_step);
}
