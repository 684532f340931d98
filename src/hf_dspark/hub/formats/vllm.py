"""vLLM: DSpark/DFlash as `Qwen3DSparkModel` (method "dspark"), Eagle3 as `LlamaForCausalLMEagle3` (method "eagle3").

Block drafters. vLLM maps DeepSpec's `Qwen3DSparkModel` to its `Qwen3DSparkForCausalLM`, so the export is the
DeepSpec layout (deepspec.py) with the same target-layer ids: vLLM itself adds 1 to each id when it sets up the
target's aux-hidden-state capture (it captures the stream entering layer l + 1 = the output of layer l).
vLLM's Markov head is the vanilla one, so gated/RNN heads are refused (the deepspec format keeps them).
A DFlash draft is written as `Qwen3DSparkModel` with `markov_rank: 0`, exactly as DeepSpec releases its DFlash
drafts, and not as `DFlashDraftModel`: vLLM's DFlash path follows z-lab's convention (see dflash.py).

Eagle3. The one-layer Eagle3 layout (llama_eagle3.py) with `layers.0.*` keys: Llama drafts as
`LlamaForCausalLMEagle3` (vllm/model_executor/models/llama_eagle3.py), drafts with q/k norm (Qwen3 targets, or
any target trained with use_qk_norm) as `Eagle3Qwen3ForCausalLM` (qwen3_eagle3.py), both registered in vLLM
0.33.0's registry.py. No d2t/t2d (full vocabulary; vLLM fails on an identity d2t, see llama_eagle3.py).
`eagle_aux_hidden_state_layer_ids` is written at top level (where gpu_model_runner.py reads the capture points)
and in `eagle_config` (where the model sizes `fc`; with `use_aux_hidden_state: true`) in vLLM's convention:
hf_dspark id + 1. Without them vLLM falls back to its defaults and warns "Acceptance will be low".

Import: a `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM` / `Eagle3Qwen3ForCausalLM` folder with
`midlayer.*` or `layers.0.*` keys reads back through this module with vLLM's layer ids (hf_dspark's own SGLang
exports read through sglang.py, with SGLang's); block drafts read through deepspec.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import (
    OUR_LAYER_CONVENTION,
    DraftFormat,
    ExportError,
    ExportResult,
    apply_export_meta,
    check_tensors,
    config_diff,
    draft_tensors,
    target_for_commands,
)
from .deepspec import DeepSpecFormat, block_reasons
from .llama_eagle3 import (
    LAYER_CONVENTIONS,
    LLAMA_EAGLE3_ARCHITECTURES,
    aux_layer_ids,
    consumer_layer_ids,
    eagle3_from_llama,
    layer_model_type,
    llama_eagle3_config,
    llama_eagle3_reasons,
    llama_eagle3_spec,
    llama_eagle3_tensors,
    read_llama_eagle3,
)

# The vLLM class each Eagle3 layer flavour loads as (vllm/model_executor/models/registry.py, 0.33.0).
VLLM_EAGLE3_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
BLOCK_CONVENTION = f"hf_dspark/DeepSpec convention ({OUR_LAYER_CONVENTION}); vLLM adds 1 internally"


def vllm_serve_command(target: str, method: str, model: str, num_tokens: int, extra: dict | None = None) -> str:
    spec = {"method": method, "model": model, "num_speculative_tokens": num_tokens, **(extra or {})}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


class VllmFormat(DraftFormat):
    name = "vllm"
    checked_against = "vLLM 0.33.0 (registry.py, qwen3_dspark.py, llama_eagle3.py, qwen3_eagle3.py, gpu_model_runner)"
    consumer = "vLLM (`--speculative-config`, methods dspark / eagle3)"

    def why_not(self, draft) -> str | None:
        cfg = draft.config
        if cfg.model_type in ("dspark", "dflash"):
            reasons = block_reasons(draft, "vLLM's Qwen3DSparkForCausalLM")
            if cfg.model_type == "dspark" and cfg.markov_rank > 0 and cfg.markov_head_type != "vanilla":
                reasons.append(
                    f"vLLM's DSpark Markov head is the vanilla one (bias = W2 W1[x]); this draft uses a "
                    f"{cfg.markov_head_type!r} head, which vLLM would serve as vanilla. Use --format deepspec"
                )
        else:
            reasons = llama_eagle3_reasons(cfg, "vLLM")
        return "; ".join(reasons) or None

    def export(self, draft, output_dir: Path, *, dtype=None, overwrite: bool = False, **options) -> ExportResult:
        self.refuse(draft)
        cfg = draft.config
        target = target_for_commands(cfg)
        num_tokens = int(options.get("num_speculative_tokens") or cfg.num_draft_tokens)
        if cfg.model_type in ("dspark", "dflash"):
            config, tensors, arch = DeepSpecFormat().build(draft)
            convention = BLOCK_CONVENTION
            extra = {}
            if getattr(cfg, "enable_confidence_head", False):
                extra["enable_adaptive_verification"] = True
            serve = vllm_serve_command(target, "dspark", str(output_dir), num_tokens, extra)
            notes = ["vLLM reads markov_rank, enable_confidence_head, confidence_head_with_markov and the top-level "
                     "target_layer_ids of this config"]
            if cfg.model_type == "dflash":
                notes.append("DFlash is written as Qwen3DSparkModel with markov_rank 0 (DeepSpec's layout), not as "
                             "DFlashDraftModel, whose slot convention differs")
                # qwen3_dspark.py builds DSparkMarkovHead(V, V, markov_rank) unconditionally: with rank 0 its
                # bias is a zero-width product (zeros), and load_weights does not require markov weights.
                notes.append("vLLM builds its Markov head with rank 0 for this draft (a zero bias); not yet run on "
                             "a GPU")
        else:
            arch = VLLM_EAGLE3_ARCHITECTURES[layer_model_type(cfg)]
            config = llama_eagle3_config(cfg, arch)
            ids = consumer_layer_ids(cfg, "vllm")
            config["eagle_aux_hidden_state_layer_ids"] = ids
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
            tensors = llama_eagle3_tensors(draft_tensors(draft), "layers.0.")
            check_tensors(tensors, llama_eagle3_spec(config, "layers.0."), "the vllm export", ExportError)
            convention = LAYER_CONVENTIONS["vllm"]
            serve = vllm_serve_command(target, "eagle3", str(output_dir), num_tokens)
            notes = ["full vocabulary: draft_vocab_size = vocab_size, no d2t/t2d"]
        lost = config_diff(cfg, self.config_from(config))
        return self.write_export(
            draft, output_dir, config, tensors, architecture=arch, convention=convention, lost=lost,
            serve_command=serve, notes=notes, dtype=dtype, overwrite=overwrite,
        )

    @classmethod
    def detect(cls, config: dict) -> bool:
        archs = set(config.get("architectures") or [])
        return bool(archs & set(LLAMA_EAGLE3_ARCHITECTURES)) and "speculators_model_type" not in config

    def config_from(self, c: dict):
        if DeepSpecFormat.detect(c):
            return DeepSpecFormat().config_from(c)
        return eagle3_from_llama(c, aux_layer_ids(c))

    def read(self, c: dict, tensors: dict) -> tuple:
        config = self.config_from(c)
        return apply_export_meta(config, c), read_llama_eagle3(c, tensors, "this Llama-Eagle3 checkpoint")


__all__ = ["VllmFormat", "VLLM_EAGLE3_ARCHITECTURES", "vllm_serve_command"]
