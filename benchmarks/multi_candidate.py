"""What several drafts for a round's first slot would add to τ, from teacher-forced blocks of a trained draft.

A round verifies one chain of drafts today; at T = 1 each slot is accepted with chance 1 - TV(target, draft), which
stays near one half for a small, high-entropy target. Drafting k candidates for the first slot, each continued by
its own chain, and verifying them as a tree (recursive rejection sampling at the first slot, lossless;
`generate(..., dspark_candidates=k)`) raises the chance that the round gets past its first slot. This script
measures what that gives on real text from the distributions alone, without decoding.

The target answers the evaluation prompts alone (at --temperature, as `hf-dspark eval` decodes them; greedy at 0),
then every answer position anchors a teacher-forced block of the draft (DSpark or DFlash). Per block and slot it
computes from the two distributions: k = 1..C candidates' first-slot acceptance (`metrics.multi_candidate_acceptance`,
for candidates drawn independently and, rows marked "distinct", without replacement as generate() draws them;
greedily, the target's argmax among the draft's top k: `metrics.top_candidates_match`) and each later slot's own
acceptance, and from them τ of a round with k candidates (`metrics.branched_tau`; k = 1 is the training estimate
τ_prob). All-anchor means: decoding's τ is lower (rounds start more often where the draft fails), so read the ratio
to k = 1, and compare k = 1 with the same draft's decoded τ. A round with k chains of n drafts verifies 1 + k n
tokens instead of 1 + n.

    python benchmarks/multi_candidate.py --target TARGET --draft DRAFT --data gsm8k.jsonl humaneval.jsonl \
        mt-bench.jsonl --num_prompts 32 --temperature 0 1 --json multi_candidate.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import hardware, write_report  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", required=True, help="a DSpark or DFlash draft folder (save_pretrained)")
    p.add_argument("--data", nargs="+", required=True, help='prompt files ({"turns": [...]} JSONL), one set each')
    p.add_argument("--num_prompts", type=int, default=32, help="first prompts of each file (default 32)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy (default: 0 1)")
    p.add_argument("--candidates", type=int, default=4, help="largest number of first-slot candidates (default 4)")
    p.add_argument("--distinct_samples", type=int, default=32,
                   help="at T > 0 also the chances for candidates drawn without replacement (as generate() draws "
                   "them), averaged over this many draws per position (0: skip)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--anchor_chunk", type=int, default=64, help="anchors whose distributions are held at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target_dtype", default="auto")
    p.add_argument("--json", default=None, help="write the table and the command here")
    return p.parse_args(argv)


@torch.no_grad()
def target_answers(target, tokenizer, prompts, temperature, max_new_tokens, batch_size, seed):
    """(prompt ids, answer ids) of the target alone: sampled at `temperature` (greedy at 0), cut after EOS."""
    from hf_dspark.data.prompts import eos_token_ids, left_pad, new_token_lengths

    eos = eos_token_ids(target, tokenizer)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False, "temperature": None, "top_k": None, "top_p": None}  # fmt: skip
    device = next(target.parameters()).device
    pairs = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        input_ids, attention_mask = left_pad(batch, tokenizer.pad_token_id, device)
        torch.manual_seed(seed + start)
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, **sampling)  # fmt: skip
        new = out[:, input_ids.shape[1] :]
        for prompt, row, n in zip(batch, new, new_token_lengths(new, eos).tolist()):
            if n >= 2:  # a block needs an anchor and a label inside the answer
                pairs.append((list(prompt), row[:n].tolist()))
    return pairs


@torch.no_grad()
def score_blocks(draft, target, pairs, temperature, candidates, batch_size, anchor_chunk, pad_id,
                 distinct_samples=0, seed=0) -> dict:
    """Sums over every answer position's block: first-slot acceptance by k, τ by k, blocks, per-slot acceptance;
    at T > 0 with `distinct_samples`, also first-slot acceptance and τ by k for candidates drawn without
    replacement ("first_distinct", "tau_distinct")."""
    from hf_dspark.metrics import branched_tau, multi_candidate_acceptance, top_candidates_match
    from hf_dspark.models.anchors import covering_anchor_passes
    from hf_dspark.target import target_features

    device = next(draft.parameters()).device
    sums = {"first": torch.zeros(candidates), "tau": torch.zeros(candidates), "blocks": 0.0}
    distinct = temperature > 0 and distinct_samples > 0
    if distinct:
        sums.update(first_distinct=torch.zeros(candidates), tau_distinct=torch.zeros(candidates))
        generator = torch.Generator(device=device).manual_seed(seed)
    for start in range(0, len(pairs), batch_size):
        rows = [p + a for p, a in pairs[start : start + batch_size]]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
        loss_mask = torch.zeros_like(ids)
        for i, ((prompt, answer), row) in enumerate(zip(pairs[start : start + batch_size], rows)):
            ids[i, : len(row)] = torch.tensor(row, device=device)
            loss_mask[i, len(prompt) : len(row)] = 1
        lengths = torch.tensor([len(r) for r in rows], device=device)
        attention = torch.arange(width, device=device)[None] < lengths[:, None]
        context, last = target_features(target, ids, draft.config.target_layer_ids, attention.long())
        for positions, valid in covering_anchor_passes(loss_mask, draft.config.num_anchors):
            out = draft(input_ids=ids, context_features=context, loss_mask=loss_mask, attention_mask=attention.long(),
                        anchor_positions=positions, anchor_mask=valid)  # fmt: skip
            K = out.hidden_states.shape[2]
            slot_pos = (positions[:, :, None] + torch.arange(K, device=device)).clamp(max=width - 1)
            for n0 in range(0, positions.shape[1], anchor_chunk):
                part = slice(n0, n0 + anchor_chunk)
                pos = slot_pos[:, part]
                hidden = last.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last.shape[-1]))
                p_logits = draft.target_logits(hidden).float().view(*pos.shape, -1)
                markov = None if out.markov_features is None else out.markov_features[:, part]
                q_logits = draft.draft_logits(out.hidden_states[:, part], markov).float()
                mask = out.eval_mask[:, part]
                if temperature > 0:
                    p = torch.softmax(p_logits / temperature, dim=-1)
                    q = torch.softmax(q_logits / temperature, dim=-1)
                    accept = torch.minimum(p, q).sum(-1)
                    first = multi_candidate_acceptance(p[..., 0, :], q[..., 0, :], candidates)
                else:
                    accept = (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
                    first = top_candidates_match(p_logits[..., 0, :], q_logits[..., 0, :], candidates)
                blocks = mask[..., 0].float().sum().item()
                valid_first = mask[..., 0].float()[..., None]
                sums["first"] += (first * valid_first).reshape(-1, candidates).sum(0).cpu()
                sums["tau"] += branched_tau(first, accept, mask).cpu() * blocks
                if distinct:
                    first = multi_candidate_acceptance(p[..., 0, :], q[..., 0, :], candidates, replacement=False,
                                                       samples=distinct_samples, generator=generator)  # fmt: skip
                    sums["first_distinct"] += (first * valid_first).reshape(-1, candidates).sum(0).cpu()
                    sums["tau_distinct"] += branched_tau(first, accept, mask).cpu() * blocks
                sums["blocks"] += blocks
                slot_sum = (accept * mask).reshape(-1, K).sum(0).cpu()
                slot_count = mask.float().reshape(-1, K).sum(0).cpu()
                sums["slot_sum"] = sums.get("slot_sum", 0) + slot_sum
                sums["slot_count"] = sums.get("slot_count", 0) + slot_count
    return sums


def main(argv=None) -> int:
    args = parse_args(argv)
    from hf_dspark.evaluation.runner import dataset_name, load_drafts, load_eval_prompts, render_prompts
    from hf_dspark.resources import load_target

    target, tokenizer = load_target(args.target, device=args.device, dtype=args.target_dtype)
    (name, draft), = load_drafts([args.draft], target).items()
    if not hasattr(draft.config, "num_anchors") or not hasattr(draft, "target_logits"):
        raise SystemExit(f"{args.draft} is a {draft.config.model_type} draft: this script scores block drafts "
                         "(dspark, dflash)")  # fmt: skip
    report = {"command": " ".join([sys.executable, *sys.argv]), "hardware": hardware(args.device), "draft": name,
              "rows": []}  # fmt: skip
    for temperature in args.temperature:
        for path in args.data:
            start = time.perf_counter()
            prompts = render_prompts(tokenizer, load_eval_prompts(path, args.num_prompts))
            pairs = target_answers(target, tokenizer, prompts, temperature, args.max_new_tokens, args.batch_size,
                                   args.seed)  # fmt: skip
            sums = score_blocks(draft, target, pairs, temperature, args.candidates, args.batch_size,
                                args.anchor_chunk, tokenizer.pad_token_id, args.distinct_samples, args.seed)  # fmt: skip
            blocks = max(sums["blocks"], 1.0)
            slot_count = sums["slot_count"].clamp(min=1)
            distinct = {}
            if "first_distinct" in sums:  # candidates drawn without replacement, as generate() draws them
                distinct = {"first_slot_by_candidates_distinct": (sums["first_distinct"] / blocks).tolist(),
                            "tau_by_candidates_distinct": (sums["tau_distinct"] / blocks).tolist()}  # fmt: skip
            report["rows"].append({
                "dataset": dataset_name(path), "temperature": temperature, "answers": len(pairs),
                "blocks": int(sums["blocks"]),
                "first_slot_by_candidates": (sums["first"] / blocks).tolist(),
                "tau_by_candidates": (sums["tau"] / blocks).tolist(),
                "accept_by_slot": (sums["slot_sum"] / slot_count).tolist(),
                **distinct,
                "seconds": round(time.perf_counter() - start, 1),
            })  # fmt: skip
            write_report(report, args.json)
    print_table(report, args.candidates, draft.config.num_draft_tokens)
    return 0


def print_table(report: dict, candidates: int, draft_tokens: int) -> None:
    head = ["T", "set", "blocks"] + [f"first@{k}" for k in range(1, candidates + 1)]
    head += [f"tau@{k}" for k in range(1, candidates + 1)] + [f"tau@{candidates}/tau@1"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    by_t: dict[tuple, list] = {}
    for row in report["rows"]:
        # Independent candidates, then (T > 0) distinct ones: the draws generate() makes.
        for kind, suffix in (("", ""), (" (distinct)", "_distinct")):
            if f"tau_by_candidates{suffix}" not in row:
                continue
            first, tau = row[f"first_slot_by_candidates{suffix}"], row[f"tau_by_candidates{suffix}"]
            by_t.setdefault((row["temperature"], kind), []).append((first, tau))
            cells = [f"{row['temperature']:g}", row["dataset"] + kind, str(row["blocks"])]
            cells += [f"{v:.3f}" for v in first] + [f"{v:.3f}" for v in tau] + [f"{tau[-1] / tau[0]:.3f}"]
            print("| " + " | ".join(cells) + " |")
    for (t, kind), rows in by_t.items():  # the mean over sets, as hf-dspark eval reports τ
        first = [sum(r[0][k] for r in rows) / len(rows) for k in range(candidates)]
        tau = [sum(r[1][k] for r in rows) / len(rows) for k in range(candidates)]
        cells = [f"{t:g}", "mean" + kind, ""] + [f"{v:.3f}" for v in first] + [f"{v:.3f}" for v in tau]
        print("| " + " | ".join(cells + [f"{tau[-1] / tau[0]:.3f}"]) + " |")
    print(f"(a round with k chains of {draft_tokens} drafts verifies 1 + {draft_tokens}k tokens)")


if __name__ == "__main__":
    sys.exit(main())
