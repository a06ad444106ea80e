"""What timings on this machine depend on: processor, its instruction set, cores and threads."""
from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import torch


def _cpuinfo() -> tuple[str, str]:
    """The processor's model name and a digest of its flags (empty where ``/proc/cpuinfo`` is absent)."""
    cpu, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not cpu:
                cpu = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = hashlib.sha256(value.strip().encode()).hexdigest()[:12]
            if cpu and flags:
                break
    except OSError:
        pass
    return cpu, flags


def machine_info() -> dict:
    """Processor, cores, torch threads, SIMD level, native bf16, torch version and the CUDA
    GPU (its name, or ``None`` when none is visible)."""
    from sot.models.loading import native_bf16

    cpu, _ = _cpuinfo()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "simd": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": native_bf16("cpu"), "torch": torch.__version__, "gpu": gpu}


def machine_key() -> dict:
    """:func:`machine_info` with the CPU flags' digest and SoT's version: two machines with the
    same key time alike."""
    from sot import __version__

    info = {k: v for k, v in machine_info().items() if k != "gpu"}  # (keys time CPU work)
    return {**info, "flags": _cpuinfo()[1], "sot": __version__}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_threads(threads: int, flag: str = "threads") -> None:
    """Run this process's passes on ``threads`` CPU threads (``torch.set_num_threads``: the
    whole process), with a warning where that is more than the CPUs it may use: threads that
    share a core wait for each other at every pass. ``flag`` names the setting in the warning."""
    import warnings

    cores = usable_cpus()
    if threads > cores:
        warnings.warn(f"{flag} {threads} is more than the {cores} CPU(s) this process may use: threads that share "
                      "a core wait for each other at every pass, so decoding slows down", stacklevel=3)
    torch.set_num_threads(threads)
