//! With the `cuda` feature: compiles every `kernels/*.cu` of the workspace with nvcc into a
//! fatbin (sm_90a machine code plus compute_90 PTX) and writes `$OUT_DIR/kernels.rs`, which
//! embeds them (`include_bytes!`) as `MODULES: &[(name, fatbin)]`. Without the feature it does
//! nothing.
//!
//! nvcc is `$NVCC`, else `<workspace>/.cache/cuda/nvidia/cu13/bin/nvcc` (installed by
//! `cargo xtask cuda-setup`), else `nvcc` on the PATH. `$NVCC_CCBIN` names the host compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Machine code for the H100/H200 (with Hopper-only instructions) and PTX the driver can JIT
/// for any later chip.
const GENCODE: &[&str] =
    &["-gencode", "arch=compute_90a,code=sm_90a", "-gencode", "arch=compute_90,code=compute_90"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=NVCC_CCBIN");
    println!("cargo:rerun-if-env-changed=NVCC_APPEND_FLAGS");
    println!("cargo:rerun-if-env-changed=NVCC_PREPEND_FLAGS");
    if let Err(e) = compile_kernels() {
        eprintln!("error: {e}");
        println!("cargo:warning={}", e.lines().next().unwrap_or("nvcc failed"));
        std::process::exit(1);
    }
}

fn compile_kernels() -> Result<(), String> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let workspace = manifest.parent().and_then(Path::parent).ok_or("no workspace root")?;
    let kernels = workspace.join("kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| e.to_string())?);
    println!("cargo:rerun-if-changed={}", kernels.display());

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .map_err(|e| format!("cannot read {}: {e}", kernels.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    // Headers shared by the kernels: a change to one recompiles them all.
    for entry in std::fs::read_dir(&kernels).map_err(|e| e.to_string())?.flatten() {
        println!("cargo:rerun-if-changed={}", entry.path().display());
    }

    let nvcc = find_nvcc(workspace)?;
    let mut table = String::from(
        "/// Kernel modules: (file stem, fatbin with sm_90a SASS and compute_90 PTX).\n",
    );
    table.push_str("pub const MODULES: &[(&str, &[u8])] = &[\n");
    for src in &sources {
        let stem = src.file_stem().and_then(|s| s.to_str()).ok_or("bad kernel file name")?;
        let fatbin = out.join(format!("{stem}.fatbin"));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("--fatbin")
            .args(GENCODE)
            .args(["-O3", "-std=c++17", "-lineinfo", "-Werror", "all-warnings"])
            .arg("-I")
            .arg(&kernels)
            .arg("-o")
            .arg(&fatbin)
            .arg(src);
        if let Some(ccbin) = std::env::var_os("NVCC_CCBIN") {
            cmd.arg("-ccbin").arg(ccbin);
        }
        let shown = format!("{cmd:?}");
        let output = cmd.output().map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
        if !output.status.success() {
            return Err(format!(
                "nvcc failed on {} ({}):\n{shown}\n{}{}",
                src.display(),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        table.push_str(&format!(
            "    ({stem:?}, include_bytes!({:?})),\n",
            fatbin.display().to_string()
        ));
    }
    table.push_str("];\n");
    std::fs::write(out.join("kernels.rs"), table).map_err(|e| e.to_string())
}

/// `$NVCC`, else the copy `cargo xtask cuda-setup` installs, else `nvcc` on the PATH.
fn find_nvcc(workspace: &Path) -> Result<PathBuf, String> {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return Ok(PathBuf::from(nvcc));
    }
    let local = workspace.join(".cache/cuda/nvidia/cu13/bin/nvcc");
    if local.is_file() {
        println!("cargo:rerun-if-changed={}", local.display());
        return Ok(local);
    }
    let on_path = Command::new("nvcc").arg("--version").output();
    if on_path.is_ok_and(|o| o.status.success()) {
        return Ok(PathBuf::from("nvcc"));
    }
    Err(format!(
        "the `cuda` feature needs nvcc 13.0, and none was found (not $NVCC, not {}, not on the \
         PATH): run `cargo xtask cuda-setup` first",
        local.display()
    ))
}
