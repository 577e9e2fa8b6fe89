//! Prompt datasets for miles-rs: what a rollout asks "give me the next N prompts" of.
//!
//! [`Dataset::load`] reads a JSONL or Parquet file (optionally a row slice of it, `FILE@[a:b]` as
//! in slime) into [`PromptRow`]s, taking the prompt, label and metadata from the keys in
//! [`Keys`]; every malformed row fails the load with `file:line` (a Parquet file: its row), what
//! is wrong and which flag to set.
//! [`DataSource`] serves those rows batch after batch, epoch after epoch, in file order or in a
//! seeded per-epoch shuffle that is the same on every platform, and its [`Cursor`] saved with a
//! checkpoint lets a resumed run draw exactly the prompts the original run would have drawn.

mod dataset;
mod error;
mod parquet_file;
mod shuffle;
mod slice;
mod source;

pub use dataset::{Dataset, Keys, PromptRow};
pub use error::DataError;
pub use slice::parse_slice;
pub use source::{Cursor, DataSource, num_rollouts_for_epochs};

#[cfg(test)]
mod testutil {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A file under the system temp dir, unique to this process and call, removed on drop.
    pub struct TempFile(pub PathBuf);

    impl TempFile {
        pub fn new(name: &str, contents: &[u8]) -> TempFile {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("miles-data-test-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(name);
            std::fs::write(&path, contents).unwrap();
            TempFile(path)
        }

        pub fn spec(&self) -> String {
            self.0.display().to_string()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            if let Some(dir) = self.0.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}
