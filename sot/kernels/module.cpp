// The one Python module of SoT's CPU kernels (built by sot.kernels on first use).
#include "common.h"
// pybind11 with ATen's tensor and optional casters, without the C++ frontend
#include <torch/csrc/utils/pybind.h>

void bind_llama_layers(pybind11::module_& m);  // layers.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write", &rope_write, "rotary embedding of q/k and KV-cache write");
  m.def("tree_attention_exact", &tree_attention_exact, "exact CPU tree attention");
  m.def("attention_pairs_bf16", &attention_pairs_bf16,
        "whether tree_attention_exact scores a bfloat16 cache with pair dot products (AVX512-BF16)");
  m.def("rms_norm_bf16", &rms_norm_bf16, "fused bfloat16 RMSNorm (optionally after a residual add)");
  m.def("rms_norm_f32", &rms_norm_f32, "fused float32 RMSNorm (optionally after a residual add)");
  m.def("linear_f32", &linear_f32, "row-stable float32 linear layer on panel-packed weights");
  m.def("linear_blocks_f32", &linear_blocks_f32, "linear_f32 on float32 weights stored as exact 4/8-bit blocks");
  m.def("block_grid_f32", &block_grid_f32, "float32 weights as exact GGUF 4/8-bit blocks, or nothing");
  m.def("amx_supported", &amx_supported, "whether this CPU has AMX tiles for bfloat16 (and Linux lends them)");
  m.def("amx_products", &amx_products, "whether linear_blocks_bf16 multiplies with AMX tiles in this process");
  m.def("set_amx_products", &set_amx_products, "turn linear_blocks_bf16's AMX chain on or off (on needs AMX); "
        "returns the state");
  m.def("bf16_blocks_supported", &bf16_blocks_supported, "whether this CPU runs linear_blocks_bf16 (AVX512-BF16)");
  m.def("linear_blocks_bf16", &linear_blocks_bf16,
        "row-stable bfloat16 product over 4/8-bit blocks (AVX512-BF16, or AMX tiles)",
        pybind11::arg("x"), pybind11::arg("data"), pybind11::arg("scale"), pybind11::arg("mins"), pybind11::arg("n"),
        pybind11::arg("bias"), pybind11::arg("pairs") = pybind11::none());
  m.def("decode_blocks_bf16", &decode_blocks_bf16, "linear_blocks_bf16's weights decoded once, for wide products");
  m.def("bf16_pairs_from_rows", &bf16_pairs_from_rows,
        "the row count from which linear_blocks_bf16 reads decoded pairs");
  m.def("row_argmax_f32", &row_argmax_f32, "each row's argmax, the first on ties (or the first NaN)");
  m.def("row_top_logsoftmax_f32", &row_top_logsoftmax_f32,
        "each row's k largest log-softmax values and their indices, largest first, ties to the lower index");
  m.def("linear_int8", &linear_int8, "row-stable product in 8-bit integers over 4/8-bit blocks");
  bind_llama_layers(m);
}
