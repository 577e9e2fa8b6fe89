#!/usr/bin/env python3
"""The HF transformers peer (../shared/bench/hf_baseline.py, packed as target/gpu/) at the shapes
of the model-family presets: its own measurements, with its table of shapes widened to Qwen2.5,
Llama 3.2, Gemma 3 and GLM-4 (their published config.json values, as crates/miles-model/src/presets.rs
holds them). Random-init weights in bf16, one JSON line per measurement.

  python3 tests/device/hf_families.py --model qwen2.5-0.5b [hf_baseline.py's flags]
"""
import inspect
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
for d in ("target/gpu", os.path.join(here, "../../../shared/bench")):
    if os.path.exists(os.path.join(d, "hf_baseline.py")):
        sys.path.insert(0, d)
        break
import hf_baseline  # noqa: E402
from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Glm4Config,
    Glm4ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
FAMILIES = {
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True), 1e6, None),
    "qwen2.5-1.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True), 1e6, None),
    "llama3.2-1b": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
        500000.0, LLAMA3_ROPE),
    "gemma3-1b": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, query_pre_attn_scalar=256,
        sliding_window=512, tie_word_embeddings=True), 1e6, None),
    "glm4-9b": (Glm4Config, Glm4ForCausalLM, dict(
        hidden_size=4096, intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, vocab_size=151552, partial_rotary_factor=0.5,
        attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False), 1e4, None),
}


def build(name):
    if name not in FAMILIES:
        return peer_build(name)
    config_cls, model_cls, kw, theta, scaling = FAMILIES[name]
    kw = dict(kw, max_position_embeddings=8192)
    rope = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    if config_cls is Gemma3TextConfig:
        kw["rope_parameters"] = {"full_attention": rope, "sliding_attention":
                                 {"rope_type": "default", "rope_theta": 10000.0}}
    elif "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        kw["rope_parameters"] = rope
    else:
        kw["rope_theta"] = theta
        if scaling:
            kw["rope_scaling"] = scaling
    cfg = config_cls(**kw)
    return model_cls(cfg), cfg


peer_build = hf_baseline.build
hf_baseline.build = build
hf_baseline.SHAPES.update({name: (None, {}) for name in FAMILIES})

if __name__ == "__main__":
    hf_baseline.main()
