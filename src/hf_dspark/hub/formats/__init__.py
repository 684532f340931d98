"""Foreign checkpoint formats, one module each, found through one registry (like PEFT's tuners).

| format      | DSpark                        | DFlash                        | Eagle3                          |
|-------------|-------------------------------|-------------------------------|---------------------------------|
| deepspec    | Qwen3DSparkModel              | Qwen3DSparkModel, rank 0      | Qwen3Eagle3Model (5 layers)     |
| vllm        | Qwen3DSparkModel (vanilla)    | Qwen3DSparkModel, rank 0      | Llama / Qwen3 Eagle3 layer      |
| sglang      | Qwen3DSparkModel (DSPARK)     | refused (slot convention)     | Llama Eagle3 layer, midlayer.*  |
| speculators | dspark -> Qwen3DSparkModel    | refused (slot convention)     | eagle3, Llama / Qwen3 layer     |
| dflash      | refused (slot convention)     | refused (slot convention)     | refused                         |

Block drafts need q/k norm (Qwen3 targets, or any target with `use_qk_norm=True`). Gemma-family drafts are
refused everywhere (no writer for DeepSpec's/vLLM's Gemma4DSparkModel yet). Each module's docstring states the
layer-id convention it writes, the consumer code it was checked against, and what it refuses.
"""

from .base import DraftFormat, ExportError, ExportResult, ForeignCheckpointError
from .deepspec import DeepSpecFormat
from .dflash import DFlashFormat
from .sglang import SglangFormat
from .speculators import SpeculatorsFormat
from .vllm import VllmFormat

FORMATS: dict[str, DraftFormat] = {
    fmt.name: fmt for fmt in (VllmFormat(), SglangFormat(), SpeculatorsFormat(), DeepSpecFormat(), DFlashFormat())
}

# Detection order for imports: the most specific markers first (speculators configs also say "eagle3").
# SGLang exports are recognised by their hf_dspark block only (their architecture names are vLLM's too).
_DETECTION_ORDER = ("speculators", "sglang", "deepspec", "vllm", "dflash")


def get_format(name: str) -> DraftFormat:
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown export format {name!r}: choose one of {', '.join(FORMATS)}") from None


def detect_format(config: dict) -> DraftFormat | None:
    """The format whose reader understands this config.json dict, or None (hf_dspark's own or unknown)."""
    for name in _DETECTION_ORDER:
        if FORMATS[name].detect(config):
            return FORMATS[name]
    return None


__all__ = [
    "FORMATS",
    "DraftFormat",
    "ExportError",
    "ExportResult",
    "ForeignCheckpointError",
    "detect_format",
    "get_format",
]
