//! `deepscaler`: DeepScaleR's rule-based reward for thinking models. Only the text after the
//! last `</think>` counts; its last `\boxed{}` is graded against the label with Hendrycks'
//! MATH normalization, or else with a numeric equivalence check.
//!
//! DeepScaleR's second check asks sympy whether the difference of the two answers simplifies to
//! zero. There is no sympy here: after DeepScaleR's answer normalization, elements of the two
//! answers (tuples and intervals are compared element by element) are equal when their texts are
//! equal or when both are numbers with the same exact rational value. Symbolic equivalences
//! such as `\sqrt{8}` = `2\sqrt{2}` are therefore not recognised.

use miles_core::{
    Error, Factory, Plugin, PluginConfig, Registration, Reward, RewardError, RewardValue, Sample,
};

use crate::latex::{self, parse_number};

pub static PLUGIN: Plugin = Plugin {
    name: "deepscaler",
    version: env!("CARGO_PKG_VERSION"),
    description: "DeepScaleR: 1 if the last \\boxed{} after </think> matches the label \
                  (MATH normalization or exact numeric equality), else 0; no </think> scores 0",
    factory: Factory::Reward(|config| Ok(Box::new(DeepScaler::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// DeepScaleR's reward: 1.0 correct, 0.0 otherwise.
///
/// The solution is the text after the last `</think>`; without one, the text after the first
/// `###Response` (up to a second one); without either the response scores 0, because a
/// thinking model that never closed its thoughts gave no answer. Config
/// `{"require_think": false}` scores the whole response instead in that case.
///
/// The answer is the last `\boxed{…}` of the solution (none → 0). A label holding a `\boxed{}`
/// or `\fbox{}` is reduced to its content; an empty label scores 0.
#[derive(Debug, Clone, Copy)]
pub struct DeepScaler {
    pub require_think: bool,
}

impl Default for DeepScaler {
    fn default() -> Self {
        DeepScaler { require_think: true }
    }
}

impl DeepScaler {
    pub fn from_config(config: &PluginConfig) -> miles_core::Result<DeepScaler> {
        let require_think = match config.get("require_think") {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => {
                return Err(Error::config(
                    "custom-rm-config",
                    format!("deepscaler: require_think must be true or false, got {other}"),
                ));
            }
        };
        Ok(DeepScaler { require_think })
    }

    /// The part of the response that holds the answer, if any.
    pub fn solution<'a>(&self, response: &'a str) -> Option<&'a str> {
        if let Some((_, after)) = response.rsplit_once("</think>") {
            return Some(after);
        }
        if let Some((_, after)) = response.split_once("###Response") {
            return Some(after.split("###Response").next().unwrap_or(after));
        }
        (!self.require_think).then_some(response)
    }

    pub fn is_correct(&self, response: &str, label: &str) -> bool {
        let Some(answer) = self.solution(response).and_then(last_boxed_strict) else {
            return false;
        };
        if label.is_empty() {
            return false;
        }
        let reference = if label.contains("\\boxed") || label.contains("\\fbox") {
            match latex::last_boxed(label) {
                Some(inner) => inner,
                None => return false,
            }
        } else {
            label
        };
        grade_mathd(answer, reference) || grade_numeric(answer, reference)
    }
}

impl Reward for DeepScaler {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        let label = crate::require_label(sample, "deepscaler")?;
        let correct = self.is_correct(&sample.response, label);
        Ok(RewardValue::Scalar(if correct { 1.0 } else { 0.0 }))
    }
}

/// DeepScaleR's extraction: the last `\boxed` of the text must be `\boxed{…}` and close; a bare
/// `\boxed 5` or a cut-off `\boxed{5` after an earlier box means no answer.
fn last_boxed_strict(text: &str) -> Option<&str> {
    let at = text.rfind("\\boxed")?;
    latex::boxed_at(text, at)
}

/// Hendrycks' MATH check: equal after [`mathd_normalize`].
pub fn grade_mathd(given: &str, reference: &str) -> bool {
    mathd_normalize(given) == mathd_normalize(reference)
}

/// `\text{X}` around the whole answer → `X`.
fn unwrap_whole_text(s: &str) -> Option<&str> {
    let inner = s.strip_prefix("\\text{")?.strip_suffix('}')?;
    (!inner.is_empty() && !inner.contains('\n')).then_some(inner)
}

/// Hendrycks' MATH answer normalization (`mathd_normalize_answer`): trims, unwraps a whole
/// `\text{}`, then strips line breaks, `\!`, `\left`/`\right`, degrees, `\$`, a trailing
/// `\text{ unit}`, `\%`; writes `0.` for a leading `.`; drops a short `k =` prefix; braces
/// `\sqrt3` and `\frac12`; removes spaces; `0.5` → `\frac{1}{2}` and `a/b` → `\frac{a}{b}` for
/// integers. Where the original would fail (an ill-formed `\sqrt`/`\frac`), the answer is kept
/// as it was after the unwrapping.
pub fn mathd_normalize(answer: &str) -> String {
    let mut answer = answer.trim();
    if let Some(inner) = unwrap_whole_text(answer) {
        answer = inner.trim();
    }
    strip_string(answer).unwrap_or_else(|| answer.to_string())
}

fn strip_string(s: &str) -> Option<String> {
    let mut s = s.replace('\n', "").replace("\\!", "").replace("\\\\", "\\");
    for (from, to) in [
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ] {
        s = s.replace(from, to);
    }
    if s.contains("\\text{ ") {
        let mut parts = s.split("\\text{ ");
        let (Some(value), Some(_), None) = (parts.next(), parts.next(), parts.next()) else {
            return None;
        };
        s = value.to_string();
    }
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Some(s);
    }
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    let halves: Vec<&str> = s.split('=').collect();
    if halves.len() == 2 && halves[0].chars().count() <= 2 {
        s = halves[1].to_string();
    }
    s = fix_sqrt(&s)?;
    s.retain(|c| c != ' ');
    s = fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".to_string();
    }
    Some(fix_a_slash_b(s))
}

/// `\sqrt3` → `\sqrt{3}` (one character); `None` for a `\sqrt` at the very end.
fn fix_sqrt(s: &str) -> Option<String> {
    let mut parts = s.split("\\sqrt");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        let first = part.chars().next()?;
        out.push_str("\\sqrt");
        if first == '{' {
            out.push_str(part);
        } else {
            out.push('{');
            out.push(first);
            out.push('}');
            out.push_str(&part[first.len_utf8()..]);
        }
    }
    Some(out)
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{2}` → `\frac{1}{2}`; a `\frac` followed by only one
/// character leaves the whole text unchanged; `None` for a `\frac` at the very end.
fn fix_fracs(s: &str) -> Option<String> {
    let mut parts = s.split("\\frac");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        out.push_str("\\frac");
        let mut chars = part.chars();
        let a = chars.next()?;
        if a == '{' {
            out.push_str(part);
            continue;
        }
        let Some(b) = chars.next() else { return Some(s.to_string()) };
        let rest = chars.as_str();
        if b == '{' {
            out.push_str(&format!("{{{a}}}{{{rest}"));
        } else {
            out.push_str(&format!("{{{a}}}{{{b}}}{rest}"));
        }
    }
    Some(out)
}

/// `3/4` → `\frac{3}{4}` when both sides are integers written canonically.
fn fix_a_slash_b(s: String) -> String {
    let mut sides = s.split('/');
    if let (Some(a), Some(b), None) = (sides.next(), sides.next(), sides.next())
        && let (Ok(a), Ok(b)) = (a.parse::<i128>(), b.parse::<i128>())
        && s == format!("{a}/{b}")
    {
        return format!("\\frac{{{a}}}{{{b}}}");
    }
    s
}

/// Units DeepScaleR strips (each with an optional plural and an optional `^2`-style power).
const UNITS: [&str; 16] = [
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
];

/// DeepScaleR's second normalization (the one it hands to sympy), with LaTeX rewritten to plain
/// math by hand instead of by pylatexenc: `\frac{a}{b}` → `a/b` (parenthesised when not a plain
/// number), `\sqrt{x}` → `sqrt(x)`, `\pi` → `pi`, `\cdot`/`\times` → `*`. Also unwraps a whole
/// `\text{}`, drops `$`/`%` and units, writes `million`/`billion`/`trillion` as powers of ten,
/// `or`/`and` as commas, whole-number decimals as integers, removes spaces and braces, lowercases.
pub fn numeric_normalize(expr: &str) -> String {
    let mut s = unwrap_whole_text(expr).unwrap_or(expr).to_string();
    for (from, to) in [
        ("\\%", "%"),
        ("\\$", "$"),
        ("$", ""),
        ("%", ""),
        (" or ", " , "),
        (" and ", " , "),
        ("million", "*10^6"),
        ("billion", "*10^9"),
        ("trillion", "*10^12"),
    ] {
        s = s.replace(from, to);
    }
    for unit in UNITS {
        s = remove_unit(&s, unit);
    }
    s = remove_degree_marks(&s);
    if s.len() >= 2 && s.starts_with('{') && s.ends_with('}') {
        s = s[1..s.len() - 1].to_string();
    }
    s = remove_comma_bang(&s);
    if let Some(int) = python_float(&s).and_then(whole_number) {
        s = int;
    }
    if s.contains('\\') {
        s = latex_to_plain(&s);
    }
    s = glue_minus(&s);
    s = join_mixed_numbers(&s);
    s.retain(|c| !matches!(c, ' ' | '{' | '}'));
    s = s.to_lowercase();
    if str_is_int(&s)
        && let Some(int) = python_float(&s.replace(',', "")).map(truncated_text)
    {
        s = int;
    }
    s
}

/// Removes `unit`, `unit(es)?(s)? *(^digits)?`, everywhere.
fn remove_unit(s: &str, unit: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(unit) {
        out.push_str(&rest[..at]);
        let mut tail = &rest[at + unit.len()..];
        tail = tail.strip_prefix("es").unwrap_or(tail);
        tail = tail.strip_prefix('s').unwrap_or(tail);
        tail = tail.trim_start_matches(' ');
        if let Some(power) = tail.strip_prefix('^') {
            let digits = power.bytes().take_while(u8::is_ascii_digit).count();
            if digits > 0 {
                tail = &power[digits..];
            }
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// Removes `^ *\circ`.
fn remove_degree_marks(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('^') {
        let after = rest[at + 1..].trim_start_matches(' ');
        match after.strip_prefix("\\circ") {
            Some(tail) => {
                out.push_str(&rest[..at]);
                rest = tail;
            }
            None => {
                out.push_str(&rest[..=at]);
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Removes `,\! *` (a LaTeX thousands separator).
fn remove_comma_bang(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(",\\!") {
        out.push_str(&rest[..at]);
        rest = rest[at + 3..].trim_start_matches(' ');
    }
    out.push_str(rest);
    out
}

/// `- 3` → `-3`.
fn glue_minus(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('-') {
        out.push_str(&rest[..=at]);
        rest = rest[at + 1..].trim_start_matches(' ');
    }
    out.push_str(rest);
    out
}

/// `7 3/4` → `7+3/4`: a digit, spaces, a digit.
fn join_mixed_numbers(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        out.push(chars[i]);
        if chars[i].is_ascii_digit() {
            let spaces = chars[i + 1..].iter().take_while(|&&c| c == ' ').count();
            if spaces > 0 && chars.get(i + 1 + spaces).is_some_and(char::is_ascii_digit) {
                out.push('+');
                i += spaces;
            }
        }
        i += 1;
    }
    out
}

/// The LaTeX DeepScaleR's answers use, as plain math text.
fn latex_to_plain(s: &str) -> String {
    let mut s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac");
    s = latex::brace_sqrt_shorthand(&latex::brace_frac_shorthand(&s));
    s = s.replace("\\left", "").replace("\\right", "");
    s = frac_to_ratio(&s);
    s = latex::map_command_arg(&s, "\\sqrt", |x| format!("sqrt({x})"));
    s = latex::map_command_arg(&s, "\\text", str::to_string);
    for (from, to) in [("\\pi", "pi"), ("\\infty", "inf"), ("\\cdot", "*"), ("\\times", "*")] {
        s = s.replace(from, to);
    }
    s
}

/// `\frac{a}{b}` → `a/b`, or `(a)/(b)` for arguments that are not plain numbers.
fn frac_to_ratio(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("\\frac{") {
        let args = &rest[at + 5..];
        let parsed = latex::braced_arg(args, 0).and_then(|(num, after)| {
            latex::braced_arg(args, after).map(|(den, end)| (num, den, end))
        });
        let Some((num, den, end)) = parsed else {
            out.push_str(&rest[..at + 5]);
            rest = args;
            continue;
        };
        let wrap = |x: &str| {
            let x = frac_to_ratio(x);
            if x.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.') {
                x
            } else {
                format!("({x})")
            }
        };
        out.push_str(&rest[..at]);
        out.push_str(&format!("{}/{}", wrap(num), wrap(den)));
        rest = &args[end..];
    }
    out.push_str(rest);
    out
}

/// `float(text)` as Python reads it (surrounding whitespace, sign, decimals, exponents).
fn python_float(text: &str) -> Option<f64> {
    text.trim().parse::<f64>().ok()
}

/// `str(int(x))`: truncated toward zero, every digit of the double written out.
fn truncated_text(x: f64) -> String {
    let t = x.trunc();
    if t == 0.0 { "0".to_string() } else { format!("{t:.0}") }
}

/// The integer text of `x` if it is within 1e-7 of a whole number.
fn whole_number(x: f64) -> Option<String> {
    (x.is_finite() && (x - x.round()).abs() <= 1e-7).then(|| {
        let r = x.round();
        if r == 0.0 { "0".to_string() } else { format!("{r:.0}") }
    })
}

/// Removes the commas of well-formed thousands groups (`1,234,567`) but not tuple commas.
fn strip_thousands_commas(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let digit = |i: usize| chars.get(i).is_some_and(char::is_ascii_digit);
    (0..chars.len())
        .filter(|&i| {
            !(chars[i] == ','
                && i > 0
                && digit(i - 1)
                && digit(i + 1)
                && digit(i + 2)
                && digit(i + 3)
                && !digit(i + 4))
        })
        .map(|i| chars[i])
        .collect()
}

fn str_is_int(s: &str) -> bool {
    python_float(&strip_thousands_commas(s)).and_then(whole_number).is_some()
}

/// `t` without its last character.
fn drop_last(t: &str) -> Option<&str> {
    t.char_indices().next_back().map(|(i, _)| &t[..i])
}

/// `-?digits.?/0*[1-9]digits*.?` (each `.` any one character): a fraction written with a slash,
/// which must then match as text (`2/4` is not accepted for `1/2`).
fn is_frac(s: &str) -> bool {
    let body = s.strip_prefix('-').unwrap_or(s);
    let all_digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let numerator_ok = |t: &str| all_digits(t) || drop_last(t).is_some_and(all_digits);
    let denominator = |t: &str| all_digits(t) && t.bytes().any(|b| b != b'0');
    let denominator_ok = |t: &str| denominator(t) || drop_last(t).is_some_and(denominator);
    body.match_indices('/')
        .any(|(at, _)| numerator_ok(&body[..at]) && denominator_ok(&body[at + 1..]))
}

/// A tuple or interval `(a, b]` → its elements; anything else is one element.
fn split_tuple(expr: &str) -> Vec<String> {
    let expr = strip_thousands_commas(expr);
    if expr.is_empty() {
        return Vec::new();
    }
    let brackets = ['(', ')', '[', ']'];
    let chars: Vec<char> = expr.chars().collect();
    let is_tuple = chars.len() > 2
        && brackets.contains(&chars[0])
        && brackets.contains(&chars[chars.len() - 1])
        && !chars[1..chars.len() - 1].iter().any(|c| brackets.contains(c));
    if is_tuple {
        let inner: String = chars[1..chars.len() - 1].iter().collect();
        inner.split(',').map(|e| e.trim().to_string()).collect()
    } else {
        vec![expr]
    }
}

/// DeepScaleR's second check with exact rational equality standing in for sympy: equal
/// normalized texts, or tuples of the same shape whose elements agree one by one.
pub fn grade_numeric(given: &str, reference: &str) -> bool {
    let (reference, given) = (numeric_normalize(reference), numeric_normalize(given));
    if reference == given {
        return true;
    }
    if given.is_empty() {
        return false;
    }
    let (reference_elems, given_elems) = (split_tuple(&reference), split_tuple(&given));
    if reference_elems.len() > 1
        && (reference.chars().next() != given.chars().next()
            || reference.chars().next_back() != given.chars().next_back())
    {
        return false;
    }
    if reference_elems.len() != given_elems.len() {
        return false;
    }
    reference_elems.iter().zip(&given_elems).all(|(r, g)| {
        if is_frac(r) && is_frac(g) {
            r == g
        } else if str_is_int(r) != str_is_int(g) {
            false
        } else {
            r == g || matches!((parse_number(r), parse_number(g)), (Some(a), Some(b)) if a == b)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(reward: DeepScaler, response: &str, label: &str) -> f64 {
        let sample =
            Sample { response: response.into(), label: Some(label.into()), ..Default::default() };
        match reward.score(&sample).unwrap() {
            RewardValue::Scalar(v) => v,
            other => panic!("deepscaler returned {other:?}"),
        }
    }

    const THINKING: DeepScaler = DeepScaler { require_think: true };
    const LENIENT: DeepScaler = DeepScaler { require_think: false };

    #[test]
    fn only_the_text_after_the_last_think_close_counts() {
        assert_eq!(score(THINKING, "<think>\\boxed{3}</think> so \\boxed{4}", "4"), 1.0);
        assert_eq!(score(THINKING, "<think>so \\boxed{4}</think> I am done", "4"), 0.0);
        assert_eq!(score(THINKING, "a</think>b</think>\\boxed{4}", "4"), 1.0);
        // A thinking model that never closed its thoughts answered nothing.
        assert_eq!(score(THINKING, "\\boxed{4}", "4"), 0.0);
        assert_eq!(score(LENIENT, "\\boxed{4}", "4"), 1.0);
        assert_eq!(score(THINKING, "x###Response \\boxed{4} ###Response \\boxed{5}", "4"), 1.0);
        let reward = DeepScaler::from_config(&serde_json::Value::Null).unwrap();
        assert!(reward.require_think);
        let reward = DeepScaler::from_config(&serde_json::json!({"require_think": false}));
        assert!(!reward.unwrap().require_think);
        assert!(DeepScaler::from_config(&serde_json::json!({"require_think": 0})).is_err());
    }

    #[test]
    fn the_answer_is_the_last_box_which_must_close() {
        assert_eq!(score(THINKING, "</think>\\boxed{\\frac{1}{2}}", "\\frac12"), 1.0);
        assert_eq!(score(THINKING, "</think>\\boxed{2} then \\boxed{3}", "3"), 1.0);
        assert_eq!(score(THINKING, "</think>\\boxed{3} then \\boxed 4", "3"), 0.0);
        assert_eq!(score(THINKING, "</think>\\boxed{3} then \\boxed{4", "3"), 0.0);
        assert_eq!(score(THINKING, "</think>the answer is 3", "3"), 0.0);
        assert_eq!(score(THINKING, "</think>\\boxed{3}", ""), 0.0);
    }

    #[test]
    fn mathd_normalization_accepts_equivalent_spellings() {
        assert_eq!(mathd_normalize("\\dfrac{1}{2}"), "\\frac{1}{2}");
        assert_eq!(mathd_normalize("0.5"), "\\frac{1}{2}");
        assert_eq!(mathd_normalize("1/2"), "\\frac{1}{2}");
        assert_eq!(mathd_normalize("\\text{ five }"), "five");
        assert_eq!(mathd_normalize("x = 3"), "3");
        assert_eq!(mathd_normalize(".25"), "0.25");
        assert_eq!(mathd_normalize(".5"), "\\frac{1}{2}");
        assert_eq!(mathd_normalize("5\\text{ cm}"), "5");
        assert_eq!(mathd_normalize("10\\%"), "10");
        assert_eq!(mathd_normalize("2\\sqrt3"), "2\\sqrt{3}");
        assert_eq!(mathd_normalize("\\frac1{72}"), "\\frac{1}{72}");
        // Ill-formed input is kept as it was.
        assert_eq!(mathd_normalize("2\\sqrt"), "2\\sqrt");
        assert_eq!(mathd_normalize("\\frac1"), "\\frac1");
    }

    #[test]
    fn numeric_check_compares_values_not_spellings() {
        let ok = |g: &str, r: &str| grade_mathd(g, r) || grade_numeric(g, r);
        assert!(ok("0.25", "\\frac14"));
        assert!(ok("2.0", "2"));
        assert!(ok("1,000", "1000"));
        assert!(ok("-3", "-3.0"));
        assert!(ok("10\\%", "10"));
        assert!(ok("\\$5", "5"));
        assert!(ok("3 million", "3*10^6"));
        // An integer reference needs an answer that reads as an integer, as in DeepScaleR.
        assert!(!ok("3 million", "3000000"));
        assert!(ok("(1, \\frac{1}{2})", "(1, 0.5)"));
        assert!(ok("\\text{Monday}", "monday"));
        assert!(ok("90^\\circ", "90"));
        assert!(ok("5 inches", "5"));
        // Unreduced slash fractions must match as written; integers are never approximate.
        assert!(!ok("2/4", "1/2"));
        assert!(!ok("2.001", "2"));
        assert!(!ok("(1,2)", "[1,2]"));
        assert!(!ok("(1,2)", "(1,2,3)"));
        assert!(!ok("\\sqrt{8}", "2\\sqrt{2}"));
        assert!(!ok("3", "-3"));
    }

    #[test]
    fn fbox_and_boxed_labels_are_unwrapped() {
        assert_eq!(score(THINKING, "</think>\\boxed{7}", "\\boxed{7}"), 1.0);
        assert_eq!(score(THINKING, "</think>\\boxed{7}", "so \\fbox{7}"), 1.0);
        assert_eq!(score(THINKING, "</think>\\boxed{7}", "\\boxed{7"), 0.0);
    }

    #[test]
    fn missing_label_is_an_error_naming_the_reward() {
        let err = THINKING.score(&Sample::default()).unwrap_err().to_string();
        assert!(err.contains("deepscaler") && err.contains("no label"), "{err}");
    }
}
