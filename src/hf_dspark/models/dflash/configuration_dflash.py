"""DFlash draft configuration: the DSpark backbone with no Markov head, no confidence head, CE-only loss."""

from __future__ import annotations

from ..dspark.configuration_dspark import DSparkConfig


class DFlashConfig(DSparkConfig):
    r"""
    Configuration of a DFlash draft (fully parallel block drafter). Same fields as [`DSparkConfig`]; the Markov
    and confidence heads are off and the loss is cross-entropy only (alpha = (1, 0, 0)).
    """

    model_type = "dflash"

    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    ce_loss_alpha: float = 1.0
    l1_loss_alpha: float = 0.0
    soft_ce_loss_alpha: float = 0.0
    confidence_head_alpha: float = 0.0

    def card_rows(self) -> list[tuple[str, str]]:
        return [("mask token id", str(self.mask_token_id)), self.loss_card_row()]

    def check_draft_fields(self) -> None:
        if self.markov_rank != 0 or self.markov_head_type is not None or self.enable_confidence_head:
            raise ValueError(
                "DFlash drafts have no Markov head and no confidence head (markov_rank=0, markov_head_type=None, "
                "enable_confidence_head=False); use DSparkConfig for a semi-autoregressive draft"
            )
        super().check_draft_fields()


__all__ = ["DFlashConfig"]
