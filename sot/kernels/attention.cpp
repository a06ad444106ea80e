// Exact tree attention on the CPU.
//
// Every (sequence, head, row) is computed by the same instruction sequence over its keys in
// position order: the committed slots 0 .. length-1, then the row's ancestors (root first,
// itself last). Nothing depends on how many rows, trees or sequences share the call, so a
// tree row produces the same bits as plain decoding of the same token.
// A row of many keys is attended in two halves split at a point its position fixes, and the
// halves merged by a fixed formula, so that that too is the same in every pass; the halves
// are separate tasks, which spreads a one-row pass over the threads.
#include "common.h"

#include <type_traits>

typedef int32_t vec16i __attribute__((vector_size(64)));

// exp for the softmax, 16 values at once: range reduction plus a degree-6 polynomial, in
// plain lane-wise arithmetic. Every value takes the same path wherever it sits.
inline vec16 softmax_exp(vec16 x) {
  const vec16 lo = vec16{} - 87.0f;
  x = x < lo ? lo : x;
  const vec16 t = x * 1.44269504088896341f;
  const vec16 half = t < 0.f ? vec16{} - 0.5f : vec16{} + 0.5f;
  const vec16i ni = __builtin_convertvector(t + half, vec16i);
  const vec16 n = __builtin_convertvector(ni, vec16);
  const vec16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vec16 p = vec16{} + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vec16i bits = (ni + 127) << 23;
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}


constexpr int64_t kMaxGroup = 16;

// The cache holds float32 or bfloat16 values (bfloat16 models write bfloat16 keys and values,
// so a float32 cache would only hold them widened), or, for a float32 model whose cache was
// asked to be smaller (--kv-cache-dtype), bfloat16 or float16 roundings of its values. Loads
// widen exactly, so the arithmetic below is the same float32 arithmetic on the values held.

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec16 load16(const at::BFloat16* p) {
  uint16_t bits[kLanes];
  std::memcpy(bits, p, sizeof(bits));
  uint32_t wide[kLanes];
  for (int l = 0; l < kLanes; ++l) wide[l] = static_cast<uint32_t>(bits[l]) << 16;
  vec16 v;
  std::memcpy(&v, wide, sizeof(v));
  return v;
}

inline vec16 load16(const at::Half* p) {
  float wide[kLanes];
  for (int l = 0; l < kLanes; ++l) wide[l] = static_cast<float>(p[l]);
  vec16 v;
  std::memcpy(&v, wide, sizeof(v));
  return v;
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const at::Half* p) {  // (F16C: exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// The cache layout this kernel reads: keys [B, Hkv, S / 16, D, 16] (tiles of 16 slots, each
// tile the 16 keys' dimensions in turn, so that 16 keys of one dimension fill one vector and a
// block of 16 keys is one contiguous read: one stream for the hardware prefetcher, where rows of
// S slots per dimension were D streams), values [B, Hkv, S, D]. One task is one (sequence, KV
// head) and a tile of that sequence's rows: the query heads sharing that KV head, in each of
// those rows, are processed together so each key is loaded once, but every (row, head) keeps
// its own accumulators and its own fixed order of operations.
// Tiles ahead of the block being scored whose lines are prefetched.
constexpr int64_t kPrefetchTiles = 2;

// One 16-key block of scores for the query heads of one KV head, in plain lane-wise
// arithmetic (score_tile's vector registers do the same): each lane sums q[d] * k[d] over d
// in order, dimension d of the 16 keys at kt + d * S (S = 16 in a tile). G > 0 fixes the head
// count at compile time; G == 0 takes it from `group`.

template <int G, typename C>
inline void score_block(int64_t group, const float* qrows, int64_t D, const C* kt, int64_t S, float scale,
                        float* scores, int64_t stride) {
  const int64_t g = G > 0 ? G : group;
  vec16 lane[G > 0 ? G : kMaxGroup];
  for (int64_t j = 0; j < g; ++j) lane[j] = vec16{};
  for (int64_t d = 0; d < D; ++d) {
    const vec16 col = load16(kt + d * S);
    for (int64_t j = 0; j < g; ++j) lane[j] += qrows[j * D + d] * col;
  }
  for (int64_t j = 0; j < g; ++j) {
    lane[j] *= scale;
    std::memcpy(scores + j * stride, &lane[j], sizeof(vec16));
  }
}

// 16 lanes of the weighted value sum for each query head: acc[j * nv] = sum of w[j][k] * v[k]
// over the committed keys k in order (a row's ancestors are added after, by the caller); with
// `resume`, the sum goes on from acc (keys taken a block at a time: the same operations).
template <int G, typename C>
inline void weighted_values(int64_t group, const float* weights, int64_t stride, const C* vbase, int64_t D,
                            int64_t committed, vec16* acc, int64_t nv, bool resume) {
  const int64_t g = G > 0 ? G : group;
  vec16 lane[G > 0 ? G : kMaxGroup];
  for (int64_t j = 0; j < g; ++j) lane[j] = resume ? acc[j * nv] : vec16{};
  for (int64_t k = 0; k < committed; ++k) {
    const vec16 vv = load16(vbase + k * D);
    for (int64_t j = 0; j < g; ++j) lane[j] += weights[j * stride + k] * vv;
  }
  for (int64_t j = 0; j < g; ++j) acc[j * nv] = lane[j];
}

// The largest of n scores (-inf for none). Lane-wise maxima over 16-key blocks, then the lanes:
// a maximum is exact in any order, so this is the value a scan in key order finds.
inline float max_score(const float* sc, int64_t n) {
  float lanes[kLanes];
  int64_t k = 0;
#if defined(__AVX2__)
  // (GCC lowers the 16-lane select below poorly on AVX2; MAXPS is the same select)
  __m256 lo = _mm256_set1_ps(-INFINITY), hi = lo;
  for (; k + kLanes <= n; k += kLanes) {
    lo = _mm256_max_ps(_mm256_loadu_ps(sc + k), lo);  // (first > second ? first : second)
    hi = _mm256_max_ps(_mm256_loadu_ps(sc + k + 8), hi);
  }
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
#else
  vec16 top16 = vec16{} - INFINITY;
  for (; k + kLanes <= n; k += kLanes) {
    vec16 v;
    std::memcpy(&v, sc + k, sizeof(v));
    top16 = v > top16 ? v : top16;
  }
  std::memcpy(lanes, &top16, sizeof(lanes));
#endif
  float top = -INFINITY;
  for (int l = 0; l < kLanes; ++l) top = lanes[l] > top ? lanes[l] : top;
  for (; k < n; ++k) top = sc[k] > top ? sc[k] : top;
  return top;
}

// Rows of one tree share their committed keys, so a task takes up to kTileSlots (row, query
// head) pairs at once: each key (and value) vector is loaded once for all of them, while every
// pair keeps its own accumulators and the very operations score_block and weighted_values give
// it alone. A row's bits therefore do not depend on the rows it is tiled with.
#if defined(__AVX512F__)
constexpr int kTileSlots = 12;  // (32 vector registers: 24 accumulators, 2 loaded vectors)
#else
constexpr int kTileSlots = 6;   // (16 registers)
#endif

template <int G>
constexpr int max_tile_rows() { return G > 0 && kTileSlots / G > 1 ? kTileSlots / G : 1; }

// Keys a block: the scores and the value sums of a task's rows go through the keys a block at
// a time, each block taken by every register tile of rows while it is in L1 (64 keys: 16 KB of
// float32 keys or values at head dim 64).
constexpr int64_t kKeyBlock = 64;
// Rows of a task at most, in register tiles (as many as fill it), where the rows share many
// committed keys (kWideKeys or more): their keys and values are read from memory once for all
// of them (a prompt's chain of 64 rows after 3,000 keys read them 32 times, in tiles of 2). With
// fewer keys, the cache holds them between tasks and one register tile a task keeps more tasks
// to spread over the threads.
constexpr int kWideRows = 8;
constexpr int64_t kWideKeys = 1024;
template <int G>
constexpr int max_task_rows() {
  return max_tile_rows<G>() >= kWideRows ? max_tile_rows<G>() : kWideRows / max_tile_rows<G>() * max_tile_rows<G>();
}

#if defined(__AVX2__)
// For each of P (row, head) pairs s, 16 lanes lo[s] | hi[s] = sum over i < n, in order, of
// scalars[s * step + i] * vecs[i * stride .. + 16], as one multiply and one add per lane and i
// (score_tile: i is the head dimension, weighted_tile: the key), from zero unless `zero` is
// false (then from lo[s] | hi[s]). With PREFETCH, each vector's
// line `ahead` entries on is asked for (the tiles of keys to come; no effect on the arithmetic;
// past the cache's end it is a hint only).
template <int P, bool PREFETCH, typename C>
inline void broadcast_sums(int64_t n, const float* scalars, int64_t step, const C* vecs, int64_t stride, __m256* lo,
                           __m256* hi, int64_t ahead = 0, bool zero = true) {
  if (zero) {  // (else the sums go on from lo and hi)
#pragma GCC unroll 12
    for (int s = 0; s < P; ++s) lo[s] = hi[s] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < n; ++i) {
    const C* v = vecs + i * stride;
    const __m256 v0 = load8(v), v1 = load8(v + 8);
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(v + ahead), _MM_HINT_T0);
#pragma GCC unroll 12
    for (int s = 0; s < P; ++s) {
      const __m256 x = _mm256_set1_ps(scalars[s * step + i]);
      lo[s] = _mm256_add_ps(lo[s], _mm256_mul_ps(x, v0));
      hi[s] = _mm256_add_ps(hi[s], _mm256_mul_ps(x, v1));
    }
  }
}
#endif

#if defined(__AVX2__)
// broadcast_sums over two 16-lane chunks at once (the vectors at vecs and vecs + chunk: two
// 16-dimension chunks of a value row, or two tiles of keys): the same operations for each lane
// in the same order, reading both in one pass instead of two. lo/hi[s * 2 + c]: chunk c of
// pair s.
template <int P, bool PREFETCH, typename C>
inline void broadcast_sums2(int64_t n, const float* scalars, int64_t step, const C* vecs, int64_t stride,
                            int64_t chunk, __m256* lo, __m256* hi, int64_t ahead = 0) {
  __m256 l[P][2], h[P][2];
#pragma GCC unroll 12
  for (int s = 0; s < P; ++s) l[s][0] = l[s][1] = h[s][0] = h[s][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const C* v = vecs + i * stride;
    if (PREFETCH) {
      _mm_prefetch(reinterpret_cast<const char*>(v + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + chunk + ahead), _MM_HINT_T0);
    }
#pragma GCC unroll 12
    for (int s = 0; s < P; ++s) {
      const __m256 x = _mm256_set1_ps(scalars[s * step + i]);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        l[s][c] = _mm256_add_ps(l[s][c], _mm256_mul_ps(x, load8(v + c * chunk)));
        h[s][c] = _mm256_add_ps(h[s][c], _mm256_mul_ps(x, load8(v + c * chunk + 8)));
      }
    }
  }
#pragma GCC unroll 12
  for (int s = 0; s < P; ++s)
    for (int c = 0; c < 2; ++c) {
      lo[s * 2 + c] = l[s][c];
      hi[s * 2 + c] = h[s][c];
    }
}
#endif

#if defined(__AVX2__)
// A row's own keys (its ancestors, after the committed keys) added to its value sums, for P
// query heads and NC 16-lane chunks of the value rows from `off`: acc[s * nv + c] += w[s *
// stride + k] * v(k)[off + 16 c ...] for k = 0 .. n - 1 in order, v(k) the value row at slot
// slots[k]; one multiply and one add per lane and key, the operations of a vec16 `a += w * v`
// loop, with 2 P NC independent accumulators instead of one chain per (head, chunk).
template <int P, int NC, typename C>
inline void ancestor_sums(int64_t n, const float* w, int64_t stride, const C* vbase, const int64_t* slots, int64_t D,
                          int64_t off, vec16* acc, int64_t nv) {
  __m256 lo[P][NC], hi[P][NC];
#pragma GCC unroll 8
  for (int s = 0; s < P; ++s)
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) {
      const float* a = reinterpret_cast<const float*>(acc + s * nv + c);
      lo[s][c] = _mm256_loadu_ps(a);
      hi[s][c] = _mm256_loadu_ps(a + 8);
    }
  for (int64_t k = 0; k < n; ++k) {
    const C* v = vbase + slots[k] * D + off;
#pragma GCC unroll 8
    for (int s = 0; s < P; ++s) {
      const __m256 x = _mm256_set1_ps(w[s * stride + k]);
#pragma GCC unroll 2
      for (int c = 0; c < NC; ++c) {
        lo[s][c] = _mm256_add_ps(lo[s][c], _mm256_mul_ps(x, load8(v + c * kLanes)));
        hi[s][c] = _mm256_add_ps(hi[s][c], _mm256_mul_ps(x, load8(v + c * kLanes + 8)));
      }
    }
  }
#pragma GCC unroll 8
  for (int s = 0; s < P; ++s)
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) {
      float* a = reinterpret_cast<float*>(acc + s * nv + c);
      _mm256_storeu_ps(a, lo[s][c]);
      _mm256_storeu_ps(a + 8, hi[s][c]);
    }
}
#endif

// Row i's ancestors (slots own, relative to the values' base) added to its value sums acc
// (head j's chunk v at acc[j * nv + v], the committed keys' sums already there), w its
// weights past the committed keys (head j's at w + j * stride): per head and chunk, in the
// ancestors' order, `a += w * v` in lane-wise arithmetic, whichever loop runs it.
template <int G, typename C>
inline void add_ancestors(int64_t group, const std::vector<int64_t>& own, const float* w, int64_t stride,
                          const C* vbase, int64_t D, vec16* acc, int64_t nv) {
  if (own.empty()) return;
  const int64_t n = static_cast<int64_t>(own.size());
#if defined(__AVX2__)
  if constexpr (G > 0 && G <= 3) {  // (two chunks a pass: 4 G accumulators)
    int64_t v = 0;
    for (; v + 2 <= nv; v += 2) ancestor_sums<G, 2, C>(n, w, stride, vbase, own.data(), D, v * kLanes, acc + v, nv);
    if (v < nv) ancestor_sums<G, 1, C>(n, w, stride, vbase, own.data(), D, v * kLanes, acc + v, nv);
    return;
  }
  if constexpr (G >= 4 && G <= 6) {
    for (int64_t v = 0; v < nv; ++v)
      ancestor_sums<G, 1, C>(n, w, stride, vbase, own.data(), D, v * kLanes, acc + v, nv);
    return;
  }
#endif
  for (int64_t j = 0; j < group; ++j)
    for (int64_t v = 0; v < nv; ++v) {
      vec16 a = acc[j * nv + v];
      for (int64_t k = 0; k < n; ++k) a += w[j * stride + k] * load16(vbase + own[k] * D + v * kLanes);
      acc[j * nv + v] = a;
    }
}

#if defined(__AVX512F__)
// Scores over a bfloat16 cache with the AVX512-BF16 pair dot product (VDPBF16PS), where the CPU
// has it: q and the keys are both bfloat16 then, so one instruction takes two head dimensions
// of 16 keys, twice the multiply-adds of the float32 loop. Each lane (one key) is one chain of
// VDPBF16PS steps over the pairs (d, d + 1), d = 0, 2, ..., D - 2, in order, from zero, then
// times the scale: the same instructions for every key, row and head, whatever lane of its
// block the key takes, so a row's scores never depend on the rows or the keys around it. (The
// float32 loops' bits differ; a machine uses one or the other.)
#define SOT_DPBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// (SOT_NO_BF16_ATTENTION=1: the float32 loops, as on other CPUs; read at each call, so that a
// comparison can switch it between passes)
bool attention_pairs_bf16() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported && !std::getenv("SOT_NO_BF16_ATTENTION");
}

// q of one (row, head) as bfloat16 pairs: pairs[p] holds q[2p] in its low half, q[2p + 1] in
// its high half. qrow holds bfloat16 values widened to float32, so dropping the low half of
// each float's bits gives them back exactly.
inline void q_pairs(const float* qrow, int64_t D, uint32_t* pairs) {
  for (int64_t p = 0; p < D / 2; ++p) {
    uint32_t lo, hi;
    std::memcpy(&lo, qrow + 2 * p, 4);
    std::memcpy(&hi, qrow + 2 * p + 1, 4);
    pairs[p] = (lo >> 16) | (hi & 0xFFFF0000u);
  }
}

// Interleaves the 16 bfloat16 values at r0 and the 16 at r1: element 2l <- r0[l], 2l + 1 <- r1[l].
SOT_DPBF16 __attribute__((always_inline)) inline __m512bh interleave(const uint16_t* r0, const uint16_t* r1) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1)), 1);
  return (__m512bh)_mm512_permutexvar_epi16(order, both);
}

// NB blocks of 16 keys from k0 for P slots (see pair_scores): NB independent chains per slot,
// so that few slots (a one-row pass) still keep the dot-product unit busy; each lane's chain is
// the same whatever NB. A block is one tile: dimension d of its 16 keys at tile + d * 16.
template <int P, int NB>
SOT_DPBF16 __attribute__((always_inline)) inline void pair_score_blocks(int64_t k0, const uint32_t* qp, int64_t D,
                                                                        const uint16_t* kt, __m512 sc, float* scores,
                                                                        int64_t stride) {
  const int64_t half = D / 2;
  __m512 acc[NB][P];
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int s = 0; s < P; ++s) acc[b][s] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half; ++p) {
    __m512bh keys[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const uint16_t* r0 = kt + (k0 + b * kLanes) * D + 2 * p * kLanes;  // rows 2p and 2p + 1 of the tile
      _mm_prefetch(reinterpret_cast<const char*>(r0 + kPrefetchTiles * kLanes * D), _MM_HINT_T0);
      keys[b] = interleave(r0, r0 + kLanes);
    }
#pragma GCC unroll 16
    for (int s = 0; s < P; ++s) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[s * half + p]));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[b][s] = _mm512_dpbf16_ps(acc[b][s], q, keys[b]);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int s = 0; s < P; ++s) _mm512_storeu_ps(scores + s * stride + k0 + b * kLanes, _mm512_mul_ps(acc[b][s], sc));
}

// For P (row, head) slots s with pairs qp[s * D / 2 ...], the scores of the 16 keys of each
// block k0 = 0, 16, ..., blocks - 16: scores[s * stride + k0 + l] for key k0 + l, whose
// dimension d sits at kt[k0 * D + d * 16 + l] (tiled keys). (Few slots take blocks four or two
// at a time.)
template <int P>
SOT_DPBF16 void pair_scores(int64_t blocks, const uint32_t* qp, int64_t D, const uint16_t* kt, float scale,
                            float* scores, int64_t stride) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t k0 = 0;
  if constexpr (P <= 3)
    for (; k0 + 4 * kLanes <= blocks; k0 += 4 * kLanes) pair_score_blocks<P, 4>(k0, qp, D, kt, sc, scores, stride);
  if constexpr (P <= 6)
    for (; k0 + 2 * kLanes <= blocks; k0 += 2 * kLanes) pair_score_blocks<P, 2>(k0, qp, D, kt, sc, scores, stride);
  for (; k0 < blocks; k0 += kLanes) pair_score_blocks<P, 1>(k0, qp, D, kt, sc, scores, stride);
}

// pair_scores for n slots (any n), P at a time.
template <int P>
void pair_scores_n(int n, int64_t blocks, const uint32_t* qp, int64_t D, const uint16_t* kt, float scale,
                   float* scores, int64_t stride) {
  for (; n >= P; n -= P, qp += P * (D / 2), scores += P * stride)
    pair_scores<P>(blocks, qp, D, kt, scale, scores, stride);
  if constexpr (P > 1)
    if (n > 0) pair_scores_n<P - 1>(n, blocks, qp, D, kt, scale, scores, stride);
}

// The weighted value sums by the same pair dot product, where the scores were taken by it: a
// row's weights are rounded to bfloat16 (as a bfloat16 model's reference attention rounds its
// probabilities before the product with the values), and each of its 16-dimension chunks is
// one chain of VDPBF16PS steps over the pairs of its keys (k, k + 1), k = 0, 2, ..., counted
// in the row's key order (its committed keys, then its ancestors; an odd last key is paired
// with a zero weight and zero values). A key's place in that order is its position less the
// row's first, so a tree row and plain decoding of the same token pair the same keys.
//
// For P slots s, pairs m = m0 .. m1 - 1: out[s][l] (16 floats; zeros first unless `resume`)
// += w[s][2m] * v(2m)[l] + w[s][2m + 1] * v(2m + 1)[l], where wp[s][m] holds the weights of
// keys 2m (low half) and 2m + 1 (high half) and v(k) is rows[k] + off (when `rows` is given)
// or base + k * D.
//
// NV chunks at once (out[s] + c * 16 for chunk c, values at + c * 16): independent chains, for
// few slots; each lane's chain is the same whatever NV.
template <int P, int NV>
SOT_DPBF16 void pair_values(int64_t m0, int64_t m1, const uint32_t* const* wp, const uint16_t* const* rows,
                            int64_t off, const uint16_t* base, int64_t D, bool resume, float* const* out) {
  __m512 acc[NV][P];
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c)
#pragma GCC unroll 16
    for (int s = 0; s < P; ++s) acc[c][s] = resume ? _mm512_loadu_ps(out[s] + c * kLanes) : _mm512_setzero_ps();
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* r0 = rows ? rows[2 * m] + off : base + 2 * m * D;
    const uint16_t* r1 = rows ? rows[2 * m + 1] + off : r0 + D;
    __m512bh vals[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vals[c] = interleave(r0 + c * kLanes, r1 + c * kLanes);
#pragma GCC unroll 16
    for (int s = 0; s < P; ++s) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[s][m]));
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[c][s] = _mm512_dpbf16_ps(acc[c][s], w, vals[c]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c)
#pragma GCC unroll 16
    for (int s = 0; s < P; ++s) _mm512_storeu_ps(out[s] + c * kLanes, acc[c][s]);
}

// A row's weights w[0 .. n) (n a multiple of 16) rounded to bfloat16 (nearest even): stored as
// pairs (weights 2m and 2m + 1 in pairs[m], low half first) and written back to w as floats.
SOT_DPBF16 void round_weights(float* w, int64_t n, uint32_t* pairs) {
  for (int64_t k = 0; k < n; k += kLanes) {
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + k / 2), b);
    _mm512_storeu_ps(w + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
  }
}

// pair_values for n slots (any n), P at a time, over the `chunks` chunks of 16 dimensions from
// `off` (out[s] + c * 16 for chunk c): few slots take two or four chunks at once.
template <int P>
void pair_values_n(int n, int chunks, int64_t m0, int64_t m1, const uint32_t* const* wp, const uint16_t* const* rows,
                   int64_t off, const uint16_t* base, int64_t D, bool resume, float* const* out) {
  for (; n >= P; n -= P, wp += P, out += P) {
    float* o[P];
    for (int c = 0; c < chunks;) {
      for (int s = 0; s < P; ++s) o[s] = out[s] + c * kLanes;
      const int64_t at = off + c * kLanes;
      if (P <= 3 && c + 4 <= chunks) {
        pair_values<P, 4>(m0, m1, wp, rows, at, base + (rows ? 0 : at), D, resume, o);
        c += 4;
      } else if (P <= 6 && c + 2 <= chunks) {
        pair_values<P, 2>(m0, m1, wp, rows, at, base + (rows ? 0 : at), D, resume, o);
        c += 2;
      } else {
        pair_values<P, 1>(m0, m1, wp, rows, at, base + (rows ? 0 : at), D, resume, o);
        c += 1;
      }
    }
  }
  if constexpr (P > 1)
    if (n > 0) pair_values_n<P - 1>(n, chunks, m0, m1, wp, rows, off, base, D, resume, out);
}
#else
bool attention_pairs_bf16() { return false; }
inline void q_pairs(const float*, int64_t, uint32_t*) {}
template <int P>
void pair_scores_n(int, int64_t, const uint32_t*, int64_t, const uint16_t*, float, float*, int64_t) {}
template <int P>
void pair_values_n(int, int, int64_t, int64_t, const uint32_t* const*, const uint16_t* const*, int64_t,
                   const uint16_t*, int64_t, bool, float* const*) {}
inline void round_weights(float*, int64_t, uint32_t*) {}
#endif

// score_block for NR rows: qrows [NR][group][D], scores of row i, head j at (i * group + j) * stride.
template <int G, int NR, typename C>
inline void score_tile(int64_t group, const float* qrows, int64_t D, const C* kt, int64_t S, float scale,
                       float* scores, int64_t stride) {
#if defined(__AVX2__)
  if constexpr (G > 0) {
    constexpr int P = G * NR;
    __m256 lo[P], hi[P];
    broadcast_sums<P, true>(D, qrows, D, kt, S, lo, hi, kPrefetchTiles * kLanes * D);
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 12
    for (int s = 0; s < P; ++s) {
      _mm256_storeu_ps(scores + s * stride, _mm256_mul_ps(lo[s], sc));
      _mm256_storeu_ps(scores + s * stride + 8, _mm256_mul_ps(hi[s], sc));
    }
    return;
  }
#endif
  for (int i = 0; i < NR; ++i)
    score_block<G, C>(group, qrows + i * group * D, D, kt, S, scale, scores + i * group * stride, stride);
}

// weighted_values over the committed keys 0 .. committed - 1 for NR rows: acc[i] is row i's
// accumulators (head j's 16 lanes at acc[i][j * nv]); with `resume`, going on from them.
template <int G, int NR, typename C>
inline void weighted_tile(int64_t group, const float* weights, int64_t stride, const C* vbase, int64_t D,
                          int64_t committed, vec16* const* acc, int64_t nv, bool resume) {
#if defined(__AVX2__)
  if constexpr (G > 0) {
    constexpr int P = G * NR;
    __m256 lo[P], hi[P];
    if (resume) {
#pragma GCC unroll 12
      for (int s = 0; s < P; ++s) {
        const float* a = reinterpret_cast<const float*>(acc[s / G] + (s % G) * nv);
        lo[s] = _mm256_loadu_ps(a);
        hi[s] = _mm256_loadu_ps(a + 8);
      }
    }
    broadcast_sums<P, false>(committed, weights, stride, vbase, D, lo, hi, 0, !resume);
#pragma GCC unroll 12
    for (int s = 0; s < P; ++s) {
      float* a = reinterpret_cast<float*>(acc[s / G] + (s % G) * nv);
      _mm256_storeu_ps(a, lo[s]);
      _mm256_storeu_ps(a + 8, hi[s]);
    }
    return;
  }
#endif
  for (int i = 0; i < NR; ++i)
    weighted_values<G, C>(group, weights + i * group * stride, stride, vbase, D, committed, acc[i], nv, resume);
}

// The tile functions for nr rows (1 <= nr <= NR), register tiles fixed at compile time.
template <int G, int NR, typename C>
inline void score_rows(int nr, int64_t group, const float* qrows, int64_t D, const C* kt, int64_t S, float scale,
                       float* scores, int64_t stride) {
  if constexpr (NR > 1)
    if (nr < NR) return score_rows<G, NR - 1, C>(nr, group, qrows, D, kt, S, scale, scores, stride);
  score_tile<G, NR, C>(group, qrows, D, kt, S, scale, scores, stride);
}

template <int G, int NR, typename C>
inline void weighted_rows(int nr, int64_t group, const float* weights, int64_t stride, const C* vbase, int64_t D,
                          int64_t committed, vec16* const* acc, int64_t nv, bool resume) {
  if constexpr (NR > 1)
    if (nr < NR) return weighted_rows<G, NR - 1, C>(nr, group, weights, stride, vbase, D, committed, acc, nv, resume);
  weighted_tile<G, NR, C>(group, weights, stride, vbase, D, committed, acc, nv, resume);
}

// A row with at least this many keys is attended as two halves, split at a point its own
// position fixes (so a tree row and plain decoding split alike), and the halves' softmaxes are
// merged by a fixed formula: a one-row pass then spreads its KV heads' halves over the threads
// instead of leaving a thread with one head more than another.
constexpr int64_t kSplitKeys = 256;
// Merging a split row's halves is a few hundred multiply-adds: below this many (sequence, KV
// head, row) units the merge runs on the calling thread, so a pass of a few rows (one row: 3
// units with 3 KV heads) opens no second parallel region. (One layer, one row, 9 query and 3
// KV heads of 64 dims, best of 2000 calls on two cores of an AVX2 EPYC: 1-4 us less a call
// at 16 and 128 keys.)
constexpr int64_t kMergeGrain = 64;

// The attention of nr rows (a tile) over their keys from slot `from`: the `committed` slots
// from there, shared by the tile, then each row's own ancestors at slots[i] (relative to
// `from`). khead: the head's tiled keys ([S / 16][D][16], S slots); vbase: its values from slot
// `from`. Leaves, for row i and query head j, the weighted value sums in acc[i][j * nv ...], the
// largest score in tops[i * group + j] and the sum of the weights in sums[i * group + j].
template <int G, typename C>
void attend_tile(int nr, int64_t group, const float* qrows, int64_t D, const C* khead, int64_t from, int64_t S,
                 const C* vbase, int64_t committed, const std::vector<int64_t>* slots, float scale,
                 float softcap, bool paired, std::vector<float>& scores, std::vector<uint32_t>& wpairs,
                 vec16* const* acc, float* tops, float* sums) {
  const int64_t nv = D / kLanes;
  // Scores in whole 16-key blocks, the tiles from the one that holds slot `from`: over the
  // committed slots and on through the scratch slots up to the furthest row's own, whose
  // ancestors' scores are then moved behind the committed ones. The cache holds whole tiles
  // (S is a multiple of 16), so the blocks reach every key. A lane's score is its own key's
  // alone, so the `skew` keys of the first tile before `from` (a sliding window's first key
  // need not start a tile) are scored, then dropped, and no key's bits depend on where its
  // tile starts.
  const int64_t skew = from % kLanes;
  const C* kt = khead + (from - skew) * D;
  int64_t reach = committed, most = committed;
  for (int i = 0; i < nr; ++i) {
    if (!slots[i].empty()) reach = std::max(reach, slots[i].back() + 1);
    most = std::max(most, committed + static_cast<int64_t>(slots[i].size()));
  }
  const int64_t blocks = (skew + reach + kLanes - 1) / kLanes * kLanes;  // (at most S - (from - skew))
  const int64_t stride = (std::max(most, blocks) + kLanes - 1) / kLanes * kLanes;
  scores.resize(nr * group * stride);
  if (paired) wpairs.resize(nr * group * stride / 2);
  // paired: bfloat16 pair dot products (a bfloat16 cache on a CPU that has them, see pair_scores)
  uint32_t qp[kMaxGroup * kMaxD / 2];  // (nr * group <= kMaxGroup slots: tiles hold at most kTileSlots)
  if (paired) {
    for (int s = 0; s < nr * group; ++s) q_pairs(qrows + s * D, D, qp + s * (D / 2));
    pair_scores_n<kTileSlots>(nr * static_cast<int>(group), blocks, qp, D, reinterpret_cast<const uint16_t*>(kt),
                              scale, scores.data(), stride);
  } else {
    int64_t k0 = 0;
#if defined(__AVX2__)
    if constexpr (G > 0 && G <= 3) {
      if (nr == 1) {  // two blocks of 16 keys (two tiles) a pass over the head dimension
        const __m256 sc = _mm256_set1_ps(scale);
        for (; k0 + 2 * kLanes <= blocks; k0 += 2 * kLanes) {
          __m256 lo[G * 2], hi[G * 2];
          broadcast_sums2<G, true, C>(D, qrows, D, kt + k0 * D, kLanes, kLanes * D, lo, hi,
                                      kPrefetchTiles * kLanes * D);
          for (int j = 0; j < G; ++j)
            for (int c = 0; c < 2; ++c) {
              _mm256_storeu_ps(scores.data() + j * stride + k0 + c * kLanes, _mm256_mul_ps(lo[j * 2 + c], sc));
              _mm256_storeu_ps(scores.data() + j * stride + k0 + c * kLanes + 8, _mm256_mul_ps(hi[j * 2 + c], sc));
            }
        }
      }
    }
#endif
    // Blocks of kKeyBlock keys outer, register tiles of rows inner: a block is read from
    // memory once for all the tile's rows, then from L1 (each score is the same dot product).
    constexpr int RT = max_tile_rows<G>();
    for (; k0 < blocks; k0 += kKeyBlock) {
      const int64_t k1 = std::min<int64_t>(blocks, k0 + kKeyBlock);
      for (int t = 0; t < nr; t += RT)
        for (int64_t k = k0; k < k1; k += kLanes)
          score_rows<G, RT, C>(std::min(RT, nr - t), group, qrows + t * group * D, D, kt + k * D, kLanes, scale,
                               scores.data() + t * group * stride + k, stride);
    }
  }
  if (skew > 0)  // the scores from slot `from` on
    for (int64_t s = 0; s < nr * group; ++s)
      std::memmove(scores.data() + s * stride, scores.data() + s * stride + skew, (blocks - skew) * sizeof(float));
  for (int i = 0; i < nr; ++i) {
    const std::vector<int64_t>& own = slots[i];
    const int64_t total = committed + static_cast<int64_t>(own.size());
    float* rs = scores.data() + i * group * stride;  // this row's scores, head j at j * stride
    // An ancestor's slot is at or past its place in the row's key order, and later ancestors
    // sit at later slots: moving them in order overwrites nothing still needed.
    for (int64_t j = 0; j < group; ++j)
      for (int64_t k = committed; k < total; ++k) rs[j * stride + k] = rs[j * stride + own[k - committed]];
    if (softcap > 0.f)  // Gemma 2: cap * tanh(score / cap), before the softmax
      for (int64_t j = 0; j < group; ++j)
        for (int64_t k = 0; k < total; ++k) {
          float& s = rs[j * stride + k];
          s = std::tanh(s / softcap) * softcap;
        }
    for (int64_t j = 0; j < group; ++j) {
      float* sc = rs + j * stride;
      const float top = max_score(sc, total);
      for (int64_t k = total; k < stride; ++k) sc[k] = top;  // padding, zeroed below
#if defined(__AVX2__) && !defined(__AVX512F__)  // (with AVX-512, GCC lowers the 16 lanes well)
      const __m256 top8 = _mm256_set1_ps(top);
      for (int64_t k = 0; k < stride; k += 8)  // now weights
        _mm256_storeu_ps(sc + k, softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + k), top8)));
#else
      for (int64_t k = 0; k < stride; k += kLanes) {
        vec16 v;
        std::memcpy(&v, sc + k, sizeof(v));
        v = softmax_exp(v - top);  // now weights
        std::memcpy(sc + k, &v, sizeof(v));
      }
#endif
      for (int64_t k = total; k < stride; ++k) sc[k] = 0.f;
      if (paired)  // (weights as bfloat16 pairs for pair_values; the sum is of the rounded weights)
        round_weights(sc, stride, wpairs.data() + (i * group + j) * (stride / 2));
      float lanes[kLanes] = {0};
      int64_t k = 0;
      for (; k + kLanes <= total; k += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += sc[k + l];
      for (int l = 0; k < total; ++k, ++l) lanes[l] += sc[k];
      for (int w = kLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      sums[i * group + j] = lanes[0];
      tops[i * group + j] = top;
    }
  }
  if (paired) {
    if constexpr (std::is_same_v<C, at::BFloat16>) {
      const int n = nr * static_cast<int>(group);
      const uint32_t* wp[kMaxGroup];
      for (int s = 0; s < n; ++s) wp[s] = wpairs.data() + s * (stride / 2);
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(vbase);
      // each row's own keys, from the last whole pair of committed keys on (`first`, even)
      // through its ancestors: their value rows, a zero row after an odd last key
      static const uint16_t zeros[kMaxD] = {};
      const int64_t first = committed / 2 * 2;
      std::vector<const uint16_t*> own_rows[kTileSlots];
      const uint32_t* own_wp[kMaxGroup * kTileSlots];
      for (int i = 0; i < nr; ++i) {
        const int64_t total = committed + static_cast<int64_t>(slots[i].size());
        own_rows[i].assign(total > first ? (total - first + 1) / 2 * 2 : 0, zeros);
        for (int64_t k = first; k < total; ++k)
          own_rows[i][k - first] = vb + (k < committed ? k : slots[i][k - committed]) * D;
        for (int64_t j = 0; j < group; ++j) own_wp[i * group + j] = wp[i * group + j] + first / 2;
      }
      float* out[kMaxGroup];
      // the pairs of committed keys, shared by the tile's rows, then each row's own (every chunk)
      for (int s = 0; s < n; ++s) out[s] = reinterpret_cast<float*>(acc[s / group] + (s % group) * nv);
      const int chunks = static_cast<int>(nv);
      pair_values_n<kTileSlots>(n, chunks, 0, committed / 2, wp, nullptr, 0, vb, D, false, out);
      for (int i = 0; i < nr; ++i)
        if (!own_rows[i].empty())
          pair_values_n<kTileSlots>(static_cast<int>(group), chunks, 0, static_cast<int64_t>(own_rows[i].size()) / 2,
                                    own_wp + i * group, own_rows[i].data(), 0, nullptr, D, true, out + i * group);
    }
    return;
  }
  vec16* slice[kTileSlots];
#if defined(__AVX2__)
  // A one-row tile with up to three query heads per KV head takes two chunks of each value row
  // a pass (12 accumulators), reading 128 contiguous bytes a key instead of 64 in four passes.
  constexpr int kPair = G > 0 && G <= 3 ? G : 0;
  if constexpr (kPair > 0) {
    if (nr == 1 && nv % 2 == 0) {
      for (int64_t v = 0; v < nv; v += 2) {
        __m256 lo[kPair * 2], hi[kPair * 2];
        broadcast_sums2<kPair, false, C>(committed, scores.data(), stride, vbase + v * kLanes, D, kLanes, lo, hi);
        for (int64_t j = 0; j < group; ++j)
          for (int c = 0; c < 2; ++c) {
            float* a = reinterpret_cast<float*>(acc[0] + j * nv + v + c);
            _mm256_storeu_ps(a, lo[j * 2 + c]);
            _mm256_storeu_ps(a + 8, hi[j * 2 + c]);
          }
      }
      add_ancestors<G, C>(group, slots[0], scores.data() + committed, stride, vbase, D, acc[0], nv);
      return;
    }
  }
#endif
  // The committed keys, shared by the rows, a block of kKeyBlock at a time where the task holds
  // several register tiles of rows (read once for all of them, each (row, head) going on with
  // its sums in key order; one tile takes them in one go), then each row's ancestors in order.
  constexpr int RT = max_tile_rows<G>();
  const int64_t block = nr > RT ? kKeyBlock : std::max<int64_t>(committed, 1);
  int64_t c0 = 0;
  do {
    const int64_t c1 = std::min<int64_t>(committed, c0 + block);
    for (int t = 0; t < nr; t += RT) {
      const int n = std::min(RT, nr - t);
      for (int64_t v = 0; v < nv; ++v) {
        for (int i = 0; i < n; ++i) slice[i] = acc[t + i] + v;
        weighted_rows<G, RT, C>(n, group, scores.data() + t * group * stride + c0, stride,
                                vbase + c0 * D + v * kLanes, D, c1 - c0, slice, nv, c0 > 0);
      }
    }
    c0 = c1;
  } while (c0 < committed);
  for (int i = 0; i < nr; ++i)
    add_ancestors<G, C>(group, slots[i], scores.data() + i * group * stride + committed, stride, vbase, D, acc[i], nv);
}

template <typename T, int G, typename C>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
         const at::Tensor& lengths, const at::Tensor& ancestors, const at::Tensor& rows,
         float scale, int64_t window, float softcap, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  // S: the keys' slots (tiles of 16; past the values' Sv, padding, never read as a key)
  const int64_t Hkv = keys.size(1), S = keys.size(2) * kLanes, Sv = values.size(2), W = ancestors.size(2);
  const int64_t group = H / Hkv;
  TORCH_CHECK(group <= kMaxGroup, "too many query heads per KV head");
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxD, "head dim must be a multiple of 16, at most 256");
  const int64_t nv = D / kLanes;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const T* qp = q.data_ptr<T>();
  const C* kp = keys.data_ptr<C>();
  const C* vp = values.data_ptr<C>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* ap = ancestors.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // (once a call; a float32 q is never rounded to pairs)
  const bool paired = std::is_same_v<C, at::BFloat16> && std::is_same_v<T, at::BFloat16> && attention_pairs_bf16();
  // the halves of split rows: weighted value sums, largest scores and weight sums per head
  const int64_t units = B * Hkv * R;
  std::vector<vec16> half_acc(units * 2 * group * nv);
  std::vector<float> half_top(units * 2 * group), half_sum(units * 2 * group);
  std::vector<char> split_rows(units, 0);

  // Where each row's keys lie. A row sits at position lp[b] + depth. With a sliding window it
  // sees the keys at positions first .. position only: the window's first key depends on the
  // row's own position, so a tree row and plain decoding of the same token see the same keys.
  // Keys are counted from `first` (k = 0 is position first) on both paths. A row of many keys
  // is split, at a whole number of 16-key blocks among its committed keys, into two halves.
  struct Geometry {
    int64_t depth, first, lo, committed, split;
  };
  auto locate = [&](int64_t b, int64_t r) {
    const int64_t* anc = ap + (b * R + r) * W;
    int64_t depth = -1;
    while (depth + 1 < W && anc[depth + 1] >= 0) ++depth;
    // (the blocks read every slot up to a row's furthest ancestor: it must be in the cache)
    for (int64_t w = 0; w <= depth; ++w)
      TORCH_CHECK(anc[w] < Sv, "ancestor slot ", anc[w], " is past the cache's ", Sv, " slots");
    const int64_t position = lp[b] + depth;
    const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
    const int64_t lo = std::min(first, lp[b]);  // first committed slot read
    const int64_t committed = lp[b] - lo;
    const int64_t total = committed + depth + 1 - std::max<int64_t>(0, first - lp[b]);
    int64_t split = total >= kSplitKeys ? total / 2 / kLanes * kLanes : 0;
    if (split > committed) split = 0;  // (never, with trees of at most 64 levels: a guard)
    return Geometry{depth, first, lo, committed, split};
  };
  std::vector<Geometry> rows_at(B * R);  // (real rows only)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < rp[b]; ++r) rows_at[b * R + r] = locate(b, r);
  auto geometry = [&](int64_t b, int64_t r) -> const Geometry& { return rows_at[b * R + r]; };
  // Tiles: runs of consecutive real rows of one sequence whose committed keys and split agree
  // (a tree's rows, unless a window starts them at different keys): one register tile
  // (max_tile_rows), or several (max_task_rows) where they share many keys.
  struct Tile {
    int64_t b, r0;
    int nr;
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < rp[b];) {
      const Geometry& g = geometry(b, r);
      // (the pair dot products' loops take one register tile a task)
      const int most = !paired && g.committed >= kWideKeys ? max_task_rows<G>() : max_tile_rows<G>();
      int n = 1;
      while (n < most && r + n < rp[b]) {
        const Geometry& h = geometry(b, r + n);
        if (h.lo != g.lo || h.committed != g.committed || h.split != g.split) break;
        ++n;
      }
      tiles.push_back({b, r, n});
      r += n;
    }
    for (int64_t r = std::max<int64_t>(rp[b], 0); r < R; ++r)  // padding rows: zeros
      for (int64_t h = 0; h < H; ++h) {
        T* o = op + ((b * R + r) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = T(0.f);
      }
  }
  const int64_t ntiles = static_cast<int64_t>(tiles.size());

  // One task is one half of one (tile, KV head); a tile that is not split is all in its
  // first half's task. The tasks of one (KV head, half) follow each other, tile after tile, so
  // a tree's later tiles find that part of the cache in this core's L2, where the first one
  // left it, instead of reading it from memory again.
  at::parallel_for(0, ntiles * Hkv * 2, 1, [&](int64_t begin, int64_t end) {
    constexpr int NR = max_task_rows<G>();
    std::vector<float> scores, qrows(NR * group * D);
    std::vector<uint32_t> wpairs;
    std::vector<int64_t> slots[NR];
    std::vector<vec16> accv(NR * group * nv);
    vec16* acc[NR];
    float tops[NR * kMaxGroup], sums[NR * kMaxGroup];
    for (int64_t task = begin; task < end; ++task) {
      const Tile& tile = tiles[task % ntiles];
      const int64_t kvh = task / (ntiles * 2), half = (task / ntiles) % 2, b = tile.b;
      const Geometry& g = geometry(b, tile.r0);
      if (half == 1 && g.split == 0) continue;
      const int64_t from = g.lo + (half == 1 ? g.split : 0);  // this part's first slot
      const int64_t part_committed = g.split == 0 ? g.committed : (half == 0 ? g.split : g.committed - g.split);
      for (int i = 0; i < tile.nr; ++i) {
        const int64_t r = tile.r0 + i;
        for (int64_t j = 0; j < group; ++j) {
          const T* qsrc = qp + b * qs0 + (kvh * group + j) * qs1 + r * qs2;
          float* qrow = qrows.data() + (i * group + j) * D;
          for (int64_t d = 0; d < D; ++d) qrow[d] = static_cast<float>(qsrc[d]);
        }
        slots[i].clear();
        if (g.split == 0 || half == 1) {
          const Geometry& own = geometry(b, r);
          const int64_t* anc = ap + (b * R + r) * W;
          for (int64_t w = std::max<int64_t>(0, own.first - lp[b]); w <= own.depth; ++w)
            slots[i].push_back(anc[w] - from);
        }
        const int64_t unit = (b * Hkv + kvh) * R + r;
        acc[i] = g.split == 0 ? accv.data() + i * group * nv : half_acc.data() + (unit * 2 + half) * group * nv;
      }
      const C* khead = kp + (b * Hkv + kvh) * S * D;              // [S / 16][D][16]
      const C* vbase = vp + ((b * Hkv + kvh) * Sv + from) * D;  // [Sv][D], from slot `from`
      attend_tile<G, C>(tile.nr, group, qrows.data(), D, khead, from, S, vbase, part_committed, slots, scale, softcap,
                        paired, scores, wpairs, acc, tops, sums);
      for (int i = 0; i < tile.nr; ++i) {
        const int64_t r = tile.r0 + i, unit = (b * Hkv + kvh) * R + r;
        if (g.split > 0) {
          split_rows[unit] = 1;
          for (int64_t j = 0; j < group; ++j) {
            half_top[(unit * 2 + half) * group + j] = tops[i * group + j];
            half_sum[(unit * 2 + half) * group + j] = sums[i * group + j];
          }
          continue;
        }
        for (int64_t j = 0; j < group; ++j) {
          T* o = op + ((b * R + r) * H + kvh * group + j) * D;
          const float sum = sums[i * group + j];
          for (int64_t v = 0; v < nv; ++v)
            for (int l = 0; l < kLanes; ++l) o[v * kLanes + l] = static_cast<T>(acc[i][j * nv + v][l] / sum);
        }
      }
    }
  });
  // Split rows: each half's weights are scaled to the larger of the two maxima, then summed.
  at::parallel_for(0, units, kMergeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      if (!split_rows[unit]) continue;
      const int64_t b = unit / (Hkv * R), kvh = (unit / R) % Hkv, r = unit % R;
      for (int64_t j = 0; j < group; ++j) {
        const float t0 = half_top[unit * 2 * group + j], t1 = half_top[(unit * 2 + 1) * group + j];
        const float top = t0 > t1 ? t0 : t1;
        vec16 x{};
        x[0] = t0 - top;
        x[1] = t1 - top;
        const vec16 f = softmax_exp(x);
        const float denom = half_sum[unit * 2 * group + j] * f[0] + half_sum[(unit * 2 + 1) * group + j] * f[1];
        const vec16* a0 = half_acc.data() + (unit * 2) * group * nv + j * nv;
        const vec16* a1 = half_acc.data() + (unit * 2 + 1) * group * nv + j * nv;
        T* o = op + ((b * R + r) * H + kvh * group + j) * D;
        for (int64_t i = 0; i < nv; ++i)
          for (int l = 0; l < kLanes; ++l)
            o[i * kLanes + l] = static_cast<T>((a0[i][l] * f[0] + a1[i][l] * f[1]) / denom);
      }
    }
  });
}

// A run<T, G, C> for the query heads per KV head (G: 1-4 at compile time, else 0).
template <typename T, typename C>
void run_by_group(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths,
                  const at::Tensor& ancestors, const at::Tensor& rows, float scale, int64_t window, float cap,
                  at::Tensor& out) {
  switch (q.size(1) / keys.size(1)) {
    case 1: run<T, 1, C>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    case 2: run<T, 2, C>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    case 3: run<T, 3, C>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    case 4: run<T, 4, C>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    default: run<T, 0, C>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
  }
}

// q: [B, H, R, D] (last dim contiguous), float32 or bfloat16; keys: [B, Hkv, S' / 16, D, 16]
// (tiles of 16 slots, S' >= S) and values: [B, Hkv, S, D], contiguous, of one dtype: float32,
// bfloat16, or float16 with a float32 q;
// lengths: [B] int64; ancestors: [B, R, W] int64
// cache slots (-1 past the row's depth); rows: [B] int64 real rows per sequence; window:
// keys per row under a sliding window (0: all); softcap: attention-logit soft cap (0: none).
// Returns [B, R, H, D] in q's dtype, accumulated in float32 (zeros past rows[b]).
at::Tensor tree_attention_exact(at::Tensor q, at::Tensor keys, at::Tensor values,
                                at::Tensor lengths, at::Tensor ancestors,
                                at::Tensor rows, double scaling, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 5 && values.dim() == 4, "rank mismatch");
  TORCH_CHECK(keys.size(4) == kLanes && keys.size(3) == q.size(3) && keys.size(2) * kLanes >= values.size(2),
              "keys must be [B, Hkv, S' / 16, D, 16] (S' >= S) for values [B, Hkv, S, D]");
  const at::ScalarType cache = keys.scalar_type();
  TORCH_CHECK(values.scalar_type() == cache && (cache == at::kFloat || cache == at::kBFloat16 || cache == at::kHalf),
              "the cache must be float32, bfloat16 or float16, keys and values alike");
  TORCH_CHECK(cache != at::kHalf || q.scalar_type() == at::kFloat, "a float16 cache takes a float32 q");
  TORCH_CHECK(q.stride(3) == 1, "q's last dim must be contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  for (const at::Tensor* t : {&lengths, &ancestors, &rows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "lengths, ancestors and rows: contiguous int64");
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const bool q32 = q.scalar_type() == at::kFloat;
  if (q32 && cache == at::kFloat)
    run_by_group<float, float>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out);
  else if (q32 && cache == at::kBFloat16)
    run_by_group<float, at::BFloat16>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out);
  else if (q32)
    run_by_group<float, at::Half>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out);
  else if (cache == at::kBFloat16)
    run_by_group<at::BFloat16, at::BFloat16>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out);
  else
    run_by_group<at::BFloat16, float>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out);
  return out;
}
