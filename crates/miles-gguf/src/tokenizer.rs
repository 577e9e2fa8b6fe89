//! `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.*` metadata, for
//! byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`).

use serde_json::{Value, json};

use crate::Result;
use crate::metadata::Metadata;

/// llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
const TOKEN_NORMAL: i128 = 1;
const TOKEN_UNKNOWN: i128 = 2;
const TOKEN_CONTROL: i128 = 3;
const TOKEN_USER_DEFINED: i128 = 4;

/// Qwen2's split (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`, HF Qwen2 tokenizer.json): digits one
/// at a time.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split: as Qwen2's, with digits in runs of up to three.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `tokenizer.ggml.pre` name pre-tokenizes, in HF tokenizer.json terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreTokenizer {
    /// ByteLevel's built-in GPT-2 regex.
    Gpt2,
    Llama3,
    Qwen2,
}

/// The `tokenizer.ggml.pre` names this converter knows. `smollm` is GPT-2's split: llama.cpp
/// splits digits off first for it, but SmolLM2's own tokenizer.json does not, and the two
/// disagree on whitespace before a digit ("a  1"); the model's HF tokenizer is the one it was
/// trained with. `default` is what llama.cpp assumes when the key is absent; its own fallback
/// regex stack matches no HF tokenizer, GPT-2's is the byte-level default.
const PRE_TOKENIZERS: [(&str, PreTokenizer); 6] = [
    ("default", PreTokenizer::Gpt2),
    ("gpt-2", PreTokenizer::Gpt2),
    ("smollm", PreTokenizer::Gpt2),
    ("llama-bpe", PreTokenizer::Llama3),
    ("llama3", PreTokenizer::Llama3),
    ("qwen2", PreTokenizer::Qwen2),
];

/// The two files, as JSON values.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    pub tokenizer: Value,
    pub config: Value,
}

fn byte_level(add_prefix_space: bool, trim_offsets: bool, use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space,
           "trim_offsets": trim_offsets, "use_regex": use_regex})
}

fn split(regex: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

fn pre_tokenizer(meta: &Metadata) -> Result<PreTokenizer> {
    let key = "tokenizer.ggml.pre";
    let name = meta.opt_str(key)?.unwrap_or("default");
    PRE_TOKENIZERS.iter().find(|(n, _)| *n == name).map(|(_, p)| *p).ok_or_else(|| {
        let known: Vec<&str> = PRE_TOKENIZERS.iter().map(|(n, _)| *n).collect();
        meta.err(
            key,
            format!("pre-tokenizer '{name}' is not supported; known: {}", known.join(", ")),
        )
    })
}

/// Builds the tokenizer files; `context_length` becomes `model_max_length`.
pub fn build(meta: &Metadata, context_length: usize) -> Result<TokenizerFiles> {
    let model = meta.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(meta.err(
            "tokenizer.ggml.model",
            format!("tokenizer model '{model}' is not supported (only 'gpt2', byte-level BPE)"),
        ));
    }
    let pre = pre_tokenizer(meta)?;
    let tokens = meta
        .opt_strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| meta.err("tokenizer.ggml.tokens", "missing".into()))?;
    let merges = meta.opt_strings("tokenizer.ggml.merges")?.unwrap_or_default();
    let types = match meta.opt_ints("tokenizer.ggml.token_type")? {
        Some(t) if t.len() != tokens.len() => {
            return Err(meta.err(
                "tokenizer.ggml.token_type",
                format!("has {} entries for {} tokens", t.len(), tokens.len()),
            ));
        }
        Some(t) => t,
        None => vec![TOKEN_NORMAL; tokens.len()],
    };
    let id_of = |key: &str| -> Result<Option<u32>> {
        match meta.opt_u32(key)? {
            Some(id) if id as usize >= tokens.len() => Err(meta
                .err(key, format!("token id {id} is outside the vocabulary of {}", tokens.len()))),
            other => Ok(other),
        }
    };
    let bos = id_of("tokenizer.ggml.bos_token_id")?;
    let eos = id_of("tokenizer.ggml.eos_token_id")?;
    let unk = id_of("tokenizer.ggml.unknown_token_id")?;
    let pad = id_of("tokenizer.ggml.padding_token_id")?;
    let add_bos = meta.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = meta.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let text = |id: Option<u32>| id.map(|i| tokens[i as usize].clone());

    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    let named_specials = [bos, eos, unk, pad];
    for (id, (token, &ty)) in tokens.iter().zip(&types).enumerate() {
        // A repeated token string keeps its first id: a JSON object has one entry per key.
        if !vocab.contains_key(token) {
            vocab.insert(token.clone(), json!(id));
        }
        let named = named_specials.contains(&Some(id as u32));
        let special = ty == TOKEN_CONTROL || ty == TOKEN_UNKNOWN || named;
        if special || ty == TOKEN_USER_DEFINED {
            added.push(json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": special}));
        }
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ').map(|(a, b)| json!([a, b])).ok_or_else(|| {
                meta.err("tokenizer.ggml.merges", format!("merge {i} ({m:?}) is not 'left right'"))
            })
        })
        .collect::<Result<Vec<_>>>()?;

    let (normalizer, pre_tokenizer, decoder, ignore_merges) = match pre {
        PreTokenizer::Gpt2 => {
            (Value::Null, byte_level(false, true, true), byte_level(true, true, true), false)
        }
        PreTokenizer::Llama3 => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false, true, false)]}),
            byte_level(true, true, true),
            true,
        ),
        PreTokenizer::Qwen2 => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false, false, false)]}),
            byte_level(false, false, false),
            false,
        ),
    };
    if add_bos && bos.is_none() {
        return Err(meta.err(
            "tokenizer.ggml.add_bos_token",
            "is true but tokenizer.ggml.bos_token_id is not set".into(),
        ));
    }
    if add_eos && eos.is_none() {
        return Err(meta.err(
            "tokenizer.ggml.add_eos_token",
            "is true but tokenizer.ggml.eos_token_id is not set".into(),
        ));
    }
    let post_processor = post_processor(bos.filter(|_| add_bos), eos.filter(|_| add_eos), tokens);
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    });
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(bos),
        "eos_token": text(eos),
        "unk_token": text(unk),
        "pad_token": text(pad),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(template) = meta.opt_str("tokenizer.chat_template")? {
        config["chat_template"] = json!(template);
    }
    Ok(TokenizerFiles { tokenizer, config })
}

/// Prepends BOS and appends EOS as the GGUF's `add_bos_token` / `add_eos_token` say.
fn post_processor(bos: Option<u32>, eos: Option<u32>, tokens: &[String]) -> Value {
    let piece = |name: &str, type_id: u32| {
        let special =
            |id: u32| json!({"SpecialToken": {"id": tokens[id as usize], "type_id": type_id}});
        let mut out: Vec<Value> = bos.map(special).into_iter().collect();
        out.push(json!({"Sequence": {"id": name, "type_id": type_id}}));
        out.extend(eos.map(special));
        out
    };
    let single = piece("A", 0);
    let pair: Vec<Value> = single.iter().cloned().chain(piece("B", 1)).collect();
    let mut specials = serde_json::Map::new();
    for id in bos.into_iter().chain(eos) {
        let t = &tokens[id as usize];
        specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{Array, Value as V};
    use std::path::Path;

    fn meta(extra: Vec<(&str, V)>) -> Metadata {
        let tokens = ["<s>", "a", "b", "ab", "Ġ", "Ġab", "<tool>"];
        let mut entries = vec![
            ("tokenizer.ggml.model".to_string(), V::String("gpt2".into())),
            (
                "tokenizer.ggml.tokens".to_string(),
                V::Array(Array::String(tokens.iter().map(|t| t.to_string()).collect())),
            ),
            (
                "tokenizer.ggml.merges".to_string(),
                V::Array(Array::String(vec!["a b".into(), "Ġ ab".into()])),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                V::Array(Array::I32(vec![3, 1, 1, 1, 1, 1, 4])),
            ),
            ("tokenizer.ggml.bos_token_id".to_string(), V::U32(0)),
        ];
        entries.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
        Metadata::new(Path::new("m.gguf"), entries)
    }

    #[test]
    fn control_and_user_tokens_become_added_tokens() {
        let files = build(&meta(vec![]), 128).unwrap();
        let added = files.tokenizer["added_tokens"].as_array().unwrap();
        assert_eq!(added.len(), 2);
        assert_eq!(
            (added[0]["content"].as_str(), added[0]["special"].as_bool()),
            (Some("<s>"), Some(true))
        );
        assert_eq!(
            (added[1]["content"].as_str(), added[1]["special"].as_bool()),
            (Some("<tool>"), Some(false))
        );
        assert_eq!(files.tokenizer["model"]["merges"][1], json!(["Ġ", "ab"]));
        assert_eq!(files.config["bos_token"], json!("<s>"));
        assert_eq!(files.config["add_bos_token"], json!(false));
        assert!(files.config.get("chat_template").is_none());
    }

    #[test]
    fn add_bos_token_prepends_it() {
        let files = build(&meta(vec![("tokenizer.ggml.add_bos_token", V::Bool(true))]), 8).unwrap();
        let single = &files.tokenizer["post_processor"]["single"];
        assert_eq!(single[0]["SpecialToken"]["id"], json!("<s>"));
        assert_eq!(single[1]["Sequence"]["id"], json!("A"));
        assert_eq!(files.tokenizer["post_processor"]["pair"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn unknown_pre_tokenizers_and_models_are_named() {
        let err = build(&meta(vec![("tokenizer.ggml.pre", V::String("klingon".into()))]), 8)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "m.gguf: metadata 'tokenizer.ggml.pre': pre-tokenizer 'klingon' is not supported; known: default, gpt-2, smollm, llama-bpe, llama3, qwen2"
        );
        let mut m = meta(vec![]);
        m.entries[0].1 = V::String("llama".into());
        let err = build(&m, 8).unwrap_err().to_string();
        assert!(err.contains("tokenizer model 'llama' is not supported"), "{err}");
        let err = build(&meta(vec![("tokenizer.ggml.eos_token_id", V::U32(99))]), 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("token id 99 is outside the vocabulary of 7"), "{err}");
    }
}
