"""speculators (vllm-project/speculators): the self-describing `Eagle3Speculator` format.

config.json names the algorithm, the proposal method and the verifier, so `vllm serve DRAFT` finds the target
by itself:

    speculators_model_type: "eagle3", architectures: ["Eagle3Speculator"], transformer_layer_config: {Llama
    config of the draft layer}, draft_vocab_size, norm_before_residual, target_hidden_size,
    eagle_aux_hidden_state_layer_ids (vLLM convention: hf_dspark id + 1),
    speculators_config: {algorithm, proposal_methods: [{proposal_type: "greedy", speculative_tokens,
    verifier_accept_k: 1, accept_tolerance: 0.0}], default_proposal_method: "greedy",
    verifier: {name_or_path, architectures}}

Weights: the Llama-Eagle3 layout with `layers.0.*` keys plus identity d2t/t2d. Only Eagle3 drafts (the format
documents no block drafter). The verifier defaults to the draft's recorded target; a target recorded only as a
local path or a bare name is refused unless `verifier=` names its Hub id.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .base import (
    DraftFormat,
    ExportError,
    ExportResult,
    apply_export_meta,
    check_tensors,
    config_diff,
    draft_tensors,
    looks_like_hub_id,
    target_hub_id,
)
from .llama_eagle3 import (
    LAYER_CONVENTION,
    consumer_layer_ids,
    eagle3_from_llama,
    llama_eagle3_config,
    llama_eagle3_reasons,
    llama_eagle3_spec,
    llama_eagle3_tensors,
    read_llama_eagle3,
)

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.2.0"


def verifier_architectures(model_type: str | None) -> list[str]:
    """The causal-LM class transformers registers for the target's model_type (e.g. llama -> LlamaForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    return [name] if name else []


class SpeculatorsFormat(DraftFormat):
    name = "speculators"
    consumer = "speculators / vLLM (`vllm serve DRAFT` reads the verifier from the config)"

    def why_not(self, draft) -> str | None:
        cfg = draft.config
        if cfg.model_type != "eagle3":
            return (
                f"the speculators format holds Eagle3 drafts only; export {cfg.model_type} drafts with "
                "--format vllm or --format deepspec"
            )
        return "; ".join(llama_eagle3_reasons(cfg, "speculators")) or None

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
        layer = llama_eagle3_config(cfg, "LlamaForCausalLM")
        ids = consumer_layer_ids(cfg)
        tokens = int(num_speculative_tokens or cfg.num_draft_tokens)
        config = {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {k: v for k, v in layer.items() if k not in ("architectures",)},
            "draft_vocab_size": cfg.vocab_size,
            "norm_before_residual": bool(cfg.norm_before_residual),
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(cfg.target_model_type)},
            },
        }
        tensors = llama_eagle3_tensors(draft_tensors(draft), "layers.0.", True, cfg.vocab_size)
        spec = llama_eagle3_spec(self.layer_fields(config), "layers.0.", vocab_maps=True)
        check_tensors(tensors, spec, "the speculators export", ExportError)
        named = copy.deepcopy(cfg)
        named.target_name_or_path = verifier  # the verifier field now records the target
        return self.write_export(
            draft, output_dir, config, tensors, architecture=SPECULATORS_ARCHITECTURE, convention=LAYER_CONVENTION,
            lost=config_diff(named, self.config_from(config)), serve_command=f"vllm serve {output_dir}",
            notes=[f"verifier: {verifier}", f"speculative_tokens: {tokens}", "full vocabulary: identity d2t/t2d"],
            dtype=dtype, overwrite=overwrite,
        )

    @staticmethod
    def layer_fields(c: dict) -> dict:
        """The Llama layer fields plus the top-level Eagle3 fields, as one dict (what the shared helpers read)."""
        layer = dict(c.get("transformer_layer_config") or {})
        for key in ("draft_vocab_size", "norm_before_residual", "target_hidden_size"):
            if c.get(key) is not None:
                layer[key] = c[key]
        return layer

    @classmethod
    def detect(cls, config: dict) -> bool:
        return config.get("speculators_model_type") == "eagle3" or SPECULATORS_ARCHITECTURE in (
            config.get("architectures") or []
        )

    def config_from(self, c: dict):
        config = eagle3_from_llama(self.layer_fields(c), c.get("eagle_aux_hidden_state_layer_ids"))
        verifier = (c.get("speculators_config") or {}).get("verifier") or {}
        config.target_name_or_path = verifier.get("name_or_path")
        proposals = (c.get("speculators_config") or {}).get("proposal_methods") or []
        if proposals and proposals[0].get("speculative_tokens"):
            config.ttt_length = int(proposals[0]["speculative_tokens"])
        return config

    def read(self, c: dict, tensors: dict) -> tuple:
        config = self.config_from(c)
        state = read_llama_eagle3(self.layer_fields(c), tensors, "this speculators checkpoint")
        return apply_export_meta(config, c), state


__all__ = ["SpeculatorsFormat", "SPECULATORS_ARCHITECTURE", "verifier_architectures"]
