// quickdraft's CPU kernels for x86 CPUs with AVX-512 VNNI: weight-only int8 and int4 linear layers, the
// attention of decode and verification passes, fused RMSNorm / SiLU-and-multiply / rotary steps, and the
// int4 grid fit. Each has a plain reference in Python (quickdraft/quant/vnni.py, models/transformer.py).
//
// Each call quantizes the activations per row (symmetric int8, one scale per row) and multiplies them
// with the integer weights by vpdpbusd (64 unsigned x signed byte products per instruction), reading
// every weight once for all the rows: verifying k+1 tokens costs little more than decoding one.
//
// int8: weights u = q + 128 in 0..255 (q in -127..127, one scale per output row).
//       y[m][n] = d[m] * s[n] * (sum_k u[n][k] x[m][k] - 128 * sum_k x[m][k])
// int4: weights q in 0..15 in groups of 32 along K, w = q * scale + lo (fp16 scale and lo per group),
//       packed in chunks of 128 (4 groups): byte 16g + i holds elements 32g + i (low nibble) and 32g + 16 + i
//       (high nibble), so both vpdpbusd of a chunk (low nibbles, high nibbles) add into the same group's
//       lanes and a chunk needs one conversion to float and one multiply-add per activation row.
//       y[m][n] = d[m] * sum_g (scale[n][g] * sum_{k in g} q[n][k] x[m][k] + lo[n][g] * sum_{k in g} x[m][k])
// where x are the int8 activations and d their row scales (a row of massive activations gets a second level
// of codes for its remainder, and its output sums both). Weights are tiled: each 4 output rows are
// interleaved in 64-byte pieces (and the int4 scales in pieces of 4), so a tile is one sequential stream
// for the hardware prefetcher. The plain reference is in Python
// (quickdraft/quant/vnni.py); each output is computed the same way whatever the number of rows, so
// batched verification gives bit-identical rows to one-at-a-time decoding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int kMaxRows = 8;  // rows of activations per pass over a tile (accumulators stay in registers)
constexpr int kTileN = 4;    // output rows per tile

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
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
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  const float dm = _mm512_reduce_max_ps(amax) / 127.0f;
  *d = dm;
  const __m512 div = _mm512_set1_ps(dm == 0.0f ? 1.0f : dm);
  for (int64_t g = 0; g < K / group; ++g) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + k), div));  // nearest even
      v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      acc = _mm512_add_epi32(acc, v);
      _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(v));
    }
    sums[g] = _mm512_reduce_add_epi32(acc);
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
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 v = load_bf16x16(x + m * K + k);
      _mm512_storeu_ps(row.data() + k, v);
      total = _mm512_add_ps(total, _mm512_abs_ps(v));
    }
    const int64_t first = levels++;
    quantize_row(row.data(), K, group, q + first * K, d + first, sums + first * (K / group));
    owner[first] = m;
    if (d[first] * 127.0f > kOutlierRatio * (_mm512_reduce_add_ps(total) / static_cast<float>(K))) {
      const __m512 d1 = _mm512_set1_ps(d[first]);
      for (int64_t k = 0; k < K; k += 16) {  // the remainder x - d1 q1
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + first * K + k))));
        _mm512_storeu_ps(row.data() + k, _mm512_sub_ps(_mm512_loadu_ps(row.data() + k), _mm512_mul_ps(d1, q1)));
      }
      const int64_t second = levels++;
      quantize_row(row.data(), K, group, q + second * K, d + second, sums + second * (K / group));
      owner[second] = m;
    }
  }
  return levels;
}

inline __m256i float_to_bf16x16(__m512 v) {  // round to nearest even (no NaN handling: finite inputs)
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
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
      __m512 y = _mm512_loadu_ps(res + v * N + n);
      if (two) y = _mm512_add_ps(y, _mm512_loadu_ps(res + (v + 1) * N + n));
      if (bias) y = _mm512_add_ps(y, load_bf16x16(bias + n));
      __m256i h = float_to_bf16x16(y);
      const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
      _mm256_storeu_si256((__m256i*)(o + n), _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7fc0)));
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
  for (int i = 0; i < nt; ++i) {
    int64_t n = n0 + i;
    const uint16_t* lo_n = lows + n * G;
    for (int j = 0; j < MT; ++j) {
      int64_t m = m0 + j;
      const int32_t* sm = sums + m * G;
      __m512 z = _mm512_setzero_ps();  // the lows' term, 16 groups at a time, the last ones masked
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 mask = G - g >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (G - g)) - 1);
        z = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, lo_n + g)),
                            _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, sm + g)), z);
      }
      res[m * N + n] = d[m] * _mm512_reduce_add_ps(_mm512_add_ps(acc[i][j], z));
    }
  }
}

template <typename F>
void run_tiles(int64_t M, int64_t N, int64_t K, F tile) {
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
  const int32_t* smp = sums.data_ptr<int32_t>();
  float* op = res.data_ptr<float>();
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
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const int32_t* smp = sums.data_ptr<int32_t>();
  float* op = res.data_ptr<float>();
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

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * p(f), p a degree-6 polynomial
// of the fraction (relative error ~2e-7); below -87 it gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // in [-ln2/2, ln2/2]
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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
// by position, its sum over positions in order), so the bits do not depend on which pairs share a tile.
// Sixteen dot products' last step: lane l of the result is the sum of a[l]'s lanes, always in the same order (pairs
// of lanes, then pairs of those, ...), whichever other vectors share the call.
inline __m512 sum16(const __m512* a) {
  __m512 s[8], u[4], w[2];
  for (int m = 0; m < 8; ++m)
    s[m] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * m], a[2 * m + 1]), _mm512_unpackhi_ps(a[2 * m], a[2 * m + 1]));
  for (int m = 0; m < 4; ++m) {
    const __m512d x = _mm512_castps_pd(s[2 * m]), y = _mm512_castps_pd(s[2 * m + 1]);
    u[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int m = 0; m < 2; ++m)
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

constexpr int64_t TILE = 64;
constexpr int64_t PAIRS_MAX = 32;

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
        for (int64_t c = 0; c < chunks; ++c)
          _mm512_storeu_ps(&qs[j * D + 16 * c], _mm512_mul_ps(load_bf16x16(qrow + 16 * c), _mm512_set1_ps(scale)));
        maxes[j] = -INFINITY;
      }
      const uint16_t* kbase = kp + b * kb + g * kh;
      const uint16_t* vbase = vp + b * vb + g * vh;
      for (int64_t t0 = lo; t0 < hi; t0 += TILE) {  // scores, a tile of keys at a time
        const int64_t t1 = std::min(hi, t0 + TILE), blocks = (t1 - t0 + 15) / 16;
        for (int64_t t = t0; t < t0 + 16 * blocks; ++t)
          for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(&tile[(t - t0) * D + 16 * c],
                             t < t1 ? load_bf16x16(kbase + t * kt + 16 * c) : _mm512_setzero_ps());
        for (int64_t j = 0; j < n; ++j) {
          const int64_t from = std::max(t0, firsts[j]), to = std::min(t1, lasts[j]);
          const float* qj = &qs[j * D];
          float* sj = scores[j].data() - firsts[j];
          float mx = maxes[j];
          for (int64_t t = t0 + (from - t0) / 16 * 16; t < to; t += 16) {  // 16 positions' scores at once
            __m512 a[16];
            for (int l = 0; l < 16; ++l) a[l] = _mm512_setzero_ps();
            const float* kt_ = &tile[(t - t0) * D];
            for (int64_t c = 0; c < chunks; ++c) {
              const __m512 qc = _mm512_loadu_ps(qj + 16 * c);
              for (int l = 0; l < 16; ++l) a[l] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kt_ + l * D + 16 * c), a[l]);
            }
            float got[16];
            _mm512_storeu_ps(got, sum16(a));
            for (int64_t u = std::max(t, from); u < std::min(t + 16, to); ++u) {
              sj[u] = got[u - t];
              mx = std::max(mx, sj[u]);
            }
          }
          maxes[j] = mx;
        }
      }
      for (int64_t j = 0; j < n; ++j) {  // each pair's weights: exp(score - max), and their sum in order
        const int64_t L = lasts[j] - firsts[j];
        float* sj = scores[j].data();
        const __m512 mx = _mm512_set1_ps(maxes[j]);
        __m512 total = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 16 <= L; t += 16) {
          __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(&sj[t]), mx));
          _mm512_storeu_ps(&sj[t], e);
          total = _mm512_add_ps(total, e);
        }
        if (t < L) {
          __mmask16 m = static_cast<__mmask16>((1u << (L - t)) - 1);
          __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, &sj[t]), mx));
          e = _mm512_maskz_mov_ps(m, e);
          _mm512_mask_storeu_ps(&sj[t], m, e);
          total = _mm512_add_ps(total, e);
        }
        invs[j] = 1.0f / _mm512_reduce_add_ps(total);
        std::fill(&acc[j * D], &acc[j * D] + D, 0.0f);
      }
      for (int64_t u0 = lo; u0 < hi; u0 += TILE) {  // the weighted values, a tile at a time, each pair in order
        const int64_t u1 = std::min(hi, u0 + TILE);
        for (int64_t u = u0; u < u1; ++u)
          for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(&tile[(u - u0) * D + 16 * c], load_bf16x16(vbase + u * vt + 16 * c));
        for (int64_t j = 0; j < n; ++j) {
          const int64_t from = std::max(u0, firsts[j]), to = std::min(u1, lasts[j]);
          if (from >= to) continue;
          const float* sj = scores[j].data() - firsts[j];
          __m512 ov[16];
          for (int64_t c = 0; c < chunks; ++c) ov[c] = _mm512_loadu_ps(&acc[j * D + 16 * c]);
          for (int64_t u = from; u < to; ++u) {
            const __m512 p = _mm512_set1_ps(sj[u]);
            const float* vu = &tile[(u - u0) * D];
            for (int64_t c = 0; c < chunks; ++c) ov[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vu + 16 * c), ov[c]);
          }
          for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(&acc[j * D + 16 * c], ov[c]);
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        uint16_t* orow = op + ((b * H + heads_of[j]) * S + rows_of[j]) * D;
        for (int64_t c = 0; c < chunks; ++c) {
          float tmp[16];
          _mm512_storeu_ps(tmp, _mm512_mul_ps(_mm512_loadu_ps(&acc[j * D + 16 * c]), _mm512_set1_ps(invs[j])));
          for (int e = 0; e < 16; ++e) orow[16 * c + e] = float_to_bf16(tmp[e]);
        }
      }
    }
  });
  return out;
}


// Small fused steps of a decode pass, each the same arithmetic as the PyTorch code it replaces
// (models/transformer.py), one call instead of 5-10 small ops.

inline __m512 round_bf16(__m512 v) {  // v rounded to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(float_to_bf16x16(v)), 16));
}

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
    __m512 ss = _mm512_setzero_ps();
    for (int64_t k = 0; k < D; k += 16) {
      __m512 v = load_bf16x16(row + k);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + static_cast<float>(eps));
    for (int64_t k = 0; k < D; k += 16) {
      __m512 h = round_bf16(_mm512_mul_ps(load_bf16x16(row + k), _mm512_set1_ps(inv)));
      _mm256_storeu_si256((__m256i*)(op + r * D + k), float_to_bf16x16(_mm512_mul_ps(load_bf16x16(wp + k), h)));
    }
  }
  return out;
}

// SiLU(gate) * up from the fused gate-and-up projection (rows, 2F): bf16(bf16(silu(g)) * u).
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.is_contiguous(), "contiguous bfloat16 expected");
  const int64_t F = gu.size(-1) / 2, rows = gu.numel() / (2 * F);
  TORCH_CHECK(F % 16 == 0, "F must be a multiple of 16");
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = F;
  auto out = at::empty(shape, gu.options());
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(gu.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < F; k += 16) {
      __m512 g = load_bf16x16(gp + r * 2 * F + k), u = load_bf16x16(gp + r * 2 * F + F + k);
      __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // exp(-|g|)
      __m512 one = _mm512_set1_ps(1.0f);
      __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
      __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));  // sigmoid(g)
      __m512 silu = round_bf16(_mm512_mul_ps(g, sig));
      _mm256_storeu_si256((__m256i*)(op + r * F + k), float_to_bf16x16(_mm512_mul_ps(silu, u)));
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
          __m512 x1 = load_bf16x16(x + i), x2 = load_bf16x16(x + half + i);
          __m512 lo = _mm512_add_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c + i)),
                                    _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), _mm512_loadu_ps(sn + i)));
          __m512 hi = _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(c + half + i)),
                                    _mm512_mul_ps(x1, _mm512_loadu_ps(sn + half + i)));
          _mm256_storeu_si256((__m256i*)(dst + i), float_to_bf16x16(lo));
          _mm256_storeu_si256((__m256i*)(dst + half + i), float_to_bf16x16(hi));
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

}  // namespace

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

TORCH_LIBRARY(quickdraft_vnni, m) {
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

TORCH_LIBRARY_IMPL(quickdraft_vnni, CPU, m) {
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
