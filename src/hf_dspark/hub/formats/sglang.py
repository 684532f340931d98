"""SGLang (0.5.23): Eagle3 as `LlamaForCausalLMEagle3` (`midlayer.*` keys), DSpark as `Qwen3DSparkModel`.

Checked against sglang 0.5.23's own code:

- Eagle3 (sglang/srt/models/llama_eagle3.py): a Llama layer whose q/k/v take 2d inputs with `bias=False`
  hard-coded and no q_norm/k_norm, `hidden_norm` applied after the residual is taken (no
  norm_before_residual), `fc` sized from `len(eagle_config.eagle_aux_hidden_state_layer_ids)` (default 3).
  Unknown keys are skipped silently, so the exporter checks every key it loads. d2t is optional (absent = full
  vocabulary), so none is written.
- DSpark (sglang/srt/models/dspark.py, algorithm DSPARK): the DeepSpec `Qwen3DSparkModel` layout (deepspec.py).
  It raises unless `markov_rank > 0`; it builds the confidence head whatever `enable_confidence_head` says and
  raises when its weights are missing; it skips the checkpoint's `embed_tokens`/`lm_head` and uses the
  target's (hf_dspark drafts hold frozen copies of them, so nothing is lost); all three Markov heads.
- Layer ids: SGLang adds 1 to every configured id and captures the stream entering that layer
  (`set_eagle3_layers_to_capture` / `set_dflash_layers_to_capture` in sglang/srt/models/{llama,qwen3}.py), so a
  configured id k means "output of layer k": hf_dspark's own ids are written unchanged, for both drafters.
  `dflash_utils.py` rejects ids < 0 or >= the target's layer count, so the embedding output (-1) is refused.

Refused: DFlash (SGLang's DFLASH algorithm runs z-lab's DFlashDraftModel slot convention, see dflash.py, and its
DSPARK drafter needs a Markov head).

Import: an SGLang export (recognised by the `hf_dspark` block of its config) reads back here with SGLang's ids;
other `LlamaForCausalLMEagle3` folders read through the vllm reader (vLLM's ids).
"""

from __future__ import annotations

from pathlib import Path

from .base import (
    EXPORT_META_KEY,
    DraftFormat,
    ExportError,
    ExportResult,
    apply_export_meta,
    check_tensors,
    config_diff,
    draft_tensors,
    target_for_commands,
)
from .deepspec import BLOCK_ARCHITECTURE, DeepSpecFormat, block_reasons
from .llama_eagle3 import (
    LAYER_CONVENTIONS,
    LAYER_ID_OFFSETS,
    aux_layer_ids,
    consumer_layer_ids,
    eagle3_from_llama,
    llama_eagle3_config,
    llama_eagle3_reasons,
    llama_eagle3_spec,
    llama_eagle3_tensors,
    read_llama_eagle3,
)

SGLANG_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def sglang_serve_command(target: str, algorithm: str, draft: str, extra: str = "") -> str:
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {draft}{extra}"
    )


class SglangFormat(DraftFormat):
    name = "sglang"
    checked_against = "SGLang 0.5.23 (srt/models/llama_eagle3.py, dspark.py, llama.py, qwen3.py; dflash_utils.py)"
    consumer = "SGLang (`--speculative-algorithm EAGLE3` / `DSPARK`)"

    def why_not(self, draft) -> str | None:
        cfg = draft.config
        if cfg.model_type == "dflash":
            return (
                "SGLang's DFLASH algorithm runs z-lab's DFlashDraftModel, whose mask slots predict their own "
                "position, and its DSPARK drafter requires markov_rank > 0; serve DFlash drafts with vLLM "
                "(--format vllm) instead"
            )
        if cfg.model_type == "dspark":
            reasons = block_reasons(draft, "SGLang's Qwen3DSparkModel")
            if cfg.markov_rank <= 0:
                reasons.append("SGLang's DSPARK drafter requires markov_rank > 0")
            if not cfg.enable_confidence_head:
                reasons.append(
                    "SGLang's DSPARK drafter always builds a confidence head and refuses checkpoints without its "
                    "weights; train the draft with enable_confidence_head=True, or serve it with --format vllm"
                )
            if min(cfg.target_layer_ids) < 0:
                reasons.append(
                    "SGLang rejects target layer id -1 (embedding output); train the draft with target_layer_ids >= 0"
                )
            return "; ".join(reasons) or None
        reasons = llama_eagle3_reasons(cfg, "SGLang", norm_before_residual=False, qk_norm=False, biases=False)
        return "; ".join(reasons) or None

    def export(self, draft, output_dir: Path, *, dtype=None, overwrite: bool = False, **options) -> ExportResult:
        self.refuse(draft)
        cfg = draft.config
        target = target_for_commands(cfg)
        if cfg.model_type == "dspark":
            config, tensors, arch = DeepSpecFormat().build(draft)
            return self.write_export(
                draft, output_dir, config, tensors, architecture=arch, convention=LAYER_CONVENTIONS["sglang"],
                lost=config_diff(cfg, DeepSpecFormat().config_from(config)),
                serve_command=sglang_serve_command(target, "DSPARK", str(output_dir)),
                notes=["SGLang uses the target's embed_tokens/lm_head (the draft's are frozen copies of them)"],
                dtype=dtype, overwrite=overwrite,
            )
        config = llama_eagle3_config(cfg, SGLANG_EAGLE3_ARCHITECTURE)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": consumer_layer_ids(cfg, "sglang")}
        tensors = llama_eagle3_tensors(draft_tensors(draft), "midlayer.")
        check_tensors(tensors, llama_eagle3_spec(config, "midlayer."), "the sglang export", ExportError)
        steps = int(options.get("num_speculative_tokens") or cfg.num_draft_tokens)
        serve = sglang_serve_command(
            target, "EAGLE3", str(output_dir),
            f" --speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}",
        )
        return self.write_export(
            draft, output_dir, config, tensors, architecture=SGLANG_EAGLE3_ARCHITECTURE,
            convention=LAYER_CONVENTIONS["sglang"], lost=config_diff(cfg, self.config_from(config)),
            serve_command=serve, notes=["full vocabulary: draft_vocab_size = vocab_size, no d2t/t2d"], dtype=dtype,
            overwrite=overwrite,
        )

    @classmethod
    def detect(cls, config: dict) -> bool:
        return (config.get(EXPORT_META_KEY) or {}).get("export_format") == "sglang"

    def config_from(self, c: dict):
        if BLOCK_ARCHITECTURE in (c.get("architectures") or []):
            return DeepSpecFormat().config_from(c)
        return eagle3_from_llama(c, aux_layer_ids(c), offset=LAYER_ID_OFFSETS["sglang"])

    def read(self, c: dict, tensors: dict) -> tuple:
        if BLOCK_ARCHITECTURE in (c.get("architectures") or []):
            return DeepSpecFormat().read(c, tensors)
        state = read_llama_eagle3(c, tensors, "this SGLang Eagle3 checkpoint")
        return apply_export_meta(self.config_from(c), c), state


__all__ = ["SglangFormat", "SGLANG_EAGLE3_ARCHITECTURE", "sglang_serve_command"]
