//! Prompt files → [`Dataset`]: one [`PromptRow`] per non-blank line of a JSONL file, or per row
//! of a Parquet file (`.parquet`, read in `parquet_file` into the same JSON objects).

use std::ops::Range;
use std::path::Path;

use miles_core::{Message, Prompt};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{DataError, parse_slice};

/// Which keys of each JSON line (columns of a Parquet file) hold the prompt, the label and the
/// metadata (slime's `--input-key`, `--label-key`, `--metadata-key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub input_key: String,
    pub label_key: Option<String>,
    pub metadata_key: Option<String>,
}

impl Keys {
    /// Prompts under `input_key`, no label, no metadata.
    pub fn input(input_key: impl Into<String>) -> Keys {
        Keys { input_key: input_key.into(), label_key: None, metadata_key: None }
    }
}

impl Default for Keys {
    /// slime's default: the prompt under `"input"`.
    fn default() -> Keys {
        Keys::input("input")
    }
}

/// One prompt row. `line` is the 1-based line number in its JSONL file, or the 1-based row
/// number in its Parquet file (for error messages and provenance).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRow {
    pub prompt: Prompt,
    /// The label's text: strings as written, numbers and booleans as their JSON text (`42`,
    /// `true`), so GSM8K-style numeric answers need no conversion. `None` without a label key.
    pub label: Option<String>,
    /// The value under the metadata key, exactly as written; `Null` without a metadata key.
    pub metadata: Value,
    pub line: usize,
}

/// The rows of one prompt file (or a slice of it), in file order.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// The spec as given, slice included: `data/gsm8k.jsonl@[0:100]`.
    pub source: String,
    pub rows: Vec<PromptRow>,
}

impl Dataset {
    /// Loads `spec` (`FILE` or `FILE@[a:b]`, see [`parse_slice`]) with the prompt, label and
    /// metadata under `keys`.
    ///
    /// Rows are the non-blank lines of the file (blank: only spaces, tabs, `\r`); the slice
    /// counts rows, not lines, and its end is clamped to the row count as in Python. Only the
    /// rows inside the slice are parsed, so a slice loads quickly from a large file and does not
    /// see malformed rows outside it. A UTF-8 byte order mark and CRLF line ends are accepted.
    /// The load fails on the first bad row, naming `file:line`, and on a slice or file with no
    /// row.
    ///
    /// A file named `*.parquet` (any case) is read as Parquet instead: each row becomes the JSON
    /// object a JSONL line of the same data would hold, and goes through the same checks, so the
    /// rows, slices, keys and messages are the JSONL ones (a bad row is named by its 1-based row
    /// number). Only the columns the keys name are read.
    pub fn load(spec: &str, keys: &Keys) -> Result<Dataset, DataError> {
        let (path, from, to) = parse_slice(spec)?;
        if is_parquet(&path) {
            return crate::parquet_file::load(spec, &path, from, to, keys);
        }
        let bytes =
            std::fs::read(&path).map_err(|source| DataError::Io { path: path.clone(), source })?;
        let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
        // (1-based line number, the line without its end), blank lines left out.
        let lines: Vec<(usize, &[u8])> = bytes
            .split(|&b| b == b'\n')
            .enumerate()
            .map(|(i, l)| (i + 1, l.strip_suffix(b"\r").unwrap_or(l)))
            .filter(|(_, l)| !l.iter().all(|b| matches!(b, b' ' | b'\t' | b'\r')))
            .collect();
        let rows = row_range(
            spec,
            &path,
            (from, to),
            lines.len(),
            " (the file is empty or every line is blank)",
        )?;
        let rows = lines[rows]
            .iter()
            .map(|&(line, text)| {
                parse_line(text)
                    .and_then(|object| parse_object(&object, keys))
                    .map_err(|message| DataError::Row { path: path.clone(), line, message })
                    .map(|(prompt, label, metadata)| PromptRow { prompt, label, metadata, line })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Dataset { source: spec.to_string(), rows })
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// Whether `path` names a Parquet file: its extension is `.parquet`, in any case.
fn is_parquet(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// The rows `from..to` of a file of `total` rows (`to` clamped to `total`, as Python slices do),
/// or the error for a slice, or a whole file, with no row; `empty_hint` says why a whole file
/// may have none.
pub(crate) fn row_range(
    spec: &str,
    path: &Path,
    (from, to): (Option<usize>, Option<usize>),
    total: usize,
    empty_hint: &str,
) -> Result<Range<usize>, DataError> {
    let (start, end) = (from.unwrap_or(0), to.unwrap_or(total).min(total));
    if start < end {
        return Ok(start..end);
    }
    if from.is_none() && to.is_none() {
        return Err(DataError::Empty { dataset: spec.to_string(), hint: empty_hint.into() });
    }
    let rows = match total {
        1 => "1 row".to_string(),
        n => format!("{n} rows"),
    };
    Err(DataError::Slice {
        spec: spec.to_string(),
        message: format!(
            "the slice selects no row ({} has {rows}, counted from 0)",
            path.display()
        ),
    })
}

/// One JSONL line → its JSON object, or what is wrong with it (the caller adds file:line).
fn parse_line(text: &[u8]) -> Result<Map<String, Value>, String> {
    let text = std::str::from_utf8(text).map_err(|e| {
        format!(
            "not valid UTF-8 (at byte {} of the line); save the file as UTF-8",
            e.valid_up_to() + 1
        )
    })?;
    let value: Value = serde_json::from_str(text).map_err(|e| {
        format!("not valid JSON ({e}); each line must hold one JSON object (JSONL)")
    })?;
    match value {
        Value::Object(object) => Ok(object),
        other => Err(format!(
            "expected a JSON object, found {}; each line must hold one JSON object (JSONL)",
            kind(&other)
        )),
    }
}

/// One row's JSON object (a JSONL line, or a Parquet row in the same form) → (prompt, label,
/// metadata), or what is wrong with it (the caller adds where).
pub(crate) fn parse_object(
    object: &Map<String, Value>,
    keys: &Keys,
) -> Result<(Prompt, Option<String>, Value), String> {
    let prompt = parse_prompt(get(object, &keys.input_key, "--input-key")?, &keys.input_key)?;
    let label = match &keys.label_key {
        None => None,
        Some(key) => Some(match get(object, key, "--label-key")? {
            Value::String(s) => s.clone(),
            v @ (Value::Number(_) | Value::Bool(_)) => v.to_string(),
            other => {
                return Err(format!(
                    "label '{key}' must be a string, number or boolean, found {} (check \
                     --label-key)",
                    kind(other)
                ));
            }
        }),
    };
    let metadata = match &keys.metadata_key {
        None => Value::Null,
        Some(key) => get(object, key, "--metadata-key")?.clone(),
    };
    Ok((prompt, label, metadata))
}

/// `object[key]`, or an error saying which flag names the key and which keys the line has.
fn get<'a>(object: &'a Map<String, Value>, key: &str, flag: &str) -> Result<&'a Value, String> {
    object.get(key).ok_or_else(|| {
        let have = if object.is_empty() {
            "this line has no key".to_string()
        } else {
            format!("this line has {}", quoted_list(object.keys()))
        };
        format!("no key '{key}' (set {flag}; {have})")
    })
}

/// `'a', 'b', 'c'`, the first 20 names and then how many more.
pub(crate) fn quoted_list<S: AsRef<str>>(names: impl ExactSizeIterator<Item = S>) -> String {
    const SHOWN: usize = 20;
    let total = names.len();
    let mut list: Vec<String> = names.take(SHOWN).map(|k| format!("'{}'", k.as_ref())).collect();
    if total > SHOWN {
        list.push(format!("and {} more", total - SHOWN));
    }
    list.join(", ")
}

/// What a prompt may be, for error messages: "the prompt {PROMPT_FORMS}".
pub(crate) const PROMPT_FORMS: &str =
    "must be text or a list of {\"role\", \"content\"} chat messages";

/// Text, or a non-empty list of `{"role": .., "content": ..}` chat messages.
fn parse_prompt(value: &Value, key: &str) -> Result<Prompt, String> {
    let must = PROMPT_FORMS;
    match value {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) if items.is_empty() => {
            Err(format!("prompt '{key}' is an empty list; it {must}"))
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let field = |name: &str| match item.get(name) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    Some(other) => Err(format!(
                        "prompt '{key}': message {i} has a '{name}' that is {}, not a string; \
                         the prompt {must}",
                        kind(other)
                    )),
                    None => Err(format!(
                        "prompt '{key}': message {i} has no string '{name}'; the prompt {must}"
                    )),
                };
                if !item.is_object() {
                    return Err(format!(
                        "prompt '{key}': message {i} is {}, not an object; the prompt {must}",
                        kind(item)
                    ));
                }
                Ok(Message { role: field("role")?, content: field("content")? })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Messages),
        other => Err(format!("prompt '{key}' is {}; it {must}", kind(other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempFile;
    use serde_json::json;

    const GSM: &str = concat!(
        r#"{"question": "What is 2 + 3?", "answer": 5, "meta": {"id": "a"}}"#,
        "\n",
        "\n",
        "   \n",
        r#"{"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}], "answer": "red", "meta": 7}"#,
        "\r\n",
        r#"{"question": "Is 2 even?", "answer": true, "meta": null}"#,
        "\n",
        r#"{"question": "Third", "answer": 2.5, "meta": [1, 2]}"#,
    );

    fn keys(input: &str, label: Option<&str>, metadata: Option<&str>) -> Keys {
        Keys {
            input_key: input.into(),
            label_key: label.map(Into::into),
            metadata_key: metadata.map(Into::into),
        }
    }

    fn load_err(contents: &[u8], keys: &Keys) -> (String, String) {
        let f = TempFile::new("bad.jsonl", contents);
        let e = Dataset::load(&f.spec(), keys).unwrap_err();
        (e.to_string(), f.spec())
    }

    #[test]
    fn text_and_chat_prompts_with_numeric_labels_and_metadata() {
        let f = TempFile::new("gsm.jsonl", GSM.as_bytes());
        let d = Dataset::load(&f.spec(), &keys("question", Some("answer"), Some("meta"))).unwrap();
        assert_eq!(d.source, f.spec());
        assert_eq!(d.len(), 4);
        assert!(!d.is_empty());
        assert_eq!(d.rows[0].prompt, Prompt::Text("What is 2 + 3?".into()));
        assert_eq!(
            d.rows[1].prompt,
            Prompt::Messages(vec![
                Message { role: "system".into(), content: "Be brief.".into() },
                Message { role: "user".into(), content: "Name a colour.".into() },
            ])
        );
        let labels: Vec<_> = d.rows.iter().map(|r| r.label.as_deref()).collect();
        assert_eq!(labels, [Some("5"), Some("red"), Some("true"), Some("2.5")]);
        let metadata: Vec<_> = d.rows.iter().map(|r| r.metadata.clone()).collect();
        assert_eq!(metadata, [json!({"id": "a"}), json!(7), Value::Null, json!([1, 2])]);
        // Line numbers are the file's, blank lines counted.
        let lines: Vec<_> = d.rows.iter().map(|r| r.line).collect();
        assert_eq!(lines, [1, 4, 5, 6]);
    }

    #[test]
    fn without_label_and_metadata_keys_they_are_none_and_null() {
        let f = TempFile::new("gsm.jsonl", GSM.as_bytes());
        let d = Dataset::load(&f.spec(), &keys("question", None, None)).unwrap();
        assert!(d.rows.iter().all(|r| r.label.is_none() && r.metadata.is_null()));
    }

    #[test]
    fn a_byte_order_mark_is_skipped() {
        let f = TempFile::new("bom.jsonl", b"\xEF\xBB\xBF{\"input\": \"hi\"}\n");
        let d = Dataset::load(&f.spec(), &Keys::default()).unwrap();
        assert_eq!(d.rows[0].prompt, Prompt::Text("hi".into()));
    }

    #[test]
    fn slices_count_rows_not_lines() {
        let f = TempFile::new("gsm.jsonl", GSM.as_bytes());
        let k = keys("question", Some("answer"), None);
        let lines = |slice: &str| -> Vec<usize> {
            let spec = format!("{}{slice}", f.spec());
            let d = Dataset::load(&spec, &k).unwrap();
            assert_eq!(d.source, spec);
            d.rows.iter().map(|r| r.line).collect()
        };
        assert_eq!(lines("@[2:]"), [5, 6]);
        assert_eq!(lines("@[:3]"), [1, 4, 5]);
        assert_eq!(lines("@[1:2]"), [4]);
        assert_eq!(lines("@[:]"), [1, 4, 5, 6]);
        assert_eq!(lines("@[3:100]"), [6], "the end is clamped to the row count");
    }

    #[test]
    fn rows_outside_the_slice_are_not_parsed() {
        let f = TempFile::new("half.jsonl", b"{\"input\": \"ok\"}\nnot json\n");
        let d = Dataset::load(&format!("{}@[:1]", f.spec()), &Keys::default()).unwrap();
        assert_eq!(d.len(), 1);
        let e = Dataset::load(&f.spec(), &Keys::default()).unwrap_err().to_string();
        assert!(e.contains("half.jsonl:2: not valid JSON"), "{e}");
    }

    #[test]
    fn a_slice_selecting_no_row_names_the_spec() {
        let f = TempFile::new("gsm.jsonl", GSM.as_bytes());
        for slice in ["@[4:]", "@[2:2]", "@[3:1]", "@[10:20]"] {
            let spec = format!("{}{slice}", f.spec());
            let e = Dataset::load(&spec, &Keys::default()).unwrap_err().to_string();
            assert!(
                e.starts_with(&spec) && e.contains("selects no row") && e.contains("4 rows"),
                "{e}"
            );
        }
    }

    #[test]
    fn an_empty_file_is_an_error() {
        let (e, spec) = load_err(b"\n  \n", &Keys::default());
        assert!(e.starts_with(&spec) && e.contains("no prompt rows"), "{e}");
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let path = std::env::temp_dir().join("miles-data-no-such-file.jsonl");
        let spec = format!("{}@[0:2]", path.display());
        let e = Dataset::load(&spec, &Keys::default()).unwrap_err().to_string();
        assert!(e.contains(&format!("cannot read {}:", path.display())), "{e}");
        assert!(e.contains("check the path"), "{e}");
    }

    #[test]
    fn a_bad_slice_is_refused_before_reading() {
        let e = Dataset::load("nowhere.jsonl@[0:x]", &Keys::default()).unwrap_err().to_string();
        assert!(e.contains("FILE@[a:b]"), "{e}");
    }

    #[test]
    fn invalid_json_names_file_line_and_the_parse_error() {
        let (e, spec) = load_err(b"{\"input\": \"a\"}\n\n{\"input\": \"b\",}\n", &Keys::default());
        assert!(e.starts_with(&format!("{spec}:3: not valid JSON (")), "{e}");
        assert!(e.contains("column") && e.contains("one JSON object"), "{e}");
    }

    #[test]
    fn a_line_that_is_not_an_object_names_file_and_line() {
        let (e, spec) = load_err(b"{\"input\": \"a\"}\n[\"input\"]\n", &Keys::default());
        assert!(e.starts_with(&format!("{spec}:2: expected a JSON object, found an array")), "{e}");
    }

    #[test]
    fn invalid_utf8_names_file_and_line() {
        let (e, spec) = load_err(b"{\"input\": \"a\"}\n{\"input\": \"\xff\"}\n", &Keys::default());
        assert!(e.starts_with(&format!("{spec}:2: not valid UTF-8 (at byte 12")), "{e}");
    }

    #[test]
    fn a_missing_input_key_says_set_input_key_and_lists_the_keys() {
        let (e, spec) = load_err(b"{\"question\": \"a\", \"answer\": 1}\n", &Keys::default());
        assert!(e.starts_with(&format!("{spec}:1: no key 'input' (set --input-key;")), "{e}");
        assert!(e.contains("this line has 'question', 'answer'"), "{e}");
        let (e, _) = load_err(b"{}\n", &Keys::default());
        assert!(e.contains("this line has no key"), "{e}");
    }

    #[test]
    fn a_missing_label_names_label_key() {
        let k = keys("input", Some("answer"), None);
        let (e, spec) = load_err(b"{\"input\": \"a\", \"answer\": 1}\n{\"input\": \"b\"}\n", &k);
        assert!(e.starts_with(&format!("{spec}:2: no key 'answer' (set --label-key;")), "{e}");
        let (e, spec) = load_err(b"{\"input\": \"b\", \"answer\": [1]}\n", &k);
        assert!(e.starts_with(&format!("{spec}:1: label 'answer' must be a string")), "{e}");
        assert!(e.contains("found an array") && e.contains("--label-key"), "{e}");
        let (e, _) = load_err(b"{\"input\": \"b\", \"answer\": null}\n", &k);
        assert!(e.contains("found null"), "{e}");
    }

    #[test]
    fn a_missing_metadata_key_names_metadata_key() {
        let k = keys("input", None, Some("meta"));
        let (e, spec) = load_err(b"{\"input\": \"a\", \"meta\": {}}\n{\"input\": \"b\"}\n", &k);
        assert!(e.starts_with(&format!("{spec}:2: no key 'meta' (set --metadata-key;")), "{e}");
    }

    #[test]
    fn prompts_that_are_neither_text_nor_messages_name_file_and_line() {
        for (row, why) in [
            (r#"{"input": 3}"#, "prompt 'input' is a number"),
            (r#"{"input": null}"#, "prompt 'input' is null"),
            (r#"{"input": {"role": "user"}}"#, "prompt 'input' is an object"),
            (r#"{"input": []}"#, "prompt 'input' is an empty list"),
            (r#"{"input": ["hi"]}"#, "message 0 is a string, not an object"),
            (r#"{"input": [{"role": "user"}]}"#, "message 0 has no string 'content'"),
            (
                r#"{"input": [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]}"#,
                "message 1 has a 'role' that is a number",
            ),
            (
                r#"{"input": [{"role": "user", "content": [{"type": "text"}]}]}"#,
                "message 0 has a 'content' that is an array",
            ),
        ] {
            let (e, spec) = load_err(format!("\n{row}\n").as_bytes(), &Keys::default());
            assert!(e.starts_with(&format!("{spec}:2: ")) && e.contains(why), "{row}: {e}");
            assert!(e.contains("chat messages"), "{e}");
        }
    }

    #[test]
    fn a_prompt_row_roundtrips_through_json() {
        let row = PromptRow {
            prompt: Prompt::Text("q".into()),
            label: Some("4".into()),
            metadata: json!({"k": 1}),
            line: 3,
        };
        let back: PromptRow = serde_json::from_str(&serde_json::to_string(&row).unwrap()).unwrap();
        assert_eq!(back, row);
    }
}
