#include "common.h"

#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstdlib>
#include <type_traits>
// The AMX chain needs a compiler that knows the tile instructions (GCC 11, Clang 12); with an
// older one the kernels build without it and AMX CPUs take AVX512-BF16's chain.
#if defined(__AVX512F__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                             (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SOT_AMX_BUILD 1
#else
#define SOT_AMX_BUILD 0
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Row-stable bfloat16 products over 4-bit or 8-bit blocks (GGUF Q4_1 / Q8_0), with the
// AVX512-BF16 pair dot product (VDPBF16PS): y[m, n] = bf16(sum_k x[m, k] * bf16(w[n, k]) + bias[n]).
//
// The weights are those of the bfloat16 mode: each block weight decoded exactly in float32
// (w = d * q + m, as the float32 kernels decode it) and rounded to bfloat16 (nearest even), as
// casting the float32 model to bfloat16 rounds it. Each output is one chain of VDPBF16PS steps
// over the input pairs (k, k + 1), k = 0, 2, ..., K - 2, in order, from zero; the bias is added
// to the float32 sum, then rounded to bfloat16. That chain is the same whatever the row count,
// the row's place in the call or the register tile it lands in, so a row's bits never depend
// on the other rows, and plain decoding (1 row) and tree verification (many rows) agree.
//
// Against the float32 block kernel (linear.cpp), one instruction multiplies 32 pairs instead
// of 16 products: the same bytes for a one-row pass, half the arithmetic for wide ones.
//
// Decoding a pair costs about eight vector instructions against the one that multiplies it,
// so a one-row product is bound by the decoding, not by memory, and wide ones spend a third of
// their instructions on it. Wide calls (kPairsFromRows rows or more) therefore read the pair
// vectors decoded once, ahead of time, where the caller keeps them (decode_blocks_bf16: 2
// bytes a weight): each output is the same chain, so the bits are the same whichever path a
// call takes.
//
// Layout per panel p (16 output columns) and block kb (32 inputs, 16 pairs t):
//   q4: data [P, K/32, 16, 16] uint8: byte j of pair t holds, in its low nibble, q[column j/2]
//       [input 2t + j%2] and, in its high nibble, q[column 8 + j/2][input 2t + j%2];
//   q8: data [P, K/32, 16, 32] int8: bytes 0-15 as the low nibbles above, 16-31 as the high;
//   scale, mins: [P, K/32, 16] float16 (GGUF keeps them so: exact; mins empty for q8).
// (sot.kernels.linear.pack_blocks_bf16 writes it.)
namespace {

constexpr int64_t kCols = 16;
constexpr int kTileRows = 8;
// from this many rows on, a product reads the decoded pairs where it has them (linear_blocks_bf16)
constexpr int64_t kPairsFromRows = 6;

// f(std::integral_constant<int, R>{}) for R = rows, 1..kTileRows (more rows: kTileRows): the
// row count as a template argument, for the kernels whose accumulators sit in registers
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, kTileRows>{}); break;
  }
}

#if defined(__AVX512F__)
#define SOT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// The 32 bfloat16 weights of pair t of a panel: dword lane c < 8 holds column c's weights for
// inputs (2t, 2t + 1), lane 8 + c column 8 + c's. d_lo, m_lo: column c's scale and min in
// lanes 2c and 2c + 1 (columns 0-7); d_hi, m_hi: the same for columns 8-15.
template <bool Q4>
SOT_BF16 __attribute__((always_inline)) inline __m512bh decode_pair(const uint8_t* q, __m512 d_lo, __m512 m_lo,
                                                                    __m512 d_hi, __m512 m_hi) {
  __m512 lo, hi;
  if (Q4) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_fmadd_ps(d_lo, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), m_lo);
    hi = _mm512_fmadd_ps(d_hi, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), m_hi);
  } else {
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    lo = _mm512_mul_ps(d_lo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)));
    hi = _mm512_mul_ps(d_hi, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)));
  }
  return _mm512_cvtne2ps_pbh(hi, lo);  // (low half from lo: columns 0-7, high half columns 8-15)
}

// A block's 16 scales (or mins) spread to the pair lanes: {lo, hi} as decode_pair takes them.
SOT_BF16 __attribute__((always_inline)) inline void spread(const half_t* v, __m512& lo, __m512& hi) {
  const __m512 all = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  lo = _mm512_permutexvar_ps(first, all);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(first, _mm512_set1_epi32(8)), all);
}

// The pair (x[k], x[k + 1]) of a bfloat16 row, in every dword lane.
SOT_BF16 __attribute__((always_inline)) inline __m512bh pair_of(const c10::BFloat16* x, int64_t k) {
  int32_t bits;
  std::memcpy(&bits, x + k, 4);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

struct Blocks {
  const uint8_t* data;
  const half_t* scale;
  const half_t* mins;  // null for q8
  int64_t K, P, N;
  int64_t bytes() const { return (K / 32) * 16 * (mins ? 16 : 32); }  // per panel
  int64_t per() const { return (K / 32) * kCols; }                   // scales per panel
  const uint8_t* pair_bytes(int64_t p, int64_t kb, int64_t t) const {
    return data + p * bytes() + (kb * 16 + t) * (mins ? 16 : 32);
  }
};

// MR rows x NP panels, the accumulators in registers over all of K, each pair decoded right
// before its multiplies. For calls of at most kTileRows rows (plain decoding, small trees).
// Block kb of the next tile's panels (`next`, `next_np` of them; none when next_np is 0) is
// fetched into L2 while block kb of these is multiplied, as the float32 block kernel does it
// (linear.cpp): otherwise the core waits on memory, then computes.
template <int MR, int NP, bool Q4>
SOT_BF16 void tile_rows(const c10::BFloat16* x, const Blocks& w, int64_t p, int64_t next, int next_np, float* out) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t K = w.K;
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    __m512 d_lo[NP], d_hi[NP], m_lo[NP], m_hi[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      spread(w.scale + (p + j) * w.per() + kb * kCols, d_lo[j], d_hi[j]);
      if (Q4) spread(w.mins + (p + j) * w.per() + kb * kCols, m_lo[j], m_hi[j]);
      else m_lo[j] = m_hi[j] = _mm512_setzero_ps();
    }
    for (int j = 0; j < next_np; ++j) {
      const char* block = reinterpret_cast<const char*>(w.pair_bytes(next + j, kb, 0));
      for (int64_t o = 0; o < 16 * (Q4 ? 16 : 32); o += 64) _mm_prefetch(block + o, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w.scale + (next + j) * w.per() + kb * kCols), _MM_HINT_T1);
      if (Q4) _mm_prefetch(reinterpret_cast<const char*>(w.mins + (next + j) * w.per() + kb * kCols), _MM_HINT_T1);
    }
    for (int64_t t = 0; t < 16; ++t) {
      __m512bh wv[NP];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j)
        wv[j] = decode_pair<Q4>(w.pair_bytes(p + j, kb, t), d_lo[j], m_lo[j], d_hi[j], m_hi[j]);
      const int64_t k = kb * 32 + 2 * t;
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512bh xi = pair_of(x + i * K, k);
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xi, wv[j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(out + (i * NP + j) * kCols, acc[i][j]);
}

// More rows: each block of a panel is decoded once into 16 pair vectors kept in L1, and the
// rows, in near-equal groups of at most kTileRows, take their steps from them; a group's
// accumulators go to memory between blocks (float32 stores: exact), so each output is still
// the same chain as tile_rows gives it.
template <int MR>
SOT_BF16 void chunk_rows(const c10::BFloat16* x, int64_t K, int64_t kb, const __m512bh* pairs, float* acc) {
  __m512 a[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) a[i] = _mm512_loadu_ps(acc + i * kCols);
  for (int64_t t = 0; t < 16; ++t) {
    const int64_t k = kb * 32 + 2 * t;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) a[i] = _mm512_dpbf16_ps(a[i], pair_of(x + i * K, k), pairs[t]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc + i * kCols, a[i]);
}

template <bool Q4>
SOT_BF16 void decode_block(const Blocks& w, int64_t p, int64_t kb, __m512bh* pairs) {
  __m512 d_lo, d_hi, m_lo = _mm512_setzero_ps(), m_hi = _mm512_setzero_ps();
  spread(w.scale + p * w.per() + kb * kCols, d_lo, d_hi);
  if (Q4) spread(w.mins + p * w.per() + kb * kCols, m_lo, m_hi);
  for (int64_t t = 0; t < 16; ++t) pairs[t] = decode_pair<Q4>(w.pair_bytes(p, kb, t), d_lo, m_lo, d_hi, m_hi);
}

// The same chains over pair vectors decoded once, ahead of the call (decode_blocks_bf16:
// [P, K/32, 16, 32] bfloat16, panel p's pairs at `pairs + p * K / 2`): MR rows x NP panels,
// the accumulators in registers over all of K. Each output is the chain tile_rows and
// chunk_rows give it (the pair vectors hold the bits decode_pair makes), so a pass reading
// these and one reading the blocks agree bit for bit.
template <int MR, int NP>
SOT_BF16 void tile_pairs(const c10::BFloat16* x, int64_t K, const __m512bh* pairs, const __m512bh* next, int next_np,
                         float* out) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t stride = K / 2;  // pair vectors a panel
  for (int64_t s = 0; s < K / 2; ++s) {
    __m512bh wv[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) wv[j] = pairs[j * stride + s];
    for (int j = 0; j < next_np; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * stride + s), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh xi = pair_of(x + i * K, 2 * s);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xi, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(out + (i * NP + j) * kCols, acc[i][j]);
}
#endif

// A tile [MR][NP][16] of float32 sums for panels p.. written to y [MR, N]: plus the bias,
// rounded to bfloat16 (nearest even).
[[maybe_unused]] inline void store_bf16(const float* tile, int mr, int np, int64_t p, int64_t N, const float* bias,
                                        c10::BFloat16* y) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < np; ++j) {
      const int64_t n0 = (p + j) * kCols;
      const int64_t cols = std::min<int64_t>(kCols, N - n0);
      const float* a = tile + (i * np + j) * kCols;
      c10::BFloat16* dst = y + i * N + n0;
      for (int64_t c = 0; c < cols; ++c) dst[c] = c10::BFloat16(bias ? a[c] + bias[n0 + c] : a[c]);
    }
}

#if SOT_AMX_BUILD
// ---- AMX ----------------------------------------------------------------------------------
// Where the CPU has AMX tiles, every product takes a second chain instead: each output is the
// chain of TDPBF16PS steps over the blocks kb = 0, 1, ..., K/32 - 1, in order, from zero (one
// step multiplies a tile of up to 16 rows of x's 32 inputs of block kb by the block's 16 pairs
// of 16 columns). The tile instruction rounds its pair sums its own way, so these bits differ
// from the VDPBF16PS chain's; but a row's chain is the same whatever the row count or the
// row's place in the tile, so a process whose products all take this chain keeps plain
// decoding (1 row) and tree verification (many rows) bit-identical. The pair vectors
// decode_pair makes are, as they are, the rows of the tile the weights go in: pair t, 16
// columns x (input 2t, input 2t + 1).
//
// The weights are decoded from the blocks right before their step, at every row count: with
// the multiplies nearly free, a pass of 16 rows costs about 1.2x one row, and reading pairs
// decoded ahead (2 bytes a weight instead of about 0.6) was slower at every row count.
//
// Tiles: 0-3 the float32 sums (panel j, row group g: tile j * G + g), 4 a group of 16 rows of
// x, 5 the last group's rows (up to 16), 6 and 7 the two panels' pairs. A tile the
// configuration leaves empty must not be touched: that faults.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// rows of x one sweep over the panels takes: four groups of 16
constexpr int64_t kAmxRows = 64;

#define SOT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// G groups of rows (the last `last` rows), NP panels
TileConfig amx_config(int G, int NP, int last) {
  TileConfig c;
  for (int t = 0; t < G * NP; ++t) {
    c.rows[t] = static_cast<uint8_t>(t % G == G - 1 ? last : 16);
    c.colsb[t] = 64;
  }
  c.rows[4] = 16, c.colsb[4] = 64;
  c.rows[5] = static_cast<uint8_t>(last), c.colsb[5] = 64;
  c.rows[6] = c.rows[7] = 16, c.colsb[6] = c.colsb[7] = 64;
  return c;
}

// Steps of block kb for every row group against tile 6 (panel 0) and, with NP = 2, tile 7
// (panel 1). Tile numbers are part of the instruction, hence one line per case.
#define SOT_AMX_A(g, tile) _tile_loadd(tile, x + (g * 16) * K + kb * 32, 2 * K)

template <int G, int NP>
SOT_AMX __attribute__((always_inline)) inline void amx_steps(const c10::BFloat16* x, int64_t K, int64_t kb) {
  static_assert(G * NP <= 4 && G >= 1 && NP >= 1 && NP <= 2, "four sum tiles");
  if constexpr (G == 1) {
    SOT_AMX_A(0, 5);
    _tile_dpbf16ps(0, 5, 6);
    if constexpr (NP == 2) _tile_dpbf16ps(1, 5, 7);
  } else if constexpr (G == 2) {
    SOT_AMX_A(0, 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) _tile_dpbf16ps(2, 4, 7);
    SOT_AMX_A(1, 5);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
  } else {
    SOT_AMX_A(0, 4);
    _tile_dpbf16ps(0, 4, 6);
    SOT_AMX_A(1, 4);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (G == 3) {
      SOT_AMX_A(2, 5);
      _tile_dpbf16ps(2, 5, 6);
    } else {
      SOT_AMX_A(2, 4);
      _tile_dpbf16ps(2, 4, 6);
      SOT_AMX_A(3, 5);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
}
#undef SOT_AMX_A

// Panels [begin, end) for G groups of rows of x (16 each, the last `last`), NP panels a
// tile; each block decoded into tile 6 (7) right before its steps, the next tile's block
// fetched into L2 meanwhile.
template <int G, int NP, bool Q4>
SOT_AMX void amx_panels(const c10::BFloat16* x, int last, const Blocks& w, int64_t begin, int64_t end,
                        const float* bias, c10::BFloat16* y, int64_t N) {
  const TileConfig cfg = amx_config(G, NP, last);
  _tile_loadconfig(&cfg);
  const int64_t K = w.K, rows = (G - 1) * 16 + last;
  alignas(64) __m512bh decoded[NP][16];
  alignas(64) float sums[4 * 256];
  for (int64_t p = begin; p < end; p += NP) {
    const int np = static_cast<int>(std::min<int64_t>(NP, end - p));
    _tile_zero(0);
    if constexpr (G * NP > 1) _tile_zero(1);
    if constexpr (G * NP > 2) _tile_zero(2);
    if constexpr (G * NP > 3) _tile_zero(3);
    const int64_t next = p + NP;
    const int next_np = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(NP, end - next)));
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      for (int j = 0; j < next_np; ++j) {
        const char* block = reinterpret_cast<const char*>(w.pair_bytes(next + j, kb, 0));
        for (int64_t o = 0; o < 16 * (Q4 ? 16 : 32); o += 64) _mm_prefetch(block + o, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w.scale + (next + j) * w.per() + kb * kCols), _MM_HINT_T1);
        if (Q4) _mm_prefetch(reinterpret_cast<const char*>(w.mins + (next + j) * w.per() + kb * kCols), _MM_HINT_T1);
      }
      decode_block<Q4>(w, p, kb, decoded[0]);
      _tile_loadd(6, decoded[0], 64);
      if constexpr (NP == 2) {
        // (a lone last panel steps over zeros in the second: its sums are never stored)
        if (np == 2) decode_block<Q4>(w, p + 1, kb, decoded[1]);
        else std::memset(decoded[1], 0, sizeof(decoded[1]));
        _tile_loadd(7, decoded[1], 64);
      }
      amx_steps<G, NP>(x, K, kb);
    }
    _tile_stored(0, sums, 64);
    if constexpr (G * NP > 1) _tile_stored(1, sums + 256, 64);
    if constexpr (G * NP > 2) _tile_stored(2, sums + 512, 64);
    if constexpr (G * NP > 3) _tile_stored(3, sums + 768, 64);
    for (int j = 0; j < np; ++j)
      for (int64_t i = 0; i < rows; ++i) store_bf16(sums + (j * G + i / 16) * 256 + (i % 16) * kCols, 1, 1, p + j, N,
                                                   bias, y + i * N);
  }
  _tile_release();
}

// A product of rows <= kAmxRows rows of x over every panel, each thread taking a share of the panels.
template <bool Q4>
SOT_AMX void amx_product(const c10::BFloat16* x, int64_t rows, const Blocks& w, const float* bias, c10::BFloat16* y,
                         int64_t N) {
  const int G = static_cast<int>((rows + 15) / 16), last = static_cast<int>(rows - 16 * (G - 1));
  const int NP = G <= 2 ? 2 : 1;
  // (a thread's share starts on an even panel, so two-panel tiles pair the same panels)
  at::parallel_for(0, (w.P + NP - 1) / NP, 1, [&](int64_t b, int64_t e) {
    const int64_t begin = b * NP, end = std::min(w.P, e * NP);
    switch (G * 2 + (NP - 1)) {
      case 3: amx_panels<1, 2, Q4>(x, last, w, begin, end, bias, y, N); break;
      case 5: amx_panels<2, 2, Q4>(x, last, w, begin, end, bias, y, N); break;
      case 6: amx_panels<3, 1, Q4>(x, last, w, begin, end, bias, y, N); break;
      default: amx_panels<4, 1, Q4>(x, last, w, begin, end, bias, y, N); break;
    }
  });
}
#endif

}  // namespace

bool bf16_blocks_supported() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

int64_t bf16_pairs_from_rows() { return kPairsFromRows; }

bool amx_supported() {
  static const bool ok = [] {
#if SOT_AMX_BUILD && defined(__linux__) && defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!bf16_blocks_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    // Linux hands out the tile state on request (ARCH_REQ_XCOMP_PERM for XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

namespace {
// -1: not decided yet (AMX where the CPU has it, unless SOT_NO_AMX is set); 0 or 1 after
std::atomic<int> g_amx{-1};
}  // namespace

bool amx_products() {
  int on = g_amx.load(std::memory_order_relaxed);
  if (on < 0) {
    on = amx_supported() && !std::getenv("SOT_NO_AMX") ? 1 : 0;
    g_amx.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

bool set_amx_products(bool on) {
  g_amx.store(on && amx_supported() ? 1 : 0, std::memory_order_relaxed);
  return amx_products();
}

// The blocks' weights decoded once: [P, K/32, 16, 32] bfloat16, pair t of block kb of panel p
// as decode_pair makes it (a product reading these takes 4x the bytes of 4-bit blocks and
// none of the decoding: the faster read from kPairsFromRows rows on).
at::Tensor decode_blocks_bf16(at::Tensor data, at::Tensor scale, at::Tensor mins) {
  TORCH_CHECK(bf16_blocks_supported(), "decode_blocks_bf16 needs a CPU with AVX512-BF16");
  const bool q4 = data.scalar_type() == at::kByte;
  TORCH_CHECK(data.dim() == 4 && data.size(2) == 16 && data.size(3) == (q4 ? 16 : 32) && data.is_contiguous() &&
              (q4 || data.scalar_type() == at::kChar), "packed weight mismatch");
  const int64_t P = data.size(0), K = data.size(1) * 32;
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == P * (K / 32) * kCols,
              "packed weight mismatch");
  TORCH_CHECK(!q4 || (mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.numel() == scale.numel()),
              "packed weight mismatch");
  at::Tensor out = at::empty({P, K / 32, 16, 32}, data.options().dtype(at::kBFloat16));
#if defined(__AVX512F__)
  const Blocks w{reinterpret_cast<const uint8_t*>(data.data_ptr()),
                 reinterpret_cast<const half_t*>(scale.data_ptr()),
                 q4 ? reinterpret_cast<const half_t*>(mins.data_ptr()) : nullptr, K, P, P * kCols};
  __m512bh* dst = reinterpret_cast<__m512bh*>(out.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    __m512bh pairs[16];
    for (int64_t p = begin; p < end; ++p)
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        q4 ? decode_block<true>(w, p, kb, pairs) : decode_block<false>(w, p, kb, pairs);
        std::memcpy(dst + (p * (K / 32) + kb) * 16, pairs, sizeof(pairs));
      }
  });
#endif
  return out;
}

// x: [M, K] bfloat16; data, scale, mins: the layout above (pack_blocks_bf16); N: outputs;
// bias: [N] or None; pairs: the same weights decoded (decode_blocks_bf16) or None, read
// instead of the blocks from kPairsFromRows rows on. Returns [M, N] bfloat16.
at::Tensor linear_blocks_bf16(at::Tensor x, at::Tensor data, at::Tensor scale, at::Tensor mins, int64_t N,
                              std::optional<at::Tensor> bias, std::optional<at::Tensor> pairs) {
  TORCH_CHECK(bf16_blocks_supported(), "linear_blocks_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = data.size(0);
  const bool q4 = data.scalar_type() == at::kByte;
  TORCH_CHECK(data.dim() == 4 && K % 32 == 0 && data.size(1) == K / 32 && data.size(2) == 16 &&
              data.size(3) == (q4 ? 16 : 32) && (q4 || data.scalar_type() == at::kChar) && data.is_contiguous(),
              "packed weight mismatch");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == P * (K / 32) * kCols,
              "packed weight mismatch");
  TORCH_CHECK(!q4 || (mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.numel() == scale.numel()),
              "packed weight mismatch");
  TORCH_CHECK(P * kCols >= N, "N exceeds the packed weight");
  at::Tensor b;
  const float* bp = float_bias(bias, N, b);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AVX512F__)
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const bool decoded = pairs.has_value() && pairs->defined();
  if (decoded)
    TORCH_CHECK(pairs->scalar_type() == at::kBFloat16 && pairs->is_contiguous() && pairs->numel() == P * K * kCols,
                "decoded pairs mismatch");
  const Blocks w{reinterpret_cast<const uint8_t*>(data.data_ptr()),
                 reinterpret_cast<const half_t*>(scale.data_ptr()),
                 q4 ? reinterpret_cast<const half_t*>(mins.data_ptr()) : nullptr, K, P, N};
#if SOT_AMX_BUILD
  if (amx_products()) {
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      const int64_t rows = std::min(kAmxRows, M - m0);
      q4 ? amx_product<true>(xp + m0 * K, rows, w, bp, yp + m0 * N, N)
         : amx_product<false>(xp + m0 * K, rows, w, bp, yp + m0 * N, N);
    }
    return y;
  }
#endif
  if (decoded && M >= kPairsFromRows) {
    const __m512bh* pp = reinterpret_cast<const __m512bh*>(pairs->data_ptr());
    // rows in near-equal groups of at most kTileRows, two panels a tile; each tile's panels
    // stay in L2 while its row groups pass over them
    const int64_t groups = (M + kTileRows - 1) / kTileRows, base = M / groups, extra = M % groups;
    at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float tile[kTileRows * 2 * kCols];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = 2 * t;
        const bool two = p + 1 < P;
        const __m512bh* wp = pp + p * (K / 2);
        // (this thread's next tile, fetched into L2 while the first row group multiplies)
        const int next_np = t + 1 < end ? static_cast<int>(std::min<int64_t>(2, P - p - 2)) : 0;
        for (int64_t g = 0, m0 = 0; g < groups; ++g) {
          const int64_t rows = base + (g < extra ? 1 : 0);
          const c10::BFloat16* xg = xp + m0 * K;
          const int ahead = g == 0 ? next_np : 0;
          with_rows(rows, [&](auto r) {
            constexpr int R = decltype(r)::value;
            two ? tile_pairs<R, 2>(xg, K, wp, wp + K, ahead, tile) : tile_pairs<R, 1>(xg, K, wp, wp + K, ahead, tile);
          });
          store_bf16(tile, static_cast<int>(rows), two ? 2 : 1, p, N, bp, yp + m0 * N);
          m0 += rows;
        }
      }
    });
    return y;
  }
  if (M <= kTileRows) {
    // two panels a tile (more independent chains), each fetching the next tile ahead: whole
    // verify passes of 5-7 rows ran 1.03-1.08x faster than with one panel and no fetch, 1-4 level
    const int64_t np = 2;
    at::parallel_for(0, (P + np - 1) / np, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float tile[kTileRows * 2 * kCols];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = t * np, q = p + np;
        const int pn = static_cast<int>(std::min<int64_t>(np, P - p));
        const int qn = t + 1 < end ? static_cast<int>(std::min<int64_t>(np, P - q)) : 0;  // (this thread's next)
        with_rows(M, [&](auto r) {
          constexpr int R = decltype(r)::value;
          if (pn == 2)
            q4 ? tile_rows<R, 2, true>(xp, w, p, q, qn, tile) : tile_rows<R, 2, false>(xp, w, p, q, qn, tile);
          else
            q4 ? tile_rows<R, 1, true>(xp, w, p, q, qn, tile) : tile_rows<R, 1, false>(xp, w, p, q, qn, tile);
        });
        store_bf16(tile, static_cast<int>(M), pn, p, N, bp, yp);
      }
    });
    return y;
  }
  const int64_t groups = (M + kTileRows - 1) / kTileRows, base = M / groups, extra = M % groups;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kCols);
    __m512bh pairs[16];
    for (int64_t p = begin; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        q4 ? decode_block<true>(w, p, kb, pairs) : decode_block<false>(w, p, kb, pairs);
        for (int64_t g = 0, m0 = 0; g < groups; ++g) {
          const int64_t rows = base + (g < extra ? 1 : 0);
          const c10::BFloat16* xg = xp + m0 * K;
          float* ag = acc.data() + m0 * kCols;
          with_rows(rows, [&](auto r) { chunk_rows<decltype(r)::value>(xg, K, kb, pairs, ag); });
          m0 += rows;
        }
      }
      for (int64_t i = 0; i < M; ++i) store_bf16(acc.data() + i * kCols, 1, 1, p, N, bp, yp + i * N);
    }
  });
  return y;
#else
  (void)bp;
  TORCH_CHECK(false, "unreachable");
  return y;
#endif
}
