"""LoRA adaptation of a trained draft to a new domain, then merge back into a plain draft.

    from hf_dspark.hub.peft_utils import apply_lora, merge_lora, save_lora_adapter
    apply_lora(draft, r=16)                      # in place: the draft stays a DSparkModel / Eagle3Model
    DraftTrainer(model=draft, args=..., train_dataset=new_domain, target_model=target).train()
    save_lora_adapter(draft, "adapter/")                     # optional: the adapter alone
    merge_lora(draft).save_pretrained("draft-new-domain")   # a plain draft again, loads with from_pretrained

The adapter is injected in place with `peft.inject_adapter_in_model`, not by wrapping the draft in a
`PeftModel`: the draft keeps its class, so `DraftTrainer` (which accepts draft models only), the draft's
inference protocol and `generate(assistant_model=draft)` work unchanged while the adapter is attached.
(transformers' own `PreTrainedModel.add_adapter` does the same, but transformers 5.24 requires peft >= 0.22,
which is not released; peft's function works with every supported version.) `save_lora_adapter` /
`load_lora_adapter` write and read the adapter alone in PEFT's standard layout (adapter_config.json +
adapter_model.safetensors, 1-2% of the draft's size).

Adapted modules (`default_lora_targets`): the decoder layers' attention and MLP projections, the context
projection `fc`, the Markov head's input side (`markov_w1` embedding and the gated/RNN projections) and the
confidence head, which should be re-fitted on the new domain too. The embeddings and lm_head are copies of the
target's and are never adapted (the draft must keep the target's vocabulary geometry); `markov_w2` is used as a
matrix by the chunked loss, not called as a module, so it cannot carry a LoRA wrapper; norms stay frozen.
"""

from __future__ import annotations

from ..models import DraftPreTrainedModel

_LAYER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# markov_w2 and lm_head are read as matrices by the chunked loss and `draft_logits` (never called as modules),
# so a LoRA wrapper around them would be silently ignored: they stay frozen.
_HEAD_MODULES = ("fc", "markov_w1", "markov_head.gate_proj", "rnn_proj", "confidence_head.proj")


def default_lora_targets(draft: DraftPreTrainedModel) -> list[str]:
    """Names (peft suffix patterns) of the draft's modules worth adapting that exist in this draft."""
    names = [name for name, _ in draft.named_modules()]
    found = []
    for target in (*_LAYER_PROJECTIONS, *_HEAD_MODULES):
        if any(n == target or n.endswith("." + target) for n in names):
            found.append(target)
    return found


def lora_config(
    draft: DraftPreTrainedModel,
    r: int = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: list[str] | None = None,
    **kwargs,
):
    """A `peft.LoraConfig` for a draft (alpha defaults to 2 r)."""
    from peft import LoraConfig

    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
        lora_dropout=lora_dropout,
        target_modules=target_modules or default_lora_targets(draft),
        bias="none",
        **kwargs,
    )


def apply_lora(
    draft: DraftPreTrainedModel, config=None, adapter_name: str = "default", **kwargs
) -> DraftPreTrainedModel:
    """Attach a fresh LoRA adapter to `draft` in place and make only the adapter trainable. Returns `draft`.

    config: a `peft.LoraConfig` (default: `lora_config(draft, **kwargs)`).
    """
    from peft import inject_adapter_in_model

    if not isinstance(draft, DraftPreTrainedModel):
        raise TypeError(f"apply_lora adapts hf_dspark drafts, got {type(draft).__name__}")
    if has_lora(draft):
        raise ValueError("the draft already carries a LoRA adapter: merge it first (merge_lora)")
    config = config if config is not None else lora_config(draft, **kwargs)
    config.base_model_name_or_path = getattr(draft, "name_or_path", None) or None
    inject_adapter_in_model(config, draft, adapter_name)
    for name, param in draft.named_parameters():
        param.requires_grad_("lora_" in name)
    draft._lora_config = {adapter_name: config}
    return draft


def has_lora(draft) -> bool:
    """Whether LoRA layers are attached (checked by name, so peft is not imported for plain drafts)."""
    return any(hasattr(m, "lora_A") for m in draft.modules())


def refuse_attached_lora(draft, action: str) -> None:
    if has_lora(draft):
        raise ValueError(
            f"the draft carries a LoRA adapter: merge it first (merge_lora(draft)) before you {action}, or save the "
            "adapter alone with save_lora_adapter"
        )


def save_lora_adapter(draft: DraftPreTrainedModel, path, adapter_name: str = "default"):
    """Write the adapter alone (PEFT layout: adapter_config.json + adapter_model.safetensors)."""
    from pathlib import Path

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = getattr(draft, "_lora_config", {}).get(adapter_name)
    if config is None:
        raise ValueError(f"the draft has no LoRA adapter {adapter_name!r} (apply_lora or load_lora_adapter first)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(draft, adapter_name=adapter_name)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
    config.save_pretrained(str(path))
    return path


def load_lora_adapter(draft: DraftPreTrainedModel, path, adapter_name: str = "default") -> DraftPreTrainedModel:
    """Attach an adapter saved by `save_lora_adapter` (or any PEFT LoRA adapter of this draft)."""
    from pathlib import Path

    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(path))
    apply_lora(draft, config, adapter_name=adapter_name)
    result = set_peft_model_state_dict(draft, load_file(str(Path(path) / "adapter_model.safetensors")), adapter_name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the adapter at {path} has weights for modules this draft lacks: {unexpected[:5]}")
    return draft


def lora_parameters(draft: DraftPreTrainedModel) -> dict[str, int]:
    """{'trainable': n, 'total': n} parameter counts (what the adapter trains vs. the whole draft)."""
    params = {id(p): p for p in draft.parameters()}.values()
    return {"trainable": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}


def merge_lora(draft: DraftPreTrainedModel) -> DraftPreTrainedModel:
    """Fold every LoRA adapter into the base weights and remove the adapter machinery, in place.

    Afterwards the draft is a plain draft again: `save_pretrained` writes full weights under the usual keys and
    `from_pretrained` loads them without peft. Returns `draft`.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not has_lora(draft):
        raise ValueError("the draft has no LoRA adapter to merge (apply_lora or load_lora_adapter first)")
    layers = [(name, module) for name, module in draft.named_modules() if isinstance(module, BaseTunerLayer)]
    for name, module in layers:
        module.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        parent = draft.get_submodule(parent_name) if parent_name else draft
        setattr(parent, child, module.get_base_layer())
    draft.__dict__.pop("_lora_config", None)
    for param in draft.parameters():
        param.requires_grad_(True)
    draft.freeze_target_io()
    return draft


__all__ = [
    "apply_lora",
    "default_lora_targets",
    "has_lora",
    "load_lora_adapter",
    "lora_config",
    "lora_parameters",
    "merge_lora",
    "refuse_attached_lora",
    "save_lora_adapter",
]
