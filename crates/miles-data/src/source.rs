//! [`DataSource`]: batches of prompts across epochs, with a [`Cursor`] for exact resume.

use serde::{Deserialize, Serialize};

use crate::shuffle::permutation;
use crate::{DataError, Dataset, PromptRow};

/// Where a [`DataSource`] stands: `offset` prompts of epoch `epoch` have been served, and
/// `samples_served` prompts in all (`epoch × rows + offset`). Saved with a checkpoint;
/// [`DataSource::restore`] picks up exactly there.
///
/// `offset` runs up to the dataset length inclusive: a batch that ends exactly at the end of an
/// epoch leaves the cursor at `(epoch, rows)`, and the next epoch starts (and is shuffled) only
/// when the next prompt is asked for, as in slime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub offset: usize,
    pub samples_served: u64,
}

/// Serves a [`Dataset`]'s rows in epoch order: file order, or with `shuffle` a permutation per
/// epoch derived from `(seed, epoch)` only, identical on every platform.
#[derive(Debug, Clone)]
pub struct DataSource {
    dataset: Dataset,
    shuffle: bool,
    seed: u64,
    cursor: Cursor,
    /// The row order of `cursor.epoch`.
    order: Vec<usize>,
}

impl DataSource {
    /// Starts at epoch 0, offset 0. An empty dataset is refused: it could serve nothing.
    pub fn new(dataset: Dataset, shuffle: bool, seed: u64) -> Result<Self, DataError> {
        if dataset.is_empty() {
            return Err(DataError::Empty { dataset: dataset.source, hint: String::new() });
        }
        let mut source =
            DataSource { dataset, shuffle, seed, cursor: Cursor::default(), order: Vec::new() };
        source.order = source.order_of(0);
        Ok(source)
    }

    /// The row indices (into [`Dataset::rows`]) of the next `n` prompts in epoch order. A batch
    /// that crosses the end of an epoch continues into the next one, reshuffled; `n` may exceed
    /// the dataset length, taking several epochs. `n == 0` serves nothing.
    pub fn next_indices(&mut self, n: usize) -> Vec<usize> {
        let len = self.len();
        let mut batch = Vec::with_capacity(n);
        while batch.len() < n {
            if self.cursor.offset == len {
                self.cursor.epoch += 1;
                self.cursor.offset = 0;
                self.order = self.order_of(self.cursor.epoch);
            }
            let take = (n - batch.len()).min(len - self.cursor.offset);
            batch.extend_from_slice(&self.order[self.cursor.offset..self.cursor.offset + take]);
            self.cursor.offset += take;
            self.cursor.samples_served += take as u64;
        }
        batch
    }

    /// The next `n` prompts as `(row index, row)`, as [`DataSource::next_indices`] does; the rows
    /// are clones, so the batch does not hold a borrow of the source (a prompt row is small next
    /// to what generating from it costs). Use `next_indices` with [`DataSource::dataset`] to
    /// avoid the copy.
    pub fn next_batch(&mut self, n: usize) -> Vec<(usize, PromptRow)> {
        self.next_indices(n).into_iter().map(|i| (i, self.dataset.rows[i].clone())).collect()
    }

    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Restores a saved cursor (for exact resume): afterwards [`DataSource::next_batch`] yields
    /// exactly what the original run would have yielded next, given the same dataset, `shuffle`
    /// and `seed`. Refuses an offset past the end of the dataset, and a `samples_served` that is
    /// not `epoch × rows + offset` (both mean the cursor was saved over another dataset); on
    /// error the source is unchanged.
    pub fn restore(&mut self, cursor: Cursor) -> Result<(), DataError> {
        let len = self.len();
        let changed = "the checkpoint was saved with another dataset: check --prompt-data and \
                       its slice, or start the data from the beginning";
        if cursor.offset > len {
            return Err(DataError::Cursor {
                message: format!(
                    "offset {} is past the end of {} ({len} rows); {changed}",
                    cursor.offset, self.dataset.source
                ),
            });
        }
        let expected =
            cursor.epoch.checked_mul(len as u64).and_then(|n| n.checked_add(cursor.offset as u64));
        if expected != Some(cursor.samples_served) {
            return Err(DataError::Cursor {
                message: format!(
                    "it says {} prompts served, but epoch {} of {} ({len} rows) at offset {} \
                     means {}; {changed}",
                    cursor.samples_served,
                    cursor.epoch,
                    self.dataset.source,
                    cursor.offset,
                    expected.map_or("more than 2^64".to_string(), |n| n.to_string()),
                ),
            });
        }
        if cursor.epoch != self.cursor.epoch {
            self.order = self.order_of(cursor.epoch);
        }
        self.cursor = cursor;
        Ok(())
    }

    /// The epoch the cursor is in: that of the last prompt served (0 before any).
    pub fn epoch(&self) -> u64 {
        self.cursor.epoch
    }

    /// Rows in the dataset (never 0).
    #[expect(clippy::len_without_is_empty, reason = "new refuses an empty dataset")]
    pub fn len(&self) -> usize {
        self.dataset.len()
    }

    pub fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    fn order_of(&self, epoch: u64) -> Vec<usize> {
        if self.shuffle {
            permutation(self.len(), self.seed, epoch)
        } else {
            (0..self.len()).collect()
        }
    }
}

/// slime's count: `num_epoch × dataset rows / rollout_batch_size` (floor, at least 1). A
/// `rollout_batch_size` of 0 counts as 1 (the caller checks its flags); the product saturates.
pub fn num_rollouts_for_epochs(rows: usize, num_epoch: usize, rollout_batch_size: usize) -> usize {
    (num_epoch.saturating_mul(rows) / rollout_batch_size.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;

    fn dataset(len: usize) -> Dataset {
        Dataset {
            source: "test.jsonl".into(),
            rows: (0..len)
                .map(|i| PromptRow {
                    prompt: Prompt::Text(format!("prompt {i}")),
                    label: None,
                    metadata: serde_json::Value::Null,
                    line: i + 1,
                })
                .collect(),
        }
    }

    fn source(len: usize, shuffle: bool, seed: u64) -> DataSource {
        DataSource::new(dataset(len), shuffle, seed).unwrap()
    }

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    #[test]
    fn an_empty_dataset_is_refused() {
        let e = DataSource::new(dataset(0), true, 1).unwrap_err().to_string();
        assert!(e.contains("test.jsonl") && e.contains("no prompt rows"), "{e}");
    }

    #[test]
    fn without_shuffle_every_epoch_is_file_order() {
        let mut s = source(5, false, 9);
        assert_eq!(s.next_indices(5), [0, 1, 2, 3, 4]);
        assert_eq!(s.next_indices(7), [0, 1, 2, 3, 4, 0, 1]);
        assert_eq!(s.epoch(), 2);
    }

    #[test]
    fn a_shuffled_epoch_is_a_permutation() {
        for len in [1, 2, 7, 100] {
            let mut s = source(len, true, 3);
            for _ in 0..3 {
                assert_eq!(sorted(s.next_indices(len)), (0..len).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn the_shuffle_is_deterministic_per_seed_and_differs_across_epochs_and_seeds() {
        let epochs = |seed| source(50, true, seed).next_indices(150);
        let a = epochs(42);
        assert_eq!(a, epochs(42));
        assert_ne!(a, epochs(43));
        assert_ne!(a[..50], a[50..100]);
        assert_ne!(a[50..100], a[100..]);
        assert_ne!(a[..50], (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn a_batch_crosses_into_the_next_epoch() {
        let mut s = source(10, true, 5);
        let first = s.next_indices(8);
        assert_eq!(s.cursor(), Cursor { epoch: 0, offset: 8, samples_served: 8 });
        let crossing = s.next_indices(5);
        assert_eq!(s.cursor(), Cursor { epoch: 1, offset: 3, samples_served: 13 });
        assert_eq!(s.epoch(), 1);
        let epoch0 = permutation(10, 5, 0);
        let epoch1 = permutation(10, 5, 1);
        assert_eq!(first, epoch0[..8]);
        assert_eq!(crossing[..2], epoch0[8..]);
        assert_eq!(crossing[2..], epoch1[..3]);
        // A batch longer than the dataset spans several epochs.
        let long = s.next_indices(25);
        assert_eq!(s.cursor(), Cursor { epoch: 3, offset: 8, samples_served: 38 });
        assert_eq!(long[..7], epoch1[3..]);
        assert_eq!(long[7..17], permutation(10, 5, 2));
        assert!(s.next_indices(0).is_empty());
        assert_eq!(s.cursor().samples_served, 38);
    }

    #[test]
    fn an_epoch_ends_lazily_at_its_last_prompt() {
        let mut s = source(4, true, 1);
        s.next_indices(4);
        assert_eq!(s.cursor(), Cursor { epoch: 0, offset: 4, samples_served: 4 });
        s.next_indices(1);
        assert_eq!(s.cursor(), Cursor { epoch: 1, offset: 1, samples_served: 5 });
    }

    #[test]
    fn next_batch_pairs_indices_with_their_rows() {
        let mut s = source(6, true, 8);
        let mut t = source(6, true, 8);
        let batch = s.next_batch(9);
        assert_eq!(batch.iter().map(|(i, _)| *i).collect::<Vec<_>>(), t.next_indices(9));
        for (i, row) in &batch {
            assert_eq!(row, &s.dataset().rows[*i]);
            assert_eq!(row.prompt, Prompt::Text(format!("prompt {i}")));
        }
    }

    /// Runs `a` for `before` prompts (in batches of `batch`), restores its cursor into a fresh
    /// source, and checks both then serve the same `after` prompts.
    fn resumes_identically(shuffle: bool, batch: usize, before: usize, after: usize) {
        let mut original = source(7, shuffle, 11);
        let mut served = 0;
        while served < before {
            let n = batch.min(before - served);
            original.next_indices(n);
            served += n;
        }
        let saved = original.cursor();
        let json = serde_json::to_string(&saved).unwrap();
        let mut resumed = source(7, shuffle, 11);
        resumed.restore(serde_json::from_str(&json).unwrap()).unwrap();
        assert_eq!(resumed.cursor(), saved);
        assert_eq!(resumed.epoch(), original.epoch());
        for n in [3, 1, after] {
            assert_eq!(resumed.next_batch(n), original.next_batch(n), "after {before}, batch {n}");
        }
        assert_eq!(resumed.cursor(), original.cursor());
    }

    #[test]
    fn restore_continues_identically_mid_epoch_and_at_epoch_boundaries() {
        for shuffle in [true, false] {
            resumes_identically(shuffle, 2, 3, 20); // mid epoch 0
            resumes_identically(shuffle, 7, 7, 20); // exactly at the end of epoch 0
            resumes_identically(shuffle, 3, 14, 20); // end of epoch 1, reached mid-batch
            resumes_identically(shuffle, 4, 17, 20); // mid epoch 2
            resumes_identically(shuffle, 1, 0, 9); // before anything
        }
    }

    #[test]
    fn restore_at_a_boundary_into_a_source_already_past_it() {
        // The restored source was elsewhere (a later epoch); restore must rebuild the order.
        let mut original = source(5, true, 2);
        original.next_indices(5);
        let saved = original.cursor();
        let mut resumed = source(5, true, 2);
        resumed.next_indices(13);
        resumed.restore(saved).unwrap();
        assert_eq!(resumed.next_indices(12), original.next_indices(12));
    }

    #[test]
    fn an_out_of_range_cursor_is_refused_and_leaves_the_source_as_it_was() {
        let mut s = source(5, true, 2);
        s.next_indices(2);
        let before = s.cursor();
        let e = s.restore(Cursor { epoch: 0, offset: 6, samples_served: 6 }).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("offset 6 is past the end of test.jsonl (5 rows)"), "{e}");
        assert!(e.contains("another dataset") && e.contains("--prompt-data"), "{e}");
        let e = s.restore(Cursor { epoch: 2, offset: 1, samples_served: 9 }).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("9 prompts served") && e.contains("means 11"), "{e}");
        let e = s.restore(Cursor { epoch: u64::MAX, offset: 1, samples_served: 1 }).unwrap_err();
        assert!(e.to_string().contains("more than 2^64"), "{e}");
        assert_eq!(s.cursor(), before);
        // The end of an epoch is a valid offset.
        s.restore(Cursor { epoch: 1, offset: 5, samples_served: 10 }).unwrap();
    }

    #[test]
    fn rollouts_for_epochs_is_slimes_floor_at_least_one() {
        assert_eq!(num_rollouts_for_epochs(100, 3, 32), 9);
        assert_eq!(num_rollouts_for_epochs(64, 1, 32), 2);
        assert_eq!(num_rollouts_for_epochs(10, 1, 32), 1);
        assert_eq!(num_rollouts_for_epochs(10, 0, 32), 1);
        assert_eq!(num_rollouts_for_epochs(10, 2, 0), 20);
        assert_eq!(num_rollouts_for_epochs(usize::MAX, 2, 1), usize::MAX);
    }

    #[test]
    fn cursor_json_has_the_field_names() {
        let c = Cursor { epoch: 2, offset: 3, samples_served: 17 };
        assert_eq!(
            serde_json::to_value(c).unwrap(),
            serde_json::json!({"epoch": 2, "offset": 3, "samples_served": 17})
        );
    }
}
