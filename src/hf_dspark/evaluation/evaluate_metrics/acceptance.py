"""`evaluate` metric module "acceptance": tau, conditional acceptance by position and verify efficiency.

Load it without the Hub: `hf_dspark.evaluation.load_metric("acceptance")` (= `evaluate.load(<path of this
file>)`). One input row per verification round of one request: `proposed` draft tokens verified, `accepted`
of them accepted (a prefix); `compute(..., committed=[...])` optionally gives the tokens committed per round
(default accepted + 1; fewer when EOS or max_new_tokens cut the round). The numbers come from
`hf_dspark.metrics.AcceptanceStats`, the project's single definition, so both APIs agree exactly.
"""

import datasets
import evaluate

from hf_dspark.metrics import AcceptanceStats

_DESCRIPTION = """Speculative-decoding acceptance: tau = committed tokens per verification round (accepted draft
tokens + 1 bonus token), accept_rate_by_position[k] = P(slot k+1 accepted | slots 1..k accepted), verify efficiency
= committed tokens / tokens fed to the target."""

_KWARGS_DESCRIPTION = """
Args:
    proposed (`list[int]`): draft tokens verified in each round.
    accepted (`list[int]`): draft tokens accepted in each round (0 <= accepted <= proposed).
    committed (`list[int]`, optional, compute() only): tokens committed in each round (default accepted + 1).
Returns:
    tau, accept_rate_by_position, accept_count_by_position (rounds behind each rate), verify_efficiency, rounds,
    committed_tokens, verified_tokens, proposed_tokens.
Example:
    >>> metric = hf_dspark.evaluation.load_metric("acceptance")
    >>> metric.compute(proposed=[4, 4], accepted=[4, 1])["tau"]
    3.5
"""

_CITATION = """@misc{dspark2025, title={DSpark: semi-autoregressive speculative decoding drafts}}"""


class Acceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            # `committed` is a compute() keyword, not a feature: evaluate cannot make a feature optional.
            features=datasets.Features({"proposed": datasets.Value("int64"), "accepted": datasets.Value("int64")}),
        )

    def _compute(self, proposed, accepted, committed=None):
        stats = AcceptanceStats()
        if committed is not None and len(committed) != len(proposed):
            raise ValueError(f"committed has {len(committed)} entries but there are {len(proposed)} rounds")
        if len(proposed):
            stats.add_round(proposed, accepted, committed=committed)
        return stats.to_dict()
