use std::process::ExitCode;

fn main() -> ExitCode {
    // NVLink multicast stays off in NCCL unless asked for: a program that uses it can put a
    // host's shared GPUs out of service. `--nproc-per-node` sets it for its workers; this also
    // covers ranks started by torchrun or Slurm.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: the first thing the process does, before any other thread exists.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let cli = miles_cli::Cli::parse_or_exit();
    let stdout = std::io::stdout();
    match miles_cli::execute(cli, &mut stdout.lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
