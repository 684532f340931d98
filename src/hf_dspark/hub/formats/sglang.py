"""SGLang: Eagle3 drafts as `LlamaForCausalLMEagle3` with `midlayer.*` keys and explicit d2t/t2d.

SGLang skips unknown keys silently, so the exporter checks that every key its Llama-Eagle3 model loads is
present with the right shape (`midlayer.self_attn.{q,k,v,o}_proj`, `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}`, `midlayer.mlp.*`, `fc`, `norm`, `lm_head`, `embed_tokens`, `d2t`, `t2d`). The maps
are the identity (full vocabulary). Layer ids go in `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's
aux-hidden-state convention (hf_dspark id + 1).

Refused: DSpark (SGLang has no DSpark drafter) and DFlash (SGLang's DFLASH algorithm runs z-lab's
DFlashDraftModel convention, see dflash.py); Eagle3 drafts the Llama layout cannot hold (llama_eagle3.py) and
`norm_before_residual` (SGLang's Eagle3 layer has no such option).

Importing an SGLang folder goes through the vllm reader, which accepts `midlayer.*` keys.
"""

from __future__ import annotations

from pathlib import Path

from .base import (
    DraftFormat,
    ExportError,
    ExportResult,
    check_tensors,
    config_diff,
    draft_tensors,
    target_for_commands,
)
from .llama_eagle3 import (
    LAYER_CONVENTION,
    consumer_layer_ids,
    eagle3_from_llama,
    llama_eagle3_config,
    llama_eagle3_reasons,
    llama_eagle3_spec,
    llama_eagle3_tensors,
)

SGLANG_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


class SglangFormat(DraftFormat):
    name = "sglang"
    consumer = "SGLang (`--speculative-algorithm EAGLE3`)"

    def why_not(self, draft) -> str | None:
        cfg = draft.config
        if cfg.model_type == "dspark":
            return "SGLang has no DSpark drafter; serve DSpark drafts with vLLM (--format vllm)"
        if cfg.model_type == "dflash":
            return (
                "SGLang's DFLASH algorithm runs z-lab's DFlashDraftModel, whose mask slots predict their own "
                "position, while hf_dspark/DeepSpec block drafts predict the next token from every slot; serve "
                "DFlash drafts with vLLM (--format vllm) instead"
            )
        reasons = llama_eagle3_reasons(cfg, "SGLang", norm_before_residual=False)
        return "; ".join(reasons) or None

    def export(self, draft, output_dir: Path, *, dtype=None, overwrite: bool = False, **options) -> ExportResult:
        self.refuse(draft)
        cfg = draft.config
        config = llama_eagle3_config(cfg, SGLANG_EAGLE3_ARCHITECTURE)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": consumer_layer_ids(cfg)}
        tensors = llama_eagle3_tensors(draft_tensors(draft), "midlayer.", True, cfg.vocab_size)
        spec = llama_eagle3_spec(config, "midlayer.", vocab_maps=True)
        check_tensors(tensors, spec, "the sglang export", ExportError)
        rebuilt = eagle3_from_llama(config, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        steps = int(options.get("num_speculative_tokens") or cfg.num_draft_tokens)
        serve = (
            f"python -m sglang.launch_server --model-path {target_for_commands(cfg)} "
            f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {output_dir} "
            f"--speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}"
        )
        return self.write_export(
            draft, output_dir, config, tensors, architecture=SGLANG_EAGLE3_ARCHITECTURE, convention=LAYER_CONVENTION,
            lost=config_diff(cfg, rebuilt), serve_command=serve,
            notes=["full vocabulary: d2t is all zeros and t2d all true (identity maps)"], dtype=dtype,
            overwrite=overwrite,
        )


__all__ = ["SglangFormat", "SGLANG_EAGLE3_ARCHITECTURE"]
