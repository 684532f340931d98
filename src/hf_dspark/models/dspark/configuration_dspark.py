"""DSpark draft configuration: parallel block backbone + sequential (Markov) head + confidence head."""

from __future__ import annotations

from ..configuration_draft import DraftConfig

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class DSparkConfig(DraftConfig):
    r"""
    Configuration of a DSpark draft (semi-autoregressive: one parallel forward over an anchor block, then a
    lightweight Markov head samples left to right; a confidence head estimates per-slot acceptance).

    Args:
        block_size (`int`, defaults to 7): draft slots per block (anchor + block_size-1 mask tokens in, block_size
            proposals out).
        num_anchors (`int`, defaults to 512): anchors sampled per training sequence.
        mask_token_id (`int`): token id whose (frozen) embedding fills the non-anchor slots.
        markov_rank (`int`, defaults to 256): rank r of the low-rank transition bias; 0 disables the Markov head.
        markov_head_type (`str`, defaults to "vanilla"): "vanilla", "gated" or "rnn"; None when markov_rank is 0.
        enable_confidence_head (`bool`, defaults to True): predict c_k = P(slot k accepted | slots < k accepted).
        confidence_head_with_markov (`bool`, defaults to True): feed W1[x_{k-1}] to the confidence head too.
        confidence_temperatures (`list[float]`, *optional*): per-slot STS temperatures applied to confidence logits.
        ce_loss_alpha, l1_loss_alpha, soft_ce_loss_alpha, confidence_head_alpha (`float`): loss weights (0, 0.5,
            0.5, 1.0): the cross-entropy against the label, the L1 distance to the target's distribution, the soft
            cross-entropy against that distribution, -sum_v p_t(v) log p_d(v) (Eagle3's objective: the expectation
            of CE over the target's own samples, without the sampling noise of one label), and the confidence BCE.
            At equal training time on SmolLM2 the soft CE in place of the label's decoded a higher τ at T = 0 and
            T = 1 (benchmarks/results/dspark_smollm2_15min_soft_ce.json against _15min_t1_answers.json); the label
            mix before it, (0.5, 0.5, 0), beat the paper's reference mix (0.1, 0.9, 0)
            (benchmarks/results/dspark_loss_mix_smollm2_8min.json).
        loss_decay_gamma (`float`, defaults to 4.0): slot weights w_k = exp(-(k-1)/loss_decay_gamma).
    """

    model_type = "dspark"

    block_size: int = 7
    num_anchors: int = 512
    mask_token_id: int | None = None
    markov_rank: int = 256
    markov_head_type: str | None = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None
    ce_loss_alpha: float = 0.0
    l1_loss_alpha: float = 0.5
    confidence_head_alpha: float = 1.0
    soft_ce_loss_alpha: float = 0.5
    loss_decay_gamma: float = 4.0

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size

    def card_rows(self) -> list[tuple[str, str]]:
        markov = f"{self.markov_head_type}, rank {self.markov_rank}" if self.markov_rank else "none"
        confidence = "none"
        if self.enable_confidence_head:
            confidence = "on" + (" (with Markov features)" if self.confidence_head_with_markov else "")
            confidence += ", STS-calibrated" if self.confidence_temperatures else ", not calibrated"
        return [("Markov head", markov), ("confidence head", confidence), ("mask token id", str(self.mask_token_id)),
                self.loss_card_row()]

    def loss_card_row(self) -> tuple[str, str]:
        """The training loss's terms with their weights (those above 0), for the model card."""
        terms = [("label CE", self.ce_loss_alpha), ("soft CE against the target", self.soft_ce_loss_alpha),
                 ("L1 to the target", self.l1_loss_alpha), ("confidence BCE", self.confidence_head_alpha)]  # fmt: skip
        return "training loss", " + ".join(f"{weight:g} {name}" for name, weight in terms if weight > 0)

    def check_draft_fields(self) -> None:
        super().check_draft_fields()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 disables the Markov head), got {self.markov_rank}")
        if self.markov_rank == 0 and self.markov_head_type is not None:
            raise ValueError(
                f"markov_head_type={self.markov_head_type!r} needs markov_rank > 0 (the paper uses 256); for a "
                "drafter without a Markov head set markov_head_type=None (that drafter is DFlash: DFlashConfig)"
            )
        if self.markov_rank > 0:
            if self.markov_head_type is None:
                raise ValueError(
                    f"markov_rank={self.markov_rank} but markov_head_type is None: choose one of "
                    f"{MARKOV_HEAD_TYPES} or set markov_rank=0"
                )
            self._check_choice("markov_head_type", self.markov_head_type, MARKOV_HEAD_TYPES)
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "confidence_head_with_markov=True needs a Markov head (markov_rank > 0); set "
                "confidence_head_with_markov=False to condition the confidence head on the hidden state only"
            )
        names = ("ce_loss_alpha", "l1_loss_alpha", "soft_ce_loss_alpha", "confidence_head_alpha", "loss_decay_gamma")
        for name in names:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ce_loss_alpha + self.l1_loss_alpha + self.soft_ce_loss_alpha == 0:
            raise ValueError(
                "ce_loss_alpha, l1_loss_alpha and soft_ce_loss_alpha are all 0: the draft distribution would not be "
                "trained"
            )
        if self.confidence_head_alpha > 0 and not self.enable_confidence_head:
            raise ValueError(
                f"confidence_head_alpha={self.confidence_head_alpha} but enable_confidence_head=False: "
                "set confidence_head_alpha=0 or enable the confidence head"
            )
        if self.confidence_temperatures is not None:
            temps = [float(t) for t in self.confidence_temperatures]
            if len(temps) != self.block_size or any(t <= 0 for t in temps):
                raise ValueError(
                    f"confidence_temperatures must hold {self.block_size} positive values (one per slot), got {temps}"
                )
            self.confidence_temperatures = temps


__all__ = ["DSparkConfig", "MARKOV_HEAD_TYPES"]
