//! `FILE@[a:b]`: a file and the rows a..b of it, as slime's `--prompt-data` writes it.

use std::path::PathBuf;

use crate::DataError;

/// Splits `FILE@[a:b]` into the path and the 0-based row range `a..b`, either end optional
/// (`@[2:]`, `@[:3]`, `@[:]`). A spec without `@[` is a plain path: `(path, None, None)`.
///
/// Unlike Python slices, negative ends are refused: rows are counted from the start of the file.
/// An empty range (`@[3:3]`, `@[5:2]`) parses; [`crate::Dataset::load`] refuses it, since it
/// knows how many rows the file has.
pub fn parse_slice(spec: &str) -> Result<(PathBuf, Option<usize>, Option<usize>), DataError> {
    let Some((path, range)) = spec.rsplit_once("@[") else {
        return Ok((PathBuf::from(spec), None, None));
    };
    let bad = |why: &str| DataError::Slice {
        spec: spec.to_string(),
        message: format!(
            "{why}; a row slice is written FILE@[a:b] (0-based rows, either end optional)"
        ),
    };
    if path.is_empty() {
        return Err(bad("no file before '@['"));
    }
    let range = range.strip_suffix(']').ok_or_else(|| bad("the slice does not end with ']'"))?;
    let (a, b) =
        range.split_once(':').ok_or_else(|| bad("the slice has no ':' between its ends"))?;
    let end = |s: &str| -> Result<Option<usize>, DataError> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(None);
        }
        if s.starts_with('-') {
            return Err(bad(&format!("'{s}' is negative, and rows count from the start")));
        }
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad(&format!("'{s}' is not a row number")));
        }
        s.parse().map(Some).map_err(|_| bad(&format!("'{s}' is too large")))
    };
    Ok((PathBuf::from(path), end(a)?, end(b)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(spec: &str) -> (PathBuf, Option<usize>, Option<usize>) {
        parse_slice(spec).unwrap_or_else(|e| panic!("{spec}: {e}"))
    }

    fn err(spec: &str) -> String {
        match parse_slice(spec) {
            Ok(v) => panic!("{spec} parsed as {v:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn slices_with_either_end_optional() {
        assert_eq!(ok("d.jsonl"), (PathBuf::from("d.jsonl"), None, None));
        assert_eq!(ok("d.jsonl@[2:]"), (PathBuf::from("d.jsonl"), Some(2), None));
        assert_eq!(ok("d.jsonl@[:3]"), (PathBuf::from("d.jsonl"), None, Some(3)));
        assert_eq!(ok("d.jsonl@[1:2]"), (PathBuf::from("d.jsonl"), Some(1), Some(2)));
        assert_eq!(ok("d.jsonl@[:]"), (PathBuf::from("d.jsonl"), None, None));
        assert_eq!(ok("dir/d.jsonl@[ 1 : 20 ]"), (PathBuf::from("dir/d.jsonl"), Some(1), Some(20)));
        // Only the last `@[` starts the slice.
        assert_eq!(ok("a@[b/d.jsonl@[0:1]"), (PathBuf::from("a@[b/d.jsonl"), Some(0), Some(1)));
    }

    #[test]
    fn bad_slices_name_the_spec_and_the_form() {
        for (spec, why) in [
            ("d.jsonl@[1:2", "does not end with ']'"),
            ("d.jsonl@[12]", "no ':'"),
            ("d.jsonl@[]", "no ':'"),
            ("d.jsonl@[0:x]", "'x' is not a row number"),
            ("d.jsonl@[+1:2]", "'+1' is not a row number"),
            ("d.jsonl@[1:2:3]", "'2:3' is not a row number"),
            ("d.jsonl@[-2:]", "'-2' is negative"),
            ("d.jsonl@[0:99999999999999999999999]", "too large"),
            ("@[0:1]", "no file before"),
        ] {
            let e = err(spec);
            assert!(e.starts_with(spec) && e.contains(why) && e.contains("FILE@[a:b]"), "{e}");
        }
    }
}
