//! `math`: the final answer of a worked solution against a reference answer, compared after a
//! careful string normalization and, for numbers, exactly as rationals.

use miles_core::{Factory, Plugin, Registration, Reward, RewardError, RewardValue, Sample};

use crate::latex::{self, parse_number};

pub static PLUGIN: Plugin = Plugin {
    name: "math",
    version: env!("CARGO_PKG_VERSION"),
    description: "1 if the final answer (last \\boxed{}, else after ####, else the last number) \
                  equals the label after normalization (numbers compared exactly), else 0",
    factory: Factory::Reward(|_config| Ok(Box::new(MathAnswer))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// 1.0 when the response's final answer equals the label's, 0.0 otherwise (also when the
/// response has no answer at all).
///
/// The response's answer is the last `\boxed{…}`/`\fbox{…}`, else the line after the last
/// `####`, else the last number in the text. The label is used whole unless it holds a box or a
/// `####` (a GSM8K solution), in which case the answer is taken from it the same way.
#[derive(Debug, Clone, Copy, Default)]
pub struct MathAnswer;

impl Reward for MathAnswer {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        let label = crate::require_label(sample, "math")?;
        let hit = extract_response_answer(&sample.response)
            .is_some_and(|given| answers_match(&given, &label_answer(label)));
        Ok(RewardValue::Scalar(if hit { 1.0 } else { 0.0 }))
    }
}

/// The final answer a response commits to, unnormalized.
pub fn extract_response_answer(response: &str) -> Option<String> {
    if let Some(boxed) = latex::last_boxed(response) {
        return Some(boxed.to_string());
    }
    if let Some(answer) = after_last_hashes(response) {
        return Some(answer.to_string());
    }
    last_number(response).map(str::to_string)
}

/// The reference answer inside a label: a box's content, the text after `####`, or the label.
pub fn label_answer(label: &str) -> String {
    latex::last_boxed(label).or_else(|| after_last_hashes(label)).unwrap_or(label).to_string()
}

/// The rest of the line after the last `####` (GSM8K's answer marker), if not empty.
fn after_last_hashes(text: &str) -> Option<&str> {
    let at = text.rfind("####")?;
    let answer = text[at + 4..].lines().next().unwrap_or("").trim();
    (!answer.is_empty()).then_some(answer)
}

/// The last number in the text: an optional minus sign (ASCII or `−`) not glued to a preceding
/// word or number, digits with well-formed thousands groups (`1,234`), an optional decimal part,
/// and an optional `/denominator`. A sentence's full stop after it is not part of it.
pub fn last_number(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let digits_from = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        i
    };
    let mut last = None;
    let mut i = 0;
    while i < bytes.len() {
        if !bytes[i].is_ascii_digit() || (i > 0 && bytes[i - 1].is_ascii_alphanumeric()) {
            i += 1;
            continue;
        }
        let mut start = i;
        let mut end = digits_from(i);
        // Thousands groups: a comma and exactly three digits, not followed by a fourth.
        while bytes.get(end) == Some(&b',') && digits_from(end + 1) == end + 4 {
            end += 4;
        }
        if bytes.get(end) == Some(&b'.') && digits_from(end + 1) > end + 1 {
            end = digits_from(end + 1);
        }
        if bytes.get(end) == Some(&b'/') && digits_from(end + 1) > end + 1 {
            end = digits_from(end + 1);
        }
        let before = &text[..start];
        let sign = ['-', '−'].into_iter().find(|&c| before.ends_with(c));
        if let Some(sign) = sign {
            let sign_at = start - sign.len_utf8();
            let glued = text[..sign_at].chars().next_back().is_some_and(char::is_alphanumeric);
            if !glued {
                start = sign_at;
            }
        }
        last = Some(&text[start..end]);
        i = end;
    }
    last
}

/// Whether two answers agree: equal as exact numbers when both are numbers, else equal as
/// normalized text. An empty answer never matches.
pub fn answers_match(given: &str, reference: &str) -> bool {
    let (given, reference) = (normalize_answer(given), normalize_answer(reference));
    if given.is_empty() || reference.is_empty() {
        return false;
    }
    match (parse_number(&given), parse_number(&reference)) {
        (Some(a), Some(b)) => a == b,
        _ => given == reference,
    }
}

/// Rewrites an answer into a canonical text: no `$`, no `\text{}` wrapper (a `\text{ unit}`
/// after the value is dropped), no LaTeX spacing (`\!`, `\,`, …) or whitespace, no trailing
/// full stop, no `%`/`\%`/degrees, `\dfrac`/`\tfrac` → `\frac`, no `\left`/`\right`, unicode
/// minus → `-`, `1,000` → `1000`, a short `x = ` prefix dropped, one-character `\frac12`
/// arguments braced, and braces around the whole answer removed.
pub fn normalize_answer(answer: &str) -> String {
    let mut s = answer.trim().replace('−', "-");
    for (from, to) in [
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", ""),
        ("{,}", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\mbox{", "\\text{"),
        ("\\textbf{", "\\text{"),
        ("\\mathrm{", "\\text{"),
    ] {
        s = s.replace(from, to);
    }
    // `5\text{ cm}`: in MATH a \text{ starting with a space after the value is a unit.
    let unit_at = s.find("\\text{ ").filter(|&at| !s[..at].trim().is_empty());
    if let Some(at) = unit_at
        && let Some(close) = latex::matching_brace(&s, at + 5)
    {
        s.replace_range(at..=close, "");
    }
    s = latex::map_command_arg(&s, "\\text", str::to_string);
    for unit in ["\\%", "%", "^{\\circ}", "^\\circ", "°"] {
        s = s.replace(unit, "");
    }
    s.retain(|c| !c.is_whitespace());
    while let Some(stripped) = s.strip_suffix('.') {
        s.truncate(stripped.len());
    }
    while s.starts_with('{') && latex::matching_brace(&s, 0) == Some(s.len() - 1) {
        s = s[1..s.len() - 1].to_string();
    }
    if let Some((lhs, rhs)) = s.split_once('=')
        && !rhs.contains('=')
        && lhs.chars().count() <= 2
    {
        s = rhs.to_string();
    }
    if latex::is_thousands_grouped(&s) {
        s.retain(|c| c != ',');
    }
    latex::brace_sqrt_shorthand(&latex::brace_frac_shorthand(&s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(response: &str, label: &str) -> f64 {
        let sample =
            Sample { response: response.into(), label: Some(label.into()), ..Default::default() };
        match MathAnswer.score(&sample).unwrap() {
            RewardValue::Scalar(v) => v,
            other => panic!("math returned {other:?}"),
        }
    }

    #[test]
    fn boxed_answers_with_nested_braces_compare_as_numbers() {
        assert_eq!(score("so the answer is \\boxed{\\frac{1}{2}}.", "0.5"), 1.0);
        assert_eq!(score("\\boxed{\\dfrac{1}{2}}", "1/2"), 1.0);
        assert_eq!(score("\\boxed{\\frac12}", "\\frac{1}{2}"), 1.0);
        assert_eq!(score("\\boxed{\\frac{2}{4}}", "1/2"), 1.0);
        assert_eq!(score("\\fbox{7}", "7"), 1.0);
        assert_eq!(score("first \\boxed{3}, finally \\boxed{4}", "4"), 1.0);
        assert_eq!(score("first \\boxed{3}, finally \\boxed{4}", "3"), 0.0);
        assert_eq!(score("\\boxed{\\frac{1}{3}}", "0.333"), 0.0);
    }

    #[test]
    fn gsm8k_labels_use_the_text_after_the_hashes() {
        let label = "Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72";
        assert_eq!(score("She sold 72 clips in total.", label), 1.0);
        assert_eq!(score("#### 72", label), 1.0);
        assert_eq!(score("The answer is \\boxed{72}", label), 1.0);
        assert_eq!(score("The answer is 71.", label), 0.0);
        // The response's own `####` line wins over later numbers.
        assert_eq!(score("#### 72\nchecked with 3 methods", label), 1.0);
    }

    #[test]
    fn thousands_separators_and_decimals_normalize() {
        assert_eq!(score("It costs $1,000.", "1000"), 1.0);
        assert_eq!(score("\\boxed{1{,}000}", "1000"), 1.0);
        assert_eq!(score("\\boxed{1\\,000\\,000}", "#### 1,000,000"), 1.0);
        assert_eq!(score("\\boxed{2.0}", "2"), 1.0);
        assert_eq!(score("\\boxed{2.50}", "\\frac{5}{2}"), 1.0);
        assert_eq!(score("\\boxed{12,5}", "125"), 0.0);
    }

    #[test]
    fn negative_numbers_match_whichever_minus_is_used() {
        assert_eq!(score("\\boxed{-3}", "−3"), 1.0);
        assert_eq!(score("the result is −3", "-3"), 1.0);
        assert_eq!(score("the result is -3.", "-3"), 1.0);
        assert_eq!(score("from 5-3 we get 2", "2"), 1.0);
        assert_eq!(score("x-3", "-3"), 0.0);
        assert_eq!(score("\\boxed{-\\frac{1}{2}}", "-0.5"), 1.0);
        assert_eq!(score("\\boxed{3}", "-3"), 0.0);
    }

    #[test]
    fn units_text_dollars_and_percent_are_stripped() {
        assert_eq!(score("\\boxed{\\$18}", "18"), 1.0);
        assert_eq!(score("\\boxed{50\\%}", "50"), 1.0);
        assert_eq!(score("\\boxed{50%}", "50"), 1.0);
        assert_eq!(score("\\boxed{90^\\circ}", "90"), 1.0);
        assert_eq!(score("\\boxed{5\\text{ cm}}", "5"), 1.0);
        assert_eq!(score("\\boxed{\\text{Monday}}", "Monday"), 1.0);
        assert_eq!(score("\\boxed{x = 4}", "4"), 1.0);
        assert_eq!(score("$\\boxed{3\\!\\sqrt{2}}$", "3\\sqrt2"), 1.0);
        assert_eq!(score("\\boxed{(1, 2)}", "(1,2)"), 1.0);
        assert_eq!(score("\\boxed{\\left( 1,2 \\right)}", "(1,2)"), 1.0);
        assert_eq!(score("\\boxed{\\text{(B)}}", "(C)"), 0.0);
    }

    #[test]
    fn a_response_without_an_answer_scores_zero() {
        assert_eq!(score("I do not know.", "42"), 0.0);
        assert_eq!(score("", "42"), 0.0);
        assert_eq!(score("\\boxed{}", "42"), 0.0);
        assert_eq!(score("####", "42"), 0.0);
        // An empty label matches nothing, not even an empty answer.
        assert_eq!(score("\\boxed{}", ""), 0.0);
    }

    #[test]
    fn fractions_written_with_a_slash_are_found_as_last_numbers() {
        assert_eq!(last_number("about 3/4 of them"), Some("3/4"));
        assert_eq!(last_number("1,234,567 and 89"), Some("89"));
        assert_eq!(last_number("total 1,234,567."), Some("1,234,567"));
        assert_eq!(last_number("pi is 3.14."), Some("3.14"));
        assert_eq!(last_number("v2 beta"), None);
        assert_eq!(score("about 3/4 of them", "0.75"), 1.0);
    }

    #[test]
    fn missing_label_is_an_error_naming_the_reward() {
        let err = MathAnswer.score(&Sample { response: "1".into(), ..Default::default() });
        let err = err.unwrap_err().to_string();
        assert!(err.contains("math") && err.contains("no label"), "{err}");
    }
}
