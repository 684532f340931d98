"""Model cards: Hub-valid metadata, the τ table and acceptance plot, usage and serving sections, the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_target
from fake_hub import card_metadata_errors
from huggingface_hub import ModelCard

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model
from hf_dspark.cli import main as cli_main
from hf_dspark.hub import export_draft, generate_model_card

EVAL = {
    "target": "org/tiny-target",
    "hardware": "cpu",
    "command": "hf-dspark eval ...",
    "results": [
        {"drafter": "dspark", "dataset": "gsm8k", "temperature": 1.0, "tau": 2.5,
         "accept_rate_by_position": [0.8, 0.6, 0.5], "tokens_per_s": 120.0, "speedup": 1.7},
        {"drafter": "dspark", "dataset": "mt-bench", "temperature": 0.0, "tau": 2.1,
         "accept_rate_by_position": [0.7, None], "tokens_per_s": None, "speedup": None},
        {"drafter": "eagle3", "dataset": "gsm8k", "temperature": 1.0, "tau": 9.9,
         "accept_rate_by_position": [0.99], "tokens_per_s": 1.0, "speedup": 9.9},
    ],
}


@pytest.fixture(scope="module")
def qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture
def draft_dir(qwen3, tmp_path):
    draft = DSparkModel.from_target(qwen3, num_hidden_layers=1, markov_rank=8)
    draft.config.target_name_or_path = "org/tiny-target"
    draft.save_pretrained(tmp_path / "draft")
    return tmp_path / "draft"


def metadata(text: str) -> dict:
    return ModelCard(text).data.to_dict()


def test_card_metadata_is_valid_for_the_hub(draft_dir):
    text = generate_model_card(draft_dir)
    data = metadata(text)
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == "org/tiny-target" and data["license"] == "other"
    assert {"speculative-decoding", "draft-model", "dspark", "hf_dspark"} <= set(data["tags"])
    assert card_metadata_errors(text) == []  # the checks the Hub's validate-yaml applies to these fields


def test_card_tabulates_tau_for_this_drafter_and_embeds_the_plot(draft_dir):
    text = generate_model_card(draft_dir, eval_results=EVAL)
    assert "| gsm8k | 1.0 | 2.50 | 0.80 | 0.60 | 0.50 | 120.0 | 1.70x |" in text
    assert "| mt-bench | 0.0 | 2.10 | 0.70 | – | – | – | – |" in text
    assert "9.9" not in text  # the eagle3 row belongs to another draft
    assert "![Per-position conditional acceptance](assets/acceptance_by_position.png)" in text
    assert (draft_dir / "assets" / "acceptance_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_card_accepts_the_eval_json_file_and_names_its_source(draft_dir, tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(EVAL))
    text = generate_model_card(draft_dir, eval_results=tmp_path / "results.json", plot_path=tmp_path / "plot.png")
    assert "Source: `results.json` (target `org/tiny-target`, cpu)" in text
    assert (tmp_path / "plot.png").exists()


def test_card_refuses_eval_results_it_cannot_use(draft_dir):
    with pytest.raises(ValueError, match="none of them 'dspark'"):
        generate_model_card(draft_dir, eval_results=[r for r in EVAL["results"] if r["drafter"] == "eagle3"])
    with pytest.raises(ValueError, match="lacks tau"):
        generate_model_card(draft_dir, eval_results=[{"drafter": "dspark", "dataset": "gsm8k"}])


def test_card_leaves_out_a_base_model_that_is_not_a_hub_id(qwen3, tmp_path):
    draft = DSparkModel.from_target(qwen3, num_hidden_layers=1, markov_rank=8)
    draft.config.target_name_or_path = str(tmp_path)  # a local folder
    assert "base_model" not in metadata(generate_model_card(draft))
    text = generate_model_card(draft, base_model="org/tiny-target", license="apache-2.0", datasets=["org/chats"])
    assert metadata(text)["base_model"] == "org/tiny-target" and metadata(text)["datasets"] == ["org/chats"]
    assert card_metadata_errors(text) == []


def test_default_target_maps_to_its_hub_id_and_licence(qwen3):
    draft = DSparkModel.from_target(qwen3, num_hidden_layers=1, markov_rank=8)
    draft.config.target_name_or_path = "/root/.cache/hf_dspark/smollm2-135m-instruct"
    data = metadata(generate_model_card(draft))
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and data["license"] == "apache-2.0"


def test_card_shows_usage_and_serving_for_exportable_formats(tmp_path):
    llama = make_tiny_target("llama")
    draft = Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4])
    draft.config.target_name_or_path = "org/tiny-llama"
    text = generate_model_card(draft, repo_id="me/eagle3-tiny")
    assert 'draft = AutoModel.from_pretrained("me/eagle3-tiny")' in text
    assert "target.generate(**inputs, assistant_model=draft" in text
    assert "--format vllm --output_dir eagle3-tiny-vllm" in text and '"method": "eagle3"' in text
    assert "--speculative-algorithm EAGLE3" in text and "vllm serve eagle3-tiny-speculators" in text
    not_exportable = text.split("Not exportable:")[1]
    assert "- deepspec: " in not_exportable and "q_norm/k_norm" in not_exportable


def test_card_records_training_settings(draft_dir, qwen3, tmp_path):
    from transformers import TrainingArguments

    # The loss the draft was configured to train with: its terms above weight 0 (DSpark's default, a DFlash's).
    text = generate_model_card(draft_dir)
    assert "| training loss | 0.5 soft CE against the target + 0.5 L1 to the target + 1 confidence BCE |" in text
    DFlashModel.from_target(qwen3, num_hidden_layers=1).save_pretrained(tmp_path / "dflash")
    assert "| training loss | 1 label CE |" in generate_model_card(tmp_path / "dflash")

    args = TrainingArguments(output_dir=str(draft_dir / "run"), learning_rate=6e-4, max_steps=100, seed=3, report_to=[])
    text = generate_model_card(draft_dir, training_args=args)
    assert "| learning_rate | 0.0006 |" in text and "| max_steps | 100 |" in text and "| seed | 3 |" in text
    text = generate_model_card(draft_dir, training_args={"train_file": "chats.jsonl.gz", "learning_rate": 1e-3})
    assert "Training data: train_file = `chats.jsonl.gz`" in text


def test_card_refuses_a_folder_that_is_not_an_hf_dspark_draft(qwen3, tmp_path):
    export_draft(DSparkModel.from_target(qwen3, num_hidden_layers=1, markov_rank=8), "deepspec", tmp_path / "ds")
    with pytest.raises(ValueError, match="load_draft"):
        generate_model_card(tmp_path / "ds")


def test_cli_card_writes_readme_next_to_the_draft(draft_dir, tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(EVAL))
    assert cli_main(["card", "--draft", str(draft_dir), "--eval_results", str(tmp_path / "results.json"),
                     "--license", "apache-2.0"]) == 0
    text = (draft_dir / "README.md").read_text()
    assert metadata(text)["license"] == "apache-2.0" and "| gsm8k | 1.0 | 2.50 |" in text
    assert (draft_dir / "assets" / "acceptance_by_position.png").exists()
    assert "README.md" in capsys.readouterr().out
