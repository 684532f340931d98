"""What one draft proposal (a round's block draw) issues: aten operators per drafter and temperature, and on CUDA
the time of a proposal replayed as the decoding loop replays it (`StaticDraftRunner`, one CUDA graph; eagerly on
CPU). With
`--round`, the operators of one whole fused round instead (`round_graph.FusedRoundRunner`: proposal, the target's
verify forward, counted apart, verification, commit, the draft's context extension), run eagerly.

A speculative round at batch 16 is bound by kernel launches, not arithmetic, so the operator count of the draw is
what separates the drafters' round costs: DSpark draws its block slot by slot through its Markov head, DFlash in
one batched call, Eagle3 one forward per slot. It also times a proposal (rounds are timed by
generation_speed.py): a CUDA graph's replay on CUDA, the eager call on CPU, where arithmetic rules and a draft of
the target's width (`--hidden_size 576`, SmolLM2's) shows what a proposal's matrix products cost.

    python benchmarks/draft_draw_ops.py --device cpu --json OUT.json              # tiny random target, vocab 49152
    python benchmarks/draft_draw_ops.py --target TARGET --device cuda --json OUT.json
    python benchmarks/draft_draw_ops.py --round --device cpu --json OUT.json      # whole rounds
    python benchmarks/draft_draw_ops.py --round --candidates 1 2 4 --drafters dspark --device cpu  # tree rounds
    python benchmarks/draft_draw_ops.py --device cpu --hidden_size 576 --candidates 1 4  # proposals, timed

Counts are dispatched aten operators without views and allocations (what launches work); `torch.multinomial`
counts once here but runs about 13 kernels on CUDA (its input checks, then the exponential race), listed apart.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import hardware  # noqa: E402

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model, TokenSampler, target_features  # noqa: E402
from hf_dspark.generation.draft_graphs import StaticDraftRunner  # noqa: E402

DRAFTERS = {"dspark": DSparkModel, "dflash": DFlashModel, "eagle3": Eagle3Model}
NO_WORK = {"view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute",
           "reshape", "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "new_empty", "split",
           "chunk", "unbind", "lift_fresh", "_reshape_alias"}


class OperatorCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_WORK:
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target folder (default: a tiny random Llama with --vocab)")
    p.add_argument("--vocab", type=int, default=49152, help="the tiny target's vocabulary (SmolLM2's by default)")
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--block_size", type=int, default=7)
    p.add_argument("--num_hidden_layers", type=int, default=2, help="DSpark's and DFlash's layers (Eagle3: 1)")
    p.add_argument("--context", type=int, default=128, help="context positions in the draft's cache")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--replays", type=int, default=None, help="timed proposals per configuration (default: 200 "
                   "replays on CUDA, 5 eager calls on CPU)")
    p.add_argument("--hidden_size", type=int, default=64, help="the random target's width (and so the draft's); "
                   "SmolLM2-135M's is 576")
    p.add_argument("--round", action="store_true", help="count a whole fused round (the second of a call)")
    p.add_argument("--candidates", type=int, nargs="+", default=[1], metavar="K",
                   help="first-slot candidates a round (dspark_candidates; K > 1: k chains proposed, with --round "
                   "a tree round; block drafters only)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def load_target(args, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.target:
        return AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    config = AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def seeded_draft(args, target, name: str, device, dtype):
    """The drafter `name` built from the target with seeded random weights, in eval mode on the device."""
    torch.manual_seed(0)
    layers = 1 if name == "eagle3" else args.num_hidden_layers  # Eagle3 drafts have one decoder layer
    draft = DRAFTERS[name].from_target(target, num_hidden_layers=layers, block_size=args.block_size)
    return draft.to(device=device, dtype=dtype).eval()


def measure(args, target, name: str, temperature: float, device, dtype, candidates: int = 1) -> dict:
    draft = seeded_draft(args, target, name, device, dtype)
    vocab = target.config.vocab_size
    ids = torch.randint(3, vocab, (args.rows, args.context + 1), device=device)
    with torch.no_grad():
        feats, _ = target_features(target, ids, draft.config.target_layer_ids)
    cache = draft.new_context_cache(args.rows, capacity=args.context + 8 * (args.block_size + 1))
    draft.extend_context(cache, feats[:, :-1].to(dtype), next_token_ids=ids[:, 1:])
    sampler = TokenSampler(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0)
    runner = StaticDraftRunner(draft, cache, sampler, args.block_size, capture=device.type == "cuda",
                               candidates=candidates)  # fmt: skip
    runner.anchor_ids.copy_(ids[:, -1])
    ops = OperatorCount()
    with ops:
        runner._run_propose()
    work = sum(ops.names.values())
    row = {"drafter": name, "temperature": temperature, "candidates": candidates, "operators": work,
           "multinomial_calls": ops.names["multinomial"], "softmax_calls": ops.names["_softmax"],
           "float_casts": ops.names["_to_copy"], "top_operators": dict(ops.names.most_common(12))}
    cuda = device.type == "cuda"
    graphs = runner.ready() if cuda else False
    rows = torch.arange(args.rows, device=device)
    replays = args.replays or (200 if cuda else 5)
    propose = (lambda: runner.propose(rows, ids[:, -1], args.block_size)) if candidates == 1 else (
        lambda: runner.propose_chains(rows, ids[:, -1]))  # fmt: skip
    for _ in range(10 if cuda else 1):
        propose()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(replays):
        propose()
    sync()
    row.update(cuda_graph=graphs, ms_per_proposal=1000 * (time.perf_counter() - start) / replays)
    return row


class _CountSecondRound:
    """Patches `FusedRoundRunner._round` (`_tree_round` for a tree) for one call: the second round (past any
    first-round set-up) runs under an `OperatorCount`, with the target's verify forward and the draft's proposal
    counted apart."""

    def __init__(self, tree: bool = False):
        from hf_dspark.generation import round_graph

        self.method = "_tree_round" if tree else "_round"
        self.runner_class = round_graph.FusedRoundRunner
        self.plain = getattr(self.runner_class, self.method)
        self.rounds, self.ops, self.target_ops, self.draft_ops = 0, OperatorCount(), 0, 0

    def __enter__(self):
        counter, plain = self, self.plain

        def counted(runner):
            counter.rounds += 1
            if counter.rounds != 2:
                return plain(runner)
            forward, propose = runner.target_runner._run, runner.draft_runner._propose_fn

            def counted_apart(fn, field):
                def run():
                    before = sum(counter.ops.names.values())
                    try:
                        return fn()
                    finally:
                        setattr(counter, field, getattr(counter, field) + sum(counter.ops.names.values()) - before)

                return run

            runner.target_runner._run = counted_apart(forward, "target_ops")
            runner.draft_runner._propose_fn = counted_apart(propose, "draft_ops")
            try:
                with counter.ops:
                    plain(runner)
            finally:
                runner.target_runner._run, runner.draft_runner._propose_fn = forward, propose

        setattr(self.runner_class, self.method, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.runner_class, self.method, self.plain)


def measure_round(args, target, name: str, temperature: float, device, dtype, candidates: int = 1) -> dict:
    draft = seeded_draft(args, target, name, device, dtype)
    ids = torch.randint(3, target.config.vocab_size, (args.rows, 24), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))  # fmt: skip
    sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
    tree = {"dspark_candidates": candidates} if candidates > 1 else {}
    with _CountSecondRound(tree=bool(tree)) as counter:
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                        max_new_tokens=4 * (args.block_size + 1), dspark_target_graphs=True, dspark_fused_round=True,
                        **sampling, **tree)  # fmt: skip
    if counter.rounds < 2:
        raise RuntimeError(f"{name}: the call ran {counter.rounds} fused round(s); the count needs a second")
    total = sum(counter.ops.names.values())
    rest = total - counter.target_ops - counter.draft_ops
    return {"drafter": name, "temperature": temperature, "candidates": candidates, "operators": total,
            "target_forward_operators": counter.target_ops, "draft_proposal_operators": counter.draft_ops,
            "other_operators": rest, "float_casts": counter.ops.names["_to_copy"],
            "top_operators": dict(counter.ops.names.most_common(12))}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    target = load_target(args, device, dtype)
    count = measure_round if args.round else measure
    # Eagle3 proposes one chain: it is measured with k = 1 only.
    rows = [count(args, target, name, t, device, dtype, k) for name in args.drafters for t in args.temperatures
            for k in args.candidates if k == 1 or name != "eagle3"]  # fmt: skip
    result = {
        "benchmark": "draft_draw_ops" + (" --round" if args.round else ""),
        "command": "draft_draw_ops.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": hardware(device),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.round:
        print("| drafter | T | candidates | aten operators a round | the target's verify forward | the draft's "
              "proposal | the rest (verification, commit, extension) | float casts |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['drafter']} | {r['temperature']:g} | {r['candidates']} | {r['operators']} "
                  f"| {r['target_forward_operators']} | {r['draft_proposal_operators']} | {r['other_operators']} "
                  f"| {r['float_casts']} |")
        return 0
    print("| drafter | T | candidates | aten operators | multinomial calls (~13 kernels each on CUDA) | softmax "
          "| float casts | ms a proposal (a CUDA graph's replay; eager on CPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms_per_proposal']:.3f}" if "ms_per_proposal" in r else "-"
        print(f"| {r['drafter']} | {r['temperature']:g} | {r['candidates']} | {r['operators']} "
              f"| {r['multinomial_calls']} "
              f"| {r['softmax_calls']} | {r['float_casts']} | {ms} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
