"""On-policy row weights against fit's uniform rows, on the same recorded data and steps.

Replays the recorded on-policy run (runs/onpolicy/main: iteration 0's shards for the first 30
steps, both iterations' after) from the shipped predictor twice: once with the chain and error
weights of `sot train onpolicy`, once with uniform rows only. Writes
runs/onpolicy/ablate-{uniform,chains}.safetensors; walk them with
`python -m sot.analysis.walk_acceptance docs/bench/stage8 sharegpt-heldout humaneval --predictors ...`.
"""
import random
from pathlib import Path

import torch

from sot.drafters import DEFAULT_PREDICTOR
from sot.drafters.state import load_predictor, save_predictor
from sot.models.loading import load_model
from sot.online.loss import OnlineLossConfig, online_loss
from sot.train.onpolicy import read_shard
from sot.train.trainer import warmup_cosine
loaded = load_model("default")
buf = Path("runs/onpolicy/main/buffer")
it0 = [s for f in sorted(buf.glob("shard-000-*.safetensors")) for s in read_shard(f)]
it1 = [s for f in sorted(buf.glob("shard-001-*.safetensors")) for s in read_shard(f)]
for name, loss_cfg in (("uniform", OnlineLossConfig(uniform=1.0, error_weight=0.0)),
                       ("chains", OnlineLossConfig())):
    pred = load_predictor(DEFAULT_PREDICTOR, loaded.model, dtype=torch.float32)
    for p in pred.parameters():
        p.requires_grad_(True)
    pred.head = pred.head.float()
    pred.train()
    opt = torch.optim.AdamW(pred.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(0)
    torch.manual_seed(0)
    for step in range(60):
        items = it0 if step < 30 else it0 + it1
        for g in opt.param_groups:
            g["lr"] = warmup_cosine(step, 3e-4, 10, 120)
        opt.zero_grad()
        batch, n = [], 0
        while n < 2048:
            s = items[rng.randrange(len(items))]
            batch.append(s)
            n += s.length
        for s in batch:
            loss, _ = online_loss(pred, pred, s, loss_cfg, torch.device("cpu"))
            (loss * s.length / n).backward()
        torch.nn.utils.clip_grad_norm_(pred.parameters(), 1.0)
        opt.step()
    save_predictor(pred, f"runs/onpolicy/ablate-{name}.safetensors")
    print(name, "done", flush=True)
