"""Eagle3 draft configuration: one autoregressive decoder layer trained with training-time test (TTT)."""

from __future__ import annotations

from ..configuration_draft import DraftConfig


class Eagle3Config(DraftConfig):
    r"""
    Configuration of an Eagle3 draft. The single decoder layer reads `[embed(token); hidden]` (2 x hidden wide);
    the hidden input is the projected target features on the first step and the draft's own output afterwards.

    Args:
        ttt_length (`int`, defaults to 7): unrolled training-time-test steps, and the default number of draft
            tokens per round at inference.
        step_loss_decay (`float`, defaults to 0.8): weight of TTT step j is step_loss_decay ** j.
        norm_before_residual (`bool`, defaults to False): use the normed hidden input as the attention residual.
    """

    model_type = "eagle3"

    num_hidden_layers: int = 1
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    norm_before_residual: bool = False

    @property
    def num_draft_tokens(self) -> int:
        return self.ttt_length

    def card_rows(self) -> list[tuple[str, str]]:
        return [("norm_before_residual", str(self.norm_before_residual))]

    def check_draft_fields(self) -> None:
        super().check_draft_fields()
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"Eagle3 drafts have exactly one decoder layer (got num_hidden_layers={self.num_hidden_layers}); "
                "use DSpark or DFlash for a deeper draft"
            )
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if not 0 < self.step_loss_decay <= 1:
            raise ValueError(f"step_loss_decay must be in (0, 1], got {self.step_loss_decay}")


__all__ = ["Eagle3Config"]
