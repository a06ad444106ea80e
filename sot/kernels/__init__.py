"""Optional compiled kernels, built on first use with the local C++ compiler.

If the build fails (no compiler, no ninja), SoT falls back to its pure-PyTorch path; both
are exact, each consistent with itself. ``SOT_NO_KERNELS=1`` forces the fallback.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType


@lru_cache(maxsize=1)
def tree_attention_kernel() -> ModuleType | None:
    """The compiled CPU tree-attention module, or ``None`` when unavailable."""
    if os.environ.get("SOT_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).with_name("tree_attention.cpp")
        return load(
            name="sot_tree_attention",
            sources=[str(source)],
            extra_cflags=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the fallback
        warnings.warn(f"SoT's CPU kernel could not be built ({exc}); using the PyTorch path", stacklevel=2)
        return None
