"""Write a Llama-shaped GGUF model in each common quantization format, to time SoT's products
on them against llama.cpp's.

The model has the default model's tokenizer and metadata (so every prompt set and `sot bench`
work as they do on it), random float16 weights and the widths of a small Llama (hidden 1024,
12 layers, 16 heads over 4 key/value heads, MLP 4096: multiples of 256, so llama.cpp's
K-quant mixes are what they are for published Llama files). llama.cpp's own quantizer
(llama-cpp-python) writes each format from the float16 file. Its answers are nonsense; its
speed is a model's of this shape.

    python scripts/gguf_formats.py --out /tmp/formats --formats q4_k_m,q5_k_m,iq4_xs
    sot bench --model /tmp/formats/llama-wide-q4_k_m.gguf --methods plain,llamacpp --limit 8
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

#: llama.cpp's file types by the names its `llama-quantize` tool takes (lower case)
FORMATS = {"f16": None, "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
           "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
           "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
           "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS", "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL"}


def write_f16(path: Path, hidden: int, layers: int, inter: int, heads: int, kv_heads: int, seed: int) -> None:
    """The float16 model: the default model's metadata and vocabulary, these widths, random weights."""
    import gguf
    from gguf import GGUFReader, GGUFValueType

    from sot.models.loading import default_gguf_path

    source = GGUFReader(str(default_gguf_path()))
    out = gguf.GGUFWriter(str(path), "llama")
    shape = {"llama.embedding_length": hidden, "llama.block_count": layers, "llama.feed_forward_length": inter,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
             "llama.rope.dimension_count": hidden // heads}
    scalars = {GGUFValueType.UINT32: out.add_uint32, GGUFValueType.INT32: out.add_int32,
               GGUFValueType.FLOAT32: out.add_float32, GGUFValueType.BOOL: out.add_bool,
               GGUFValueType.UINT64: out.add_uint64, GGUFValueType.UINT8: out.add_uint8}
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        if name in shape:
            out.add_uint32(name, shape[name])
        elif kind == GGUFValueType.ARRAY:
            text = field.types[1] == GGUFValueType.STRING
            out.add_array(name, [bytes(field.parts[i]).decode("utf-8", "replace") if text
                                 else field.parts[i].tolist()[0] for i in field.data])
        elif kind == GGUFValueType.STRING:
            out.add_string(name, bytes(field.parts[field.data[0]]).decode())
        else:
            scalars[kind](name, field.parts[field.data[0]].tolist()[0])
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    head_dim = hidden // heads
    out.add_tensor("token_embd.weight", weight(vocab, hidden))
    out.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            out.add_tensor(f"blk.{i}.{name}.weight", weight(rows, cols))
        out.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        out.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the files (llama-wide-FORMAT.gguf)")
    ap.add_argument("--formats", default="f16,q4_k_m,q5_k_m,q3_k_m,iq4_xs", help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--inter", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    import llama_cpp
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "llama-wide-f16.gguf"
    write_f16(f16, args.hidden, args.layers, args.inter, args.heads, args.kv_heads, args.seed)
    for name in tqdm(formats, desc="quantizing", unit="file"):
        if FORMATS[name] is None:
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FORMATS[name])
        params.nthread = 2
        target = out / f"llama-wide-{name}.gguf"
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(target).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not write {target}")
    print("\n".join(str(out / f"llama-wide-{name}.gguf") for name in formats))


if __name__ == "__main__":
    main()
