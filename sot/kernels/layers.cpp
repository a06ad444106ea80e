// The decoder layers of a Llama-family model in one compiled call, for the passes that run on
// SoT's kernels end to end (float32 rows, products on packed panels or 4/8-bit blocks, the
// transposed-key cache). It calls the same kernels, in the same order, with the same inputs as
// the Python loop in sot/models/fast_llama.py, so every value has the same bits; what it
// removes is the interpreter and the binding work between the kernels (about ten calls a
// layer, each a few microseconds, which add up to a tenth of a one-row pass).
#include "common.h"

#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>

namespace {

// One product: panels ([P, K, 16] float32) or blocks (data, scale, mins), as PackedLinear
// holds them.
struct Product {
  std::vector<at::Tensor> packed;
  int64_t n = 0;
  std::optional<at::Tensor> bias;
  bool fused = true;

  at::Tensor operator()(const at::Tensor& x) const {
    if (packed.size() == 1) return linear_f32(x, packed[0], n, bias);
    return linear_blocks_f32(x, packed[0], packed[1], packed[2], n, bias, fused);
  }
};

struct Layer {
  at::Tensor ln1, ln2;
  Product qkv, o, gate_up, down;
  int64_t window = 0;
};

}  // namespace

// Built once per model from its packed weights; forward() runs every layer of one pass.
class LlamaLayers {
 public:
  LlamaLayers(double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double scaling)
      : eps_(eps), nq_(heads), nkv_(kv_heads), hd_(head_dim), inter_(inter), scaling_(scaling) {}

  // One layer's weights, in order: the two norm weights, then each product as (packed
  // tensors: 1 for panels, 3 for blocks; output size; bias or None; decode blocks in registers).
  void add(at::Tensor ln1, at::Tensor ln2, std::vector<std::vector<at::Tensor>> packed, std::vector<int64_t> sizes,
           std::vector<std::optional<at::Tensor>> biases, bool fused, int64_t window) {
    TORCH_CHECK(packed.size() == 4 && sizes.size() == 4 && biases.size() == 4, "four products a layer");
    Layer layer;
    layer.ln1 = ln1.contiguous();
    layer.ln2 = ln2.contiguous();
    Product* products[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(packed[i].size() == 1 || packed[i].size() == 3, "a product is packed as 1 or 3 tensors");
      products[i]->packed = packed[i];
      products[i]->n = sizes[i];
      products[i]->bias = biases[i];
      products[i]->fused = fused;
    }
    layer.window = window;
    layers_.push_back(std::move(layer));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // h: [M, D] float32, the pass's rows after the embedding (M = B * T, or the R packed rows
  // when `flat` is given); cos, sin: [B, T, hd]; keys: [L, B, Hkv, hd, S'] and values:
  // [L, B, Hkv, S, hd], the cache; slots: [B, T] the rows' cache slots; lengths, ancestors,
  // rows: the attention kernel's layout; flat: [R] the packed rows' places on the [B, T] grid
  // (real: how many of them are real), or None; state_layers: the layers (> 0) whose input
  // residual stream is returned. Returns [h, delta, states...]: the residual stream and the
  // last layer's branch, not yet added (the final norm adds it), and one [M, D] per state layer.
  std::vector<at::Tensor> forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                                  at::Tensor slots, at::Tensor lengths, at::Tensor ancestors, at::Tensor rows,
                                  std::optional<at::Tensor> flat, int64_t real, std::vector<int64_t> state_layers) {
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be [M, D] float32");
    TORCH_CHECK(cos.dim() == 3, "cos must be [B, T, head_dim]");
    const int64_t batch = cos.size(0), grid_rows = cos.size(0) * cos.size(1), width = (nq_ + 2 * nkv_) * hd_;
    at::Tensor grid_index;
    if (flat.has_value()) grid_index = flat->narrow(0, 0, real);
    std::vector<at::Tensor> out(2);
    at::Tensor delta;
    for (int64_t idx = 0; idx < size(); ++idx) {
      const Layer& layer = layers_[idx];
      at::Tensor x;
      if (delta.defined()) {
        auto normed = rms_norm_f32(h, layer.ln1, eps_, delta);
        x = normed[0];
        h = normed[1];
      } else {
        x = rms_norm_f32(h, layer.ln1, eps_, std::nullopt)[0];
      }
      if (idx > 0 && std::find(state_layers.begin(), state_layers.end(), idx) != state_layers.end())
        out.push_back(h);
      at::Tensor qkv = layer.qkv(x);  // [M, (nq + 2 nkv) hd]
      if (flat.has_value())
        qkv = at::zeros({grid_rows, width}, qkv.options()).index_copy_(0, grid_index, qkv.narrow(0, 0, real));
      at::Tensor k = keys.select(0, idx), v = values.select(0, idx);
      at::Tensor q = rope_write(qkv.view({batch, grid_rows / batch, nq_ + 2 * nkv_, hd_}), cos, sin, k, v, slots, nq_);
      at::Tensor att = tree_attention_exact(q, k, v, lengths, ancestors, rows, scaling_, layer.window, 0.0);
      att = att.reshape({grid_rows, nq_ * hd_});
      if (flat.has_value()) att = at::index_select(att, 0, *flat);
      auto normed = rms_norm_f32(h, layer.ln2, eps_, layer.o(att));
      x = normed[0];
      h = normed[1];
      at::Tensor gu = layer.gate_up(x);
      delta = layer.down(at::mul(at::silu(gu.narrow(1, 0, inter_)), gu.narrow(1, inter_, inter_)));
    }
    out[0] = h;
    out[1] = delta;
    return out;
  }

 private:
  double eps_;
  int64_t nq_, nkv_, hd_, inter_;
  double scaling_;
  std::vector<Layer> layers_;
};

void bind_llama_layers(pybind11::module_& m) {
  pybind11::class_<LlamaLayers>(m, "LlamaLayers")
      .def(pybind11::init<double, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add", &LlamaLayers::add)
      .def("__len__", &LlamaLayers::size)
      .def("forward", &LlamaLayers::forward);
}
