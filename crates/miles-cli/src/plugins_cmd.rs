use std::io::Write;

use clap::Args;
use miles_plugin_abi::host;
use serde::Serialize;

use crate::linked;

#[derive(Debug, Args)]
pub struct PluginsArgs {
    /// Also list the reward plugin in this shared library (`LIB[:SYMBOL]`); repeatable.
    #[arg(long = "custom-rm-path", value_name = "LIB")]
    pub custom_rm_path: Vec<String>,
    /// Print one JSON object per plugin instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    kind: String,
    name: String,
    version: String,
    source: &'static str,
    detail: String,
}

pub fn run(args: &PluginsArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    linked::plugins();
    let mut rows: Vec<Row> = miles_core::registry::list()
        .into_iter()
        .map(|p| Row {
            kind: p.kind().to_string(),
            name: p.name.to_string(),
            version: p.version.to_string(),
            source: "static",
            detail: p.description.to_string(),
        })
        .collect();
    for spec in &args.custom_rm_path {
        // A Python reward is not a library: listed as given, started only by a run.
        if let Some((file, function)) = miles_rewards::python_spec(spec) {
            let kind = miles_core::PluginKind::Reward.to_string();
            let detail = format!("{} (Python worker)", file.display());
            rows.push(Row { kind, name: function, version: "-".into(), source: "python", detail });
            continue;
        }
        let (name, version) = host::describe(spec)?;
        let kind = miles_core::PluginKind::Reward.to_string();
        rows.push(Row { kind, name, version, source: "dynamic", detail: spec.clone() });
    }
    if args.json {
        for row in &rows {
            writeln!(out, "{}", serde_json::to_string(row)?)?;
        }
        return Ok(());
    }
    let width = |f: fn(&Row) -> usize, header: &str| {
        rows.iter().map(f).chain([header.len()]).max().unwrap_or(0)
    };
    let (wk, wn, wv) = (
        width(|r| r.kind.len(), "KIND"),
        width(|r| r.name.len(), "NAME"),
        width(|r| r.version.len(), "VERSION"),
    );
    writeln!(
        out,
        "{:wk$}  {:wn$}  {:wv$}  {:7}  DESCRIPTION",
        "KIND", "NAME", "VERSION", "SOURCE"
    )?;
    for r in &rows {
        writeln!(
            out,
            "{:wk$}  {:wn$}  {:wv$}  {:7}  {}",
            r.kind, r.name, r.version, r.source, r.detail
        )?;
    }
    Ok(())
}
