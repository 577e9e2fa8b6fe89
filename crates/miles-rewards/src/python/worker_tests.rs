//! `PythonReward` against the machine's `python3`, with the functions of `test_rewards.py`.
//! Every test is skipped, saying so, where there is no `python3`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{PythonReward, PythonRewardConfig, score_all};
use miles_core::{Message, Prompt, Reward, RewardError, RewardValue, Sample};
use serde_json::{Value, json};

fn python_available() -> bool {
    let found = Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: no python3 on PATH");
    }
    found
}

fn rewards_py() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/python/test_rewards.py")
}

/// A fresh directory for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("miles-python-rm-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn start(function: &str, config: Value) -> PythonReward {
    let config = PythonRewardConfig::from_json(&config).unwrap();
    PythonReward::start(rewards_py(), function, None, config).unwrap()
}

fn start_err(file: PathBuf, function: &str, python: Option<PathBuf>) -> String {
    let config = PythonRewardConfig::default();
    PythonReward::start(file, function, python, config).unwrap_err().to_string()
}

fn sample(index: usize, response: &str, label: &str) -> Sample {
    Sample {
        index,
        prompt: Prompt::Text("1+1?".into()),
        response: response.into(),
        label: Some(label.into()),
        metadata: json!({"data_source": "unit"}),
        ..Default::default()
    }
}

fn responses(list: &[&str]) -> Vec<Sample> {
    list.iter().enumerate().map(|(i, r)| sample(i, r, "2")).collect()
}

fn error(result: &Result<RewardValue, RewardError>) -> &str {
    &result.as_ref().unwrap_err().0
}

#[test]
fn a_scalar_reward_scores_each_sample_of_a_batch() {
    if !python_available() {
        return;
    }
    let rm = start("scalar", Value::Null);
    assert_eq!(rm.info().call, "sample");
    assert!(!rm.info().is_async);
    let results = rm.score_group(&responses(&["2", " 2 ", "3"]));
    assert_eq!(
        results,
        [Ok(RewardValue::Scalar(1.0)), Ok(RewardValue::Scalar(1.0)), Ok(RewardValue::Scalar(0.0))]
    );
    assert_eq!(rm.score(&sample(0, "2", "2")), Ok(RewardValue::Scalar(1.0)));
    assert_eq!(rm.score_group(&[]), []);
}

#[test]
fn a_dict_is_a_named_reward() {
    if !python_available() {
        return;
    }
    let rm = start("named", Value::Null);
    let want = RewardValue::Named(BTreeMap::from([("acc".into(), 1.0), ("len".into(), 1.0)]));
    assert_eq!(rm.score(&sample(0, "2", "2")), Ok(want));
}

#[test]
fn slime_and_verl_signatures_are_called_their_way() {
    if !python_available() {
        return;
    }
    let rm = start("slime_style", json!({"bonus": 0.5}));
    assert_eq!(rm.info().call, "args_sample");
    let results = rm.score_group(&responses(&["2", "3"]));
    assert_eq!(results, [Ok(RewardValue::Scalar(1.5)), Ok(RewardValue::Scalar(0.5))]);

    let rm = start("verl_style", Value::Null);
    assert_eq!(rm.info().call, "verl");
    let results = rm.score_group(&responses(&["2", "3"]));
    assert_eq!(results, [Ok(RewardValue::Scalar(1.0)), Ok(RewardValue::Scalar(0.0))]);
}

#[test]
fn an_exception_fails_its_sample_only_with_the_tracebacks_last_line() {
    if !python_available() {
        return;
    }
    let rm = start("raises_on_bad", Value::Null);
    let samples = responses(&["ok", "bad", "ok"]);
    for results in [rm.score_group(&samples), score_all(&rm, &samples, false)] {
        assert_eq!(results[0], Ok(RewardValue::Scalar(1.0)));
        assert_eq!(error(&results[1]), "ValueError: cannot score sample 1");
        assert_eq!(results[2], Ok(RewardValue::Scalar(1.0)));
    }
}

#[test]
fn a_result_that_is_not_a_number_fails_the_sample_saying_what_came_back() {
    if !python_available() {
        return;
    }
    let rm = start("not_a_number", Value::Null);
    let samples = responses(&["str", "none", "nan", "list", "true", "dict_of_str", "empty_dict"]);
    let results = rm.score_group(&samples);
    assert_eq!(
        error(&results[0]),
        "not_a_number returned str 'abc', not a number or a dict of numbers"
    );
    assert_eq!(
        error(&results[1]),
        "not_a_number returned NoneType None, not a number or a dict of numbers"
    );
    assert_eq!(error(&results[2]), "not_a_number returned nan, not a finite number");
    assert!(error(&results[3]).contains("returned list [1]"), "{}", error(&results[3]));
    assert_eq!(results[4], Ok(RewardValue::Scalar(1.0)));
    assert_eq!(
        error(&results[5]),
        "not_a_number returned a dict whose 'acc' is str 'x', not a number"
    );
    assert!(error(&results[6]).contains("empty dict"), "{}", error(&results[6]));
}

#[test]
fn unicode_in_prompts_and_responses_round_trips() {
    if !python_available() {
        return;
    }
    let rm = start("unicode_echo", Value::Null);
    let texts = ["答案是 ½", "émoji 😀 and \u{1F9EA}", "null \u{0} tab\t newline\n", "\u{FEFF}bom"];
    let samples: Vec<Sample> = texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let prompt = vec![Message { role: "user".into(), content: format!("问题 {text}") }];
            Sample {
                index: i,
                prompt: Prompt::Messages(prompt.clone()),
                response: text.to_string(),
                metadata: json!({"response": text, "prompt": prompt}),
                ..Default::default()
            }
        })
        .collect();
    let results = rm.score_group(&samples);
    assert!(results.iter().all(|r| *r == Ok(RewardValue::Scalar(1.0))), "{results:?}");
}

#[test]
fn prints_to_stdout_do_not_corrupt_the_protocol() {
    if !python_available() {
        return;
    }
    let rm = start("noisy", Value::Null);
    let results = rm.score_group(&responses(&["a", "b"]));
    assert_eq!(results, [Ok(RewardValue::Scalar(1.0)), Ok(RewardValue::Scalar(1.0))]);
}

#[test]
fn a_crashed_worker_is_restarted_and_the_batch_retried() {
    if !python_available() {
        return;
    }
    let dir = scratch("crash-once");
    let marker = dir.join("crashed").to_string_lossy().to_string();
    let rm = start("crash_once", json!({"backoff_ms": 1}));
    let first_pid = rm.worker_pid().unwrap();
    let mut samples = responses(&["a", "CRASH", "b"]);
    for s in &mut samples {
        s.metadata = json!({"marker": marker});
    }
    let results = rm.score_group(&samples);
    assert!(results.iter().all(|r| *r == Ok(RewardValue::Scalar(1.0))), "{results:?}");
    assert_ne!(rm.worker_pid().unwrap(), first_pid, "the worker was not restarted");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A sample that crashes the worker is found by bisecting its batch and fails alone; the
/// others score and scoring goes on.
#[test]
fn a_sample_that_crashes_the_worker_is_found_by_bisection_and_fails_alone() {
    if !python_available() {
        return;
    }
    let rm = start("always_crash", json!({"backoff_ms": 1, "max_restarts": 2}));
    let texts = ["a", "b", "c", "d", "e", "CRASH", "f", "g"];
    let results = rm.score_group(&responses(&texts));
    for (text, r) in texts.iter().zip(&results) {
        if *text != "CRASH" {
            assert_eq!(*r, Ok(RewardValue::Scalar(1.0)), "{text}: {results:?}");
            continue;
        }
        let err = error(r);
        let file = rewards_py().display().to_string();
        assert!(err.contains(&format!("python reward {file}:always_crash")), "{err}");
        assert!(err.contains("the worker failed twice on this sample"), "{err}");
        assert!(err.contains("exit status: 7"), "{err}");
    }
    assert_eq!(rm.fatal(), None);
    assert_eq!(rm.score(&sample(0, "a", "2")), Ok(RewardValue::Scalar(1.0)));
}

#[test]
fn repeated_crashes_stop_scoring_with_an_error_naming_the_file_and_stderr() {
    if !python_available() {
        return;
    }
    let rm = start("crash_every_time", json!({"backoff_ms": 1, "max_restarts": 2}));
    assert_eq!(rm.fatal(), None);
    let results = rm.score_group(&responses(&["a", "b"]));
    // The run stops here (Reward::fatal), rather than training on failed samples.
    assert!(rm.fatal().is_some_and(|why| why.contains("scoring stopped")));
    let file = rewards_py().display().to_string();
    for r in &results {
        let err = error(r);
        assert!(err.contains(&format!("python reward {file}:crash_every_time")), "{err}");
        assert!(err.contains("scoring stopped after 3 failed attempts in a row"), "{err}");
        assert!(err.contains("exit status: 9"), "{err}");
        assert!(err.contains("crashing on sample"), "{err}");
    }
    // Scoring has stopped: later calls fail at once, even for samples that would score.
    let started = Instant::now();
    let later = rm.score(&sample(0, "a", "2"));
    assert!(error(&later).contains("scoring stopped"), "{later:?}");
    assert!(started.elapsed() < Duration::from_millis(100));
    assert_eq!(rm.worker_pid(), None);
}

/// A process the reward function started dies with its worker (the worker's process group).
#[test]
fn a_dead_workers_children_are_killed_with_it() {
    if !python_available() {
        return;
    }
    let dir = scratch("orphans");
    let pidfile = dir.join("pid");
    let rm = start("spawn_and_crash", json!({"backoff_ms": 1, "max_restarts": 3}));
    let mut s = sample(0, "a", "2");
    s.metadata = json!({"pidfile": pidfile.to_string_lossy()});
    assert!(rm.score(&s).is_err());
    let pid: u32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    // Dead: gone, or a zombie waiting for whoever adopted it.
    let deadline = Instant::now() + Duration::from_secs(5);
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
    };
    while alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(), "the worker's child {pid} outlived it");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_hung_worker_is_killed_and_restarted() {
    if !python_available() {
        return;
    }
    let dir = scratch("hang-once");
    let marker = dir.join("hung").to_string_lossy().to_string();
    let rm = start("hang_once", json!({"timeout_secs": 0.5, "backoff_ms": 1}));
    let mut samples = responses(&["HANG", "a"]);
    for s in &mut samples {
        s.metadata = json!({"marker": marker});
    }
    let started = Instant::now();
    let results = rm.score_group(&samples);
    assert!(results.iter().all(|r| *r == Ok(RewardValue::Scalar(1.0))), "{results:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    std::fs::remove_dir_all(dir).unwrap();

    let rm = start("always_hang", json!({"timeout_secs": 0.3, "backoff_ms": 1, "max_restarts": 1}));
    let started = Instant::now();
    let result = rm.score(&sample(0, "HANG", "2"));
    let err = error(&result);
    assert!(err.contains("finished no sample within 0.3s (timeout_secs)"), "{err}");
    assert!(err.contains("scoring stopped after 2 failed attempts"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

#[test]
fn ten_thousand_samples_score_in_batches() {
    if !python_available() {
        return;
    }
    let rm = start("length_mod_7", Value::Null);
    let samples: Vec<Sample> = (0..10_000).map(|i| sample(i, &"x".repeat(i % 50), "")).collect();
    let started = Instant::now();
    let results = score_all(&rm, &samples, false);
    let elapsed = started.elapsed();
    println!("10k samples through the Python worker in {:.1} ms", elapsed.as_secs_f64() * 1e3);
    for (i, r) in results.iter().enumerate() {
        assert_eq!(*r, Ok(RewardValue::Scalar(((i % 50) % 7) as f64)), "sample {i}");
    }
}

#[test]
fn async_functions_of_one_batch_run_concurrently() {
    if !python_available() {
        return;
    }
    let rm = start("slow_length", Value::Null);
    assert!(rm.info().is_async);
    let mut samples: Vec<Sample> = (0..20).map(|i| sample(i, &"y".repeat(i), "")).collect();
    samples[3].response = "bad".into();
    let started = Instant::now();
    let results = rm.score_group(&samples);
    let elapsed = started.elapsed();
    // One after another this takes 4 s; gathered, about 0.2 s.
    assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    assert_eq!(error(&results[3]), "KeyError: 'bad'");
    for (i, r) in results.iter().enumerate().filter(|(i, _)| *i != 3) {
        assert_eq!(*r, Ok(RewardValue::Scalar(i as f64)));
    }
}

#[test]
fn a_group_function_gets_each_group_in_one_call() {
    if !python_available() {
        return;
    }
    let rm = start("longest_in_group", json!({"group": true}));
    let mut samples = responses(&["a", "abc", "ab", "xy", "x"]);
    for (s, g) in samples.iter_mut().zip([0, 0, 0, 1, 1]) {
        s.group_index = g;
    }
    let rewards: Vec<f64> = score_all(&rm, &samples, true)
        .into_iter()
        .map(|r| r.unwrap().scalar(None).unwrap())
        .collect();
    assert_eq!(rewards, [0.0, 1.0, 0.0, 1.0, 0.0]);

    let rm = start("group_raises", json!({"group": true}));
    let results = rm.score_group(&samples[..3]);
    assert!(results.iter().all(|r| error(r) == "RuntimeError: group 0 failed"), "{results:?}");

    let rm = start("group_too_short", json!({"group": true}));
    let results = rm.score_group(&samples[..3]);
    let want = "group_too_short was given a group of 3 samples and returned 1 rewards";
    assert!(results.iter().all(|r| error(r) == want), "{results:?}");
}

#[test]
fn setup_errors_name_the_file_the_function_and_the_cause() {
    if !python_available() {
        return;
    }
    let dir = scratch("setup");
    let missing = dir.join("missing.py");
    let err = start_err(missing.clone(), "f", None);
    assert!(
        err.contains(&format!("{}:f", missing.display())) && err.contains("not a file"),
        "{err}"
    );

    let broken = dir.join("broken.py");
    std::fs::write(&broken, "def f(sample):\n    return (1\n").unwrap();
    let err = start_err(broken.clone(), "f", None);
    assert!(err.contains(&format!("{}:f", broken.display())), "{err}");
    assert!(err.contains("SyntaxError") && err.contains("line 2"), "{err}");

    let raising = dir.join("raising.py");
    std::fs::write(&raising, "import no_such_module_for_miles\n").unwrap();
    let err = start_err(raising, "f", None);
    assert!(
        err.contains("ModuleNotFoundError: No module named 'no_such_module_for_miles'"),
        "{err}"
    );

    let err = start_err(rewards_py(), "nope", None);
    assert!(err.contains("has no function 'nope'") && err.contains("scalar"), "{err}");

    let err = start_err(rewards_py(), "scalar", Some(dir.join("no-python")));
    assert!(err.contains("cannot run") && err.contains("(--rm-python "), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn threads_sharing_one_reward_each_get_their_own_results() {
    if !python_available() {
        return;
    }
    let rm = start("length_mod_7", Value::Null);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let rm = &rm;
            scope.spawn(move || {
                for i in 0..25 {
                    let n = t * 100 + i;
                    let result = rm.score(&sample(n, &"z".repeat(n), ""));
                    assert_eq!(result, Ok(RewardValue::Scalar((n % 7) as f64)));
                }
            });
        }
    });
}
