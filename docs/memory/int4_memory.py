#!/usr/bin/env python3
"""The rollout weights' memory in BF16 and in INT4 (issue 31's paper accounting): parameter
counts from the published config.json of Llama-3.1-70B, Qwen3-235B-A22B and DeepSeek-V3 (the
values below are theirs), INT4 as the int4-qat plugin stores it: 4 bits a weight plus one
bf16 scale per group of 128 inputs (0.5156 bytes a weight) for every quantizable linear
(attention projections, dense MLPs, experts) or for the routed experts only (miles' choice);
embeddings, LM head, norms and routers stay bf16. GB = 1e9 bytes.

    python3 docs/memory/int4_memory.py
"""

GROUP = 128
INT4 = 0.5 + 2 / GROUP  # bytes a weight: the nibble and its share of a bf16 scale


def llama_70b():
    h, inter, layers, heads, kv, d, vocab = 8192, 28672, 80, 64, 8, 128, 128256
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    return {"attention": layers * attn, "dense MLP": layers * 3 * h * inter, "experts": 0,
            "bf16 rest": 2 * vocab * h + layers * 2 * h + h}


def qwen3_235b():
    h, layers, heads, kv, d, vocab, experts, inter = 4096, 94, 64, 4, 128, 151936, 128, 1536
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    return {"attention": layers * attn, "dense MLP": 0, "experts": layers * experts * 3 * h * inter,
            "bf16 rest": 2 * vocab * h + layers * (h * experts + 2 * h + 2 * d) + h}


def deepseek_v3():
    h, layers, dense, vocab = 7168, 61, 3, 129280
    q_lora, kv_lora, heads, nope, rope, v = 1536, 512, 128, 128, 64, 128
    experts, moe_inter, inter = 256, 2048, 18432
    attn = (h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope)
            + kv_lora * heads * (nope + v) + heads * v * h)
    sparse = layers - dense
    return {"attention": layers * attn,
            "dense MLP": dense * 3 * h * inter + sparse * 3 * h * moe_inter,  # with shared experts
            "experts": sparse * experts * 3 * h * moe_inter,
            "bf16 rest": 2 * vocab * h + sparse * h * experts + layers * (2 * h + q_lora + kv_lora) + h}


print("| model | parameters | BF16 | INT4, every linear | INT4, experts only | miles' figures (BF16 → INT4) |")
print("|---|---|---|---|---|---|")
for name, parts, miles in [("Llama-3.1-70B", llama_70b(), "140 → 45 GB"),
                           ("Qwen3-235B-A22B", qwen3_235b(), "470 → 150 GB"),
                           ("DeepSeek-V3 (671B)", deepseek_v3(), "1.3 TB → 420 GB")]:
    total = sum(parts.values())
    linear = parts["attention"] + parts["dense MLP"] + parts["experts"]
    bf16 = 2 * total / 1e9
    every = (INT4 * linear + 2 * parts["bf16 rest"]) / 1e9
    experts = (INT4 * parts["experts"] + 2 * (total - parts["experts"])) / 1e9
    experts_cell = f"{experts:.0f} GB" if parts["experts"] else "(no experts)"
    print(f"| {name} | {total / 1e9:.1f} B | {bf16:.0f} GB | {every:.0f} GB | {experts_cell} | {miles} |")
