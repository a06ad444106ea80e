"""SoT's compiled CPU kernels, built on first use with the local C++ compiler: exact tree
attention (``attention.cpp``), row-stable float32 products on packed and 4/8-bit block
weights (``linear.cpp``; their Python side is :mod:`sot.kernels.linear`), bfloat16 products
over the same blocks where the CPU has AVX512-BF16, on AMX tiles where it has them
(``linear_bf16.cpp``), the int8 mode's
8-bit integer products (``linear_int8.cpp``), RMSNorm, rope with the KV-cache write and the
greedy row argmax (``norm_rope.cpp``), and a Llama-family model's decoder layers in one call
over those kernels (``layers.cpp``), bound into one module (``module.cpp``).

If the build fails (no compiler, no ninja), SoT falls back to its pure-PyTorch path; both
are exact, each consistent with itself. ``SOT_NO_KERNELS=1`` forces the fallback.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator


#: the kernel sources, compiled into one module
SOURCES = ("attention.cpp", "linear.cpp", "linear_bf16.cpp", "linear_int8.cpp", "norm_rope.cpp", "layers.cpp",
           "module.cpp")
#: what they include from this folder
HEADERS = ("common.h",)


def _stage(build: Path) -> list[Path]:
    """Copy the sources into ``build/src`` (once: the folder's name is their digest) and
    return the copies to compile. The build tool compares file times, and a fresh clone or a
    checkout gives the package's files new ones: compiling these copies, whose times never
    change, lets a build of the same sources be found again instead of redone."""
    here = Path(__file__).parent
    staged = build / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for name in SOURCES + HEADERS:
        code = (here / name).read_bytes()
        target = staged / name
        if target.is_file() and target.read_bytes() == code:
            continue
        part = target.with_name(f".{name}.{os.getpid()}")
        part.write_bytes(code)
        part.replace(target)  # atomic: a process building beside this one never sees half a file
    return [staged / name for name in SOURCES]


@lru_cache(maxsize=1)
def _build() -> tuple[list[str], str]:
    """The compiler flags for this machine and the build's key: a digest of the sources, the
    flags and torch's version."""
    import torch

    here = Path(__file__).parent
    sources = [here / name for name in SOURCES]
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
    # Vector width of the build machine (the kernel is built where it runs).
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX512_BF16", "AMX"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma", "-mf16c"]
    # One build folder per (source, flags, torch and where it is installed): clones of the same
    # code in one environment share a build, two environments never rebuild over each other's
    # (the build records torch's include paths), and an edited kernel never collides with an
    # old one.
    code = b"".join(path.read_bytes() for path in sources + [here / name for name in HEADERS])
    where = str(Path(torch.__file__).resolve().parent).encode()
    return flags, hashlib.sha256(code + " ".join(flags).encode() + torch.__version__.encode() + where).hexdigest()[:16]


def build_key() -> str:
    """What identifies this machine's build of the kernels (see :func:`cpu_kernels`)."""
    return _build()[1]


#: environment switches that bypass the kernels or their block paths (see sot.kernels.linear)
SWITCHES = ("SOT_NO_BLOCKS", "SOT_NO_FUSED_BLOCKS", "SOT_NO_BF16_BLOCKS", "SOT_NO_BF16_PAIRS",
            "SOT_NO_BF16_ATTENTION", "SOT_NO_KERNELS", "SOT_NO_AMX")


def kernels_key() -> dict:
    """What a timing on this machine depends on besides the model: the build of the kernels
    (``None``: the PyTorch path) and the switches that bypass them. Cached timings (the cost
    curve, the ``--dtype auto`` choice) are keyed on it, so a changed kernel is timed anew."""
    return {"build": build_key() if cpu_kernels() is not None else None,
            "env": {k: os.environ.get(k) for k in SWITCHES}}


@contextlib.contextmanager
def _builder_lock(build: Path) -> Iterator[None]:
    """Hold ``build`` for this process while it builds or loads the kernels there.

    PyTorch's builder marks a build in progress with a file (``lock``) that a killed build
    leaves behind, and every later load then waits for it for ever. This lock is the operating
    system's, released when its holder ends however it ends: a process that holds it knows no
    other SoT process is building there, so a ``lock`` file it finds is stale and goes."""
    try:
        import fcntl
    except ImportError:  # (no POSIX locks: PyTorch's own file alone)
        yield
        return
    with open(build / "builder.lock", "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"sot: waiting for another process building SoT's CPU kernels in {build}", file=sys.stderr)
            fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                warnings.warn(f"removed {stale}, left by a kernel build that was stopped", stacklevel=3)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


@lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernels (``tree_attention_exact``, ``linear_f32``,
    ``linear_blocks_f32``, ``rms_norm_bf16``, ``rms_norm_f32``, ``rope_write``,
    ``row_argmax_f32``, ...), or ``None``
    when they cannot be built here."""
    if os.environ.get("SOT_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        flags, key = _build()
        build = Path(os.environ.get("SOT_CACHE", Path.home() / ".cache" / "sot")) / "kernels" / key
        build.mkdir(parents=True, exist_ok=True)
        with _builder_lock(build):
            return load(
                name="sot_cpu_kernels",
                sources=[str(path) for path in _stage(build)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the fallback
        warnings.warn(f"SoT's CPU kernel could not be built ({exc}); using the PyTorch path", stacklevel=2)
        return None
