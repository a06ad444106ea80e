"""``--dtype int8``: products in 8-bit integers over GGUF blocks (llama.cpp's arithmetic).
The kernel computes the documented formula, each row on its own; decoding in that mode is
as lossless as in float32; the mode is refused where it cannot run."""
from __future__ import annotations

import pytest
import torch

from helpers import RandomTreeDrafter, blockify, random_blocks, random_prompts, tiny_model
from sot.drafters import NoDrafter, TreeBudget
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.kernels import cpu_kernels
from sot.models.adapter import TargetModel
from sot.models.loading import INT8_ATTR, load_model

PARAMS = GenerationParams(max_new_tokens=40)


def _kernel():
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    return kernel


def _reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The formula of ``linear_int8.cpp`` in float64 with a float32 rounding after each step:
    rows rounded to 8-bit blocks, exact integer block sums, blocks summed in order."""
    rows = x.shape[0]
    xb = x.reshape(rows, -1, 32)
    da = xb.abs().amax(-1) / 127
    qa = torch.round(xb * torch.where(da != 0, 1 / da, torch.zeros_like(da))[..., None]).clamp(-127, 127)
    sa = da * qa.sum(-1)
    dots = torch.einsum("mbt,nbt->mnb", qa.double(), q.double())
    acc = torch.zeros(rows, q.shape[0], dtype=torch.float64)
    for b in range(q.shape[1]):
        scale = (d[None, :, b] * da[:, b, None]).double()
        acc = (acc + dots[:, :, b] * scale).float().double()
        if m is not None:
            acc = (acc + m[None, :, b].double() * sa[:, b, None].double()).float().double()
    return acc.float()


def test_int8_products_follow_the_formula_row_by_row() -> None:
    """4-bit (Q4_1) and 8-bit (Q8_0) blocks: the product is the formula's value, and every
    slice of rows gives the bits of the whole call (rows never depend on each other); a
    weight without blocks of 32 inputs keeps the float32 kernel."""
    from sot.kernels.linear import PackedLinear, pack_int8

    kernel = _kernel()
    gen = torch.Generator().manual_seed(8)
    n, k = 100, 96
    d, low, q4, q8 = random_blocks(n, k, gen)
    x = torch.randn(21, k, generator=gen)
    x[3] = 0.0  # an all-zero row: scale 0
    bias = torch.randn(n, generator=gen)
    for q, m in ((q4, low), (q8, None)):
        w = (d * q + (m if m is not None else 0)).reshape(n, k)
        packed = pack_int8(w)
        assert packed is not None and packed[0].dtype == (torch.uint8 if m is not None else torch.int8)
        full = kernel.linear_int8(x, *packed, n, bias)
        torch.testing.assert_close(full, _reference(x, q, d[..., 0], None if m is None else m[..., 0]) + bias,
                                   rtol=1e-6, atol=1e-6)
        assert not torch.equal(full, x @ w.T + bias)  # activations are rounded: not float32's product
        torch.testing.assert_close(full, x @ w.T + bias, rtol=0.05, atol=0.05 * float(full.abs().max()))
        for lo, hi in ((0, 1), (4, 6), (3, 6), (5, 9), (1, 6), (0, 6), (2, 9), (0, 8), (1, 11), (0, 12), (4, 17)):
            assert torch.equal(kernel.linear_int8(x[lo:hi], *packed, n, bias), full[lo:hi])
        lin = PackedLinear(w, bias, int8=True)
        assert lin.int8 and torch.equal(lin(x[:5], stable=True), full[:5])
    assert pack_int8(torch.randn(n, k, generator=gen)) is None  # not a grid (int8 mode rounds it: below)
    plain = PackedLinear(torch.randn(n, 40, generator=gen), int8=True)  # no blocks of 32 inputs
    assert not plain.int8 and plain.kind == "sot"


def _int8_target(arch: str, gguf: bool, seed: int = 5) -> TargetModel:
    model = tiny_model(arch, seed=seed)
    if gguf:
        model = blockify(model, head=True)
    setattr(model, INT8_ATTR, True)
    return TargetModel(model)


@pytest.mark.parametrize("arch,gguf", [("llama", True), ("qwen3", True), ("llama", False)],
                         ids=["llama", "qwen3", "llama-float-weights"])
def test_int8_decoding_is_lossless(arch: str, gguf: bool) -> None:
    """In the int8 mode, speculative decoding (random trees, batch of three and alone) commits
    the same tokens from the same logits bits as plain decoding, while those logits differ
    from the float32 mode's (a mode of its own). Llama runs the fast path, Qwen3 the generic
    one (its linear modules); float weights (no GGUF blocks) are rounded to Q8_0 first."""
    _kernel()
    target = _int8_target(arch, gguf)
    assert target.int8
    if target.fast is not None:
        assert target.fast.int8_products == 4 * 2 + 1  # (the output layer too)
    prompts = random_prompts((7, 30, 75), seed=1)

    def traced(drafter, batch) -> list[torch.Tensor]:
        out = Engine(target, drafter, TreeBudget(16, 6), trace=True).generate(batch, PARAMS)
        return [torch.stack(r.logit_trace)[: r.new_tokens] for r in out]

    plain = [traced(NoDrafter(), [p])[0] for p in prompts]
    tokens = [t.argmax(-1).tolist() for t in plain]
    spec = traced(RandomTreeDrafter(tokens, [len(p) for p in prompts], hit=0.8, seed=2), prompts)
    for a, b in zip(plain, spec):
        assert torch.equal(a, b)
    if target.fast is None:  # the generic path packs its linear modules at their first call
        packed = [m._sot_packed[1] for m in target.model.modules() if hasattr(m, "_sot_packed")]
        assert packed and all(lin.int8 for lin in packed)
    float_model = tiny_model(arch, seed=5)
    if gguf:
        float_model = blockify(float_model, head=True)
    float_plain = Engine(TargetModel(float_model), NoDrafter(), TreeBudget(16, 6), trace=True).generate(
        [prompts[0]], PARAMS)[0]
    assert not torch.equal(torch.stack(float_plain.logit_trace)[: float_plain.new_tokens][:1], plain[0][:1])


def test_float_weights_round_to_q8_0() -> None:
    """A float weight is rounded as llama.cpp converts to q8_0: per block of 32 inputs a
    float16 scale max|w| / 127 and q = round(w / d), so every weight is within half a step."""
    from sot.kernels.linear import PackedLinear, round_q8_0

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(20, 64, generator=gen)
    w[1, :32] = 0.0  # an all-zero block
    q, d, mins = round_q8_0(w)
    assert mins is None and q.shape == (24, 2, 32) and d.dtype == torch.float32
    assert torch.equal(d, d.half().float()) and int(q.abs().max()) <= 127 and float(d[1, 0]) == 0.0
    rebuilt = (q[:20].float() * d[:20, :, None]).reshape(20, 64)
    assert bool(((rebuilt - w).abs() <= d[:20].repeat_interleave(32, 1) / 2 + 1e-7).all())
    assert round_q8_0(torch.randn(8, 48, generator=gen)) is None
    _kernel()
    lin = PackedLinear(w, int8=True)
    assert lin.int8 and lin.packed[0].dtype == torch.int8


def test_int8_mode_without_blocks_warns_and_off_the_cpu_is_refused() -> None:
    """Products whose input size is no multiple of 32 cannot be cut into blocks: when no
    weight can, a warning says the products stay float32. The mode runs float32 parameters on
    the CPU only."""
    _kernel()
    model = tiny_model("llama", seed=5, hidden_size=48, intermediate_size=80)
    setattr(model, INT8_ATTR, True)
    with pytest.warns(RuntimeWarning, match="multiple of 32"):
        target = TargetModel(model)
    assert target.fast.int8_products == 0
    with pytest.raises(ConfigError, match="int8"):
        load_model("default", dtype=torch.bfloat16, int8=True)


def test_a_kernel_build_stopped_midway_does_not_hang_the_next_load() -> None:
    """PyTorch's builder leaves its ``lock`` file behind when a build is killed, and every
    later load would wait for it for ever: the next process finds it stale (no SoT process
    holds the build) and removes it."""
    import subprocess
    import sys
    from pathlib import Path

    from sot.kernels import build_key

    if cpu_kernels() is None:
        pytest.skip("the compiled CPU kernels cannot be built here")
    import os

    build = Path(os.environ.get("SOT_CACHE", Path.home() / ".cache" / "sot")) / "kernels" / build_key()
    stale = build / "lock"
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-c", "from sot.kernels import cpu_kernels; "
                               "assert cpu_kernels() is not None"], capture_output=True, text=True, timeout=300)
    finally:
        existed = stale.exists()
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and not existed, done.stderr[-2000:]
    assert "left by a kernel build that was stopped" in done.stderr
