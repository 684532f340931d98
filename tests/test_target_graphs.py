"""The online target's feature forward replayed from CUDA graphs (training/target_graphs.py): the 4-D mask it feeds
the target gives the same features as transformers' own masking, and the captured forward the same as the plain
one (on a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import FAMILIES, make_tiny_target, replaying_on_cpu

from hf_dspark.compilation import KeyedGraphs
from hf_dspark.target import explicit_mask_unsupported, has_sliding_layers, target_features
from hf_dspark.training.target_graphs import CapturedTargetFeatures, padded_causal_mask, target_mask

LAYERS = [1, 2, 4]


def _batch(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # right padding, as the collator pads
    mask[1, 5:] = 0
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_explicit_mask_gives_transformers_features_on_every_real_position(family, attention):
    target = make_tiny_target(family, attn_implementation=attention)
    assert explicit_mask_unsupported(target) is None
    ids, mask = _batch()
    ctx, last = target_features(target, ids, LAYERS, mask)
    ctx4, last4 = target_features(target, ids, LAYERS, target_mask(target, mask))
    real = mask.bool()
    torch.testing.assert_close(ctx4[real], ctx[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last4[real], last[real], rtol=1e-5, atol=1e-5)


def test_padded_causal_mask_rule():
    mask = torch.tensor([[1, 1, 0]])
    expected = torch.tensor([[[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]], dtype=torch.bool)  # padding row 2 sees itself
    assert torch.equal(padded_causal_mask(mask), expected)


def test_which_targets_take_an_explicit_mask():
    """One rule for training's captured forward and generation's verify masks: sdpa/eager, no sliding windows."""
    flex = make_tiny_target("llama", attn_implementation="flex_attention")
    assert "attn_implementation='sdpa'" in explicit_mask_unsupported(flex)
    qwen2 = make_tiny_target("qwen2")
    assert not has_sliding_layers(qwen2.config)  # Qwen2 names a window but leaves it off (use_sliding_window=False)
    assert "sliding" in explicit_mask_unsupported(qwen2, sliding=True)  # generation passes its cache's flags
    assert has_sliding_layers(make_tiny_target("gemma3").config)


def test_sliding_window_targets_keep_their_own_masking():
    """Gemma3's sliding layers need another mask than the causal one: no graphs, with the reason."""
    assert "sliding" in explicit_mask_unsupported(make_tiny_target("gemma3"))
    captured = CapturedTargetFeatures(make_tiny_target("gemma3"))
    assert captured(*_batch()[:1], LAYERS) is None and "sliding" in captured.failed


def test_the_default_setting_passes_over_unsupported_targets_quietly(caplog):
    """On by default on CUDA: a target that cannot take the explicit mask is logged at info level, not warned about;
    asked for explicitly, it is warned about."""
    with caplog.at_level(logging.INFO, logger="hf_dspark.training.target_graphs"):
        CapturedTargetFeatures(make_tiny_target("gemma3"), quiet=True)
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        caplog.clear()
        CapturedTargetFeatures(make_tiny_target("gemma3"))
        assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_off_cuda_it_serves_nothing_and_the_caller_runs_the_plain_forward():
    captured = CapturedTargetFeatures(make_tiny_target("llama"))
    ids, mask = _batch()
    assert captured(ids, LAYERS, mask) is None and not captured.graphs.graphs and captured.failed is None


class _CapturedOnCPU(CapturedTargetFeatures):
    """The runner's bookkeeping on CPU: a 'capture' that records the call and 'replays' the plain forward."""

    def __init__(self, target, max_shapes: int = 8):
        super().__init__(target, max_shapes=max_shapes)
        self.graphs.__class__ = replaying_on_cpu(KeyedGraphs)

    @property
    def captures(self) -> int:
        return self.graphs.captures


def test_a_shape_is_captured_when_it_comes_a_second_time():
    """One-off shapes (an epoch's last batch, the evaluation's) run plain and keep no graph; a shape that comes again
    is captured once and replayed from then on, reading each call's batch; past max_shapes the plain forward runs."""
    target = make_tiny_target("llama")
    runner = _CapturedOnCPU(target, max_shapes=2)
    ids, mask = _batch()
    short = (ids[:, :8].contiguous(), mask[:, :8].contiguous())
    assert runner(ids, LAYERS, mask) is None and runner(*short[:1], LAYERS, short[1]) is None  # first sightings
    for seed in range(3):
        new_ids = (ids + seed) % 90 + 3
        out = runner(new_ids, LAYERS, mask)
        ctx, last = target_features(target, new_ids, LAYERS, mask)
        real = mask.bool()  # padding positions see themselves under the explicit mask (`padded_causal_mask`)
        torch.testing.assert_close(out[0][real], ctx[real])
        torch.testing.assert_close(out[1][real], last[real])
    assert runner.captures == 1 and len(runner.graphs.graphs) == 1
    assert runner(*short[:1], LAYERS, short[1]) is not None and runner.captures == 2
    third = (ids[:2], mask[:2])
    assert runner(*third[:1], LAYERS, third[1]) is None and runner(*third[:1], LAYERS, third[1]) is None  # cap
    assert runner.captures == 2


def _assert_replay_is_the_plain_forward(captured, target, ids, mask):
    out = captured(ids, LAYERS, mask)
    if out is None and captured.failed is None:
        out = captured(ids, LAYERS, mask)  # a shape's first call runs plain; its second captures
    assert out is not None, captured.failed
    ctx, last = target_features(target, ids, LAYERS, mask)
    real = mask.bool()
    torch.testing.assert_close(out[0][real], ctx[real])
    torch.testing.assert_close(out[1][real], last[real])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_replayed_features_equal_the_plain_forward_for_each_batch(family):
    target = make_tiny_target(family, attn_implementation="sdpa").cuda()
    captured = CapturedTargetFeatures(target)
    for seed in range(3):  # new contents in the same buffers: each replay reads this batch
        ids, mask = _batch("cuda")
        ids = (ids + seed) % 90 + 3
        _assert_replay_is_the_plain_forward(captured, target, ids, mask)
    assert len(captured.graphs.graphs) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_of_several_batch_shapes_replayed_in_turn_keep_their_own_features():
    """Training pads to a few lengths: one graph per shape, replayed in any order, each equal to the plain forward."""
    target = make_tiny_target("llama", attn_implementation="sdpa").cuda()
    captured = CapturedTargetFeatures(target)
    ids, mask = _batch("cuda")
    shapes = [(ids, mask), (ids[:, :8].contiguous(), mask[:, :8].contiguous()), (ids[:2], mask[:2])]
    for turn in range(2):
        for batch_ids, batch_mask in shapes:
            _assert_replay_is_the_plain_forward(captured, target, batch_ids, batch_mask)
    assert len(captured.graphs.graphs) == 3
