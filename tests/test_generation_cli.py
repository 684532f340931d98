"""`hf-dspark calibrate` and `hf-dspark profile-sps`."""

import json

import pytest
from conftest import make_tiny_target
from generation_utils import make_draft

from hf_dspark.cli import build_parser, main
from hf_dspark.generation.scheduler import SPSTable


def test_commands_are_registered(capsys):
    for command in ("calibrate", "profile-sps"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert command in capsys.readouterr().out
    args = build_parser().parse_args(["profile-sps", "--batch-size", "1", "16"])
    assert args.batch_size == [1, 16]


def test_profile_sps_writes_a_cached_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path / "cache"))
    make_tiny_target("llama").save_pretrained(tmp_path / "target")
    out = tmp_path / "tables.json"
    argv = ["profile-sps", "--target", str(tmp_path / "target"), "--device", "cpu", "--batch-size", "1", "2"]
    argv += ["--max-width", "3", "--context-length", "8", "--repeats", "1", "--output", str(out)]
    assert main(argv) == 0
    tables = json.loads(out.read_text())
    assert SPSTable.from_any(tables["2"]).tokens == [2, 4, 6]
    assert len(list((tmp_path / "cache" / "sps").glob("*.json"))) == 2
    assert "steps/s" in capsys.readouterr().out


@pytest.mark.real_model
@pytest.mark.slow
def test_calibrate_saves_the_draft_with_temperatures(smollm2, tmp_path):
    target, _ = smollm2
    draft = make_draft("dspark", target, block_size=3)
    draft.save_pretrained(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["Hi!", "Name a color.", "Count to 3."]))
    argv = ["calibrate", "--draft", str(tmp_path / "draft"), "--prompts", str(prompts), "--max-new-tokens", "6"]
    argv += ["--batch-size", "3", "--device", "cpu", "--dtype", "float32", "--output", str(tmp_path / "calibrated")]
    assert main(argv) == 0
    config = json.loads((tmp_path / "calibrated" / "config.json").read_text())
    assert len(config["confidence_temperatures"]) == 3
    report = json.loads((tmp_path / "calibrated" / "calibration.json").read_text())
    assert report["temperatures"] == config["confidence_temperatures"]
