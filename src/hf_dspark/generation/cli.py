"""`hf-dspark calibrate` (STS temperatures for a DSpark draft) and `hf-dspark profile-sps` (the cost table of the
hardware-aware prefix scheduler)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..data.prompts import first_turns
from ..resources import load_target


def register(subparsers) -> None:
    cal = subparsers.add_parser(
        "calibrate",
        help="fit STS confidence temperatures of a DSpark draft on speculative rollouts",
        description="Roll out the target with the draft on prompts, fit per-slot temperatures (Sequential "
        "Temperature Scaling) and save the draft with them in its config.",
    )
    cal.add_argument("--draft", required=True, help="draft folder (save_pretrained output)")
    cal.add_argument("--target", default=None, help="target folder (default: the embedded SmolLM2-135M-Instruct)")
    cal.add_argument("--prompts", required=True, help='JSONL(.gz) prompts, {"turns": [...]} rows (first turn)')
    cal.add_argument("--num-prompts", type=int, default=64)
    cal.add_argument("--max-new-tokens", type=int, default=128)
    cal.add_argument("--batch-size", type=int, default=8)
    cal.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    cal.add_argument("--holdout", type=float, default=0.3, help="share of rounds kept out of the fit for the report")
    cal.add_argument("--seed", type=int, default=0)
    _device_args(cal)
    out = cal.add_mutually_exclusive_group(required=True)
    out.add_argument("--output", help="folder for the calibrated draft (weights + config + calibration.json)")
    out.add_argument("--in-place", action="store_true", help="update the draft folder's config.json")
    cal.set_defaults(func=run_calibrate)

    prof = subparsers.add_parser(
        "profile-sps",
        help="profile the target's forward steps per second SPS(B) for the prefix scheduler",
        description="Measure SPS(B) = target forward steps per second at B = rows x width tokens on this device "
        "and cache the table under ~/.cache/hf_dspark/sps/ (generate() finds it there).",
    )
    prof.add_argument("--target", default=None, help="target folder (default: the embedded SmolLM2-135M-Instruct)")
    prof.add_argument("--batch-size", type=int, nargs="+", default=[1], help="rows per forward (one table each)")
    prof.add_argument("--max-width", type=int, default=16, help="tokens per row: 1..max-width")
    prof.add_argument("--context-length", type=int, default=128)
    prof.add_argument("--repeats", type=int, default=5)
    prof.add_argument("--refresh", action="store_true", help="re-profile even when a cached table exists")
    prof.add_argument("--output", help="also write the tables to this JSON file")
    _device_args(prof)
    prof.set_defaults(func=run_profile_sps)


def _device_args(parser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])






def run_calibrate(args: argparse.Namespace) -> int:
    from transformers import AutoModel

    from .calibration import calibrate_confidence

    target, tokenizer = load_target(args.target, args.device, args.dtype)
    draft = AutoModel.from_pretrained(args.draft).to(args.device).eval()
    prompts = first_turns(args.prompts, args.num_prompts)
    torch.manual_seed(args.seed)
    sample = args.temperature > 0
    report = calibrate_confidence(
        draft,
        target,
        tokenizer,
        prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        holdout_fraction=args.holdout,
        seed=args.seed,
        do_sample=sample,
        temperature=args.temperature if sample else 1.0,
    )
    output = Path(args.draft) if args.in_place else Path(args.output)
    if args.in_place:
        draft.config.save_pretrained(output)  # weights are unchanged: only config.json is rewritten
    else:
        draft.save_pretrained(output)
    (output / "calibration.json").write_text(json.dumps(report.to_dict(), indent=2))
    print(report)
    print(f"temperatures saved to {output / 'config.json'}")
    return 0


def run_profile_sps(args: argparse.Namespace) -> int:
    from .scheduler import load_or_profile_sps

    target, _ = load_target(args.target, args.device, args.dtype, with_tokenizer=False)
    tables = {}
    for rows in args.batch_size:
        table = load_or_profile_sps(
            target,
            batch_size=rows,
            context_length=args.context_length,
            refresh=args.refresh,
            widths=range(1, args.max_width + 1),
            repeats=args.repeats,
        )
        tables[rows] = table
        print(f"rows={rows} ({table.meta.get('device', '?')}, {table.meta.get('dtype', '?')})")
        print("  tokens  steps/s   tokens/s")
        for tokens, sps in zip(table.tokens, table.sps):
            print(f"  {tokens:>6}  {sps:>8.1f}  {tokens * sps:>9.0f}")
    if args.output:
        Path(args.output).write_text(json.dumps({str(r): t.to_dict() for r, t in tables.items()}, indent=2))
    return 0


__all__ = ["register"]
