"""The drafter registry is the one place the rest of the package learns about a drafter."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig, AutoModel

import hf_dspark.models
from conftest import make_tiny_target
from generation_utils import make_draft
from hf_dspark.hub import FORMATS, export_draft
from hf_dspark.hub.formats import ExportError
from hf_dspark.models import DRAFTERS, DrafterSpec, drafter_classes, drafter_spec
from hf_dspark.training.losses import OBJECTIVES, draft_loss


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_each_entry_is_consistent_with_the_code_it_names(name):
    spec = DRAFTERS[name]
    assert spec.model_type == name == spec.config_class.model_type
    assert spec.model_class.config_class is spec.config_class
    assert spec.objective in OBJECTIVES
    assert set(spec.export_formats) <= set(FORMATS)
    assert AutoConfig.for_model(name).__class__ is spec.config_class
    assert AutoModel._model_mapping[spec.config_class] is spec.model_class
    assert drafter_classes(name.upper()) == (spec.config_class, spec.model_class)
    # Published repos' remote-code shim imports both classes from hf_dspark.models, the stable public path.
    assert getattr(hf_dspark.models, spec.config_class.__name__) is spec.config_class
    assert getattr(hf_dspark.models, spec.model_class.__name__) is spec.model_class


def test_unknown_drafter_lists_the_valid_names():
    with pytest.raises(ValueError, match="choose one of dspark, dflash, eagle3"):
        drafter_spec("medusa")


def test_pair_access_still_works_with_a_deprecation():
    with pytest.warns(FutureWarning, match="config_class"):
        config_cls, model_cls = DRAFTERS["dspark"]
    assert (config_cls, model_cls) == (DRAFTERS["dspark"].config_class, DRAFTERS["dspark"].model_class)


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


def test_the_loss_follows_the_entry_objective(target, monkeypatch):
    """draft_loss dispatches on the registry entry, not on the output type: pointing the entry at another
    objective changes which loss runs."""
    draft = make_draft("dspark", target, block_size=3)
    called = []
    monkeypatch.setitem(OBJECTIVES, "probe", lambda d, o, **kw: called.append((d, o)) or "probe-result")
    monkeypatch.setitem(DRAFTERS, "dspark", dataclasses.replace(DRAFTERS["dspark"], objective="probe"))
    assert draft_loss(draft, "outputs") == "probe-result" and called == [(draft, "outputs")]


def test_export_refuses_formats_the_entry_does_not_list(target, tmp_path, monkeypatch):
    draft = make_draft("eagle3", target, block_size=3)
    monkeypatch.setitem(DRAFTERS, "eagle3", dataclasses.replace(DRAFTERS["eagle3"], export_formats=("deepspec",)))
    with pytest.raises(ExportError, match="the vllm exporter does not handle eagle3 drafts .exportable as: deepspec"):
        export_draft(draft, "vllm", tmp_path / "out")


def test_decoding_reads_the_autoregressive_hook(target, monkeypatch):
    """A block drafter may not be asked for more tokens than its block; an autoregressive one may."""
    from hf_dspark.generation.speculative import SpeculativeConfig, _num_draft_tokens

    draft = make_draft("dspark", target, block_size=3)
    with pytest.raises(ValueError, match="exceeds the draft's block_size 3"):
        _num_draft_tokens(draft, SpeculativeConfig(block_size=5))
    monkeypatch.setitem(DRAFTERS, "dspark", dataclasses.replace(DRAFTERS["dspark"], autoregressive=True))
    assert _num_draft_tokens(draft, SpeculativeConfig(block_size=5)) == 5


def test_card_reads_name_summary_and_block_label(target):
    from hf_dspark.hub import generate_model_card

    card = generate_model_card(make_draft("eagle3", target, block_size=3), repo_id="me/eagle3-draft")
    spec = DRAFTERS["eagle3"]
    assert f"{spec.display_name} draft for" in card and spec.summary in card
    assert "TTT length (draft tokens per round)" in card and "An **Eagle3**" in card
    assert isinstance(spec, DrafterSpec)


def test_the_export_command_offers_exactly_the_registered_formats():
    from hf_dspark.hub.cli import EXPORT_FORMATS
    from hf_dspark.hub.formats import FORMATS

    assert set(EXPORT_FORMATS) == set(FORMATS)
