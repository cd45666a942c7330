"""flashgen in a Hugging Face transformers model: build a small Llama from its config (random weights, no
download), switch it to flashgen's attention, generate from a left-padded batch, and run one training step
on packed sequences. Needs a CUDA GPU and transformers 5 (``pip install -e ".[transformers]"``).

    python3 scripts/hf_example.py
"""
from __future__ import annotations

import torch
import transformers

import flashgen.integrations.transformers as flashgen_hf


def main() -> None:
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                      pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.set_attn_implementation(flashgen_hf.register())  # the one-line switch: "fgen"
    print("attention:", model.config._attn_implementation)

    # Generation from a left-padded batch: the padding becomes per-sequence lengths (varlen), no compute on it.
    ids = torch.randint(1, 32000, (2, 24), device="cuda")
    mask = torch.ones_like(ids)
    ids[1, :10], mask[1, :10] = 0, 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    print("generated:", out[:, 24:].tolist())

    # A training step on two rows, each packing sequences that position_ids restart at 0.
    model.train()
    rows = torch.randint(1, 32000, (2, 512), device="cuda")
    pos = torch.cat([torch.arange(200), torch.arange(312)]).repeat(2, 1).cuda()
    loss = model(input_ids=rows, position_ids=pos, labels=rows, use_cache=False).loss
    loss.backward()
    grad = sum(p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
    print(f"loss {loss.item():.3f}, gradient norm {grad.item():.3f}")


if __name__ == "__main__":
    main()
