//! Helpers shared by the integration tests: building workspace artifacts (plugin libraries,
//! the `miles` binary) with the same cargo that runs the tests, and scratch directories.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Builds `target` of `package` (debug profile, the shared target directory) and returns the
/// files cargo reports for it. A no-op when up to date, as after `cargo build --workspace`.
fn build(package: &str, target: &str, extra: &[&str]) -> Vec<PathBuf> {
    let output = Command::new(env!("CARGO"))
        .current_dir(workspace_root())
        .args(["build", "--quiet", "--message-format=json", "-p", package])
        .args(extra)
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo build -p {package} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut files = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if msg["reason"] != "compiler-artifact" || msg["target"]["name"] != target {
            continue;
        }
        for f in msg["filenames"].as_array().into_iter().flatten() {
            files.push(PathBuf::from(f.as_str().unwrap_or_default()));
        }
    }
    files
}

/// The shared library of a cdylib workspace package.
pub fn cdylib(package: &str) -> PathBuf {
    let ext = std::env::consts::DLL_EXTENSION;
    build(package, &package.replace('-', "_"), &[])
        .into_iter()
        .find(|p| p.extension().is_some_and(|e| e == ext))
        .unwrap_or_else(|| panic!("cargo built no .{ext} for {package}"))
}

/// The `miles` binary with the driver's default features.
pub fn miles_binary() -> PathBuf {
    build("miles-cli", "miles", &["--bin", "miles"])
        .into_iter()
        .find(|p| p.extension().is_none_or(|e| e == "exe"))
        .expect("cargo built the miles binary")
}

/// A fresh, empty directory under the target directory, named after the test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = workspace_root().join("target").join("test-scratch").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Runs `miles` in-process; returns its report or the error message (with causes).
pub fn miles(args: &[&str]) -> Result<String, String> {
    let mut out = Vec::new();
    let argv = std::iter::once("miles").chain(args.iter().copied());
    miles_cli::run(argv, &mut out).map_err(|e| format!("{e:#}"))?;
    Ok(String::from_utf8(out).expect("utf-8 report"))
}
