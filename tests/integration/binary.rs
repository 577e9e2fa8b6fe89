//! The real `miles` executable, as users run it.

use std::process::Command;

use miles_tests::{miles_binary, scratch};

#[test]
fn version_lists_the_compiled_in_features() {
    let out = Command::new(miles_binary()).arg("--version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(&format!("miles {}", env!("CARGO_PKG_VERSION"))), "{text}");
    assert!(text.contains("features: tis"), "{text}");
}

#[test]
fn plugins_lists_static_plugins_as_json() {
    let out = Command::new(miles_binary()).args(["plugins", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let has = |kind: &str, name: &str| {
        rows.iter().any(|r| r["kind"] == kind && r["name"] == name && r["source"] == "static")
    };
    assert!(has("reward", "exact_match") && has("correction", "tis"), "{rows:?}");
}

#[test]
fn bad_input_exits_nonzero_with_a_clear_message() {
    let dir = scratch("binary_bad_input");
    let input = dir.join("in.jsonl");
    std::fs::write(&input, "{\"response\": \"a\"}\nnot json\n").unwrap();
    let out = Command::new(miles_binary())
        .args(["reward", "--rm-type", "exact_match", "--input"])
        .arg(&input)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: ") && err.contains("in.jsonl:2: not valid JSON"), "{err}");

    let out = Command::new(miles_binary()).args(["reward", "--bogus"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bogus"));
}

/// Corrupt Parquet files that make the `parquet` crate panic (tests/fixtures/parquet/
/// make_corrupt.py: its metadata reader, dictionary decoder, bit reader, schema and triplet
/// readers) are an error naming the file, with no panic message before it.
#[test]
fn corrupt_parquet_files_are_errors_without_a_panic_message() {
    let dir = scratch("binary_corrupt_parquet");
    let ckpt = dir.join("ckpt");
    miles_tests::miles(&["init-model", "--preset", "tiny", "--out", ckpt.to_str().unwrap()])
        .unwrap();
    let fixtures = miles_tests::workspace_root().join("tests/fixtures/parquet");
    for kind in ["metadata", "dictionary", "bit-reader", "schema", "triplet"] {
        let file = fixtures.join(format!("corrupt-{kind}.parquet"));
        let out = Command::new(miles_binary())
            .args(["generate", "--hf-checkpoint", ckpt.to_str().unwrap(), "--prompt-data"])
            .arg(&file)
            .args(["--input-key", "question", "--label-key", "answer", "--output"])
            .arg(dir.join("out.jsonl"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{kind}: {err}");
        assert!(err.starts_with("error: --prompt-data"), "{kind}: {err}");
        assert!(err.contains(&format!("corrupt-{kind}.parquet")), "{kind}: {err}");
        assert!(!err.contains("panicked"), "{kind}: {err}");
    }
}
