"""A SmolLM2-135M-architecture target with random weights (speed measurements need no real weights)."""
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

src, out = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
print("random target saved to", out)
