//! `checksums.json`: every file of a checkpoint (or an HF export) with its XXH3-128 digest,
//! written last, before the directory is renamed into place. A load checks every file against
//! it first, streaming, so a flipped bit or a cut copy is an error naming the file instead of
//! weights that are silently wrong.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::{Error, Result, at, io, write_synced};

pub const MANIFEST_FILE: &str = "checksums.json";
const ALGORITHM: &str = "xxh3-128";

/// Every file under `dir` but the manifest, as paths relative to it (`/`-separated), sorted.
fn files(dir: &Path) -> Result<Vec<String>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let path = entry.map_err(io(dir))?.path();
            if path.is_dir() {
                walk(root, &path, out)?;
            } else {
                let rel = path.strip_prefix(root).expect("under the root");
                let parts: Vec<String> =
                    rel.components().map(|c| c.as_os_str().to_string_lossy().into()).collect();
                out.push(parts.join("/"));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.retain(|f| f != MANIFEST_FILE);
    out.sort();
    Ok(out)
}

/// The file's digest, read in 1 MiB pieces.
fn digest(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:032x}", hasher.digest128()))
}

/// The digest of the file list itself (its compact JSON), so that a change to the manifest
/// is told from a change to a file it lists.
fn own_digest(files: &serde_json::Value) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(files.to_string().as_bytes()))
}

/// Writes `dir`'s manifest over every file in it, synced (the caller syncs the directory).
pub(super) fn write(dir: &Path) -> Result<()> {
    let mut digests = BTreeMap::new();
    for file in files(dir)? {
        digests.insert(file.clone(), digest(&dir.join(&file))?);
    }
    let own = own_digest(&serde_json::json!(digests));
    let manifest = serde_json::json!({"algorithm": ALGORITHM, "files": digests, "digest": own});
    let mut text = serde_json::to_string_pretty(&manifest).expect("JSON of strings");
    text.push('\n');
    write_synced(&dir.join(MANIFEST_FILE), text.as_bytes())
}

/// Checks every file of `dir` against its manifest: `Ok(false)` when it has none (written by
/// an earlier version), an [`Error::Damaged`] naming the first file that is not as saved
/// (changed, missing, or not in the manifest).
pub fn verify(dir: &Path) -> Result<bool> {
    let path = dir.join(MANIFEST_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(Error::Io { path, source }),
    };
    let damaged = |path: PathBuf, message: &str| Error::Damaged { path, message: message.into() };
    let manifest: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| damaged(path.clone(), &format!("not the JSON it was written as ({e})")))?;
    if manifest["algorithm"] != ALGORITHM {
        return Err(at(
            &path,
            format!("algorithm {}: this version checks {ALGORITHM}", manifest["algorithm"]),
        ));
    }
    let listed = manifest["files"]
        .as_object()
        .ok_or_else(|| damaged(path.clone(), "holds no \"files\" object"))?;
    if manifest["digest"].as_str() != Some(own_digest(&manifest["files"]).as_str()) {
        return Err(damaged(path, "does not match its own digest: it changed after it was saved"));
    }
    let present = files(dir)?;
    for file in &present {
        let Some(want) = listed.get(file).and_then(|d| d.as_str()) else {
            return Err(damaged(
                dir.join(file),
                "is not in checksums.json: the checkpoint was changed after it was saved",
            ));
        };
        if digest(&dir.join(file))? != want {
            return Err(damaged(
                dir.join(file),
                "does not match its checksum: it changed after it was saved (a flipped bit, a \
                 cut or partial copy)",
            ));
        }
    }
    if let Some(missing) = listed.keys().find(|f| !present.contains(f)) {
        return Err(damaged(dir.join(missing), "is missing (checksums.json lists it)"));
    }
    Ok(true)
}
