#!/usr/bin/env python3
"""Qwen3-0.6B-shaped random model: miles-rs bf16 on the GPU against HF transformers bf16, both
judged by HF transformers f32 on the same (bf16-valued) weights. Runs on the GPU machine.

  python3 qwen3_bf16_parity.py write DIR        # checkpoint, tokens.jsonl, hf.json
  miles score --hf-checkpoint DIR --input DIR/tokens.jsonl --device cuda --output DIR/ours.jsonl
  (and --dtype f32 --output DIR/ours_f32.jsonl: our f32 mode against HF f32, optional)
  python3 qwen3_bf16_parity.py compare DIR      # one JSON line: |Δlogp| of both against HF f32

Acceptance (issue 11): ours' mean, p99 and max |Δlogp| no worse than HF bf16's.
"""
import json, os, sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

LENGTHS = [512, 300, 64, 1000, 17, 256, 700, 128]


def write(d):
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=8192,
                      rope_theta=1000000.0, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(cfg).to("cuda").eval()
    # model.to(dtype) casts every floating buffer, RoPE's inverse frequencies too; from_pretrained
    # keeps them in f32, as we do. Without this, both HF runs rotate by bf16-rounded frequencies
    # (off by up to 2 rad at position 1000) and differ from any f32 RoPE by ~0.008 per token.
    rope = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}

    def cast(dtype):
        model.to(dtype)
        for name, b in rope.items():
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, b)

    cast(torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True)
    seqs = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in LENGTHS]
    with open(f"{d}/tokens.jsonl", "w") as f:
        for s in seqs:
            f.write(json.dumps({"tokens": s, "response_length": len(s) - 1}) + "\n")
    out = {}
    for name, dtype in [("hf_bf16", torch.bfloat16), ("hf_f32", torch.float32)]:
        cast(dtype)
        rows = []
        with torch.no_grad():
            for s in seqs:
                x = torch.tensor([s], device="cuda")
                logits = model(x).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)
                rows.append(lp.cpu().tolist())
        out[name] = rows
    json.dump(out, open(f"{d}/hf.json", "w"))


def compare(d):
    hf = json.load(open(f"{d}/hf.json"))
    ours = [json.loads(l)["log_probs"] for l in open(f"{d}/ours.jsonl")]
    ref = torch.tensor(sum(hf["hf_f32"], []), dtype=torch.float64)

    def stats(rows):
        diff = (torch.tensor(sum(rows, []), dtype=torch.float64) - ref).abs()
        return dict(mean=diff.mean().item(), p99=diff.quantile(0.99).item(), max=diff.max().item())

    res = dict(what="qwen3_0.6b_bf16_parity", tokens=len(ref), ours_bf16_vs_hf_f32=stats(ours),
               hf_bf16_vs_hf_f32=stats(hf["hf_bf16"]))
    if os.path.exists(f"{d}/ours_f32.jsonl"):  # our f32 mode: how far the f32 references agree
        res["ours_f32_vs_hf_f32"] = stats([json.loads(l)["log_probs"] for l in open(f"{d}/ours_f32.jsonl")])
    print(json.dumps(res))


if __name__ == "__main__":
    {"write": write, "compare": compare}[sys.argv[1]](sys.argv[2])
