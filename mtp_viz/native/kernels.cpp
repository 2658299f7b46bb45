// The linear products of decoding on an x86 CPU: one weight matrix times 1 to 64 rows, each row
// computed by the same instructions in the same order whatever the row count, so a verify's rows
// equal the one-token forward's bit for bit (row-invariant by construction, no row plan needed).
// Rows go in groups of 4, 2 and 1 that share one unpacking of each weight block; each row keeps
// its own accumulators. Output rows (N) are split across threads; a row's sum is one thread's.
//
// Formats (w = the weight, K a multiple of 32, blocks of 32 along K):
//   q4:  codes (N, K/2) uint8, GGUF Q4_1's block layout: byte j of a block holds weight j (low
//        nibble) and weight j+16 (high nibble); d, m (N, K/32) float16: w = q·d + m.
//   q8:  codes (N, K) int8, GGUF Q8_0; d (N, K/32) float16: w = q·d.
//   f32: weight (N, K) float32 (any K).
// Activations are float32 throughout: "q4" computes Σ x·(q·d + m) as d·Σ x·q + m·Σ x per block.
// AVX2, FMA and F16C only (every x86 CPU this runs on has them; no AVX-512, no AMX).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

constexpr int64_t BLOCK = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline __m256 widen_i8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// one block's 32 weights (as 4 vectors of 8) against R rows' 32 activations: acc[r] += scale·Σ x·q
template <int R>
inline void block_dot(const __m256 q[4], __m256 scale, const float* x, int64_t ldx, __m256* acc) {
  for (int r = 0; r < R; r++) {
    const float* xr = x + r * ldx;
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), q[0]);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q[1], t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q[2], t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3], t);
    acc[r] = _mm256_fmadd_ps(scale, t, acc[r]);
  }
}

template <int R>
void q4_rows(const float* x, const float* sums, int64_t K, const uint8_t* codes, const uint16_t* d,
             const uint16_t* m, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t B = K / BLOCK;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* c = codes + n * (K / 2);
    __m256 acc[R];
    float shift[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), shift[r] = 0.f;
    for (int64_t b = 0; b < B; b++) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16));
      const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
      const __m256 q[4] = {widen_u8(lo), widen_u8(_mm_srli_si128(lo, 8)), widen_u8(hi), widen_u8(_mm_srli_si128(hi, 8))};
      block_dot<R>(q, _mm256_set1_ps(_cvtsh_ss(d[n * B + b])), x + b * BLOCK, K, acc);
      const float mb = _cvtsh_ss(m[n * B + b]);
      for (int r = 0; r < R; r++) shift[r] += mb * sums[r * B + b];
    }
    for (int r = 0; r < R; r++) y[r * N + n] = hsum(acc[r]) + shift[r];
  }
}

template <int R>
void q8_rows(const float* x, int64_t K, const int8_t* codes, const uint16_t* d, float* y, int64_t N, int64_t n0,
             int64_t n1) {
  const int64_t B = K / BLOCK;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* c = codes + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * BLOCK));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * BLOCK + 16));
      const __m256 q[4] = {widen_i8(lo), widen_i8(_mm_srli_si128(lo, 8)), widen_i8(hi), widen_i8(_mm_srli_si128(hi, 8))};
      block_dot<R>(q, _mm256_set1_ps(_cvtsh_ss(d[n * B + b])), x + b * BLOCK, K, acc);
    }
    for (int r = 0; r < R; r++) y[r * N + n] = hsum(acc[r]);
  }
}

template <int R>
void f32_rows(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K8 = K - K % 8;
  for (int64_t n = n0; n < n1; n++) {
    const float* wn = w + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wn + k);
      for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r]);
    }
    for (int r = 0; r < R; r++) {
      float s = hsum(acc[r]);
      for (int64_t k = K8; k < K; k++) s += x[r * K + k] * wn[k];
      y[r * N + n] = s;
    }
  }
}

// rows in groups of 4, 2, 1 (each row's arithmetic is the same in every group), output rows across threads
template <typename Rows4, typename Rows2, typename Rows1>
void by_rows(int64_t M, int64_t N, int64_t grain, Rows4 four, Rows2 two, Rows1 one) {
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) four(r, n0, n1);
    for (; r + 2 <= M; r += 2) two(r, n0, n1);
    for (; r < M; r++) one(r, n0, n1);
  });
}

void check(const at::Tensor& x, const at::Tensor& codes, int64_t k_of_codes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be (M, K) float32 on a CPU");
  TORCH_CHECK(x.size(1) == k_of_codes, "x has ", x.size(1), " inputs, the weight ", k_of_codes);
  TORCH_CHECK(codes.is_contiguous(), "weights must be contiguous");
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  check(x_, codes, codes.size(1) * 2);
  TORCH_CHECK(x_.size(1) % BLOCK == 0, "q4 needs K a multiple of 32");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), B = K / BLOCK;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor sums = at::empty({M, B}, x.options());  // Σ x per row and block: the m term
  const float* X = x.data_ptr<float>();
  float* S = sums.data_ptr<float>();
  for (int64_t i = 0; i < M * B; i++) {
    const float* xb = X + i * BLOCK;
    float s = 0.f;
    for (int j = 0; j < BLOCK; j++) s += xb[j];
    S[i] = s;
  }
  const uint8_t* C = codes.data_ptr<uint8_t>();
  const auto* D = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* Mn = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* Y = y.data_ptr<float>();
  auto rows = [&](auto tag, int64_t r, int64_t n0, int64_t n1) {
    q4_rows<decltype(tag)::value>(X + r * K, S + r * B, K, C, D, Mn, Y + r * N, N, n0, n1);
  };
  by_rows(M, N, 16, [&](int64_t r, int64_t a, int64_t b) { rows(std::integral_constant<int, 4>(), r, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { rows(std::integral_constant<int, 2>(), r, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { rows(std::integral_constant<int, 1>(), r, a, b); });
  return y;
}

at::Tensor q8_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& d) {
  check(x_, codes, codes.size(1));
  TORCH_CHECK(x_.size(1) % BLOCK == 0, "q8 needs K a multiple of 32");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const int8_t* C = codes.data_ptr<int8_t>();
  const auto* D = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  float* Y = y.data_ptr<float>();
  by_rows(M, N, 64, [&](int64_t r, int64_t a, int64_t b) { q8_rows<4>(X + r * K, K, C, D, Y + r * N, N, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { q8_rows<2>(X + r * K, K, C, D, Y + r * N, N, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { q8_rows<1>(X + r * K, K, C, D, Y + r * N, N, a, b); });
  return y;
}

at::Tensor f32_linear(const at::Tensor& x_, const at::Tensor& w) {
  check(x_, w, w.size(1));
  TORCH_CHECK(w.scalar_type() == at::kFloat, "f32_linear takes a float32 weight");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  by_rows(M, N, 16, [&](int64_t r, int64_t a, int64_t b) { f32_rows<4>(X + r * K, K, W, Y + r * N, N, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { f32_rows<2>(X + r * K, K, W, Y + r * N, N, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { f32_rows<1>(X + r * K, K, W, Y + r * N, N, a, b); });
  return y;
}

TORCH_LIBRARY(mtp_viz, lib) {
  lib.def("q4_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("f32_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_viz, CPU, lib) {
  lib.impl("q4_linear", &q4_linear);
  lib.impl("q8_linear", &q8_linear);
  lib.impl("f32_linear", &f32_linear);
}
