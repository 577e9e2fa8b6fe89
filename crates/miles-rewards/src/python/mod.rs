//! Python reward functions: `--custom-rm-path FILE.py:FUNCTION` runs `FUNCTION` from `FILE.py`
//! in a long-lived Python worker process that miles starts (`python3`, or `--rm-python PATH`).
//! Nothing needs installing: the worker's helper (`worker.py`, written out as
//! `python_worker.py`) is embedded in the binary and written to a temporary directory when the
//! reward starts.
//!
//! # The function
//!
//! ```python
//! def compute_score(sample) -> float | dict[str, float]: ...     # sample["response"], sample.label
//! async def compute_score(args, sample): ...                      # slime's form; awaited
//! def compute_score(data_source, solution_str, ground_truth, extra_info=None): ...  # verl's form
//! def group_score(samples) -> list[float | dict]: ...             # --group-rm: one prompt's group
//! ```
//!
//! A sample is a dict that also reads as an object (`sample["response"]` or `sample.response`)
//! with `prompt` (text, or a list of `{"role", "content"}` messages), `response`, `label` (or
//! `None`), `metadata`, `group_index`, `index`, `status` and `response_length`. `args` is the
//! JSON object of `--custom-rm-config`, as attributes (`args.my_key`). A function with two
//! required positional parameters, or whose first is named `args`, is called as `f(args, sample)`;
//! one with a `solution_str` parameter as verl's `compute_score`; any other as `f(sample)`.
//! `async def` functions of one batch run concurrently (`asyncio.gather`, on one event loop that
//! lives as long as the worker).
//!
//! A reward is a number (bools and numpy/torch scalars count) or a dict of named numbers (train
//! on one with `--reward-key`). An exception fails that sample only, with the traceback's last
//! line (`ValueError: …`) as the reason (the first three tracebacks are printed in full); any
//! other return value (a string, `None`, NaN) fails the sample with a message saying what came
//! back. In group mode an exception fails the whole group.
//!
//! # Protocol
//!
//! JSON lines, one object each, UTF-8. The worker writes protocol lines to a private copy of its
//! original stdout and points file descriptor 1 and `sys.stdout` at stderr before it imports the
//! user's file, so prints (from Python or C) go to stderr, which miles forwards to its own
//! stderr line by line, prefixed with `[rm FILE:FUNCTION]`.
//!
//! ```text
//! miles → worker   {"args": {…}}                                   once, first
//! worker → miles   {"ready": true, "python": "3.11.7", "function": "f", "call": "sample", "async": false}
//!              or  {"ready": false, "error": "rewards.py has no function 'f' (…)"}  and exits
//! miles → worker   {"id": 7, "group": false, "samples": [{"prompt": …, "response": …, "label": …,
//!                   "metadata": …, "group_index": 0, "index": 3, "status": "completed",
//!                   "response_length": 12}, …]}
//! worker → miles   {"id": 7, "progress": 120}                      at most once a second
//! worker → miles   {"id": 7, "results": [{"reward": 1.0}, {"reward": {"acc": 1.0}},
//!                   {"error": "ZeroDivisionError: division by zero"}, …]}   one per sample
//!              or  {"id": 7, "error": "…"}                         the whole request failed
//! ```
//!
//! Closing the worker's stdin asks it to exit.
//!
//! # Failures
//!
//! A worker that exits, writes something that is not protocol, or finishes no sample for
//! `timeout_secs` (a group function: the whole group) is killed with every process it started
//! (the worker leads a process group of its own) and started again after a backoff that doubles
//! from `backoff_ms`. A failed batch is then split in halves, each sent on its own, so that a
//! sample that crashes the worker is found by bisection and fails alone; a single sample (or a
//! group, which cannot be split) is sent once more, and fails alone if the worker fails on it
//! again. After `max_restarts` restarts in a row without a successful request, scoring stops:
//! this and every later call fail all their samples with an error naming the file, the last
//! failure and the worker's last stderr lines. Problems found when the reward starts (no such
//! file, a syntax error, no such function, no `python3`) are returned by
//! [`PythonReward::start`] and stop the run before it begins.

pub mod generate;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use miles_core::{Error, PluginConfig, Reward, RewardError, RewardValue, Sample};
use serde_json::{Map, Value, json};

/// The worker's helper module, written out when a [`PythonReward`] starts.
const WORKER_SOURCE: &str = include_str!("worker.py");

/// The function called when the spec names none (`FILE.py` alone), as in verl.
pub const DEFAULT_FUNCTION: &str = "compute_score";

/// The config keys that steer the worker; any other key only reaches the function's `args`.
pub const PYTHON_CONFIG_KEYS: [&str; 5] =
    ["timeout_secs", "startup_timeout_secs", "max_restarts", "backoff_ms", "group"];

/// Longest wait before a restart.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Lines of the worker's stderr kept for error messages.
const STDERR_TAIL: usize = 20;
/// Lines of that tail quoted in the error that stops scoring.
const STDERR_QUOTED: usize = 8;
/// How long a worker asked to exit (stdin closed) may take before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// `FILE.py[:FUNCTION]` as given to `--custom-rm-path`: the file and the function, or `None`
/// when the spec does not name a `.py` file (a plugin library, say).
pub fn python_spec(spec: &str) -> Option<(PathBuf, String)> {
    if let Some((file, function)) = spec.rsplit_once(':')
        && file.ends_with(".py")
        && !function.is_empty()
    {
        return Some((PathBuf::from(file), function.to_string()));
    }
    spec.ends_with(".py").then(|| (PathBuf::from(spec), DEFAULT_FUNCTION.to_string()))
}

/// Configuration of [`PythonReward`], read from the `--custom-rm-config` JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonRewardConfig {
    /// A request that finishes no sample for this long means a hung worker (`timeout_secs`,
    /// default 60).
    pub timeout: Duration,
    /// Bound on importing the user's file (`startup_timeout_secs`, default 120).
    pub startup_timeout: Duration,
    /// Restarts in a row before scoring stops (`max_restarts`, default 3).
    pub max_restarts: u32,
    /// Wait before the first restart; doubles for each further one (`backoff_ms`, default 500).
    pub backoff: Duration,
    /// The function scores a whole group: a list of samples in, a list of rewards out
    /// (`--group-rm`, or `group: true`).
    pub group: bool,
    /// The whole config object, handed to the function as `args`.
    pub args: Map<String, Value>,
}

impl Default for PythonRewardConfig {
    fn default() -> Self {
        PythonRewardConfig {
            timeout: Duration::from_secs(60),
            startup_timeout: Duration::from_secs(120),
            max_restarts: 3,
            backoff: Duration::from_millis(500),
            group: false,
            args: Map::new(),
        }
    }
}

impl PythonRewardConfig {
    pub fn from_json(config: &PluginConfig) -> miles_core::Result<PythonRewardConfig> {
        let object = match config {
            Value::Null => Map::new(),
            Value::Object(map) => map.clone(),
            other => {
                return Err(Error::config(
                    "custom-rm-config",
                    format!("a Python reward takes a JSON object, got {other}"),
                ));
            }
        };
        let bad = |key: &str, want: &str, got: &Value| {
            Error::config("custom-rm-config", format!("{key} must be {want}, got {got}"))
        };
        let seconds = |key: &str, default: Duration| match object.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|t| t.is_finite() && *t > 0.0 && *t <= 86_400.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| bad(key, "a number of seconds in (0, 86400]", v)),
        };
        let count = |key: &str, default: u64, max: u64| match object.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|n| *n <= max)
                .ok_or_else(|| bad(key, &format!("an integer in 0..={max}"), v)),
        };
        let defaults = PythonRewardConfig::default();
        let group = match object.get("group") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(bad("group", "true or false", other)),
        };
        Ok(PythonRewardConfig {
            timeout: seconds("timeout_secs", defaults.timeout)?,
            startup_timeout: seconds("startup_timeout_secs", defaults.startup_timeout)?,
            max_restarts: count("max_restarts", 3, 100)? as u32,
            backoff: Duration::from_millis(count("backoff_ms", 500, 60_000)?),
            group,
            args: object,
        })
    }
}

/// What the worker said when it was ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    /// The worker's Python version, `3.11.7`.
    pub python_version: String,
    /// How the function is called: `sample`, `args_sample` (slime) or `verl`.
    pub call: String,
    /// Whether the function is `async def`.
    pub is_async: bool,
}

/// What a worker runs, which names its flag and its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// A reward function (`--custom-rm-path`): one reward per sample.
    Reward,
    /// A generate function (`--custom-generate-function-path`): one sample per sample.
    Generate,
}

impl Role {
    fn flag(self) -> &'static str {
        match self {
            Role::Reward => "--custom-rm-path",
            Role::Generate => "--custom-generate-function-path",
        }
    }

    /// The prefix of the worker's forwarded stderr: `[rm FILE:FUNCTION]`.
    fn tag(self) -> &'static str {
        match self {
            Role::Reward => "rm",
            Role::Generate => "generate",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Role::Reward => "python reward",
            Role::Generate => "python generate function",
        }
    }

    fn doing(self) -> &'static str {
        match self {
            Role::Reward => "scoring",
            Role::Generate => "generating",
        }
    }
}

/// A reward computed by a Python function in a worker process; see the module documentation.
pub struct PythonReward(PythonWorker);

/// A Python function in a worker process, restarted as it fails (the module documentation):
/// a [`PythonReward`]'s or a [`generate::PythonGenerate`]'s.
pub(crate) struct PythonWorker {
    role: Role,
    file: PathBuf,
    function: String,
    python: PathBuf,
    config: PythonRewardConfig,
    /// `FILE:FUNCTION`, in messages and as the prefix of forwarded stderr.
    label: String,
    /// Holds the helper; removed when the reward is dropped.
    helper_dir: PathBuf,
    info: WorkerInfo,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    state: Mutex<State>,
}

struct State {
    worker: Option<Worker>,
    next_id: u64,
    /// Failed attempts since the last successful request.
    failures_in_a_row: u32,
    /// Why scoring stopped, once it has.
    stopped: Option<String>,
}

impl std::fmt::Debug for PythonReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for PythonWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(match self.role {
            Role::Reward => "PythonReward",
            Role::Generate => "PythonGenerate",
        })
        .field("label", &self.label)
        .field("python", &self.python)
        .field("config", &self.config)
        .field("info", &self.info)
        .finish_non_exhaustive()
    }
}

impl PythonReward {
    /// Starts the worker for `function` in `file` with `python` (default `python3`) and waits
    /// until it has imported the file. Errors name the file and the function and carry the
    /// Python traceback's last line.
    pub fn start(
        file: impl Into<PathBuf>,
        function: &str,
        python: Option<PathBuf>,
        config: PythonRewardConfig,
    ) -> miles_core::Result<PythonReward> {
        PythonWorker::start(Role::Reward, file.into(), function, python, config).map(PythonReward)
    }

    /// `FILE:FUNCTION`.
    pub fn label(&self) -> &str {
        &self.0.label
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.0.info
    }

    pub fn config(&self) -> &PythonRewardConfig {
        &self.0.config
    }

    /// The process id of the current worker, if one is running.
    pub fn worker_pid(&self) -> Option<u32> {
        self.0.worker_pid()
    }

    /// Scores `samples` in one request (see the module docs, Failures).
    fn run(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        let items = samples.iter().map(sample_payload).collect();
        let label = &self.0.label;
        self.0
            .run(items, self.0.config.group, &Value::Null)
            .into_iter()
            .map(|r| r.map_err(RewardError::new).and_then(|item| decode_result(label, &item)))
            .collect()
    }
}

impl PythonWorker {
    /// [`PythonReward::start`] for `role`.
    pub(crate) fn start(
        role: Role,
        file: PathBuf,
        function: &str,
        python: Option<PathBuf>,
        config: PythonRewardConfig,
    ) -> miles_core::Result<PythonWorker> {
        let label = format!("{}:{function}", file.display());
        let flag = role.flag();
        if !file.is_file() {
            return Err(Error::Plugin(format!("{flag} {label}: {} is not a file", file.display())));
        }
        let helper_dir =
            write_helper().map_err(|e| Error::Plugin(format!("{flag} {label}: {e}")))?;
        let hint = match &python {
            Some(python) => format!(" (--rm-python {})", python.display()),
            None => " (is Python 3 installed? --rm-python PATH names the interpreter)".to_string(),
        };
        let mut reward = PythonWorker {
            role,
            file,
            function: function.to_string(),
            python: python.unwrap_or_else(|| PathBuf::from("python3")),
            config,
            label,
            helper_dir,
            info: WorkerInfo {
                python_version: String::new(),
                call: String::new(),
                is_async: false,
            },
            stderr_tail: Arc::default(),
            state: Mutex::new(State {
                worker: None,
                next_id: 0,
                failures_in_a_row: 0,
                stopped: None,
            }),
        };
        let (worker, info) = reward.spawn().map_err(|failure| {
            let hint = if matches!(failure, Failure::Spawn(_)) { hint.as_str() } else { "" };
            Error::Plugin(format!("{flag} {}: {failure}{hint}", reward.label))
        })?;
        reward.info = info;
        reward.state.get_mut().unwrap_or_else(|p| p.into_inner()).worker = Some(worker);
        Ok(reward)
    }

    /// The process id of the current worker, if one is running.
    pub(crate) fn worker_pid(&self) -> Option<u32> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.worker.as_ref().map(|w| w.child.id())
    }

    /// Starts a worker and waits for its ready line.
    fn spawn(&self) -> Result<(Worker, WorkerInfo), Failure> {
        let mut command = Command::new(&self.python);
        // A group of its own: killing the worker kills whatever it started too.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command
            .arg("-u")
            .arg(self.helper_dir.join("python_worker.py"))
            .arg(&self.file)
            .arg(&self.function)
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONIOENCODING", "utf-8")
            // Importing the user's file must not leave __pycache__ beside it.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Failure::Spawn(format!("cannot run {}: {e}", self.python.display())))?;
        let (stdin, stdout, stderr) =
            match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
                (Some(i), Some(o), Some(e)) => (i, o, e),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(Failure::Spawn("the worker's pipes were not set up".into()));
                }
            };
        let stderr_closed = forward_stderr(
            stderr,
            format!("[{} {}] ", self.role.tag(), self.label),
            Arc::clone(&self.stderr_tail),
        );
        let mut worker = Worker {
            child,
            requests: Some(write_requests(stdin)),
            lines: read_lines(stdout),
            stderr_closed,
        };
        let mode = match self.role {
            Role::Reward => "reward",
            Role::Generate => "generate",
        };
        let init = json!({"args": self.config.args, "mode": mode});
        let ready = worker.send(&init).and_then(|()| worker.ready(self.config.startup_timeout));
        match ready {
            Ok(info) => Ok((worker, info)),
            Err(failure) => {
                worker.kill();
                Err(failure)
            }
        }
    }

    /// Runs the function on `samples` (their payloads; one call on them all when `group`),
    /// with `extra`'s keys added to the request, restarting the worker as needed (see the
    /// module docs, Failures): one result object per sample, or why it has none.
    pub(crate) fn run(
        &self,
        samples: Vec<Value>,
        group: bool,
        extra: &Value,
    ) -> Vec<Result<Value, String>> {
        if samples.is_empty() {
            return Vec::new();
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.run_locked(&mut state, (&samples, group, extra), false)
    }

    /// [`Self::run`] with the state held; `again` when `samples` already failed once alone.
    fn run_locked(
        &self,
        state: &mut State,
        (samples, group, extra): (&[Value], bool, &Value),
        again: bool,
    ) -> Vec<Result<Value, String>> {
        let all_failed = |message: &str| -> Vec<Result<Value, String>> {
            samples.iter().map(|_| Err(message.to_string())).collect()
        };
        if let Some(reason) = &state.stopped {
            return all_failed(reason);
        }
        state.next_id += 1;
        let id = state.next_id;
        let mut request = json!({"id": id, "group": group, "samples": samples});
        if let (Value::Object(request), Value::Object(extra)) = (&mut request, extra) {
            request.extend(extra.clone());
        }
        let worker = match state.worker.take() {
            Some(worker) => Ok(worker),
            None => self.spawn().map(|(worker, _)| worker),
        };
        let attempt = worker.and_then(|mut worker| {
            let reply = worker.call(id, &request, samples.len(), self.config.timeout);
            if reply.is_ok() {
                state.worker = Some(worker);
            } else {
                worker.kill();
            }
            reply
        });
        let failure = match attempt {
            Ok(Reply::Results(items)) => {
                state.failures_in_a_row = 0;
                return items.into_iter().map(Ok).collect();
            }
            Ok(Reply::Error(message)) => {
                state.failures_in_a_row = 0;
                return all_failed(&message);
            }
            Err(failure) => failure,
        };
        state.failures_in_a_row += 1;
        let failures = state.failures_in_a_row;
        if failures > self.config.max_restarts {
            let reason = self.stop_reason(failures, &failure);
            eprintln!("[{} {}] {reason}", self.role.tag(), self.label);
            state.stopped = Some(reason.clone());
            return all_failed(&reason);
        }
        if again {
            // The worker failed on these samples twice: they fail alone, scoring goes on.
            let these = match samples.len() {
                1 => "this sample".to_string(),
                n => format!("this group of {n} samples"),
            };
            let message = format!(
                "{} {}: the worker failed twice on {these}: {failure}",
                self.role.what(),
                self.label
            );
            eprintln!("[{} {}] {message}", self.role.tag(), self.label);
            return all_failed(&message);
        }
        let wait = self.config.backoff.saturating_mul(1 << (failures - 1).min(16)).min(MAX_BACKOFF);
        let next = if samples.len() > 1 && !group {
            "running each half of the batch on its own"
        } else {
            "trying again"
        };
        eprintln!(
            "[{} {}] {failure}; restarting the worker in {:.1}s (restart {failures} of at most \
             {}), {next}",
            self.role.tag(),
            self.label,
            wait.as_secs_f64(),
            self.config.max_restarts
        );
        std::thread::sleep(wait);
        if samples.len() > 1 && !group {
            let (first, second) = samples.split_at(samples.len() / 2);
            let mut results = self.run_locked(state, (first, group, extra), false);
            results.extend(self.run_locked(state, (second, group, extra), false));
            results
        } else {
            self.run_locked(state, (samples, group, extra), true)
        }
    }

    fn stop_reason(&self, failures: u32, last: &Failure) -> String {
        let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        let quoted: Vec<&str> = tail
            .iter()
            .skip(tail.len().saturating_sub(STDERR_QUOTED))
            .map(String::as_str)
            .collect();
        let stderr = if quoted.is_empty() { "nothing".to_string() } else { quoted.join(" | ") };
        format!(
            "{} {}: {} stopped after {failures} failed attempts in a row (max_restarts {}); \
             last: {last}; the worker's last stderr lines: {stderr}",
            self.role.what(),
            self.label,
            self.role.doing(),
            self.config.max_restarts
        )
    }

    /// Why the function can run no more, once it cannot.
    pub(crate) fn stopped(&self) -> Option<String> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped.clone()
    }

    /// `FILE:FUNCTION`.
    pub(crate) fn label(&self) -> &str {
        &self.label
    }
}

/// What a line of the worker's output says about request `id`.
#[derive(Debug)]
enum Answer {
    /// About another (an abandoned) request.
    Other,
    /// A sample of it finished: the timeout starts again.
    Progress,
    Done(Reply),
}

/// Reads one line of the worker's output while request `id` of `n` samples (`samples`, in
/// words) is out; a line that is not the protocol's is a [`Failure::Protocol`].
fn read_answer(line: &str, id: u64, n: usize, samples: &str) -> Result<Answer, Failure> {
    let answer: Value = serde_json::from_str(line).map_err(|_| {
        Failure::Protocol(format!("the worker wrote a line that is not protocol JSON: {line}"))
    })?;
    if answer.get("id").and_then(Value::as_u64) != Some(id) {
        return Ok(Answer::Other);
    }
    if answer.get("progress").is_some() {
        return Ok(Answer::Progress);
    }
    match (answer.get("results"), answer.get("error")) {
        (Some(Value::Array(items)), _) if items.len() == n => {
            Ok(Answer::Done(Reply::Results(items.clone())))
        }
        (_, Some(Value::String(message))) => Ok(Answer::Done(Reply::Error(message.clone()))),
        _ => Err(Failure::Protocol(format!(
            "the worker's answer to a batch of {samples} is not one result per sample: {line}"
        ))),
    }
}

/// One sample's result in a worker's answer (`{"reward": x}`, `{"reward": {name: x}}` or
/// `{"error": message}`) as a reward of the reward labelled `label`.
fn decode_result(label: &str, item: &Value) -> Result<RewardValue, RewardError> {
    match (item.get("reward"), item.get("error")) {
        (Some(Value::Number(n)), _) => n
            .as_f64()
            .map(RewardValue::Scalar)
            .ok_or_else(|| RewardError::new(format!("python reward {label}: {n} is not a number"))),
        (Some(Value::Object(map)), _) => map
            .iter()
            .map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
            .collect::<Option<_>>()
            .map(RewardValue::Named)
            .ok_or_else(|| {
                RewardError::new(format!("python reward {label}: bad named reward {item}"))
            }),
        (_, Some(Value::String(message))) => Err(RewardError::new(message.clone())),
        _ => Err(RewardError::new(format!(
            "python reward {label}: the worker answered {item}, not a result"
        ))),
    }
}

/// The fuzzing harness's way in (`fuzz/`): one line of a worker's output, read as the answer
/// to request 7 of 2 samples, and its results decoded; errors are the expected outcome.
#[doc(hidden)]
pub fn fuzz_worker_line(line: &str) {
    if let Ok(Answer::Done(Reply::Results(items))) = read_answer(line, 7, 2, "2 samples") {
        for item in &items {
            let _ = decode_result("fuzz", item);
        }
    }
}

impl Reward for PythonReward {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        self.run(std::slice::from_ref(sample))
            .pop()
            .unwrap_or_else(|| Err(RewardError::new("no result")))
    }

    /// One request for the whole slice: one call of a group function, or one batch of
    /// independent samples (run concurrently when the function is `async`).
    fn score_group(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        self.run(samples)
    }

    /// Set once the worker failed more than `max_restarts` times in a row.
    fn fatal(&self) -> Option<String> {
        self.0.stopped()
    }
}

impl Drop for PythonWorker {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(worker) = state.worker.take() {
            worker.shut_down();
        }
        let _ = std::fs::remove_dir_all(&self.helper_dir);
    }
}

/// What a sample looks like to the Python function.
fn sample_payload(sample: &Sample) -> Value {
    json!({
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
        "group_index": sample.group_index,
        "index": sample.index,
        "status": sample.status,
        "response_length": sample.response_length,
    })
}

/// Writes the helper into a fresh temporary directory, returned.
fn write_helper() -> std::io::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("miles-python-rm-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("python_worker.py");
    std::fs::write(&path, WORKER_SOURCE).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()))
    })?;
    Ok(dir)
}

/// Why a worker could not answer a request.
#[derive(Debug)]
enum Failure {
    /// The interpreter could not be started.
    Spawn(String),
    /// The worker said it cannot run the function (bad file, missing function).
    Setup(String),
    Exited(String),
    Hung(String),
    Protocol(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Spawn(m)
            | Failure::Setup(m)
            | Failure::Exited(m)
            | Failure::Hung(m)
            | Failure::Protocol(m) => f.write_str(m),
        }
    }
}

/// The worker's answer to a request.
#[derive(Debug)]
enum Reply {
    /// One result object per sample.
    Results(Vec<Value>),
    /// The whole request failed (a group function raised).
    Error(String),
}

/// One running worker process.
struct Worker {
    child: Child,
    /// Lines to the worker's stdin, written by a thread so that a worker that stops reading
    /// cannot block miles; dropping it closes stdin.
    requests: Option<Sender<Vec<u8>>>,
    /// Lines from the worker's stdout; disconnected when it closes.
    lines: Receiver<String>,
    /// Disconnected once all of the worker's stderr has been forwarded.
    stderr_closed: Receiver<()>,
}

impl Worker {
    fn send(&mut self, message: &Value) -> Result<(), Failure> {
        let mut line = serde_json::to_vec(message)
            .map_err(|e| Failure::Protocol(format!("cannot encode the request: {e}")))?;
        line.push(b'\n');
        let sent = self.requests.as_ref().is_some_and(|r| r.send(line).is_ok());
        if sent { Ok(()) } else { Err(self.exited("before it was sent a request")) }
    }

    fn ready(&mut self, timeout: Duration) -> Result<WorkerInfo, Failure> {
        let line = match self.lines.recv_timeout(timeout) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                return Err(Failure::Hung(format!(
                    "the worker was not ready within {:.1}s (startup_timeout_secs)",
                    timeout.as_secs_f64()
                )));
            }
            Err(RecvTimeoutError::Disconnected) => return Err(self.exited("while starting")),
        };
        let hello: Value = serde_json::from_str(&line).map_err(|_| {
            Failure::Protocol(format!("the worker's first line is not protocol JSON: {line}"))
        })?;
        match hello.get("ready") {
            Some(Value::Bool(true)) => Ok(WorkerInfo {
                python_version: hello["python"].as_str().unwrap_or("?").to_string(),
                call: hello["call"].as_str().unwrap_or("?").to_string(),
                is_async: hello["async"].as_bool().unwrap_or(false),
            }),
            _ => Err(Failure::Setup(
                hello["error"].as_str().map_or_else(|| line.clone(), str::to_string),
            )),
        }
    }

    /// Sends request `id` of `n` samples and waits for its answer; a progress line from the
    /// worker gives it another `timeout`.
    fn call(
        &mut self,
        id: u64,
        request: &Value,
        n: usize,
        timeout: Duration,
    ) -> Result<Reply, Failure> {
        self.send(request)?;
        let samples = if n == 1 { "1 sample".to_string() } else { format!("{n} samples") };
        let mut deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Failure::Hung(format!(
                        "the worker finished no sample within {:.1}s (timeout_secs) of a batch of \
                         {samples}; it was killed",
                        timeout.as_secs_f64()
                    )));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.exited(&format!("while running a batch of {samples}")));
                }
            };
            match read_answer(&line, id, n, &samples)? {
                Answer::Other => {}
                Answer::Progress => deadline = Instant::now() + timeout,
                Answer::Done(reply) => return Ok(reply),
            }
        }
    }

    /// The failure of a worker whose stdout closed: it exited (or is about to).
    fn exited(&mut self, when: &str) -> Failure {
        let status = wait_for_exit(&mut self.child, EXIT_GRACE);
        // What it started may hold its stderr open.
        kill_group(&self.child);
        self.drain_stderr();
        Failure::Exited(match status {
            Some(status) => format!("the worker exited ({status}) {when}"),
            None => format!("the worker closed its output {when} and was killed"),
        })
    }

    /// Waits a little for the dead worker's last stderr lines to be forwarded, so that error
    /// messages quote them; a process it left behind may hold the pipe open, hence the bound.
    fn drain_stderr(&self) {
        let _ = self.stderr_closed.recv_timeout(Duration::from_millis(500));
    }

    fn kill(&mut self) {
        self.requests = None;
        kill_group(&self.child);
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.drain_stderr();
    }

    /// Closes the worker's stdin, which asks it to exit; kills it if it does not, and what it
    /// left running either way.
    fn shut_down(mut self) {
        self.requests = None;
        if wait_for_exit(&mut self.child, EXIT_GRACE).is_none() {
            self.kill();
        }
        kill_group(&self.child);
    }
}

/// SIGKILLs the worker's process group: the worker and every process it started that did not
/// leave the group. (Once the worker is reaped, its id stays reserved while the group has a
/// member, so a leftover group is still the worker's.)
fn kill_group(child: &Child) {
    let Ok(id) = i32::try_from(child.id()) else { return };
    // SAFETY: kill(2) with a negative id signals that process group; no memory is involved.
    unsafe {
        libc::kill(-id, libc::SIGKILL);
    }
}

/// Waits up to `grace` for the child to exit; kills it after that. `None` if it had to be
/// killed.
fn wait_for_exit(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    let until = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                kill_group(child);
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

fn write_requests(mut stdin: ChildStdin) -> Sender<Vec<u8>> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        for line in rx {
            if stdin.write_all(&line).and_then(|()| stdin.flush()).is_err() {
                break;
            }
        }
    });
    tx
}

fn read_lines(stdout: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

/// Copies the worker's stderr to ours, each line prefixed, and keeps its last lines. The
/// receiver disconnects when the copying is done.
fn forward_stderr(
    stderr: impl Read + Send + 'static,
    prefix: String,
    tail: Arc<Mutex<VecDeque<String>>>,
) -> Receiver<()> {
    let (done, closed) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let _done = done;
        let mut reader = BufReader::new(stderr);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    eprintln!("{prefix}{line}");
                    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        }
    });
    closed
}

#[cfg(test)]
mod worker_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_a_python_file_and_a_function() {
        assert_eq!(python_spec("r.py:score"), Some((PathBuf::from("r.py"), "score".into())));
        assert_eq!(
            python_spec("dir/my_rewards.py"),
            Some((PathBuf::from("dir/my_rewards.py"), DEFAULT_FUNCTION.into()))
        );
        assert_eq!(python_spec("libx.so:sym"), None);
        assert_eq!(python_spec("libx.so"), None);
        assert_eq!(python_spec("r.py:"), None);
    }

    #[test]
    fn config_defaults_pass_unknown_keys_and_reject_bad_values() {
        let c = PythonRewardConfig::from_json(&Value::Null).unwrap();
        assert_eq!(c, PythonRewardConfig::default());
        let c = PythonRewardConfig::from_json(&json!({"timeout_secs": 0.5, "max_restarts": 0,
            "backoff_ms": 1, "group": true, "threshold": 0.3}))
        .unwrap();
        assert_eq!(
            (c.timeout, c.max_restarts, c.backoff, c.group),
            (Duration::from_millis(500), 0, Duration::from_millis(1), true)
        );
        assert_eq!(c.args["threshold"], json!(0.3));
        for bad in [
            json!({"timeout_secs": 0}),
            json!({"startup_timeout_secs": "1"}),
            json!({"max_restarts": -1}),
            json!({"group": "yes"}),
            json!([1]),
        ] {
            let err = PythonRewardConfig::from_json(&bad).unwrap_err().to_string();
            assert!(err.starts_with("--custom-rm-config:"), "{err}");
        }
    }

    #[test]
    fn the_helper_is_written_out_and_removed() {
        let dir = write_helper().unwrap();
        let text = std::fs::read_to_string(dir.join("python_worker.py")).unwrap();
        assert_eq!(text, WORKER_SOURCE);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
