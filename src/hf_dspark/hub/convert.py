"""Export drafts to other tools' layouts and load checkpoints written by them (DeepSpec, vLLM, SGLang, speculators).

    export_draft(draft, "vllm", "out/")        # -> ExportResult (folder + notes)
    draft = load_draft("deepseek-ai/dspark_qwen3_4b_block7")   # any supported layout, local or on the Hub

`load_draft` reads config.json first: an hf_dspark folder (model_type dspark/dflash/eagle3) loads through
`from_pretrained`; a foreign layout is detected from its config (hub/formats), its tensors are checked against
the shapes its config implies (a key the consumer needs but that is missing, or one it would skip, is an
error) and renamed, and the draft is built on the meta device and filled with the loaded tensors (no random
initialisation, no second copy). `DraftPreTrainedModel.from_pretrained` still reaches the same code through
`foreign_format` + `load_foreign_draft`, with a FutureWarning: `load_draft` is the entry for foreign layouts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..models import DRAFTERS, DraftPreTrainedModel
from .formats import ExportError, ExportResult, ForeignCheckpointError, detect_format, get_format
from .peft_utils import refuse_attached_lora
from ..resources import resolve_dtype

_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder", "proxies")
# from_pretrained arguments that have no meaning for a converted checkpoint (always safetensors, no remote code).
_IGNORED_LOAD_KWARGS = ("trust_remote_code", "low_cpu_mem_usage", "use_safetensors")
# -- export -------------------------------------------------------------------------------------------------


def export_draft(
    draft,
    format: str,
    output_dir: str | os.PathLike,
    *,
    dtype=None,
    overwrite: bool = False,
    **options,
) -> ExportResult:
    """Write `draft` (a draft model or a folder/Hub id holding one) in another tool's layout.

    format: "vllm", "sglang", "speculators", "deepspec" or "dflash" (see hf_dspark.hub.formats for what each
    holds and refuses). dtype: cast floating weights (e.g. "bf16" for serving); default keeps them.
    options: num_speculative_tokens (serve command / speculators proposal), verifier (speculators: the
    target's Hub id when the draft config does not record one).
    Raises ExportError (a ValueError) naming the reason when the format cannot represent the draft.
    """
    fmt = get_format(format)
    if isinstance(draft, (str, os.PathLike)):
        draft = load_draft(draft)
    if not isinstance(draft, DraftPreTrainedModel):
        raise TypeError(
            f"export_draft needs an hf_dspark draft model or a folder holding one, got {type(draft).__name__}"
        )
    refuse_attached_lora(draft, "export it")
    reason = unlisted_format_reason(fmt, draft.config)
    if reason is not None:
        raise ExportError(f"cannot export this {draft.config.model_type} draft as {fmt.name!r}: {reason}")
    return fmt.export(draft, Path(output_dir), dtype=resolve_dtype(dtype), overwrite=overwrite, **options)


def unlisted_format_reason(fmt, config) -> str | None:
    """Why `fmt` refuses a drafter whose registry entry does not list it (None when it does: the format's own
    checks decide)."""
    spec = DRAFTERS.get(config.model_type)
    if spec is not None and fmt.name in spec.export_formats:
        return None
    formats = ", ".join(spec.export_formats) if spec is not None and spec.export_formats else "none"
    return f"the {fmt.name} exporter does not handle {config.model_type} drafts (exportable as: {formats})"


# -- reading folders and Hub repos --------------------------------------------------------------------------


def _split_hub_kwargs(kwargs: dict) -> dict:
    return {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}


def read_config(path_or_repo: str | os.PathLike, **hub_kwargs) -> dict:
    """config.json of a local folder or a Hub repo, as a dict."""
    subfolder = hub_kwargs.get("subfolder") or ""
    local = Path(path_or_repo) / subfolder
    if local.is_dir():
        file = local / "config.json"
        if not file.exists():
            raise FileNotFoundError(f"{local} has no config.json: it is not a saved model folder")
    else:
        from huggingface_hub import hf_hub_download

        kwargs = {k: v for k, v in hub_kwargs.items() if k in _HUB_KWARGS}
        file = hf_hub_download(str(path_or_repo), "config.json", **kwargs)
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)


def _weights_folder(path_or_repo, **hub_kwargs) -> Path:
    subfolder = hub_kwargs.pop("subfolder", None) or ""
    local = Path(path_or_repo) / subfolder
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder}/" if subfolder else ""
    patterns = [f"{prefix}config.json", f"{prefix}*.safetensors", f"{prefix}*.safetensors.index.json"]
    kwargs = {k: v for k, v in hub_kwargs.items() if k in _HUB_KWARGS}
    return Path(snapshot_download(str(path_or_repo), allow_patterns=patterns, **kwargs)) / subfolder


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ForeignCheckpointError(
            f"{folder} has no .safetensors weights (pickled .bin checkpoints are not read: re-save them with "
            "safetensors first)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file))
        clash = set(part) & set(tensors)
        if clash:
            raise ForeignCheckpointError(
                f"{file.name} repeats tensors already read from another shard: {sorted(clash)[:3]}"
            )
        tensors.update(part)
    return tensors


# -- import -------------------------------------------------------------------------------------------------


def foreign_format(path_or_repo, **kwargs) -> str | None:
    """Name of the foreign layout of a folder/repo, or None (hf_dspark's own, unknown, or unreadable).

    Never raises: `from_pretrained` calls it first and leaves every other case to transformers.
    """
    hub_kwargs = {k: v for k, v in kwargs.items() if k in _HUB_KWARGS}
    try:
        config = read_config(path_or_repo, **hub_kwargs)
    except Exception:
        return None
    if config.get("model_type") in DRAFTERS:
        return None
    fmt = detect_format(config)
    return fmt.name if fmt is not None else None


def load_foreign_draft(
    path_or_repo,
    *,
    expected_class: type | None = None,
    target=None,
    dtype=None,
    torch_dtype=None,
    device_map=None,
    attn_implementation: str | None = None,
    **kwargs,
) -> DraftPreTrainedModel:
    """Build an hf_dspark draft from a checkpoint in another tool's layout (DeepSpec, vLLM, SGLang, speculators).

    target: the target model (or its path), needed only when the checkpoint omits the embeddings or lm_head
    that its consumer borrows from the target (common for Eagle3 exports). dtype: cast after loading (default:
    the stored dtype). Other keyword arguments override config fields (as in `from_pretrained`).
    """
    hub_kwargs = _split_hub_kwargs(kwargs)
    config_dict = read_config(path_or_repo, **hub_kwargs)
    fmt = detect_format(config_dict)
    if fmt is None:
        raise ForeignCheckpointError(
            f"{path_or_repo} is not in a layout hf_dspark can import (architectures "
            f"{config_dict.get('architectures')}, model_type {config_dict.get('model_type')!r})"
        )
    fmt.check_import(config_dict)
    tensors = read_safetensors(_weights_folder(path_or_repo, **hub_kwargs))
    _fill_target_io(config_dict, tensors, target, fmt.name)
    config, state = fmt.read(config_dict, tensors)
    for key, value in kwargs.items():
        if key in _IGNORED_LOAD_KWARGS:
            continue
        if key not in config.to_dict():
            raise TypeError(f"unexpected keyword argument {key!r} for loading a converted {fmt.name} checkpoint")
        setattr(config, key, value)
    config.check_draft_fields()
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model_cls = DRAFTERS[config.model_type].model_class
    if expected_class is not None and not issubclass(model_cls, expected_class):
        raise ValueError(
            f"{path_or_repo} holds a {config.model_type} draft ({fmt.name} layout), not a "
            f"{expected_class.__name__}: load it with hf_dspark.load_draft(path)"
        )
    model = build_draft(model_cls, config, state, str(path_or_repo))
    dtype = resolve_dtype(dtype if dtype is not None else torch_dtype)
    if dtype is not None:
        model = model.to(dtype)
    if device_map is not None:
        if isinstance(device_map, dict):
            raise ValueError("converted checkpoints load on one device: pass device_map='cuda' (or a torch.device)")
        if device_map == "auto":
            device_map = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(device_map)
    model.config.dtype = next(model.parameters()).dtype
    return model.eval()


def build_draft(model_cls, config, state: dict[str, torch.Tensor], source: str) -> DraftPreTrainedModel:
    """Instantiate on the meta device and take the loaded tensors as parameters (strict: no key left over)."""
    with torch.device("meta"):
        model = model_cls(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ForeignCheckpointError(
            f"{source}: converted weights do not match a {config.model_type} draft (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.freeze_target_io()
    model.name_or_path = source
    model.config._name_or_path = source
    return model


def _fill_target_io(config: dict, tensors: dict, target, fmt: str) -> None:
    """Consumers often borrow embed_tokens/lm_head from the target; take them from `target` when absent."""
    needed = [k for k in ("embed_tokens.weight", "lm_head.weight") if k not in tensors]
    if not needed:
        return
    if target is None:
        raise ForeignCheckpointError(
            f"this {fmt} checkpoint omits {', '.join(needed)} (its consumer takes them from the target model); "
            "pass target=<the target model or its path> to load it"
        )
    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target)
    embed = target.get_input_embeddings().weight.detach().to("cpu")
    head = target.get_output_embeddings().weight.detach().to("cpu")
    for key, value in (("embed_tokens.weight", embed), ("lm_head.weight", head)):
        if key in needed:
            tensors[key] = value.clone().contiguous()


def load_draft(path_or_repo, *, target=None, **kwargs) -> DraftPreTrainedModel:
    """Load any draft: an hf_dspark folder/repo, or a DeepSpec / vLLM / SGLang / speculators checkpoint."""
    hub_kwargs = {k: v for k, v in kwargs.items() if k in _HUB_KWARGS}
    config = read_config(path_or_repo, **hub_kwargs)
    model_type = config.get("model_type")
    if model_type in DRAFTERS:
        return DRAFTERS[model_type].model_class.from_pretrained(path_or_repo, **kwargs)
    if detect_format(config) is not None:
        return load_foreign_draft(path_or_repo, target=target, **kwargs)
    raise ValueError(
        f"{path_or_repo} is neither an hf_dspark draft (model_type {', '.join(DRAFTERS)}) nor a checkpoint in a "
        f"layout hf_dspark imports (DeepSpec, vLLM/SGLang Eagle3, speculators): architectures "
        f"{config.get('architectures')}, model_type {model_type!r}"
    )


__all__ = [
    "export_draft",
    "foreign_format",
    "load_draft",
    "load_foreign_draft",
    "read_config",
    "read_safetensors",
    "resolve_dtype",
    "unlisted_format_reason",
]
