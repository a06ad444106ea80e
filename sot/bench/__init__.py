"""Benchmarks: side-by-side runs of decoding methods over the same prompts."""
