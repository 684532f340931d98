"""Rebuild demo_prompts_more.jsonl.gz: prompts a CUDA demo run has the target answer before training.

    python examples/data/build_demo_prompts.py --source ../shared/data/train_prompts.jsonl

Only sources whose licence permits redistribution with attribution are kept (see README.md beside this file);
first turns of at most 1,000 characters, a seeded sample in a fixed domain mix, none equal to a demo prompt.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
# source -> licence, as listed in the prompt collection's source table.
PERMISSIVE = {
    "gsm8k_train": "MIT",
    "math_train": "MIT",
    "leetcode_train": "MIT",
    "exercism": "MIT",
    "gpteacher_roleplay": "MIT",
    "gpteacher_toolformer": "MIT",
    "hh_rlhf_harmless_test": "MIT",
    "instructlab_taxonomy": "Apache-2.0",
    "selfinstruct_seed": "Apache-2.0",
    "awesome_chatgpt_prompts": "CC0-1.0",
}
MIX = {"math": 0.35, "code": 0.30, "chat": 0.28, "instruction": 0.07}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="train_prompts.jsonl ({id, source, domain, turns})")
    p.add_argument("--count", type=int, default=4096)
    p.add_argument("--max_chars", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(HERE / "demo_prompts_more.jsonl.gz"))
    args = p.parse_args()

    demo = {json.loads(line)["turns"][0] for line in (HERE.parent / "demo_prompts.jsonl").read_text().splitlines()}
    by_domain: dict[str, list[dict]] = {}
    with open(args.source, encoding="utf-8") as f:  # not splitlines(): prompts may hold U+2028 and the like
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        first = row["turns"][0]
        if row["source"] in PERMISSIVE and len(first) <= args.max_chars and first not in demo:
            by_domain.setdefault(row["domain"], []).append(
                {"id": row["id"], "source": row["source"], "licence": PERMISSIVE[row["source"]], "turns": [first]}
            )
    rng = random.Random(args.seed)
    chosen = []
    for domain, share in MIX.items():
        pool = by_domain.get(domain, [])
        chosen += rng.sample(pool, min(len(pool), round(share * args.count)))
    if len(chosen) < args.count:  # a scarce domain: fill up from the rest
        ids = {r["id"] for r in chosen}
        rest = [r for pool in by_domain.values() for r in pool if r["id"] not in ids]
        chosen += rng.sample(rest, min(len(rest), args.count - len(chosen)))
    rng.shuffle(chosen)
    chosen = chosen[: args.count]
    with gzip.GzipFile(args.output, "wb", mtime=0) as raw:
        raw.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen).encode())
    print(f"{len(chosen)} prompts -> {args.output}")


if __name__ == "__main__":
    main()
