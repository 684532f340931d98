"""`hf-dspark eval`: compare drafts on prompt files (tau, acceptance by position, calibration, speed).

    hf-dspark eval --draft runs/dspark --draft runs/dflash --data gsm8k.jsonl --data mt-bench.jsonl \
        --num_prompts 80 --max_new_tokens 256 --temperature 0 1 --output_dir eval_out

writes eval_out/results.json, results.md, reliability.json and PNG plots (see `evaluate_drafts`).
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cli_args import TARGET_DTYPES, add_command, field


@dataclass
class EvalArguments:
    draft: list[str] = field(
        help="draft folder (save_pretrained) as [NAME=]PATH; repeat to compare drafts side by side. Named by the "
        "config's model_type, or the folder name when two share one, unless NAME= is given",
        action="extend", metavar="[NAME=]PATH",
    )  # fmt: skip
    data: list[str] = field(
        help='{"turns": [...]} JSONL prompt file as [NAME=]FILE; repeat for several datasets (named by file stem)',
        action="extend", metavar="[NAME=]FILE",
    )  # fmt: skip
    output_dir: str = field(help="folder for results.json, results.md and plots")
    target: str | None = field(None, help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    target_dtype: str = field("auto", help="weights dtype of target and drafts (auto: bfloat16 on CUDA, float32 "
                              "on CPU)", choices=TARGET_DTYPES, aliases=["--dtype"])  # fmt: skip
    device: str | None = field(None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    num_prompts: int = field(80, help="use the first N prompts of every file (0: all)")
    max_new_tokens: int = field(256, help="new tokens per prompt")
    temperature: list[float] = field([0.0], help="sampling temperature(s); 0 = greedy. Several values give rows "
                                     "for each")  # fmt: skip
    top_k: int = field(0, help="top-k filtering when sampling (0: off)")
    top_p: float = field(1.0, help="nucleus filtering when sampling (1.0: off)")
    batch_size: int = field(1, help="prompts per generate() call (left padded), for the target alone and the drafts")
    seed: int = field(0, help="generate() call i is seeded with seed + i")
    generate_kwargs: str | None = field(None, help="extra generate() arguments for the draft runs only, as a JSON "
                                        "object (e.g. confidence-scheduler options)", metavar="JSON")  # fmt: skip
    draft_kwargs: list[str] | None = field(None, help="generate() arguments for one draft as NAME=JSON, over "
                                           "--generate_kwargs; repeat per draft. The same draft folder under two "
                                           "names decodes side by side with other options (same prompts, seeds and "
                                           "baselines in one process), e.g. --draft k1=runs/d --draft k2=runs/d "
                                           "--draft_kwargs 'k2={\"dspark_candidates\": 2}'",
                                           action="extend", metavar="NAME=JSON")  # fmt: skip
    n_bins: int = field(15, help="bins of the expected calibration error")
    static_baseline: str = field("auto", help="also time the target alone with a static cache (compiled by "
                                 "generate() on CUDA), the fastest target-alone baseline; rows gain "
                                 "speedup_vs_static_target. auto: on CUDA; a bare --static_baseline means true",
                                 nargs="?", const="true", choices=["auto", "true", "false"])  # fmt: skip
    eager_baseline: str = field("true", help="time the target alone on its eager path too (false: the static "
                                "baseline only, the slowest part of an evaluation skipped; rows then have no "
                                "eager speedup)", choices=["true", "false"])  # fmt: skip
    no_warmup: bool = field(False, help="skip the untimed warm-up generate() calls")
    no_plots: bool = field(False, help="write JSON and markdown only")
    no_teacher_forced: bool = field(False, help="skip each draft's teacher-forced τ on the target's own answers")
    no_progress: bool = field(False, help="no progress bars")

    def __post_init__(self):
        if self.generate_kwargs is not None and not isinstance(self.generate_kwargs, dict):
            try:
                self.generate_kwargs = json.loads(self.generate_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(f"--generate_kwargs is not valid JSON: {err}") from None
            if not isinstance(self.generate_kwargs, dict):
                raise ValueError("--generate_kwargs must be a JSON object, e.g. '{\"num_assistant_tokens\": 5}'")
        self.draft_generate_kwargs = {}
        for spec in self.draft_kwargs or []:
            name, sep, text = spec.partition("=")
            try:
                value = json.loads(text) if sep and name else None
            except json.JSONDecodeError as err:
                raise ValueError(f"--draft_kwargs {spec!r}: the part after NAME= is not valid JSON: {err}") from None
            if not isinstance(value, dict):
                raise ValueError(f"--draft_kwargs {spec!r} is not NAME=JSON with a JSON object, e.g. "
                                 "'k2={\"dspark_candidates\": 2}'")  # fmt: skip
            self.draft_generate_kwargs[name] = value


def register(subparsers) -> None:
    add_command(
        subparsers, "eval", EvalArguments, run_eval,
        help="evaluate drafts: tau, acceptance by position, calibration, tokens/s vs. the target alone",
        description=(
            "Speculative decoding of each draft over each {\"turns\": [...]} JSONL prompt file (first turn, target "
            "chat template, the first --num_prompts rows): tau, conditional acceptance by position, verify "
            "efficiency, per-slot confidence calibration (ECE/AUROC/Brier, before/after STS) and wall-clock "
            "tokens/s against target.generate() alone. Writes results.json, results.md and PNG plots."
        ),
    )  # fmt: skip


def _command_line(args: EvalArguments) -> str:
    """The command as typed when run from a shell; otherwise the equivalent command rebuilt from `args`."""
    if sys.argv[1:2] == ["eval"]:
        return shlex.join(["hf-dspark", *sys.argv[1:]])
    parts = ["hf-dspark", "eval"]
    if args.target:
        parts += ["--target", args.target]
    for d in args.draft:
        parts += ["--draft", d]
    for d in args.data:
        parts += ["--data", d]
    parts += ["--num_prompts", str(args.num_prompts), "--max_new_tokens", str(args.max_new_tokens),
              "--temperature", *[f"{t:g}" for t in args.temperature]]
    if args.top_k:
        parts += ["--top_k", str(args.top_k)]
    if args.top_p < 1:
        parts += ["--top_p", f"{args.top_p:g}"]
    parts += ["--batch_size", str(args.batch_size), "--seed", str(args.seed)]
    if args.device:
        parts += ["--device", args.device]
    parts += ["--target_dtype", args.target_dtype, "--output_dir", args.output_dir]
    if args.generate_kwargs:
        parts += ["--generate_kwargs", json.dumps(args.generate_kwargs)]
    for name, kwargs in args.draft_generate_kwargs.items():
        parts += ["--draft_kwargs", f"{name}={json.dumps(kwargs)}"]
    if args.static_baseline != "auto":
        parts += ["--static_baseline", args.static_baseline]
    if args.eager_baseline != "true":
        parts += ["--eager_baseline", args.eager_baseline]
    flags = (("--no_warmup", args.no_warmup), ("--no_plots", args.no_plots),
             ("--no_teacher_forced", args.no_teacher_forced))  # fmt: skip
    parts += [flag for flag, on in flags if on]
    return shlex.join(parts)


def _named_files(specs: list[str]) -> dict[str, str]:
    from .runner import dataset_name

    files = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or Path(spec).exists():
            name, path = dataset_name(spec), spec
        if not Path(path).is_file():
            raise FileNotFoundError(f"prompt file {path} does not exist (expected a {{\"turns\": [...]}} JSONL file)")
        if name in files:
            raise ValueError(f"two prompt files are both named {name!r}: name them explicitly with NAME=FILE")
        files[name] = path
    return files


def run_eval(args: EvalArguments) -> int:
    import torch

    from .runner import evaluate_drafts, load_drafts, load_target

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    datasets = _named_files(args.data)
    device = args.device if args.device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    target_path, target_name = args.target, args.target
    if target_path is None:
        from ..resources import DEFAULT_TARGET_NAME, default_target_path

        target_path, target_name = str(default_target_path()), DEFAULT_TARGET_NAME
    target, tokenizer = load_target(target_path, device=device, dtype=args.target_dtype)
    drafts = load_drafts(args.draft, target)
    results = evaluate_drafts(
        target,
        tokenizer,
        drafts,
        datasets,
        num_prompts=args.num_prompts or None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        batch_size=args.batch_size,
        seed=args.seed,
        output_dir=args.output_dir,
        generate_kwargs=args.generate_kwargs,
        draft_generate_kwargs=args.draft_generate_kwargs,
        warmup=not args.no_warmup,
        progress=not args.no_progress,
        n_bins=args.n_bins,
        plots=not args.no_plots,
        command=_command_line(args),
        target_name=target_name,
        # The honest baseline by default where it exists: transformers compiles static-cache decoding on CUDA only.
        static_baseline={"true": True, "false": False}.get(args.static_baseline, device.startswith("cuda")),
        teacher_forced=not args.no_teacher_forced,
        eager_baseline=args.eager_baseline == "true",
    )
    from .report import results_markdown

    print(results_markdown(results))
    print(f"wrote {Path(args.output_dir) / 'results.json'}")
    return 0


__all__ = ["register", "run_eval"]
