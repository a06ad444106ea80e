// RMSNorm (bfloat16 and float32) and the rotary embedding with the KV-cache write, each one
// compiled call with a fixed order of operations; and the row argmax of greedy decoding.
#include "common.h"

// RMSNorm of bfloat16 rows, Llama style: w * bf16(x * rsqrt(mean(x^2) + eps)), computed in
// float32 with a fixed reduction order. With ``residual`` given, x = bf16(x + residual) first
// and that sum is returned as well.
std::vector<at::Tensor> rms_norm_bf16(at::Tensor x, at::Tensor weight, double eps,
                                      std::optional<at::Tensor> residual) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  x = x.contiguous();
  const int64_t D = x.size(-1), N = x.numel() / D;
  at::Tensor sum_out;
  const at::BFloat16* rp = nullptr;
  if (residual.has_value()) {
    auto res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes(), "residual shape mismatch");
    sum_out = at::empty_like(x);
    rp = res.data_ptr<at::BFloat16>();
  }
  auto out = at::empty_like(x);
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
std::vector<at::Tensor> rms_norm_f32(at::Tensor x, at::Tensor weight, double eps,
                                     std::optional<at::Tensor> residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  x = x.contiguous();
  const int64_t D = x.size(-1), N = x.numel() / D;
  TORCH_CHECK(weight.numel() == D, "weight size mismatch");
  at::Tensor sum_out;
  const float* rp = nullptr;
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == at::kFloat, "residual shape mismatch");
    sum_out = at::empty_like(x);
    rp = res.data_ptr<float>();
  }
  auto w = weight.contiguous();
  auto out = at::empty_like(x);
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
// keys: [B, Hkv, S' / 16, D, 16] (tiles of 16 slots, S' >= S), values: [B, Hkv, S, D] (one
// layer of the cache: float32, or bfloat16 for a bfloat16 model, whose keys and values are
// bfloat16 values; for a float32 model, bfloat16 or float16 when its cache was asked to be
// smaller, holding the roundings of what it would hold);
// slots: [B, T] cache slot per row.
// Returns q: [B, Hq, T, D]. Every operation rounds to the model dtype exactly as the
// transformers formula q * cos + rotate_half(q) * sin does, so the bits are the same.
template <typename T, typename C>
void rope_write_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& keys, at::Tensor& values, const at::Tensor& slots,
                     int64_t hq, at::Tensor& q_out) {
  const int64_t B = qkv.size(0), Tn = qkv.size(1), Hall = qkv.size(2), D = qkv.size(3);
  const int64_t hkv = (Hall - hq) / 2, Sk = keys.size(2) * kLanes, Sv = values.size(2), half = D / 2;
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  C* kp = keys.data_ptr<C>();
  C* vp = values.data_ptr<C>();
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
            // slot `where` is lane where % 16 of tile where / 16
            kp[((b * hkv + (h - hq)) * Sk + where / kLanes * kLanes) * D + d * kLanes + where % kLanes] =
                static_cast<C>(static_cast<float>(value));
          }
        }
      }
      for (int64_t h = 0; h < hkv; ++h) {
        const T* x = src + (bt * Hall + hq + hkv + h) * D;
        C* dst = vp + ((b * hkv + h) * Sv + where) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<C>(static_cast<float>(x[d]));
      }
    }
  });
}

at::Tensor rope_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                      at::Tensor values, at::Tensor slots, int64_t hq) {
  TORCH_CHECK(slots.numel() == 0 || slots.max().item<int64_t>() < values.size(2), "cache slot out of range");
  return rope_write_checked_once(qkv, cos, sin, keys, values, slots, hq);
}

at::Tensor rope_write_checked_once(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                                   at::Tensor values, at::Tensor slots, int64_t hq) {
  TORCH_CHECK(qkv.dim() == 4 && cos.dim() == 3 && keys.dim() == 5, "rank mismatch");
  TORCH_CHECK(keys.size(4) == kLanes && keys.size(2) * kLanes >= values.size(2) && keys.size(3) == qkv.size(3),
              "keys must be [B, Hkv, S' / 16, D, 16] (S' >= S) for values [B, Hkv, S, D]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "cache must be contiguous");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  const at::ScalarType cache = keys.scalar_type();
  const bool q32 = qkv.scalar_type() == at::kFloat;
  TORCH_CHECK((cache == at::kFloat || cache == at::kBFloat16 || (cache == at::kHalf && q32)) &&
                  values.scalar_type() == cache && cos.scalar_type() == qkv.scalar_type(),
              "dtype mismatch (a float32 or bfloat16 cache, or a float16 one for a float32 model)");
  auto q = at::empty({qkv.size(0), hq, qkv.size(1), qkv.size(3)}, qkv.options());
  if (q32 && cache == at::kFloat) {
    rope_write_impl<float, float>(qkv, cos, sin, keys, values, slots, hq, q);
  } else if (q32 && cache == at::kBFloat16) {
    rope_write_impl<float, at::BFloat16>(qkv, cos, sin, keys, values, slots, hq, q);
  } else if (q32) {
    rope_write_impl<float, at::Half>(qkv, cos, sin, keys, values, slots, hq, q);
  } else if (qkv.scalar_type() == at::kBFloat16 && cache == at::kBFloat16) {
    rope_write_impl<at::BFloat16, at::BFloat16>(qkv, cos, sin, keys, values, slots, hq, q);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rope_write_impl<at::BFloat16, float>(qkv, cos, sin, keys, values, slots, hq, q);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
  }
  return q;
}

// ---------------------------------------------------------------------------- row argmax
// x [M, V] float32 -> [M] int64: the index of each row's largest value, the first on ties (as
// torch.argmax), or the row's first NaN where it has one (torch.argmax gives one of its NaNs,
// which one depending on its vector lanes). Two passes over the row (it stays in
// L2): its maximum, then the first index holding it. PyTorch's CPU argmax keeps an index
// beside every lane: on an AVX2 EPYC, one 49k row took 53 us against 18, 16 rows 0.47 ms against 0.05.
namespace {

inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

inline int64_t argmax_row(const float* x, int64_t n) {
  if (n == 0) return 0;
  int64_t i = 0;
  float top = x[0];
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, v);
    }
    if (_mm256_movemask_ps(nan)) return first_nan(x, n);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    top = lanes[0];
    for (int j = 1; j < 8; ++j) top = std::max(top, lanes[j]);
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return first_nan(x, n);
    top = std::max(top, x[i]);
  }
  if (std::isnan(top)) return first_nan(x, n);
  i = 0;
#if defined(__AVX2__)
  const __m256 t = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(mask);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return 0;  // (not reached: top is one of the row's values)
}

// The k largest values of one row, ties to the lower index, into vals/idx (descending):
// the first k values sorted, then each later value that beats the k-th (8 at a time compared
// with it first, most of a row never entering).
inline void top_row(const float* x, int64_t n, int64_t k, float* vals, int64_t* idx) {
  int64_t count = 0;
  auto insert = [&](float v, int64_t i) {
    int64_t at = count < k ? count : k - 1;
    while (at > 0 && vals[at - 1] < v) {  // (after every value >= v: an earlier index stays first)
      vals[at] = vals[at - 1];
      idx[at] = idx[at - 1];
      --at;
    }
    vals[at] = v;
    idx[at] = i;
    if (count < k) ++count;
  };
  int64_t i = 0;
  for (; i < k; ++i) insert(x[i], i);
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
    while (mask) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      if (x[i + j] > vals[k - 1]) insert(x[i + j], i + j);
    }
  }
#endif
  for (; i < n; ++i)
    if (x[i] > vals[k - 1]) insert(x[i], i);
}

// log of the sum of exp(x - top) over a row, with the softmax's exp
inline float log_sum_exp_below(const float* x, int64_t n, float top) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__)
  const __m256 t = _mm256_set1_ps(top);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_ps(a0, softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), t)));
    a1 = _mm256_add_ps(a1, softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), t)));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
  for (int j = 0; j < 8; ++j) sum += lanes[j];
#endif
  for (; i < n; ++i) sum += std::exp(x[i] - top);
  return std::log(sum);
}
}  // namespace

at::Tensor row_argmax_f32(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "row_argmax_f32 takes float32 rows [M, V]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), V = xc.size(1);
  at::Tensor out = at::empty({M}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> row_top_logsoftmax_f32(at::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "row_top_logsoftmax_f32 takes float32 rows [M, V]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), V = xc.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "row_top_logsoftmax_f32: k must be in 1..V");
  at::Tensor vals = at::empty({M, k}, xc.options());
  at::Tensor idx = at::empty({M, k}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, M, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* v = vp + r * k;
      top_row(xp + r * V, V, k, v, ip + r * k);
      const float lse = v[0] + log_sum_exp_below(xp + r * V, V, v[0]);
      for (int64_t j = 0; j < k; ++j) v[j] -= lse;
    }
  });
  return {vals, idx};
}
