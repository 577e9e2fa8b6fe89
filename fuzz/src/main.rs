//! One libFuzzer binary for every parser of miles-rs; `MILES_FUZZ_TARGET` picks the parser.
//! Each harness feeds the bytes to the code a user's file or request reaches (files through a
//! scratch file in `/dev/shm`, as the loaders read them) and ignores the errors: a panic, an
//! abort, a hang or a blow-up of memory is the finding. Built and run by `cargo xtask fuzz`
//! (see FUZZING.md).
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{Map, Value, json};

/// The parsers, by the names `cargo xtask fuzz` takes.
const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("safetensors", safetensors),
    ("gguf", gguf),
    ("config-json", config_json),
    ("jsonl", jsonl),
    ("parquet", parquet),
    ("toml-config", toml_config),
    ("chat-template", chat_template),
    ("plugin-json", plugin_json),
    ("worker-line", worker_line),
    ("http-request", http_request),
];

fn target() -> fn(&[u8]) {
    static TARGET: OnceLock<fn(&[u8])> = OnceLock::new();
    *TARGET.get_or_init(|| {
        let name = std::env::var("MILES_FUZZ_TARGET").unwrap_or_default();
        match TARGETS.iter().find(|(n, _)| *n == name) {
            Some(&(_, f)) => f,
            None => {
                let names: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
                eprintln!("MILES_FUZZ_TARGET='{name}': one of {}", names.join(", "));
                std::process::exit(2);
            }
        }
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| target()(data));

/// `data` written to `name` in this process's scratch directory (memory-backed where the
/// system has /dev/shm), for the loaders that read files.
fn scratch(name: &str, data: &[u8]) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let dir = base.join(format!("miles-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    });
    let path = dir.join(name);
    std::fs::write(&path, data).expect("the scratch file is written");
    path
}

/// A safetensors file: the header, then every tensor read as the loaders read it.
fn safetensors(data: &[u8]) {
    let path = scratch("model.safetensors", data);
    let Ok(files) = miles_model::weights::TensorFiles::single(&path) else { return };
    for name in files.names() {
        if let Ok(shape) = files.shape(name) {
            let _ = files.f32(name, &shape);
        }
        let _ = files.i32(name);
    }
}

/// A GGUF file: header, metadata and tensor table; then the model config, the weights and
/// the tokenizer it describes.
fn gguf(data: &[u8]) {
    let path = scratch("model.gguf", data);
    let Ok(file) = miles_gguf::GgufFile::open(&path) else { return };
    if let Ok(config) = miles_gguf::convert::model_config(&file) {
        let _ = miles_gguf::tokenizer::build(&file.metadata, config.max_position_embeddings);
        let _ = miles_gguf::convert::load_weights(&file, &config);
    }
}

/// An HF config.json of any family.
fn config_json(data: &[u8]) {
    if let Ok(value) = serde_json::from_slice::<Value>(data) {
        let _ = miles_model::ModelConfig::from_json(&value, Path::new("config.json"));
    }
}

/// The prompt keys the data harnesses ask for: a label and metadata too.
fn keys() -> miles_data::Keys {
    miles_data::Keys {
        label_key: Some("label".into()),
        metadata_key: Some("metadata".into()),
        ..miles_data::Keys::input("prompt")
    }
}

/// A prompt file in JSONL, whole and sliced.
fn jsonl(data: &[u8]) {
    let path = scratch("prompts.jsonl", data);
    let spec = path.display().to_string();
    let _ = miles_data::Dataset::load(&spec, &keys());
    let _ = miles_data::Dataset::load(&format!("{spec}@[1:3]"), &keys());
}

/// A prompt file in Parquet.
fn parquet(data: &[u8]) {
    let path = scratch("prompts.parquet", data);
    let _ = miles_data::Dataset::load(&path.display().to_string(), &keys());
}

/// A `--config` TOML file, through every check of `miles train`'s configuration.
fn toml_config(data: &[u8]) {
    let path = scratch("run.toml", data);
    let args = miles_cli::run_flags::TrainArgs { config: Some(path), ..Default::default() };
    let _ = miles_cli::run_flags::build_run_config(&Map::new(), &args);
}

/// A chat template rendering a fixed conversation, or, after a line `---`, a fixed template
/// rendering the conversation (JSON) that follows.
fn chat_template(data: &[u8]) {
    use miles_model::chat_template::{CHATML_TEMPLATE, ChatRequest, render_chat_template};
    let Ok(text) = std::str::from_utf8(data) else { return };
    let fixed = json!([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "What is 2 + 3?"}]);
    let (template, messages) = match text.split_once("\n---\n") {
        Some((template, messages)) => match serde_json::from_str::<Value>(messages) {
            Ok(messages) => (template, messages),
            Err(_) => return,
        },
        None => (text, fixed),
    };
    let kwargs = json!({"enable_thinking": false});
    for template in [template, CHATML_TEMPLATE] {
        let request = ChatRequest {
            messages: &messages,
            add_generation_prompt: true,
            bos_token: Some("<s>"),
            eos_token: Some("</s>"),
            kwargs: &kwargs,
        };
        let _ = render_chat_template(template, &request);
    }
}

/// A reward plugin's JSON (its results, the samples it is given).
fn plugin_json(data: &[u8]) {
    miles_plugin_abi::host::fuzz_plugin_json(data);
}

/// A line of a Python reward worker's output.
fn worker_line(data: &[u8]) {
    if let Ok(line) = std::str::from_utf8(data) {
        miles_rewards::python::fuzz_worker_line(line);
    }
}

/// A request body of the server's endpoints.
fn http_request(data: &[u8]) {
    miles_server::fuzz_request(data);
}
