//! `miles plot RUN_DIR [RUN_DIR…]`: a run's metrics.jsonl drawn to one PNG per chart, or several
//! runs side by side (each series named by its run).

use std::io::Write;
use std::path::PathBuf;

use anyhow::bail;
use clap::Args;

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// Run directories holding metrics.jsonl; with several, each chart draws them all.
    #[arg(required = true)]
    pub run_dirs: Vec<PathBuf>,
    /// Where the PNG files go (created if missing) [default: RUN_DIR/plots; required with
    /// several runs].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: &PlotArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let out_dir = match (&args.out, args.run_dirs.as_slice()) {
        (Some(dir), _) => dir.clone(),
        (None, [one]) => one.join("plots"),
        (None, _) => bail!("--out: say where the side-by-side charts of several runs go"),
    };
    let mut runs = Vec::new();
    for dir in &args.run_dirs {
        runs.push(miles_plot::read_metrics(&dir.join(miles_plot::METRICS_FILE))?);
    }
    // One run keeps its metrics' names; several are told apart by their directories' names.
    let labels: Vec<String> = match args.run_dirs.as_slice() {
        [_] => vec![String::new()],
        dirs => dirs.iter().map(|d| label(d)).collect(),
    };
    let pairs: Vec<(&str, &[miles_plot::Record])> =
        labels.iter().map(String::as_str).zip(runs.iter().map(Vec::as_slice)).collect();
    let report = miles_plot::plot_runs(&pairs, &out_dir)?;
    for path in &report.written {
        writeln!(out, "wrote {}", path.display())?;
    }
    for spec in &report.skipped {
        writeln!(out, "skipped {}: no data for {}", spec.file, spec.describe())?;
    }
    let records: usize = runs.iter().map(Vec::len).sum();
    let sources: Vec<String> = args
        .run_dirs
        .iter()
        .map(|d| d.join(miles_plot::METRICS_FILE).display().to_string())
        .collect();
    writeln!(
        out,
        "plotted {} of {} charts from {records} records of {} into {}",
        report.written.len(),
        miles_plot::CHARTS.len(),
        sources.join(", "),
        out_dir.display()
    )?;
    Ok(())
}

/// A run's name in a legend: its directory's last component.
fn label(dir: &std::path::Path) -> String {
    dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}
