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
#include <cmath>
#include <limits>
#include <vector>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
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

// llama.cpp's arithmetic for Q4_1: each row's activations quantized per block of 32 to int8 with a
// scale dx (and the block's sum sx = dx·Σq), then integer dot products of codes and activations:
// Σ w·x = d·dx·Σ q·qx + m·sx per block
template <int R>
void q4q8_rows(const int8_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* codes,
               const uint16_t* d, const uint16_t* m, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t B = K / BLOCK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* c = codes + n * (K / 2);
    __m256 acc[R];
    float shift[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), shift[r] = 0.f;
    for (int64_t b = 0; b < B; b++) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16));
      const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);  // weights 0..31
      const float db = _cvtsh_ss(d[n * B + b]), mb = _cvtsh_ss(m[n * B + b]);
      for (int r = 0; r < R; r++) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * BLOCK));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);  // 8 partial sums
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(db * dx[r * B + b]), _mm256_cvtepi32_ps(dot), acc[r]);
        shift[r] += mb * sx[r * B + b];
      }
    }
    for (int r = 0; r < R; r++) y[r * N + n] = hsum(acc[r]) + shift[r];
  }
}

// a row's activations per block of 32: int8 codes, their scale and the block's sum (llama.cpp's Q8_1)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  for (int64_t i = 0; i < M * (K / BLOCK); i++) {
    const float* xb = x + i * BLOCK;
    float amax = 0.f;
    for (int j = 0; j < BLOCK; j++) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    int sum = 0;
    for (int j = 0; j < BLOCK; j++) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      xq[i * BLOCK + j] = static_cast<int8_t>(v);
      sum += v;
    }
    dx[i] = scale;
    sx[i] = scale * static_cast<float>(sum);
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

at::Tensor q4q8_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  check(x_, codes, codes.size(1) * 2);
  TORCH_CHECK(x_.size(1) % BLOCK == 0, "q4 needs K a multiple of 32");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), B = K / BLOCK;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, M, B}, x.options());
  int8_t* XQ = xq.data_ptr<int8_t>();
  float* DX = scales.data_ptr<float>();
  float* SX = DX + M * B;
  quantize_rows(x.data_ptr<float>(), M, K, XQ, DX, SX);
  const uint8_t* C = codes.data_ptr<uint8_t>();
  const auto* D = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* Mn = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* Y = y.data_ptr<float>();
  by_rows(M, N, 16,
          [&](int64_t r, int64_t a, int64_t b) { q4q8_rows<4>(XQ + r * K, DX + r * B, SX + r * B, K, C, D, Mn, Y + r * N, N, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { q4q8_rows<2>(XQ + r * K, DX + r * B, SX + r * B, K, C, D, Mn, Y + r * N, N, a, b); },
          [&](int64_t r, int64_t a, int64_t b) { q4q8_rows<1>(XQ + r * K, DX + r * B, SX + r * B, K, C, D, Mn, Y + r * N, N, a, b); });
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

// Attention of each query row over the cache slots it sees, listed in order: idx (S, W) slot numbers,
// the first counts[s] of row s seen. Each (head, row) is computed alone by one thread, in slot
// order, so a row's result does not depend on the other rows of the call: a verify row, a tree
// node and a one-token forward at the same position attend alike. q (heads, S, d); keys, values
// (kv_heads, capacity, d), head h reading kv head h / (heads / kv_heads); d a multiple of 8.
at::Tensor attend(const at::Tensor& q_, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& idx_,
                  const at::Tensor& counts_, double scaling) {
  using Vec = at::vec::Vectorized<float>;
  TORCH_CHECK(q_.scalar_type() == at::kFloat && keys.is_contiguous() && values.is_contiguous(), "float32, contiguous");
  const at::Tensor q = q_.contiguous(), idx = idx_.contiguous(), counts = counts_.contiguous();
  const int64_t H = q.size(0), S = q.size(1), D = q.size(2), KV = keys.size(0), C = keys.size(1), W = idx.size(1);
  TORCH_CHECK(D % Vec::size() == 0 && H % KV == 0, "head size a multiple of 8, heads a multiple of kv heads");
  at::Tensor out = at::empty_like(q);
  const float* Q = q.data_ptr<float>();
  const float* K = keys.data_ptr<float>();
  const float* V = values.data_ptr<float>();
  const int64_t* I = idx.data_ptr<int64_t>();
  const int64_t* N = counts.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, H * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(W);
    for (int64_t hs = begin; hs < end; hs++) {
      const int64_t h = hs / S, s = hs % S, kv = h / (H / KV), n = N[s];
      TORCH_CHECK(n >= 1 && n <= W, "a row sees 1..W slots");
      const float* qr = Q + hs * D;
      const float* kb = K + kv * C * D;
      const float* vb = V + kv * C * D;
      const int64_t* slots = I + s * W;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; j++) {
        TORCH_CHECK(slots[j] >= 0 && slots[j] < C, "a slot outside the cache");
        const float* kr = kb + slots[j] * D;
        Vec acc(0.f);
        for (int64_t t = 0; t < D; t += Vec::size()) acc = at::vec::fmadd(Vec::loadu(qr + t), Vec::loadu(kr + t), acc);
        scores[j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc) * scale;
        top = std::max(top, scores[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < n; j++) total += (scores[j] = std::exp(scores[j] - top));
      float* o = O + hs * D;
      for (int64_t t = 0; t < D; t += Vec::size()) Vec(0.f).store(o + t);
      for (int64_t j = 0; j < n; j++) {
        const Vec p(scores[j] / total);
        const float* vr = vb + slots[j] * D;
        for (int64_t t = 0; t < D; t += Vec::size()) at::vec::fmadd(p, Vec::loadu(vr + t), Vec::loadu(o + t)).store(o + t);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(mtp_viz, lib) {
  lib.def("attend(Tensor q, Tensor keys, Tensor values, Tensor idx, Tensor counts, float scaling) -> Tensor");
  lib.def("q4_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("q4q8_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
  lib.def("f32_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_viz, CPU, lib) {
  lib.impl("attend", &attend);
  lib.impl("q4_linear", &q4_linear);
  lib.impl("q4q8_linear", &q4q8_linear);
  lib.impl("q8_linear", &q8_linear);
  lib.impl("f32_linear", &f32_linear);
}
