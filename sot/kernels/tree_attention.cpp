// Exact tree attention on the CPU.
//
// Every (sequence, head, row) is computed by the same instruction sequence over its keys in
// position order: the committed slots 0 .. length-1, then the row's ancestors (root first,
// itself last). Nothing depends on how many rows, trees or sequences share the call, so a
// tree row produces the same bits as plain decoding of the same token.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int64_t kMaxD = 256;
// 16 floats as one value; lane-wise arithmetic, so each lane's result depends on its own
// inputs only (GCC/Clang vector extension, lowered to the widest vectors available).
typedef float vec16 __attribute__((vector_size(64)));

// Dot product with kLanes fixed partial sums, reduced in a fixed order.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

}  // namespace

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

// The cache layout this kernel reads: keys [B, Hkv, D, S] (transposed, so that 16 keys fit
// one vector), values [B, Hkv, S, D], both float32. One task is one (sequence, KV head, row):
// the query heads sharing that KV head are processed together so each key is loaded once,
// but every head keeps its own accumulators and its own fixed order of operations.
// One 16-key block of scores for the query heads of one KV head: each lane sums
// q[d] * k[d] over d in order. G > 0 fixes the head count at compile time, so the
// accumulators stay in registers; G == 0 takes it from `group`. The operations are the same.
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

template <typename T, int G>
void run(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
         const torch::Tensor& lengths, const torch::Tensor& ancestors, const torch::Tensor& rows,
         float scale, int64_t window, float softcap, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), S = keys.size(3), W = ancestors.size(2);
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

  at::parallel_for(0, B * Hkv * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qrows(group * D);
    std::vector<int64_t> slots;
    std::vector<vec16> accv(group * nv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (Hkv * R), kvh = (task / R) % Hkv, r = task % R;
      if (r >= rp[b]) {
        for (int64_t j = 0; j < group; ++j) {
          T* o = op + ((b * R + r) * H + kvh * group + j) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = T(0.f);
        }
        continue;
      }
      for (int64_t j = 0; j < group; ++j) {
        const T* qsrc = qp + b * qs0 + (kvh * group + j) * qs1 + r * qs2;
        for (int64_t d = 0; d < D; ++d) qrows[j * D + d] = static_cast<float>(qsrc[d]);
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
      const float* kt = kp + (b * Hkv + kvh) * D * S + lo;      // [D][S], from slot lo
      const float* vbase = vp + ((b * Hkv + kvh) * S + lo) * D;  // [S][D], from slot lo
      const int64_t committed = lp[b] - lo;
      slots.clear();
      for (int64_t w = std::max<int64_t>(0, first - lp[b]); w <= depth; ++w) slots.push_back(anc[w] - lo);
      const int64_t total = committed + static_cast<int64_t>(slots.size());
      // Whole 16-key blocks over the committed keys; the last block may run into scratch
      // slots (finite values), whose scores are then overwritten by the scalar loop.
      int64_t blocks = (committed + kLanes - 1) / kLanes * kLanes;
      if (blocks > S - lo) blocks = committed / kLanes * kLanes;
      const int64_t stride = (std::max(total, blocks) + kLanes - 1) / kLanes * kLanes;
      scores.resize(group * stride);
      // Scores: each lane sums q[d] * k[d] over d in order, the same operations as the
      // scalar loop used for the rest.
      for (int64_t k0 = 0; k0 < blocks; k0 += kLanes)
        score_block<G>(group, qrows.data(), D, kt + k0, S, scale, scores.data() + k0, stride);
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
      if (softcap > 0.f)  // Gemma 2: cap * tanh(score / cap), before the softmax
        for (int64_t j = 0; j < group; ++j)
          for (int64_t k = 0; k < total; ++k) {
            float& s = scores[j * stride + k];
            s = std::tanh(s / softcap) * softcap;
          }
      float sums[kMaxGroup];
      for (int64_t j = 0; j < group; ++j) {
        float* sc = scores.data() + j * stride;
        float top = -INFINITY;
        for (int64_t k = 0; k < total; ++k) top = sc[k] > top ? sc[k] : top;
        for (int64_t k = total; k < stride; ++k) sc[k] = top;  // padding, zeroed below
        for (int64_t k = 0; k < stride; k += kLanes) {
          vec16 v;
          std::memcpy(&v, sc + k, sizeof(v));
          v = softmax_exp(v - top);  // now weights
          std::memcpy(sc + k, &v, sizeof(v));
        }
        for (int64_t k = total; k < stride; ++k) sc[k] = 0.f;
        float lanes[kLanes] = {0};
        int64_t k = 0;
        for (; k + kLanes <= total; k += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += sc[k + l];
        for (int l = 0; k < total; ++k, ++l) lanes[l] += sc[k];
        for (int w = kLanes / 2; w > 0; w /= 2)
          for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
        sums[j] = lanes[0];
      }
      for (int64_t i = 0; i < nv; ++i)
        weighted_values<G>(group, scores.data(), stride, vbase + i * kLanes, D, committed, slots.data(), total,
                           accv.data() + i, nv);
      for (int64_t j = 0; j < group; ++j) {
        T* o = op + ((b * R + r) * H + kvh * group + j) * D;
        for (int64_t i = 0; i < nv; ++i)
          for (int l = 0; l < kLanes; ++l) o[i * kLanes + l] = static_cast<T>(accv[j * nv + i][l] / sums[j]);
      }
    }
  });
}

// q: [B, H, R, D] (last dim contiguous), float32 or bfloat16; keys: [B, Hkv, D, S] and
// values: [B, Hkv, S, D], float32, contiguous; lengths: [B] int64; ancestors: [B, R, W] int64
// cache slots (-1 past the row's depth); rows: [B] int64 real rows per sequence; window:
// keys per row under a sliding window (0: all); softcap: attention-logit soft cap (0: none).
// Returns [B, R, H, D] in q's dtype, accumulated in float32 (zeros past rows[b]).
torch::Tensor tree_attention_exact(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor lengths, torch::Tensor ancestors,
                                   torch::Tensor rows, double scaling, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "rank mismatch");
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32,
              "the cache must be float32");
  TORCH_CHECK(q.stride(3) == 1, "q's last dim must be contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
  const bool f32 = q.scalar_type() == torch::kFloat32;
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

// RMSNorm of bfloat16 rows, Llama style: w * bf16(x * rsqrt(mean(x^2) + eps)), computed in
// float32 with a fixed reduction order. With ``residual`` given, x = bf16(x + residual) first
// and that sum is returned as well.
std::vector<torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps,
                                         c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "bfloat16 only");
  x = x.contiguous();
  const int64_t D = x.size(-1), N = x.numel() / D;
  torch::Tensor sum_out;
  const at::BFloat16* rp = nullptr;
  if (residual.has_value()) {
    auto res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes(), "residual shape mismatch");
    sum_out = torch::empty_like(x);
    rp = res.data_ptr<at::BFloat16>();
  }
  auto out = torch::empty_like(x);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::BFloat16* sp = sum_out.defined() ? sum_out.data_ptr<at::BFloat16>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t d = 0; d < D; ++d) {
        float v = static_cast<float>(xp[n * D + d]);
        if (rp) {
          const at::BFloat16 s = static_cast<at::BFloat16>(v + static_cast<float>(rp[n * D + d]));
          sp[n * D + d] = s;
          v = static_cast<float>(s);
        }
        row[d] = v;
      }
      const float ss = dot(row.data(), row.data(), D);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + feps);
      for (int64_t d = 0; d < D; ++d) {
        const float normed = static_cast<float>(static_cast<at::BFloat16>(row[d] * inv));
        op[n * D + d] = static_cast<at::BFloat16>(static_cast<float>(wp[d]) * normed);
      }
    }
  });
  if (sp) return {out, sum_out};
  return {out};
}

// RMSNorm of float32 rows: w * (x * (1 / sqrt(mean(x^2) + eps))), the operations of the
// transformers formula, with the sum of squares in a fixed order (``dot``). With ``residual``
// given, x = x + residual first and that sum is returned as well. One call replaces the
// half-dozen aten operations of the formula, whose per-call overhead dominated at a few rows.
std::vector<torch::Tensor> rms_norm_f32(torch::Tensor x, torch::Tensor weight, double eps,
                                        c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32 only");
  x = x.contiguous();
  const int64_t D = x.size(-1), N = x.numel() / D;
  TORCH_CHECK(weight.numel() == D, "weight size mismatch");
  torch::Tensor sum_out;
  const float* rp = nullptr;
  torch::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == torch::kFloat32, "residual shape mismatch");
    sum_out = torch::empty_like(x);
    rp = res.data_ptr<float>();
  }
  auto w = weight.contiguous();
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum_out.defined() ? sum_out.data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * D;
      if (rp) {
        float* s = sp + n * D;
        const float* r = rp + n * D;
        for (int64_t d = 0; d < D; ++d) s[d] = row[d] + r[d];
        row = s;
      }
      const float ss = dot(row, row, D);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + feps);
      float* o = op + n * D;
      for (int64_t d = 0; d < D; ++d) o[d] = wp[d] * (row[d] * inv);
    }
  });
  if (sp) return {out, sum_out};
  return {out};
}

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// Rotary embedding of q and k plus the KV-cache write, in one pass.
// qkv: [B, T, Hq + 2 Hkv, D] (q heads, k heads, v heads); cos, sin: [B, T, D];
// keys: [B, Hkv, D, S], values: [B, Hkv, S, D] (one layer of the float32 cache);
// slots: [B, T] cache slot per row.
// Returns q: [B, Hq, T, D]. Every operation rounds to the model dtype exactly as the
// transformers formula q * cos + rotate_half(q) * sin does, so the bits are the same.
template <typename T>
void rope_write_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& slots,
                     int64_t hq, torch::Tensor& q_out) {
  const int64_t B = qkv.size(0), Tn = qkv.size(1), Hall = qkv.size(2), D = qkv.size(3);
  const int64_t hkv = (Hall - hq) / 2, S = keys.size(3), half = D / 2;
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  T* qp = q_out.data_ptr<T>();
  at::parallel_for(0, B * Tn, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / Tn, t = bt % Tn;
      const T* c = cp + bt * D;
      const T* s = sp + bt * D;
      const int64_t where = slot[bt];
      for (int64_t h = 0; h < hq + hkv; ++h) {
        const T* x = src + (bt * Hall + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
          const T rot_t = round_to<T>(rot);
          const T a = round_to<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
          const T bb = round_to<T>(static_cast<float>(rot_t) * static_cast<float>(s[d]));
          const T value = round_to<T>(static_cast<float>(a) + static_cast<float>(bb));
          if (h < hq) {
            qp[((b * hq + h) * Tn + t) * D + d] = value;
          } else {
            kp[((b * hkv + (h - hq)) * D + d) * S + where] = static_cast<float>(value);
          }
        }
      }
      for (int64_t h = 0; h < hkv; ++h) {
        const T* x = src + (bt * Hall + hq + hkv + h) * D;
        float* dst = vp + ((b * hkv + h) * S + where) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(x[d]);
      }
    }
  });
}

torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                         torch::Tensor values, torch::Tensor slots, int64_t hq) {
  TORCH_CHECK(qkv.dim() == 4 && cos.dim() == 3 && keys.dim() == 4, "rank mismatch");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && cos.scalar_type() == qkv.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slots.numel() == 0 || slots.max().item<int64_t>() < keys.size(3), "cache slot out of range");
  auto q = torch::empty({qkv.size(0), hq, qkv.size(1), qkv.size(3)}, qkv.options());
  if (qkv.scalar_type() == torch::kFloat32) {
    rope_write_impl<float>(qkv, cos, sin, keys, values, slots, hq, q);
  } else if (qkv.scalar_type() == torch::kBFloat16) {
    rope_write_impl<at::BFloat16>(qkv, cos, sin, keys, values, slots, hq, q);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
  }
  return q;
}

// Row-stable float32 linear layer: y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]).
//
// Weights are packed once into panels of 16 output columns, [P, K, 16] (pack with
// sot.models.fast_llama.pack_panels). Every output is one fused multiply-add chain over
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

template <int MR, int NP>
inline void linear_tile(const float* x, int64_t K, const float* panel, float* out) {
  __m256 acc[MR][NP][2];
  zero_tile<MR, NP>(acc);
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    // With 3 or more rows the tile is compute-bound: fetch the next panel meanwhile.
    if (NP == 1) _mm_prefetch(reinterpret_cast<const char*>(panel + stride + k * kPanel), _MM_HINT_T0);
    __m256 w[NP][2];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      w[j][0] = _mm256_loadu_ps(panel + j * stride + k * kPanel);
      w[j][1] = _mm256_loadu_ps(panel + j * stride + k * kPanel + 8);
    }
    fma_step<MR, NP>(acc, w, x, K, k);
  }
  store_acc<MR, NP>(acc, out);
}
#else
template <int MR, int NP>
inline void linear_tile(const float* x, int64_t K, const float* panel, float* out) {
  float acc[MR][NP][kPanel] = {};
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NP; ++j)
        for (int64_t c = 0; c < kPanel; ++c)
          acc[i][j][c] = std::fma(x[i * K + k], panel[j * stride + k * kPanel + c], acc[i][j][c]);
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
template <int MR, int NP>
inline void linear_block(const float* x, int64_t K, const float* panel, int64_t p, int64_t N,
                         const float* bias, float* y) {
  float tile[MR * NP * kPanel];
  linear_tile<MR, NP>(x, K, panel, tile);
  store_tile<MR, NP>(tile, p, N, bias, y);
}

template <int NP>
inline void linear_rows(int64_t rows, const float* x, int64_t K, const float* packed, int64_t p, int64_t N,
                        const float* bias, float* y) {
  switch (rows) {
    case 1: linear_block<1, NP>(x, K, packed, p, N, bias, y); break;
    case 2: linear_block<2, NP>(x, K, packed, p, N, bias, y); break;
    case 3: linear_block<3, NP>(x, K, packed, p, N, bias, y); break;
    case 4: linear_block<4, NP>(x, K, packed, p, N, bias, y); break;
    case 5: linear_block<5, NP>(x, K, packed, p, N, bias, y); break;
    default: linear_block<kMaxRows, NP>(x, K, packed, p, N, bias, y); break;
  }
}

}  // namespace

// The input made contiguous, the output [M, N] and the bias (float32, or null) of a product.
struct LinearIO {
  torch::Tensor x, y, b;
  const float* xp;
  float* yp;
  const float* bp = nullptr;
  LinearIO(const torch::Tensor& input, int64_t N, const c10::optional<torch::Tensor>& bias)
      : x(input.contiguous()), y(torch::empty({input.size(0), N}, input.options())) {
    if (bias.has_value() && bias->defined()) {
      b = bias->to(torch::kFloat32).contiguous();
      TORCH_CHECK(b.numel() == N, "bias size mismatch");
      bp = b.data_ptr<float>();
    }
    xp = x.data_ptr<float>();
    yp = y.data_ptr<float>();
  }
};

// The product over every panel, two threads or more splitting the panels. `panel_at(p, np,
// scratch)` returns np consecutive panels starting at panel p, [np][K][16] floats, either in
// place or decoded into `scratch` (room for two panels).
template <typename PanelAt>
torch::Tensor linear_panels(torch::Tensor x, int64_t P, int64_t N, const c10::optional<torch::Tensor>& bias,
                            PanelAt panel_at) {
  LinearIO io(x, N, bias);
  const int64_t M = io.x.size(0), K = io.x.size(1);
  const float *xp = io.xp, *bp = io.bp;
  float* yp = io.yp;
  const int64_t np = M <= 2 ? 2 : 1;
  at::parallel_for(0, (P + np - 1) / np, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t * np;
      const bool pair = np == 2 && p + 1 < P;
      const float* panel = panel_at(p, pair ? 2 : 1, scratch);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        if (pair) {
          linear_rows<2>(rows, xp + m0 * K, K, panel, p, N, bp, yp + m0 * N);
        } else {
          linear_rows<1>(rows, xp + m0 * K, K, panel, p, N, bp, yp + m0 * N);
        }
      }
    }
  });
  return io.y;
}

// x: [M, K] float32; packed: [P, K, 16] with P * 16 >= N; bias: [N] or None. Returns [M, N].
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
              packed.scalar_type() == torch::kFloat32 && packed.is_contiguous(), "packed weight mismatch");
  TORCH_CHECK(packed.size(0) * kPanel >= N, "N exceeds the packed weight");
  const float* pp = packed.data_ptr<float>();
  const int64_t K = x.size(1);
  return linear_panels(x, packed.size(0), N, bias,
                       [&](int64_t p, int64_t, std::vector<float>&) { return pp + p * K * kPanel; });
}

// Float32 weights stored exactly as 4-bit or 8-bit blocks of 32 inputs (the GGUF Q4_1 and
// Q8_0 layouts, whose float32 dequantization is w = d * q + m, resp. w = d * q, rounded after
// each operation). A panel is decoded into float32 right before use, so the products are
// bit-identical to linear_f32 on the float32 weights, with a quarter to an eighth of the
// memory traffic. Layouts per panel p and block kb (K / 32 blocks):
//   q4: data [P, K/32, 32, 8] uint8, byte j of input k = column j (low nibble) and column
//       j + 8 (high nibble); scale, min [P, K/32, 16] float32;
//   q8: data [P, K/32, 32, 16] int8; scale [P, K/32, 16] float32; min empty.
#if defined(__AVX2__) && defined(__FMA__)
// The 16 weights of input k of one panel (``q``: its bytes; ``d``, ``m``: its block's 16
// scales and mins) as w[0] (columns 0-7) and w[1] (columns 8-15). For 4-bit blocks d * q is
// exact in float32 (d is a float16 value, 11 significant bits, and q < 16), so one fused
// multiply-add rounds exactly as the multiply, then add, of the format.
template <bool Q4>
__attribute__((always_inline)) inline void decode16(const uint8_t* q, const float* d, const float* m, __m256 (&w)[2]) {
  if (Q4) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    w[0] = _mm256_fmadd_ps(_mm256_loadu_ps(d), lo, _mm256_loadu_ps(m));
    w[1] = _mm256_fmadd_ps(_mm256_loadu_ps(d + 8), hi, _mm256_loadu_ps(m + 8));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    w[0] = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    w[1] = _mm256_mul_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
  }
}
#endif

inline void decode_panel(int bits, const uint8_t* data, const float* scale, const float* mins, int64_t K,
                         float* out) {
  const int64_t blocks = K / 32;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const float* d = scale + kb * kPanel;
    const float* m = mins ? mins + kb * kPanel : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t k = kb * 32; k < kb * 32 + 32; ++k) {
      __m256 w[2];
      if (bits == 4) {
        decode16<true>(data + k * 8, d, m, w);
      } else {
        decode16<false>(data + k * 16, d, m, w);
      }
      _mm256_storeu_ps(out + k * kPanel, w[0]);
      _mm256_storeu_ps(out + k * kPanel + 8, w[1]);
    }
#else
    for (int64_t k = 0; k < 32; ++k) {
      float* o = out + (kb * 32 + k) * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        if (bits == 4) {
          const uint8_t byte = data[(kb * 32 + k) * 8 + c % 8];
          const float q = static_cast<float>(c < 8 ? byte & 15 : byte >> 4);
          o[c] = d[c] * q + m[c];
        } else {
          o[c] = d[c] * static_cast<float>(reinterpret_cast<const int8_t*>(data)[(kb * 32 + k) * 16 + c]);
        }
      }
    }
#endif
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// MR rows over NP panels of blocks, each weight decoded in registers right before its
// multiply-add (no float32 copy of the panel): the decode (decode16) and the FMA chain over k
// are those of decode_panel + linear_tile, so the bits are the same. For the 1-6 row
// products of plain decoding and small trees, where decoding, not arithmetic, bounds the time.
template <int MR, int NP, bool Q4>
inline void fused_block_tile(const float* x, int64_t K, const uint8_t* data, int64_t bytes, const float* scale,
                             const float* mins, int64_t per, float* out) {
  __m256 acc[MR][NP][2];
  zero_tile<MR, NP>(acc);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    for (int64_t k = kb * 32; k < kb * 32 + 32; ++k) {
      __m256 w[NP][2];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j)
        decode16<Q4>(data + j * bytes + k * (Q4 ? 8 : 16), scale + j * per + kb * kPanel,
                     Q4 ? mins + j * per + kb * kPanel : nullptr, w[j]);
      fma_step<MR, NP>(acc, w, x, K, k);
    }
  }
  store_acc<MR, NP>(acc, out);
}

// All M = MR rows over every panel: pairs of panels (32 columns, more independent FMA chains)
// for 1-2 rows, single panels for 3-6 rows (their accumulators fill the registers).
template <int MR, bool Q4>
void fused_block_rows(const float* x, int64_t K, int64_t P, int64_t N, const uint8_t* data, int64_t bytes,
                      const float* scale, const float* mins, int64_t per, const float* bias, float* y) {
  constexpr int64_t NP = MR <= 2 ? 2 : 1;
  at::parallel_for(0, (P + NP - 1) / NP, 1, [&](int64_t begin, int64_t end) {
    float tile[MR * 2 * kPanel];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = NP * t;
      const uint8_t* dp = data + p * bytes;
      const float* sp = scale + p * per;
      const float* mp = Q4 ? mins + p * per : nullptr;
      if (NP == 2 && p + 1 < P) {
        fused_block_tile<MR, 2, Q4>(x, K, dp, bytes, sp, mp, per, tile);
        store_tile<MR, 2>(tile, p, N, bias, y);
      } else {
        fused_block_tile<MR, 1, Q4>(x, K, dp, bytes, sp, mp, per, tile);
        store_tile<MR, 1>(tile, p, N, bias, y);
      }
    }
  });
}

// More than kMaxRows rows: each panel is decoded once, 32 inputs at a time, into a float32
// block that stays in L1, and the rows, in near-equal groups of at most kMaxRows (8 rows as
// 4 + 4), take their multiply-adds from it; a group's accumulators go back to memory between
// blocks (exact: float32 stores). Each output is still one FMA chain over k in order, so the
// bits equal linear_f32's.

// acc [MR][16] (in memory) += x [MR rows, 32 inputs from x] times w [32][16] (decoded, in L1).
template <int MR>
inline void chunk_tile(const float* x, int64_t K, const float* w, float* acc) {
  __m256 a[MR][1][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    a[i][0][0] = _mm256_loadu_ps(acc + i * kPanel);
    a[i][0][1] = _mm256_loadu_ps(acc + i * kPanel + 8);
  }
  for (int64_t k = 0; k < 32; ++k) {
    const __m256 wv[1][2] = {{_mm256_loadu_ps(w + k * kPanel), _mm256_loadu_ps(w + k * kPanel + 8)}};
    fma_step<MR, 1>(a, wv, x, K, k);
  }
  store_acc<MR, 1>(a, acc);
}

template <bool Q4>
void chunked_block_rows(const float* x, int64_t M, int64_t K, int64_t P, int64_t N, const uint8_t* data,
                        int64_t bytes, const float* scale, const float* mins, int64_t per, const float* bias,
                        float* y) {
  const int64_t groups = (M + kMaxRows - 1) / kMaxRows, base = M / groups, extra = M % groups;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kPanel);
    alignas(32) float w[32 * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* dp = data + p * bytes;
      const float* sp = scale + p * per;
      const float* mp = Q4 ? mins + p * per : nullptr;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        decode_panel(Q4 ? 4 : 8, dp + kb * 32 * (Q4 ? 8 : 16), sp + kb * kPanel, Q4 ? mp + kb * kPanel : nullptr,
                     32, w);  // this block of 32 inputs
        for (int64_t g = 0, m0 = 0; g < groups; ++g) {
          const int64_t rows = base + (g < extra ? 1 : 0);
          const float* xg = x + m0 * K + kb * 32;
          float* ag = acc.data() + m0 * kPanel;
          switch (rows) {
            case 1: chunk_tile<1>(xg, K, w, ag); break;
            case 2: chunk_tile<2>(xg, K, w, ag); break;
            case 3: chunk_tile<3>(xg, K, w, ag); break;
            case 4: chunk_tile<4>(xg, K, w, ag); break;
            case 5: chunk_tile<5>(xg, K, w, ag); break;
            default: chunk_tile<kMaxRows>(xg, K, w, ag); break;
          }
          m0 += rows;
        }
      }
      for (int64_t i = 0; i < M; ++i) store_tile<1, 1>(acc.data() + i * kPanel, p, N, bias, y + i * N);
    }
  });
}

#endif

// fused = false decodes every product through a float32 panel copy (for comparison).
torch::Tensor linear_blocks_f32(torch::Tensor x, torch::Tensor data, torch::Tensor scale, torch::Tensor mins,
                                int64_t N, c10::optional<torch::Tensor> bias, bool fused) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  const int64_t K = x.size(1), P = data.size(0);
  const bool q4 = data.scalar_type() == torch::kUInt8;
  TORCH_CHECK(data.dim() == 4 && K % 32 == 0 && data.size(1) == K / 32 && data.size(2) == 32 &&
              data.size(3) == (q4 ? 8 : 16) && (q4 || data.scalar_type() == torch::kInt8) && data.is_contiguous(),
              "packed weight mismatch");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == P * (K / 32) * kPanel,
              "packed weight mismatch");
  TORCH_CHECK(!q4 || (mins.scalar_type() == torch::kFloat32 && mins.is_contiguous() && mins.numel() == scale.numel()),
              "packed weight mismatch");
  TORCH_CHECK(P * kPanel >= N, "N exceeds the packed weight");
  const uint8_t* dp = reinterpret_cast<const uint8_t*>(data.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* mp = q4 ? mins.data_ptr<float>() : nullptr;
  const int64_t bytes = K * (q4 ? 8 : 16), per = (K / 32) * kPanel;
#if defined(__AVX2__) && defined(__FMA__)
  // (Measured, scripts/linear_bench.py, against a float32 copy of each decoded panel shared by
  // the row tiles: 1.4x faster at 1 and at 8 rows, 1.1x at 16 and at 32 rows.)
  if (fused) {
    LinearIO io(x, N, bias);
    const float *xp = io.xp, *bp = io.bp;
    float* yp = io.yp;
#define SOT_FUSED(R) (q4 ? fused_block_rows<R, true>(xp, K, P, N, dp, bytes, sp, mp, per, bp, yp) \
                         : fused_block_rows<R, false>(xp, K, P, N, dp, bytes, sp, mp, per, bp, yp))
    switch (io.x.size(0)) {
      case 1: SOT_FUSED(1); break;
      case 2: SOT_FUSED(2); break;
      case 3: SOT_FUSED(3); break;
      case 4: SOT_FUSED(4); break;
      case 5: SOT_FUSED(5); break;
      case 6: SOT_FUSED(6); break;
      case 0: break;
      default:
        q4 ? chunked_block_rows<true>(xp, io.x.size(0), K, P, N, dp, bytes, sp, mp, per, bp, yp)
           : chunked_block_rows<false>(xp, io.x.size(0), K, P, N, dp, bytes, sp, mp, per, bp, yp);
    }
#undef SOT_FUSED
    return io.y;
  }
#endif
  return linear_panels(x, P, N, bias, [&](int64_t p, int64_t count, std::vector<float>& scratch) {
    scratch.resize(2 * K * kPanel);
    for (int64_t j = 0; j < count; ++j)
      decode_panel(q4 ? 4 : 8, dp + (p + j) * bytes, sp + (p + j) * per, mp ? mp + (p + j) * per : nullptr, K,
                   scratch.data() + j * K * kPanel);
    return static_cast<const float*>(scratch.data());
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write", &rope_write, "rotary embedding of q/k and KV-cache write");
  m.def("tree_attention_exact", &tree_attention_exact, "exact CPU tree attention");
  m.def("rms_norm_bf16", &rms_norm_bf16, "fused bfloat16 RMSNorm (optionally after a residual add)");
  m.def("rms_norm_f32", &rms_norm_f32, "fused float32 RMSNorm (optionally after a residual add)");
  m.def("linear_f32", &linear_f32, "row-stable float32 linear layer on panel-packed weights");
  m.def("linear_blocks_f32", &linear_blocks_f32, "linear_f32 on float32 weights stored as exact 4/8-bit blocks");
}
