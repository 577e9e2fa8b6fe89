//! `cargo xtask …`: the project's build, test, CI and benchmark entry points.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

/// Plugin names users pass to `--features`, and the driver's cargo feature each one turns on.
/// Only plugins whose crate exists are offered; a test checks this against the driver's
/// `Cargo.toml`.
const PLUGINS: &[(&str, &str)] = &[("tis", "tis")];

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
}

type Result<T = ()> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let result = match Xtask::parse().command {
        Task::Build { features, release } => build(&features, release).map(|exe| {
            println!("built {}", exe.display());
        }),
        Task::Test => test(),
        Task::Ci => ci(),
        Task::Bench { args } => bench(&args),
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

fn test() -> Result {
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
    let mut clippy = cargo();
    clippy.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    run(clippy)?;
    check_plugin_features()?;
    test()
}

/// Builds the driver with no plugin and with every plugin, and checks what `miles plugins`
/// lists each time: a plugin crate the linker dropped would show here.
fn check_plugin_features() -> Result {
    let all: Vec<String> = PLUGINS.iter().map(|(p, _)| p.to_string()).collect();
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
        for (plugin, _) in PLUGINS {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_plugins_are_refused_with_the_valid_names() {
        assert_eq!(driver_features(&["tis".into(), "tis".into()]).unwrap(), vec!["tis"]);
        assert!(driver_features(&[]).unwrap().is_empty());
        let err = driver_features(&["fp8".into()]).unwrap_err();
        assert!(err.contains("unknown plugin 'fp8'") && err.contains("tis"), "{err}");
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
    }
}
