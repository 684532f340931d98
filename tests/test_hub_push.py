"""Publishing to the Hub, exercised end to end against a local Hub HTTP fake (tests/fake_hub.py):
create_repo + preupload + git-LFS upload + commit, then downloads through from_pretrained / datasets."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_tiny_target
from fake_hub import fake_hub, subprocess_env  # noqa: F401  (fixture)
from safetensors.torch import load

from hf_dspark import DSparkModel, Eagle3Model
from hf_dspark.hub import load_draft, push_draft, push_target_cache

EVAL = {"target": "org/tiny-target", "hardware": "cpu", "command": "x", "results": [
    {"drafter": "dspark", "dataset": "gsm8k", "temperature": 1.0, "tau": 2.5,
     "accept_rate_by_position": [0.8, 0.6], "tokens_per_s": 10.0, "speedup": 1.2}]}


@pytest.fixture(scope="module")
def qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture
def draft(qwen3):
    draft = DSparkModel.from_target(qwen3, num_hidden_layers=1, markov_rank=8)
    draft.config.target_name_or_path = "org/tiny-target"
    return draft


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_push_draft_uploads_weights_config_card_eval_and_shim_in_one_commit(fake_hub, draft, tmp_path):  # noqa: F811
    info = push_draft(draft, "me/tiny-dspark", eval_results=EVAL)
    files = fake_hub.files("me/tiny-dspark")
    assert set(files) == {
        ".gitattributes", "README.md", "config.json", "model.safetensors", "eval_results.json",
        "assets/acceptance_by_position.png", "hf_dspark_remote.py",
    }
    assert len(fake_hub.commits("me/tiny-dspark")) == 2 and info.oid == fake_hub.commits("me/tiny-dspark")[0].sha
    uploaded = load(files["model.safetensors"])
    assert all(torch.equal(uploaded[k], v) for k, v in draft.state_dict().items() if k in uploaded)
    config = json.loads(files["config.json"])
    assert config["model_type"] == "dspark"
    assert config["auto_map"] == {
        "AutoConfig": "hf_dspark_remote.DSparkConfig",
        "AutoModel": "hf_dspark_remote.DSparkModel",
    }
    assert json.loads(files["eval_results.json"]) == EVAL
    readme = files["README.md"].decode()
    assert "base_model: org/tiny-target" in readme and "| gsm8k | 1.0 | 2.50 |" in readme
    assert 'AutoModel.from_pretrained("me/tiny-dspark")' in readme and "trust_remote_code=True" in readme
    assert files["assets/acceptance_by_position.png"][:4] == b"\x89PNG"
    assert "from hf_dspark.models import DSparkModel as _Model" in files["hf_dspark_remote.py"].decode()


def test_pushed_draft_loads_back_from_the_hub(fake_hub, draft):  # noqa: F811
    from transformers import AutoModel

    push_draft(draft, "me/tiny-dspark")
    assert same_weights(AutoModel.from_pretrained("me/tiny-dspark"), draft)
    assert same_weights(load_draft("me/tiny-dspark"), draft)


def test_push_from_a_folder_copies_the_weights_byte_for_byte(fake_hub, draft, tmp_path):  # noqa: F811
    draft.save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "optimizer.pt").write_bytes(b"local only")
    push_draft(tmp_path / "draft", "me/from-dir", revision="v1")
    files = fake_hub.files("me/from-dir", revision="v1")
    local = (tmp_path / "draft" / "model.safetensors").read_bytes()
    assert hashlib.sha256(files["model.safetensors"]).digest() == hashlib.sha256(local).digest()
    assert "optimizer.pt" not in files
    assert set(fake_hub.files("me/from-dir", revision="main")) == {".gitattributes"}  # pushed to the branch only


def test_push_refuses_a_folder_that_is_not_a_draft(fake_hub, qwen3, tmp_path):  # noqa: F811
    qwen3.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="not an hf_dspark draft"):
        push_draft(tmp_path / "target", "me/oops")
    assert ("model", "me/oops") not in fake_hub.repos  # refused before anything was created


def test_draft_push_to_hub_publishes_the_card_and_shim(fake_hub, draft):  # noqa: F811
    """Needs DraftPreTrainedModel.push_to_hub to delegate to hf_dspark.hub.push_draft."""
    draft.push_to_hub("me/via-method", commit_message="first draft")
    files = fake_hub.files("me/via-method")
    assert "hf_dspark_remote.py" in files and "DSpark draft for org/tiny-target" in files["README.md"].decode()
    assert fake_hub.commits("me/via-method")[0].message == "first draft"


def test_push_target_cache_publishes_rows_and_manifest(fake_hub, qwen3, tmp_path):  # noqa: F811
    import datasets

    from hf_dspark.data import build_target_cache, load_target_cache

    rows = datasets.Dataset.from_list(
        [{"input_ids": list(range(3, 3 + n)), "loss_mask": [0, 0] + [1] * (n - 2)} for n in (20, 24, 28, 32)]
    )
    cache_dir = build_target_cache(qwen3, rows, tmp_path / "cache", target_layer_ids=[1, 3], shard_size=2,
                                   batch_size=2, progress=False, process_index=0, num_processes=1)
    push_target_cache(cache_dir, "me/tiny-cache")
    files = fake_hub.files("me/tiny-cache", repo_type="dataset")
    parquet = [p for p in files if p.endswith(".parquet")]
    assert parquet and "README.md" in files
    table = pq.read_table(io.BytesIO(files[parquet[0]]))
    local = load_target_cache(cache_dir).hf_dataset
    assert table.num_rows == len(local) == 4
    assert table.column("input_ids").to_pylist() == local["input_ids"]
    manifest = json.loads(files["hf_dspark_target_cache.json"])
    assert manifest["settings"]["target_layer_ids"] == [1, 3] and manifest["settings"]["dtype"] == "bf16"


def test_push_target_cache_refuses_an_incomplete_cache(fake_hub, qwen3, tmp_path):  # noqa: F811
    import datasets

    from hf_dspark.data import TargetCacheError, build_target_cache

    rows = datasets.Dataset.from_list([{"input_ids": list(range(3, 23)), "loss_mask": [1] * 20}] * 2)
    cache_dir = build_target_cache(qwen3, rows, tmp_path / "cache", target_layer_ids=[1, 3], shard_size=1,
                                   batch_size=1, progress=False, process_index=0, num_processes=1)
    (cache_dir / "shard-00001" / "shard.json").unlink()
    with pytest.raises(TargetCacheError, match="incomplete"):
        push_target_cache(cache_dir, "me/broken-cache")
    assert ("dataset", "me/broken-cache") not in fake_hub.repos


def test_cli_push_then_remote_code_load_in_fresh_processes(fake_hub, tmp_path):  # noqa: F811
    """`hf-dspark push` under HF_ENDPOINT, then AutoModel(trust_remote_code=True) without importing hf_dspark."""
    llama = make_tiny_target("llama")
    draft = Eagle3Model.from_target(llama, target_layer_ids=[0, 2, 4])
    draft.config.target_name_or_path = "org/tiny-llama"
    draft.save_pretrained(tmp_path / "draft")
    env = {**os.environ, **subprocess_env(fake_hub, tmp_path / "cache"), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    push = [sys.executable, "-m", "hf_dspark.cli", "push", "--draft", str(tmp_path / "draft"), "--repo_id", "me/e3",
            "--commit_message", "from the CLI"]
    done = subprocess.run(push, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert fake_hub.commits("me/e3")[0].message == "from the CLI"
    code = (
        "import sys, torch\n"
        "from transformers import AutoModel\n"
        "m = AutoModel.from_pretrained('me/e3', trust_remote_code=True)\n"
        "print(type(m).__module__.split('.')[0], type(m).__name__, float(m.fc.weight.double().sum()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    module, name, checksum = done.stdout.split()[-3:]
    assert (module, name) == ("transformers_modules", "Eagle3Model")
    assert float(checksum) == pytest.approx(float(draft.fc.weight.detach().double().sum()), rel=1e-12)


@pytest.mark.parametrize("command", ["card", "export", "import", "push"])
def test_sharing_subcommands_have_help(command, capsys):
    from hf_dspark.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: hf-dspark {command}" in capsys.readouterr().out
