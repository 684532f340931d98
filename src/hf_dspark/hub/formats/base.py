"""What every foreign checkpoint format shares: the writer/reader interface, tensor-shape checks, config fields.

A format module describes one consumer's layout (key names, config fields, target-layer index convention) in
both directions: `export` writes a draft for that consumer, `read` turns such a folder back into an hf_dspark
config + state dict. Expected tensor shapes are always computed from the *written config*, never from the
tensors, so a renaming or shape bug fails here instead of being skipped silently by the consumer's loader.

Exported configs carry an `"hf_dspark"` block holding only the draft fields the format cannot represent
(loss weights, STS temperatures, target identity, ...), so export -> import restores the exact draft. Fields
the format does represent are always read from the format's own keys: editing them in the exported config
wins over anything recorded in the block.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file

# Key of the block in exported configs that records what the foreign format cannot represent.
EXPORT_META_KEY = "hf_dspark"

# Our layer-id convention, stated in every export (see hf_dspark.models.target).
OUR_LAYER_CONVENTION = "id l = raw output of decoder layer l (0-based), -1 = embedding output"

# Config keys that are bookkeeping, never part of the comparison that decides what a format lost.
_BOOKKEEPING_KEYS = {
    "architectures",
    "transformers_version",
    "model_type",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "auto_map",
    "custom_pipelines",
}


class ExportError(ValueError):
    """The draft cannot be written in the requested format; the message says why and what to do instead."""


class ForeignCheckpointError(ValueError):
    """A checkpoint in another tool's layout that cannot be converted into an hf_dspark draft (message says why)."""


@dataclass
class ExportResult:
    """What `export_draft` wrote: the folder, the format, and the notes it put in the folder's README.md."""

    output_dir: Path
    format: str
    architecture: str
    layer_id_convention: str
    serve_command: str | None = None
    notes: list[str] = field(default_factory=list)


class DraftFormat:
    """One foreign layout. Subclasses set the class attributes and implement the four methods."""

    name: ClassVar[str] = ""
    consumer: ClassVar[str] = ""  # who reads it, for messages and notes
    checked_against: ClassVar[str] = ""  # the consumer release whose code the layout was checked against

    def why_not(self, draft) -> str | None:
        """None if `draft` can be written losslessly in this format, else the reason (and the alternative)."""
        raise NotImplementedError

    def export(self, draft, output_dir: Path, **options) -> ExportResult:
        raise NotImplementedError

    @classmethod
    def detect(cls, config: dict) -> bool:
        """Whether a config.json dict is this format's (used for imports)."""
        return False

    def check_import(self, config: dict) -> None:
        """Raise ForeignCheckpointError when a checkpoint with this config can never be imported (before any
        weights are downloaded)."""

    def read(self, config: dict, tensors: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        """(hf_dspark config, state dict with our key names) from a folder in this format."""
        raise ForeignCheckpointError(f"{self.name} checkpoints cannot be imported")

    def refuse(self, draft) -> None:
        reason = self.why_not(draft)
        if reason is not None:
            raise ExportError(f"cannot export this {draft.config.model_type} draft as {self.name!r}: {reason}")

    def write_export(
        self,
        draft,
        output_dir,
        config: dict,
        tensors: dict[str, torch.Tensor],
        *,
        architecture: str,
        convention: str,
        lost: dict[str, Any],
        serve_command: str | None = None,
        notes: list[str] | None = None,
        dtype: torch.dtype | None = None,
        overwrite: bool = False,
    ) -> ExportResult:
        """The common end of every export: cast, record what the format cannot hold (`lost`) and the dtype in the
        config, then write config + weights + README atomically."""
        tensors = cast(tensors, dtype)
        config[EXPORT_META_KEY] = export_meta(draft, self.name, convention, lost)
        config["torch_dtype"] = config["dtype"] = dtype_name(tensors)
        result = ExportResult(Path(output_dir), self.name, architecture, convention, serve_command, list(notes or []))
        readme = notes_readme(result, draft, consumer=self.consumer, checked_against=self.checked_against)
        write_folder(output_dir, config, tensors, readme, overwrite=overwrite)
        return result


# -- tensors ------------------------------------------------------------------------------------------------


def draft_tensors(draft) -> dict[str, torch.Tensor]:
    """The draft's weights under our key names, on CPU, with a tied lm_head written out explicitly.

    Every consumer wants an explicit lm_head (DeepSpec and vLLM write `tie_word_embeddings: false`), and
    safetensors cannot store two names for one tensor, hence the clone.
    """
    state = {}
    seen: dict[int, str] = {}
    for name, tensor in draft.state_dict().items():
        tensor = tensor.detach().to("cpu")
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen[tensor.data_ptr()] = name
        state[name] = tensor.contiguous()
    return state


def rename(tensors: dict[str, torch.Tensor], renames: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Prefix renames applied to every key (first match wins)."""
    out = {}
    for key, value in tensors.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    return out


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast floating tensors (index buffers such as d2t/t2d keep their dtype)."""
    if dtype is None:
        return tensors
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str = "float"  # "float", "int64" or "bool"
    required: bool = True


def check_tensors(
    tensors: dict[str, torch.Tensor],
    spec: dict[str, TensorSpec],
    what: str,
    error: type[Exception] = ForeignCheckpointError,
) -> None:
    """Every key the consumer needs is present with the right shape and kind, and there is no key it would skip.

    `what` names the checkpoint in the message ("the vllm export", "this Qwen3DSparkModel checkpoint"); exports
    raise ExportError (a bug in the conversion), imports ForeignCheckpointError (a damaged or unknown checkpoint).
    """
    problems = []
    missing = [k for k, s in spec.items() if s.required and k not in tensors]
    unexpected = [k for k in tensors if k not in spec]
    if missing:
        problems.append(f"missing {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected {_short(unexpected)}")
    for key, s in spec.items():
        if key not in tensors:
            continue
        t = tensors[key]
        if tuple(t.shape) != s.shape:
            problems.append(f"{key} has shape {tuple(t.shape)}, expected {s.shape}")
        kind = "bool" if t.dtype == torch.bool else "int64" if t.dtype == torch.int64 else (
            "float" if t.is_floating_point() else str(t.dtype)
        )
        if kind != s.kind:
            problems.append(f"{key} is {t.dtype}, expected {s.kind}")
    if problems:
        raise error(f"{what} does not match its config: " + "; ".join(problems))


def _short(keys: list[str], limit: int = 6) -> str:
    keys = sorted(keys)
    head = ", ".join(keys[:limit])
    return head + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def decoder_layer_spec(
    prefix: str,
    c: dict,
    *,
    input_size: int,
    qk_norm: bool,
    extra_norms: tuple[str, ...] = (),
) -> dict[str, TensorSpec]:
    """Shapes of one Llama/Qwen3-style decoder layer read from a config dict (q/k/v take `input_size` inputs)."""
    d, inter = c["hidden_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim") or d // heads
    spec = {
        f"{prefix}self_attn.q_proj.weight": TensorSpec((heads * hd, input_size)),
        f"{prefix}self_attn.k_proj.weight": TensorSpec((kv * hd, input_size)),
        f"{prefix}self_attn.v_proj.weight": TensorSpec((kv * hd, input_size)),
        f"{prefix}self_attn.o_proj.weight": TensorSpec((d, heads * hd)),
        f"{prefix}mlp.gate_proj.weight": TensorSpec((inter, d)),
        f"{prefix}mlp.up_proj.weight": TensorSpec((inter, d)),
        f"{prefix}mlp.down_proj.weight": TensorSpec((d, inter)),
        f"{prefix}input_layernorm.weight": TensorSpec((d,)),
        f"{prefix}post_attention_layernorm.weight": TensorSpec((d,)),
    }
    if c.get("attention_bias"):
        spec[f"{prefix}self_attn.q_proj.bias"] = TensorSpec((heads * hd,))
        spec[f"{prefix}self_attn.k_proj.bias"] = TensorSpec((kv * hd,))
        spec[f"{prefix}self_attn.v_proj.bias"] = TensorSpec((kv * hd,))
        spec[f"{prefix}self_attn.o_proj.bias"] = TensorSpec((d,))
    if c.get("mlp_bias"):
        spec[f"{prefix}mlp.gate_proj.bias"] = TensorSpec((inter,))
        spec[f"{prefix}mlp.up_proj.bias"] = TensorSpec((inter,))
        spec[f"{prefix}mlp.down_proj.bias"] = TensorSpec((d,))
    if qk_norm:
        spec[f"{prefix}self_attn.q_norm.weight"] = TensorSpec((hd,))
        spec[f"{prefix}self_attn.k_norm.weight"] = TensorSpec((hd,))
    for norm in extra_norms:
        spec[f"{prefix}{norm}.weight"] = TensorSpec((d,))
    return spec


# -- configs ------------------------------------------------------------------------------------------------


def architecture_fields(cfg) -> dict[str, Any]:
    """The decoder-architecture fields every Llama/Qwen3-style consumer reads, from a draft config.

    RoPE is written both ways: `rope_parameters` (transformers 5) and `rope_theta`/`rope_scaling` (transformers
    4.x, which older vLLM/SGLang/DeepSpec installs use and which would otherwise fall back to theta 10000).
    """
    rope = dict(cfg.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.initializer_range,
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta"),
        "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": False,
        "use_cache": True,
    }


def architecture_kwargs(c: dict) -> dict[str, Any]:
    """Draft-config kwargs from a Llama/Qwen3-style config dict (the inverse of `architecture_fields`)."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [k for k in required if c.get(k) is None]
    if missing:
        raise ForeignCheckpointError(f"config.json lacks {', '.join(missing)}")
    kwargs = {
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        "hidden_act": c.get("hidden_act", "silu"),
        "rms_norm_eps": c.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": c.get("max_position_embeddings", 32768),
        "attention_bias": bool(c.get("attention_bias", False)),
        "attention_dropout": c.get("attention_dropout", 0.0),
        "mlp_bias": bool(c.get("mlp_bias", False)),
        "rope_parameters": rope_parameters(c),
        "pad_token_id": c.get("pad_token_id"),
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_id": c.get("eos_token_id"),
    }
    if c.get("initializer_range") is not None:
        kwargs["initializer_range"] = c["initializer_range"]
    return kwargs


def rope_parameters(c: dict) -> dict[str, Any]:
    """RoPE parameters from either convention (`rope_parameters`, or legacy `rope_theta` + `rope_scaling`)."""
    rope = c.get("rope_parameters")
    if rope:
        rope = dict(rope)
        if "rope_type" not in rope and "full_attention" in rope:  # per-layer-type layout
            rope = dict(rope["full_attention"])
        rope.setdefault("rope_type", "default")
        if "rope_theta" not in rope and c.get("rope_theta") is not None:
            rope["rope_theta"] = c["rope_theta"]
        return rope
    scaling = dict(c.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    return {"rope_type": rope_type, **scaling, "rope_theta": float(c.get("rope_theta", 10000.0))}


def config_diff(original, rebuilt) -> dict[str, Any]:
    """Fields of `original` (a draft config) that `rebuilt` does not reproduce: what a format cannot hold."""
    ours, theirs = original.to_dict(), rebuilt.to_dict()
    return {
        k: v for k, v in ours.items() if k not in _BOOKKEEPING_KEYS and not k.startswith("_") and theirs.get(k) != v
    }


def export_meta(draft, fmt: str, layer_convention: str, lost: dict[str, Any]) -> dict[str, Any]:
    from ... import __version__

    return {
        "version": __version__,
        "drafter": draft.config.model_type,
        "export_format": fmt,
        "target_layer_id_convention": layer_convention,
        "config": lost,
    }


def apply_export_meta(config, c: dict):
    """Restore the fields an export recorded because its format cannot represent them."""
    meta = c.get(EXPORT_META_KEY) or {}
    for key, value in (meta.get("config") or {}).items():
        setattr(config, key, value)
    if meta.get("config"):
        config.check_draft_fields()
    return config


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    for t in tensors.values():
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


# -- writing ------------------------------------------------------------------------------------------------


def write_folder(
    output_dir: str | os.PathLike,
    config: dict,
    tensors: dict[str, torch.Tensor],
    readme: str,
    *,
    overwrite: bool = False,
) -> Path:
    """Write config.json + model.safetensors + README.md atomically (staging folder, then rename).

    An existing non-empty folder is never overwritten unless `overwrite=True`.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{output_dir} exists and is not empty: choose another output_dir or pass overwrite=True")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.tmp-"))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "README.md").write_text(readme, encoding="utf-8")
        if output_dir.exists():
            shutil.rmtree(output_dir)
        staging.rename(output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def notes_readme(result: ExportResult, draft, extra: str = "", *, consumer: str, checked_against: str) -> str:
    """The README.md of an export folder: what it is, who reads it, the layer-id convention, how to serve it."""
    cfg = draft.config
    lines = [
        f"# {cfg.model_type} draft exported by hf_dspark ({result.format} format)",
        "",
        f"- consumer: {consumer}",
        f"- checked against: {checked_against}",
        f"- architecture: `{result.architecture}`",
        f"- target: `{cfg.target_name_or_path or 'unknown'}` ({cfg.target_model_type or 'unknown'}, "
        f"{cfg.num_target_layers or '?'} layers)",
        f"- target-layer ids in this config: {result.layer_id_convention}",
        f"- hf_dspark ids: `{list(cfg.target_layer_ids)}` ({OUR_LAYER_CONVENTION})",
    ]
    lines += [f"- {note}" for note in result.notes]
    if result.serve_command:
        lines += ["", "## Serve", "", "```bash", result.serve_command, "```"]
        lines += ["", "Not yet run on a GPU by hf_dspark: the layout was checked on CPU against the consumer's own code "
                  "(scripts/check_exports.sh)."]
    lines += [
        "",
        "## Load back into hf_dspark",
        "",
        "```python",
        "from hf_dspark.hub import load_draft",
        f'draft = load_draft("{result.output_dir.name}")',
        "```",
    ]
    if extra:
        lines += ["", extra]
    return "\n".join(lines) + "\n"


def block_layer_reasons(cfg, consumer: str) -> list[str]:
    """Why a draft's decoder layers do not fit a Qwen3 layout (q_norm/k_norm always on, plain embeddings)."""
    reasons = []
    if not cfg.use_qk_norm:
        reasons.append(
            f"{consumer} always applies q_norm/k_norm (Qwen3 attention) but this draft has none "
            f"(its target is {cfg.target_model_type or 'not Qwen3-like'}); train the draft with q/k norm: "
            "`from_target(target, use_qk_norm=True)` or `hf-dspark train --use_qk_norm true`"
        )
    if cfg.embedding_multiplier != 1.0:
        reasons.append(
            f"{consumer} has no embedding multiplier (this draft scales embeddings by {cfg.embedding_multiplier:g})"
        )
    if cfg.final_logit_softcapping is not None:
        reasons.append(f"{consumer} has no logit soft-capping (this draft caps at {cfg.final_logit_softcapping})")
    if cfg.embedding_multiplier != 1.0 or cfg.final_logit_softcapping is not None:
        # DeepSpec and vLLM 0.33.0 do serve Gemma-4 DSpark drafts, but as Gemma4DSparkModel, whose layers are
        # Gemma-4 layers (v_norm, pre/post-feedforward norms; deepspec/modeling/dspark/gemma4/modeling.py).
        reasons.append(
            "the Gemma-4 DSpark layout of DeepSpec and vLLM (Gemma4DSparkModel) has Gemma-4 decoder layers "
            "(v_norm, pre/post-feedforward norms) that hf_dspark's Qwen3-style draft layers cannot be written as; "
            "Gemma-family drafts can only be served through hf_dspark (target.generate(assistant_model=draft))"
        )
    if cfg.mlp_bias:
        reasons.append(f"the MLP of {consumer} has no biases")
    if cfg.target_hidden_size != cfg.hidden_size:
        reasons.append(
            f"{consumer} sizes fc from the draft's own hidden size; this draft's target hidden size "
            f"{cfg.target_hidden_size} differs from its hidden size {cfg.hidden_size}"
        )
    return reasons


# -- target identity ----------------------------------------------------------------------------------------

# Targets hf_dspark records under a local name or path -> (Hub id, licence). Matched on the folder name.
KNOWN_TARGETS = {"smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}


def looks_like_hub_id(name: str | None) -> bool:
    """`org/name` that is not an existing local path."""
    if not name or os.path.exists(name):
        return False
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def known_target(name: str | None) -> tuple[str, str] | None:
    """(Hub id, licence) of a target hf_dspark knows by its local name/path (the embedded default target)."""
    if not name:
        return None
    return KNOWN_TARGETS.get(Path(str(name).rstrip("/")).name.lower())


def target_hub_id(name: str | None) -> str | None:
    """The target's Hub id, or None when it is recorded only as a local path or an unknown bare name."""
    known = known_target(name)
    if known:
        return known[0]
    return name if looks_like_hub_id(name) else None


def target_for_commands(cfg) -> str:
    """What to put as the target in serve commands: its Hub id, else the recorded name, else a placeholder."""
    return target_hub_id(cfg.target_name_or_path) or cfg.target_name_or_path or "TARGET_MODEL"


def strictly_increasing(ids) -> bool:
    return all(a < b for a, b in zip(ids, ids[1:]))


__all__ = [
    "EXPORT_META_KEY",
    "OUR_LAYER_CONVENTION",
    "DraftFormat",
    "ExportError",
    "ExportResult",
    "ForeignCheckpointError",
    "TensorSpec",
    "apply_export_meta",
    "architecture_fields",
    "architecture_kwargs",
    "block_layer_reasons",
    "cast",
    "check_tensors",
    "known_target",
    "looks_like_hub_id",
    "target_for_commands",
    "target_hub_id",
    "config_diff",
    "decoder_layer_spec",
    "draft_tensors",
    "dtype_name",
    "export_meta",
    "notes_readme",
    "rename",
    "rope_parameters",
    "strictly_increasing",
    "write_folder",
]
