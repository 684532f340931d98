"""`hf-dspark regenerate` and `hf-dspark build-cache`: thin wrappers over the data API."""

from __future__ import annotations

from dataclasses import dataclass

from ..cli_args import TARGET_DTYPES, add_command, field

TARGET_HELP = "target model folder (default: the embedded SmolLM2-135M-Instruct)"


@dataclass
class RegenerateArguments:
    prompts: str = field(help="JSONL(.gz) file of {'turns': [str, ...]} rows")
    output: str = field(help="JSONL file the conversations are appended to (re-running resumes)")
    target: str | None = field(None, help=TARGET_HELP)
    target_dtype: str = field("auto", help="dtype the target runs in", choices=TARGET_DTYPES,
                              aliases=["--torch-dtype", "--torch_dtype"])  # fmt: skip
    device: str | None = field(None, help="default: this process's accelerator (or cpu)")
    batch_size: int = field(32, help="prompts per generate() call")
    max_new_tokens: int = field(768, help="answer length limit")
    temperature: float = field(1.0, help="0 decodes greedily (default: the target's own distribution, the data "
                               "that trained the best drafts for sampled decoding)")
    top_p: float = field(1.0, help="nucleus sampling (1: off)")
    top_k: int = field(0, help="top-k sampling (0: off)")
    seed: int = field(0, help="sampling seed")
    all_turns: bool = field(False, help="answer every turn, not only the first")
    static_cache: str = field("auto", help="decode on a static cache with generate()'s compiled step ('auto': on "
                              "CUDA for first turns)", choices=("auto", "true", "false"))  # fmt: skip
    grouped_attention: bool = field(True, help="attend without copying keys/values per query head (sdpa targets "
                                    "with grouped KV heads; same results)")  # fmt: skip
    engine: str = field("generate", help="generate: fixed batches through generate(); continuous: transformers' "
                        "continuous batching (finished rows refilled at once; first turns)",
                        choices=("generate", "continuous"))  # fmt: skip
    rows: str | None = field(None, help="answer only these rows of the prompt file, START:END counted from 0 "
                             "before any filter (e.g. 19456:27861)")  # fmt: skip
    max_prompt_chars: int | None = field(None, help="skip prompts with a turn longer than this many characters "
                                         "(long prompts lengthen every row's cache in a batch)")  # fmt: skip


@dataclass
class BuildCacheArguments:
    data: list[str] = field(
        help="conversations: JSON/JSONL(.gz) files (several, or a quoted glob such as 'data/*.jsonl.gz'), a "
        "save_to_disk folder or a Hub dataset name"
    )
    output_dir: str = field(help="cache folder (resumed when it exists)")
    target: str | None = field(None, help=TARGET_HELP)
    target_dtype: str = field("auto", help="dtype the target runs in", choices=TARGET_DTYPES,
                              aliases=["--torch-dtype", "--torch_dtype"])  # fmt: skip
    device: str | None = field(None, help="default: this process's accelerator (or cpu)")
    split: str = field("train", help="dataset split")
    max_length: int = field(2048, help="tokens per conversation (longer ones are cut)")
    min_loss_tokens: int = field(14, help="conversations with fewer supervised tokens are dropped")
    max_loop_repeats: int = field(
        2, help="answers cut at the length limit that end in a repetition loop keep at most this many repeats (0: whole "
        "loops; 2 is the training recipe's)"
    )
    target_layer_ids: str | None = field(
        None, help="comma-separated target layers (-1 = embeddings); default: 5 evenly spaced non-final layers"
    )
    cache_dtype: str = field("bf16", help="storage dtype of the features", choices=("bf16", "fp16", "fp8"),
                             aliases=["--dtype"])  # fmt: skip
    batch_size: int = field(8, help="rows per target forward")
    shard_size: int = field(1000, help="rows per shard")
    num_proc: int | None = field(
        None, help="processes for tokenization (default: one per 2,048 conversations, at most 16 and one per CPU core)"
    )
    verify: str = field("fast", help="check of finished shards on resume", choices=("fast", "full"))


def register(subparsers) -> None:
    add_command(
        subparsers, "regenerate", RegenerateArguments, run_regenerate,
        help="answer prompts with the target model (training data in the target's own distribution)",
        description="Answer {'turns': [...]} prompts with the target and append conversations to a JSONL file; "
        "re-running resumes.",
    )  # fmt: skip
    add_command(
        subparsers, "build-cache", BuildCacheArguments, run_build_cache,
        help="run the target over conversations and store its features as a sharded Arrow cache",
        description="Tokenize conversations with the target's chat template and cache the target's context "
        "features and final hidden states. Resumable; under `accelerate launch` processes build disjoint shards.",
    )  # fmt: skip


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as 1,9,17, got {text!r}") from None


def _load_target(args):
    from ..resources import load_target
    from .cache import distributed_state

    return load_target(args.target, device=args.device or distributed_state().device, dtype=args.target_dtype)

def run_regenerate(args) -> int:
    from .prompts import parse_rows
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
        static_cache={"auto": None, "true": True, "false": False}[args.static_cache],
        grouped_attention=args.grouped_attention,
        engine=args.engine,
        rows=parse_rows(args.rows) if args.rows else None,
        max_prompt_chars=args.max_prompt_chars,
    )
    print(f"conversations written to {out}")
    return 0


def run_build_cache(args) -> int:
    from ..target import TargetSpec, default_target_layer_ids
    from .cache import build_target_cache, distributed_state
    from .chat import load_conversations, tokenize_conversations

    target, tokenizer = _load_target(args)
    layer_ids = _int_list(args.target_layer_ids) if args.target_layer_ids else None
    if layer_ids is None:
        layer_ids = default_target_layer_ids(TargetSpec.from_model(target).num_hidden_layers)
    state = distributed_state()
    # Tokenize on the main process first so the others reuse its `datasets` cache files.
    with state.main_process_first():
        conversations = load_conversations(args.data, split=args.split)
        rows = tokenize_conversations(
            conversations, tokenizer, args.max_length, min_loss_tokens=args.min_loss_tokens, num_proc=args.num_proc,
            max_loop_repeats=args.max_loop_repeats,
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
        dtype=args.cache_dtype,
        verify=args.verify,
    )
    return 0
