"""How `target.generate(..., assistant_model=draft)` reaches hf_dspark.

transformers has no registry for assistant types: `_assisted_decoding` and `_get_candidate_generator` are
hard-coded, and the loop only runs batch 1. hf_dspark therefore installs one small wrapper around
`GenerationMixin.generate` (`install()`, idempotent; `uninstall()` restores the original). Importing hf_dspark does
not install it: the first draft model built or loaded does (`DraftPreTrainedModel.post_init`), since only a
draft can be an hf_dspark `assistant_model`. Once installed:

- when `assistant_model` is not a `DraftPreTrainedModel`, the call goes to transformers untouched;
- when it is, the wrapper removes `assistant_model` and the `dspark_*` keywords, and calls the original
  generate() with `custom_generate=<speculative loop bound to the draft>`. generate() then does everything it
  normally does (generation config and defaults, special tokens, attention mask, input expansion, logits
  processors and warpers, stopping criteria, the DynamicCache) and calls our loop instead of its own.

Why `custom_generate` rather than replacing `_get_candidate_generator`: the candidate-generator route cannot
serve batches, and see `speculative.py` for why batch 1 uses the same loop. The wrapper also restores two
things generate() drops for callables: the streamer (passed to the loop; generate() still streams the prompt
first, as usual) and `tokenizer` for `stop_strings` (turned into a `StopStringCriteria` here).
"""

from __future__ import annotations

import functools
import inspect

from transformers.generation.utils import GenerationMixin

from .speculative import SpeculativeConfig, check_draft_for_target, speculative_generate

_ORIGINAL_GENERATE = None
_PARAMETERS = None


def _is_draft(model) -> bool:
    from ..models.modeling_draft import DraftPreTrainedModel

    return isinstance(model, DraftPreTrainedModel)


def _as_keywords(original, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keep `inputs` positional, move any further positional arguments to keywords."""
    global _PARAMETERS
    if len(args) <= 1:
        return args, kwargs
    if _PARAMETERS is None:
        _PARAMETERS = [p for p in inspect.signature(original).parameters if p != "self"]
    kwargs = dict(kwargs)
    for name, value in zip(_PARAMETERS[1:], args[1:]):
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument {name!r}")
        kwargs[name] = value
    return args[:1], kwargs


def _stop_string_criteria(model, kwargs: dict):
    """generate() loses `tokenizer` when a custom_generate callable is used; build StopStringCriteria here."""
    from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

    generation_config = kwargs.get("generation_config")
    stop_strings = kwargs.get("stop_strings")
    for source in (generation_config, model.generation_config):
        if stop_strings is None and source is not None:
            stop_strings = getattr(source, "stop_strings", None)
    if not stop_strings:
        return
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate()")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def _speculative_call(original, self, args, kwargs):
    draft = kwargs.pop("assistant_model")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("custom_generate cannot be combined with a draft assistant_model")
    if kwargs.get("synced_gpus"):
        raise ValueError("synced_gpus (DeepSpeed ZeRO-3 / FSDP generation) is not supported with a draft assistant")
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError(
            "assistant_tokenizer is for assistants with another vocabulary; a draft shares the target's tokenizer"
        )
    for key in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if kwargs.get(key):
            raise ValueError(f"{key} cannot be combined with a draft assistant_model")
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if kwargs.get("streamer") is not None and getattr(inputs, "dim", lambda: 0)() == 2 and inputs.shape[0] > 1:
        # Checked before generate() streams the prompt.
        raise ValueError("streamer supports batch size 1 only (as in transformers); stream one prompt at a time")
    check_draft_for_target(self, draft)  # before generate() does any work (and streams the prompt)
    config = SpeculativeConfig.pop_from(kwargs, kwargs.get("generation_config"), self.generation_config)
    _stop_string_criteria(self, kwargs)
    loop = functools.partial(
        speculative_generate, draft=draft, speculative_config=config, streamer=kwargs.get("streamer")
    )
    return original(self, *args, custom_generate=loop, **kwargs)


def install() -> None:
    """Route generate(assistant_model=<hf_dspark draft>) to the speculative loop (idempotent)."""
    global _ORIGINAL_GENERATE
    current = GenerationMixin.generate
    if getattr(current, "_hf_dspark_original", None) is not None:
        return
    original = current

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if kwargs.get("assistant_model") is None and len(args) <= 1:
            return original(self, *args, **kwargs)
        args, kwargs = _as_keywords(original, args, kwargs)
        if not _is_draft(kwargs.get("assistant_model")):
            return original(self, *args, **kwargs)
        return _speculative_call(original, self, args, kwargs)

    generate._hf_dspark_original = original
    _ORIGINAL_GENERATE = original
    GenerationMixin.generate = generate


def uninstall() -> None:
    """Restore transformers' own generate()."""
    current = GenerationMixin.generate
    original = getattr(current, "_hf_dspark_original", None)
    if original is not None:
        GenerationMixin.generate = original


def is_installed() -> bool:
    return getattr(GenerationMixin.generate, "_hf_dspark_original", None) is not None


__all__ = ["install", "uninstall", "is_installed"]
