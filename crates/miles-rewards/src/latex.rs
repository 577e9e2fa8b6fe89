//! LaTeX answer handling shared by the math rewards: braced arguments, `\boxed{…}` extraction
//! and exact rational values of numeric answers (`-3`, `0.25`, `1/4`, `\frac{1}{4}`).

/// The byte index of the `}` that closes the `{` at `open`. Escaped braces (`\{`, `\}`) are
/// text, not grouping, so `\boxed{\left\{1\right.}` still closes where it should.
pub(crate) fn matching_brace(text: &str, open: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    if bytes.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            // A backslash escapes the next byte; UTF-8 continuation bytes are never braces.
            b'\\' => i += 1,
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The argument `{…}` starting exactly at byte `at`: its inner text and the index just past it.
pub(crate) fn braced_arg(text: &str, at: usize) -> Option<(&str, usize)> {
    let close = matching_brace(text, at)?;
    Some((&text[at + 1..close], close + 1))
}

/// The inner text of `\boxed{…}` or `\fbox{…}` whose command starts at byte `at`, if the command
/// is followed directly by a brace group that closes.
pub(crate) fn boxed_at(text: &str, at: usize) -> Option<&str> {
    let rest = &text[at..];
    let command = ["\\boxed", "\\fbox"].into_iter().find(|c| rest.starts_with(c))?;
    braced_arg(text, at + command.len()).map(|(inner, _)| inner)
}

/// The content of the last `\boxed{…}` or `\fbox{…}` that closes. An unclosed one (a response cut
/// off mid-answer) is skipped in favour of an earlier complete one.
pub fn last_boxed(text: &str) -> Option<&str> {
    let mut starts: Vec<usize> = text
        .match_indices("\\boxed{")
        .chain(text.match_indices("\\fbox{"))
        .map(|(i, _)| i)
        .collect();
    starts.sort_unstable();
    starts.into_iter().rev().find_map(|i| boxed_at(text, i))
}

/// Replaces every `command{X}` (balanced braces) with `replace(X)`.
pub(crate) fn map_command_arg(s: &str, command: &str, replace: impl Fn(&str) -> String) -> String {
    let pattern = format!("{command}{{");
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(&pattern) {
        let open = at + command.len();
        match braced_arg(rest, open) {
            Some((inner, end)) => {
                out.push_str(&rest[..at]);
                out.push_str(&replace(inner));
                rest = &rest[end..];
            }
            None => {
                out.push_str(&rest[..open]);
                rest = &rest[open..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{2}` → `\frac{1}{2}`, `\frac{1}2` → `\frac{1}{2}`: the
/// one-character-argument shorthand written braced. Only letters and digits count as arguments.
pub(crate) fn brace_frac_shorthand(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(at) = rest.find("\\frac") {
        out.push_str(&rest[..at + 5]);
        rest = &rest[at + 5..];
        for _ in 0..2 {
            match rest.chars().next() {
                Some('{') => match matching_brace(rest, 0) {
                    Some(close) => {
                        out.push_str(&rest[..=close]);
                        rest = &rest[close + 1..];
                    }
                    None => break,
                },
                Some(c) if c.is_alphanumeric() => {
                    out.push('{');
                    out.push(c);
                    out.push('}');
                    rest = &rest[c.len_utf8()..];
                }
                _ => break,
            }
        }
    }
    out.push_str(rest);
    out
}

/// `\sqrt2` → `\sqrt{2}`.
pub(crate) fn brace_sqrt_shorthand(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 4);
    let mut rest = s;
    while let Some(at) = rest.find("\\sqrt") {
        out.push_str(&rest[..at + 5]);
        rest = &rest[at + 5..];
        if let Some(c) = rest.chars().next().filter(|c| c.is_alphanumeric()) {
            out.push('{');
            out.push(c);
            out.push('}');
            rest = &rest[c.len_utf8()..];
        }
    }
    out.push_str(rest);
    out
}

/// Whether `s` is a number written with thousands separators: `1,000`, `-12,345.5`.
pub(crate) fn is_thousands_grouped(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let int = s.split_once('.').map_or(s, |(int, frac)| {
        if frac.is_empty() || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return "";
        }
        int
    });
    let mut groups = int.split(',');
    let Some(head) = groups.next() else { return false };
    let digits = |g: &str| g.bytes().all(|b| b.is_ascii_digit());
    let mut tail = groups.peekable();
    tail.peek().is_some()
        && (1..=3).contains(&head.len())
        && digits(head)
        && tail.all(|g| g.len() == 3 && digits(g))
}

/// An exact rational number, `num / den` in lowest terms with `den > 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rational {
    num: i128,
    den: i128,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Rational {
    pub fn new(num: i128, den: i128) -> Option<Rational> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1);
        let g = i128::try_from(g).ok()?;
        let (num, den) = (num / g, den / g);
        if den < 0 {
            Some(Rational { num: num.checked_neg()?, den: den.checked_neg()? })
        } else {
            Some(Rational { num, den })
        }
    }

    fn integer(n: i128) -> Rational {
        Rational { num: n, den: 1 }
    }

    fn neg(self) -> Option<Rational> {
        Some(Rational { num: self.num.checked_neg()?, den: self.den })
    }

    fn div(self, other: Rational) -> Option<Rational> {
        Rational::new(self.num.checked_mul(other.den)?, self.den.checked_mul(other.num)?)
    }

    fn mul(self, other: Rational) -> Option<Rational> {
        Rational::new(self.num.checked_mul(other.num)?, self.den.checked_mul(other.den)?)
    }
}

/// `12`, `-0.5`, `.5`, `3.` as an exact rational; `None` for anything else or on overflow.
fn parse_decimal(s: &str) -> Option<Rational> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let all_digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    if int.len() + frac.len() == 0 || !all_digits(int) || !all_digits(frac) {
        return None;
    }
    // Trailing zeros of the fraction change nothing and only risk overflow.
    let frac = frac.trim_end_matches('0');
    let mut num: i128 = 0;
    for b in int.bytes().chain(frac.bytes()) {
        num = num.checked_mul(10)?.checked_add(i128::from(b - b'0'))?;
    }
    let den = 10i128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    Rational::new(num, den)
}

/// `(x)` → `x`, when the parentheses enclose the whole string.
fn strip_parens(s: &str) -> &str {
    match s.strip_prefix('(').and_then(|t| t.strip_suffix(')')) {
        Some(inner) if !inner.contains(['(', ')']) => inner,
        _ => s,
    }
}

/// The exact value of a numeric answer, spaces already removed: an optional sign (`-`, `+`)
/// before a decimal (`2`, `2.50`, `.5`), a ratio `a/b` (either side may be parenthesised),
/// `\frac{a}{b}` (arguments themselves numeric), or any of those times `10^k` (`3*10^6`).
/// `None` when `s` is not such a number, divides by zero or overflows 128 bits.
pub fn parse_number(s: &str) -> Option<Rational> {
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if body.is_empty() || body.starts_with(['-', '+']) {
        return None;
    }
    let value = if let Some((mantissa, exponent)) = body.split_once("*10^") {
        let exponent: u32 = exponent.parse().ok().filter(|&e| e <= 36)?;
        parse_number(mantissa)?.mul(Rational::integer(10i128.checked_pow(exponent)?))?
    } else if let Some(args) = body.strip_prefix("\\frac") {
        let (num, after) = braced_arg(args, 0)?;
        let (den, end) = braced_arg(args, after)?;
        if end != args.len() {
            return None;
        }
        parse_number(num)?.div(parse_number(den)?)?
    } else if let Some((num, den)) = body.split_once('/') {
        parse_signed_decimal(strip_parens(num))?.div(parse_signed_decimal(strip_parens(den))?)?
    } else {
        parse_decimal(body)?
    };
    if negative { value.neg() } else { Some(value) }
}

fn parse_signed_decimal(s: &str) -> Option<Rational> {
    match s.strip_prefix('-') {
        Some(rest) => parse_decimal(rest)?.neg(),
        None => parse_decimal(s.strip_prefix('+').unwrap_or(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(num: i128, den: i128) -> Option<Rational> {
        Rational::new(num, den)
    }

    #[test]
    fn last_boxed_takes_the_last_closed_box_with_nested_braces() {
        assert_eq!(last_boxed("so \\boxed{\\frac{1}{2}}."), Some("\\frac{1}{2}"));
        assert_eq!(last_boxed("\\boxed{1} then \\boxed{2}"), Some("2"));
        assert_eq!(last_boxed("\\fbox{7} beats \\boxed{6} only if later"), Some("6"));
        assert_eq!(last_boxed("\\boxed{6} \\fbox{7}"), Some("7"));
        assert_eq!(last_boxed("\\boxed{\\{1,2\\}}"), Some("\\{1,2\\}"));
        assert_eq!(last_boxed("\\boxed{\\left\\{x\\right.}"), Some("\\left\\{x\\right."));
        // Cut off mid-answer: the earlier complete box stands.
        assert_eq!(last_boxed("\\boxed{5} ... \\boxed{12"), Some("5"));
        assert_eq!(last_boxed("\\boxed 5"), None);
        assert_eq!(last_boxed("no box"), None);
        assert_eq!(last_boxed("\\boxed{}"), Some(""));
    }

    #[test]
    fn shorthand_fractions_and_roots_get_braces() {
        assert_eq!(brace_frac_shorthand("\\frac12"), "\\frac{1}{2}");
        assert_eq!(brace_frac_shorthand("\\frac1{72}"), "\\frac{1}{72}");
        assert_eq!(brace_frac_shorthand("\\frac{3}4+\\frac{a}{b}"), "\\frac{3}{4}+\\frac{a}{b}");
        assert_eq!(brace_frac_shorthand("\\frac\\pi2"), "\\frac\\pi2");
        assert_eq!(brace_sqrt_shorthand("2\\sqrt3"), "2\\sqrt{3}");
        assert_eq!(brace_sqrt_shorthand("\\sqrt{3}"), "\\sqrt{3}");
    }

    #[test]
    fn numbers_parse_to_exact_rationals() {
        assert_eq!(parse_number("0.5"), q(1, 2));
        assert_eq!(parse_number("\\frac{1}{2}"), q(1, 2));
        assert_eq!(parse_number("1/2"), q(1, 2));
        assert_eq!(parse_number("(1)/(2)"), q(1, 2));
        assert_eq!(parse_number("-\\frac{3}{6}"), q(-1, 2));
        assert_eq!(parse_number("\\frac{-3}{6}"), q(-1, 2));
        assert_eq!(parse_number("\\frac{0.5}{2}"), q(1, 4));
        assert_eq!(parse_number("2.000"), q(2, 1));
        assert_eq!(parse_number("+7"), q(7, 1));
        assert_eq!(parse_number(".25"), q(1, 4));
        assert_eq!(parse_number("3*10^6"), q(3_000_000, 1));
        for not_a_number in ["", "-", "--3", "1/0", "x", "2x", "1.2.3", "\\frac{1}{2}3", "1,000"] {
            assert_eq!(parse_number(not_a_number), None, "{not_a_number}");
        }
        // Too long for 128 bits: not a number here, so callers compare the text instead.
        assert_eq!(parse_number(&"9".repeat(50)), None);
    }

    #[test]
    fn thousands_grouping_is_recognised_only_when_well_formed() {
        assert!(is_thousands_grouped("1,000"));
        assert!(is_thousands_grouped("-12,345,678.25"));
        assert!(!is_thousands_grouped("1000"));
        assert!(!is_thousands_grouped("1,2"));
        assert!(!is_thousands_grouped("1234,567"));
        assert!(!is_thousands_grouped("1,000."));
    }
}
