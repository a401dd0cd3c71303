// quickdraft's float32 CPU kernels for any x86-64 CPU with AVX2 and FMA (2013 on): the linear layer and the FFN's
// activation-and-multiply of a float32 model, computed so that a row's result never depends on the rows beside it or
// on the threads that share the work. PyTorch's float32 GEMM (MKL) picks its algorithm, and its split of the sum,
// by the row count and the thread count, so a row's logits differ between a one-token step and a verification pass;
// its vectorised elementwise kernels leave each thread's tail to scalar code, so an activation's bits depend on how
// the threads cut the tensor. Here:
//
// linear_f32: y[m][n] = (sum_k x[m][k] w[n][k]) + bias[n]. Lane j of an 8-float accumulator sums the products of the
//   k = j (mod 8) in order of k (the last chunk's missing k as zeros), the eight lanes are added in one fixed tree,
//   then the bias. Threads take whole output columns; tiles of 4 columns x up to 3 rows keep 12 accumulators in
//   registers, and a tile of fewer rows or columns runs the same sequence per output.
// act_mul: out[m][i] = act(gate[m][i]) * up[m][i] over gate_up = [gate | up] (SiLU or tanh GELU), every element by
//   the same vector code (a tail is padded into a vector), in float32, or for bf16 rounded as PyTorch rounds:
//   act in float, rounded to bf16, times up, rounded to bf16.
//
// The plain reference of each is in Python (quickdraft/quant/avx2.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kTileN = 4;  // output columns per tile
constexpr int kTileM = 3;  // rows per tile
constexpr int kBlockN = 16;  // columns a thread takes at a time
constexpr int kChunkM = 48;  // rows that pass over a block before the next block

inline float hsum(__m256 v) {  // the fixed tree: (0+4, 1+5, 2+6, 3+7), then (a+c, b+d), then the two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int C>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, const __m256i tail_mask, int64_t tail,
          const float* bias, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t full = K - tail;
  for (int64_t k = 0; k < full; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (tail) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_maskload_ps(w + c * K + full, tail_mask);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * ldx + full, tail_mask);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float s = hsum(acc[r][c]);
      y[r * ldy + c] = bias ? s + bias[c] : s;
    }
}

template <int C>
void rows_of(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t K, const __m256i mask, int64_t tail,
             const float* bias, float* y, int64_t ldy) {
  switch (rows) {
    case 3: tile<3, C>(x, ldx, w, K, mask, tail, bias, y, ldy); break;
    case 2: tile<2, C>(x, ldx, w, K, mask, tail, bias, y, ldy); break;
    default: tile<1, C>(x, ldx, w, K, mask, tail, bias, y, ldy); break;
  }
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32 takes float32");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "linear_f32: shapes do not match");
  const at::Tensor xs = x.reshape({-1, x.size(-1)}).contiguous();
  const at::Tensor ws = w.contiguous();
  const int64_t M = xs.size(0), K = xs.size(1), N = ws.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty({M, N}, xs.options());
  const float* xp = xs.data_ptr<float>();
  const float* wp = ws.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tail = K % 8;
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < tail ? -1 : 0;
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  // Threads take blocks of kBlockN columns; each thread walks its blocks once per chunk of kChunkM rows, so a block's
  // weights stay in L2 while a chunk's rows pass over them, and a chunk's rows stay in cache across the blocks.
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
      const int64_t m1 = std::min<int64_t>(M, m0 + kChunkM);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n1 = std::min<int64_t>(N, (blk + 1) * kBlockN);
        for (int64_t m = m0; m < m1; m += kTileM) {
          const int64_t rows = std::min<int64_t>(kTileM, m1 - m);
          for (int64_t n = blk * kBlockN; n < n1; n += kTileN) {
            const int64_t cols = std::min<int64_t>(kTileN, n1 - n);
            const float* xr = xp + m * K;
            const float* wr = wp + n * K;
            const float* br = bp ? bp + n : nullptr;
            float* yr = yp + m * N + n;
            switch (cols) {
              case 4: rows_of<4>(rows, xr, K, wr, K, mask, tail, br, yr, N); break;
              case 3: rows_of<3>(rows, xr, K, wr, K, mask, tail, br, yr, N); break;
              case 2: rows_of<2>(rows, xr, K, wr, K, mask, tail, br, yr, N); break;
              default: rows_of<1>(rows, xr, K, wr, K, mask, tail, br, yr, N); break;
            }
          }
        }
      }
    }
  });
  return y.reshape(sizes);
}

// exp(x) for float32 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), exp(r) by a degree-6 polynomial
// (Cephes' expf coefficients), times 2^n built in the exponent bits; x clamped to [-87.3, 88.7] (0 and inf beyond).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 silu8(__m256 g) {  // g / (1 + exp(-g))
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline __m256 gelu_tanh8(__m256 g) {  // g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3); 1 + tanh(u) = 2 - 2 / (e^2u + 1)
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.0f), u));
  const __m256 one_plus_tanh = _mm256_sub_ps(_mm256_set1_ps(2.0f),
                                             _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), one_plus_tanh);
}

inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline __m256 round_bf16(__m256 v) {  // v rounded to bf16 (nearest even; finite values) and back to float
  __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline void store_bf16x8(uint16_t* p, __m256 v) {  // v already rounded: its high halves
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <bool Bf16, int Kind>
inline __m256 act8(__m256 g, __m256 u) {
  const __m256 a = Kind == 0 ? silu8(g) : gelu_tanh8(g);
  return Bf16 ? round_bf16(_mm256_mul_ps(round_bf16(a), u)) : _mm256_mul_ps(a, u);
}

template <bool Bf16, int Kind, typename T>
void act_rows(const T* gu, T* out, int64_t M, int64_t I) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* g = gu + m * 2 * I;
      const T* u = g + I;
      T* o = out + m * I;
      for (int64_t i = 0; i < I; i += 8) {
        const int64_t n = std::min<int64_t>(8, I - i);
        alignas(32) T gb[8] = {}, ub[8] = {}, ob[8];
        const T* gp = g + i;
        const T* up = u + i;
        if (n < 8) {  // the tail through the same vector code
          std::memcpy(gb, gp, n * sizeof(T));
          std::memcpy(ub, up, n * sizeof(T));
          gp = gb;
          up = ub;
        }
        T* op = n < 8 ? ob : o + i;
        if constexpr (Bf16) {
          store_bf16x8(reinterpret_cast<uint16_t*>(op), act8<true, Kind>(load_bf16x8(reinterpret_cast<const uint16_t*>(gp)),
                                                                        load_bf16x8(reinterpret_cast<const uint16_t*>(up))));
        } else {
          _mm256_storeu_ps(op, act8<false, Kind>(_mm256_loadu_ps(gp), _mm256_loadu_ps(up)));
        }
        if (n < 8) std::memcpy(o + i, ob, n * sizeof(T));
      }
    }
  });
}

at::Tensor act_mul(const at::Tensor& gu, int64_t kind) {
  TORCH_CHECK(kind == 0 || kind == 1, "act_mul: kind 0 (SiLU) or 1 (tanh GELU)");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "act_mul: the last dimension holds gate and up");
  const at::Tensor x = gu.reshape({-1, gu.size(-1)}).contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty({M, I}, x.options());
  if (x.scalar_type() == at::kFloat) {
    if (kind == 0) act_rows<false, 0>(x.data_ptr<float>(), out.data_ptr<float>(), M, I);
    else act_rows<false, 1>(x.data_ptr<float>(), out.data_ptr<float>(), M, I);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "act_mul takes float32 or bfloat16");
    auto* g = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    if (kind == 0) act_rows<true, 0>(g, o, M, I);
    else act_rows<true, 1>(g, o, M, I);
  }
  return out.reshape(sizes);
}

}  // namespace

TORCH_LIBRARY(quickdraft_avx2, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("act_mul(Tensor gu, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(quickdraft_avx2, CPU, m) {
  m.impl("linear_f32", linear_f32);
  m.impl("act_mul", act_mul);
}
