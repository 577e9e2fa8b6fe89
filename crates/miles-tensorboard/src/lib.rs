//! Scalar metrics as TensorBoard event files, so `tensorboard --logdir <run dir>` follows a run
//! live.
//!
//! The crate's one job is TensorBoard's record format: `record` frames bytes as TFRecords
//! (length, masked CRC32C, data, masked CRC32C) and `proto` encodes the three protobuf messages
//! a scalar needs (`Event`, `Summary`, `Summary.Value`). [`EventWriter`] puts them in a file
//! named the way TensorBoard looks for, one event per training step, each written through to the
//! OS at once so a live TensorBoard sees every step.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

mod proto;
mod record;

/// What can go wrong writing events; each message names the file or directory.
/// The io error is part of the message rather than a `source()`, so a printed chain does not
/// repeat it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot create the TensorBoard log directory {}: {error}", path.display())]
    CreateDir { path: PathBuf, error: io::Error },
    #[error("cannot create the TensorBoard event file {}: {error}", path.display())]
    CreateFile { path: PathBuf, error: io::Error },
    #[error("cannot write to the TensorBoard event file {}: {error}", path.display())]
    Write { path: PathBuf, error: io::Error },
}

/// Appends events to one `events.out.tfevents.*` file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    /// Unbuffered on purpose: each event is one `write_all`, so nothing waits in user space
    /// for a reader tailing the file.
    file: File,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it,
    /// `events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n>` (TensorBoard's naming; `n` is 0
    /// unless a writer of this process already took that name this second), then writes the
    /// `file_version` event TensorBoard expects first.
    pub fn create(dir: &Path) -> Result<EventWriter, Error> {
        fs::create_dir_all(dir)
            .map_err(|error| Error::CreateDir { path: dir.to_path_buf(), error })?;
        let now = wall_time_now();
        let stem =
            format!("events.out.tfevents.{}.{}.{}", now as u64, hostname(), std::process::id());
        let (path, file) = create_new_file(dir, &stem)?;
        let mut writer = EventWriter { path, file };
        writer.write_event(&proto::file_version_event(now))?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step's scalars as a single event (`wall_time` in seconds since the Unix
    /// epoch, see [`wall_time_now`]). Values are stored as f32, the type TensorBoard keeps;
    /// NaN and infinities are written as they are. TensorBoard expects steps to increase: a
    /// step lower than one already written (a resumed run) makes it drop the points from that
    /// step on.
    pub fn write_scalars(
        &mut self,
        step: i64,
        wall_time: f64,
        scalars: &[(&str, f64)],
    ) -> Result<(), Error> {
        self.write_event(&proto::scalars_event(step, wall_time, scalars))
    }

    fn write_event(&mut self, event: &[u8]) -> Result<(), Error> {
        self.file
            .write_all(&record::frame(event))
            .and_then(|()| self.file.flush())
            .map_err(|error| Error::Write { path: self.path.clone(), error })
    }
}

/// Seconds since the Unix epoch, TensorBoard's `wall_time`; 0 if the clock reads before 1970.
pub fn wall_time_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// Creates `<stem>.<n>` with the lowest free `n`, never truncating another writer's file.
fn create_new_file(dir: &Path, stem: &str) -> Result<(PathBuf, File), Error> {
    let mut last_error = None;
    for n in 0..100u32 {
        let path = dir.join(format!("{stem}.{n}"));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => last_error = Some(error),
            Err(error) => return Err(Error::CreateFile { path, error }),
        }
    }
    let error = last_error.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists));
    Err(Error::CreateFile { path: dir.join(format!("{stem}.*")), error })
}

/// The host name for the file name: /etc/hostname, else $HOSTNAME, else "localhost"; characters
/// that could not be part of one file name become `_`.
fn hostname() -> String {
    let from_file = fs::read_to_string("/etc/hostname").ok().map(|text| text.trim().to_string());
    let from_env = || std::env::var("HOSTNAME").ok().map(|name| name.trim().to_string());
    let name = from_file
        .filter(|name| !name.is_empty())
        .or_else(|| from_env().filter(|name| !name.is_empty()))
        .unwrap_or_else(|| "localhost".to_string());
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests;
