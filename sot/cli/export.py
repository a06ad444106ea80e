"""``sot export``: write a trained state predictor in a format other engines serve."""
from __future__ import annotations

import argparse
import sys

from sot.cli.common import FLOAT_DTYPE_CHOICES

#: formats ``sot export`` writes
EXPORT_FORMATS = ("eagle3",)
#: weight dtypes of an exported checkpoint: the engine's, without ``auto``
EXPORT_DTYPES = tuple(d for d in FLOAT_DTYPE_CHOICES if d != "auto")


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a state predictor as an EAGLE-3 draft head for vLLM and SGLang")
    p.add_argument("predictor", help="a state predictor file trained with 'sot train fit --arch eagle3'")
    p.add_argument("out_dir", help="folder to write: config.json and model.safetensors")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="eagle3", help="checkpoint layout (default: eagle3)")
    p.add_argument("--model", default="default", help="the target model the predictor was trained for")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="bfloat16", help="dtype of the written weights")


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from sot.drafters.state import load_predictor
    from sot.drafters.state.eagle3 import check_export_folder, export_eagle3, layer_ids
    from sot.errors import SoTError
    from sot.models.loading import load_model, resolve_dtype

    if not Path(args.predictor).exists():  # (before the target loads)
        raise SoTError(f"predictor file {args.predictor} does not exist")
    check_export_folder(Path(args.out_dir))
    model = load_model(args.model, dtype=torch.float32).model
    pred = load_predictor(args.predictor, model)
    out = export_eagle3(pred, args.out_dir, model, dtype=resolve_dtype(args.dtype))
    ids = layer_ids(pred.config.state_layers)
    print(f"wrote {out}/config.json and model.safetensors: EAGLE-3 head, draft vocabulary "
          f"{pred.draft_vocab.numel():,}, input layers {ids['vllm']} (vLLM; SGLang counts them as {ids['sglang']})",
          file=sys.stderr)
    return 0
