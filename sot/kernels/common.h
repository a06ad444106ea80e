// Shared by SoT's CPU kernels: 16-lane float vectors and a dot product with a fixed
// reduction order. Each kernel file includes this; nothing here depends on the row count.
#pragma once
// ATen's core headers only: <torch/extension.h> takes about 40 s to parse per file, these
// about 8 s, and the kernels need nothing more (module.cpp adds the Python binding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <optional>
#include <tuple>
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

#if defined(__AVX2__)
// exp of 8 floats in AVX2 registers: range reduction plus a degree-6 polynomial, the same
// operations in the same order as attention.cpp's 16-lane softmax_exp (GCC lowers that one
// poorly on AVX2; measured at about a third of a 16-row tree's attention time).
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

// The bias of a product as float32 values (null without one); `keep` holds the converted
// tensor while the pointer is used.
inline const float* float_bias(const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(keep.numel() == N, "bias size mismatch");
  return keep.data_ptr<float>();
}

// The GGUF blocks' scales and minimums, kept as the format stores them (float16; exact).
using half_t = uint16_t;  // a float16 value's bits

inline float half_value(half_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
// A block's scale as float32, stored as float16 bits or as float32
inline float scale_value(half_t h) { return half_value(h); }
inline float scale_value(float f) { return f; }

#if defined(__AVX2__) && defined(__F16C__)
// 8 float16 values as float32 (exact)
__attribute__((always_inline)) inline __m256 load8h(const half_t* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
// 8 scales as float32, from float16 bits or float32
__attribute__((always_inline)) inline __m256 load8s(const half_t* h) { return load8h(h); }
__attribute__((always_inline)) inline __m256 load8s(const float* f) { return _mm256_loadu_ps(f); }
#endif

}  // namespace

// The kernels each file defines, bound into one module by module.cpp.
at::Tensor tree_attention_exact(at::Tensor q, at::Tensor keys, at::Tensor values,
                                at::Tensor lengths, at::Tensor ancestors,
                                at::Tensor rows, double scaling, int64_t window, double softcap);
std::vector<at::Tensor> rms_norm_bf16(at::Tensor x, at::Tensor weight, double eps,
                                      std::optional<at::Tensor> residual);
std::vector<at::Tensor> rms_norm_f32(at::Tensor x, at::Tensor weight, double eps,
                                     std::optional<at::Tensor> residual);
at::Tensor rope_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                      at::Tensor values, at::Tensor slots, int64_t hq);
// rope_write without its check that every slot is in the cache (for a caller that checked the
// pass's slots once, as layers.cpp does for all its layers)
at::Tensor rope_write_checked_once(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                                   at::Tensor values, at::Tensor slots, int64_t hq);
at::Tensor linear_f32(at::Tensor x, at::Tensor packed, int64_t N, std::optional<at::Tensor> bias);
at::Tensor linear_blocks_f32(at::Tensor x, at::Tensor data, at::Tensor scale, at::Tensor mins,
                             int64_t N, std::optional<at::Tensor> bias, bool fused);
std::vector<at::Tensor> block_grid_f32(at::Tensor blocks);
at::Tensor linear_int8(at::Tensor x, at::Tensor data, at::Tensor scale, at::Tensor mins, int64_t N,
                       std::optional<at::Tensor> bias);
bool bf16_blocks_supported();
bool amx_supported();
bool amx_products();
bool set_amx_products(bool on);
// whether tree_attention_exact scores a bfloat16 cache with AVX512-BF16 pair dot products
bool attention_pairs_bf16();
at::Tensor linear_blocks_bf16(at::Tensor x, at::Tensor data, at::Tensor scale, at::Tensor mins, int64_t N,
                              std::optional<at::Tensor> bias, std::optional<at::Tensor> pairs);
at::Tensor decode_blocks_bf16(at::Tensor data, at::Tensor scale, at::Tensor mins);
int64_t bf16_pairs_from_rows();
// x [M, V] float32 -> [M] int64, each row's argmax as torch.argmax gives it (norm_rope.cpp)
at::Tensor row_argmax_f32(at::Tensor x);
// x [M, V] float32 -> ([M, k] float32, [M, k] int64): each row's k largest values less the row's
// log-sum-exp (their log-softmax), largest first, ties to the lower index (norm_rope.cpp)
std::tuple<at::Tensor, at::Tensor> row_top_logsoftmax_f32(at::Tensor x, int64_t k);
