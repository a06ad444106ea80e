#include "common.h"

// Products in 8-bit integers over GGUF blocks of 32 inputs, llama.cpp's arithmetic: each row
// of the input is rounded to 8-bit blocks (scale d_a = max |x| / 127, q_a = round(x / d_a)),
// and an output is a float32 sum over the blocks, in order, of
//   d_w * d_a * sum(q_w q_a)        (+ m_w * d_a * sum(q_a) for 4-bit blocks with a minimum),
// with the integer sums exact. Every row is rounded and summed on its own, in the same order
// whatever the row count, so a row's bits never depend on the other rows of the call: plain
// decoding and tree verification agree, as with the float32 kernels. The results differ from
// float32 products (the activations are rounded), which is why this is a mode of its own.
//
// Weights come in panels of 8 output columns (sot.kernels.linear.pack_int8):
//   4-bit: data [P, K/32, 128] uint8: byte 32 j + 4 c + t holds q[c][8 j + t] (low nibble) and
//          q[c][8 j + 4 + t] (high nibble), so a 32-byte load gives 4 inputs of 8 columns;
//   8-bit: data [P, K/32, 256] int8: byte 32 g + 4 c + t holds q[c][4 g + t];
//   scale (and, 4-bit, mins): [P, K/32, 8] float16 (the format's own values: exact, and half the
//   bytes that a one-row product streams beside the data).
namespace {

constexpr int64_t kCols = 8;
constexpr int kGroupRows = 4;

// One block of 32 inputs -> q [32] int8, its scale d = max |x| / 127 and d * sum(q).
inline void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);  // (a maximum is exact in any order)
#else
  float amax = 0.0f;
  for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(x[t]));
#endif
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX2__)
  // x * id rounded to the nearest integer, ties to even (as std::nearbyint), kept in [-127, 127]
  const __m256 vid = _mm256_set1_ps(id);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi);
    sum = _mm256_add_epi32(sum, qi[j]);
  }
  // 32 int32 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute undoes it)
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  const int total = _mm_cvtsi128_si32(s4);
#else
  int total = 0;
  for (int t = 0; t < 32; ++t) {
    const int v = std::clamp(static_cast<int>(std::nearbyint(x[t] * id)), -127, 127);
    q[t] = static_cast<int8_t>(v);
    total += v;
  }
#endif
  *d_out = d;
  *s_out = d * static_cast<float>(total);
}

// x [M, K] -> qa [M, K] int8, da [M, K/32] (scales), sa [M, K/32] (d_a * sum of the block's q_a).
void quantize_rows(const float* x, int64_t blocks, int8_t* qa, float* da, float* sa) {
  at::parallel_for(0, blocks, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_block(x + b * 32, qa + b * 32, da + b, sa + b);
  });
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// MR rows (qa: the first row's quantized inputs, rows K apart) times one panel: out [MR][8],
// rows `ldo` apart, plus the panel's 8 biases when `bias` is given (added last). With one or
// two rows, block kb of the panel that follows (`next`, or null) is fetched into L2 meanwhile,
// as in the float32 block kernel (linear.cpp, fused_block_tile): memory and arithmetic overlap.
template <int MR, bool Q4>
inline void int8_tile(const int8_t* qa, const float* da, const float* sa, int64_t K, const uint8_t* data,
                      const half_t* scale, const half_t* mins, float* out, int64_t ldo, const float* bias,
                      const uint8_t* next) {
  const int64_t nb = K / 32;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t per = nb * kCols;  // one panel's scales
  for (int64_t kb = 0; kb < nb; ++kb) {
    if (MR <= 2 && next != nullptr) {
      const char* block = reinterpret_cast<const char*>(next + kb * (Q4 ? 128 : 256));
      for (int o = 0; o < (Q4 ? 128 : 256); o += 64) _mm_prefetch(block + o, _MM_HINT_T1);
      if (kb % 4 == 0) {  // (four blocks' 8 scales to a cache line)
        _mm_prefetch(reinterpret_cast<const char*>(scale + per + kb * kCols), _MM_HINT_T1);
        if (Q4) _mm_prefetch(reinterpret_cast<const char*>(mins + per + kb * kCols), _MM_HINT_T1);
      }
    }
    __m256i s[MR];  // Q4: 16-bit sums (at most 8 * 2 * 15 * 127); Q8: 32-bit sums
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) s[i] = _mm256_setzero_si256();
    if (Q4) {
      const uint8_t* blk = data + kb * 128;
      // (not unrolled: unrolled, GCC computes every product of the block first and spills them)
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * j));
        const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const int8_t* a = qa + i * K + kb * 32 + 8 * j;
          s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(a))));
          s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(a + 4))));
        }
      }
    } else {
      const uint8_t* blk = data + kb * 256;
#pragma GCC unroll 1
      for (int g = 0; g < 8; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * g));
        const __m256i aw = _mm256_abs_epi8(w);  // |w| as unsigned bytes; the sign moves onto q_a
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(load4(qa + i * K + kb * 32 + 4 * g)), w);
          s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, a), ones));
        }
      }
    }
    const __m256 dw = load8h(scale + kb * kCols);
    const __m256 mw = Q4 ? load8h(mins + kb * kCols) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256i dot = Q4 ? _mm256_madd_epi16(s[i], ones) : s[i];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(da[i * nb + kb])), acc[i]);
      if (Q4) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[i * nb + kb]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
    _mm256_storeu_ps(out + i * ldo, bias ? _mm256_add_ps(acc[i], _mm256_loadu_ps(bias)) : acc[i]);
}
#else
template <int MR, bool Q4>
inline void int8_tile(const int8_t* qa, const float* da, const float* sa, int64_t K, const uint8_t* data,
                      const half_t* scale, const half_t* mins, float* out, int64_t ldo, const float* bias,
                      const uint8_t*) {
  const int64_t nb = K / 32;
  for (int i = 0; i < MR; ++i)
    for (int64_t c = 0; c < kCols; ++c) {
      float acc = 0.0f;
      for (int64_t kb = 0; kb < nb; ++kb) {
        int32_t dot = 0;
        for (int t = 0; t < 32; ++t) {
          int w;
          if (Q4) {
            const uint8_t byte = data[kb * 128 + 32 * (t / 8) + 4 * c + t % 4];
            w = (t % 8) < 4 ? byte & 15 : byte >> 4;
          } else {
            w = reinterpret_cast<const int8_t*>(data)[kb * 256 + 32 * (t / 4) + 4 * c + t % 4];
          }
          dot += w * qa[i * K + kb * 32 + t];
        }
        acc = std::fma(static_cast<float>(dot), half_value(scale[kb * kCols + c]) * da[i * nb + kb], acc);
        if (Q4) acc = std::fma(half_value(mins[kb * kCols + c]), sa[i * nb + kb], acc);
      }
      out[i * ldo + c] = bias ? acc + bias[c] : acc;
    }
}
#endif

template <bool Q4>
inline void int8_rows(int64_t rows, const int8_t* qa, const float* da, const float* sa, int64_t K,
                      const uint8_t* data, const half_t* scale, const half_t* mins, float* out, int64_t ldo,
                      const float* bias, const uint8_t* next) {
  switch (rows) {
    case 1: int8_tile<1, Q4>(qa, da, sa, K, data, scale, mins, out, ldo, bias, next); break;
    case 2: int8_tile<2, Q4>(qa, da, sa, K, data, scale, mins, out, ldo, bias, next); break;
    case 3: int8_tile<3, Q4>(qa, da, sa, K, data, scale, mins, out, ldo, bias, next); break;
    default: int8_tile<kGroupRows, Q4>(qa, da, sa, K, data, scale, mins, out, ldo, bias, next); break;
  }
}

}  // namespace

// x: [M, K] float32 (K a multiple of 32); data, scale, mins: the packed weight (mins empty for
// 8-bit blocks); N: the output size; bias: [N] or None. Returns y [M, N] float32.
at::Tensor linear_int8(at::Tensor x, at::Tensor data, at::Tensor scale, at::Tensor mins, int64_t N,
                       std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), P = data.size(0), nb = K / 32;
  const bool q4 = data.scalar_type() == at::kByte;
  TORCH_CHECK(K % 32 == 0 && data.dim() == 3 && data.size(1) == nb && data.size(2) == (q4 ? 128 : 256) &&
              (q4 || data.scalar_type() == at::kChar) && data.is_contiguous(), "packed weight mismatch");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == P * nb * kCols,
              "packed weight mismatch (float16 scales)");
  TORCH_CHECK(!q4 || (mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.numel() == scale.numel()),
              "packed weight mismatch (float16 mins)");
  TORCH_CHECK(P * kCols >= N, "N exceeds the packed weight");
  at::Tensor xc = x.contiguous(), y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor b;
  const float* bp = float_bias(bias, N, b);
  std::vector<int8_t> qa(M * K);
  std::vector<float> da(M * nb), sa(M * nb);
  quantize_rows(xc.data_ptr<float>(), M * nb, qa.data(), da.data(), sa.data());
  const uint8_t* dp = reinterpret_cast<const uint8_t*>(data.data_ptr());
  const half_t* sp = reinterpret_cast<const half_t*>(scale.data_ptr());
  const half_t* mp = q4 ? reinterpret_cast<const half_t*>(mins.data_ptr()) : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t bytes = nb * (q4 ? 128 : 256), per = nb * kCols;
  // rows in near-equal groups of at most kGroupRows (6 rows as 3 + 3)
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows, base = M / groups, extra = M % groups;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    float tile[kGroupRows * kCols];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kCols, cols = std::min<int64_t>(kCols, N - n0);
      const uint8_t* dpp = dp + p * bytes;
      const half_t *spp = sp + p * per, *mpp = q4 ? mp + p * per : nullptr;
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t rows = base + (g < extra ? 1 : 0);
        const int8_t* qg = qa.data() + m0 * K;
        const float *dg = da.data() + m0 * nb, *sg = sa.data() + m0 * nb;
        // a whole panel goes straight to y; the last, partial one through a tile
        float* out = cols == kCols ? yp + m0 * N + n0 : tile;
        const int64_t ldo = cols == kCols ? N : kCols;
        const float* bias = cols == kCols && bp ? bp + n0 : nullptr;
        const uint8_t* next = p + 1 < end ? dpp + bytes : nullptr;
        if (q4) {
          int8_rows<true>(rows, qg, dg, sg, K, dpp, spp, mpp, out, ldo, bias, next);
        } else {
          int8_rows<false>(rows, qg, dg, sg, K, dpp, spp, nullptr, out, ldo, bias, next);
        }
        if (cols < kCols) {
          for (int64_t i = 0; i < rows; ++i) {
            float* dst = yp + (m0 + i) * N + n0;
            for (int64_t c = 0; c < cols; ++c) dst[c] = bp ? tile[i * kCols + c] + bp[n0 + c] : tile[i * kCols + c];
          }
        }
        m0 += rows;
      }
    }
  });
  return y;
}
