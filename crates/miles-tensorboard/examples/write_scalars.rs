//! Writes a few steps of made-up metrics into DIR, for checking the file with TensorBoard's own
//! reader: `cargo run -p miles-tensorboard --example write_scalars -- DIR`, then
//! `python tests/fixtures/tensorboard/read_events.py DIR`.

use std::path::PathBuf;
use std::process::ExitCode;

use miles_tensorboard::EventWriter;

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: write_scalars DIR");
        return ExitCode::FAILURE;
    };
    match write(&dir) {
        Ok(path) => {
            println!("{}", path.display());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn write(dir: &std::path::Path) -> Result<PathBuf, miles_tensorboard::Error> {
    let mut writer = EventWriter::create(dir)?;
    let start = miles_tensorboard::wall_time_now();
    for step in 0..4i64 {
        let x = step as f64;
        let loss = if step == 2 { f64::NAN } else { 2.0 / (1.0 + x) };
        let scalars = [
            ("train/loss", loss),
            ("rollout/raw_reward", 0.25 * x),
            ("perf/step_time", if step == 3 { f64::INFINITY } else { 0.1 + x }),
        ];
        writer.write_scalars(step, start + x, &scalars)?;
    }
    Ok(writer.path().to_path_buf())
}
