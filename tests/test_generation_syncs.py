"""The decoding loop makes the host wait for the device once a round (the commit's one read-back)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import make_tiny_target
from generation_utils import PATHS, left_padded, make_draft
from host_syncs import HostSyncs

import hf_dspark.generation.speculative as speculative


@pytest.mark.parametrize("path", ["dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize(("name", "candidates"), [("dspark", 1), ("dflash", 1), ("eagle3", 1), ("dspark", 3), ("dflash", 3)])
def test_a_round_synchronizes_once(name, candidates, temperature, path, monkeypatch):
    """Counted inside the round's phases, at batch 2: on CUDA each further read-back would leave the GPU idle
    while the host works out what to launch next."""
    target = make_tiny_target("llama")
    draft = make_draft(name, target, block_size=4)
    current, rounds = {"phase": None}, []

    @contextlib.contextmanager
    def phase(label):
        if label == "propose":
            rounds.append(label)
        outer, current["phase"] = current["phase"], label
        try:
            yield
        finally:
            current["phase"] = outer

    monkeypatch.setattr(speculative, "phase", phase)
    ids, mask = left_padded([[5, 9, 11, 3, 7], [8, 4, 6]])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
    torch.manual_seed(3)
    with HostSyncs(lambda: current["phase"]) as syncs:
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=40, pad_token_id=0,
                        dspark_candidates=candidates, **sampling, **PATHS[path])  # fmt: skip
    assert len(rounds) > 3
    assert sum(syncs.counts.values()) <= len(rounds), (len(rounds), dict(syncs.calls))
