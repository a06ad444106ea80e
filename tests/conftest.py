import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("SOT_TEST_THREADS", "2")))
# ``--dtype auto`` times both modes once per machine, model and drafter; the suite loads many
# tiny models and the default one with several drafters, so it takes the rule instead.
# tests/test_dtype_choice.py lifts this to test the measurement itself.
os.environ.setdefault("SOT_DTYPE_AUTO", "rule")


@pytest.fixture(autouse=True)
def _batch_guard_off(request, monkeypatch) -> None:
    """The batch guard decides from wall-clock timings, which on tiny models are mostly Python
    overhead and vary from machine to machine; outside tests marked ``guard`` it measures
    nothing, so a test's speculation never depends on how busy the machine is."""
    if request.node.get_closest_marker("guard") is None:
        from sot.policy.guard import BatchGuard

        monkeypatch.setattr(BatchGuard, "observe", lambda self, *args, **kwargs: None)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> dict:
    """A tiny target folder with cached states and a short training run (shared by the
    predictor, training and training-data tests)."""
    import time

    from helpers import tiny_model_dir
    from sot.models.loading import load_model
    from sot.train.data import build_state_cache
    from sot.train.trainer import TrainConfig, fit
    from state_helpers import LAYERS, conversations

    root = tmp_path_factory.mktemp("state")
    model_dir = tiny_model_dir(root / "model")
    loaded = load_model(str(model_dir))
    data = root / "data"
    build_state_cache(loaded.model, loaded.tokenizer, conversations(40), data / "train", LAYERS, None, 256, progress=False)
    build_state_cache(loaded.model, loaded.tokenizer, conversations(6), data / "eval", LAYERS, None, 256, progress=False)
    cfg = TrainConfig(model=str(model_dir), data=str(data), out=str(root / "run"), steps=30, tokens_per_step=1024,
                      lr=3e-3, warmup=5, unroll=3, draft_vocab=0, eval_every=15, eval_sequences=4, eval_depth=4,
                      save_every=10)
    # CPU time of this process, not wall time: other work on a shared machine does not count
    t0 = time.process_time()
    predictor = fit(cfg)
    return {"model_dir": model_dir, "data": data, "cfg": cfg, "predictor": predictor,
            "cpu_seconds": time.process_time() - t0}
