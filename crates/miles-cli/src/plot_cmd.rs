//! `miles plot RUN_DIR`: a run's metrics.jsonl drawn to one PNG per chart.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A run directory holding metrics.jsonl.
    pub run_dir: PathBuf,
    /// Where the PNG files go (created if missing) [default: RUN_DIR/plots].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: &PlotArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let metrics = args.run_dir.join(miles_plot::METRICS_FILE);
    let out_dir = args.out.clone().unwrap_or_else(|| args.run_dir.join("plots"));
    let records = miles_plot::read_metrics(&metrics)?;
    let report = miles_plot::plot_records(&records, &out_dir)?;
    for path in &report.written {
        writeln!(out, "wrote {}", path.display())?;
    }
    for spec in &report.skipped {
        writeln!(out, "skipped {}: no data for {}", spec.file, spec.describe())?;
    }
    writeln!(
        out,
        "plotted {} of {} charts from {} records of {} into {}",
        report.written.len(),
        miles_plot::CHARTS.len(),
        records.len(),
        metrics.display(),
        out_dir.display()
    )?;
    Ok(())
}
