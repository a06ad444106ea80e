"""Training a state predictor: the loss falls, resume, init-from, DDP, precision, schedules."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from state_helpers import ROOT, free_port
from sot.drafters.state import (
    load_predictor,
    read_predictor_config,
)
from sot.errors import ConfigError
from sot.models.loading import load_model
from sot.train.data import StateDataset
from sot.train.trainer import fit


def test_trainer_loss_falls_within_a_minute(tiny_run) -> None:
    run = Path(tiny_run["cfg"].out)
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    losses = [h["loss"] for h in state["history"]]
    # a minute on two cores is two minutes of CPU time
    assert tiny_run["cpu_seconds"] < 120, f"training took {tiny_run['cpu_seconds']:.0f} s of CPU time"
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert (run / "loss.png").is_file() and (run / "accept.png").is_file()
    evals = state["evals"]
    assert evals[-1]["chain_tau"] > evals[0]["chain_tau"], "held-out acceptance should improve"


def test_resume_continues_from_the_checkpoint(tiny_run, tmp_path) -> None:
    cfg = tiny_run["cfg"]
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cfg.out, run)
    more = dataclasses.replace(cfg, out=str(run), steps=cfg.steps + 4)
    fit(more)
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["step"] == cfg.steps + 4
    assert [h["step"] for h in state["history"]] == list(range(1, cfg.steps + 5))
    # a finished run asked again with other settings trains nothing, and its config.json
    # still says how it was trained
    before = (run / "config.json").read_text()
    fit(dataclasses.replace(more, unroll=more.unroll + 1, warmup=1))
    assert (run / "config.json").read_text() == before
    with pytest.raises(ConfigError, match="is a file; give the run's folder"):
        fit(dataclasses.replace(more, out=str(run / "config.json")))


def test_init_from_a_predictor_file(tiny_run, tmp_path) -> None:
    """Training can continue from a shipped predictor file (fresh optimizer state)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "more"), steps=2, init_from=str(tiny_run["predictor"]))
    with pytest.raises(ConfigError, match="keeps its file's draft vocabulary"):  # (not silently ignored)
        fit(dataclasses.replace(cfg, draft_vocab=7))
    fit(cfg)
    state = torch.load(tmp_path / "more" / "checkpoint.pt", weights_only=False)
    trained = torch.load(Path(tiny_run["cfg"].out) / "checkpoint.pt", weights_only=False)
    assert state["evals"][0]["chain_tau"] == pytest.approx(trained["evals"][-1]["chain_tau"], abs=0.15)


def test_init_from_grows_decoder_layers(tiny_run, tmp_path) -> None:
    """``decoder_layers`` above the file's adds layers that start as the identity: the first
    evaluation equals the file's, exactly; fewer layers than the file's are refused."""
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "grown"), steps=2, decoder_layers=2,
                              init_from=str(tiny_run["predictor"]))
    fit(cfg)
    grown = read_predictor_config(tmp_path / "grown" / "predictor.safetensors")
    assert grown.decoder_layers == 2
    state = torch.load(tmp_path / "grown" / "checkpoint.pt", weights_only=False)
    groups = state["optimizer"]["param_groups"]  # the added layer (9 tensors) learns 10x faster
    assert [g["scale"] for g in groups] == [1.0, 10.0] and len(groups[1]["params"]) == 9
    assert groups[1]["lr"] == pytest.approx(10 * groups[0]["lr"])
    same = dataclasses.replace(cfg, out=str(tmp_path / "same"), decoder_layers=1)
    fit(same)
    reference = torch.load(tmp_path / "same" / "checkpoint.pt", weights_only=False)
    assert state["evals"][0]["chain_tau"] == reference["evals"][0]["chain_tau"]
    assert state["evals"][0]["reach"] == reference["evals"][0]["reach"]
    fewer = dataclasses.replace(cfg, out=str(tmp_path / "fewer"), decoder_layers=1,
                                init_from=str(tmp_path / "grown" / "predictor.safetensors"))
    with pytest.raises(ConfigError, match="2 decoder layers"):
        fit(fewer)


def test_init_from_recounts_the_draft_vocabulary(tiny_run, tmp_path) -> None:
    """``recount_vocab`` gives a file-started run the ``draft_vocab`` most frequent reply tokens
    of its data (here the file proposes from the whole vocabulary) and keeps the file's
    weights; without ``init_from`` it is refused."""
    target = load_model(str(tiny_run["model_dir"])).model
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "recount"), steps=1, lr=1e-9, warmup=1,
                              draft_vocab=12, recount_vocab=True, init_from=str(tiny_run["predictor"]))
    fit(cfg)
    recounted = load_predictor(tmp_path / "recount" / "predictor.safetensors", target)
    counts = StateDataset(tiny_run["data"] / "train").token_counts(target.config.vocab_size)
    assert recounted.draft_vocab.tolist() == counts.topk(12).indices.sort().values.tolist()
    assert recounted.config.draft_vocab_size == 12
    original = load_predictor(tiny_run["predictor"], target)
    assert original.draft_vocab.numel() == target.config.vocab_size
    assert torch.allclose(recounted.fuse.weight, original.fuse.weight, atol=1e-3)  # one step at lr 1e-9
    with pytest.raises(ConfigError, match="--recount-vocab applies to --init-from"):
        fit(dataclasses.replace(cfg, init_from="", out=str(tmp_path / "fresh")))


def test_ddp_two_processes(tiny_run, tmp_path) -> None:
    """``torchrun`` with 2 CPU processes (gloo) runs the same trainer unchanged (any GPU
    hidden: a one-GPU machine has no device for the second process)."""
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "sot.cli", "train", "fit", "--model", str(tiny_run["model_dir"]), "--data", str(tiny_run["data"]),
           "--out", str(out), "--steps", "3", "--tokens-per-step", "1024", "--unroll", "2", "--draft-vocab", "0",
           "--eval-every", "3", "--save-every", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (out / "predictor.safetensors").is_file()
    assert summary["tokens"] >= 3 * 1024


def test_training_precision_bf16_or_fp32(tiny_run, tmp_path, monkeypatch) -> None:
    """``precision`` picks bf16 autocast or float32 compute (``auto``: bf16 only where the
    hardware has it); both train, and a bad value is refused before any work."""
    from sot.train.trainer import compute_autocast

    cpu = torch.device("cpu")
    with compute_autocast(cpu, "bf16"):
        assert torch.is_autocast_enabled("cpu")
    with compute_autocast(cpu, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    for native in (True, False):
        monkeypatch.setattr("sot.models.loading.native_bf16", lambda device="cpu", v=native: v)
        with compute_autocast(cpu, "auto"):
            assert torch.is_autocast_enabled("cpu") is native
    monkeypatch.undo()
    for precision in ("bf16", "fp32"):
        cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / precision), steps=3, eval_every=100,
                                  save_every=100, precision=precision)
        fit(cfg)
        history = torch.load(tmp_path / precision / "checkpoint.pt", weights_only=False)["history"]
        assert len(history) == 3 and all(math.isfinite(h["loss"]) for h in history)
    with pytest.raises(ConfigError, match="precision must be one of"):
        fit(dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "bad"), precision="fp16"))


def test_stop_after_keeps_the_planned_schedule(tiny_run, tmp_path) -> None:
    """``stop_after`` ends a run early with a checkpoint and a predictor file, while the
    learning rate still follows the schedule planned over ``steps``."""
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "early"), steps=30, stop_after=8, eval_every=100,
                              save_every=100)
    path = fit(cfg)
    ckpt = torch.load(tmp_path / "early" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 8 and len(ckpt["history"]) == 8 and path.is_file()
    # cosine over 30 steps is still near its peak at step 8 (an 8-step schedule would be at its end)
    assert ckpt["history"][-1]["lr"] > 0.8 * cfg.lr
    with pytest.raises(ConfigError, match="--stop-after must be a step number >= 0"):
        fit(dataclasses.replace(cfg, out=str(tmp_path / "bad"), stop_after=-1))
    fit(cfg)  # the same command again: the run stopped there, so it trains nothing more
    assert torch.load(tmp_path / "early" / "checkpoint.pt", weights_only=False)["step"] == 8


def test_an_interrupted_run_keeps_its_steps(tiny_run, tmp_path, monkeypatch) -> None:
    """SIGTERM (a scheduler's stop) saves the steps done since the last save, as Ctrl-C does; the
    same command resumes there, on the same data and noise, so the resumed run ends with the
    weights of one never stopped."""
    import signal

    from sot.train import trainer

    calls = []
    clip = torch.nn.utils.clip_grad_norm_

    def interrupting(*args, **kwargs):  # (called once a step, before the optimizer's step)
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # (fit's handler raises KeyboardInterrupt here)
        return clip(*args, **kwargs)

    monkeypatch.setattr(trainer.torch.nn.utils, "clip_grad_norm_", interrupting)
    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "run"), steps=6, eval_every=100, save_every=100)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (fit puts the handler back)
    from tqdm import tqdm
    assert not [bar for bar in tqdm._instances if bar.desc == "train"]  # (its progress bar is closed)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(trainer.torch.nn.utils, "clip_grad_norm_", clip)
    fit(cfg)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 6 and [h["step"] for h in state["history"]] == list(range(1, 7))
    fit(dataclasses.replace(cfg, out=str(tmp_path / "whole")))
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    assert [h["tokens"] for h in whole["history"]] == [h["tokens"] for h in state["history"]]
    assert all(torch.equal(whole["model"][k], v) for k, v in state["model"].items())


def test_a_diverging_run_stops_and_keeps_its_last_checkpoint(tiny_run, tmp_path) -> None:
    """A loss that stops being finite stops the run with the reason and the way out; no
    predictor of NaN weights is written. An --out folder that holds a model is refused."""
    from sot.train.trainer import Diverged

    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "run"), steps=6, eval_every=100, save_every=100,
                              lr=1e30, warmup=0)
    with pytest.raises(Diverged, match="Lower --lr"):
        fit(cfg)
    assert not (tmp_path / "run" / "predictor.safetensors").exists()
    with pytest.raises(ConfigError, match="that no fit run wrote"):
        fit(dataclasses.replace(tiny_run["cfg"], out=str(tiny_run["model_dir"])))


def test_a_run_resumes_only_with_its_own_settings(tiny_run, tmp_path) -> None:
    """A folder holding a run is resumed with the settings that shape its predictor, its
    target and its data, or refused with the ones that differ; a cache made with another
    model, or one with nothing in it, is refused."""
    from helpers import tiny_model_dir
    from sot.models.loading import load_model
    from sot.train.data import build_state_cache
    from state_helpers import LAYERS

    cfg = dataclasses.replace(tiny_run["cfg"], out=str(tmp_path / "run"), steps=4, stop_after=2, eval_every=100,
                              save_every=100)
    fit(cfg)
    fit(dataclasses.replace(cfg, data=cfg.data + "/"))  # the same folder, written another way: it resumes
    for change, flag in ((dict(draft_vocab=40), "--draft-vocab 0"), (dict(arch="eagle3"), "--arch 'native'")):
        with pytest.raises(ConfigError, match=f"holds a run started with {flag}"):
            fit(dataclasses.replace(cfg, stop_after=0, **change))
    with pytest.raises(ConfigError, match="holds no sequence of 1002 tokens or more"):
        fit(dataclasses.replace(cfg, out=str(tmp_path / "long"), unroll=1000))
    other = tiny_model_dir(tmp_path / "other", seed=1)  # the same shapes, other weights
    with pytest.raises(ConfigError, match="was made with another model"):
        fit(dataclasses.replace(cfg, out=str(tmp_path / "other-run"), model=str(other)))
    loaded = load_model(str(other))
    with pytest.raises(ConfigError, match="nothing to cache"):
        build_state_cache(loaded.model, loaded.tokenizer, [{"prompt": "no reply"}], tmp_path / "empty", LAYERS, None,
                          256, progress=False)
    assert not (tmp_path / "empty" / "meta.json").exists()
    import shutil  # a cache prepared again in its folder is incomplete until the new one is whole

    shutil.copytree(Path(tiny_run["data"]) / "eval", tmp_path / "again")
    with pytest.raises(ConfigError, match="nothing to cache"):
        build_state_cache(loaded.model, loaded.tokenizer, [{"prompt": "no reply"}], tmp_path / "again", LAYERS, None,
                          256, progress=False)
    assert not (tmp_path / "again" / "meta.json").exists()


def test_a_process_without_its_own_gpu_is_refused(monkeypatch) -> None:
    """A node's training process whose local rank has no GPU gets an error that says what to
    run instead (not CUDA's 'invalid device ordinal')."""
    from sot.train import trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="nproc-per-node=1.*CUDA_VISIBLE_DEVICES="):
        trainer._dist_setup()


def test_kept_policy_traces_are_reused_only_with_their_settings(tmp_path) -> None:
    from sot.train.acceptance import PolicyTrainConfig, load_or_collect

    cfg = PolicyTrainConfig(model="m", out=str(tmp_path), prompts=4, temperatures=(0.0,))
    kept = {"features": torch.zeros(1), "config": {k: (list(v) if isinstance(v, tuple) else v)
                                                   for k, v in cfg.__dict__.items()}}
    torch.save(kept, tmp_path / "traces.pt")
    assert load_or_collect(cfg)["config"] == kept["config"]
    with pytest.raises(ConfigError, match=r"collected with --model 'm' \(now 'other'\), --temperatures"):
        load_or_collect(dataclasses.replace(cfg, model="other", temperatures=(0.0, 1.0)))
    # a predictor file replaced at the same path: its traces are not the new predictor's
    predictor = tmp_path / "predictor.safetensors"
    predictor.write_bytes(b"first")
    with_file = dataclasses.replace(cfg, predictor=str(predictor))
    torch.save({**kept, "config": {**kept["config"], "predictor": str(predictor)},
                "predictor_digest": hashlib.sha256(b"first").hexdigest()}, tmp_path / "traces.pt")
    assert load_or_collect(with_file)["predictor_digest"]
    predictor.write_bytes(b"second")
    with pytest.raises(ConfigError, match="the file has changed since"):
        load_or_collect(with_file)
