// The decoder layers of a Llama-family (or Gemma 3) model in one compiled call, for the verify passes on
// the tiled-key cache: float32 rows with products on SoT's packed panels or 4/8-bit
// blocks, or rows (bfloat16 on AVX-512 CPUs) with oneDNN's packed products. It calls the same
// kernels, in the same order, with the same inputs as the Python loop in
// sot/models/fast_llama.py, so every value has the same bits; what it removes is the
// interpreter and the binding work between the kernels (about ten calls a layer, each a few
// microseconds: a fifth of a one-row pass of the default model on a 2-core AVX2 CPU).
#include "common.h"

#include <torch/csrc/utils/pybind.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>

namespace {

// oneDNN's product on a weight packed by torch.ops.mkldnn._reorder_linear_weight.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// One product, as PackedLinear holds it (sot/kernels/linear.py): SoT's panels ([P, K, 16]
// float32) or blocks (data, scale, mins), or a oneDNN-packed weight, run like
// PackedLinear.__call__ with stable=True: in blocks of `unit` rows, the last one padded with
// zero rows unless the kernel gives a short block the bits of a full one (`partial_ok`); or
// segments (PackedLinear.segments: a stack of blocks of several kinds), their outputs side by side.
struct Product {
  enum Kind { kPanels, kBlocks, kInt8, kBF16Blocks, kOneDNN, kSegments } kind = kPanels;
  std::vector<at::Tensor> packed;
  std::vector<Product> segments;
  int64_t n = 0;
  std::optional<at::Tensor> bias;
  bool fused = true, partial_ok = true;
  int64_t unit = 0;  // set by LlamaLayers::add (ROW_UNIT)

  at::Tensor block(const at::Tensor& x) const {
    if (kind == kPanels) return linear_f32(x, packed[0], n, bias);
    if (kind == kBlocks) return linear_blocks_f32(x, packed[0], packed[1], packed[2], n, bias, fused);
    if (kind == kInt8) return linear_int8(x, packed[0], packed[1], packed[2], n, bias);
    if (kind == kBF16Blocks)
      return linear_blocks_bf16(x, packed[0], packed[1], packed[2], n, bias,
                                packed.size() > 3 ? std::optional<at::Tensor>(packed[3]) : std::nullopt);
    return onednn_linear(x, packed[0], bias);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == kSegments) {
      std::vector<at::Tensor> outs;
      for (const Product& piece : segments) outs.push_back(piece(x));
      return at::cat(outs, 1);
    }
    const int64_t rows = x.size(0);
    if (kind != kOneDNN || rows == unit || (rows < unit && partial_ok)) return block(x);
    const int64_t pad = partial_ok ? 0 : (unit - rows % unit) % unit;
    const at::Tensor padded = pad ? at::constant_pad_nd(x, {0, 0, 0, pad}, 0) : x;
    std::vector<at::Tensor> parts;
    for (int64_t i = 0; i < padded.size(0); i += unit)
      parts.push_back(block(padded.narrow(0, i, std::min(unit, padded.size(0) - i))));
    const at::Tensor out = at::cat(parts);
    return pad ? out.narrow(0, 0, rows) : out;
  }
};

struct Layer {
  at::Tensor ln1, ln2;
  Product qkv, o, gate_up, down;
  int64_t window = 0;
  // Qwen3 and Gemma 3: the norms of each query and key head; Gemma 3: of the attention's and
  // the MLP's outputs (undefined where a family has none); which rotary table the layer reads
  at::Tensor attn_out_norm, mlp_out_norm, q_norm, k_norm;
  int64_t rope = 0;
};

// A product from its packed tensors and kind (see LlamaLayers::add); "segments" only where
// `segmented` (a product of a layer, not a piece of one).
Product make_product(const std::vector<at::Tensor>& packed, int64_t size, const std::optional<at::Tensor>& bias,
                     const std::string& kind, bool partial_ok, bool fused, int64_t unit, bool segmented) {
  TORCH_CHECK(kind == "panels" || kind == "blocks" || kind == "int8" || kind == "bf16blocks" || kind == "onednn" ||
                  (segmented && kind == "segments"), "unknown product kind ", kind);
  const bool blocks = kind == "blocks" || kind == "int8" || kind == "bf16blocks";
  TORCH_CHECK(kind == "segments" ? packed.empty()
                                 : packed.size() == (blocks ? 3u : 1u) || (kind == "bf16blocks" && packed.size() == 4u),
              "a product is packed as 1 or 3 tensors (4: bfloat16 blocks and their decoded pairs; none: segments)");
  Product out;
  out.kind = kind == "panels"       ? Product::kPanels
             : kind == "blocks"     ? Product::kBlocks
             : kind == "int8"       ? Product::kInt8
             : kind == "bf16blocks" ? Product::kBF16Blocks
             : kind == "segments"   ? Product::kSegments
                                    : Product::kOneDNN;
  out.partial_ok = partial_ok;
  out.unit = unit;
  out.packed = packed;
  out.n = size;
  out.bias = bias;
  out.fused = fused;
  return out;
}

}  // namespace

// Built once per model from its packed weights; forward() runs every layer of one pass.
class LlamaLayers {
 public:
  // act: the MLP's activation, "silu" or "gelu_tanh" (GELU's tanh approximation, Gemma's).
  LlamaLayers(double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double scaling,
              std::string act)
      : eps_(eps), nq_(heads), nkv_(kv_heads), hd_(head_dim), inter_(inter), scaling_(scaling),
        gelu_(act == "gelu_tanh") {
    TORCH_CHECK(act == "silu" || act == "gelu_tanh", "unknown activation ", act);
  }

  // One layer's weights, in order: the two norm weights, then each product as (packed
  // tensors: 1 for panels or a oneDNN weight, 3 for blocks; output size; bias or None; its
  // kind: "panels", "blocks" (float32 products scaled per block), "int8" (8-bit integer products), "bf16blocks"
  // (bfloat16 rows over blocks decoded to bfloat16; a fourth tensor: the blocks decoded once,
  // read by wide products), "onednn", or "segments" (no tensors: add_segment gives its pieces);
  // short blocks exact), whether blocks decode in
  // registers, the row unit of padded products, the sliding window (0: none), the norms of
  // the attention's output, the MLP's output, each query head and each key head (the last two
  // Qwen3's and Gemma 3's, the first two Gemma 3's; None elsewhere), and the index of the rotary
  // table the layer reads (forward's cos and sin).
  void add(at::Tensor ln1, at::Tensor ln2, std::vector<std::vector<at::Tensor>> packed, std::vector<int64_t> sizes,
           std::vector<std::optional<at::Tensor>> biases, std::vector<std::string> kinds,
           std::vector<bool> partial_ok, bool fused, int64_t unit, int64_t window,
           std::vector<std::optional<at::Tensor>> norms, int64_t rope) {
    TORCH_CHECK(packed.size() == 4 && sizes.size() == 4 && biases.size() == 4 && kinds.size() == 4 &&
                partial_ok.size() == 4, "four products a layer");
    Layer layer;
    layer.ln1 = ln1.contiguous();
    layer.ln2 = ln2.contiguous();
    Product* products[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i)
      *products[i] = make_product(packed[i], sizes[i], biases[i], kinds[i], partial_ok[i], fused, unit, true);
    layer.window = window;
    TORCH_CHECK(norms.size() == 4, "four optional norms a layer");
    at::Tensor* extra[4] = {&layer.attn_out_norm, &layer.mlp_out_norm, &layer.q_norm, &layer.k_norm};
    for (int i = 0; i < 4; ++i)
      if (norms[i].has_value()) *extra[i] = norms[i]->contiguous();
    TORCH_CHECK(layer.q_norm.defined() == layer.k_norm.defined(), "query and key norms come together");
    TORCH_CHECK(rope >= 0, "rotary table index must be >= 0");
    layer.rope = rope;
    layers_.push_back(std::move(layer));
  }

  // One more piece of product `product` (0 qkv, 1 o, 2 gate_up, 3 down) of the last layer added,
  // which add() gave the kind "segments": its outputs follow the earlier pieces'.
  void add_segment(int64_t product, std::vector<at::Tensor> packed, int64_t size, std::optional<at::Tensor> bias,
                   std::string kind, bool partial_ok, bool fused, int64_t unit) {
    TORCH_CHECK(!layers_.empty() && product >= 0 && product < 4, "a segment of a product of the last layer");
    Layer& layer = layers_.back();
    Product* products[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    TORCH_CHECK(products[product]->kind == Product::kSegments, "that product was not added as segments");
    products[product]->segments.push_back(make_product(packed, size, bias, kind, partial_ok, fused, unit, false));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // h: [M, D] float32 or bfloat16, the pass's rows after the embedding (M = B * T, or the R packed rows
  // when `flat` is given); cos, sin: [B, T, hd] for each rotary table; keys: [L, B, Hkv, S / 16, hd, 16] (tiles of 16
  // slots) and values: [L, B, Hkv, S, hd], the cache; slots: [B, T] the rows' cache slots; lengths, ancestors,
  // rows: the attention kernel's layout; flat: [R] the packed rows' places on the [B, T] grid
  // (real: how many of them are real), or None; state_layers: the layers (> 0) whose input
  // residual stream is returned. Returns [h, delta, states...]: the residual stream and the
  // last layer's branch, not yet added (the final norm adds it), and one [M, D] per state layer.
  std::vector<at::Tensor> forward(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                  at::Tensor keys, at::Tensor values, at::Tensor slots, at::Tensor lengths,
                                  at::Tensor ancestors, at::Tensor rows, std::optional<at::Tensor> flat, int64_t real,
                                  std::vector<int64_t> state_layers) {
    TORCH_CHECK(h.dim() == 2 && (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16),
                "h must be [M, D] float32 or bfloat16");
    const auto norm = h.scalar_type() == at::kFloat ? rms_norm_f32 : rms_norm_bf16;
    TORCH_CHECK(!cos.empty() && cos.size() == sin.size() && cos[0].dim() == 3,
                "cos and sin must be [B, T, head_dim] for each rotary table");
    for (const Layer& layer : layers_)
      TORCH_CHECK(layer.rope < static_cast<int64_t>(cos.size()), "a layer reads a rotary table not given");
    const int64_t batch = cos[0].size(0), grid_rows = cos[0].size(0) * cos[0].size(1),
                  width = (nq_ + 2 * nkv_) * hd_;
    at::Tensor grid_index;
    if (flat.has_value()) grid_index = flat->narrow(0, 0, real);
    // every layer writes the same slots: checked once here, not by each layer's rope_write
    TORCH_CHECK(slots.numel() == 0 || slots.max().item<int64_t>() < values.size(3), "cache slot out of range");
    std::vector<at::Tensor> out(2);
    at::Tensor delta;
    for (int64_t idx = 0; idx < size(); ++idx) {
      const Layer& layer = layers_[idx];
      at::Tensor x;
      if (delta.defined()) {
        auto normed = norm(h, layer.ln1, eps_, delta);
        x = normed[0];
        h = normed[1];
      } else {
        x = norm(h, layer.ln1, eps_, std::nullopt)[0];
      }
      if (idx > 0 && std::find(state_layers.begin(), state_layers.end(), idx) != state_layers.end())
        out.push_back(h);
      at::Tensor qkv = layer.qkv(x);  // [M, (nq + 2 nkv) hd]
      if (layer.q_norm.defined()) {  // each query and key head normed (its own row of hd)
        const at::Tensor heads = qkv.view({qkv.size(0), nq_ + 2 * nkv_, hd_});
        const at::Tensor q = norm(heads.narrow(1, 0, nq_), layer.q_norm, eps_, std::nullopt)[0];
        const at::Tensor k = norm(heads.narrow(1, nq_, nkv_), layer.k_norm, eps_, std::nullopt)[0];
        qkv = at::cat({q, k, heads.narrow(1, nq_ + nkv_, nkv_)}, 1).view({qkv.size(0), width});
      }
      if (flat.has_value())
        qkv = at::zeros({grid_rows, width}, qkv.options()).index_copy_(0, grid_index, qkv.narrow(0, 0, real));
      at::Tensor k = keys.select(0, idx), v = values.select(0, idx);
      at::Tensor q = rope_write_checked_once(qkv.view({batch, grid_rows / batch, nq_ + 2 * nkv_, hd_}),
                                             cos[layer.rope], sin[layer.rope], k, v, slots, nq_);
      // The kernel widens q's rows to float32 (exactly), computes in float32 and rounds its
      // output to q's dtype (to nearest even, as a cast of its float32 output would): bfloat16
      // rows in and out give the bits of a float32 call between two casts, without the casts.
      at::Tensor att = tree_attention_exact(q, k, v, lengths, ancestors, rows, scaling_, layer.window, 0.0);
      att = att.reshape({grid_rows, nq_ * hd_});
      if (flat.has_value()) att = at::index_select(att, 0, *flat);
      at::Tensor o = layer.o(att);
      if (layer.attn_out_norm.defined()) o = norm(o, layer.attn_out_norm, eps_, std::nullopt)[0];
      auto normed = norm(h, layer.ln2, eps_, o);
      x = normed[0];
      h = normed[1];
      at::Tensor gu = layer.gate_up(x);
      const at::Tensor gate = gu.narrow(1, 0, inter_);
      delta = layer.down(at::mul(gelu_ ? at::gelu(gate, "tanh") : at::silu(gate), gu.narrow(1, inter_, inter_)));
      if (layer.mlp_out_norm.defined()) delta = norm(delta, layer.mlp_out_norm, eps_, std::nullopt)[0];
    }
    out[0] = h;
    out[1] = delta;
    return out;
  }

 private:
  double eps_;
  int64_t nq_, nkv_, hd_, inter_;
  double scaling_;
  bool gelu_;
  std::vector<Layer> layers_;
};

void bind_llama_layers(pybind11::module_& m) {
  pybind11::class_<LlamaLayers>(m, "LlamaLayers")
      .def(pybind11::init<double, int64_t, int64_t, int64_t, int64_t, double, std::string>())
      .def("add", &LlamaLayers::add)
      .def("add_segment", &LlamaLayers::add_segment)
      .def("__len__", &LlamaLayers::size)
      .def("forward", &LlamaLayers::forward);
}
