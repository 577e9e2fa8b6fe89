//! `tokenizer.json` through the `tokenizers` crate, and chat templates from
//! `tokenizer_config.json` (rendered by [`crate::chat_template`]).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::chat_template::{CHATML_TEMPLATE, ChatRequest, render_chat_template};
use crate::{Error, Result};

/// A checkpoint's tokenizer and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Extra variables of every rendering ([`Tokenizer::with_chat_kwargs`]).
    chat_kwargs: Value,
    path: PathBuf,
}

/// `tokenizer_config.json` writes special tokens as strings or as `{"content": …}` objects.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Config {
            path: path.clone(),
            message: format!("cannot load tokenizer: {e}"),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|source| Error::Io { path: config_path.clone(), source })?;
            serde_json::from_str(&text).map_err(|e| Error::Config {
                path: config_path.clone(),
                message: format!("not valid JSON: {e}"),
            })?
        } else {
            Value::Null
        };
        // Newer checkpoints keep the template in chat_template.jinja.
        let jinja = dir.join("chat_template.jinja");
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            _ if jinja.exists() => Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|source| Error::Io { path: jinja, source })?,
            ),
            _ => None,
        };
        Ok(Tokenizer {
            inner,
            chat_template,
            bos_token: token_text(config.get("bos_token")),
            eos_token: token_text(config.get("eos_token")),
            chat_kwargs: Value::Null,
            path,
        })
    }

    /// The tokenizer with `kwargs` (a JSON object: `enable_thinking`, `tools`, …) passed to
    /// its chat template at every rendering (`--apply-chat-template-kwargs`).
    pub fn with_chat_kwargs(mut self, kwargs: Value) -> Result<Self> {
        if !matches!(kwargs, Value::Object(_) | Value::Null) {
            return Err(Error::Invalid(format!(
                "--apply-chat-template-kwargs must be a JSON object, found {kwargs}"
            )));
        }
        self.chat_kwargs = kwargs;
        Ok(self)
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Invalid(format!("{}: cannot encode: {e}", self.path.display())))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The prompt ids of a JSON prompt: text (encoded with the special tokens, or wrapped as
    /// one user message under `chat`) or chat messages through the chat template. Generation,
    /// scoring and training all tokenize prompts here, so they see the same ids.
    pub fn encode_prompt(&self, prompt: &Value, chat: bool) -> Result<Vec<u32>> {
        match (prompt, chat) {
            (Value::Array(_), true) => self.encode(&self.apply_chat_template(prompt, true)?, false),
            (Value::String(text), true) => {
                let messages = json!([{"role": "user", "content": text}]);
                self.encode(&self.apply_chat_template(&messages, true)?, false)
            }
            (Value::String(text), false) => self.encode(text, true),
            (Value::Array(_), false) => {
                Err(Error::Invalid("chat messages need --apply-chat-template".into()))
            }
            (other, _) => {
                Err(Error::Invalid(format!("must be text or chat messages, found {other}")))
            }
        }
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Invalid(format!("{}: cannot decode: {e}", self.path.display())))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template over `messages` (a JSON array of `{"role", "content"}`), with
    /// transformers' variables: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
    /// `tools`, the tokenizer's chat kwargs. The result is text; encode it without adding
    /// special tokens.
    pub fn apply_chat_template(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            Error::Invalid(format!(
                "{}: the tokenizer has no chat_template; drop --apply-chat-template or add one to tokenizer_config.json",
                self.path.display()
            ))
        })?;
        let request = ChatRequest {
            messages,
            add_generation_prompt,
            bos_token: self.bos_token.as_deref(),
            eos_token: self.eos_token.as_deref(),
            kwargs: &self.chat_kwargs,
        };
        render_chat_template(template, &request)
    }
}

/// The special tokens of the project's byte-level tokenizer, after the 256 byte tokens.
pub const BYTE_TOKENIZER_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the rest move past 255.
fn byte_to_char() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("latin-1")
            } else {
                let c = char::from_u32(next).expect("valid code point");
                next += 1;
                c
            }
        })
        .collect()
}

/// Writes the project's tokenizer: byte-level BPE over the 256 bytes (no merges, so any text
/// round-trips) plus ChatML special tokens, as `tokenizer.json` and `tokenizer_config.json`
/// that transformers loads too. Returns the vocabulary size (259).
pub fn write_byte_level_tokenizer(dir: &Path) -> Result<usize> {
    let vocab: serde_json::Map<String, Value> =
        byte_to_char().into_iter().enumerate().map(|(id, c)| (c.to_string(), json!(id))).collect();
    let added: Vec<Value> = BYTE_TOKENIZER_SPECIALS
        .iter()
        .enumerate()
        .map(|(k, t)| {
            json!({"id": 256 + k, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    });
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": false,
    });
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    for (name, value) in [("tokenizer.json", tokenizer), ("tokenizer_config.json", config)] {
        // Written aside and renamed into place: processes of one run writing the same
        // directory never read a half-written file.
        let path = dir.join(name);
        let aside = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&aside, serde_json::to_string_pretty(&value).expect("json"))
            .and_then(|()| std::fs::rename(&aside, &path))
            .map_err(|source| Error::Io { path, source })?;
    }
    Ok(256 + BYTE_TOKENIZER_SPECIALS.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn byte_tokenizer(name: &str) -> Tokenizer {
        let dir = std::env::temp_dir().join(format!("miles-byte-tokenizer-{name}"));
        assert_eq!(write_byte_level_tokenizer(&dir).unwrap(), 259);
        Tokenizer::load(&dir).unwrap()
    }

    #[test]
    fn byte_tokenizer_round_trips_any_text() {
        let tok = byte_tokenizer("round_trip");
        for text in ["12 + 7 = 19", "Ünïcödé ✓ 日本語", "tabs\tand\nnewlines", ""] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(ids.len(), text.len(), "one token per byte: {text}");
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        assert_eq!(tok.encode("A", false).unwrap(), vec![u32::from(b'A')]);
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(258));
        assert_eq!(tok.vocab_size(), 259);
    }

    #[test]
    fn chat_template_renders_chatml_and_encodes_specials() {
        let tok = byte_tokenizer("chat");
        let messages = json!([{"role": "user", "content": "hi"}]);
        let text = tok.apply_chat_template(&messages, true).unwrap();
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let ids = tok.encode(&text, false).unwrap();
        assert_eq!(ids[0], 257);
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi\nassistant\n");
        // Extra variables reach the template; a non-object is refused by its flag's name.
        let mut tok = tok.with_chat_kwargs(json!({"suffix": "!"})).unwrap();
        tok.chat_template = Some("{{ messages[0]['content'] }}{{ suffix }}".into());
        assert_eq!(tok.apply_chat_template(&messages, true).unwrap(), "hi!");
        let err = tok.with_chat_kwargs(json!(3)).err().unwrap().to_string();
        assert!(err.contains("--apply-chat-template-kwargs"), "{err}");
    }

    #[test]
    fn missing_files_are_named() {
        let dir = std::env::temp_dir().join("miles-no-tokenizer-here");
        let _ = std::fs::create_dir_all(&dir);
        let err = Tokenizer::load(&dir).err().unwrap().to_string();
        assert!(err.contains("miles-no-tokenizer-here/tokenizer.json"), "{err}");
    }
}
