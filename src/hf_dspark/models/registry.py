"""The drafter registry: what the rest of hf_dspark needs to know about each drafter, in one entry.

Training picks the objective from here, decoding the proposal rule, the hub the display name, card summary and
export formats; no module outside a drafter's folder names a drafter class. A new drafter is its folder under
`models/` plus one entry in `DRAFTERS` (docs/ADDING_A_DRAFTER.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .configuration_draft import DraftConfig
from .dflash import DFlashConfig, DFlashModel
from .dspark import DSparkConfig, DSparkModel
from .eagle3 import Eagle3Config, Eagle3Model
from .modeling_draft import DraftPreTrainedModel


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter.

    model_type: its `config.model_type`, the registry key. objective: the training objective, a key of
    `hf_dspark.training.losses.OBJECTIVES` ("block": CE + L1 + confidence over blocks of slots; "eagle3": soft CE
    over training-time-test steps). autoregressive: drafts one token per forward from its own previous output,
    so decoding may ask it for more tokens than it was trained to propose (block drafters stop at block_size).
    export_formats: the `hf_dspark.hub.formats` exporters written with this drafter in mind; each may still refuse
    it (sglang holds no block drafter) or one draft's settings, with the reason. A format not listed refuses the
    drafter outright. block_label: what the card calls the draft-tokens-per-round setting. recipe_layers: the
    draft depth the training recipe uses when none is asked for (the measured recipe; `from_target` keeps the
    config's own default). recipe_anchors: the anchors per sequence the training recipe samples when none is asked
    for (None: the config's own default).
    """

    model_type: str
    config_class: type[DraftConfig]
    model_class: type[DraftPreTrainedModel]
    display_name: str
    summary: str
    objective: str
    autoregressive: bool = False
    export_formats: tuple[str, ...] = ()
    block_label: str = "block size"
    recipe_layers: int = 1
    recipe_anchors: int | None = None

    # DRAFTERS values were (config class, model class) pairs before the registry grew.
    def __iter__(self):
        _warn_pair_access()
        return iter((self.config_class, self.model_class))

    def __getitem__(self, index):
        _warn_pair_access()
        return (self.config_class, self.model_class)[index]


# Every exporter of hub/formats knows the three built-in drafters (and says why when it refuses one).
_KNOWN_TO_ALL_FORMATS = ("vllm", "sglang", "speculators", "deepspec", "dflash")


def _warn_pair_access() -> None:
    warnings.warn(
        "DRAFTERS values are DrafterSpec entries: use .config_class / .model_class instead of unpacking or "
        "indexing them (the pair form will be removed in a future release)",
        FutureWarning,
        stacklevel=3,
    )


DRAFTERS: dict[str, DrafterSpec] = {
    spec.model_type: spec
    for spec in (
        DrafterSpec(
            model_type="dspark",
            config_class=DSparkConfig,
            model_class=DSparkModel,
            display_name="DSpark",
            summary=(
                "DSpark drafts a whole block in one parallel forward over the target's hidden states, then a light "
                "Markov head samples the block left to right; a confidence head predicts how far the block will be "
                "accepted."
            ),
            objective="block",
            export_formats=_KNOWN_TO_ALL_FORMATS,
            recipe_layers=2,
            # 256 against the config's 512 (6-minute ablations, five runs sharing an H200): +0.09 decoded τ at T = 0
            # and at T = 1, a third more steps. DFlash was not measured at 256 and keeps 512.
            recipe_anchors=256,
        ),
        DrafterSpec(
            model_type="dflash",
            config_class=DFlashConfig,
            model_class=DFlashModel,
            display_name="DFlash",
            summary=(
                "DFlash drafts a whole block in one parallel forward over the target's hidden states (the DSpark "
                "backbone without Markov or confidence head)."
            ),
            objective="block",
            export_formats=_KNOWN_TO_ALL_FORMATS,
            recipe_layers=2,
        ),
        DrafterSpec(
            model_type="eagle3",
            config_class=Eagle3Config,
            model_class=Eagle3Model,
            display_name="Eagle3",
            summary=(
                "Eagle3 drafts one token per forward of a single decoder layer that reads the target's hidden "
                "states and its own previous output (trained with training-time test)."
            ),
            objective="eagle3",
            autoregressive=True,
            export_formats=_KNOWN_TO_ALL_FORMATS,
            block_label="TTT length",
        ),
    )
}


def drafter_spec(name: str) -> DrafterSpec:
    """The registry entry of a drafter (its model_type, any case); the error lists the valid names."""
    try:
        return DRAFTERS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}") from None


def drafter_classes(name: str) -> tuple[type[DraftConfig], type[DraftPreTrainedModel]]:
    """(config class, model class) of a drafter; the error lists the valid names."""
    spec = drafter_spec(name)
    return spec.config_class, spec.model_class


__all__ = ["DRAFTERS", "DrafterSpec", "drafter_classes", "drafter_spec"]
