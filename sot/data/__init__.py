"""Data sets shipped by PyPI packages: ShareGPT (training and held-out prompts), HumanEval."""
