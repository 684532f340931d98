"""`evaluate` metric module "calibration": ECE, AUROC and Brier score of a probability against a 0/1 outcome.

Load it without the Hub: `hf_dspark.evaluation.load_metric("calibration")`. For a draft's confidence head,
predictions are c_k (or prefix survival prod c_i) and references whether slot k was accepted (or slots 1..k);
`hf_dspark.metrics.slot_calibration_data` builds both from recorded rounds. The numbers come from
`hf_dspark.metrics.calibration_report`, so both APIs agree exactly.
"""

import datasets
import evaluate

from hf_dspark.metrics import calibration_report

_DESCRIPTION = """Calibration of predicted probabilities: expected calibration error (equal-width bins), area under
the ROC curve (nan when only one class is present) and Brier score."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`): predicted probabilities in [0, 1].
    references (`list[int]`): observed outcomes, 0 or 1.
    n_bins (`int`, defaults to 15): bins of the expected calibration error.
Returns:
    ece, auroc, brier, count.
Example:
    >>> metric = hf_dspark.evaluation.load_metric("calibration")
    >>> metric.compute(predictions=[0.9, 0.2], references=[1, 0])["brier"]
    0.025
"""

_CITATION = """@inproceedings{guo2017calibration, title={On Calibration of Modern Neural Networks}, year={2017}}"""


class Calibration(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, n_bins: int = 15):
        for p in predictions:
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"predictions must be probabilities in [0, 1], got {p}")
        for r in references:
            if r not in (0, 1):
                raise ValueError(f"references must be 0 or 1, got {r}")
        return calibration_report(predictions, references, n_bins)
