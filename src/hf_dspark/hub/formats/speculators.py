"""speculators (vllm-project/speculators 0.9.0): the self-describing format `vllm serve DRAFT` reads.

config.json names the algorithm, the proposal method and the verifier, so vLLM finds the target by itself.
vLLM turns it into a model config in vllm/transformers_utils/configs/speculators/{base,algos}.py (0.33.0):
`transformer_layer_config` is the base, the algorithm's updater adds its fields, and
`speculators_config.proposal_methods[0].speculative_tokens` + `verifier.name_or_path` are required.

- Eagle3 (`speculators_model_type: "eagle3"`): `transformer_layer_config` is the draft layer's config; its
  `model_type` picks vLLM's class ("llama" -> Eagle3LlamaForCausalLM, "qwen3" -> Eagle3Qwen3ForCausalLM, the
  latter for drafts with q/k norm). Weights: the one-layer Eagle3 layout (llama_eagle3.py) under `layers.0.*`,
  no d2t/t2d (full vocabulary: vLLM 0.33.0 fails on an identity d2t). vLLM sizes `fc` from
  `num_aux_hidden_states` (written into `transformer_layer_config`), else 3.
- DSpark (`speculators_model_type: "dspark"`): vLLM's `update_dspark` maps it to the DeepSpec
  `Qwen3DSparkModel` loader, so the weights are the deepspec.py layout; fields `mask_token_id`, `block_size`,
  `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
  `sample_from_anchor: true` (every slot, the anchor's included, predicts the next token: hf_dspark's and
  DeepSpec's convention), `aux_hidden_state_layer_ids`. vLLM's Markov head is the vanilla one.
- Layer ids: written in vLLM's aux-hidden-state convention, hf_dspark id + 1, in
  `eagle_aux_hidden_state_layer_ids` (Eagle3) / `aux_hidden_state_layer_ids` (DSpark; vLLM derives
  `target_layer_ids = id - 1` from them, which is hf_dspark's id again).

Refused: DFlash (speculators' own DFlash format is z-lab's slot convention; a DSpark entry needs
markov_rank > 0 to mean DSpark), Eagle3/DSpark drafts the layouts cannot hold. The verifier defaults to the
draft's recorded target; a target recorded only as a local path or a bare name is refused unless `verifier=`
names its Hub id.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .base import (
    DraftFormat,
    ExportError,
    ExportResult,
    ForeignCheckpointError,
    apply_export_meta,
    check_tensors,
    config_diff,
    draft_tensors,
    looks_like_hub_id,
    target_hub_id,
)
from .deepspec import BLOCK_ARCHITECTURE, DeepSpecFormat, block_config_from, block_reasons
from .llama_eagle3 import (
    LAYER_CONVENTIONS,
    LAYER_ID_OFFSETS,
    consumer_layer_ids,
    eagle3_from_llama,
    layer_model_type,
    llama_eagle3_config,
    llama_eagle3_reasons,
    llama_eagle3_spec,
    llama_eagle3_tensors,
    read_llama_eagle3,
)

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.9.0"
# Top-level fields of a DSpark entry that vLLM's update_dspark copies into the model config.
_DSPARK_FIELDS = (
    "mask_token_id", "block_size", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "target_hidden_size",
)


def verifier_architectures(model_type: str | None) -> list[str]:
    """The causal-LM class transformers registers for the target's model_type (e.g. llama -> LlamaForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    return [name] if name else []


class SpeculatorsFormat(DraftFormat):
    name = "speculators"
    checked_against = (
        "speculators 0.9.0 (its config classes and draft models load the export) and vLLM 0.33.0 "
        "(transformers_utils/configs/speculators)"
    )
    consumer = "speculators / vLLM (`vllm serve DRAFT` reads the verifier from the config)"

    def why_not(self, draft) -> str | None:
        cfg = draft.config
        if cfg.model_type == "dflash":
            return (
                "the speculators format has no DFlash entry in hf_dspark's slot convention (its 'dflash' entry is "
                "z-lab's); export DFlash drafts with --format vllm or --format deepspec"
            )
        if cfg.model_type == "dspark":
            reasons = block_reasons(draft, "vLLM's Qwen3DSparkForCausalLM")
            if cfg.markov_rank <= 0:
                reasons.append("a speculators DSpark entry needs markov_rank > 0")
            elif cfg.markov_head_type != "vanilla":
                reasons.append(
                    f"vLLM's DSpark Markov head is the vanilla one; this draft uses a {cfg.markov_head_type!r} head. "
                    "Use --format deepspec or --format sglang"
                )
            return "; ".join(reasons) or None
        return "; ".join(llama_eagle3_reasons(cfg, "vLLM (speculators)")) or None

    def export(
        self,
        draft,
        output_dir: Path,
        *,
        dtype=None,
        overwrite: bool = False,
        verifier: str | None = None,
        num_speculative_tokens: int | None = None,
        **options,
    ) -> ExportResult:
        self.refuse(draft)
        cfg = draft.config
        verifier = verifier or target_hub_id(cfg.target_name_or_path) or cfg.target_name_or_path
        if not looks_like_hub_id(verifier):
            raise ExportError(
                f"the speculators format names its verifier so that `vllm serve DRAFT` can load it, but this draft "
                f"records its target as {verifier!r}; pass verifier='org/name' (the target's Hub id)"
            )
        tokens = int(num_speculative_tokens or cfg.num_draft_tokens)
        ids = consumer_layer_ids(cfg, "speculators")
        speculators_config = {
            "algorithm": cfg.model_type,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                 "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(cfg.target_model_type)},
        }
        if cfg.model_type == "dspark":
            block, tensors, _ = DeepSpecFormat().build(draft)
            layer = {k: v for k, v in block.items() if k != "architectures"}
            config = {
                "architectures": [BLOCK_ARCHITECTURE],
                "speculators_model_type": "dspark",
                "speculators_version": SPECULATORS_VERSION,
                "transformer_layer_config": layer,
                "draft_vocab_size": cfg.vocab_size,
                **{key: block[key] for key in _DSPARK_FIELDS},
                "sample_from_anchor": True,
                "aux_hidden_state_layer_ids": ids,
                "speculators_config": speculators_config,
            }
            arch, notes = BLOCK_ARCHITECTURE, []
        else:
            layer = llama_eagle3_config(cfg, "")
            layer.pop("architectures")
            layer["num_aux_hidden_states"] = len(ids)
            config = {
                "architectures": [SPECULATORS_ARCHITECTURE],
                "speculators_model_type": "eagle3",
                "speculators_version": SPECULATORS_VERSION,
                "transformer_layer_config": layer,
                "draft_vocab_size": cfg.vocab_size,
                "norm_before_residual": bool(cfg.norm_before_residual),
                "target_hidden_size": cfg.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": ids,
                "speculators_config": speculators_config,
            }
            tensors = llama_eagle3_tensors(draft_tensors(draft), "layers.0.")
            spec = llama_eagle3_spec(self.layer_fields(config), "layers.0.")
            check_tensors(tensors, spec, "the speculators export", ExportError)
            arch, notes = SPECULATORS_ARCHITECTURE, ["full vocabulary: draft_vocab_size = vocab_size, no d2t/t2d"]
        named = copy.deepcopy(cfg)
        named.target_name_or_path = verifier  # the verifier field now records the target
        return self.write_export(
            draft, output_dir, config, tensors, architecture=arch, convention=LAYER_CONVENTIONS["speculators"],
            lost=config_diff(named, self.config_from(config)), serve_command=f"vllm serve {output_dir}",
            notes=[f"verifier: {verifier}", f"speculative_tokens: {tokens}", *notes], dtype=dtype,
            overwrite=overwrite,
        )

    @staticmethod
    def layer_fields(c: dict) -> dict:
        """The layer config plus the top-level fields, as one dict (what the shared helpers read)."""
        layer = dict(c.get("transformer_layer_config") or {})
        for key, value in c.items():
            if key not in ("transformer_layer_config", "speculators_config", "architectures") and value is not None:
                layer[key] = value
        return layer

    @classmethod
    def detect(cls, config: dict) -> bool:
        return config.get("speculators_model_type") in ("eagle3", "dspark") or SPECULATORS_ARCHITECTURE in (
            config.get("architectures") or []
        )

    def check_import(self, config: dict) -> None:
        if config.get("speculators_model_type") == "dspark" and config.get("sample_from_anchor") is False:
            raise ForeignCheckpointError(
                "this speculators DSpark checkpoint has sample_from_anchor: false (mask slots predict their own "
                "position), hf_dspark drafts predict the next token from every slot; it cannot be converted"
            )

    def config_from(self, c: dict):
        fields = self.layer_fields(c)
        offset = LAYER_ID_OFFSETS["speculators"]
        if c.get("speculators_model_type") == "dspark":
            fields["target_layer_ids"] = [i - offset for i in c.get("aux_hidden_state_layer_ids") or []] or None
            config = block_config_from(fields)
        else:
            config = eagle3_from_llama(fields, c.get("eagle_aux_hidden_state_layer_ids"), offset=offset)
        verifier = (c.get("speculators_config") or {}).get("verifier") or {}
        config.target_name_or_path = verifier.get("name_or_path")
        proposals = (c.get("speculators_config") or {}).get("proposal_methods") or []
        if config.model_type == "eagle3" and proposals and proposals[0].get("speculative_tokens"):
            config.ttt_length = int(proposals[0]["speculative_tokens"])
        return config

    def read(self, c: dict, tensors: dict) -> tuple:
        self.check_import(c)
        config = self.config_from(c)
        if c.get("speculators_model_type") == "dspark":
            fields = self.layer_fields(c)
            fields["target_layer_ids"] = list(config.target_layer_ids)
            fields["architectures"] = [BLOCK_ARCHITECTURE]
            _, state = DeepSpecFormat().read(fields, tensors)
        else:
            state = read_llama_eagle3(self.layer_fields(c), tensors, "this speculators checkpoint")
        return apply_export_meta(config, c), state


__all__ = ["SpeculatorsFormat", "SPECULATORS_ARCHITECTURE", "verifier_architectures"]
