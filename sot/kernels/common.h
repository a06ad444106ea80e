// Shared by SoT's CPU kernels: 16-lane float vectors and a dot product with a fixed
// reduction order. Each kernel file includes this; nothing here depends on the row count.
#pragma once
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

// The kernels each file defines, bound into one module by module.cpp.
torch::Tensor tree_attention_exact(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor lengths, torch::Tensor ancestors,
                                   torch::Tensor rows, double scaling, int64_t window, double softcap);
std::vector<torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps,
                                         c10::optional<torch::Tensor> residual);
std::vector<torch::Tensor> rms_norm_f32(torch::Tensor x, torch::Tensor weight, double eps,
                                        c10::optional<torch::Tensor> residual);
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                         torch::Tensor values, torch::Tensor slots, int64_t hq);
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
torch::Tensor linear_blocks_f32(torch::Tensor x, torch::Tensor data, torch::Tensor scale, torch::Tensor mins,
                                int64_t N, c10::optional<torch::Tensor> bias, bool fused);
