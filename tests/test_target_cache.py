"""The offline target cache: exact features, sharded + resumable builds, memory-mapped reads, loud validation."""

from __future__ import annotations

import json
import pickle
import shutil

import datasets
import pyarrow as pa
import pytest
import torch
from conftest import make_tiny_target, require_default_target

from hf_dspark import DSparkModel, target_features
from hf_dspark.data import (
    TargetCacheError,
    build_target_cache,
    cache_roundtrip,
    load_target_cache,
    read_manifest,
)

LAYERS = [0, 2, 4]
NUM_ROWS = 11
SHARD = 4  # -> shards of 4, 4 and 3 rows


def make_rows(num_rows=NUM_ROWS, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in torch.randint(6, 40, (num_rows,), generator=g).tolist():
        prompt = int(torch.randint(2, n - 2, (1,), generator=g))
        rows.append({
            "input_ids": torch.randint(3, vocab, (n,), generator=g).tolist(),
            "loss_mask": [0] * prompt + [1] * (n - prompt),
        })
    return datasets.Dataset.from_list(rows)


@pytest.fixture
def target():
    return make_tiny_target("qwen3")


@pytest.fixture
def rows():
    return make_rows()


def build(target, rows, path, **kw):
    kw.setdefault("target_layer_ids", LAYERS)
    kw.setdefault("shard_size", SHARD)
    kw.setdefault("batch_size", 3)
    kw.setdefault("progress", False)
    return build_target_cache(target, rows, path, **kw)


def count_forwards(model):
    """Number of target forwards (one per batch of rows)."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def shard_bytes(path):
    return {p.parent.name: p.read_bytes() for p in sorted(path.glob("shard-*/data.arrow"))}


@pytest.mark.parametrize("dtype, rel_tol", [("bf16", 2**-8), ("fp16", 2**-11), ("fp8", 2**-4)])
def test_cached_features_equal_the_targets_within_storage_rounding(tmp_path, target, rows, dtype, rel_tol):
    cache = load_target_cache(build(target, rows, tmp_path / "c", dtype=dtype))
    assert len(cache) == NUM_ROWS
    for i in range(NUM_ROWS):
        item = cache[i]
        ids = torch.tensor(rows[i]["input_ids"])
        context, last = target_features(target, ids[None], LAYERS)  # unpadded, one row at a time
        assert torch.equal(item["input_ids"], ids) and item["input_ids"].dtype == torch.long
        assert item["loss_mask"].tolist() == rows[i]["loss_mask"] and item["loss_mask"].dtype == torch.long
        assert item["context_features"].dtype == (torch.float16 if dtype == "fp16" else torch.bfloat16)
        assert item["context_features"].shape == (len(ids), len(LAYERS) * 32)
        assert item["target_last_hidden"].shape == (len(ids), 32)
        for got, want in ((item["context_features"], context[0]), (item["target_last_hidden"], last[0])):
            # Per feature vector: error bounded by the storage format's relative precision.
            want_v = want.view(len(ids), -1, 32)
            err = (got.float().view_as(want_v) - want_v).abs()
            scale = want_v.abs() if dtype != "fp8" else want_v.abs().amax(-1, keepdim=True)
            assert (err <= rel_tol * scale + 1e-6).all()
        # Online training can reproduce exactly what the cache returns.
        assert torch.equal(cache_roundtrip(context[0], dtype, num_vectors=len(LAYERS)), item["context_features"])


def test_manifest_records_target_identity_layers_dtype_and_bytes_per_token(tmp_path, target, rows, capsys):
    from transformers import AutoTokenizer

    require_default_target()
    from hf_dspark.resources import default_target_path

    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    path = build(target, rows, tmp_path / "c", tokenizer=tokenizer, max_length=64, min_loss_tokens=3, progress=True)
    assert "bytes/token" in capsys.readouterr().out
    manifest = read_manifest(path)
    s = manifest["settings"]
    assert s["target_model_type"] == "qwen3" and s["target_layer_ids"] == LAYERS
    assert (s["target_hidden_size"], s["num_target_layers"], s["vocab_size"]) == (32, 6, 96)
    assert s["dtype"] == "bf16" and s["max_length"] == 64 and s["min_loss_tokens"] == 3
    assert len(s["tokenizer_hash"]) == 64 and len(s["chat_template_hash"]) == 64 and len(s["target_config_hash"]) == 64
    assert manifest["complete"] and manifest["num_rows"] == NUM_ROWS
    assert [sh["num_rows"] for sh in manifest["shards"]] == [4, 4, 3]
    total_tokens = sum(len(x) for x in rows["input_ids"])
    assert manifest["total_tokens"] == total_tokens
    assert manifest["total_loss_tokens"] == sum(sum(x) for x in rows["loss_mask"])
    on_disk = sum(p.stat().st_size for p in path.glob("shard-*/data.arrow"))
    assert manifest["bytes_per_token"] == pytest.approx(on_disk / total_tokens)
    # bf16 features for 3 layers + final hidden state: 2*32*4 bytes, plus ids, masks and Arrow framing.
    assert 2 * 32 * 4 + 5 <= manifest["bytes_per_token"] < 1.25 * (2 * 32 * 4 + 5)
    assert manifest["deepspec_bytes_per_token"] == 2 * 32 * 4 + 6


def test_fp8_cache_is_about_half_the_size_of_bf16(tmp_path, target, rows):
    bf16 = read_manifest(build(target, rows, tmp_path / "bf16"))["bytes_per_token"]
    fp8 = read_manifest(build(target, rows, tmp_path / "fp8", dtype="fp8"))["bytes_per_token"]
    # Payload per token: fp8 (32 + 4) * 4 + 5 = 149 bytes vs bf16 2 * 32 * 4 + 5 = 261, plus the same Arrow framing.
    # (At real widths the float32 scales vanish: d = 2560, 5 layers -> 50.1% of bf16.)
    assert fp8 < 0.65 * bf16


def test_reads_are_memory_mapped_not_copied_into_ram(tmp_path, target):
    rows = make_rows(num_rows=24)
    path = build(target, rows, tmp_path / "c", shard_size=8)
    cache_size = sum(p.stat().st_size for p in path.glob("shard-*/data.arrow"))
    before = pa.total_allocated_bytes()
    cache = load_target_cache(path)
    items = [cache[i] for i in range(len(cache))]
    assert sum(len(x["input_ids"]) for x in items) == sum(cache.lengths)
    # Arrow allocates nothing for the data itself: its buffers point into the memory-mapped files.
    assert pa.total_allocated_bytes() - before < cache_size / 10
    # The same files seen as a `datasets.Dataset`: memory-mapped tables, one per shard.
    blocks = [t for row in cache.hf_dataset.data.blocks for t in row]
    assert len(blocks) == 3 and all(isinstance(t, datasets.table.MemoryMappedTable) for t in blocks)
    assert cache.lengths == [len(x) for x in rows["input_ids"]]


def test_two_processes_build_disjoint_shards_that_load_as_one_dataset(tmp_path, target, rows):
    path = tmp_path / "c"
    build(target, rows, path, process_index=0, num_processes=2)
    assert sorted(p.name for p in path.glob("shard-*")) == ["shard-00000", "shard-00002"]
    with pytest.raises(TargetCacheError, match=r"incomplete: 1 of 3 shards are missing \(1\).*re-run"):
        load_target_cache(path)
    build(target, rows, path, process_index=1, num_processes=2)
    assert sorted(p.name for p in path.glob("shard-*")) == ["shard-00000", "shard-00001", "shard-00002"]
    assert read_manifest(path)["complete"]
    assert shard_bytes(path) == shard_bytes(build(target, rows, tmp_path / "single"))
    cache = load_target_cache(path)
    assert [cache[i]["input_ids"].tolist() for i in range(len(cache))] == rows["input_ids"]


def test_an_interrupted_build_resumes_without_recomputing_finished_shards(tmp_path, target, rows):
    path = tmp_path / "c"
    calls = count_forwards(target)

    def crash_on_fourth_forward(module, args):
        if len(calls) == 4:  # shard 0 takes forwards 1-2 (4 rows, batch 3); crash in shard 1's second
            raise KeyboardInterrupt

    handle = target.register_forward_pre_hook(crash_on_fourth_forward)
    with pytest.raises(KeyboardInterrupt):
        build(target, rows, path)
    handle.remove()
    assert [p.name for p in path.glob("shard-*")] == ["shard-00000"]
    assert len(list(path.glob(".tmp-shard-*"))) == 1  # the half-written shard 1, never mistaken for done
    calls.clear()
    build(target, rows, path)
    assert len(calls) == 3  # shards 1 (4 rows: 2 forwards) and 2 (3 rows: 1 forward) only
    assert not list(path.glob(".tmp-shard-*"))
    assert shard_bytes(path) == shard_bytes(build(target, rows, tmp_path / "uninterrupted"))
    calls.clear()
    build(target, rows, path)  # complete: nothing to do
    assert calls == []


def test_truncated_shard_is_reported_and_rebuilt_alone(tmp_path, target, rows):
    path = build(target, rows, tmp_path / "c")
    reference = shard_bytes(path)
    data = path / "shard-00001" / "data.arrow"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(TargetCacheError, match=r"shard 1 .* is corrupt.*truncated.*delete .*shard-00001 and re-run"):
        load_target_cache(path)
    calls = count_forwards(target)
    build(target, rows, path)
    assert len(calls) == 2  # only shard 1
    assert shard_bytes(path) == reference
    assert len(load_target_cache(path, verify="full")) == NUM_ROWS


def test_flipped_bytes_are_caught_by_the_checksum(tmp_path, target, rows):
    path = build(target, rows, tmp_path / "c")
    data = path / "shard-00002" / "data.arrow"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF  # inside feature values: same size, still valid Arrow
    data.write_bytes(bytes(raw))
    load_target_cache(path)  # the fast check reads sizes and structure only
    with pytest.raises(TargetCacheError, match=r"shard 2 .* corrupt: sha256 checksum mismatch"):
        load_target_cache(path, verify="full")
    calls = count_forwards(target)
    build(target, rows, path, verify="full")
    assert len(calls) == 1  # only shard 2
    load_target_cache(path, verify="full")


def test_missing_shard_and_missing_manifest_are_clear_errors(tmp_path, target, rows):
    path = build(target, rows, tmp_path / "c")
    shutil.rmtree(path / "shard-00001")
    with pytest.raises(TargetCacheError, match=r"1 of 3 shards are missing \(1\)"):
        load_target_cache(path)
    (path / "manifest.json").unlink()
    with pytest.raises(TargetCacheError, match="not a target cache.*build_target_cache"):
        load_target_cache(path)


def test_draft_for_another_target_is_refused_naming_the_field(tmp_path, target, rows):
    path = build(target, rows, tmp_path / "c")
    matching = DSparkModel.from_target(target, target_layer_ids=LAYERS, num_hidden_layers=1, block_size=4).config
    assert len(load_target_cache(path, draft_config=matching, target=target)) == NUM_ROWS

    llama_draft = DSparkModel.from_target(make_tiny_target("llama"), target_layer_ids=LAYERS, num_hidden_layers=1,
                                          block_size=4).config
    with pytest.raises(TargetCacheError, match="mismatch on target_model_type: the cache has 'qwen3', the draft config "
                                               "has 'llama'"):
        load_target_cache(path, draft_config=llama_draft)
    wide = make_tiny_target("qwen3", vocab_size=128)
    with pytest.raises(TargetCacheError, match="mismatch on vocab_size: the cache has 96, the target model has 128"):
        load_target_cache(path, target=wide)
    retrained = make_tiny_target("qwen3", seed=1)  # same architecture, other weights
    with pytest.raises(TargetCacheError, match="target_weights_fingerprint.*other weights"):
        load_target_cache(path, target=retrained)


def test_other_layer_ids_are_refused_and_a_subset_is_selected(tmp_path, target, rows):
    path = build(target, rows, tmp_path / "c")
    other = DSparkModel.from_target(target, target_layer_ids=[1, 3], num_hidden_layers=1, block_size=4).config
    with pytest.raises(TargetCacheError, match=r"target_layer_ids: the cache has \[0, 2, 4\], the draft config has "
                                               r"\[1, 3\]; rebuild the cache with target_layer_ids=\[1, 3\]"):
        load_target_cache(path, draft_config=other)
    subset = DSparkModel.from_target(target, target_layer_ids=[4, 0], num_hidden_layers=1, block_size=4).config
    full, picked = load_target_cache(path), load_target_cache(path, draft_config=subset)
    assert picked.target_layer_ids == [4, 0]
    f, p = full[3]["context_features"].view(-1, 3, 32), picked[3]["context_features"].view(-1, 2, 32)
    assert torch.equal(p[:, 0], f[:, 2]) and torch.equal(p[:, 1], f[:, 0])


def test_building_into_a_cache_with_other_settings_names_the_field(tmp_path, target, rows):
    path = build(target, rows, tmp_path / "c")
    with pytest.raises(TargetCacheError, match="built with dtype='bf16', but this build uses dtype='fp16'"):
        build(target, rows, path, dtype="fp16")
    with pytest.raises(TargetCacheError, match=r"target_layer_ids=\[0, 2, 4\], but this build uses target_layer_ids="
                                               r"\[1, 2, 4\]"):
        build(target, rows, path, target_layer_ids=[1, 2, 4])
    changed = rows.map(lambda r: {"input_ids": [5] + r["input_ids"][1:]})
    with pytest.raises(TargetCacheError, match="shard 0 .* different rows.*new output_dir"):
        build(target, changed, path)


def test_bad_rows_are_refused_before_any_target_forward(tmp_path, target, rows):
    calls = count_forwards(target)
    with pytest.raises(TargetCacheError, match="rows are longer than max_length=16.*tokenize_conversations"):
        build(target, rows, tmp_path / "a", max_length=16)
    with pytest.raises(TargetCacheError, match=r"lacks columns \['loss_mask'\].*tokenize_conversations"):
        build(target, rows.remove_columns("loss_mask"), tmp_path / "b")
    with pytest.raises(TargetCacheError, match=r"token ids span \[\d+, 499\].*\[0, 96\).*another model"):
        build(target, rows.map(lambda r, i: {"input_ids": [499] * len(r["input_ids"]) if i == 0 else r["input_ids"]},
                               with_indices=True), tmp_path / "c")
    with pytest.raises(ValueError, match="final decoder layer"):
        build(target, rows, tmp_path / "d", target_layer_ids=[0, 5])
    assert calls == []


def test_fp16_overflow_is_an_error_naming_bf16(tmp_path, target, rows):
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(1e6)
    with pytest.raises(TargetCacheError, match="overflow float16.*dtype='bf16'"):
        build(target, rows, tmp_path / "c", target_layer_ids=[-1, 2], dtype="fp16")


def test_cache_dataset_pickles_for_dataloader_workers(tmp_path, target, rows):
    cache = load_target_cache(build(target, rows, tmp_path / "c"))
    cache[0]
    clone = pickle.loads(pickle.dumps(cache))
    assert torch.equal(clone[5]["context_features"], cache[5]["context_features"])
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["settings"] == clone.metadata["settings"]


def test_build_cache_command_line_on_real_conversations(tmp_path):
    require_default_target()
    from transformers import AutoTokenizer

    from conftest import shared_dir
    from hf_dspark.cli import main
    from hf_dspark.resources import default_target_path

    if shared_dir() is None:
        pytest.skip("../shared/data is not available")
    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    tiny = make_tiny_target("llama", vocab_size=len(tokenizer))  # SmolLM2's vocabulary, tiny weights
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    source = datasets.load_dataset(
        "json", data_files=f"{shared_dir()}/data/responses/smollm2-135m-instruct.jsonl.gz", split="train"
    ).select(range(6))
    source.to_json(tmp_path / "conv.jsonl")
    args = ["build-cache", "--target", str(tmp_path / "tiny"), "--data", str(tmp_path / "conv.jsonl"),
            "--output-dir", str(tmp_path / "cache"), "--max-length", "96", "--shard-size", "4",
            "--target-layer-ids", "1,3", "--dtype", "fp8"]
    assert main(args) == 0
    cache = load_target_cache(tmp_path / "cache", target=tiny)
    s = cache.metadata["settings"]
    assert (len(cache), s["max_length"], s["min_loss_tokens"], s["dtype"]) == (6, 96, 14, "fp8")
    assert max(cache.lengths) <= 96 and cache[0]["context_features"].shape[1] == 2 * 32
    assert main(args) == 0  # re-running is a no-op on a complete cache
