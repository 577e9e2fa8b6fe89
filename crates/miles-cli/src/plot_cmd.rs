//! `miles plot RUN_DIR` (being written).

use std::io::Write;
use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A run directory holding metrics.jsonl.
    pub run_dir: PathBuf,
}

pub fn run(_args: &PlotArgs, _out: &mut dyn Write) -> anyhow::Result<()> {
    anyhow::bail!("miles plot is not built yet")
}
