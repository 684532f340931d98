"""Chat conversations -> input_ids + loss_mask: the mask covers exactly the assistant's answers."""

from __future__ import annotations

import copy
import gzip
import json
import logging

import datasets
import pytest
from conftest import require_default_target

from hf_dspark.data import encode_conversation, load_conversations, tokenize_conversations
from hf_dspark.data.chat import ROWS_PER_PROCESS, special_token_ids, tokenization_processes

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": " (2 + 3) * 4 = 20,\nbecause 5 * 4 = 20. "},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome!"},
]


@pytest.fixture(scope="module")
def smol_tokenizer():
    require_default_target()
    from transformers import AutoTokenizer

    from hf_dspark.resources import default_target_path

    return AutoTokenizer.from_pretrained(default_target_path())


def with_template(tokenizer, template, specials=()):
    tok = copy.deepcopy(tokenizer)
    if specials:
        tok.add_tokens(list(specials), special_tokens=True)
    tok.chat_template = template
    return tok


def masked_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def assistant_answers(messages, trim=False):
    return [m["content"].strip() if trim else m["content"] for m in messages if m["role"] == "assistant"]


def test_smollm2_mask_covers_each_assistant_answer_and_its_end_marker(smol_tokenizer):
    ids, mask = encode_conversation(CONVERSATION, smol_tokenizer)
    assert ids == smol_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    expected = [answer + "<|im_end|>" for answer in assistant_answers(CONVERSATION)]
    assert masked_runs(smol_tokenizer, ids, mask) == expected
    # The newline after <|im_end|>, role headers, the default system prompt and user text are never supervised.
    text_of_unmasked = smol_tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "You are a helpful AI assistant named SmolLM" in text_of_unmasked
    assert "And times 4?" in text_of_unmasked


def test_qwen_style_template_with_default_system_prompt(smol_tokenizer):
    tok = with_template(smol_tokenizer, QWEN_TEMPLATE)
    ids, mask = encode_conversation(CONVERSATION, tok)
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are Qwen")
    assert masked_runs(tok, ids, mask) == [a + "<|im_end|>" for a in assistant_answers(CONVERSATION)]
    # An explicit system prompt replaces the default and stays unsupervised.
    with_system = [{"role": "system", "content": "Be terse."}] + CONVERSATION[:2]
    ids, mask = encode_conversation(with_system, tok)
    assert "You are Qwen" not in tok.decode(ids)
    assert masked_runs(tok, ids, mask) == ["2 + 3 = 5.<|im_end|>"]


def test_llama3_style_template_with_other_markers_and_trimmed_content(smol_tokenizer):
    tok = with_template(smol_tokenizer, LLAMA3_TEMPLATE, LLAMA3_SPECIALS)
    ids, mask = encode_conversation(CONVERSATION, tok)
    assert tok.convert_tokens_to_ids("<|eot_id|>") in special_token_ids(tok)
    expected = [a + "<|eot_id|>" for a in assistant_answers(CONVERSATION, trim=True)]
    assert masked_runs(tok, ids, mask) == expected


def test_gemma_style_template_with_model_role(smol_tokenizer):
    tok = with_template(smol_tokenizer, GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"])
    ids, mask = encode_conversation(CONVERSATION, tok)
    expected = [a + "<end_of_turn>" for a in assistant_answers(CONVERSATION, trim=True)]
    assert masked_runs(tok, ids, mask) == expected


THINKING_TEMPLATE = (  # like Qwen3's: only the last answer is written after an empty reasoning block
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_template_that_writes_the_last_answer_differently_masks_every_answer(smol_tokenizer):
    """Earlier answers render without the reasoning block they get as the last turn: the probe's prefix is then
    no prefix of the full conversation and the answer is found by its text; the last one by the probe."""
    from hf_dspark.data.chat import assistant_char_spans

    tok = with_template(smol_tokenizer, THINKING_TEMPLATE)
    ids, mask = encode_conversation(CONVERSATION, tok)
    assert tok.decode(ids).count("<think>") == 1
    assert masked_runs(tok, ids, mask) == [a + "<|im_end|>" for a in assistant_answers(CONVERSATION)]
    full, spans = assistant_char_spans(CONVERSATION, tok)
    assert [full[a:b] for a, b in spans] == assistant_answers(CONVERSATION)
    assert full[: spans[-1][0]].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # A conversation that opens with the assistant: the probe needs no prompt before it.
    opening = [{"role": "assistant", "content": "Hello! Ask me anything."}, *CONVERSATION[:2]]
    full, spans = assistant_char_spans(opening, smol_tokenizer)
    assert [full[a:b] for a, b in spans] == assistant_answers(opening)


def test_tokenize_conversations_truncates_to_max_length(smol_tokenizer, caplog):
    long_answer = " ".join(["word"] * 400)
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "Talk."},
                                                   {"role": "assistant", "content": long_answer}]}])
    with caplog.at_level(logging.WARNING, logger="hf_dspark.data.chat"):
        rows = tokenize_conversations(ds, smol_tokenizer, max_length=64, min_loss_tokens=1)
    assert rows.column_names == ["input_ids", "loss_mask"]
    assert len(rows[0]["input_ids"]) == 64 and len(rows[0]["loss_mask"]) == 64
    full_ids, full_mask = encode_conversation(ds[0]["messages"], smol_tokenizer)
    assert rows[0]["input_ids"] == full_ids[:64] and rows[0]["loss_mask"] == full_mask[:64]
    assert "truncated 1 conversations to max_length=64" in caplog.text


def test_rows_with_too_few_supervised_tokens_or_no_answer_are_dropped_and_counted(smol_tokenizer, caplog):
    rows = [
        {"messages": CONVERSATION},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "Only a question."}]},
        {"messages": CONVERSATION[:2]},
    ]
    short = sum(encode_conversation(CONVERSATION[:2], smol_tokenizer)[1])
    assert sum(encode_conversation(CONVERSATION, smol_tokenizer)[1]) > short
    with caplog.at_level(logging.WARNING, logger="hf_dspark.data.chat"):
        out = tokenize_conversations(datasets.Dataset.from_list(rows), smol_tokenizer, 512, min_loss_tokens=short + 1)
    assert len(out) == 1
    assert out[0]["input_ids"] == encode_conversation(CONVERSATION, smol_tokenizer)[0]
    assert "dropped 3 of 4 conversations" in caplog.text
    assert "1 with no assistant turn" in caplog.text
    assert "2 with fewer supervised tokens than min_loss_tokens" in caplog.text


def test_rows_are_the_same_whatever_the_batching_and_the_number_of_processes(smol_tokenizer):
    """Templates render per row, texts tokenize per batch, batches spread over processes: none of it may move a
    row's tokens or mask, nor pair a row with another row's encoding (unusable rows sit between usable ones)."""
    rows = []
    for k in range(48):
        messages = copy.deepcopy(CONVERSATION if k % 2 else CONVERSATION[:2])
        messages[1]["content"] = f"Answer {k}: " + "step " * (k % 7) + messages[1]["content"]
        rows.append({"messages": messages, "finish": "length" if k % 5 == 0 else "stop"})
        if k % 9 == 0:
            rows.append({"messages": [{"role": "user", "content": f"No answer {k}."}], "finish": "stop"})
    dataset = datasets.Dataset.from_list(rows)
    one = tokenize_conversations(dataset, smol_tokenizer, 4096, min_loss_tokens=1, num_proc=1)
    three = tokenize_conversations(dataset, smol_tokenizer, 4096, min_loss_tokens=1, num_proc=3)
    usable = [row for row in rows if len(row["messages"]) > 1]
    assert len(one) == len(three) == len(usable) == 48
    assert one["input_ids"] == three["input_ids"] and one["loss_mask"] == three["loss_mask"]
    for row, ids, mask in zip(usable, one["input_ids"], one["loss_mask"]):
        alone = encode_conversation(row["messages"], smol_tokenizer, supervise_last_end=row["finish"] != "length")
        assert (ids, mask) == alone
    assert tokenization_processes(ROWS_PER_PROCESS - 1) == 1  # small data stays in one process


def test_repetition_loop_finds_the_longest_periodic_end_and_ignores_ordinary_text():
    from hf_dspark.data.chat import repetition_loop

    intro = list(range(100, 140))
    loop = [7, 8, 9, 10, 11]
    assert repetition_loop(intro + loop * 12) == (5, 60)  # 12 repeats of a 5-token span
    assert repetition_loop(intro + [1] * 40) == (1, 40)
    assert repetition_loop(intro + loop * 12 + [3]) == (0, 0)  # the end breaks the loop: no loop at the end
    assert repetition_loop(intro + loop * 3) == (0, 0)  # 15 tokens: too short to be a loop
    assert repetition_loop(list(range(200))) == (0, 0)


def reference_repetition_loop(tokens):
    """The definition, token by token: for each period, walk back while each token equals the one a period
    before; keep the longest run that is long enough (the shortest period on ties)."""
    from hf_dspark.data.chat import MAX_LOOP_PERIOD, MIN_LOOP_TOKENS

    best = (0, 0)
    for period in range(1, min(MAX_LOOP_PERIOD, len(tokens) // 3) + 1):
        i = len(tokens) - 1
        while i - period >= 0 and tokens[i] == tokens[i - period]:
            i -= 1
        length = len(tokens) - 1 - i + period
        if length > best[1] and length >= max(3 * period, MIN_LOOP_TOKENS):
            best = (period, length)
    return best


def test_repetition_loop_equals_its_definition_on_random_ends():
    import random

    from hf_dspark.data.chat import repetition_loop

    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        head = [rng.randint(0, rng.randint(1, 4)) for _ in range(rng.randint(0, 60))]
        unit = [rng.randint(0, 9) for _ in range(rng.randint(1, 70))]
        tokens = head + (unit * 20)[: rng.randint(0, 300)]
        assert repetition_loop(tokens) == reference_repetition_loop(tokens), tokens
        found += repetition_loop(tokens) != (0, 0)
    assert 500 < found < 2900  # both loops and loop-free ends were drawn


def test_cut_answers_keep_max_loop_repeats_of_their_loop(smol_tokenizer, caplog):
    """max_loop_repeats: only answers cut at the length limit (finish == "length") are shortened, to the text
    before their loop plus k repeats of it; finished answers and loop-free cut answers are untouched."""
    from hf_dspark.data.chat import loop_trimmed_length, repetition_loop

    looping = ("Here is the plan. " + "Step one is to repeat the same sentence. " * 30).rstrip()
    cut = {"messages": [{"role": "user", "content": "Plan?"}, {"role": "assistant", "content": looping}],
           "finish": "length"}  # fmt: skip
    finished = dict(cut, finish="stop")
    plain_cut = {"messages": CONVERSATION[:2], "finish": "length"}
    ds = datasets.Dataset.from_list([cut, finished, plain_cut])
    whole = tokenize_conversations(ds, smol_tokenizer, 4096, min_loss_tokens=1)
    with caplog.at_level(logging.WARNING, logger="hf_dspark.data.chat"):
        trimmed = tokenize_conversations(ds, smol_tokenizer, 4096, min_loss_tokens=1, max_loop_repeats=2)
    assert trimmed[1] == whole[1] and trimmed[2] == whole[2]
    ids, mask = whole[0]["input_ids"], whole[0]["loss_mask"]
    keep = len(trimmed[0]["input_ids"])
    assert keep == loop_trimmed_length(ids, mask, 2) < len(ids)
    assert trimmed[0]["input_ids"] == ids[:keep] and trimmed[0]["loss_mask"] == mask[:keep]
    # What stays is the introduction and two repeats of the sentence: too short to count as a loop any more.
    start = mask.index(1)
    assert repetition_loop(ids[start:keep]) == (0, 0)
    text = smol_tokenizer.decode(ids[start:keep])
    assert text.startswith("Here is the plan.") and text.count("Step one is to repeat") == 2, text
    assert "cut the repetition loops of 1 answers" in caplog.text
    # 0 keeps loops whole, as None does (the training flag's spelling of "off"); a negative count is an error.
    assert tokenize_conversations(ds, smol_tokenizer, 4096, min_loss_tokens=1, max_loop_repeats=0)[0] == whole[0]
    with pytest.raises(ValueError, match="max_loop_repeats must be >= 0"):
        tokenize_conversations(ds, smol_tokenizer, 4096, max_loop_repeats=-1)


def test_all_rows_unusable_is_an_error_naming_the_reasons(smol_tokenizer):
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "No answer here."}]}] * 3)
    with pytest.raises(ValueError, match="no usable conversation among 3 rows.*3 x no assistant turn"):
        tokenize_conversations(ds, smol_tokenizer, 128)


def test_tokenizer_without_chat_template_is_refused(smol_tokenizer):
    tok = with_template(smol_tokenizer, None)
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_conversations(datasets.Dataset.from_list([{"messages": CONVERSATION}]), tok, 128)


def test_shared_smollm2_responses_mask_exactly_the_answers(smol_tokenizer):
    path = pytest.importorskip("conftest").shared_dir()
    if path is None:
        pytest.skip("../shared/data is not available")
    ds = load_conversations(f"{path}/data/responses/smollm2-135m-instruct.jsonl.gz").select(range(40))
    rows = tokenize_conversations(ds, smol_tokenizer, max_length=100_000, min_loss_tokens=1)
    assert len(rows) == 40 and 0 < ds["finish"].count("length") < 40
    for conv, row in zip(ds, rows):
        answers = assistant_answers(conv["messages"])
        runs = masked_runs(smol_tokenizer, row["input_ids"], row["loss_mask"])
        # An answer cut at the token limit never produced <|im_end|>: the template's marker is not supervised.
        end = "" if conv["finish"] == "length" else "<|im_end|>"
        assert runs == [a + end for a in answers]


# -- loading ------------------------------------------------------------------------------------------------------


def write_jsonl(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def test_load_conversations_from_jsonl_gz_and_save_to_disk_folder(tmp_path):
    rows = [{"id": str(i), "messages": CONVERSATION[:2]} for i in range(3)]
    from_gz = load_conversations(write_jsonl(tmp_path / "c.jsonl.gz", rows, gz=True), cache_dir=str(tmp_path / "hf"))
    assert from_gz["id"] == ["0", "1", "2"] and from_gz[0]["messages"] == CONVERSATION[:2]
    datasets.DatasetDict({"train": from_gz, "test": from_gz.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_conversations(tmp_path / "dd", split="test")) == 1
    with pytest.raises(ValueError, match="split 'validation' not found.*'train', 'test'"):
        load_conversations(tmp_path / "dd", split="validation")


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        load_conversations(tmp_path / "empty.jsonl")


def test_prompt_rows_without_messages_point_to_regeneration(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": ["Hi"]}])
    with pytest.raises(ValueError, match="`messages` column.*regenerate"):
        load_conversations(path, cache_dir=str(tmp_path / "hf"))


def test_missing_local_file_is_not_mistaken_for_a_hub_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_conversations(tmp_path / "nope.jsonl")


def test_hub_dataset_offline_error_names_the_local_alternative(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="could not load the Hub dataset 'someone/chats'.*local JSONL"):
        load_conversations("someone/chats")


def test_token_offsets_equal_the_tokenizers_own_call_and_fall_back_where_the_backend_adds_settings(smol_tokenizer):
    """The data path calls a fast tokenizer's backend directly; its ids and offsets must be what the tokenizer's
    own call returns, and a backend configured to truncate, pad or split special tokens goes through that call."""
    from hf_dspark.data.chat import assistant_char_spans, token_offsets

    texts = [assistant_char_spans(CONVERSATION, smol_tokenizer)[0], "plain text, émoji 🙂 and <|im_end|> inside", ""]

    def own_call(tok):
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [(list(ids), [tuple(o) for o in offsets]) for ids, offsets in zip(enc["input_ids"], enc["offset_mapping"])]

    def ours(tok):
        return [(list(ids), [tuple(o) for o in offsets]) for ids, offsets in token_offsets(tok, texts)]

    assert ours(smol_tokenizer) == own_call(smol_tokenizer)
    truncating = copy.deepcopy(smol_tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=4)  # a tokenizer.json may ship such a setting
    assert ours(truncating) == own_call(truncating)  # transformers lifts it for an un-truncated call; so do we
    assert len(ours(truncating)[0][0]) > 4
    splitting = copy.deepcopy(smol_tokenizer)
    splitting.split_special_tokens = True
    assert ours(splitting) == own_call(splitting)
    assert ours(splitting)[1][0] != ours(smol_tokenizer)[1][0]  # "<|im_end|>" split into pieces there
