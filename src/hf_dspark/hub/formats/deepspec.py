"""DeepSpec layout (github.com/deepseek-ai/DeepSpec): `Qwen3DSparkModel` (DSpark and DFlash) and `Qwen3Eagle3Model`.

The released `deepseek-ai/{dspark,dflash}_qwen3_*_block7` and `deepseek-ai/eagle3_qwen3_*_ttt7` checkpoints are
plain `save_pretrained` folders: config = a copy of the target's Qwen3 config (`model_type: "qwen3"`) plus the
draft fields, weights under flat names (FORMATS.md). hf_dspark uses the same flat names, so the conversion is:

- config: Qwen3 architecture fields <-> draft config; `use_qk_norm` is implied (Qwen3 attention always has
  q_norm/k_norm), DFlash = `markov_rank: 0` without confidence head, `tie_word_embeddings` is always false
  (lm_head written explicitly), `layer_types` all "full_attention";
- weights: identical names, except the RNN Markov head's projection, which DeepSpec calls
  `markov_head.joint_proj` (hf_dspark: `markov_head.rnn_proj`; same [s; W1[x]; h] -> [gate; cand; out] layout);
- target-layer ids: the same convention as hf_dspark (DeepSpec reads `hidden_states[l + 1]`, -1 = embeddings),
  strictly increasing (DeepSpec asserts it). DeepSpec's Eagle3 takes exactly 5 decoder layers (no -1).

vLLM serves this same layout (`Qwen3DSparkModel` -> `Qwen3DSparkForCausalLM`, method "dspark"); see vllm.py.
"""

from __future__ import annotations

from pathlib import Path

from ...models import DFlashConfig, DSparkConfig, Eagle3Config
from .base import (
    OUR_LAYER_CONVENTION,
    DraftFormat,
    ExportError,
    ExportResult,
    ForeignCheckpointError,
    TensorSpec,
    apply_export_meta,
    architecture_fields,
    architecture_kwargs,
    block_layer_reasons,
    check_tensors,
    config_diff,
    decoder_layer_spec,
    draft_tensors,
    rename,
    strictly_increasing,
    target_for_commands,
)

BLOCK_ARCHITECTURE = "Qwen3DSparkModel"
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
DEEPSPEC_EAGLE3_NUM_LAYERS = 5  # DeepSpec's Eagle3 v1 asserts exactly five target layers

# hf_dspark name -> DeepSpec name (prefix renames; everything else is identical).
_TO_DEEPSPEC = [("markov_head.rnn_proj.", "markov_head.joint_proj.")]
_FROM_DEEPSPEC = [(new, old) for old, new in _TO_DEEPSPEC]


# -- Qwen3DSparkModel (DSpark, DFlash) ----------------------------------------------------------------------


def block_config(cfg) -> dict:
    """config.json of a Qwen3DSparkModel folder for a DSpark/DFlash draft config."""
    rank = cfg.markov_rank if cfg.model_type == "dspark" else 0
    c = {"architectures": [BLOCK_ARCHITECTURE], "model_type": "qwen3", **architecture_fields(cfg)}
    c.update(
        {
            "layer_types": ["full_attention"] * cfg.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.num_hidden_layers,
            "num_target_layers": cfg.num_target_layers,
            "target_hidden_size": cfg.target_hidden_size,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "num_anchors": cfg.num_anchors,
            "markov_rank": rank,
            "enable_confidence_head": bool(cfg.enable_confidence_head),
        }
    )
    # DeepSpec writes these two only when they apply; its loader asserts on them in that case.
    if rank > 0:
        c["markov_head_type"] = cfg.markov_head_type
    if cfg.enable_confidence_head:
        c["confidence_head_with_markov"] = bool(cfg.confidence_head_with_markov)
    return c


def block_config_from(c: dict):
    """hf_dspark DSparkConfig / DFlashConfig from a Qwen3DSparkModel config dict."""
    for key in ("target_layer_ids", "mask_token_id", "block_size", "num_hidden_layers"):
        if c.get(key) is None:
            raise ForeignCheckpointError(f"this {BLOCK_ARCHITECTURE} config lacks `{key}`, which DeepSpec requires")
    kwargs = architecture_kwargs(c)
    kwargs.update(
        num_hidden_layers=c["num_hidden_layers"],
        target_layer_ids=list(c["target_layer_ids"]),
        num_target_layers=c.get("num_target_layers"),
        target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        block_size=c["block_size"],
        mask_token_id=c["mask_token_id"],
        num_anchors=c.get("num_anchors", 512),
        use_qk_norm=True,
        target_model_type="qwen3",
        tie_word_embeddings=False,
    )
    rank = int(c.get("markov_rank", 0) or 0)
    confidence = bool(c.get("enable_confidence_head", False))
    if rank == 0 and not confidence:
        return DFlashConfig(**kwargs)
    if rank > 0 and not c.get("markov_head_type"):
        raise ForeignCheckpointError(f"markov_rank={rank} but the config has no `markov_head_type`")
    if confidence and "confidence_head_with_markov" not in c:
        raise ForeignCheckpointError(
            "enable_confidence_head is true but the config has no `confidence_head_with_markov`"
        )
    return DSparkConfig(
        **kwargs,
        markov_rank=rank,
        markov_head_type=c.get("markov_head_type") if rank > 0 else None,
        enable_confidence_head=confidence,
        confidence_head_with_markov=bool(c.get("confidence_head_with_markov", False)) if confidence else False,
        confidence_head_alpha=1.0 if confidence else 0.0,
    )


def _draft_io_spec(c: dict) -> dict[str, TensorSpec]:
    """The tensors both DeepSpec drafters hold around their layers: embeddings, lm_head, final norm, feature fc."""
    d, vocab = c["hidden_size"], c["vocab_size"]
    m, target_d = len(c["target_layer_ids"]), c.get("target_hidden_size") or d
    return {
        "embed_tokens.weight": TensorSpec((vocab, d)),
        "lm_head.weight": TensorSpec((vocab, d)),
        "norm.weight": TensorSpec((d,)),
        "fc.weight": TensorSpec((d, m * target_d)),
    }


def block_spec(c: dict) -> dict[str, TensorSpec]:
    """Every tensor a Qwen3DSparkModel folder holds, with shapes computed from its config."""
    d, vocab = c["hidden_size"], c["vocab_size"]
    spec = {**_draft_io_spec(c), "hidden_norm.weight": TensorSpec((d,))}
    for i in range(c["num_hidden_layers"]):
        spec.update(decoder_layer_spec(f"layers.{i}.", c, input_size=d, qk_norm=True))
    rank = int(c.get("markov_rank", 0) or 0)
    if rank > 0:
        spec["markov_head.markov_w1.weight"] = TensorSpec((vocab, rank))
        spec["markov_head.markov_w2.weight"] = TensorSpec((vocab, rank))
        head = c.get("markov_head_type")
        if head == "gated":
            spec["markov_head.gate_proj.weight"] = TensorSpec((rank, d + rank))
            spec["markov_head.gate_proj.bias"] = TensorSpec((rank,))
        elif head == "rnn":
            spec["markov_head.joint_proj.weight"] = TensorSpec((3 * rank, 2 * rank + d))
            spec["markov_head.joint_proj.bias"] = TensorSpec((3 * rank,))
    if c.get("enable_confidence_head"):
        width = d + (rank if c.get("confidence_head_with_markov") else 0)
        spec["confidence_head.proj.weight"] = TensorSpec((1, width))
        spec["confidence_head.proj.bias"] = TensorSpec((1,))
    return spec


def block_reasons(draft, consumer: str) -> list[str]:
    cfg = draft.config
    reasons = block_layer_reasons(cfg, consumer)
    if not strictly_increasing(list(cfg.target_layer_ids)):
        reasons.append(f"{consumer} requires strictly increasing target_layer_ids, got {list(cfg.target_layer_ids)}")
    if cfg.num_target_layers is None:
        reasons.append("the draft config does not record num_target_layers (build the draft with from_target)")
    return reasons


# -- Qwen3Eagle3Model ---------------------------------------------------------------------------------------


def eagle3_config(cfg) -> dict:
    c = {"architectures": [EAGLE3_ARCHITECTURE], "model_type": "qwen3", **architecture_fields(cfg)}
    c.update(
        {
            "layer_types": ["full_attention"],
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 1,
            "num_target_layers": cfg.num_target_layers,
            "target_hidden_size": cfg.target_hidden_size,
            "target_layer_ids": list(cfg.target_layer_ids),
            "ttt_length": cfg.ttt_length,
            "step_loss_decay": cfg.step_loss_decay,
            # DeepSpec's Eagle3 evaluator reads this (deepspec/eval/eagle3/evaluator.py asserts it is 1).
            "draft_num_hidden_layers": 1,
            "target_model_name_or_path": target_for_commands(cfg),
        }
    )
    return c


def eagle3_config_from(c: dict) -> Eagle3Config:
    if c.get("target_layer_ids") is None:
        raise ForeignCheckpointError(f"this {EAGLE3_ARCHITECTURE} config lacks `target_layer_ids`")
    kwargs = architecture_kwargs(c)
    return Eagle3Config(
        **kwargs,
        num_hidden_layers=1,
        target_layer_ids=list(c["target_layer_ids"]),
        num_target_layers=c.get("num_target_layers"),
        target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        ttt_length=c.get("ttt_length", 7),
        step_loss_decay=c.get("step_loss_decay", 0.8),
        use_qk_norm=True,
        target_model_type="qwen3",
        tie_word_embeddings=False,
    )


def eagle3_spec(c: dict) -> dict[str, TensorSpec]:
    d = c["hidden_size"]
    spec = _draft_io_spec(c)
    spec.update(decoder_layer_spec("layers.0.", c, input_size=2 * d, qk_norm=True, extra_norms=("hidden_norm",)))
    return spec


# -- the format ---------------------------------------------------------------------------------------------


class DeepSpecFormat(DraftFormat):
    name = "deepspec"
    checked_against = "DeepSpec afdfa7c (its Qwen3DSparkModel / Qwen3Eagle3Model.from_pretrained load the export)"
    consumer = "DeepSpec (deepseek-ai/DeepSpec: training, eval.py) and vLLM's Qwen3DSparkModel loader"

    def why_not(self, draft) -> str | None:
        cfg = draft.config
        if cfg.model_type in ("dspark", "dflash"):
            reasons = block_reasons(draft, f"DeepSpec's {BLOCK_ARCHITECTURE}")
        elif cfg.model_type == "eagle3":
            reasons = block_layer_reasons(cfg, f"DeepSpec's {EAGLE3_ARCHITECTURE}")
            ids = list(cfg.target_layer_ids)
            if len(ids) != DEEPSPEC_EAGLE3_NUM_LAYERS or min(ids) < 0 or not strictly_increasing(ids):
                reasons.append(
                    f"DeepSpec's Eagle3 reads exactly {DEEPSPEC_EAGLE3_NUM_LAYERS} strictly increasing decoder "
                    f"layers (no -1), this draft reads {ids}"
                )
            if cfg.norm_before_residual:
                reasons.append("DeepSpec's Eagle3 has no norm_before_residual option")
        else:
            return f"DeepSpec has no {cfg.model_type} drafter"
        return "; ".join(reasons) or None

    def build(self, draft) -> tuple[dict, dict, str]:
        """(config dict, tensors, architecture) without writing anything (shared with the vLLM format)."""
        self.refuse(draft)
        cfg = draft.config
        tensors = draft_tensors(draft)
        if cfg.model_type == "eagle3":
            config, spec, arch = eagle3_config(cfg), eagle3_spec, EAGLE3_ARCHITECTURE
        else:
            config, spec, arch = block_config(cfg), block_spec, BLOCK_ARCHITECTURE
            tensors = rename(tensors, _TO_DEEPSPEC)
        check_tensors(tensors, spec(config), f"the {self.name} export", ExportError)
        return config, tensors, arch

    def export(self, draft, output_dir: Path, *, dtype=None, overwrite: bool = False, **options) -> ExportResult:
        config, tensors, arch = self.build(draft)
        notes = []
        if arch == BLOCK_ARCHITECTURE and draft.config.model_type == "dflash":
            notes.append("DFlash is written as Qwen3DSparkModel with markov_rank 0 and no confidence head")
        return self.write_export(
            draft, output_dir, config, tensors, architecture=arch,
            convention=f"hf_dspark's own: {OUR_LAYER_CONVENTION} (DeepSpec reads hidden_states[l + 1])",
            lost=config_diff(draft.config, self.config_from(config)),
            serve_command=(
                f"python eval.py --target_name_or_path {target_for_commands(draft.config)} "
                f"--draft_name_or_path {output_dir}   # in a DeepSpec checkout"
            ),
            notes=notes, dtype=dtype, overwrite=overwrite,
        )

    @classmethod
    def detect(cls, config: dict) -> bool:
        return bool({BLOCK_ARCHITECTURE, EAGLE3_ARCHITECTURE} & set(config.get("architectures") or []))

    def config_from(self, c: dict):
        if EAGLE3_ARCHITECTURE in (c.get("architectures") or []):
            return eagle3_config_from(c)
        return block_config_from(c)

    def read(self, c: dict, tensors: dict) -> tuple:
        config = self.config_from(c)
        if config.model_type == "eagle3":
            check_tensors(tensors, eagle3_spec(c), f"this {EAGLE3_ARCHITECTURE} checkpoint")
        else:
            check_tensors(tensors, block_spec(c), f"this {BLOCK_ARCHITECTURE} checkpoint")
            tensors = rename(tensors, _FROM_DEEPSPEC)
        return apply_export_meta(config, c), tensors


__all__ = [
    "BLOCK_ARCHITECTURE",
    "EAGLE3_ARCHITECTURE",
    "DeepSpecFormat",
    "block_config",
    "block_config_from",
    "block_spec",
    "eagle3_config",
    "eagle3_config_from",
    "eagle3_spec",
]
