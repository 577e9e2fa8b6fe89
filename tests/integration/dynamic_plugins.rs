use miles_tests::{cdylib, miles, scratch};

fn samples(dir: &std::path::Path, lines: &[&str]) -> String {
    let path = dir.join("samples.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn the_example_plugin_scores_a_file() {
    let lib = cdylib("miles-example-length-penalty");
    let lib = lib.to_str().unwrap();
    let dir = scratch("example_plugin_scores");
    let input = samples(
        &dir,
        &[
            r#"{"prompt": "6*7?", "response": "The answer is 42.", "label": "42"}"#,
            r#"{"prompt": "6*7?", "response": "41", "label": "42"}"#,
            r#"{"prompt": "6*7?", "response": "It is 42, after a very long think", "label": "42"}"#,
        ],
    );
    let config = r#"{"target_chars": 20, "penalty_per_char": 0.05}"#;
    let output = dir.join("out.jsonl");
    let report = miles(&[
        "reward",
        "--input",
        &input,
        "--custom-rm-path",
        lib,
        "--custom-rm-config",
        config,
        "--output",
        output.to_str().unwrap(),
    ])
    .unwrap();
    assert!(report.contains("with length_penalty 0.1.0 (dynamic"), "{report}");
    let rewards: Vec<f64> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["reward"].as_f64().unwrap())
        .collect();
    // 33 characters is 13 over the target of 20: 1 - 13 × 0.05 = 0.35.
    assert_eq!(rewards.len(), 3);
    assert_eq!(&rewards[..2], &[1.0, 0.0]);
    assert!((rewards[2] - 0.35).abs() < 1e-9, "{rewards:?}");

    let listed = miles(&["plugins", "--custom-rm-path", lib]).unwrap();
    let row = listed.lines().find(|l| l.contains("length_penalty")).expect(&listed);
    assert!(row.starts_with("reward") && row.contains("dynamic"), "{row}");
}

#[test]
fn a_panicking_plugin_fails_only_that_call() {
    let lib = cdylib("miles-test-plugins");
    let lib = lib.to_str().unwrap();
    let dir = scratch("panicking_plugin");
    let input = samples(
        &dir,
        &[r#"{"response": "abc"}"#, r#"{"response": "panic"}"#, r#"{"response": "error"}"#],
    );
    let output = dir.join("out.jsonl");
    let args = [
        "reward",
        "--input",
        &input,
        "--custom-rm-path",
        lib,
        "--output",
        output.to_str().unwrap(),
    ];
    let report = miles(&args).unwrap();
    assert!(report.contains("reward: n 1  mean 3.0000"), "{report}");
    assert!(report.contains("failed: 2 (first at line 2"), "{report}");
    assert!(
        report.contains("plugin panicked in score: touchy plugin was asked to panic"),
        "{report}"
    );
    let scored = std::fs::read_to_string(&output).unwrap();
    assert!(scored.contains("touchy plugin rejects this sample"), "{scored}");

    // The host is still up, and the same library keeps working.
    let again = samples(&dir, &[r#"{"response": "four"}"#]);
    let report = miles(&["reward", "--input", &again, "--custom-rm-path", lib]).unwrap();
    assert!(report.contains("reward: n 1  mean 4.0000"), "{report}");

    // A call that panics as a whole (group scoring keeps the batch) fails each of its samples.
    let group = samples(&dir, &[r#"{"response": "ok"}"#, r#"{"response": "panic"}"#]);
    let report =
        miles(&["reward", "--input", &group, "--custom-rm-path", lib, "--group-rm"]).unwrap();
    assert!(report.contains("failed: 2"), "{report}");
}

#[test]
fn foreign_or_broken_plugins_are_refused_by_name() {
    let lib = cdylib("miles-test-plugins");
    let shown = lib.display().to_string();
    let dir = scratch("foreign_plugins");
    let input = samples(&dir, &[r#"{"response": "a"}"#]);
    let score = |spec: String, config: Option<&str>| {
        let mut args = vec![
            "reward".to_string(),
            "--input".into(),
            input.clone(),
            "--custom-rm-path".into(),
            spec,
        ];
        if let Some(c) = config {
            args.extend(["--custom-rm-config".to_string(), c.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        miles(&args).unwrap_err()
    };

    let err = score(format!("{shown}:bad_abi"), None);
    assert!(err.contains(&format!("{shown} was built for miles plugin ABI v999.0")), "{err}");
    assert!(err.contains("rebuild the plugin"), "{err}");

    let err = score(format!("{shown}:short_table"), None);
    assert!(err.contains("shorter than ABI v1"), "{err}");

    let err = score(format!("{shown}:no_such_entry"), None);
    assert!(err.contains(&format!("{shown} does not export `no_such_entry`")), "{err}");

    let err = score(shown.clone(), Some(r#"{"refuse": true}"#));
    assert!(err.contains("(touchy) refused its configuration: refusing as configured"), "{err}");

    let not_a_library = dir.join("fake.so");
    std::fs::write(&not_a_library, "definitely not ELF").unwrap();
    let err = score(not_a_library.display().to_string(), None);
    assert!(err.contains("cannot load reward plugin") && err.contains("fake.so"), "{err}");
}
