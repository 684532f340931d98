"""Chat conversations -> token ids + a loss mask on the assistant's tokens.

A training row is one conversation rendered with the target tokenizer's chat template. `loss_mask` is 1 on
every token of every assistant turn's content and on the turn's end-of-turn marker (`<|im_end|>`,
`<|eot_id|>`, `<end_of_turn>`, ...): the draft must learn to predict the end of an answer, because that is the
token that stops generation. Role headers, system/user text and the newline after the end marker are 0.

Assistant spans are found without `{% generation %}` tags (most templates, SmolLM2's included, have none):
for assistant message i we render the conversation up to message i with a sentinel answer, which reveals what
the template writes before the content and after it, check that the rendering up to and with message i reads the
same around the real content, then map the resulting character span onto tokens with the fast tokenizer's
offsets. This works for any template whose rendering of a prefix of the conversation is a prefix of the full
rendering; other answers are found by their text.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# Contains no whitespace, so templates that `trim` the content leave it intact; never occurs in real text.
_SENTINEL = "\u2063HFDSPARKSENTINEL\u2063"

# Why a row was dropped (counted and logged; an error only when every row is dropped).
DROP_REASONS = {
    "malformed": "`messages` is not a list of {'role', 'content'} dicts",
    "no_assistant": "no assistant turn",
    "too_few_loss_tokens": "fewer supervised tokens than min_loss_tokens",
}


# -- loading ---------------------------------------------------------------------------------------------------


def load_conversations(
    source: str | Path | datasets.Dataset | datasets.DatasetDict | Sequence[str | Path],
    split: str = "train",
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Load chat conversations as a `datasets.Dataset` with a `messages` column.

    `source` is a JSON/JSONL file (optionally gzipped) of `{"messages": [{"role", "content"}, ...], ...}` rows,
    a folder written by `save_to_disk`, an in-memory `Dataset`/`DatasetDict`, or a Hub dataset name; or a list
    of these, or a glob such as "data/*.jsonl.gz" (matches in sorted order). Several sources are concatenated in
    the order given.
    """
    if isinstance(source, (str, Path)) and glob.has_magic(str(source)):
        source = [source]
    if isinstance(source, (list, tuple)):
        sources = _expand_globs(source)
        if len(sources) > 1:
            return _concatenate([load_conversations(s, split=split, cache_dir=cache_dir) for s in sources], sources)
        source = sources[0]
    if isinstance(source, datasets.DatasetDict):
        dataset = _pick_split(source, split, "the DatasetDict")
    elif isinstance(source, datasets.Dataset):
        dataset = source
    else:
        path = Path(source)
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            dataset = _pick_split(loaded, split, str(path)) if isinstance(loaded, datasets.DatasetDict) else loaded
        elif path.is_file():
            dataset = _load_json_file(path, cache_dir)
        elif _looks_local(str(source)):
            raise FileNotFoundError(
                f"conversation source {str(source)!r} does not exist: pass a JSON/JSONL(.gz) file, a folder "
                "saved with `Dataset.save_to_disk`, or a Hub dataset name such as 'owner/name'"
            )
        else:
            dataset = _load_hub(str(source), split, cache_dir)
    if "messages" not in dataset.column_names:
        hint = (
            " These look like prompts: answer them with the target first (`hf-dspark regenerate` / "
            "`regenerate_responses`)." if "turns" in dataset.column_names else ""
        )
        raise ValueError(
            f"conversations need a `messages` column of [{{'role', 'content'}}, ...] lists; got columns "
            f"{dataset.column_names}.{hint}"
        )
    if len(dataset) == 0:
        raise ValueError(f"the conversation source {_describe(source)} has no rows")
    return dataset


def _expand_globs(sources: Sequence) -> list:
    """Sources with glob patterns replaced by their matches (sorted); a pattern that matches nothing is an error."""
    if not sources:
        raise ValueError("no conversation source given: pass at least one file, folder, glob or Hub name")
    expanded = []
    for source in sources:
        if not isinstance(source, (str, Path)) or not glob.has_magic(str(source)):
            expanded.append(source)
            continue
        matches = sorted(glob.glob(os.path.expanduser(str(source))))
        if not matches:
            raise FileNotFoundError(
                f"the pattern {str(source)!r} matches no files: check its folder and file names"
            )
        expanded.extend(matches)
    return expanded


def _concatenate(parts: list[datasets.Dataset], sources: list) -> datasets.Dataset:
    """One dataset from several sources. A column that only some sources have is filled with None elsewhere
    (e.g. `finish` from `regenerate_responses`), so no source loses information."""
    features = {}
    for part in parts:
        for name, feature in part.features.items():
            features.setdefault(name, feature)
    aligned = []
    for part in parts:
        for name, feature in features.items():
            if name not in part.column_names:
                part = part.add_column(name, [None] * len(part), feature=feature)
        aligned.append(part.select_columns(list(features)))
    try:
        return datasets.concatenate_datasets(aligned)
    except ValueError as err:
        detail = "; ".join(f"{_describe(src)}: {dict(part.features)}" for src, part in zip(sources, parts))
        raise ValueError(
            f"the conversation sources have incompatible columns ({err}); give every file the same fields with the "
            f"same types. Columns per source: {detail}"
        ) from err


def _describe(source) -> str:
    return repr(str(source)) if isinstance(source, (str, Path)) else type(source).__name__


def _looks_local(source: str) -> bool:
    """A missing path that cannot be a Hub dataset name ("name" or "owner/name")."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or source.endswith(JSON_SUFFIXES)


def _pick_split(dataset_dict: datasets.DatasetDict, split: str, where: str) -> datasets.Dataset:
    if split not in dataset_dict:
        raise ValueError(f"split {split!r} not found in {where}; available splits: {list(dataset_dict)}")
    return dataset_dict[split]


def _load_json_file(path: Path, cache_dir: str | None) -> datasets.Dataset:
    if not path.name.endswith(JSON_SUFFIXES):
        raise ValueError(f"{path} is not a JSON/JSONL file: expected one of {', '.join(JSON_SUFFIXES)}")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if not f.read(4096).strip():
            raise ValueError(f"{path} is empty: it must hold one {{'messages': [...]}} conversation per line")
    try:
        return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as err:  # datasets wraps JSON errors in several exception types
        raise ValueError(
            f"could not read {path} as JSON/JSONL conversations ({type(err).__name__}: {err}); each line must be "
            "one JSON object like {'messages': [{'role': 'user', 'content': ...}, ...]}"
        ) from err


def _load_hub(name: str, split: str, cache_dir: str | None) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, split=split, cache_dir=cache_dir)
    except Exception as err:
        raise ValueError(
            f"could not load the Hub dataset {name!r} (split {split!r}): {type(err).__name__}: {err}. Without "
            "network access, download it elsewhere and pass the local JSONL file or `save_to_disk` folder instead."
        ) from err


# -- tokenization -----------------------------------------------------------------------------------------------


def tokenize_conversations(
    dataset: datasets.Dataset,
    tokenizer,
    max_length: int,
    min_loss_tokens: int = 14,
    num_proc: int | None = None,
    max_loop_repeats: int | None = None,
) -> datasets.Dataset:
    """Apply the chat template; returns a Dataset with `input_ids` and `loss_mask` (0/1) columns only.

    Rows with `finish == "length"` (answers cut at a token limit, as written by `regenerate_responses`) do
    not supervise the end marker the template appends to their last answer. Such answers often end in a
    repetition loop (a small model's sampled answers do): with `max_loop_repeats` = k, a cut answer whose end
    repeats one span (`repetition_loop`) keeps k repeats of it and the row ends there (0 or None: whole loops;
    the training recipe's `DraftTrainingArguments.max_loop_repeats` is 2). Rows are truncated to
    `max_length` tokens. Rows with fewer than `min_loss_tokens` supervised tokens (after
    truncation), with no assistant turn, or with malformed `messages` are dropped and counted in the log; if no
    row survives, a ValueError says why. `num_proc` processes render the templates (None: one per
    `ROWS_PER_PROCESS` rows, at most one per CPU core and `MAX_PROCESSES`; the output is the same for any number).
    """
    if max_length is None or max_length < 2:
        raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
    check_chat_tokenizer(tokenizer)
    if "messages" not in dataset.column_names:
        raise ValueError(
            f"tokenize_conversations needs a `messages` column; got {dataset.column_names} "
            "(load the data with `load_conversations`)"
        )
    if len(dataset) == 0:
        raise ValueError("the conversation dataset has no rows")
    end_ids = sorted(special_token_ids(tokenizer))

    if max_loop_repeats is not None and max_loop_repeats < 0:
        raise ValueError(f"max_loop_repeats must be >= 0 (0 or None keeps loops whole), got {max_loop_repeats}")
    max_loop_repeats = max_loop_repeats or None

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        finishes = batch.get("finish") or [None] * len(batch["messages"])
        statuses, good = [], []
        for i, messages in enumerate(batch["messages"]):
            if not _well_formed(messages):
                statuses.append("malformed")
                continue
            messages = [{**m, "content": m.get("content") or ""} for m in messages]
            if not any(m["role"] == "assistant" for m in messages):
                statuses.append("no_assistant")
                continue
            statuses.append("ok")
            good.append((i, messages))
        encoded = encode_conversations(
            [messages for _, messages in good], tokenizer, end_ids, [finishes[i] != "length" for i, _ in good]
        )
        rows = dict(zip((i for i, _ in good), encoded))
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "_status": [], "_truncated": [], "_loop_cut": []}
        for i, (status, finish) in enumerate(zip(statuses, finishes)):
            ids, mask, truncated, loop_cut = [], [], False, 0
            if status == "ok":
                ids, mask = rows[i]
                if max_loop_repeats is not None and finish == "length":
                    keep = loop_trimmed_length(ids, mask, max_loop_repeats)
                    loop_cut = len(ids) - keep
                    ids, mask = ids[:keep], mask[:keep]
                if len(ids) > max_length:
                    ids, mask, truncated = ids[:max_length], mask[:max_length], True
                if sum(mask) < min_loss_tokens:
                    status = "too_few_loss_tokens"
            out["input_ids"].append(ids if status == "ok" else [])
            out["loss_mask"].append(mask if status == "ok" else [])
            out["_status"].append(status)
            out["_truncated"].append(truncated)
            out["_loop_cut"].append(loop_cut if status == "ok" else 0)
        return out

    if num_proc is None:
        num_proc = tokenization_processes(len(dataset))
    encoded = dataset.map(
        encode_batch,
        batched=True,
        batch_size=256,
        remove_columns=dataset.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        desc="Applying the chat template",
    )
    # Whole columns through Arrow: `encoded[name]` walks the rows one by one in Python (~1 s for 17 k rows).
    columns = encoded.select_columns(["_status", "_truncated", "_loop_cut"]).with_format("arrow")[:]
    statuses = Counter(columns.column("_status").to_pylist())
    num_truncated = sum(columns.column("_truncated").to_pylist())
    dropped = {reason: n for reason, n in statuses.items() if reason != "ok"}
    if statuses.get("ok", 0) == 0:
        reasons = ", ".join(f"{n} x {DROP_REASONS[r]}" for r, n in dropped.items())
        raise ValueError(
            f"no usable conversation among {len(dataset)} rows ({reasons}). Rows need an assistant turn with at "
            f"least min_loss_tokens={min_loss_tokens} tokens; lower min_loss_tokens or check the data."
        )
    if dropped:
        logger.warning(
            "dropped %d of %d conversations: %s",
            sum(dropped.values()),
            len(dataset),
            ", ".join(f"{n} with {DROP_REASONS[r]}" for r, n in sorted(dropped.items())),
        )
    if num_truncated:
        logger.warning("truncated %d conversations to max_length=%d tokens", num_truncated, max_length)
    loop_cuts = [n for n in columns.column("_loop_cut").to_pylist() if n]
    if loop_cuts:
        logger.warning("cut the repetition loops of %d answers cut at a length limit to %d repeats (%d tokens in all)",
                       len(loop_cuts), max_loop_repeats, sum(loop_cuts))  # fmt: skip
    if dropped:
        # An indices mapping over the kept rows, not a rewritten table: flattening 57 k rows took 3 s before the
        # first step on a GPU host, and the train / held-out split maps indices anyway.
        encoded = encoded.filter(lambda s: [x == "ok" for x in s], input_columns="_status", batched=True)
    return encoded.remove_columns(["_status", "_truncated", "_loop_cut"])


# Rendering chat templates is Python work (~1.5 ms a conversation): 33 k conversations took 42 s in one process
# on a GPU host. Below this many rows per process, starting the processes costs more than they save.
ROWS_PER_PROCESS = 2048
# The GPU sits idle meanwhile: 8 processes took 7 s for 33 k conversations on a 16-core H200 host; 16 may halve it.
MAX_PROCESSES = 16


def tokenization_processes(num_rows: int) -> int:
    """Processes for `tokenize_conversations` when the caller names none."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_PROCESSES, num_rows // ROWS_PER_PROCESS))


# A loop: the answer's end repeats one span of at most this many tokens, for at least MIN_LOOP_TOKENS tokens and
# three repeats (shorter repetition is ordinary text: lists, tables, code).
MAX_LOOP_PERIOD = 64
MIN_LOOP_TOKENS = 32


def repetition_loop(tokens: Sequence[int]) -> tuple[int, int]:
    """(period, length) of the longest run at the end of `tokens` in which every token equals the one `period`
    before it (length counts the first repeat too); (0, 0) when the end is no loop (see MIN_LOOP_TOKENS)."""
    n = len(tokens)
    max_period = min(MAX_LOOP_PERIOD, n // 3)
    if max_period < 1:
        return 0, 0
    # All periods at once (a token-by-token walk in Python took 0.5 ms a cut answer): reversed, row p - 1 compares
    # each token with the one p before it; the padding (no token id is negative) ends every row in a mismatch.
    reverse = np.asarray(tokens, dtype=np.int64)[::-1]
    padded = np.concatenate([reverse, np.full(max_period, -1, dtype=np.int64)])
    earlier = np.lib.stride_tricks.sliding_window_view(padded, n)[1:]
    periods = np.arange(1, max_period + 1)
    lengths = np.argmin(reverse == earlier, axis=1) + periods  # matches before the first mismatch, + the first repeat
    lengths[lengths < np.maximum(3 * periods, MIN_LOOP_TOKENS)] = 0
    best = int(np.argmax(lengths))  # the shortest period among the longest runs
    return (best + 1, int(lengths[best])) if lengths[best] else (0, 0)


def loop_trimmed_length(ids: list[int], mask: list[int], repeats: int) -> int:
    """Length to keep of a row whose last supervised span (a cut answer) may end in a repetition loop: up to
    `repeats` repeats of the loop; the whole row when there is none."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end - (mask[end - 1 :: -1] + [0]).index(0) if end else 0  # the supervised span's first token
    period, length = repetition_loop(ids[start:end])
    if not period or length <= repeats * period:
        return len(ids)
    return end - length + repeats * period


def _well_formed(messages: Any) -> bool:
    if not isinstance(messages, list) or not messages:
        return False
    return all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and (m.get("content") is None or isinstance(m.get("content"), str))
        for m in messages
    )


def check_chat_tokenizer(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template: set `tokenizer.chat_template` to "
            "the target's template (training data must be formatted exactly as the target sees it at inference)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "loss masks need character offsets, which only fast tokenizers provide: load the tokenizer with "
            "`AutoTokenizer.from_pretrained(..., use_fast=True)`"
        )


def special_token_ids(tokenizer) -> set[int]:
    """Ids of special tokens (candidates for an assistant turn's end marker)."""
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant turn, the character span [start, end) of its content."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    search_from = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = _span_by_prefix(messages, i, full, tokenizer)
        if span is None:
            span = _span_by_search(full, message["content"], search_from)
        if span is None:
            raise ValueError(
                f"cannot locate assistant turn {i} in the rendered chat template: the template neither renders "
                "conversation prefixes as prefixes of the full conversation nor keeps the assistant text verbatim. "
                "Use a chat template without such rewriting for training data."
            )
        spans.append(span)
        search_from = span[1]
    return full, spans


def _span_by_prefix(messages, i, full, tokenizer) -> tuple[int, int] | None:
    try:
        last = i == len(messages) - 1  # then the turn's rendering is the full one (one render fewer)
        turn = full if last else _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        probe = _render(tokenizer, messages[:i] + [{"role": "assistant", "content": _SENTINEL}], False)
    except Exception:  # a template may reject some prefixes (e.g. requires alternating roles)
        return None
    # The probe shows what the template writes before this turn's content (everything up to the sentinel) and
    # after it; the turn must read the same around its own content, and the full conversation the same up to it.
    start = probe.find(_SENTINEL)
    if start < 0:
        return None
    after = probe[start + len(_SENTINEL) :]
    end = len(turn) - len(after)
    if end < start or not (turn.startswith(probe[:start]) and turn.endswith(after) and full.startswith(probe[:start])):
        return None
    if full[start:end] != turn[start:end]:
        return None
    return start, end


def _span_by_search(full: str, content: str, search_from: int) -> tuple[int, int] | None:
    for candidate in (content, content.strip()):
        if not candidate:
            continue
        start = full.find(candidate, search_from)
        if start >= 0:
            return start, start + len(candidate)
    return None


def encode_conversation(
    messages: list[dict],
    tokenizer,
    end_ids: set[int] | list[int] | None = None,
    supervise_last_end: bool = True,
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation; loss_mask = 1 on assistant content + its end marker.

    `supervise_last_end=False` leaves the last answer's end marker unsupervised: for answers cut at a token
    limit (`finish == "length"`), the target never produced that marker there.
    """
    return encode_conversations([messages], tokenizer, end_ids, [supervise_last_end])[0]


def encode_conversations(
    conversations: Sequence[list[dict]],
    tokenizer,
    end_ids: set[int] | list[int] | None = None,
    supervise_last_end: Sequence[bool] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """`encode_conversation` of each conversation. The templates render one by one (Python); the texts are
    tokenized in one call, which a fast tokenizer spreads over the CPU's cores."""
    if not conversations:
        return []
    end_ids = set(special_token_ids(tokenizer) if end_ids is None else end_ids)
    if supervise_last_end is None:
        supervise_last_end = [True] * len(conversations)
    rendered = [assistant_char_spans(messages, tokenizer) for messages in conversations]
    return [
        _mask_spans(ids, offsets, spans, end_ids, supervise)
        for (ids, offsets), (_, spans), supervise in zip(
            token_offsets(tokenizer, [full for full, _ in rendered]), rendered, supervise_last_end
        )
    ]


def token_offsets(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) of each text, no special tokens added (the chat template already wrote them, as
    apply_chat_template(tokenize=True) does). A fast tokenizer whose backend adds nothing of its own (no truncation,
    no padding, special tokens split as the tokenizer says) is called directly: transformers' conversion of every
    encoding to a dict of lists took a quarter of the time a conversation costs; the ids are the same (tested)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and getattr(backend, "encode_special_tokens", False) == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return [(enc.ids, enc.offsets) for enc in backend.encode_batch(texts, add_special_tokens=False)]
    encodings = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [(list(ids), offsets) for ids, offsets in zip(encodings["input_ids"], encodings["offset_mapping"])]


def _mask_spans(ids, offsets, spans, end_ids, supervise_last_end) -> tuple[list[int], list[int]]:
    """(ids, loss mask): 1 on the tokens of each character span and on the end marker right after it."""
    size = len(ids)
    starts, ends = zip(*offsets) if size else ((), ())
    mask = [0] * size
    t = 0
    for n, (start, end) in enumerate(spans):
        while t < size and ends[t] <= start:
            t += 1
        # Tokens overlapping [start, end): the content (a token straddling the header boundary counts).
        first = t
        while t < size and starts[t] < end:
            t += 1
        mask[first:t] = [int(e > s) for s, e in zip(starts[first:t], ends[first:t])]
        if t < size and ids[t] in end_ids:
            mask[t] = int(supervise_last_end or n < len(spans) - 1)  # the end-of-turn marker right after the content
            t += 1
    return ids, mask


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the chat template, the vocabulary and the special tokens: equal tokenizers, equal data."""
    h = hashlib.sha256()
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(special_token_ids(tokenizer))).encode())
    return h.hexdigest()


def chat_template_fingerprint(tokenizer) -> str:
    return hashlib.sha256((getattr(tokenizer, "chat_template", None) or "").encode()).hexdigest()
