"""Per-call statistics of speculative generate(): acceptance (the one definition in
`hf_dspark.metrics.AcceptanceStats`) plus where the time went.

After every `target.generate(..., assistant_model=draft)` the statistics are `draft.last_generation_stats`, and
with `return_dict_in_generate=True` also `output.speculative_stats` (an extra attribute: the output keeps its
standard transformers type). Times are wall-clock seconds measured at the loop's existing host syncs (no extra
CUDA synchronization): drafting = proposal + scheduling, verification = target forward + logits processing +
rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..metrics import AcceptanceStats


@dataclass
class SpeculativeStats:
    drafter: str = ""
    schedule: str = "none"
    batch_size: int = 0
    block_size: int = 0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    new_tokens: int = 0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    draft_graphs: bool = False  # whether the draft's rounds were replayed as CUDA graphs
    target_graphs: bool = False  # whether the target's verify forwards were (cache_implementation="static")
    fused_round: bool = False  # whole rounds as one graph (dspark_fused_round): draft time is inside verify time

    @property
    def tau(self) -> float:
        return self.acceptance.tau

    @property
    def accept_rate_by_position(self) -> list[float]:
        return self.acceptance.accept_rate_by_position

    @property
    def verified_tokens(self) -> int:
        """Tokens fed to the target in verification forwards (anchor + verified slots, per row and round)."""
        return self.acceptance.fed

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else float("nan")

    @property
    def confidence_records(self) -> list:
        """(confidences of the verified slots, accepted, proposed) per request-round, for calibration."""
        return self.acceptance.confidence_records

    def merge(self, other: "SpeculativeStats") -> "SpeculativeStats":
        self.acceptance.merge(other.acceptance)
        self.batch_size += other.batch_size
        self.new_tokens += other.new_tokens
        for name in ("prefill_time", "draft_time", "verify_time", "total_time"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.draft_graphs = self.draft_graphs and other.draft_graphs
        self.target_graphs = self.target_graphs and other.target_graphs
        self.fused_round = self.fused_round and other.fused_round
        return self

    def to_dict(self) -> dict:
        out = {
            "drafter": self.drafter,
            "schedule": self.schedule,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
            "new_tokens": self.new_tokens,
            "tokens_per_second": self.tokens_per_second,
            "prefill_time": self.prefill_time,
            "draft_time": self.draft_time,
            "verify_time": self.verify_time,
            "total_time": self.total_time,
            "draft_graphs": self.draft_graphs,
            "target_graphs": self.target_graphs,
            "fused_round": self.fused_round,
        }
        out.update(self.acceptance.to_dict())
        return out

    def __repr__(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.accept_rate_by_position)
        return (
            f"SpeculativeStats(drafter={self.drafter!r}, schedule={self.schedule!r}, tau={self.tau:.3f}, "
            f"rounds={self.acceptance.rounds}, new_tokens={self.new_tokens}, verified_tokens={self.verified_tokens}, "
            f"accept_rate_by_position=[{rates}], draft_time={self.draft_time:.3f}s, "
            f"verify_time={self.verify_time:.3f}s, total_time={self.total_time:.3f}s)"
        )


__all__ = ["SpeculativeStats"]
