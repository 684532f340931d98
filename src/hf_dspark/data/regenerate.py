"""Answer prompts with the target itself: the draft should learn the target's own distribution.

`regenerate_responses` reads `{"turns": [...]}` prompts and appends one conversation per prompt to a JSONL file:
`{"id", "messages", "finish", "prompt_tokens", "completion_tokens", ...the prompt's other fields}`. Writing is
resumable: ids already in the file are skipped, and a last line cut off by a crash is detected and removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Iterable

import torch
from transformers import GenerationConfig

from ..grouped_sdpa import grouped_sdpa
from ..target import static_cache_length
from .prompts import Prompt, eos_token_ids, new_token_lengths, read_prompts, select_prompts

logger = logging.getLogger(__name__)

ENGINES = ("generate", "continuous")


def finished_ids(output_file: str | Path) -> set[str]:
    """Ids already answered in `output_file`; repairs a last line left incomplete by an interrupted run."""
    path = Path(output_file)
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0  # byte offset just after the last complete, valid line
    with open(path, "rb") as f:
        data_lines = f.readlines()
    offset = 0
    for i, raw in enumerate(data_lines):
        is_last = i == len(data_lines) - 1
        try:
            row = json.loads(raw)
            valid = isinstance(row, dict) and "id" in row
        except (json.JSONDecodeError, UnicodeDecodeError):
            valid = False
        if not valid:
            if is_last:
                break  # the crash left a partial line: drop it below
            raise ValueError(
                f"{path}, line {i + 1} is not a valid conversation row, and it is not the last line, so it was "
                "not left by an interrupted run: fix or move the file before resuming"
            )
        done.add(str(row["id"]))
        offset += len(raw)
        good_end = offset
    size = path.stat().st_size
    if good_end < size or (size and not data_lines[-1].endswith(b"\n") and good_end == size):
        with open(path, "r+b") as f:
            if good_end < size:
                logger.warning("%s: removing an incomplete last line (%d bytes) left by an interrupted run",
                               path, size - good_end)
                f.truncate(good_end)
            else:  # a complete JSON row whose newline was never written
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
    return done


def regenerate_responses(
    target,
    tokenizer,
    prompts: str | Path | Iterable[dict],
    output_file: str | Path,
    *,
    batch_size: int = 32,
    max_new_tokens: int = 768,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    all_turns: bool = False,
    progress: bool = True,
    static_cache: bool | None = None,
    grouped_attention: bool = True,
    engine: str = "generate",
    rows: slice | None = None,
    max_prompt_chars: int | None = None,
) -> Path:
    """Answer each prompt with `target.generate` and append the conversations to `output_file` (JSONL).

    The default samples the target's own distribution (temperature 1, no top-p/top-k; 768 new tokens): on
    SmolLM2 a draft trained on such answers decoded at T = 1 with 19% more τ than one trained on answers sampled
    with the paper's settings (temperature 0.7, top-p 0.8, top-k 20), and greedily with the same τ
    (`benchmarks/results/ablations_smollm2_10min_data.json`). `temperature=0` decodes greedily.

    Only the first turn is answered unless `all_turns=True`, which answers
    every turn in order, each seeing the previous answers. `finish` is "length" when any answer hit
    `max_new_tokens`; `prompt_tokens` / `completion_tokens` sum over the answered turns (completion tokens
    count the end-of-turn token). Re-running with the same `output_file` resumes where it stopped. `rows` (a slice
    of the prompt file's rows) and `max_prompt_chars` (every turn at most this long) answer a part of a large prompt
    file (`select_prompts`).

    `static_cache` (default: on CUDA, first turns only) decodes on transformers' static cache, whose one-token step
    generate() compiles and replays as a CUDA graph: several times faster than the eager loop for a small target.
    Every call gets the same cache length (the longest prompt + max_new_tokens, rounded up to 256), so the compiled
    step keeps one shape per batch size instead of recompiling for each longer prompt. It needs the prompts'
    lengths up front, so it answers first turns only (`all_turns` runs without it).

    `grouped_attention` (default on) runs an "sdpa" target whose query heads share key/value heads through
    `hf_dspark.grouped_sdpa`: the same attention without transformers' per-step copies of the cache's keys and
    values, which dominated a step at large batch (34.6 ms at batch 512 for SmolLM2 on an H200).

    `engine="continuous"` answers first turns through transformers' continuous batching (`generate_batch`, a paged
    cache whose finished rows are refilled at once) instead of `generate()` on fixed batches, each of which decodes
    until its longest answer ends (at batch 512 with SmolLM2's 768-token cap, 57% of the decoded rows had already
    ended). `batch_size` is then the number of prompts submitted (and written) at a time. The answers follow the
    same distribution, not the same random draws (the engine schedules its own batches); greedy, they are the
    same answers.
    """
    from tqdm.auto import tqdm

    output_file = Path(output_file)
    if output_file.name.endswith(".gz"):
        raise ValueError(f"{output_file}: write plain .jsonl (appending to gzip is not crash safe); compress later")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "continuous" and (all_turns or static_cache):
        raise ValueError("engine='continuous' answers first turns on its own paged cache: drop all_turns / "
                         "static_cache, or use engine='generate'")  # fmt: skip
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: set `tokenizer.chat_template` to the target's template")
    all_prompts = select_prompts(read_prompts(prompts), rows, max_prompt_chars)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    done = finished_ids(output_file)
    order = {p.id: i for i, p in enumerate(all_prompts)}
    todo = [p for p in all_prompts if p.id not in done]
    if len(done) and not todo:
        logger.info("%s already answers all %d prompts", output_file, len(all_prompts))

    eos_ids = eos_token_ids(target, tokenizer)
    do_sample = temperature is not None and temperature > 0
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=top_p if do_sample else None,
        top_k=top_k if do_sample else None,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0],
    )
    device = next(target.parameters()).device
    if static_cache is None:
        static_cache = device.type == "cuda" and not all_turns and engine == "generate"
    if static_cache and all_turns:
        raise ValueError("static_cache needs every prompt's length up front, which later turns do not have: "
                         "pass static_cache=False (--static_cache false) with all_turns")  # fmt: skip
    if static_cache and todo:
        gen_config.cache_implementation = "static"
        first_turns = [_prompt_text(tokenizer, _first_turn(p)) for p in todo]
        # Tokenized as _answer_batch tokenizes them, so the cache fits every call's prompt.
        ids = tokenizer(first_turns, add_special_tokens=False)["input_ids"]
        gen_config.max_cache_len = static_cache_length(ids, max_new_tokens)
    was_training = target.training
    target.eval()
    saved = (tokenizer.padding_side, tokenizer.pad_token)
    tokenizer.padding_side = "left"  # generate() continues every row from its last real token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos_ids[0])
    bar = tqdm(total=len(all_prompts), initial=len(all_prompts) - len(todo), unit="prompt", disable=not progress,
               desc="Regenerating answers")
    attention = contextlib.ExitStack()
    grouped = False
    if grouped_attention and engine == "generate":  # (continuous batching attends through its own paged attention)
        grouped = attention.enter_context(grouped_sdpa(target))  # False where it does not apply

    def answer(batch: list[Prompt]) -> list[dict]:
        # Seeded by the batch's first prompt, so a resumed run samples like an uninterrupted one would.
        torch.manual_seed(seed + order[batch[0].id])
        if engine == "continuous":
            return _answer_continuous(target, tokenizer, batch, gen_config, eos_ids)
        return _answer_batch(target, tokenizer, batch, gen_config, eos_ids, device, all_turns)

    try:
        with attention, open(output_file, "a", encoding="utf-8") as out:
            for start in range(0, len(todo), batch_size):
                batch = todo[start : start + batch_size]
                # The compiled static-cache step has one graph per batch size: a smaller last batch would compile
                # and capture anew (about 40 s for SmolLM2 at batch 896 on an H200, against 15 s for the batch's
                # decoding). It is filled up with copies of its last prompt instead, whose answers are dropped.
                filler = batch_size - len(batch) if static_cache and start > 0 else 0
                try:
                    rows = answer(batch + batch[-1:] * filler)
                except Exception as err:  # noqa: BLE001 - retried once without grouped attention, else raised
                    if not grouped:
                        raise
                    logger.warning("grouped attention failed (%s: %s); answering with the model's own attention "
                                   "from now on (--no_grouped_attention skips the attempt)",
                                   type(err).__name__, err)  # fmt: skip
                    attention.close()  # back to "sdpa"
                    grouped = False
                    rows = answer(batch + batch[-1:] * filler)
                rows = rows[: len(batch)]
                out.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
                out.flush()
                os.fsync(out.fileno())
                bar.update(len(batch))
    finally:
        bar.close()
        tokenizer.padding_side, tokenizer.pad_token = saved
        target.train(was_training)
    return output_file


def _first_turn(prompt: Prompt) -> list[dict]:
    return [{"role": "user", "content": prompt.turns[0]}]


def _prompt_text(tokenizer, messages: list[dict]) -> str:
    """A conversation so far, rendered with the chat template up to the assistant's turn."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _answer_batch(target, tokenizer, batch: list[Prompt], gen_config, eos_ids, device, all_turns) -> list[dict]:
    messages: list[list[dict]] = [[] for _ in batch]
    finish = ["stop"] * len(batch)
    prompt_tokens = [0] * len(batch)
    completion_tokens = [0] * len(batch)
    rounds = max(len(p.turns) for p in batch) if all_turns else 1
    eos = torch.tensor(eos_ids, device=device)
    for r in range(rounds):
        active = [i for i, p in enumerate(batch) if r < len(p.turns)]
        for i in active:
            messages[i].append({"role": "user", "content": batch[i].turns[r]})
        texts = [_prompt_text(tokenizer, messages[i]) for i in active]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = target.generate(**enc, generation_config=gen_config)
        new = out[:, enc["input_ids"].shape[1] :]  # [A, <= max_new_tokens]
        lengths = new_token_lengths(new, eos_ids).tolist()  # the end-of-turn token counts
        ended = torch.isin(new, eos).any(1).tolist()
        for j, (row, i, n, stop) in enumerate(zip(new, active, lengths, ended)):
            answer = row[: n - 1] if stop else row
            if not stop:
                finish[i] = "length"
            messages[i].append(
                {"role": "assistant", "content": tokenizer.decode(answer.tolist(), skip_special_tokens=True)}
            )
            prompt_tokens[i] += int(enc["attention_mask"][j].sum())
            completion_tokens[i] += n
    return [_row(p, messages[i], finish[i], prompt_tokens[i], completion_tokens[i]) for i, p in enumerate(batch)]


def _answer_continuous(target, tokenizer, batch: list[Prompt], gen_config, eos_ids) -> list[dict]:
    """First turns through transformers' continuous batching; one request per prompt, in order."""
    texts = [_prompt_text(tokenizer, _first_turn(p)) for p in batch]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    cpu = next(target.parameters()).device.type == "cpu"
    results = target.generate_batch(
        inputs=ids, generation_config=gen_config, progress_bar=False, warmup=not cpu,
        continuous_batching_config=_cpu_cache_config(ids, gen_config.max_new_tokens) if cpu else None,
    )  # fmt: skip
    # Request ids are "req_<position in inputs>" for a fresh manager (transformers 5.x); each output's prompt is
    # checked against its input, so a change of that naming fails loudly instead of mixing answers up.
    outputs = [results.get(f"req_{i}") for i in range(len(batch))]
    failed = [p.id for p, o, x in zip(batch, outputs, ids)
              if o is None or getattr(o, "error", None) or list(o.prompt_ids) != list(x)]  # fmt: skip
    if failed:
        raise RuntimeError(f"continuous batching returned no answer for {len(failed)} prompt(s) ({failed[:3]}...); "
                           "rerun to resume, or use engine='generate' (--engine generate)")  # fmt: skip
    eos = set(eos_ids)
    rows = []
    for p, prompt_ids, out in zip(batch, ids, outputs):
        tokens = list(out.generated_tokens)
        stop = bool(tokens) and tokens[-1] in eos  # the engine stops at the first end-of-turn token
        answer = tokens[:-1] if stop else tokens
        reply = {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}
        messages = _first_turn(p) + [reply]
        rows.append(_row(p, messages, "stop" if stop else "length", len(prompt_ids), len(tokens)))
    return rows


def _cpu_cache_config(ids: list[list[int]], max_new_tokens: int):
    """On a CPU, continuous batching sizes its paged cache and its tokens per forward from the machine's free
    memory (gigabytes: a few tiny requests took a minute); give it the blocks these requests can use and a modest
    forward. On CUDA its own sizing is kept."""
    from transformers import ContinuousBatchingConfig

    block = 256  # the engine's default block (page) size
    blocks = sum(-(-(len(p) + max_new_tokens) // block) for p in ids)
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=512)


def _row(prompt: Prompt, messages: list[dict], finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": prompt.id,
        **prompt.extra,
        "messages": messages,
        "finish": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
    }
