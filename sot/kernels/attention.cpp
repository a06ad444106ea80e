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

#if defined(__AVX2__)
// softmax_exp on 8 lanes in AVX2 registers: the same operations in the same order (GCC lowers
// the 16-lane version above poorly on AVX2; measured at about a third of a 16-row tree's
// attention time).
inline __m256 softmax_exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // x < -87 ? -87 : x (NaN stays)
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 half = _mm256_blendv_ps(_mm256_set1_ps(0.5f), _mm256_set1_ps(-0.5f),
                                       _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_LT_OQ));
  const __m256i ni = _mm256_cvttps_epi32(_mm256_add_ps(t, half));
  const __m256 n = _mm256_cvtepi32_ps(ni);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

constexpr int64_t kMaxGroup = 16;

// The cache layout this kernel reads: keys [B, Hkv, D, S] (transposed, so that 16 keys fit
// one vector), values [B, Hkv, S, D], both float32. One task is one (sequence, KV head, row):
// the query heads sharing that KV head are processed together so each key is loaded once,
// but every head keeps its own accumulators and its own fixed order of operations.
// One 16-key block of scores for the query heads of one KV head: each lane sums
// q[d] * k[d] over d in order. G > 0 fixes the head count at compile time, so the
// accumulators stay in registers; G == 0 takes it from `group`. The operations are the same.
// Keys ahead of the block being scored whose lines are prefetched (8 blocks of 16).
constexpr int64_t kPrefetchKeys = 128;

template <int G>
inline void score_block(int64_t group, const float* qrows, int64_t D, const float* kt, int64_t S, float scale,
                        float* scores, int64_t stride) {
#if defined(__AVX2__)
  if constexpr (G > 0) {  // the same multiply, then add, per lane, in AVX2 registers
    __m256 lo[G], hi[G];
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 c0 = _mm256_loadu_ps(kt + d * S), c1 = _mm256_loadu_ps(kt + d * S + 8);
      // The head dim's rows are S slots apart: too many streams for the hardware prefetcher,
      // so each row's line of a block a few blocks ahead is asked for now (no effect on the
      // arithmetic; past the cache's end it is a hint, never a fault).
      _mm_prefetch(reinterpret_cast<const char*>(kt + d * S + kPrefetchKeys), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) {
        const __m256 qd = _mm256_set1_ps(qrows[j * D + d]);
        lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(qd, c0));
        hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(qd, c1));
      }
    }
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      _mm256_storeu_ps(scores + j * stride, _mm256_mul_ps(lo[j], sc));
      _mm256_storeu_ps(scores + j * stride + 8, _mm256_mul_ps(hi[j], sc));
    }
    return;
  }
#endif
  const int64_t g = G > 0 ? G : group;
  vec16 lane[G > 0 ? G : kMaxGroup];
  for (int64_t j = 0; j < g; ++j) lane[j] = vec16{};
  for (int64_t d = 0; d < D; ++d) {
    vec16 col;
    std::memcpy(&col, kt + d * S, sizeof(col));
    for (int64_t j = 0; j < g; ++j) lane[j] += qrows[j * D + d] * col;
  }
  for (int64_t j = 0; j < g; ++j) {
    lane[j] *= scale;
    std::memcpy(scores + j * stride, &lane[j], sizeof(vec16));
  }
}

// 16 lanes of the weighted value sum for each query head: acc[j * nv] += w[j][k] * v[k]
// over the keys k in order (committed slots, then the row's ancestors).
template <int G>
inline void weighted_values(int64_t group, const float* weights, int64_t stride, const float* vbase, int64_t D,
                            int64_t committed, const int64_t* slots, int64_t total, vec16* acc, int64_t nv) {
#if defined(__AVX2__)
  if constexpr (G > 0) {
    __m256 lo[G], hi[G];
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < total; ++k) {
      const float* v = vbase + (k < committed ? k : slots[k - committed]) * D;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) {
        const __m256 w = _mm256_set1_ps(weights[j * stride + k]);
        lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(w, v0));
        hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(w, v1));
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      _mm256_storeu_ps(reinterpret_cast<float*>(acc + j * nv), lo[j]);
      _mm256_storeu_ps(reinterpret_cast<float*>(acc + j * nv) + 8, hi[j]);
    }
    return;
  }
#endif
  const int64_t g = G > 0 ? G : group;
  vec16 lane[G > 0 ? G : kMaxGroup];
  for (int64_t j = 0; j < g; ++j) lane[j] = vec16{};
  for (int64_t k = 0; k < total; ++k) {
    const int64_t slot = k < committed ? k : slots[k - committed];
    vec16 vv;
    std::memcpy(&vv, vbase + slot * D, sizeof(vv));
    for (int64_t j = 0; j < g; ++j) lane[j] += weights[j * stride + k] * vv;
  }
  for (int64_t j = 0; j < g; ++j) acc[j * nv] = lane[j];
}

// A row with at least this many keys is attended as two halves, split at a point its own
// position fixes (so a tree row and plain decoding split alike), and the halves' softmaxes are
// merged by a fixed formula: a one-row pass then spreads its KV heads' halves over the threads
// instead of leaving a thread with one head more than another.
constexpr int64_t kSplitKeys = 256;

// One row's attention over its keys from slot `lo`: the `committed` slots from there, then
// its ancestors at `slots` (relative to `lo`). Leaves, per query head j, the weighted value sums
// in acc[j * nv ...], the largest score in tops[j] and the sum of the weights in sums[j].
template <int G>
void attend_part(int64_t group, const float* qrows, int64_t D, const float* kt, int64_t S, int64_t room,
                 const float* vbase, int64_t committed, const std::vector<int64_t>& slots, float scale,
                 float softcap, std::vector<float>& scores, vec16* accv, float* tops, float* sums) {
  const int64_t nv = D / kLanes;
  const int64_t total = committed + static_cast<int64_t>(slots.size());
  // Scores in whole 16-key blocks from slot lo: over the committed slots and on through the
  // scratch slots up to the row's own, whose ancestors' scores are then moved behind the
  // committed ones. Each lane sums q[d] * k[d] over d in order, the same operations as the
  // scalar loops, which take whatever the blocks cannot reach (the end of the cache).
  const int64_t reach = slots.empty() ? committed : slots.back() + 1;
  int64_t blocks = (reach + kLanes - 1) / kLanes * kLanes;
  const bool tail_in_blocks = blocks <= room;
  if (!tail_in_blocks) {
    blocks = (committed + kLanes - 1) / kLanes * kLanes;
    if (blocks > room) blocks = committed / kLanes * kLanes;
  }
  const int64_t stride = (std::max(total, blocks) + kLanes - 1) / kLanes * kLanes;
  scores.resize(group * stride);
  for (int64_t k0 = 0; k0 < blocks; k0 += kLanes)
    score_block<G>(group, qrows, D, kt + k0, S, scale, scores.data() + k0, stride);
  if (tail_in_blocks) {
    // An ancestor's slot is at or past its place in the row's key order, and later
    // ancestors sit at later slots: moving them in order overwrites nothing still needed.
    for (int64_t j = 0; j < group; ++j)
      for (int64_t k = committed; k < total; ++k)
        scores[j * stride + k] = scores[j * stride + slots[k - committed]];
  } else {
    for (int64_t k = committed; k < total; ++k) {
      const int64_t slot = slots[k - committed];
      for (int64_t j = 0; j < group; ++j) {
        float sc = 0.f;
        for (int64_t d = 0; d < D; ++d) sc += qrows[j * D + d] * kt[d * S + slot];
        scores[j * stride + k] = sc * scale;
      }
    }
    for (int64_t k = std::min(blocks, committed); k < committed; ++k) {  // committed tail
      for (int64_t j = 0; j < group; ++j) {
        float sc = 0.f;
        for (int64_t d = 0; d < D; ++d) sc += qrows[j * D + d] * kt[d * S + k];
        scores[j * stride + k] = sc * scale;
      }
    }
  }
  if (softcap > 0.f)  // Gemma 2: cap * tanh(score / cap), before the softmax
    for (int64_t j = 0; j < group; ++j)
      for (int64_t k = 0; k < total; ++k) {
        float& s = scores[j * stride + k];
        s = std::tanh(s / softcap) * softcap;
      }
  for (int64_t j = 0; j < group; ++j) {
    float* sc = scores.data() + j * stride;
    float top = -INFINITY;
    for (int64_t k = 0; k < total; ++k) top = sc[k] > top ? sc[k] : top;
    for (int64_t k = total; k < stride; ++k) sc[k] = top;  // padding, zeroed below
#if defined(__AVX2__)
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
    float lanes[kLanes] = {0};
    int64_t k = 0;
    for (; k + kLanes <= total; k += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += sc[k + l];
    for (int l = 0; k < total; ++k, ++l) lanes[l] += sc[k];
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    sums[j] = lanes[0];
    tops[j] = top;
  }
  for (int64_t i = 0; i < nv; ++i)
    weighted_values<G>(group, scores.data(), stride, vbase + i * kLanes, D, committed, slots.data(), total,
                       accv + i, nv);
}

template <typename T, int G>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
         const at::Tensor& lengths, const at::Tensor& ancestors, const at::Tensor& rows,
         float scale, int64_t window, float softcap, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  // S: the keys' slot stride (it may exceed the values' slots: padding, never read as a key)
  const int64_t Hkv = keys.size(1), S = keys.size(3), Sv = values.size(2), W = ancestors.size(2);
  const int64_t group = H / Hkv;
  TORCH_CHECK(group <= kMaxGroup, "too many query heads per KV head");
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxD, "head dim must be a multiple of 16, at most 256");
  const int64_t nv = D / kLanes;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const T* qp = q.data_ptr<T>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* ap = ancestors.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // the halves of split rows: weighted value sums, largest scores and weight sums per head
  const int64_t units = B * Hkv * R;
  std::vector<vec16> half_acc(units * 2 * group * nv);
  std::vector<float> half_top(units * 2 * group), half_sum(units * 2 * group);
  std::vector<char> split_rows(units, 0);

  // One task is one half of one (sequence, KV head, row); a row that is not split is all
  // in its first half's task.
  at::parallel_for(0, units * 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qrows(group * D);
    std::vector<int64_t> slots;
    std::vector<vec16> accv(group * nv);
    float tops[kMaxGroup], sums[kMaxGroup];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t unit = task / 2, half = task % 2;
      const int64_t b = unit / (Hkv * R), kvh = (unit / R) % Hkv, r = unit % R;
      if (r >= rp[b]) {
        if (half == 0)
          for (int64_t j = 0; j < group; ++j) {
            T* o = op + ((b * R + r) * H + kvh * group + j) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = T(0.f);
          }
        continue;
      }
      const int64_t* anc = ap + (b * R + r) * W;
      int64_t depth = -1;
      while (depth + 1 < W && anc[depth + 1] >= 0) ++depth;
      // The row sits at position lp[b] + depth. With a sliding window it sees the keys at
      // positions first .. position only: the window's first key depends on the row's own
      // position, so a tree row and plain decoding of the same token see the same keys.
      // Keys are then counted from `first` (k = 0 is position first) on both paths.
      const int64_t position = lp[b] + depth;
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      const int64_t lo = std::min(first, lp[b]);  // first committed slot read
      const int64_t committed = lp[b] - lo;
      const int64_t total = committed + depth + 1 - std::max<int64_t>(0, first - lp[b]);
      // the split: a whole number of 16-key blocks, among the committed keys
      int64_t split = total >= kSplitKeys ? total / 2 / kLanes * kLanes : 0;
      if (split > committed) split = 0;  // (never, with trees of at most 64 levels: a guard)
      if (half == 1 && split == 0) continue;
      for (int64_t j = 0; j < group; ++j) {
        const T* qsrc = qp + b * qs0 + (kvh * group + j) * qs1 + r * qs2;
        for (int64_t d = 0; d < D; ++d) qrows[j * D + d] = static_cast<float>(qsrc[d]);
      }
      const int64_t from = lo + (half == 1 ? split : 0);  // this part's first slot
      slots.clear();
      if (split == 0 || half == 1)
        for (int64_t w = std::max<int64_t>(0, first - lp[b]); w <= depth; ++w) slots.push_back(anc[w] - from);
      const int64_t part_committed = split == 0 ? committed : (half == 0 ? split : committed - split);
      const float* kt = kp + (b * Hkv + kvh) * D * S + from;      // [D][S], from slot `from`
      const float* vbase = vp + ((b * Hkv + kvh) * Sv + from) * D;  // [Sv][D], from slot `from`
      vec16* acc = split == 0 ? accv.data() : half_acc.data() + (unit * 2 + half) * group * nv;
      attend_part<G>(group, qrows.data(), D, kt, S, S - from, vbase, part_committed, slots, scale, softcap,
                     scores, acc, tops, sums);
      if (split > 0) {
        split_rows[unit] = 1;
        for (int64_t j = 0; j < group; ++j) {
          half_top[(unit * 2 + half) * group + j] = tops[j];
          half_sum[(unit * 2 + half) * group + j] = sums[j];
        }
        continue;
      }
      for (int64_t j = 0; j < group; ++j) {
        T* o = op + ((b * R + r) * H + kvh * group + j) * D;
        for (int64_t i = 0; i < nv; ++i)
          for (int l = 0; l < kLanes; ++l) o[i * kLanes + l] = static_cast<T>(accv[j * nv + i][l] / sums[j]);
      }
    }
  });
  // Split rows: each half's weights are scaled to the larger of the two maxima, then summed.
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
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

// q: [B, H, R, D] (last dim contiguous), float32 or bfloat16; keys: [B, Hkv, D, S'] and
// values: [B, Hkv, S, D], float32, contiguous (S' >= S); lengths: [B] int64; ancestors: [B, R, W] int64
// cache slots (-1 past the row's depth); rows: [B] int64 real rows per sequence; window:
// keys per row under a sliding window (0: all); softcap: attention-logit soft cap (0: none).
// Returns [B, R, H, D] in q's dtype, accumulated in float32 (zeros past rows[b]).
at::Tensor tree_attention_exact(at::Tensor q, at::Tensor keys, at::Tensor values,
                                at::Tensor lengths, at::Tensor ancestors,
                                at::Tensor rows, double scaling, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "rank mismatch");
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "the cache must be float32");
  TORCH_CHECK(q.stride(3) == 1, "q's last dim must be contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const bool f32 = q.scalar_type() == at::kFloat;
  switch (q.size(1) / keys.size(1)) {  // query heads per KV head
    case 1: f32 ? run<float, 1>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out)
                : run<at::BFloat16, 1>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    case 2: f32 ? run<float, 2>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out)
                : run<at::BFloat16, 2>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    case 3: f32 ? run<float, 3>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out)
                : run<at::BFloat16, 3>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    case 4: f32 ? run<float, 4>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out)
                : run<at::BFloat16, 4>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
    default: f32 ? run<float, 0>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out)
                 : run<at::BFloat16, 0>(q, keys, values, lengths, ancestors, rows, scale, window, cap, out); break;
  }
  return out;
}
