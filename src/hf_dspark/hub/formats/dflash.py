"""z-lab DFlash (`DFlashDraftModel`): recognised, and refused in both directions with the reason.

The layout itself would fit (config: `architectures: ["DFlashDraftModel"]`, `block_size`, `dflash_config:
{mask_token_id, target_layer_ids}`, `num_target_layers`, `layer_types`; weights `fc`, `hidden_norm`,
`layers.{i}.*` (Qwen3 with q_norm/k_norm), `norm`; embeddings and lm_head borrowed from the target), but the
two conventions assign predictions to different slots of the block [anchor, mask, ..., mask] at positions
p .. p+B-1:

- z-lab DFlash (and every consumer of DFlashDraftModel: vLLM method "dflash", SGLang DFLASH, transformers'
  `speculation_type="dflash"`, which keeps `last_hidden_state[:, 1:]`): the output at slot i >= 1 predicts
  the token at its own position p+i; slot 0 (the anchor) is discarded; B-1 proposals per block.
- DeepSpec / the DSpark paper / hf_dspark (DFlash = DSpark without Markov head): the output at slot j
  predicts the token at position p+j+1, starting with the anchor's slot; B proposals per block.

The weights cannot be converted between the two (the output that must predict x_{p+1} sees the anchor token in
one convention and a mask token one position later in the other), and a converted checkpoint would load
without error and propose shifted tokens. hf_dspark DFlash drafts are therefore served through the DeepSpec
layout (`Qwen3DSparkModel` with `markov_rank: 0`, vLLM method "dspark"): `--format vllm` or `--format deepspec`.
"""

from __future__ import annotations

from .base import DraftFormat, ForeignCheckpointError

DFLASH_ARCHITECTURE = "DFlashDraftModel"

CONVENTION_MISMATCH = (
    "DFlashDraftModel (z-lab DFlash; vLLM method 'dflash', SGLang DFLASH, transformers speculation_type='dflash') "
    "predicts the token at each mask slot's own position and discards the anchor's slot, while hf_dspark and "
    "DeepSpec block drafts predict the next token from every slot, starting at the anchor; the weights cannot be "
    "converted between these conventions"
)


class DFlashFormat(DraftFormat):
    name = "dflash"
    checked_against = "vLLM 0.33.0 and SGLang 0.5.23 DFlashDraftModel"
    consumer = "z-lab DFlash (DFlashDraftModel)"

    def why_not(self, draft) -> str | None:
        if draft.config.model_type == "eagle3":
            return "DFlashDraftModel is a block drafter; Eagle3 drafts export to vllm, sglang, speculators or deepspec"
        return CONVENTION_MISMATCH + (
            "; export hf_dspark DSpark/DFlash drafts with --format vllm (Qwen3DSparkModel, method 'dspark') or "
            "--format deepspec"
        )

    def export(self, draft, output_dir, **options):
        self.refuse(draft)

    @classmethod
    def detect(cls, config: dict) -> bool:
        return DFLASH_ARCHITECTURE in (config.get("architectures") or [])

    def check_import(self, config: dict) -> None:
        raise ForeignCheckpointError(
            CONVENTION_MISMATCH + "; load z-lab DFlash drafts with transformers' own DFlash support "
            "(speculation_type='dflash') instead"
        )

    def read(self, config: dict, tensors: dict):
        self.check_import(config)


__all__ = ["DFlashFormat", "DFLASH_ARCHITECTURE", "CONVENTION_MISMATCH"]
