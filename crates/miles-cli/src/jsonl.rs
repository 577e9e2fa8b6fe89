//! JSONL input: one JSON object per line, blank lines skipped, every error naming file and line.

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, bail};

/// One parsed line: its 1-based number and the object as written.
pub struct Line {
    pub number: usize,
    pub object: serde_json::Map<String, serde_json::Value>,
}

/// Reads every line of `path`; the first malformed one fails the whole read with
/// `path:line: what is wrong`.
pub fn read_objects(path: &Path) -> anyhow::Result<Vec<Line>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open {}: check the path", path.display()))?;
    let mut lines = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let number = i + 1;
        let text =
            line.with_context(|| format!("{}:{number}: cannot read line", path.display()))?;
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}:{number}: not valid JSON ({e}); each line must be one JSON object",
                path.display()
            )
        })?;
        let serde_json::Value::Object(object) = value else {
            bail!("{}:{number}: expected a JSON object, found {}", path.display(), kind(&value));
        };
        lines.push(Line { number, object });
    }
    Ok(lines)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
