"""How many draft tokens each request sends to verification (docs/ALGORITHMS.md, "Confidence-scheduled verification").

Three schedules, selected by the generation-config field `dspark_schedule`:

- "none" (default): verify the whole block (DSpark/DFlash block size, Eagle3 ttt_length, or the
  `dspark_block_size` override).
- "threshold": verify the prefix before the first slot whose confidence c_k is below `dspark_threshold`.
- "prefix": the paper's hardware-aware prefix scheduler (Algorithm 1). Prefix survival a_{r,j} = prod_{i<=j}
  c_{r,i}; all (r, j) with a > 0 are admitted in descending order of a while the expected throughput
  Theta = tau* x SPS(B) keeps improving, and the search stops at the first admission that does not improve it.

Both confidence schedules are non-anticipating, which keeps decoding lossless: c_k is computed from the tokens
x_1..x_{k-1} only, so whether slot k is verified never depends on x_k or later tokens. For Algorithm 1 this is
what the early break guarantees: the admission of (r, j) depends only on items sorted before it, and every item
of row r that depends on x_{r,j} (a_{r,j+1}, ...) is sorted after it (survival is monotone; ties keep slot
order). `prefix_schedule(..., early_stop=False)` is the retrospective global search of the paper's Appendix A,
kept only to demonstrate (in tests) that it breaks this property; generate() never uses it.

SPS(B) is the target's forward steps per second when B tokens are verified in one forward. `profile_sps`
measures it on the current device ([rows, width] inputs over a prefilled cache, B = rows x width) and
`load_or_profile_sps` caches the table as JSON under `$HF_DSPARK_CACHE/sps/` (default `~/.cache/hf_dspark`;
logged), keyed by model identity, dtype, device name, rows and context length. `SPSTable` interpolates the step
*time* 1/SPS linearly between profiled points (time is close to affine in B), clamps it below the profiled range,
and above it assumes compute-bound scaling (time grows in proportion to B), the conservative choice.

Tokens are counted as in the paper, B = sum_r (1 + l_r) (one anchor per row plus its verified slots). The
batched loop pads rows to the widest one, so its true cost is closer to rows x (1 + max_r l_r); the greedy
admission order keeps rows balanced, which keeps the two close.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

SCHEDULES = ("none", "threshold", "prefix")

logger = logging.getLogger(__name__)


# -- cost table ---------------------------------------------------------------------------------------------


@dataclass
class SPSTable:
    """Profiled SPS(B): target forward steps per second at B verified tokens per forward.

    tokens: increasing token counts; sps: steps per second at each; meta: how/where it was measured.
    """

    tokens: list[int]
    sps: list[float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.tokens) != len(self.sps) or not self.tokens:
            raise ValueError("an SPS table needs one or more (tokens, steps-per-second) pairs of equal length")
        order = np.argsort(np.asarray(self.tokens, dtype=np.float64), kind="stable")
        self.tokens = [int(self.tokens[i]) for i in order]
        self.sps = [float(self.sps[i]) for i in order]
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"SPS table has duplicate token counts: {self.tokens}")
        if any(t < 1 for t in self.tokens) or any(not s > 0 for s in self.sps):
            raise ValueError("SPS table entries must have tokens >= 1 and steps per second > 0")

    def __call__(self, num_tokens):
        """SPS at `num_tokens` (scalar or array): linear in step time inside the table, clamped below it,
        proportional (compute-bound) above it."""
        b = np.asarray(num_tokens, dtype=np.float64)
        tokens = np.asarray(self.tokens, dtype=np.float64)
        times = 1.0 / np.asarray(self.sps, dtype=np.float64)
        step_time = np.interp(b, tokens, times)  # clamps at both ends
        above = b > tokens[-1]
        step_time = np.where(above, times[-1] * b / tokens[-1], step_time)
        out = 1.0 / step_time
        return float(out) if out.ndim == 0 else out

    @classmethod
    def from_any(cls, value) -> "SPSTable":
        """An SPSTable from a table, a {tokens: sps} mapping, [(tokens, sps), ...] pairs or a JSON file path."""
        if isinstance(value, SPSTable):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value)
        if isinstance(value, Mapping):
            if "tokens" in value and "sps" in value:
                return cls(list(value["tokens"]), list(value["sps"]), dict(value.get("meta", {})))
            return cls([int(k) for k in value], [float(v) for v in value.values()])
        if isinstance(value, Sequence):
            pairs = [tuple(p) for p in value]
            return cls([int(p[0]) for p in pairs], [float(p[1]) for p in pairs])
        raise TypeError(
            f"dspark_sps_table must be an SPSTable, a {{tokens: steps_per_second}} dict, a list of pairs or a JSON "
            f"path, got {type(value).__name__}"
        )

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "sps": list(self.sps), "meta": dict(self.meta)}

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(self.to_dict(), tmp, indent=2)
        os.replace(tmp.name, path)  # atomic: never a half-written table
        return path

    @classmethod
    def load(cls, path) -> "SPSTable":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no SPS table at {path}: create one with `hf-dspark profile-sps` or profile_sps()")
        return cls.from_any(json.loads(path.read_text()))


# A forward over a whole block per row costing at most this many one-token forwards counts as flat (see below).
FLAT_VERIFY_COST = 1.25


def verify_cost_is_flat(sps: Callable, rows: int, width: int, ratio: float = FLAT_VERIFY_COST) -> bool:
    """Whether the target's forward over `width` tokens per row costs at most `ratio` forwards of one token per
    row (launch- or memory-bound, e.g. a small target or a small batch). Algorithm 1 then admits (nearly) every
    slot, and verifying whole blocks on fixed shapes (the static path: CUDA graphs, no per-round host sync) is the
    same choice made cheaper; a steeper table is where shorter prefixes save compute."""
    return float(sps(rows)) / float(sps(rows * width)) <= ratio


# -- schedules ----------------------------------------------------------------------------------------------


def survival(confidences: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}: [R, n] -> [R, n], monotone non-increasing along j."""
    return torch.cumprod(confidences.float().clamp(0.0, 1.0), dim=-1)


def fixed_schedule(max_lengths: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Whole blocks, cut only by each row's remaining token budget."""
    return max_lengths.clamp(max=num_tokens, min=0)


def threshold_schedule(confidences: torch.Tensor, threshold: float, max_lengths: torch.Tensor | None = None):
    """l_r = number of leading slots with c_k >= threshold (the first slot below it and all after are dropped)."""
    keep = (confidences >= threshold).long().cumprod(dim=-1).sum(dim=-1)
    return keep if max_lengths is None else torch.minimum(keep, max_lengths)


def prefix_schedule(
    confidences,
    sps: Callable,
    max_lengths=None,
    early_stop: bool = True,
) -> torch.Tensor:
    """Paper Algorithm 1 for R requests: confidences [R, n] (c_{r,k}), sps: B -> steps per second,
    max_lengths [R] (optional cap per row, e.g. the remaining token budget). Returns l*_r [R] (long, on the
    confidences' device).

    With early_stop=False the break is removed (retrospective global search): NOT lossless when confidences
    depend on sampled tokens (paper Appendix A); for tests and diagnostics only.
    """
    conf = torch.as_tensor(confidences)
    device = conf.device
    a = survival(conf).cpu().numpy()
    rows, n = a.shape
    if max_lengths is not None:
        caps = torch.as_tensor(max_lengths).cpu().numpy()
        a = np.where(np.arange(n)[None, :] < caps[:, None], a, 0.0)
    r_idx, j_idx = np.nonzero(a > 0)
    lengths = np.zeros(rows, dtype=np.int64)
    if rows == 0 or r_idx.size == 0:
        return torch.as_tensor(lengths, device=device)
    values = a[r_idx, j_idx]
    # Descending survival; ties by slot so a row's prefix order always holds, then by row for determinism.
    order = np.lexsort((r_idx, j_idx, -values))
    r_sorted, gains = r_idx[order], values[order]
    num_tokens = rows + np.arange(1, len(order) + 1)  # B after admitting each item
    expected = rows + np.cumsum(gains)  # tau* after admitting each item
    theta = expected * np.asarray(sps(num_tokens), dtype=np.float64)
    base = rows * float(sps(rows))
    if early_stop:
        previous = np.concatenate([[base], theta[:-1]])
        worse = np.nonzero(~(theta > previous))[0]
        admitted = int(worse[0]) if worse.size else len(order)
    else:
        best = int(np.argmax(theta))
        admitted = best + 1 if theta[best] > base else 0
    np.add.at(lengths, r_sorted[:admitted], 1)
    return torch.as_tensor(lengths, device=device)


# -- profiling ----------------------------------------------------------------------------------------------


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{platform.machine() or 'unknown'}"


def model_identity(model: torch.nn.Module) -> str:
    """A filesystem-safe id: model type, name (last path parts) and parameter count."""
    config = model.config
    name = str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "model")
    name = "-".join(Path(name).parts[-2:]) if name else "model"
    params = sum(p.numel() for p in model.parameters())
    return _slug(f"{getattr(config, 'model_type', 'model')}-{name}-{params}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:180]


def sps_cache_path(model, batch_size: int, context_length: int, device=None) -> Path:
    from ..resources import cache_root

    param = next(model.parameters())
    device = param.device if device is None else torch.device(device)
    dtype = str(param.dtype).replace("torch.", "")
    key = _slug(f"{model_identity(model)}-{dtype}-{device_name(device)}-rows{batch_size}-ctx{context_length}")
    return cache_root() / "sps" / f"{key}.json"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def profile_sps(
    model,
    batch_size: int = 1,
    widths: Sequence[int] = tuple(range(1, 17)),
    context_length: int = 128,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> SPSTable:
    """Measure SPS(B) for B = batch_size x width: `repeats` timed target forwards of [batch_size, width] random
    tokens on top of a prefilled `context_length`-token cache (cropped back after every step)."""
    from transformers import DynamicCache

    if batch_size < 1 or context_length < 1 or not widths:
        raise ValueError("profile_sps needs batch_size >= 1, context_length >= 1 and at least one width")
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    context = torch.randint(0, vocab, (batch_size, context_length), generator=gen).to(device)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    key = cache_kwarg_name(model)
    model(input_ids=context, use_cache=True, **{key: cache})
    tokens, sps = [], []
    for width in sorted(set(int(w) for w in widths)):
        step = torch.randint(0, vocab, (batch_size, width), generator=gen).to(device)
        positions = torch.arange(context_length, context_length + width, device=device).expand(batch_size, -1)
        for i in range(warmup + repeats):
            if i == warmup:
                _synchronize(device)
                start = time.perf_counter()
            model(input_ids=step, position_ids=positions, use_cache=True, logits_to_keep=width, **{key: cache})
            cache.crop(-width)
        _synchronize(device)
        elapsed = time.perf_counter() - start
        tokens.append(batch_size * width)
        sps.append(repeats / elapsed)
    param = next(model.parameters())
    meta = {
        "model": model_identity(model),
        "dtype": str(param.dtype).replace("torch.", ""),
        "device": device_name(device),
        "rows": batch_size,
        "context_length": context_length,
        "repeats": repeats,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return SPSTable(tokens, sps, meta)


def load_or_profile_sps(
    model, batch_size: int = 1, context_length: int = 128, refresh: bool = False, **profile_kwargs
) -> SPSTable:
    """The cached SPS table for (model, dtype, device, rows, context length), profiled and cached when missing."""
    path = sps_cache_path(model, batch_size, context_length)
    if path.is_file() and not refresh:
        logger.info("SPS table for batch %d read from %s", batch_size, path)
        return SPSTable.load(path)
    logger.warning(
        "profiling the target's SPS table for batch %d (a few seconds, once); cached in %s "
        "(folder: $HF_DSPARK_CACHE, default ~/.cache/hf_dspark)", batch_size, path
    )
    table = profile_sps(model, batch_size=batch_size, context_length=context_length, **profile_kwargs)
    table.meta["path"] = str(path)
    table.save(path)
    return table


def cache_kwarg_name(model) -> str:
    """The forward() keyword that takes the KV cache: `cache` (transformers >= 5.23) or `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


__all__ = [
    "SCHEDULES",
    "SPSTable",
    "survival",
    "fixed_schedule",
    "threshold_schedule",
    "prefix_schedule",
    "profile_sps",
    "load_or_profile_sps",
    "sps_cache_path",
    "model_identity",
    "device_name",
    "cache_kwarg_name",
]
