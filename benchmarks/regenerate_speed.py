"""Speed of `hf-dspark regenerate`: grouped attention, plain sdpa and continuous batching on the same prompts.

    python benchmarks/regenerate_speed.py --target TARGET --prompts prompts.jsonl --num-prompts 1024 \\
        --batch-size 512 --max-new-tokens 256 --json regenerate_speed.json

Runs `regenerate_responses` on the same prompts once per mode (`--modes grouped plain continuous`: fixed batches
through generate() with hf_dspark's grouped-query SDPA, the same with transformers' "sdpa" and its repeated
keys/values, and transformers' continuous batching with `--batch-size` prompts submitted at a time), each after an
untimed warm-up batch that compiles what it needs, and prints prompts/s, answer tokens/s and, for fixed batches,
milliseconds per decoding step (a batch runs until its longest answer ends, so steps = the longest answer of each
batch). Writes JSON with the command and hardware. `--smoke` runs a tiny random target on CPU (checks the script,
not the speed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _bench_common import hardware  # noqa: E402

# mode -> regenerate_responses options
MODES = {
    "grouped": {"grouped_attention": True},
    "plain": {"grouped_attention": False},
    "continuous": {"engine": "continuous"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target model folder (default: the embedded SmolLM2)")
    p.add_argument("--prompts", default=None, help='{"turns": [...]} JSONL(.gz); the first turns are answered')
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy (top-p 0.8 / top-k 20 when sampling)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny random target on CPU")
    return p.parse_args(argv)


def load(args):
    if args.smoke:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        from hf_dspark.resources import default_target_path

        tokenizer = AutoTokenizer.from_pretrained(default_target_path())
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval(), tokenizer
    from hf_dspark.resources import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_target(args.target, dtype=args.dtype, device=device)


def prompts_of(args) -> list[dict]:
    if args.smoke:
        return [{"id": str(i), "turns": [f"Count to {i}."]} for i in range(args.num_prompts)]
    from hf_dspark.data.prompts import read_prompts

    rows = read_prompts(args.prompts)[: args.num_prompts]
    return [{"id": p.id, "turns": p.turns[:1]} for p in rows]


def timed_run(target, tokenizer, prompts, args, mode: str, folder: Path) -> dict:
    from hf_dspark.data import regenerate_responses

    settings = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    progress=False, **MODES[mode])  # fmt: skip
    warm = [dict(p, id=f"warm-{p['id']}") for p in prompts[: args.batch_size]]  # compiles this batch shape
    regenerate_responses(target, tokenizer, warm, folder / "warm.jsonl", **settings)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = regenerate_responses(target, tokenizer, prompts, folder / "answers.jsonl", **settings)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = [r["completion_tokens"] for r in rows]
    steps = sum(max(lengths[i : i + args.batch_size]) for i in range(0, len(lengths), args.batch_size))
    if mode == "continuous":
        steps = None  # no fixed batches: the engine refills finished rows
    return {
        "prompts": len(rows),
        "seconds": seconds,
        "prompts_per_s": len(rows) / seconds,
        "answer_tokens_per_s": sum(lengths) / seconds,
        "decoding_steps": steps,
        "ms_per_step": 1000 * seconds / steps if steps else None,
        "cut_at_limit": sum(r["finish"] == "length" for r in rows),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.num_prompts, args.batch_size, args.max_new_tokens, args.dtype = 6, 3, 8, "float32"
    elif not args.prompts:
        raise SystemExit("--prompts is required (a {'turns': [...]} JSONL file)")
    target, tokenizer = load(args)
    prompts = prompts_of(args)
    results = {}
    for name in args.modes:
        with tempfile.TemporaryDirectory() as folder:
            results[name] = timed_run(target, tokenizer, prompts, args, name, Path(folder))
        print(f"{name}: {results[name]}", flush=True)
    device = next(target.parameters()).device
    report = {
        "benchmark": "regenerate_speed",
        "command": "python " + " ".join(sys.argv),
        "hardware": hardware(device),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "results": results,
    }
    print("| mode | prompts/s | answer tokens/s | ms a step | steps |\n|---|---|---|---|---|")
    for name, r in results.items():
        step = f"{r['ms_per_step']:.2f}" if r["ms_per_step"] else "-"
        print(f"| {name} | {r['prompts_per_s']:.1f} | {r['answer_tokens_per_s']:.0f} | {step} | "
              f"{r['decoding_steps'] or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
