"""How many backward operators a draft's training step issues: the autograd nodes of its loss, per drafter, with the
draft's layer methods compiled as training compiles them (`compile_draft_layers`) and without.

The training step of a small draft (SmolLM2's, 135M target) is host-bound: the host issues each autograd node's
kernels one after another, and a compiled region counts as one node. The count does not depend on the widths, so a
tiny random target on a CPU gives the figure a GPU run would see; what a node costs is for the GPU benchmarks
(`train_throughput.py`, `profile_training.py`).

    python benchmarks/train_step_ops.py --json OUT.json
    python benchmarks/train_step_ops.py --drafters eagle3 --seq 256 --attention dense

The loss is `draft_loss` over the draft's training forward (anchors sampled as the trainer samples them), in its
PyTorch form (the fused Triton kernel, CUDA's default, is one more node in place of the compiled chunks).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import hardware, tiny_target, write_report  # noqa: E402

from hf_dspark import DFlashModel, DSparkModel, Eagle3Model, target_features  # noqa: E402
from hf_dspark.models.anchors import sample_anchors  # noqa: E402
from hf_dspark.training.compiled_layers import compiled_draft_layers  # noqa: E402
from hf_dspark.training.losses import draft_loss  # noqa: E402

DRAFTERS = {"dspark": DSparkModel, "dflash": DFlashModel, "eagle3": Eagle3Model}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens a row (all supervised)")
    p.add_argument("--num_hidden_layers", type=int, default=2, help="DSpark's and DFlash's layers (Eagle3: 1)")
    p.add_argument("--num_anchors", type=int, default=8, help="anchor blocks a row (block drafters)")
    p.add_argument("--attention", default="dense", choices=["flex", "dense"],
                   help="the draft's training attention; CPU flex attention has no backward, so dense on a CPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def backward_nodes(loss: torch.Tensor) -> collections.Counter:
    """The autograd nodes the backward of `loss` runs, by kind."""
    kinds, seen, stack = collections.Counter(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kinds[type(node).__name__] += 1
        stack.extend(fn for fn, _ in node.next_functions)
    return kinds


def measure(args, target, name: str, compiled: bool) -> dict:
    torch.manual_seed(0)
    layers = 1 if name == "eagle3" else args.num_hidden_layers
    draft = DRAFTERS[name].from_target(target, num_hidden_layers=layers).to(args.device).train()
    draft.block_mask_kind = args.attention
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    loss_mask = torch.ones_like(ids)
    with torch.no_grad():
        feats, last = target_features(target, ids, draft.config.target_layer_ids)
    kwargs = dict(attention_mask=torch.ones_like(ids), target_last_hidden=last)
    if name != "eagle3":  # block drafters: anchors drawn as the trainer draws them
        gen = torch.Generator(device=args.device).manual_seed(0)
        positions, valid = sample_anchors(loss_mask, args.num_anchors, gen, fixed_count=True)
        kwargs.update(anchor_positions=positions, anchor_mask=valid)
    torch._dynamo.reset()
    with compiled_draft_layers(draft) if compiled else contextlib.nullcontext():
        outputs = draft(ids, feats, loss_mask, **kwargs)
        loss = draft_loss(draft, outputs).loss
    kinds = backward_nodes(loss)
    return {"drafter": name, "compiled_layers": compiled, "backward_nodes": sum(kinds.values()),
            "compiled_regions": kinds["CompiledFunctionBackward"], "top_nodes": dict(kinds.most_common(10))}


def main(argv=None):
    args = parse_args(argv)
    target = tiny_target()[0].to(args.device)  # the benchmarks' tiny random Llama (the counts ignore widths)
    rows = [measure(args, target, name, compiled) for name in args.drafters for compiled in (False, True)]
    print(f"{'drafter':8} {'compiled layers':>15} {'backward nodes':>15} {'compiled regions':>17}")
    for r in rows:
        print(f"{r['drafter']:8} {str(r['compiled_layers']):>15} {r['backward_nodes']:>15} {r['compiled_regions']:>17}")
    write_report({"command": " ".join(sys.argv), "hardware": hardware(torch.device(args.device)),
                  "settings": vars(args), "runs": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
