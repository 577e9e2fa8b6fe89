//! `dapo`: DAPO's rule-based math reward (the Minerva-style check of DAPO-Math-17k): the answer
//! is what follows the last `Answer:` in the tail of the response, normalized the way DAPO
//! normalizes final answers, against an integer label; +1 when right, −1 when wrong.

use miles_core::{
    Error, Factory, Plugin, PluginConfig, Registration, Reward, RewardError, RewardValue, Sample,
};

use crate::latex;

pub static PLUGIN: Plugin = Plugin {
    name: "dapo",
    version: env!("CARGO_PKG_VERSION"),
    description: "DAPO-Math: +1 if the last `Answer:` of the response's last 300 characters, \
                  normalized as DAPO does, equals the integer label, else -1",
    factory: Factory::Reward(|config| Ok(Box::new(Dapo::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// DAPO's reward. Only the last 300 (`TAIL_CHARS`) characters of the response are read (DAPO's
/// bound: the longest MATH-500 answer has 159 characters).
///
/// Default mode: the answer is the rest of the line after the last `Answer:` (any case,
/// whitespace allowed around the colon, even a line break after it); no such line reads as
/// `[INVALID]`. Both it and the label go through [`normalize_final_answer`]; the label is then
/// read as a number and truncated to an integer (`"34"`, `"34.0"` → `34`, DAPO's labels are all
/// integers) and the two texts compared. A label that is not a number (DAPO itself would raise)
/// is compared as normalized text instead.
///
/// `strict_box` mode (config `{"strict_box": true}`): the content of the last `\boxed{…}` in
/// the last 100 of those characters must equal the label exactly, with no normalization.
#[derive(Debug, Clone, Copy, Default)]
pub struct Dapo {
    pub strict_box: bool,
}

/// How much of the end of a response DAPO reads.
pub const TAIL_CHARS: usize = 300;
/// How much of that tail the strict-box mode reads.
pub const STRICT_BOX_TAIL_CHARS: usize = 100;

impl Dapo {
    pub fn from_config(config: &PluginConfig) -> miles_core::Result<Dapo> {
        let strict_box = match config.get("strict_box") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => {
                return Err(Error::config(
                    "custom-rm-config",
                    format!("dapo: strict_box must be true or false, got {other}"),
                ));
            }
        };
        Ok(Dapo { strict_box })
    }

    /// Whether `response` answers `label` correctly under DAPO's rule.
    pub fn is_correct(&self, response: &str, label: &str) -> bool {
        let solution = tail_chars(response, TAIL_CHARS);
        if self.strict_box {
            let tail = tail_chars(solution, STRICT_BOX_TAIL_CHARS);
            // DAPO looks at the last `\boxed{` only; if it does not close there is no answer.
            let boxed = tail.rfind("\\boxed{").and_then(|at| latex::boxed_at(tail, at));
            return boxed == Some(label);
        }
        let predicted = normalize_final_answer(last_answer_line(solution).unwrap_or("[INVALID]"));
        let reference = normalize_final_answer(label);
        let reference = match python_float(&reference) {
            Some(x) if x.is_finite() => integer_text(x),
            _ => reference,
        };
        predicted == reference
    }
}

impl Reward for Dapo {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        let label = crate::require_label(sample, "dapo")?;
        let correct = self.is_correct(&sample.response, label);
        Ok(RewardValue::Scalar(if correct { 1.0 } else { -1.0 }))
    }
}

/// The last `n` characters (not bytes) of `s`.
fn tail_chars(s: &str, n: usize) -> &str {
    match s.char_indices().rev().nth(n.saturating_sub(1)) {
        Some((at, _)) if n > 0 => &s[at..],
        _ if n == 0 => "",
        _ => s,
    }
}

/// What the last match of `Answer\s*:\s*([^\n]+)` (case-insensitive, matches taken left to right
/// without overlap) captures: the rest of the line after `Answer:`, where the whitespace after the
/// colon may span line breaks.
pub fn last_answer_line(text: &str) -> Option<&str> {
    const KEYWORD: &str = "answer";
    let mut last = None;
    let mut pos = 0;
    while let Some(found) = find_ascii_case_insensitive(&text[pos..], KEYWORD) {
        let at = pos + found;
        let after_keyword = skip_whitespace(text, at + KEYWORD.len());
        if text[after_keyword..].starts_with(':') {
            let value_from = after_keyword + 1;
            let value_at = skip_whitespace(text, value_from);
            let capture = if value_at < text.len() {
                Some(value_at..line_end(text, value_at))
            } else {
                // Nothing but whitespace to the end: the regex backtracks into that whitespace
                // and captures its last character that is not a line break.
                text[value_from..]
                    .char_indices()
                    .rev()
                    .find(|&(_, c)| c != '\n')
                    .map(|(i, c)| value_from + i..value_from + i + c.len_utf8())
            };
            if let Some(range) = capture {
                pos = range.end;
                last = Some(&text[range]);
                continue;
            }
        }
        pos = at + 1;
    }
    last
}

fn find_ascii_case_insensitive(haystack: &str, needle: &str) -> Option<usize> {
    let (h, n) = (haystack.as_bytes(), needle.as_bytes());
    (0..=h.len().checked_sub(n.len())?).find(|&i| h[i..i + n.len()].eq_ignore_ascii_case(n))
}

fn skip_whitespace(text: &str, from: usize) -> usize {
    text[from..].find(|c: char| !c.is_whitespace()).map_or(text.len(), |i| from + i)
}

fn line_end(text: &str, from: usize) -> usize {
    text[from..].find('\n').map_or(text.len(), |i| from + i)
}

/// Replacements DAPO applies first, in order (plain text, not patterns).
const SUBSTITUTIONS: [(&str, &str); 10] = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

/// Text DAPO deletes next, in order: units and filler words, spacing commands, degree marks.
const REMOVED: [&str; 43] = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
    "<|im_end|>",
    "<|endoftext|>",
];

/// DAPO's normalization of a final answer (from lm-eval-harness's Minerva math): keep what
/// follows the last `=`; apply its text substitutions (`an `, `a `, spaces, `mbox` → `text`, …)
/// and delete its list of units, filler words and spacing commands; keep only the first `$…$`
/// span of a line; unwrap `\text{}`, `\textbf{}`, `\overline{}` (up to the first `}`) and
/// `\boxed{}` (up to the line's last `}`); brace `frac12`/`sqrt2` shorthand; drop `$`; drop the
/// commas of a comma-grouped integer; trim.
pub fn normalize_final_answer(answer: &str) -> String {
    let mut s = answer.rsplit('=').next().unwrap_or("").to_string();
    for (from, to) in SUBSTITUTIONS {
        s = s.replace(from, to);
    }
    for text in REMOVED {
        s = s.replace(text, "");
    }
    s = s.split('\n').map(first_dollar_span).collect::<Vec<_>>().join("\n");
    for command in ["\\text{", "\\textbf{", "\\overline{"] {
        s = unwrap_to_first_close(&s, command);
    }
    s = s.split('\n').map(unwrap_boxed_greedy).collect::<Vec<_>>().join("\n");
    s = brace_one_char_args(&s, "frac", 2);
    s = brace_one_char_args(&s, "sqrt", 1);
    s.retain(|c| c != '$');
    let without_commas: String = s.chars().filter(|&c| c != ',').collect();
    if !without_commas.is_empty() && without_commas.chars().all(|c| c.is_ascii_digit()) {
        s = without_commas;
    }
    s.trim().to_string()
}

/// A line holding two `$` becomes `$` + the text between its first two `$` + `$`.
fn first_dollar_span(line: &str) -> String {
    let mut parts = line.splitn(3, '$');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(_), Some(inner), Some(_)) => format!("${inner}$"),
        _ => line.to_string(),
    }
}

/// `command` + text + `}` → text, the text ending at the first `}` on the same line.
fn unwrap_to_first_close(s: &str, command: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(command) {
        let inner_from = at + command.len();
        let line = &rest[inner_from..line_end(rest, inner_from)];
        match line.find('}') {
            Some(close) => {
                out.push_str(&rest[..at]);
                out.push_str(&line[..close]);
                rest = &rest[inner_from + close + 1..];
            }
            None => {
                // No match here; the scan resumes one character later.
                let next = at + rest[at..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&rest[..next]);
                rest = &rest[next..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// In one line, from the first `\boxed{` to the line's last `}` → the text between.
fn unwrap_boxed_greedy(line: &str) -> String {
    const OPEN: &str = "\\boxed{";
    if let Some(at) = line.find(OPEN)
        && let Some(close) = line.rfind('}').filter(|&c| c >= at + OPEN.len())
    {
        return format!("{}{}{}", &line[..at], &line[at + OPEN.len()..close], &line[close + 1..]);
    }
    line.to_string()
}

/// `frac` + two characters (the first not `{`) → `frac{a}{b}`; `sqrt` + one character (not `{`)
/// → `sqrt{a}`. Like the regex it mirrors, the first character may be any but `{` (a line
/// break included) and the second any but a line break.
fn brace_one_char_args(s: &str, word: &str, args: usize) -> String {
    let chars: Vec<char> = s.chars().collect();
    let word: Vec<char> = word.chars().collect();
    let mut out = String::with_capacity(s.len() + 8);
    let mut i = 0;
    while i < chars.len() {
        let fits = chars[i..].starts_with(&word)
            && chars.get(i + word.len()).is_some_and(|&c| c != '{')
            && (args == 1 || chars.get(i + word.len() + 1).is_some_and(|&c| c != '\n'));
        if fits {
            out.extend(&word);
            for &c in &chars[i + word.len()..i + word.len() + args] {
                out.push('{');
                out.push(c);
                out.push('}');
            }
            i += word.len() + args;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

/// Python's `float(text)` for the forms that matter here: surrounding whitespace, a sign,
/// decimals, exponents, `inf`/`nan`.
fn python_float(text: &str) -> Option<f64> {
    text.trim().parse::<f64>().ok()
}

/// `str(int(x))`: truncated toward zero, every digit of the double written out.
fn integer_text(x: f64) -> String {
    let t = x.trunc();
    if t == 0.0 { "0".to_string() } else { format!("{t:.0}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(dapo: Dapo, response: &str, label: &str) -> f64 {
        let sample =
            Sample { response: response.into(), label: Some(label.into()), ..Default::default() };
        match dapo.score(&sample).unwrap() {
            RewardValue::Scalar(v) => v,
            other => panic!("dapo returned {other:?}"),
        }
    }

    const PLAIN: Dapo = Dapo { strict_box: false };
    const STRICT: Dapo = Dapo { strict_box: true };

    #[test]
    fn the_last_answer_line_counts_and_scores_plus_or_minus_one() {
        assert_eq!(score(PLAIN, "work...\nAnswer: 34", "34"), 1.0);
        assert_eq!(score(PLAIN, "Answer: 12\nno wait\nAnswer: 34", "34"), 1.0);
        assert_eq!(score(PLAIN, "Answer: 34\nno wait\nAnswer: 12", "34"), -1.0);
        assert_eq!(score(PLAIN, "final answer : 34", "34"), 1.0);
        assert_eq!(score(PLAIN, "ANSWER:\n\n34", "34"), 1.0);
        assert_eq!(score(PLAIN, "The result is 34.", "34"), -1.0);
        assert_eq!(score(PLAIN, "", "34"), -1.0);
    }

    #[test]
    fn labels_are_read_as_integers() {
        assert_eq!(score(PLAIN, "Answer: 34", "34.0"), 1.0);
        assert_eq!(score(PLAIN, "Answer: -7", "-7"), 1.0);
        assert_eq!(score(PLAIN, "Answer: 1000", "1,000"), 1.0);
        assert_eq!(score(PLAIN, "Answer: 1,000", "1000"), 1.0);
        // DAPO truncates the label: 2.5 is read as 2 (its labels are integers).
        assert_eq!(score(PLAIN, "Answer: 2", "2.5"), 1.0);
        // The prediction is not read as a number: 34.0 is not 34.
        assert_eq!(score(PLAIN, "Answer: 34.0", "34"), -1.0);
        // A label that is not a number is compared as normalized text.
        assert_eq!(score(PLAIN, "Answer: \\frac{1}{2}", "\\frac{1}{2}"), 1.0);
        assert_eq!(integer_text(-0.4), "0");
        assert_eq!(integer_text(1.2345678901234567e19), "12345678901234567168");
    }

    #[test]
    fn normalization_follows_dapo() {
        assert_eq!(normalize_final_answer("x = 5"), "5");
        assert_eq!(normalize_final_answer("$34$."), "34");
        assert_eq!(normalize_final_answer("\\boxed{34}"), "34");
        assert_eq!(normalize_final_answer("The answer is $\\boxed{34}$ dollars"), "34");
        assert_eq!(normalize_final_answer("12 square units"), "12");
        assert_eq!(normalize_final_answer("\\text{(A)}"), "(A)");
        assert_eq!(normalize_final_answer("\\frac12"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("\\sqrt3"), "\\sqrt{3}");
        assert_eq!(normalize_final_answer("90^\\circ"), "90");
        assert_eq!(normalize_final_answer("1,234,567"), "1234567");
        assert_eq!(normalize_final_answer("(1, 2)"), "(1,2)");
        assert_eq!(normalize_final_answer("34<|im_end|>"), "34");
    }

    #[test]
    fn only_the_last_300_characters_are_read() {
        let early = format!("Answer: 34\n{}", "x".repeat(TAIL_CHARS));
        assert_eq!(score(PLAIN, &early, "34"), -1.0);
        let late = format!("{}\nAnswer: 34", "é".repeat(1000));
        assert_eq!(score(PLAIN, &late, "34"), 1.0);
        assert_eq!(tail_chars("héllo", 3), "llo");
        assert_eq!(tail_chars("hé", 3), "hé");
        assert_eq!(tail_chars("hé", 0), "");
    }

    #[test]
    fn strict_box_mode_compares_the_last_box_exactly() {
        assert_eq!(score(STRICT, "so \\boxed{34}", "34"), 1.0);
        assert_eq!(score(STRICT, "so \\boxed{34.0}", "34"), -1.0);
        assert_eq!(score(STRICT, "Answer: 34", "34"), -1.0);
        let far = format!("\\boxed{{34}}{}", " ".repeat(STRICT_BOX_TAIL_CHARS));
        assert_eq!(score(STRICT, &far, "34"), -1.0);
        let dapo = Dapo::from_config(&serde_json::json!({"strict_box": true})).unwrap();
        assert!(dapo.strict_box);
        let err = Dapo::from_config(&serde_json::json!({"strict_box": "yes"})).unwrap_err();
        assert!(err.to_string().contains("strict_box"), "{err}");
    }

    #[test]
    fn missing_label_is_an_error_naming_the_reward() {
        let err = PLAIN.score(&Sample::default()).unwrap_err().to_string();
        assert!(err.contains("dapo") && err.contains("no label"), "{err}");
    }
}
