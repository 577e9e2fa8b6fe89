//! HF chat templates rendered with minijinja the way transformers renders them
//! (`transformers.utils.chat_template_utils`): blocks trimmed (`trim_blocks`, `lstrip_blocks`),
//! Python's string methods, `raise_exception`, `strftime_now`, a `tojson` that writes what
//! Python's `json.dumps` writes (no HTML escaping, `", "` and `": "` separators, `indent`), and
//! `tools` and `documents` defined (none) unless given.

use serde_json::Value;

use crate::{Error, Result};

/// What a template renders: the conversation, the special tokens, and the caller's extra
/// variables (`tools`, `enable_thinking`, `date_string`, …: slime's
/// `--apply-chat-template-kwargs`), a JSON object.
pub struct ChatRequest<'a> {
    pub messages: &'a Value,
    pub add_generation_prompt: bool,
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
    pub kwargs: &'a Value,
}

/// ChatML, the template of the project's own tokenizer (and of Qwen and SmolLM2).
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

/// The steps of minijinja's machine a template may take: real templates take thousands per
/// message, a conversation of thousands of messages fits, an endless loop does not.
const TEMPLATE_FUEL: u64 = 50_000_000;

/// Renders an HF chat template.
pub fn render_chat_template(template: &str, request: &ChatRequest) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // A template comes with a checkpoint, which may be hostile or broken: a loop that does
    // not end is an error, not a hang.
    env.set_fuel(Some(TEMPLATE_FUEL));
    // HF templates call Python string methods (.strip(), .startswith(), …).
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |format: String| strftime(&format, unix_now()));
    env.add_filter("tojson", tojson);
    env.add_template("chat", template)
        .map_err(|e| Error::Invalid(format!("chat template does not parse: {e}")))?;
    let mut ctx = serde_json::Map::new();
    ctx.insert("messages".into(), request.messages.clone());
    ctx.insert("tools".into(), Value::Null);
    ctx.insert("documents".into(), Value::Null);
    ctx.insert("add_generation_prompt".into(), Value::Bool(request.add_generation_prompt));
    ctx.insert("bos_token".into(), request.bos_token.unwrap_or("").into());
    ctx.insert("eos_token".into(), request.eos_token.unwrap_or("").into());
    match request.kwargs {
        Value::Object(extra) => ctx.extend(extra.clone()),
        Value::Null => {}
        other => {
            return Err(Error::Invalid(format!(
                "chat template arguments must be a JSON object, found {other}"
            )));
        }
    }
    env.get_template("chat")
        .and_then(|t| t.render(minijinja::Value::from_serialize(&ctx)))
        .map_err(|e| Error::Invalid(format!("chat template failed: {e}")))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}"))
    })?;
    // Python's defaults: ", " between items, or "," when indenting; ": " after keys.
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(other) => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("tojson: separators must be two strings, found {other:?}"),
            ));
        }
        None => ((if indent.is_some() { "," } else { ", " }).into(), ": ".into()),
    };
    let style = PyJson { indent, item, key, sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    // Marked safe: the text goes out as written.
    Ok(minijinja::Value::from_safe_string(out))
}

/// Python's `json.dumps` layout.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, v: &Value, level: usize, out: &mut String) {
        match v {
            Value::Array(items) if !items.is_empty() => {
                self.open('[', level, out);
                for (i, x) in items.iter().enumerate() {
                    self.separate(i, level, out);
                    self.write(x, level + 1, out);
                }
                self.close(']', level, out);
            }
            Value::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.open('{', level, out);
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.separate(i, level, out);
                    out.push_str(&serde_json::to_string(k).expect("a string serializes"));
                    out.push_str(&self.key);
                    self.write(x, level + 1, out);
                }
                self.close('}', level, out);
            }
            // Scalars, `[]` and `{}` as serde_json writes them (strings escaped as Python's
            // ensure_ascii=False does: quotes, backslashes and control characters only).
            other => out.push_str(&serde_json::to_string(other).expect("json serializes")),
        }
    }

    fn open(&self, bracket: char, level: usize, out: &mut String) {
        out.push(bracket);
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * (level + 1)));
        }
    }

    fn separate(&self, i: usize, level: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * (level + 1)));
            }
        }
    }

    fn close(&self, bracket: char, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
        out.push(bracket);
    }
}

fn unix_now() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| d.as_secs() as i64)
}

/// `datetime.now().strftime(format)` (UTC) for the directives templates use: %d %m %Y %y %b
/// %B %a %A %H %M %S %j %%; any other is kept as written.
fn strftime(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] =
        ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(template: &str, messages: &Value, generation: bool, bos: &str) -> Result<String> {
        let request = ChatRequest {
            messages,
            add_generation_prompt: generation,
            bos_token: Some(bos),
            eos_token: None,
            kwargs: &Value::Null,
        };
        render_chat_template(template, &request)
    }

    #[test]
    fn hf_style_templates_with_python_methods_render() {
        let template = "{%- if messages[0]['role'] == 'system' %}{{ bos_token + messages[0]['content'].strip() }}{%- endif %}{%- for m in messages[1:] %}{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}[{{ m['role'] }}]{{ m['content'] | trim }}{% if loop.last and add_generation_prompt %}[assistant]{% endif %}{%- endfor %}";
        let messages = json!([{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": " 2+2? "}]);
        let out = render(template, &messages, true, "<s>").unwrap();
        assert_eq!(out, "<s>Be brief.[user]2+2?[assistant]");
        // Jinja's trim_blocks and lstrip_blocks, as transformers sets them.
        let blocks = render("  {% if true %}\nA\n  {% endif %}\nB", &messages, true, "").unwrap();
        assert_eq!(blocks, "A\nB");
        let bad = json!([{"role": "system", "content": "x"}, {"role": "tool", "content": "y"}]);
        let err = render(template, &bad, false, "").unwrap_err().to_string();
        assert!(err.contains("bad role"), "{err}");
    }

    /// A template that never ends (a checkpoint's, hostile or broken) is an error within its
    /// budget of steps, not a hang; a long real conversation still fits.
    #[test]
    fn an_endless_template_is_an_error_and_a_long_conversation_is_not() {
        let endless =
            "{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}";
        let err = render(endless, &json!([]), false, "").unwrap_err().to_string();
        assert!(err.contains("chat template failed"), "{err}");
        let long: Vec<Value> =
            (0..5000).map(|i| json!({"role": "user", "content": format!("turn {i}")})).collect();
        let out = render(CHATML_TEMPLATE, &Value::Array(long), true, "").unwrap();
        assert!(out.ends_with("<|im_start|>assistant\n"));
    }

    /// The families' own templates (tests/fixtures/chat_templates, from their
    /// tokenizer_config.json) give transformers' text for every case its fixture script
    /// rendered, and raise where transformers raised.
    #[test]
    fn family_templates_render_as_transformers_does() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/chat_templates");
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let cases = expected["cases"].as_array().unwrap();
        assert!(cases.len() >= 30, "{} cases", cases.len());
        for case in cases {
            let name = case["template"].as_str().unwrap();
            let template = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
            let mut kwargs = case["kwargs"].clone();
            if !case["tools"].is_null() {
                kwargs["tools"] = case["tools"].clone();
            }
            let request = ChatRequest {
                messages: &case["messages"],
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                bos_token: case["bos_token"].as_str(),
                eos_token: case["eos_token"].as_str(),
                kwargs: &kwargs,
            };
            let what = format!("{name} {}", case["case"]);
            match (render_chat_template(&template, &request), case["error"].as_str()) {
                (Ok(text), None) => assert_eq!(text, case["text"].as_str().unwrap(), "{what}"),
                (Err(e), Some(want)) => assert!(e.to_string().contains(want), "{what}: {e}"),
                (got, want) => panic!("{what}: rendered {got:?}, transformers {want:?}"),
            }
        }
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=[',', ':'], sort_keys=true) }}";
        let x = json!({"z": "<a & 'b'>\n", "a": [1, 2.5, null], "e": {}, "l": []});
        let request = ChatRequest {
            messages: &json!([]),
            add_generation_prompt: false,
            bos_token: None,
            eos_token: None,
            kwargs: &json!({"x": x}),
        };
        let out = render_chat_template(t, &request).unwrap();
        // Python: json.dumps(x, ensure_ascii=False, ...) with each argument set.
        let want = [
            r#"{"z": "<a & 'b'>\n", "a": [1, 2.5, null], "e": {}, "l": []}"#,
            "{\n  \"z\": \"<a & 'b'>\\n\",\n  \"a\": [\n    1,\n    2.5,\n    null\n  ],\n  \"e\": {},\n  \"l\": []\n}",
            r#"{"a":[1,2.5,null],"e":{},"l":[],"z":"<a & 'b'>\n"}"#,
        ];
        assert_eq!(out, want.join("|"));
    }

    #[test]
    fn strftime_formats_the_dates_templates_ask_for() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %B %d, %y %H:%M:%S %j %%", t), "Friday July 26, 24 13:05:09 208 %");
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(civil_from_days(days_from_civil(2000, 2, 29)), (2000, 2, 29));
    }
}
