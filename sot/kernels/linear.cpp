#include "common.h"

#include <c10/util/BFloat16.h>

#include <atomic>
#include <type_traits>

// Row-stable float32 linear layer: y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]).
//
// Weights are packed once into panels of 16 output columns, [P, K, 16] (pack with
// sot.kernels.linear.pack_panels). Every output is one fused multiply-add chain over
// k = 0 .. K-1 starting from zero, with the bias added last, whatever the row count, the
// row's place in the call or the register block it lands in; so a row's bits never depend
// on the other rows, and plain decoding (1 row) and tree verification (many rows) agree.
// Register blocks of up to 6 rows x 16 columns, or 2 rows x 32 columns for 1-2 row calls
// (more independent chains where the product is memory-bound).
namespace {

constexpr int64_t kPanel = 16;
constexpr int kMaxRows = 6;

#if defined(__AVX2__) && defined(__FMA__)
template <int MR, int NP>
__attribute__((always_inline)) inline void zero_tile(__m256 (&acc)[MR][NP][2]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
}

// acc [MR][NP][2] x 8 lanes -> out [MR][NP][16]
template <int MR, int NP>
__attribute__((always_inline)) inline void store_acc(const __m256 (&acc)[MR][NP][2], float* out) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      _mm256_storeu_ps(out + (i * NP + j) * kPanel, acc[i][j][0]);
      _mm256_storeu_ps(out + (i * NP + j) * kPanel + 8, acc[i][j][1]);
    }
}

// acc[i][j] += x[i, k] * w[j] for the MR rows and NP panels of a tile: one step of each
// output's FMA chain over k.
template <int MR, int NP>
__attribute__((always_inline)) inline void fma_step(__m256 (&acc)[MR][NP][2], const __m256 (&w)[NP][2],
                                                    const float* x, int64_t K, int64_t k) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m256 xi = _mm256_broadcast_ss(x + i * K + k);
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      acc[i][j][0] = _mm256_fmadd_ps(xi, w[j][0], acc[i][j][0]);
      acc[i][j][1] = _mm256_fmadd_ps(xi, w[j][1], acc[i][j][1]);
    }
  }
}

// 8 weights of a panel as float32 (exact): stored as float32, bfloat16 or float16.
__attribute__((always_inline)) inline __m256 load8w(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((always_inline)) inline __m256 load8w(const c10::BFloat16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
__attribute__((always_inline)) inline __m256 load8w(const c10::Half* w) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(w[i]);
  return _mm256_load_ps(f);
#endif
}

template <int MR, int NP, typename W>
inline void linear_tile(const float* x, int64_t K, const W* panel, float* out) {
  __m256 acc[MR][NP][2];
  zero_tile<MR, NP>(acc);
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    // With 3 or more rows the tile is compute-bound: fetch the next panel meanwhile.
    if (NP == 1) _mm_prefetch(reinterpret_cast<const char*>(panel + stride + k * kPanel), _MM_HINT_T0);
    __m256 w[NP][2];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      w[j][0] = load8w(panel + j * stride + k * kPanel);
      w[j][1] = load8w(panel + j * stride + k * kPanel + 8);
    }
    fma_step<MR, NP>(acc, w, x, K, k);
  }
  store_acc<MR, NP>(acc, out);
}
#else
template <int MR, int NP, typename W>
inline void linear_tile(const float* x, int64_t K, const W* panel, float* out) {
  float acc[MR][NP][kPanel] = {};
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NP; ++j)
        for (int64_t c = 0; c < kPanel; ++c)
          acc[i][j][c] = std::fma(x[i * K + k], static_cast<float>(panel[j * stride + k * kPanel + c]),
                                  acc[i][j][c]);
  std::memcpy(out, acc, sizeof(acc));
}
#endif

// A tile [MR][NP][16] of products for panels p.. written to y [MR, N] (plus the bias).
template <int MR, int NP>
inline void store_tile(const float* tile, int64_t p, int64_t N, const float* bias, float* y) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) {
      const int64_t n0 = (p + j) * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, N - n0);
      const float* a = tile + (i * NP + j) * kPanel;
      float* dst = y + i * N + n0;
      if (bias) {
        for (int64_t c = 0; c < cols; ++c) dst[c] = a[c] + bias[n0 + c];
      } else {
        for (int64_t c = 0; c < cols; ++c) dst[c] = a[c];
      }
    }
}

// MR rows (x [MR, K]) times NP consecutive panels (the first is panel p, at `panel`),
// written to y [MR, N].
template <int MR, int NP, typename W>
inline void linear_block(const float* x, int64_t K, const W* panel, int64_t p, int64_t N,
                         const float* bias, float* y) {
  float tile[MR * NP * kPanel];
  linear_tile<MR, NP, W>(x, K, panel, tile);
  store_tile<MR, NP>(tile, p, N, bias, y);
}

template <int NP, typename W>
inline void linear_rows(int64_t rows, const float* x, int64_t K, const W* packed, int64_t p, int64_t N,
                        const float* bias, float* y) {
  switch (rows) {
    case 1: linear_block<1, NP, W>(x, K, packed, p, N, bias, y); break;
    case 2: linear_block<2, NP, W>(x, K, packed, p, N, bias, y); break;
    case 3: linear_block<3, NP, W>(x, K, packed, p, N, bias, y); break;
    case 4: linear_block<4, NP, W>(x, K, packed, p, N, bias, y); break;
    case 5: linear_block<5, NP, W>(x, K, packed, p, N, bias, y); break;
    default: linear_block<kMaxRows, NP, W>(x, K, packed, p, N, bias, y); break;
  }
}

// The product over panels of weights stored as W (float32, or bfloat16 or float16 values,
// converted exactly): the same chains of multiply-adds on the same values whatever W is.
template <typename W>
void panel_rows(const float* xp, int64_t M, int64_t K, const W* pp, int64_t P, int64_t N, const float* bp,
                float* yp) {
  const int64_t np = M <= 2 ? 2 : 1;
  at::parallel_for(0, (P + np - 1) / np, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t * np;
      const W* panel = pp + p * K * kPanel;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        if (np == 2 && p + 1 < P) {
          linear_rows<2, W>(rows, xp + m0 * K, K, panel, p, N, bp, yp + m0 * N);
        } else {
          linear_rows<1, W>(rows, xp + m0 * K, K, panel, p, N, bp, yp + m0 * N);
        }
      }
    }
  });
}

}  // namespace

// The input made contiguous, the output [M, N] and the bias (float32, or null) of a product.
struct LinearIO {
  at::Tensor x, y, b;
  const float* xp;
  float* yp;
  const float* bp = nullptr;
  LinearIO(const at::Tensor& input, int64_t N, const std::optional<at::Tensor>& bias)
      : x(input.contiguous()), y(at::empty({input.size(0), N}, input.options())) {
    if (bias.has_value() && bias->defined()) {
      b = bias->to(at::kFloat).contiguous();
      TORCH_CHECK(b.numel() == N, "bias size mismatch");
      bp = b.data_ptr<float>();
    }
    xp = x.data_ptr<float>();
    yp = y.data_ptr<float>();
  }
};

// x: [M, K] float32; packed: [P, K, 16] with P * 16 >= N, float32, or bfloat16 or float16 where
// every weight is such a value (half the bytes; the same products, bit for bit); bias: [N] or
// None. Returns [M, N]. Two threads or more split the panels.
at::Tensor linear_f32(at::Tensor x, at::Tensor packed, int64_t N, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  const auto type = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
              (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) && packed.is_contiguous(),
              "packed weight mismatch (float32, bfloat16 or float16 panels [P, K, 16])");
  TORCH_CHECK(packed.size(0) * kPanel >= N, "N exceeds the packed weight");
  const int64_t P = packed.size(0);
  LinearIO io(x, N, bias);
  const int64_t M = io.x.size(0), K = io.x.size(1);
  if (type == at::kFloat) {
    panel_rows(io.xp, M, K, packed.data_ptr<float>(), P, N, io.bp, io.yp);
  } else if (type == at::kBFloat16) {
    panel_rows(io.xp, M, K, packed.data_ptr<c10::BFloat16>(), P, N, io.bp, io.yp);
  } else {
    panel_rows(io.xp, M, K, packed.data_ptr<c10::Half>(), P, N, io.bp, io.yp);
  }
  return io.y;
}

// Float32 weights stored exactly as 4-bit or 8-bit blocks of 32 inputs (the GGUF Q4_1 and
// Q8_0 layouts: w = d * q + m, resp. w = d * q, with d and m per block and column). The product
// is taken block by block, as the format factors it:
//   y[n] = sum over blocks b of  d[b, n] * s[b, n]  (+ m[b, n] * xs[b]  for Q4_1)
//   s[b, n] = sum over the block's 32 inputs k of x[k] * q[k, n]   (q an integer, exact in float32)
//   xs[b] = sum over the block's 32 inputs of x[k]
// with a fixed order of float32 operations for every output, whatever the row count: s is one
// FMA chain over k from zero, then acc = fma(d, s, acc) and acc = fma(m, xs, acc) block after
// block from zero, the bias added last; xs is a sum in input order, once per row. So a row's
// bits never depend on the other rows of the call. The weights are only converted to float
// (no scale applied per weight), which halves the vector work of a one-row product against
// decoding each weight to float32 first: about 1.3-1.4x faster on one Zen 3 core
// (docs/NOTEBOOK.md). Layouts per panel p and block kb (K / 32 blocks):
//   q4: data [P, K/32, 32, 8] uint8, byte j of input k = column j (low nibble) and column
//       j + 8 (high nibble); scale, min [P, K/32, 16] float16 (the format's own values, so
//       exact; half the bytes of float32 scales, which a one-row product streams with the
//       data: 1.05-1.11x faster on two Zen 3 cores);
//   q8: data [P, K/32, 32, 16] int8; scale [P, K/32, 16] float16; min empty.
// Scales and minimums may also be float32 (GGUF Q4_K's: products of a float16 and a 6-bit
// integer, exact in float32 only): the same operations on the same values; so may 8-bit
// blocks have minimums then (GGUF Q5_K: Q4_K's form with 5-bit q, held in 8 bits; Q2_K). And 8-bit blocks
// may have a scale per 16 inputs, float32 [P, K/16, 16] (GGUF Q6_K: a block of 32 is two
// halves of 16 with their own 8-bit scales under one float16 scale d, w = (d * scale) * q, q
// in -32..31; Q3_K, Q2_K likewise): s, the scale step and xs then run per 16 inputs.
namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SOT_BLOCKS_AVX2 1
#endif

// xs [M, K/BL]: each row's sum of the inputs of each block of BL (32 or 16), in input order
// from zero (the blocks' sums advance together, input by input, so that the adds are independent).
std::vector<float> block_sums(const float* x, int64_t M, int64_t K, int64_t BL) {
  const int64_t KB = K / BL;
  std::vector<float> xs(M * KB, 0.0f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* s = xs.data() + i * KB;
      const float* row = x + i * K;
      for (int64_t k = 0; k < BL; ++k)
        for (int64_t kb = 0; kb < KB; ++kb) s[kb] += row[kb * BL + k];
    }
  });
  return xs;
}

// Bytes of one input's 16 integers in a panel, for blocks of QB-bit integers (4 or 8).
constexpr int64_t input_bytes(int QB) { return QB == 4 ? 8 : 16; }

#if SOT_BLOCKS_AVX2
// The 16 integers of input k of one panel (``q``: its bytes; QB bits each) as floats: w[0]
// columns 0-7, w[1] columns 8-15.
template <int QB>
__attribute__((always_inline)) inline void unpack16(const uint8_t* q, __m256 (&w)[2]) {
  if (QB == 4) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}

// The end of block kb for MR rows and NP panels: acc (in memory, [MR][NP][16]) = fma(d, s,
// acc), then fma(m, xs, acc) for Q4_1. d, m: the block's scales of the first panel (the next
// panels `per` values on); xs: the rows' block sums ([MR, KB], this block's column; Q4_1 only).
template <int MR, int NP, bool MN, typename S>
__attribute__((always_inline)) inline void scale_step(const __m256 (&s)[MR][NP][2], const S* d, const S* m,
                                                      int64_t per, const float* xs, int64_t KB, float* acc) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m256 xsum = MN ? _mm256_broadcast_ss(xs + i * KB) : _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        float* a = acc + (i * NP + j) * kPanel + 8 * h;
        __m256 v = _mm256_fmadd_ps(load8s(d + j * per + 8 * h), s[i][j][h], _mm256_loadu_ps(a));
        if (MN) v = _mm256_fmadd_ps(load8s(m + j * per + 8 * h), xsum, v);
        _mm256_storeu_ps(a, v);
      }
  }
}

// MR rows over NP panels of blocks, the integers converted in registers right before their
// multiply-add. For the 1-6 row products of plain decoding and small trees.
//
// `next` (or null) is the tile that follows on this thread: block kb of its panels is fetched
// into L2 while block kb of these is multiplied. The hardware's own prefetch does not run that
// far ahead, and without it the core waits on memory, then computes, instead of both at once
// (on 2 cores of an AVX-512 EPYC, every product of the default model's pass against the same
// kernel without it: 1.3x faster at one row, 1.2x at two; docs/NOTEBOOK.md).
template <typename S>
struct NextTile {
  const uint8_t* data;
  const S* scale;
  const S* mins;
  int np;
};

template <int MR, int NP, int QB, typename S, int BL, bool MN>
inline void fused_block_tile(const float* x, const float* xs, int64_t K, const uint8_t* data, int64_t bytes,
                             const S* scale, const S* mins, int64_t per, float* out, const NextTile<S>& next) {
  constexpr int64_t kBytes = input_bytes(QB);  // per input of a panel
  std::fill(out, out + MR * NP * kPanel, 0.0f);
  for (int64_t kb = 0; kb < K / BL; ++kb) {
    if (MR <= 2 && next.data != nullptr) {  // (with more rows the products bound the time)
      for (int j = 0; j < next.np; ++j) {
        const char* block = reinterpret_cast<const char*>(next.data + j * bytes + kb * BL * kBytes);
        for (int64_t o = 0; o < BL * kBytes; o += 64) _mm_prefetch(block + o, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next.scale + j * per + kb * kPanel), _MM_HINT_T1);
        if (MN) _mm_prefetch(reinterpret_cast<const char*>(next.mins + j * per + kb * kPanel), _MM_HINT_T1);
      }
    }
    __m256 s[MR][NP][2];
    zero_tile<MR, NP>(s);
    for (int64_t k = kb * BL; k < kb * BL + BL; ++k) {
      __m256 w[NP][2];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) unpack16<QB>(data + j * bytes + k * kBytes, w[j]);
      fma_step<MR, NP>(s, w, x, K, k);
    }
    scale_step<MR, NP, MN, S>(s, scale + kb * kPanel, MN ? mins + kb * kPanel : nullptr, per, MN ? xs + kb : nullptr,
                           K / BL, out);
  }
}

// All M = MR rows over every panel: pairs of panels (32 columns, more independent FMA chains)
// for 1-2 rows, single panels for 3-6 rows (their sums fill the registers).
template <int MR, int QB, typename S, int BL, bool MN>
void fused_block_rows(const float* x, const float* xs, int64_t K, int64_t P, int64_t N, const uint8_t* data,
                      int64_t bytes, const S* scale, const S* mins, int64_t per, const float* bias,
                      float* y) {
  constexpr int64_t NP = MR <= 2 ? 2 : 1;
  at::parallel_for(0, (P + NP - 1) / NP, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float tile[MR * 2 * kPanel];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = NP * t;
      const uint8_t* dp = data + p * bytes;
      const S* sp = scale + p * per;
      const S* mp = MN ? mins + p * per : nullptr;
      NextTile<S> next{nullptr, nullptr, nullptr, 0};
      if (t + 1 < end) {
        const int64_t q = p + NP;
        next = {data + q * bytes, scale + q * per, MN ? mins + q * per : nullptr,
                static_cast<int>(std::min<int64_t>(NP, P - q))};
      }
      if (NP == 2 && p + 1 < P) {
        fused_block_tile<MR, 2, QB, S, BL, MN>(x, xs, K, dp, bytes, sp, mp, per, tile, next);
        store_tile<MR, 2>(tile, p, N, bias, y);
      } else {
        fused_block_tile<MR, 1, QB, S, BL, MN>(x, xs, K, dp, bytes, sp, mp, per, tile, next);
        store_tile<MR, 1>(tile, p, N, bias, y);
      }
    }
  });
}

// More than kMaxRows rows (or every row count, with fused = false): each panel's integers are
// converted once, 32 inputs at a time, into a float block that stays in L1, and the rows, in
// near-equal groups of at most kMaxRows (8 rows as 4 + 4), take their multiply-adds from it.
// The same operations in the same order as fused_block_tile, so the same bits.

// acc [MR][16] (in memory) gets block kb of MR rows: x [MR rows, this block's BL inputs] times
// q [BL][16] (floats, in L1), scaled by d (and m, xs) as scale_step does.
template <int MR, bool MN, typename S, int BL>
inline void chunk_tile(const float* x, int64_t K, const float* q, const S* d, const S* m, const float* xs,
                       int64_t KB, float* acc) {
  __m256 s[MR][1][2];
  zero_tile<MR, 1>(s);
  for (int64_t k = 0; k < BL; ++k) {
    const __m256 wv[1][2] = {{_mm256_loadu_ps(q + k * kPanel), _mm256_loadu_ps(q + k * kPanel + 8)}};
    fma_step<MR, 1>(s, wv, x, K, k);
  }
  scale_step<MR, 1, MN, S>(s, d, m, 0, xs, KB, acc);
}

template <int QB, typename S, int BL, bool MN>
void chunked_block_rows(const float* x, const float* xs, int64_t M, int64_t K, int64_t P, int64_t N,
                        const uint8_t* data, int64_t bytes, const S* scale, const S* mins, int64_t per,
                        const float* bias, float* y) {
  const int64_t groups = (M + kMaxRows - 1) / kMaxRows, base = M / groups, extra = M % groups, KB = K / BL;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kPanel);
    alignas(32) float q[BL * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* dp = data + p * bytes;
      const S* sp = scale + p * per;
      const S* mp = MN ? mins + p * per : nullptr;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t kb = 0; kb < K / BL; ++kb) {
        for (int64_t k = 0; k < BL; ++k) {  // this block of BL inputs
          __m256 w[2];
          unpack16<QB>(dp + (kb * BL + k) * input_bytes(QB), w);
          _mm256_storeu_ps(q + k * kPanel, w[0]);
          _mm256_storeu_ps(q + k * kPanel + 8, w[1]);
        }
        const S* d = sp + kb * kPanel;
        const S* m = MN ? mp + kb * kPanel : nullptr;
        for (int64_t g = 0, m0 = 0; g < groups; ++g) {
          const int64_t rows = base + (g < extra ? 1 : 0);
          const float* xg = x + m0 * K + kb * BL;
          const float* sg = MN ? xs + m0 * KB + kb : nullptr;
          float* ag = acc.data() + m0 * kPanel;
          switch (rows) {
            case 1: chunk_tile<1, MN, S, BL>(xg, K, q, d, m, sg, KB, ag); break;
            case 2: chunk_tile<2, MN, S, BL>(xg, K, q, d, m, sg, KB, ag); break;
            case 3: chunk_tile<3, MN, S, BL>(xg, K, q, d, m, sg, KB, ag); break;
            case 4: chunk_tile<4, MN, S, BL>(xg, K, q, d, m, sg, KB, ag); break;
            case 5: chunk_tile<5, MN, S, BL>(xg, K, q, d, m, sg, KB, ag); break;
            default: chunk_tile<kMaxRows, MN, S, BL>(xg, K, q, d, m, sg, KB, ag); break;
          }
          m0 += rows;
        }
      }
      for (int64_t i = 0; i < M; ++i) store_tile<1, 1>(acc.data() + i * kPanel, p, N, bias, y + i * N);
    }
  });
}

#else
// Without AVX2: the same operations one output at a time (std::fma rounds as the vector FMA).
template <int QB, typename S, int BL, bool MN>
void scalar_block_rows(const float* x, const float* xs, int64_t M, int64_t K, int64_t P, int64_t N,
                       const uint8_t* data, int64_t bytes, const S* scale, const S* mins, int64_t per,
                       const float* bias, float* y) {
  const int64_t KB = K / BL;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < M; ++i) {
        float tile[kPanel];
        for (int64_t c = 0; c < kPanel; ++c) {
          float acc = 0.0f;
          for (int64_t kb = 0; kb < K / BL; ++kb) {
            float s = 0.0f;
            for (int64_t k = kb * BL; k < kb * BL + BL; ++k) {
              float q;
              if (QB == 4) {
                const uint8_t byte = data[p * bytes + k * 8 + c % 8];
                q = static_cast<float>(c < 8 ? byte & 15 : byte >> 4);
              } else {
                q = static_cast<float>(reinterpret_cast<const int8_t*>(data)[p * bytes + k * 16 + c]);
              }
              s = std::fma(x[i * K + k], q, s);
            }
            acc = std::fma(scale_value(scale[p * per + kb * kPanel + c]), s, acc);
            if (MN) acc = std::fma(scale_value(mins[p * per + kb * kPanel + c]), xs[i * KB + kb], acc);
          }
          tile[c] = acc;
        }
        store_tile<1, 1>(tile, p, N, bias, y + i * N);
      }
  });
}
#endif

}  // namespace

namespace {

// One block product's operands (see linear_blocks_f32), apart from its scales.
struct BlockArgs {
  const float* x;
  const float* xs;
  int64_t M, K, P, N;
  const uint8_t* data;
  int64_t bytes, per;
  const float* bias;
  float* y;
  bool fused;
};

// The product over QB-bit integers with scales (and minimums, MN) of type S: float16 bits, or
// float32; one scale per block of BL inputs (32, or 16: Q6_K's half-blocks).
template <int QB, typename S, int BL, bool MN>
void block_rows(const BlockArgs& a, const S* sp, const S* mp) {
#if SOT_BLOCKS_AVX2
  if (a.fused && a.M <= kMaxRows) {
#define SOT_FUSED(R) \
  fused_block_rows<R, QB, S, BL, MN>(a.x, a.xs, a.K, a.P, a.N, a.data, a.bytes, sp, mp, a.per, a.bias, a.y)
    switch (a.M) {
      case 1: SOT_FUSED(1); break;
      case 2: SOT_FUSED(2); break;
      case 3: SOT_FUSED(3); break;
      case 4: SOT_FUSED(4); break;
      case 5: SOT_FUSED(5); break;
      default: SOT_FUSED(6); break;
    }
#undef SOT_FUSED
  } else {
    chunked_block_rows<QB, S, BL, MN>(a.x, a.xs, a.M, a.K, a.P, a.N, a.data, a.bytes, sp, mp, a.per, a.bias, a.y);
  }
#else
  scalar_block_rows<QB, S, BL, MN>(a.x, a.xs, a.M, a.K, a.P, a.N, a.data, a.bytes, sp, mp, a.per, a.bias, a.y);
#endif
}

// Q4_1 and Q4_K: 4 bits with minimums; Q8_0 (Q5_0, Q4_0): 8 bits; and with float32 scales
// only: 8 bits with a scale per 16 inputs (Q6_K, Q3_K) and minimums too (Q2_K), or with
// minimums per 32 (Q5_K).
template <typename S>
void block_rows(const BlockArgs& a, int qb, bool halves, bool mins, const S* sp, const S* mp) {
  if (qb == 4) {
    block_rows<4, S, 32, true>(a, sp, mp);
  } else if (!halves && !mins) {
    block_rows<8, S, 32, false>(a, sp, mp);
  } else if constexpr (std::is_same_v<S, float>) {
    if (halves && mins) block_rows<8, S, 16, true>(a, sp, mp);
    else if (halves) block_rows<8, S, 16, false>(a, sp, mp);
    else block_rows<8, S, 32, true>(a, sp, mp);
  }
}

}  // namespace

// fused = false takes every product through the L1 float block of the wide path (for comparison).
at::Tensor linear_blocks_f32(at::Tensor x, at::Tensor data, at::Tensor scale, at::Tensor mins,
                             int64_t N, std::optional<at::Tensor> bias, bool fused) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  const int64_t K = x.size(1), P = data.size(0);
  const bool q4 = data.scalar_type() == at::kByte;
  const int qb = q4 ? 4 : 8;
  TORCH_CHECK(data.dim() == 4 && K % 32 == 0 && data.size(1) == K / 32 && data.size(2) == 32 &&
              data.size(3) == (q4 ? 8 : 16) && (q4 || data.scalar_type() == at::kChar) &&
              data.is_contiguous(), "packed weight mismatch (uint8 4-bit or int8 8-bit blocks)");
  const bool wide = scale.scalar_type() == at::kFloat;  // (float32 scales: the K-quants')
  // one scale per 16 inputs (Q6_K's half-blocks: 8-bit integers, float32 scales) or per 32
  const bool halves = wide && qb == 8 && scale.numel() == P * (K / 16) * kPanel;
  TORCH_CHECK((wide || scale.scalar_type() == at::kHalf) && scale.is_contiguous() &&
              (halves || scale.numel() == P * (K / 32) * kPanel),
              "packed weight mismatch (float16 or float32 scales, one per block of 32 inputs, or float32 ones "
              "per 16 inputs of 8-bit integers)");
  // minimums: always with 4 bits; with 8 bits, float32 ones only (Q5_K's, Q2_K's)
  const bool mins_given = mins.numel() > 0;
  TORCH_CHECK(mins_given == q4 || (wide && mins_given), "packed weight mismatch (minimums with 4-bit blocks, or "
              "with 8-bit blocks of float32 scales)");
  TORCH_CHECK(!mins_given || (mins.scalar_type() == scale.scalar_type() && mins.is_contiguous() &&
                              mins.numel() == scale.numel()), "packed weight mismatch (mins of the scales' dtype)");
  TORCH_CHECK(P * kPanel >= N, "N exceeds the packed weight");
  const int64_t bytes = K * input_bytes(qb), per = (K / (halves ? 16 : 32)) * kPanel;
  LinearIO io(x, N, bias);
  const int64_t M = io.x.size(0);
  if (M == 0) return io.y;
  const std::vector<float> sums =  // (without minimums: none)
      mins_given ? block_sums(io.xp, M, K, halves ? 16 : 32) : std::vector<float>();
  const BlockArgs args{io.xp, mins_given ? sums.data() : nullptr, M, K, P, N,
                       reinterpret_cast<const uint8_t*>(data.data_ptr()), bytes, per, io.bp, io.yp, fused};
  if (wide) {
    block_rows<float>(args, qb, halves, mins_given, scale.data_ptr<float>(),
                      mins_given ? mins.data_ptr<float>() : nullptr);
  } else {
    block_rows<half_t>(args, qb, false, false, reinterpret_cast<const half_t*>(scale.data_ptr()),
                       mins_given ? reinterpret_cast<const half_t*>(mins.data_ptr()) : nullptr);
  }
  return io.y;
}

// ---------------------------------------------------------------------------- finding the blocks
// block_grid_f32: float32 weights as exact GGUF blocks of 32 (Q4_1: w = d * q + m, q in 0..15;
// Q8_0, Q5_0, Q4_0: w = d * q, q in -128..127; d and m float16 values), the arithmetic of
// sot.kernels.linear._block_grid_torch in one pass per block instead of a dozen passes over
// the whole weight: the same candidate scales in the same order (float16 at and next to the
// spread, nearest first), the same float32 operations one at a time (no contraction), and a
// block's weights decoded bit for bit or the candidate refused.
namespace {

constexpr int kBlock = 32;
constexpr int kCandidateOffsets[5] = {0, -1, 1, -2, 2};
// The largest |q| of a signed block, by format, tried in this order: Q8_0 (127), Q5_0 (q in
// -16..15: 16, or 15 where no weight takes -16), Q4_0 (q in -8..7: 8 or 7). Each is exact in the
// 8-bit blocks, Q5_0 and Q4_0 at 8 bits a weight instead of 5 or 4.
constexpr float kSignedLevels[5] = {127.0f, 16.0f, 15.0f, 8.0f, 7.0f};

inline float half_bits_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// One block: the first candidate scale that decodes all 32 weights exactly, into q and d.
template <bool kMin>
inline bool solve_block(const float* w, float low, float approx, float qlo, float qhi, int16_t* q, float* d_out) {
  const uint16_t bits = c10::Half(approx).x;
  for (int off : kCandidateOffsets) {
    const float d = half_bits_value(static_cast<uint16_t>(bits + off));
    const float safe = d == 0.0f ? 1.0f : d;
    float cand[kBlock];
    int32_t differ = 0;
    for (int i = 0; i < kBlock; ++i) {  // no early exit, so that the loop vectorizes
      const float base = kMin ? w[i] - low : w[i];
      const float c = std::min(std::max(std::nearbyint(base / safe), qlo), qhi);  // ties to even
      const float scaled = d * c;
      const float rebuilt = kMin ? scaled + low : scaled;
      uint32_t x, y;
      std::memcpy(&x, &rebuilt, 4);
      std::memcpy(&y, w + i, 4);
      differ |= static_cast<int32_t>(x ^ y);
      cand[i] = c;
    }
    if (differ == 0) {
      for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int16_t>(cand[i]);
      *d_out = d;
      return true;
    }
  }
  return false;
}

// Whether ok(b) holds for every block b < n (blocks in parallel; all stop at the first failure).
template <typename F>
inline bool every_block(int64_t n, const F& ok) {
  std::atomic<bool> all{true};
  at::parallel_for(0, n, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1 && all.load(std::memory_order_relaxed); ++b)
      if (!ok(b)) all = false;
  });
  return all;
}

}  // namespace

// blocks [N', K/32, 32] float32 -> {q [N', K/32, 32] int16, d [N', K/32], m [N', K/32]} (Q4_1),
// {q, d} (Q8_0), or {} when some block is neither.
std::vector<at::Tensor> block_grid_f32(at::Tensor blocks) {
  TORCH_CHECK(blocks.scalar_type() == at::kFloat && blocks.dim() == 3 && blocks.size(2) == kBlock,
              "block_grid_f32 takes float32 blocks [N, K/32, 32]");
  blocks = blocks.contiguous();
  const int64_t n = blocks.size(0) * blocks.size(1);
  const float* w = blocks.data_ptr<float>();
  at::Tensor q = at::empty({blocks.size(0), blocks.size(1), kBlock}, blocks.options().dtype(at::kShort));
  at::Tensor d = at::empty({blocks.size(0), blocks.size(1)}, blocks.options());
  at::Tensor m = at::empty({blocks.size(0), blocks.size(1)}, blocks.options());
  int16_t* qp = q.data_ptr<int16_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  // Q4_1 only where every block's minimum is a float16 value
  const bool q4 = every_block(n, [&](int64_t b) {
    const float* x = w + b * kBlock;
    float low = x[0];
    for (int i = 1; i < kBlock; ++i) low = std::min(low, x[i]);
    mp[b] = low;
    return static_cast<float>(c10::Half(low)) == low;
  });
  if (q4 && every_block(n, [&](int64_t b) {
        const float* x = w + b * kBlock;
        float high = x[0];
        for (int i = 1; i < kBlock; ++i) high = std::max(high, x[i]);
        return solve_block<true>(x, mp[b], (high - mp[b]) / 15.0f, 0.0f, 15.0f, qp + b * kBlock, dp + b);
      }))
    return {q, d, m};
  if (every_block(n, [&](int64_t b) {
        const float* x = w + b * kBlock;
        float top = std::fabs(x[0]);
        for (int i = 1; i < kBlock; ++i) top = std::max(top, std::fabs(x[i]));
        for (float levels : kSignedLevels)
          if (solve_block<false>(x, 0.0f, top / levels, -128.0f, 127.0f, qp + b * kBlock, dp + b)) return true;
        return false;
      }))
    return {q, d};
  return {};
}
