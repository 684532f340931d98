"""`hf-dspark regenerate` and `hf-dspark build-cache`: thin wrappers over the data API."""

from __future__ import annotations

import argparse

TORCH_DTYPES = ("auto", "bfloat16", "float16", "float32")


def register(subparsers) -> None:
    regen = subparsers.add_parser(
        "regenerate",
        help="answer prompts with the target model (training data in the target's own distribution)",
        description="Answer {'turns': [...]} prompts with the target and append conversations to a JSONL file; "
        "re-running resumes.",
    )
    _target_args(regen)
    regen.add_argument("--prompts", required=True, help="JSONL(.gz) file of {'turns': [str, ...]} rows")
    regen.add_argument("--output", required=True, help="JSONL file the conversations are appended to")
    regen.add_argument("--batch-size", type=int, default=32)
    regen.add_argument("--max-new-tokens", type=int, default=768)
    regen.add_argument("--temperature", type=float, default=0.7, help="0 decodes greedily")
    regen.add_argument("--top-p", type=float, default=0.8)
    regen.add_argument("--top-k", type=int, default=20)
    regen.add_argument("--seed", type=int, default=0)
    regen.add_argument("--all-turns", action="store_true", help="answer every turn, not only the first")
    regen.set_defaults(func=run_regenerate)

    cache = subparsers.add_parser(
        "build-cache",
        help="run the target over conversations and store its features as a sharded Arrow cache",
        description="Tokenize conversations with the target's chat template and cache the target's context "
        "features and final hidden states. Resumable; under `accelerate launch` processes build disjoint shards.",
    )
    _target_args(cache)
    cache.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="conversations: JSON/JSONL(.gz) files (several, or a quoted glob such as 'data/*.jsonl.gz'), a "
        "save_to_disk folder or a Hub name",
    )
    cache.add_argument("--split", default="train")
    cache.add_argument("--output-dir", required=True)
    cache.add_argument("--max-length", type=int, default=2048)
    cache.add_argument("--min-loss-tokens", type=int, default=14)
    cache.add_argument(
        "--target-layer-ids",
        type=_int_list,
        default=None,
        help="comma-separated target layers (-1 = embeddings); default: 5 evenly spaced non-final layers",
    )
    cache.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8"), help="storage dtype of features")
    cache.add_argument("--batch-size", type=int, default=8)
    cache.add_argument("--shard-size", type=int, default=1000, help="rows per shard")
    cache.add_argument("--num-proc", type=int, default=None, help="processes for tokenization")
    cache.add_argument("--verify", default="fast", choices=("fast", "full"), help="check of finished shards on resume")
    cache.set_defaults(func=run_build_cache)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,9,17, got {text!r}") from None


def _target_args(parser) -> None:
    parser.add_argument("--target", default=None, help="target model folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--torch-dtype", default="auto", choices=TORCH_DTYPES, help="dtype the target runs in")
    parser.add_argument("--device", default=None, help="default: this process's accelerator (or cpu)")


def _load_target(args):
    from ..resources import load_target
    from .cache import distributed_state

    return load_target(args.target, device=args.device or distributed_state().device, dtype=args.torch_dtype)

def run_regenerate(args) -> int:
    from .regenerate import regenerate_responses

    target, tokenizer = _load_target(args)
    out = regenerate_responses(
        target,
        tokenizer,
        args.prompts,
        args.output,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        all_turns=args.all_turns,
    )
    print(f"conversations written to {out}")
    return 0


def run_build_cache(args) -> int:
    from ..target import TargetSpec, default_target_layer_ids
    from .cache import build_target_cache, distributed_state
    from .chat import load_conversations, tokenize_conversations

    target, tokenizer = _load_target(args)
    layer_ids = args.target_layer_ids
    if layer_ids is None:
        layer_ids = default_target_layer_ids(TargetSpec.from_model(target).num_hidden_layers)
    state = distributed_state()
    # Tokenize on the main process first so the others reuse its `datasets` cache files.
    with state.main_process_first():
        conversations = load_conversations(args.data, split=args.split)
        rows = tokenize_conversations(
            conversations, tokenizer, args.max_length, min_loss_tokens=args.min_loss_tokens, num_proc=args.num_proc
        )
    build_target_cache(
        target,
        rows,
        args.output_dir,
        target_layer_ids=layer_ids,
        tokenizer=tokenizer,
        max_length=args.max_length,
        min_loss_tokens=args.min_loss_tokens,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        dtype=args.dtype,
        verify=args.verify,
    )
    return 0
