"""Where the time of turning conversations into training rows goes: rendering, tokenizing, masking, loop trimming.

    python benchmarks/data_prep.py --tokenizer TARGET --data DATA/smollm2-135m-instruct.jsonl.gz \
        DATA/smollm2-135m-instruct-part2.jsonl.gz --packages this=src before=OLD/src --runs 3 --output data_prep.json

Each run is a fresh process with one package source first on PYTHONPATH (`--packages NAME=SRC`, alternating within
each round so drift on the machine falls on all of them). It loads the conversations, then times the steps of
`tokenize_conversations` one after another in one process: locating each answer in the rendered chat template
(`render`), the tokenizer's encoding with offsets (`tokenize`), the loss masks (`mask`) and the trimming of the
repetition loops of answers cut at a length limit (`loops`); then `tokenize_conversations` itself into an empty
`datasets` cache (`end_to_end`, with `--num_proc` processes). The tokenizer runs on one thread unless `--threads
all` (then a fast tokenizer spreads each batch over the cores). Prints a table and writes JSON with the command and
hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _bench_common import add_packages_arg, hardware, package_env, packages_of, write_report  # noqa: E402

PHASES = ("render", "tokenize", "mask", "loops", "end_to_end")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="target folder whose tokenizer renders (default: the package's)")
    p.add_argument("--data", nargs="+", required=True, help="conversations (JSONL(.gz) files)")
    add_packages_arg(p)
    p.add_argument("--runs", type=int, default=3, help="fresh processes per package")
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--max_loop_repeats", type=int, default=2)
    p.add_argument("--num_proc", type=int, default=1, help="processes for the end-to-end call")
    p.add_argument("--threads", choices=["one", "all"], default="one", help="the fast tokenizer's threads")
    p.add_argument("--output", default=None, help="JSON result file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one timed process (internal)
    return p.parse_args(argv)


def time_phases(args) -> dict:
    """The phases in this process, with whatever hf_dspark is first on the path."""
    from transformers import AutoTokenizer

    from hf_dspark.data import chat, load_conversations, tokenize_conversations
    from hf_dspark.resources import default_target_path

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_target_path())
    conversations = load_conversations(args.data)
    messages = conversations["messages"]
    finishes = conversations["finish"] if "finish" in conversations.column_names else [None] * len(messages)
    end_ids = chat.special_token_ids(tokenizer)
    seconds, clock = {}, time.perf_counter()

    def done(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase], clock = round(now - clock, 3), now

    rendered = [chat.assistant_char_spans(m, tokenizer) for m in messages]
    done("render")
    encoded = chat.token_offsets(tokenizer, [text for text, _ in rendered])
    done("tokenize")
    rows = [chat._mask_spans(ids, offsets, spans, end_ids, finish != "length")
            for (ids, offsets), (_, spans), finish in zip(encoded, rendered, finishes)]  # fmt: skip
    done("mask")
    for (ids, mask), finish in zip(rows, finishes):
        if finish == "length":
            chat.loop_trimmed_length(ids, mask, args.max_loop_repeats)
    done("loops")
    # Into the empty `datasets` cache the parent gave this process: nothing is read back from an earlier run.
    kept = len(tokenize_conversations(conversations, tokenizer, args.max_length, num_proc=args.num_proc,
                                      max_loop_repeats=args.max_loop_repeats))  # fmt: skip
    done("end_to_end")
    return {"conversations": len(messages), "rows": kept, "tokens": sum(len(ids) for ids, _ in rows), **seconds}


def timed_run(args, name: str, src: str) -> dict:
    env = package_env(src)
    env["TOKENIZERS_PARALLELISM"] = "true" if args.threads == "all" else "false"
    cmd = [sys.executable, __file__, "--child", *child_flags(args)]
    with tempfile.TemporaryDirectory() as cache:  # nothing tokenized by an earlier run
        env["HF_DATASETS_CACHE"] = cache
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run of {name} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    row = {"package": name, **json.loads(done.stdout.strip().splitlines()[-1])}
    print(f"{name:>10}  " + "  ".join(f"{phase} {row[phase]:6.2f} s" for phase in PHASES), flush=True)
    return row


def child_flags(args) -> list[str]:
    flags = ["--data", *args.data, "--max_length", str(args.max_length), "--max_loop_repeats",
             str(args.max_loop_repeats), "--num_proc", str(args.num_proc)]  # fmt: skip
    return flags + (["--tokenizer", args.tokenizer] if args.tokenizer else [])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(time_phases(args)))
        return {}
    packages = packages_of(args.packages)
    report = {
        "benchmark": "conversations to training rows: time by phase, fresh processes",
        "command": "python " + " ".join(sys.argv),
        "packages": packages,
        "threads": args.threads,
        "hardware": {**hardware("cpu"), "cpu_count": os.cpu_count()},
        "runs": [],
    }
    names = list(packages)
    for r in range(args.runs):
        for name in names if r % 2 == 0 else names[::-1]:
            report["runs"].append(timed_run(args, name, packages[name]))
            write_report(report, args.output)  # after every run: a run cut short keeps the rows before it
    report["summary"] = {
        name: {phase: statistics.median(row[phase] for row in report["runs"] if row["package"] == name)
               for phase in PHASES}  # fmt: skip
        for name in names
    }
    write_report(report, args.output)
    print("\n| package | " + " | ".join(PHASES) + " (median s) |")
    print("|---|" + "---|" * len(PHASES))
    for name, row in report["summary"].items():
        print(f"| {name} | " + " | ".join(f"{row[phase]:.2f}" for phase in PHASES) + " |")
    return report


if __name__ == "__main__":
    main()
