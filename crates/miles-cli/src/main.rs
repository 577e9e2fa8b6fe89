use std::process::ExitCode;

fn main() -> ExitCode {
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
