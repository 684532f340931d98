"""Sharing drafts: model cards, Hub uploads, export to and import from other tools' formats, LoRA adaptation.

- cards.py: `generate_model_card` / `write_model_card` (template in model_cards/ at the repo root).
- push.py: `push_draft` (weights + config + card + eval JSON/plot + remote-code shim), `push_target_cache`.
- formats/: one module per foreign layout (vLLM, SGLang, speculators, DeepSpec, z-lab DFlash), each stating
  its target-layer index convention and what it refuses; convert.py: `export_draft`, `load_draft`.
- peft_utils.py: LoRA on a trained draft (`apply_lora`, `merge_lora`, `save_lora_adapter`, `load_lora_adapter`).
- cli.py: `hf-dspark card | export | import | push`.
"""

from .._lazy import lazy_attributes

# name -> defining module, imported on first use (keeps `import hf_dspark.<stage>.cli` light for --help).
_EXPORTS = {
    **dict.fromkeys(["generate_model_card", "write_model_card"], ".cards"),
    **dict.fromkeys(["export_draft", "foreign_format", "load_draft", "load_foreign_draft"], ".convert"),
    **dict.fromkeys(["FORMATS", "ExportError", "ExportResult", "ForeignCheckpointError"], ".formats"),
    **dict.fromkeys(["apply_lora", "load_lora_adapter", "merge_lora", "save_lora_adapter"], ".peft_utils"),
    **dict.fromkeys(["push_draft", "push_target_cache", "stage_draft"], ".push"),
}  # fmt: skip
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportResult",
    "ForeignCheckpointError",
    "apply_lora",
    "export_draft",
    "foreign_format",
    "generate_model_card",
    "load_draft",
    "load_foreign_draft",
    "load_lora_adapter",
    "merge_lora",
    "push_draft",
    "push_target_cache",
    "save_lora_adapter",
    "stage_draft",
    "write_model_card",
]
