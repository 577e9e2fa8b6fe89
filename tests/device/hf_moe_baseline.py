#!/usr/bin/env python3
"""The HF transformers peer for Qwen3-MoE (issue 16): Qwen3MoeForCausalLM (eager attention,
PyTorch, bf16, random weights) at the shape of `miles init-model --preset qwen3-30b-a3b-4l`
(Qwen3-30B-A3B's published config with 4 of its 48 layers). One JSON line per measurement, in
the style of ../shared/bench/hf_baseline.py: the logprob forward and the train step (AdamW) at
--batch x --seq-len, and sampled decode at --gen-batch. Runs on the GPU machine:

    python3 tests/device/hf_moe_baseline.py --batch 8 --seq-len 512 --gen-batch 64

--experts picks transformers' experts backend (its default in 5.x is grouped_mm, one
torch grouped GEMM per matrix; "eager" loops over the experts in Python).
"""
import argparse, json, time
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
             max_position_embeddings=8192)


def sync():
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--experts", default=None, help="eager, batched_mm or grouped_mm")
    ap.add_argument("--skip-generate", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**SHAPE)
    model = Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="eager").to("cuda", torch.bfloat16)
    if a.experts:
        model.set_experts_implementation(a.experts)
    nparam = sum(p.numel() for p in model.parameters())
    active = nparam - 4 * (128 - 8) * 3 * 2048 * 768
    base = dict(peer="hf-transformers", model="qwen3-30b-a3b-4l", params=nparam, active_params=active,
                torch=torch.__version__, device=torch.cuda.get_device_name(),
                experts=str(getattr(model.config, "_experts_implementation", None)))
    B, L, V = a.batch, a.seq_len, cfg.vocab_size
    x = torch.randint(0, V, (B, L), device="cuda")
    model.eval()
    with torch.no_grad():
        for i in range(5):
            if i == 2:
                sync(); t = time.perf_counter()
            logits = model(x).logits[:, :-1].float()
            torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])
        sync(); dt = (time.perf_counter() - t) / 3
    print(json.dumps(dict(base, what="logprob_forward", batch=B, seq_len=L, tokens_per_s=B * L / dt,
                          tflops_2nd=2 * active * B * L / dt / 1e12)), flush=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    torch.cuda.reset_peak_memory_stats()
    for i in range(5):
        if i == 2:
            sync(); t = time.perf_counter()
        logits = model(x).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        loss = -(lp * torch.randn_like(lp)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(); dt = (time.perf_counter() - t) / 3
    print(json.dumps(dict(base, what="train_step", batch=B, seq_len=L, tokens_per_s=B * L / dt,
                          tflops_6nd=6 * active * B * L / dt / 1e12,
                          peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)), flush=True)
    if a.skip_generate:
        return
    model.eval()
    G, P, N = a.gen_batch, a.prompt_len, a.new_tokens
    prompts = torch.randint(0, V, (G, P), device="cuda")
    with torch.no_grad():
        model.generate(prompts[:2], max_new_tokens=2, min_new_tokens=2, do_sample=True)
        sync(); t = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=N, min_new_tokens=N, do_sample=True, top_k=0)
        sync(); dt = time.perf_counter() - t
    print(json.dumps(dict(base, what="generate", batch=G, prompt_len=P, new_tokens=N,
                          tokens_per_s=(out.shape[1] - P) * G / dt, seconds=dt)), flush=True)


if __name__ == "__main__":
    main()
