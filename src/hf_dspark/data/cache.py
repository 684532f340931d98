"""The offline target cache: the frozen target's features for every training token, as Arrow files on disk.

Layout of a cache folder::

    manifest.json            settings (target identity, layer ids, dtype, tokenizer hash, ...) + totals
    shard-00000/data.arrow   rows [0, shard_size) as an Arrow IPC stream (`datasets.Dataset.from_file` reads it)
    shard-00000/shard.json   row range, token counts, byte size, sha256 of data.arrow and of the input rows
    shard-00001/...

Columns: `input_ids` list<int32> [T], `loss_mask` list<uint8> [T], `context_features` [T, m*d] (the raw outputs
of `target_layer_ids`, concatenated in that order) and `target_last_hidden` [T, d] (the post-norm final hidden
state), both list<fixed_size_list<...>>. Storage dtypes: "bf16" (bit patterns in uint16, as Arrow has no
bfloat16), "fp16" (Arrow halffloat) or "fp8" (float8 e4m3 bit patterns in uint8 plus one float32 scale per
token and feature vector, in `context_features_scale` [T, m] and `target_last_hidden_scale` [T]).

Each shard is written into a temporary folder and renamed when complete, so a crash never leaves a
half-written shard that looks finished; re-running the build skips finished shards and rebuilds missing or
corrupt ones. Shard k belongs to process k % num_processes, so `accelerate launch` builds shards in parallel.
Reading memory-maps the Arrow files: nothing is copied into RAM except the rows being read.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..target import (
    TargetSpec,
    target_config_hash,
    target_features,
    target_weights_fingerprint,
    validate_layer_ids,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_DATA = "data.arrow"
SHARD_META = "shard.json"
STORAGE_DTYPES = ("bf16", "fp16", "fp8")
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
# Rows computed together before being written: bounds host memory to a few batches of features.
_BATCHES_PER_WRITE = 4


class TargetCacheError(ValueError):
    """A target cache that cannot be used as is; the message names the field or shard and the fix."""


# -- identity ---------------------------------------------------------------------------------------------------


def _normalize_name(name: str | None) -> str:
    # Paths differ across machines; the folder name identifies the model ("SmolLM2-135M-Instruct").
    return Path(str(name).rstrip("/")).name.lower() if name else ""


# -- storage encoding -------------------------------------------------------------------------------------------


def _check_dtype(dtype: str) -> str:
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": "fp8", "float8_e4m3fn": "fp8"}
    dtype = aliases.get(str(dtype).replace("torch.", ""), str(dtype))
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"cache dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
    return dtype


def _encode(x: torch.Tensor, dtype: str, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Features [..., n, d] (any float dtype/device) -> (stored values [..., n, d], fp8 scales [..., n] | None)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16), None
    if dtype == "fp16":
        y = x.to(torch.float16)
        if not torch.isfinite(y).all():
            raise TargetCacheError(
                f"{what} overflow float16 (max |value| {x.abs().max().item():.3g} > 65504): build with dtype='bf16'"
            )
        return y.cpu().numpy(), None
    # fp8: one scale per feature vector maps its largest magnitude to the top of the e4m3 range.
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).cpu().numpy(), scale.squeeze(-1).cpu().numpy()


def _decode(values: np.ndarray, dtype: str, scale: np.ndarray | None = None) -> torch.Tensor:
    """Inverse of `_encode` for one row: values [T, n*d] -> bfloat16 (bf16, fp8) or float16 (fp16) tensor."""
    if dtype == "bf16":
        return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
    if dtype == "fp16":
        return torch.from_numpy(values.copy())
    q = torch.from_numpy(values.copy()).view(torch.float8_e4m3fn).float()
    scale = torch.from_numpy(np.asarray(scale, dtype=np.float32).copy())  # [T, n]
    n = scale.shape[-1]
    t = q.shape[0]
    return (q.view(t, n, -1) * scale.view(t, n, 1)).view(t, -1).to(torch.bfloat16)


def cache_roundtrip(x: torch.Tensor, dtype: str = "bf16", num_vectors: int = 1) -> torch.Tensor:
    """What the cache returns for features `x` [..., num_vectors*d]: lets online training see the same values."""
    dtype = _check_dtype(dtype)
    shape = x.shape
    xv = x.reshape(-1, num_vectors, shape[-1] // num_vectors)
    values, scale = _encode(xv, dtype, "features")
    out = _decode(values.reshape(xv.shape[0], -1), dtype, scale)
    return out.view(shape).to(x.device)


def _storage_type(dtype: str) -> pa.DataType:
    return {"bf16": pa.uint16(), "fp16": pa.float16(), "fp8": pa.uint8()}[dtype]


def cache_schema(settings: dict) -> pa.Schema:
    m, d = len(settings["target_layer_ids"]), settings["target_hidden_size"]
    value = _storage_type(settings["dtype"])
    fields = [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.uint8())),
        pa.field("context_features", pa.list_(pa.list_(value, m * d))),
        pa.field("target_last_hidden", pa.list_(pa.list_(value, d))),
    ]
    if settings["dtype"] == "fp8":
        fields += [
            pa.field("context_features_scale", pa.list_(pa.list_(pa.float32(), m))),
            pa.field("target_last_hidden_scale", pa.list_(pa.float32())),
        ]
    meta = {"hf_dspark": json.dumps({"format_version": FORMAT_VERSION, "dtype": settings["dtype"],
                                     "target_layer_ids": settings["target_layer_ids"]})}
    return pa.schema(fields, metadata=meta)


def _list_array(chunks: list[np.ndarray], width: int | None = None) -> pa.Array:
    """Rows of [T_i] or [T_i, width] numpy arrays -> list<...> (width None) or list<fixed_size_list<width>>."""
    offsets = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum([c.shape[0] for c in chunks], out=offsets[1:])
    flat = pa.array(np.concatenate([c.reshape(-1) for c in chunks]))
    inner = flat if width is None else pa.FixedSizeListArray.from_arrays(flat, width)
    return pa.ListArray.from_arrays(pa.array(offsets), inner)


# -- manifest and shards ----------------------------------------------------------------------------------------


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _shard_dir(root: Path, k: int) -> Path:
    return root / f"shard-{k:05d}"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _rows_sha256(table: pa.Table) -> str:
    """Hash of the token ids, lengths and loss masks of some rows: detects a dataset that changed under a cache."""
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask"):
        column = table.column(name).combine_chunks()
        h.update(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        h.update(pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return h.hexdigest()


def _fix_hint(root: Path) -> str:
    return (
        f"re-run build_target_cache (or `hf-dspark build-cache`) with the same arguments and output_dir {root}: "
        "it keeps the finished shards and rebuilds missing or corrupt ones"
    )


def _verify_shard(root: Path, k: int, settings: dict, verify: str = "fast") -> dict:
    """Checks one finished shard; returns its shard.json entry or raises TargetCacheError naming the fix."""
    folder = _shard_dir(root, k)
    num_rows, size = settings["num_rows"], settings["shard_size"]
    expected_rows = min((k + 1) * size, num_rows) - k * size
    if not (folder / SHARD_META).is_file() or not (folder / SHARD_DATA).is_file():
        raise TargetCacheError(f"shard {k} ({folder}) is missing: the build did not finish; {_fix_hint(root)}")
    corrupt = f"shard {k} ({folder / SHARD_DATA}) is corrupt"
    hint = f"delete {folder} and {_fix_hint(root)}"
    try:
        entry = json.loads((folder / SHARD_META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise TargetCacheError(f"shard {k}: unreadable {SHARD_META} ({err}); {hint}") from None
    on_disk = (folder / SHARD_DATA).stat().st_size
    if on_disk != entry.get("bytes"):
        raise TargetCacheError(f"{corrupt}: {on_disk} bytes on disk, {entry.get('bytes')} when written "
                               f"(truncated?); {hint}")
    if entry.get("num_rows") != expected_rows:
        raise TargetCacheError(f"{corrupt}: {entry.get('num_rows')} rows recorded, {expected_rows} expected; {hint}")
    try:
        table = _open_table(folder / SHARD_DATA)
    except (pa.ArrowException, OSError) as err:
        raise TargetCacheError(f"{corrupt}: not a readable Arrow stream ({err}); {hint}") from None
    if table.num_rows != expected_rows or not table.schema.equals(cache_schema(settings)):
        raise TargetCacheError(f"{corrupt}: {table.num_rows} rows / schema {table.schema.types} do not match the "
                               f"manifest; {hint}")
    if verify == "full" and _file_sha256(folder / SHARD_DATA) != entry.get("sha256"):
        raise TargetCacheError(f"{corrupt}: sha256 checksum mismatch; {hint}")
    return entry


def _open_table(path: Path) -> pa.Table:
    """Zero-copy, memory-mapped table over an Arrow IPC stream file."""
    return pa.ipc.open_stream(pa.memory_map(str(path), "r")).read_all()


def read_manifest(path: str | Path) -> dict:
    root = Path(path)
    manifest = root / MANIFEST_NAME
    if not manifest.is_file():
        raise TargetCacheError(
            f"{root} is not a target cache (no {MANIFEST_NAME}): build one with build_target_cache or "
            "`hf-dspark build-cache`"
        )
    data = json.loads(manifest.read_text())
    version = data.get("settings", {}).get("format_version")
    if version != FORMAT_VERSION:
        raise TargetCacheError(
            f"{root} has cache format_version {version}, this hf_dspark reads {FORMAT_VERSION}: rebuild the cache"
        )
    return data


def _check_settings(root: Path, settings: dict) -> None:
    """Write the settings of a new cache, or check they equal those of the existing one."""
    manifest = root / MANIFEST_NAME
    if not manifest.exists():
        _write_json_atomic(manifest, {"settings": settings, "complete": False})
        return
    existing = read_manifest(root)["settings"]
    for key in sorted(set(existing) | set(settings)):
        if existing.get(key) != settings.get(key):
            raise TargetCacheError(
                f"{root} holds a cache built with {key}={existing.get(key)!r}, but this build uses "
                f"{key}={settings.get(key)!r}: pass the same settings to resume it, or choose a new output_dir"
            )


# -- building ---------------------------------------------------------------------------------------------------


def distributed_state():
    """`accelerate.PartialState()`; on machines without GPUs it must be asked for CPU processes (gloo) explicitly."""
    from accelerate import PartialState

    has_gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not has_gpu
    return PartialState(cpu=use_cpu)  # returns the existing state unchanged when one is already set up


def build_target_cache(
    target,
    dataset,
    output_dir: str | Path,
    *,
    target_layer_ids: Sequence[int],
    tokenizer=None,
    max_length: int | None = None,
    min_loss_tokens: int | None = None,
    batch_size: int = 8,
    shard_size: int = 1000,
    dtype: str = "bf16",
    process_index: int | None = None,
    num_processes: int | None = None,
    progress: bool = True,
    verify: str = "fast",
) -> Path:
    """Run the frozen target over a tokenized dataset (`input_ids`, `loss_mask`) and store its features.

    Shard k (rows [k*shard_size, (k+1)*shard_size)) is built by process k % num_processes; by default these
    come from `accelerate.PartialState()`, and all processes wait for each other at the end. Finished shards
    are kept when re-run (checked with `verify`: "fast" = sizes and Arrow structure, "full" = sha256 too);
    missing or corrupt ones are (re)built. `tokenizer`, `max_length` and `min_loss_tokens` are recorded in
    the manifest (rows longer than `max_length` are an error). Returns the cache folder.
    """
    from tqdm.auto import tqdm

    root = Path(output_dir)
    dtype = _check_dtype(dtype)
    missing = [c for c in ("input_ids", "loss_mask") if c not in dataset.column_names]
    if missing:
        raise TargetCacheError(
            f"the dataset lacks columns {missing} (has {dataset.column_names}): tokenize conversations first with "
            "`tokenize_conversations(dataset, tokenizer, max_length)`"
        )
    if len(dataset) == 0:
        raise TargetCacheError("the dataset has no rows: nothing to cache")
    if shard_size < 1 or batch_size < 1:
        raise ValueError(f"shard_size and batch_size must be >= 1, got {shard_size} and {batch_size}")
    state = None
    if process_index is None or num_processes is None:
        state = distributed_state()
        process_index = state.process_index if process_index is None else process_index
        num_processes = state.num_processes if num_processes is None else num_processes
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} is outside [0, num_processes={num_processes})")

    spec = TargetSpec.from_model(target)
    layer_ids = [int(i) for i in target_layer_ids]
    validate_layer_ids(layer_ids, spec.num_hidden_layers)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    lengths = _column_lengths(dataset)
    _check_rows(dataset, lengths, max_length, spec.vocab_size)

    settings = {
        "format_version": FORMAT_VERSION,
        "target_name_or_path": spec.name_or_path,
        "target_model_type": spec.model_type,
        "target_config_hash": target_config_hash(target.config),
        "target_weights_fingerprint": target_weights_fingerprint(target),
        "target_layer_ids": layer_ids,
        "target_hidden_size": spec.hidden_size,
        "num_target_layers": spec.num_hidden_layers,
        "vocab_size": spec.vocab_size,
        "dtype": dtype,
        "tokenizer_hash": None,
        "chat_template_hash": None,
        "max_length": max_length,
        "min_loss_tokens": min_loss_tokens,
        "num_rows": len(dataset),
        "shard_size": shard_size,
        "num_shards": math.ceil(len(dataset) / shard_size),
    }
    if tokenizer is not None:
        from .chat import chat_template_fingerprint, tokenizer_fingerprint

        settings["tokenizer_hash"] = tokenizer_fingerprint(tokenizer)
        settings["chat_template_hash"] = chat_template_fingerprint(tokenizer)
    root.mkdir(parents=True, exist_ok=True)
    _check_settings(root, settings)

    mine = [k for k in range(settings["num_shards"]) if k % num_processes == process_index]
    for stale in root.glob(".tmp-shard-*"):  # left by a crash; only this process's shards
        if int(stale.name.split("-")[2]) in mine:
            shutil.rmtree(stale, ignore_errors=True)
    todo = []
    for k in mine:
        if _shard_dir(root, k).exists():
            try:
                entry = _verify_shard(root, k, settings, verify)
            except TargetCacheError as err:
                logger.warning("rebuilding shard %d: %s", k, err)
                shutil.rmtree(_shard_dir(root, k))
                todo.append(k)
                continue
            rows = dataset.with_format("arrow")[k * shard_size : (k + 1) * shard_size]
            if entry.get("rows_sha256") != _rows_sha256(rows):
                raise TargetCacheError(
                    f"shard {k} of {root} was built from different rows than this dataset holds (the data or its "
                    "tokenization changed): build into a new output_dir"
                )
        else:
            todo.append(k)

    def tokens(k: int) -> int:
        return int(lengths[k * shard_size : (k + 1) * shard_size].sum())

    bar = tqdm(
        total=sum(tokens(k) for k in mine),
        initial=sum(tokens(k) for k in mine if k not in todo),
        unit="tok",
        unit_scale=True,
        disable=not progress or process_index != 0,
        desc=f"Target cache ({len(todo)}/{len(mine)} shards to build)",
    )
    was_training = target.training
    target.eval()
    try:
        for k in todo:
            _build_shard(target, dataset, root, k, settings, lengths, batch_size, bar)
    finally:
        target.train(was_training)
        bar.close()
    if state is not None:
        state.wait_for_everyone()
    if state is None or state.is_main_process:
        summary = finalize_target_cache(root)
        if summary is not None and progress:
            print(
                f"target cache {root}: {summary['num_rows']} rows, {summary['total_tokens']} tokens, "
                f"{summary['total_bytes'] / 2**20:.1f} MiB, {summary['bytes_per_token']:.1f} bytes/token "
                f"(DeepSpec's layout: {summary['deepspec_bytes_per_token']} bytes/token)"
            )
    return root


def _column_lengths(dataset) -> np.ndarray:
    parts = [
        pc.list_value_length(batch.column("input_ids")).to_numpy(zero_copy_only=False)
        for batch in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=65536)
    ]
    return np.concatenate(parts).astype(np.int64)


def _check_rows(dataset, lengths: np.ndarray, max_length: int | None, vocab_size: int) -> None:
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise TargetCacheError(f"rows {empty[:5].tolist()} have no tokens: drop them before caching")
    if max_length is not None and lengths.max() > max_length:
        bad = np.flatnonzero(lengths > max_length)
        raise TargetCacheError(
            f"{bad.size} rows are longer than max_length={max_length} (row {bad[0]} has {lengths[bad[0]]} tokens): "
            f"tokenize with tokenize_conversations(..., max_length={max_length}), which truncates, or pass the "
            "max_length the data was tokenized with"
        )
    for batch in dataset.with_format("arrow").iter(batch_size=65536):
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        if not pc.all(pc.equal(pc.list_value_length(ids), pc.list_value_length(mask))).as_py():
            raise TargetCacheError("some rows have loss_mask and input_ids of different lengths")
        flat = pc.list_flatten(ids)
        low, high = pc.min_max(flat).values()
        if low.as_py() < 0 or high.as_py() >= vocab_size:
            raise TargetCacheError(
                f"token ids span [{low.as_py()}, {high.as_py()}] but the target's vocabulary is [0, {vocab_size}): "
                "the data was tokenized for another model"
            )


def _build_shard(target, dataset, root: Path, k: int, settings: dict, lengths, batch_size: int, bar) -> None:
    size, num_rows, dtype = settings["shard_size"], settings["num_rows"], settings["dtype"]
    layer_ids, m = settings["target_layer_ids"], len(settings["target_layer_ids"])
    start, stop = k * size, min((k + 1) * size, num_rows)
    device = next(target.parameters()).device
    schema = cache_schema(settings)
    tmp = root / f".tmp-shard-{k:05d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    num_tokens = num_loss_tokens = 0
    with pa.OSFile(str(tmp / SHARD_DATA), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        step = batch_size * _BATCHES_PER_WRITE
        for chunk_start in range(start, stop, step):
            chunk = dataset[chunk_start : min(chunk_start + step, stop)]
            ids, masks = chunk["input_ids"], chunk["loss_mask"]
            feats: list = [None] * len(ids)
            # Similar lengths share a batch (less padding); rows are written back in dataset order.
            order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
            for b in range(0, len(order), batch_size):
                rows = order[b : b + batch_size]
                width = max(len(ids[i]) for i in rows)
                input_ids = torch.zeros(len(rows), width, dtype=torch.long)
                attention = torch.zeros(len(rows), width, dtype=torch.long)
                for j, i in enumerate(rows):  # right padding: causal attention keeps real positions exact
                    input_ids[j, : len(ids[i])] = torch.tensor(ids[i])
                    attention[j, : len(ids[i])] = 1
                context, last = target_features(target, input_ids.to(device), layer_ids, attention.to(device))
                ctx_values, ctx_scale = _encode(context.unflatten(-1, (m, -1)), dtype, "context features")
                last_values, last_scale = _encode(last.unsqueeze(-2), dtype, "final hidden states")
                for j, i in enumerate(rows):
                    t = len(ids[i])
                    feats[i] = (
                        ctx_values[j, :t].reshape(t, -1),
                        last_values[j, :t].reshape(t, -1),
                        None if ctx_scale is None else ctx_scale[j, :t],
                        None if last_scale is None else last_scale[j, :t, 0],
                    )
            columns = {
                "input_ids": _list_array([np.asarray(x, dtype=np.int32) for x in ids]),
                "loss_mask": _list_array([np.asarray(x, dtype=np.uint8) for x in masks]),
                "context_features": _list_array([f[0] for f in feats], feats[0][0].shape[1]),
                "target_last_hidden": _list_array([f[1] for f in feats], feats[0][1].shape[1]),
            }
            if dtype == "fp8":
                columns["context_features_scale"] = _list_array([f[2].astype(np.float32) for f in feats], m)
                columns["target_last_hidden_scale"] = _list_array([f[3].astype(np.float32) for f in feats])
            writer.write_batch(pa.record_batch([columns[f.name] for f in schema], schema=schema))
            chunk_tokens = sum(len(x) for x in ids)
            num_tokens += chunk_tokens
            num_loss_tokens += sum(sum(x) for x in masks)
            bar.update(chunk_tokens)
    entry = {
        "index": k,
        "row_start": start,
        "row_end": stop,
        "num_rows": stop - start,
        "num_tokens": num_tokens,
        "num_loss_tokens": int(num_loss_tokens),
        "bytes": (tmp / SHARD_DATA).stat().st_size,
        "sha256": _file_sha256(tmp / SHARD_DATA),
        "rows_sha256": _rows_sha256(dataset.with_format("arrow")[start:stop]),
    }
    _write_json_atomic(tmp / SHARD_META, entry)
    os.replace(tmp, _shard_dir(root, k))  # atomic: a shard folder only exists once complete


def finalize_target_cache(path: str | Path) -> dict | None:
    """Record totals in the manifest once every shard exists; returns the manifest (None if shards are missing)."""
    root = Path(path)
    manifest = read_manifest(root)
    settings = manifest["settings"]
    if any(not (_shard_dir(root, k) / SHARD_META).is_file() for k in range(settings["num_shards"])):
        return None
    shards = [json.loads((_shard_dir(root, k) / SHARD_META).read_text()) for k in range(settings["num_shards"])]
    total_tokens = sum(s["num_tokens"] for s in shards)
    total_bytes = sum(s["bytes"] for s in shards)
    m, d = len(settings["target_layer_ids"]), settings["target_hidden_size"]
    manifest.update(
        complete=True,
        shards=shards,
        num_rows=sum(s["num_rows"] for s in shards),
        total_tokens=total_tokens,
        total_loss_tokens=sum(s["num_loss_tokens"] for s in shards),
        total_bytes=total_bytes,
        bytes_per_token=total_bytes / max(total_tokens, 1),
        deepspec_bytes_per_token=2 * d * (m + 1) + 6,
        columns={f.name: str(f.type) for f in cache_schema(settings)},
    )
    _write_json_atomic(root / MANIFEST_NAME, manifest)
    return manifest


# -- reading ----------------------------------------------------------------------------------------------------


class TargetCacheDataset(torch.utils.data.Dataset):
    """Map-style dataset over a target cache; rows are read from memory-mapped Arrow files on demand.

    Items: `input_ids` LongTensor [T], `loss_mask` LongTensor [T], `context_features` [T, m*d] and
    `target_last_hidden` [T, d] (bfloat16; float16 for an fp16 cache). `lengths` gives each row's token
    count (for length-grouped sampling), `metadata` the manifest, `hf_dataset` the raw Arrow data as a
    `datasets.Dataset`.
    """

    def __init__(self, path: str | Path, metadata: dict, shards: list[dict], feature_index: list[int] | None = None):
        self.path = Path(path)
        self.metadata = metadata
        self.settings = metadata["settings"]
        self.shards = shards
        self._starts = [s["row_start"] for s in shards]
        self._num_rows = shards[-1]["row_end"] if shards else 0
        # Positions of the requested layers among the cached ones (None: all, in cached order).
        self.feature_index = feature_index
        self.target_layer_ids = (
            [self.settings["target_layer_ids"][i] for i in feature_index]
            if feature_index is not None
            else list(self.settings["target_layer_ids"])
        )
        self._tables: dict[int, pa.Table] = {}
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return self._num_rows

    def _table(self, k: int) -> pa.Table:
        if k not in self._tables:
            self._tables[k] = _open_table(_shard_dir(self.path, k) / SHARD_DATA)
        return self._tables[k]

    def __getstate__(self):  # DataLoader workers reopen the memory maps themselves
        state = dict(self.__dict__)
        state["_tables"] = {}
        return state

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = []
            for k in range(len(self.shards)):
                lens = pc.list_value_length(self._table(k).column("input_ids"))
                self._lengths.extend(lens.to_numpy(zero_copy_only=False).tolist())
        return self._lengths

    @property
    def hf_dataset(self):
        """All shards as one memory-mapped `datasets.Dataset` (raw storage columns)."""
        import datasets

        files = [str(_shard_dir(self.path, k) / SHARD_DATA) for k in range(len(self.shards))]
        parts = [datasets.Dataset.from_file(f) for f in files]
        return datasets.concatenate_datasets(parts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} is outside the cache's {len(self)} rows")
        k = bisect.bisect_right(self._starts, index) - 1
        table = self._table(k)
        row = index - self._starts[k]
        dtype = self.settings["dtype"]

        def values(name: str) -> np.ndarray:
            column = table.column(name)
            i = row
            for chunk in column.chunks:  # a row lives in exactly one record batch
                if i < len(chunk):
                    inner = chunk[i].values
                    if pa.types.is_fixed_size_list(inner.type):
                        inner = inner.flatten()
                    return inner.to_numpy(zero_copy_only=True)
                i -= len(chunk)
            raise IndexError(index)

        ids = torch.from_numpy(values("input_ids").astype(np.int64))
        t = ids.shape[0]
        ctx_scale = values("context_features_scale").reshape(t, -1) if dtype == "fp8" else None
        last_scale = values("target_last_hidden_scale").reshape(t, 1) if dtype == "fp8" else None
        context = _decode(values("context_features").reshape(t, -1), dtype, ctx_scale)
        if self.feature_index is not None:
            m = len(self.settings["target_layer_ids"])
            context = context.view(t, m, -1)[:, self.feature_index].reshape(t, -1)
        return {
            "input_ids": ids,
            "loss_mask": torch.from_numpy(values("loss_mask").astype(np.int64)),
            "context_features": context,
            "target_last_hidden": _decode(values("target_last_hidden").reshape(t, -1), dtype, last_scale),
        }


def load_target_cache(
    path: str | Path,
    draft_config=None,
    target=None,
    verify: str = "fast",
) -> TargetCacheDataset:
    """Open a target cache for training, after checking it is complete and matches the draft and/or target.

    A mismatch raises TargetCacheError naming the field and both values. When the draft reads a subset of the
    cached layers, items carry just those layers, in the draft's order. `verify="full"` also checks each
    shard's sha256 (reads every byte once).
    """
    root = Path(path)
    if verify not in ("fast", "full"):
        raise ValueError(f"verify must be 'fast' or 'full', got {verify!r}")
    metadata = read_manifest(root)
    settings = metadata["settings"]
    feature_index = validate_target_cache(settings, draft_config=draft_config, target=target)
    missing = [k for k in range(settings["num_shards"]) if not (_shard_dir(root, k) / SHARD_META).is_file()]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise TargetCacheError(
            f"the cache at {root} is incomplete: {len(missing)} of {settings['num_shards']} shards are missing "
            f"({shown}); {_fix_hint(root)}"
        )
    shards = [_verify_shard(root, k, settings, verify) for k in range(settings["num_shards"])]
    return TargetCacheDataset(root, metadata, shards, feature_index)


def validate_target_cache(settings: dict, draft_config=None, target=None) -> list[int] | None:
    """Refuse a cache built for another target or other layers; returns the layer selection for the draft."""

    def refuse(field: str, cached, wanted, whose: str, fix: str) -> None:
        raise TargetCacheError(
            f"target cache mismatch on {field}: the cache has {cached!r}, the {whose} has {wanted!r}; {fix}"
        )

    rebuild = "rebuild the cache for this target (build_target_cache / `hf-dspark build-cache`)"
    if target is not None:
        spec = TargetSpec.from_model(target)
        for field, wanted in (
            ("target_model_type", spec.model_type),
            ("target_hidden_size", spec.hidden_size),
            ("num_target_layers", spec.num_hidden_layers),
            ("vocab_size", spec.vocab_size),
            ("target_config_hash", target_config_hash(target.config)),
        ):
            if settings.get(field) != wanted:
                refuse(field, settings.get(field), wanted, "target model", rebuild)
        fingerprint = target_weights_fingerprint(target)
        if None not in (fingerprint, settings.get("target_weights_fingerprint")) and fingerprint != settings[
            "target_weights_fingerprint"
        ]:
            refuse("target_weights_fingerprint", settings["target_weights_fingerprint"], fingerprint,
                   "target model", "the target has other weights than the one the cache was built with; " + rebuild)
    if draft_config is None:
        return None
    cfg = draft_config
    checks = [
        ("vocab_size", cfg.vocab_size),
        ("target_hidden_size", getattr(cfg, "target_hidden_size", None)),
        ("target_model_type", getattr(cfg, "target_model_type", None)),
        ("num_target_layers", getattr(cfg, "num_target_layers", None)),
        ("target_config_hash", getattr(cfg, "target_config_hash", None)),
    ]
    for field, wanted in checks:
        if wanted is not None and settings.get(field) is not None and settings[field] != wanted:
            refuse(field, settings[field], wanted, "draft config",
                   "the draft was built for another target: " + rebuild + ", or build the draft from this target")
    name = getattr(cfg, "target_name_or_path", None)
    if _normalize_name(name) and _normalize_name(settings.get("target_name_or_path")) and (
        _normalize_name(name) != _normalize_name(settings["target_name_or_path"])
    ):
        refuse("target_name_or_path", settings["target_name_or_path"], name, "draft config",
               "the draft was built for another target: " + rebuild)
    cached = list(settings["target_layer_ids"])
    wanted = list(getattr(cfg, "target_layer_ids", None) or [])
    if not wanted or wanted == cached:
        return None
    if set(wanted) <= set(cached):
        return [cached.index(i) for i in wanted]
    refuse("target_layer_ids", cached, wanted, "draft config",
           f"rebuild the cache with target_layer_ids={wanted}, or build the draft with target_layer_ids={cached}")
    return None
