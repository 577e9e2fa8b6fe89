use miles_tests::{miles, scratch};

#[test]
fn exact_match_scores_a_file_and_keeps_every_field() {
    let dir = scratch("exact_match_scores_a_file");
    let input = dir.join("samples.jsonl");
    std::fs::write(
        &input,
        concat!(
            r#"{"prompt": "Capital of France?", "response": " Paris", "label": "Paris", "extra": {"id": 7}}"#,
            "\n\n",
            r#"{"prompt": [{"role": "user", "content": "2+2?"}], "response": "5", "label": 4}"#,
            "\n",
            r#"{"prompt": "no label", "response": "x", "metadata": 3}"#,
            "\n",
        ),
    )
    .unwrap();
    let output = dir.join("scored.jsonl");
    let report = miles(&[
        "reward",
        "--input",
        input.to_str().unwrap(),
        "--rm-type",
        "exact_match",
        "--output",
        output.to_str().unwrap(),
    ])
    .unwrap();
    assert!(report.contains("scored 3 samples"), "{report}");
    assert!(report.contains("reward: n 2  mean 0.5000"), "{report}");
    assert!(report.contains("failed: 1 (first at line 4: sample has no label"), "{report}");

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["reward"], 1.0);
    assert_eq!(lines[0]["extra"]["id"], 7);
    assert_eq!(lines[1]["reward"], 0.0);
    assert_eq!(lines[1]["label"], 4);
    assert_eq!(lines[2]["status"], "failed");
    assert_eq!(lines[2]["metadata"]["original"], 3);
    assert!(lines[2]["metadata"]["reward_error"].as_str().unwrap().contains("no label"));
    // The first key stays first: fields are kept in their order.
    let first_key = std::fs::read_to_string(&output).unwrap();
    assert!(first_key.starts_with(r#"{"prompt":"#), "{first_key}");
}

#[test]
fn a_malformed_line_names_the_file_and_line_and_writes_nothing() {
    let dir = scratch("malformed_line");
    let input = dir.join("broken.jsonl");
    std::fs::write(&input, "{\"response\": \"a\", \"label\": \"a\"}\n{\"response\": \n").unwrap();
    let output = dir.join("out.jsonl");
    let args = [
        "reward",
        "--input",
        input.to_str().unwrap(),
        "--rm-type",
        "exact_match",
        "--output",
        output.to_str().unwrap(),
    ];
    let err = miles(&args).unwrap_err();
    assert!(err.contains(&format!("{}:2: not valid JSON", input.display())), "{err}");
    assert!(!output.exists());

    std::fs::write(&input, "[1, 2]\n").unwrap();
    let err = miles(&args).unwrap_err();
    assert!(err.contains(":1: expected a JSON object, found an array"), "{err}");

    std::fs::write(&input, "{\"response\": 5}\n").unwrap();
    let err = miles(&args).unwrap_err();
    assert!(err.contains(":1: not a sample"), "{err}");
    assert!(err.contains("invalid type"), "{err}");
}

#[test]
fn reward_flags_are_checked() {
    let err = miles(&["reward", "--input", "x.jsonl"]).unwrap_err();
    assert!(err.contains("--rm-type") && err.contains("--custom-rm-path"), "{err}");
    let dir = scratch("reward_flags_are_checked");
    let input = dir.join("s.jsonl");
    std::fs::write(&input, "{\"response\": \"a\", \"label\": \"a\"}\n").unwrap();
    let input = input.to_str().unwrap();
    let err = miles(&["reward", "--input", input, "--rm-type", "exact_mach"]).unwrap_err();
    assert!(err.contains("no reward plugin named 'exact_mach'; available: "), "{err}");
    assert!(err.contains("exact_match") && err.contains("remote_rm"), "{err}");
    let err =
        miles(&["reward", "--input", "missing.jsonl", "--rm-type", "exact_match"]).unwrap_err();
    assert!(err.contains("cannot open missing.jsonl"), "{err}");
    let bad = ["reward", "--input", input, "--rm-type", "exact_match", "--custom-rm-config", "{"];
    assert!(miles(&bad).unwrap_err().contains("--custom-rm-config is not valid JSON"));
}
