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

namespace {

constexpr int kLanes = 16;

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

// exp for the softmax: range reduction plus a degree-6 polynomial, written as plain float
// arithmetic so that the compiler vectorises it; every element takes the same path.
inline float softmax_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The cache layout this kernel reads: keys [B, Hkv, D, S] (transposed, so that 16 keys fit
// one vector), values [B, Hkv, S, D], both float32.
template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
         const torch::Tensor& lengths, const torch::Tensor& ancestors, const torch::Tensor& rows,
         float scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), S = keys.size(3), W = ancestors.size(2);
  const int64_t group = H / Hkv;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const T* qp = q.data_ptr<T>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* ap = ancestors.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  at::parallel_for(0, B * H * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, weights, qrow(D), acc(D);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (H * R), h = (task / R) % H, r = task % R;
      T* o = op + ((b * R + r) * H + h) * D;
      if (r >= rp[b]) {
        for (int64_t d = 0; d < D; ++d) o[d] = T(0.f);
        continue;
      }
      const int64_t kvh = h / group;
      const float* kt = kp + (b * Hkv + kvh) * D * S;  // [D][S]
      const float* vbase = vp + (b * Hkv + kvh) * S * D;  // [S][D]
      const T* qsrc = qp + b * qs0 + h * qs1 + r * qs2;
      for (int64_t d = 0; d < D; ++d) qrow[d] = static_cast<float>(qsrc[d]);
      const int64_t committed = lp[b];
      const int64_t* anc = ap + (b * R + r) * W;
      slots.clear();
      for (int64_t w = 0; w < W && anc[w] >= 0; ++w) slots.push_back(anc[w]);
      const int64_t total = committed + static_cast<int64_t>(slots.size());
      const int64_t blocks = committed / kLanes * kLanes;
      scores.resize(total);
      weights.resize(total);
      // Scores of committed keys, 16 keys per vector; each lane sums q[d] * k[d] over d in
      // order, exactly the operations of the scalar loops below.
      for (int64_t k0 = 0; k0 < blocks; k0 += kLanes) {
        float lane[kLanes] = {0};
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qrow[d];
          const float* col = kt + d * S + k0;
          for (int l = 0; l < kLanes; ++l) lane[l] += qd * col[l];
        }
        for (int l = 0; l < kLanes; ++l) scores[k0 + l] = lane[l] * scale;
      }
      for (int64_t k = blocks; k < total; ++k) {
        const int64_t slot = k < committed ? k : slots[k - committed];
        float sc = 0.f;
        for (int64_t d = 0; d < D; ++d) sc += qrow[d] * kt[d * S + slot];
        scores[k] = sc * scale;
      }
      float top = -INFINITY;
      for (int64_t k = 0; k < total; ++k) top = scores[k] > top ? scores[k] : top;
      for (int64_t k = 0; k < total; ++k) weights[k] = softmax_exp(scores[k] - top);
      float lanes[kLanes] = {0};
      int64_t k = 0;
      for (; k + kLanes <= total; k += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += weights[k + l];
      for (int l = 0; k < total; ++k, ++l) lanes[l] += weights[k];
      for (int w = kLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      const float sum = lanes[0];
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t kk = 0; kk < total; ++kk) {
        const int64_t slot = kk < committed ? kk : slots[kk - committed];
        const float w = weights[kk];
        const float* v = vbase + slot * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / sum);
    }
  });
}

// q: [B, H, R, D] (last dim contiguous), float32 or bfloat16; keys: [B, Hkv, D, S] and
// values: [B, Hkv, S, D], float32, contiguous; lengths: [B] int64; ancestors: [B, R, W] int64
// cache slots (-1 past the row's depth); rows: [B] int64 real rows per sequence.
// Returns [B, R, H, D] in q's dtype, accumulated in float32 (zeros past rows[b]).
torch::Tensor tree_attention_exact(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor lengths, torch::Tensor ancestors,
                                   torch::Tensor rows, double scaling) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "rank mismatch");
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32,
              "the cache must be float32");
  TORCH_CHECK(q.stride(3) == 1, "q's last dim must be contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const float scale = static_cast<float>(scaling);
  if (q.scalar_type() == torch::kFloat32) {
    run<float>(q, keys, values, lengths, ancestors, rows, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(q, keys, values, lengths, ancestors, rows, scale, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write", &rope_write, "rotary embedding of q/k and KV-cache write");
  m.def("tree_attention_exact", &tree_attention_exact, "exact CPU tree attention");
  m.def("rms_norm_bf16", &rms_norm_bf16, "fused bfloat16 RMSNorm (optionally after a residual add)");
}
