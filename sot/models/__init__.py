"""Models: loading (Hugging Face folders, GGUF files, LoRA merges; :mod:`.loading`), which
models SoT refuses and why (:mod:`.support`), the generic tree-verification adapter
(:mod:`.adapter`), the Llama-family fast path (:mod:`.fast_llama`), CUDA graphs of verify
passes (:mod:`.graphs`) and row-stable products (:mod:`.rows`)."""
