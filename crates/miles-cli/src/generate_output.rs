//! `miles generate`'s output file: samples appended as their groups finish, so that a killed
//! run keeps them; `--resume` reads back the complete groups and generates only the rest; at
//! the end the file is rewritten in prompt order.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use miles_core::{Sample, Status};

/// The output file being written.
pub struct Output {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    /// The first write that failed: later writes are skipped and `finish` returns it.
    failed: Option<anyhow::Error>,
}

impl Output {
    /// Starts `path` afresh, or with `kept` (the groups of an earlier run) already in it.
    pub fn create(path: &Path, kept: &[Vec<Sample>]) -> anyhow::Result<Self> {
        write_whole(path, kept)?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("cannot append to {}", path.display()))?;
        Ok(Output { path: path.to_path_buf(), file: std::io::BufWriter::new(file), failed: None })
    }

    /// Appends the samples of a finished group, on disk when this returns.
    pub fn append(&mut self, group: &[Sample]) {
        if self.failed.is_some() {
            return;
        }
        let mut write = || -> anyhow::Result<()> {
            for s in group {
                serde_json::to_writer(&mut self.file, s)?;
                self.file.write_all(b"\n")?;
            }
            self.file.flush()?;
            Ok(())
        };
        if let Err(e) = write() {
            let path = self.path.display();
            self.failed = Some(e.context(format!("cannot write {path}")));
        }
    }

    /// Rewrites the file with every group in prompt order (`groups` sorted by the caller).
    pub fn finish(self, groups: &[Vec<Sample>]) -> anyhow::Result<()> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        drop(self.file);
        write_whole(&self.path, groups)
    }
}

/// Writes `groups` to `path` through a temporary file and a rename: never half a file.
fn write_whole(path: &Path, groups: &[Vec<Sample>]) -> anyhow::Result<()> {
    let mut text = String::new();
    for s in groups.iter().flatten() {
        text.push_str(&serde_json::to_string(s)?);
        text.push('\n');
    }
    let tmp = path.with_extension("jsonl.partial");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The complete groups an earlier run wrote to `path` for these `groups` (the prompts to
/// generate, `n` samples each): a group is kept when all its samples are there and none
/// failed (a failure may be the flags', such as a KV cache too small: it is tried again). A last line
/// cut short (the run killed while writing it) is dropped; any other line that is not a
/// sample, or a sample whose prompt is not its group's, is an error.
pub fn read_kept(path: &Path, groups: &[Vec<Sample>]) -> anyhow::Result<Vec<Vec<Sample>>> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(e).with_context(|| format!("--resume: cannot read {}", path.display()));
        }
    };
    let lines: Vec<String> = std::io::BufReader::new(file)
        .lines()
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("--resume: cannot read {}", path.display()))?;
    let mut by_group: BTreeMap<usize, Vec<Sample>> = BTreeMap::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("--resume: {}:{}", path.display(), i + 1);
        let sample: Sample = match serde_json::from_str(line) {
            Ok(s) => s,
            Err(_) if i + 1 == lines.len() => break, // cut short by a kill
            Err(e) => bail!("{}: not a sample ({e}); give another --output", at()),
        };
        let g = sample.group_index;
        let Some(group) = groups.get(g) else {
            bail!("{}: group {g}, but --prompt-data has {} prompts", at(), groups.len());
        };
        if sample.prompt != group[0].prompt {
            bail!(
                "{}: the sample of group {g} has another prompt than row {g} of --prompt-data; \
                 give another --output or leave out --resume",
                at()
            );
        }
        by_group.entry(g).or_default().push(sample);
    }
    let mut kept = Vec::new();
    for (g, mut samples) in by_group {
        samples.sort_by_key(|s| s.index);
        samples.dedup_by_key(|s| s.index);
        let want: Vec<usize> = groups[g].iter().map(|s| s.index).collect();
        let failed = samples.iter().any(|s| s.status == Status::Failed);
        if samples.iter().map(|s| s.index).eq(want) && !failed {
            kept.push(samples);
        }
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;

    fn group(g: usize, n: usize) -> Vec<Sample> {
        (0..n)
            .map(|i| Sample {
                group_index: g,
                index: g * n + i,
                prompt: Prompt::Text(format!("prompt {g}")),
                response: format!("response {i}"),
                ..Sample::default()
            })
            .collect()
    }

    #[test]
    fn resume_keeps_complete_groups_and_drops_a_cut_line() {
        let dir =
            std::env::temp_dir().join(format!("miles-generate-output-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.jsonl");
        let prompts: Vec<Vec<Sample>> = (0..4).map(|g| group(g, 2)).collect();
        assert!(read_kept(&path, &prompts).unwrap().is_empty(), "no file yet");
        let mut out = Output::create(&path, &[]).unwrap();
        out.append(&prompts[2]);
        out.append(&prompts[0]);
        let mut failed = prompts[3].clone();
        failed[1].status = Status::Failed;
        out.append(&failed);
        drop(out);
        // Group 1 half written, then a line cut short; group 3 has a failed sample.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(&serde_json::to_string(&prompts[1][0]).unwrap());
        text.push('\n');
        let line = serde_json::to_string(&prompts[3][0]).unwrap();
        text.push_str(&line[..line.len() / 2]);
        std::fs::write(&path, &text).unwrap();
        let kept = read_kept(&path, &prompts).unwrap();
        assert_eq!(kept, vec![prompts[0].clone(), prompts[2].clone()]);
        // Resumed and finished: every group, in order.
        let out = Output::create(&path, &kept).unwrap();
        out.finish(&prompts).unwrap();
        assert_eq!(read_kept(&path, &prompts).unwrap(), prompts);
        // Another prompt file is refused; so is a broken line before the last.
        let other: Vec<Vec<Sample>> = (0..4).map(|g| group(g + 1, 2)).collect();
        let e = read_kept(&path, &other).unwrap_err().to_string();
        assert!(e.contains("out.jsonl:1: the sample of group 0 has another prompt"), "{e}");
        std::fs::write(&path, format!("not json\n{line}\n")).unwrap();
        let e = read_kept(&path, &prompts).unwrap_err().to_string();
        assert!(e.contains("out.jsonl:1: not a sample"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
