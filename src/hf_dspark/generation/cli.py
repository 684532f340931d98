"""`hf-dspark calibrate` (STS temperatures for a DSpark draft) and `hf-dspark profile-sps` (the cost table of the
hardware-aware prefix scheduler)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..cli_args import TARGET_DTYPES, add_command, field

TARGET_HELP = "target model folder (default: the embedded SmolLM2-135M-Instruct)"
DEVICE_HELP = "default: cuda when available, else cpu"


@dataclass
class CalibrateArguments:
    draft: str = field(help="draft folder (save_pretrained output)")
    prompts: str = field(help='JSONL(.gz) prompts, {"turns": [...]} rows (first turn)')
    output_dir: str | None = field(None, help="folder for the calibrated draft (weights + config + calibration.json)",
                                   aliases=["--output"])  # fmt: skip
    in_place: bool = field(False, help="update the draft folder's config.json instead of writing --output_dir")
    target: str | None = field(None, help=TARGET_HELP)
    target_dtype: str = field("auto", help="dtype of target and draft", choices=TARGET_DTYPES, aliases=["--dtype"])
    device: str | None = field(None, help=DEVICE_HELP)
    num_prompts: int = field(64, help="prompts used (the first N)")
    max_new_tokens: int = field(128, help="tokens per rollout")
    batch_size: int = field(8, help="prompts per generate() call")
    temperature: float = field(1.0, help="sampling temperature (0 = greedy)")
    holdout: float = field(0.3, help="share of rounds kept out of the fit for the report")
    seed: int = field(0, help="random seed")

    def __post_init__(self):
        if (self.output_dir is None) == (not self.in_place):
            raise ValueError("give exactly one of --output_dir FOLDER and --in_place")


@dataclass
class ProfileSpsArguments:
    target: str | None = field(None, help=TARGET_HELP)
    target_dtype: str = field("auto", help="dtype the target runs in", choices=TARGET_DTYPES, aliases=["--dtype"])
    device: str | None = field(None, help=DEVICE_HELP)
    batch_size: list[int] = field([1], help="rows per forward (one table each)")
    max_width: int = field(16, help="tokens per row: 1..max_width")
    context_length: int = field(128, help="prefilled context tokens")
    repeats: int = field(5, help="timed forwards per width")
    refresh: bool = field(False, help="re-profile even when a cached table exists")
    output: str | None = field(None, help="also write the tables to this JSON file")


def register(subparsers) -> None:
    add_command(
        subparsers, "calibrate", CalibrateArguments, run_calibrate,
        help="fit STS confidence temperatures of a DSpark draft on speculative rollouts",
        description="Roll out the target with the draft on prompts, fit per-slot temperatures (Sequential "
        "Temperature Scaling) and save the draft with them in its config.",
    )  # fmt: skip
    add_command(
        subparsers, "profile-sps", ProfileSpsArguments, run_profile_sps,
        help="profile the target's forward steps per second SPS(B) for the prefix scheduler",
        description="Measure SPS(B) = target forward steps per second at B = rows x width tokens on this device "
        "and cache the table under $HF_DSPARK_CACHE/sps/ (default ~/.cache/hf_dspark; generate() finds it there).",
    )  # fmt: skip


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def run_calibrate(args: CalibrateArguments) -> int:
    import torch
    from transformers import AutoModel

    from ..data.prompts import first_turns
    from ..resources import load_target
    from .calibration import calibrate_confidence

    device = _device(args.device)
    if not Path(args.draft).is_dir():
        raise FileNotFoundError(f"draft folder {args.draft} does not exist (a save_pretrained folder)")
    target, tokenizer = load_target(args.target, device, args.target_dtype)
    draft = AutoModel.from_pretrained(args.draft).to(device).eval()
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
    output = Path(args.draft) if args.in_place else Path(args.output_dir)
    if args.in_place:
        draft.config.save_pretrained(output)  # weights are unchanged: only config.json is rewritten
    else:
        draft.save_pretrained(output)
    (output / "calibration.json").write_text(json.dumps(report.to_dict(), indent=2))
    print(report)
    print(f"temperatures saved to {output / 'config.json'}")
    return 0


def run_profile_sps(args: ProfileSpsArguments) -> int:
    from ..resources import load_target
    from .scheduler import load_or_profile_sps

    target, _ = load_target(args.target, _device(args.device), args.target_dtype, with_tokenizer=False)
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
