#!/usr/bin/env python3
"""The HF transformers peer for the MoE shapes (issues 16 and 37): Qwen3MoeForCausalLM at the
shape of `--preset qwen3-30b-a3b-4l` (Qwen3-30B-A3B's published config with 4 of its 48
layers), or DeepseekV3ForCausalLM at `--preset deepseek-v3-4l` (DeepSeek-V3's published config
with 4 of its 61 layers: 3 dense, one of 256 experts), eager attention, PyTorch, bf16, random
weights made on the GPU. One JSON line per measurement, in the style of
../shared/bench/hf_baseline.py: the logprob forward and the train step (AdamW) at --batch x
--seq-len, and sampled decode at --gen-batch. Runs on the GPU machine:

    python3 tests/device/hf_moe_baseline.py --batch 8 --seq-len 512 --gen-batch 64
    python3 tests/device/hf_moe_baseline.py --model deepseek-v3-4l --skip-train ...

--experts picks transformers' experts backend (its default in 5.x is grouped_mm, one
torch grouped GEMM per matrix; "eager" loops over the experts in Python).
"""
import argparse, json, time
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
             max_position_embeddings=8192)
# DeepSeek-V3's published config.json (its quantization_config left out), 4 layers.
DEEPSEEK_V3 = dict(
    attention_bias=False, first_k_dense_replace=3, hidden_act="silu", hidden_size=7168,
    intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840,
    moe_intermediate_size=2048, moe_layer_freq=1, n_group=8, n_routed_experts=256,
    n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8,
    num_hidden_layers=4, num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6, rope_theta=10000,
    routed_scaling_factor=2.5,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    scoring_func="sigmoid", tie_word_embeddings=False, topk_group=4, topk_method="noaux_tc",
    v_head_dim=128, vocab_size=129280, bos_token_id=0, eos_token_id=1)
MODELS = {
    "qwen3-30b-a3b-4l": (Qwen3MoeConfig, Qwen3MoeForCausalLM, SHAPE),
    "deepseek-v3-4l": (DeepseekV3Config, DeepseekV3ForCausalLM, DEEPSEEK_V3),
}


def inactive(cfg):
    """Parameters of the experts a token does not visit, over the sparse layers."""
    experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    dense = getattr(cfg, "first_k_dense_replace", 0)
    sparse = cfg.num_hidden_layers - dense
    return sparse * (experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size


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
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--model", default="qwen3-30b-a3b-4l", choices=sorted(MODELS))
    a = ap.parse_args()
    torch.manual_seed(0)
    config_cls, model_cls, shape = MODELS[a.model]
    cfg = config_cls(**shape)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_cls._from_config(cfg, attn_implementation="eager")
    torch.set_default_dtype(torch.float32)
    if a.experts:
        model.set_experts_implementation(a.experts)
    nparam = sum(p.numel() for p in model.parameters())
    active = nparam - inactive(cfg)
    base = dict(peer="hf-transformers", model=a.model, params=nparam, active_params=active,
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
    if a.skip_train:
        return generate(a, model, base, V)
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
    generate(a, model, base, V)


def generate(a, model, base, V):
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
