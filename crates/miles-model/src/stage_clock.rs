//! Wall time per stage of the model's steps, for machines without a system profiler: on when
//! `MILES_STAGE_TIMES` is set. Each timed stage waits for the device before and after, so the
//! steps it measures run slower and without overlap; the shares are what it is for.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use miles_tensor::Device;

use crate::Result;

/// Per stage name: its calls and their total time, in the order first seen.
type Totals = Vec<(&'static str, u64, Duration)>;

fn clock() -> Option<&'static Mutex<Totals>> {
    static CLOCK: OnceLock<Option<Mutex<Totals>>> = OnceLock::new();
    CLOCK
        .get_or_init(|| std::env::var_os("MILES_STAGE_TIMES").map(|_| Mutex::new(Vec::new())))
        .as_ref()
}

/// Whether stages are being timed.
pub fn on() -> bool {
    clock().is_some()
}

/// Runs `f` as stage `name` on `device`, timed when the clock is on.
pub fn stage<T>(device: Device, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match clock() {
        Some(clock) => timed(clock, device, name, f),
        None => f(),
    }
}

fn timed<T>(
    clock: &Mutex<Totals>,
    device: Device,
    name: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    device.synchronize()?;
    let start = Instant::now();
    let out = f()?;
    device.synchronize()?;
    let took = start.elapsed();
    let mut totals = clock.lock().unwrap_or_else(|e| e.into_inner());
    match totals.iter_mut().find(|(n, ..)| *n == name) {
        Some((_, calls, total)) => (*calls, *total) = (*calls + 1, *total + took),
        None => totals.push((name, 1, took)),
    }
    Ok(out)
}

/// Forgets the times so far (a bench's warm-up).
pub fn reset() {
    if let Some(clock) = clock() {
        clock.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// The stages' times as a table (stages nest: a stage's time includes those inside it), or
/// `None` when the clock is off.
pub fn report() -> Option<String> {
    Some(table(&clock()?.lock().unwrap_or_else(|e| e.into_inner())))
}

fn table(totals: &Totals) -> String {
    let mut out =
        format!("{:<28} {:>8} {:>12} {:>12}\n", "stage", "calls", "total ms", "ms a call");
    for &(name, calls, total) in totals {
        let ms = total.as_secs_f64() * 1e3;
        out += &format!("{name:<28} {calls:>8} {ms:>12.2} {:>12.4}\n", ms / calls as f64);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use miles_tensor::Device;

    /// Calls are counted per stage, in the order first seen, and values pass through.
    #[test]
    fn stages_are_counted_by_name_in_first_seen_order() {
        let clock = Mutex::new(Vec::new());
        for i in 0..3 {
            assert_eq!(super::timed(&clock, Device::Cpu, "layer", || Ok(i)).unwrap(), i);
            if i > 0 {
                super::timed(&clock, Device::Cpu, "attention", || Ok(())).unwrap();
            }
        }
        let totals = clock.into_inner().unwrap();
        let calls: Vec<_> = totals.iter().map(|&(name, calls, _)| (name, calls)).collect();
        assert_eq!(calls, [("layer", 3), ("attention", 2)]);
        let table = super::table(&totals);
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(table.lines().nth(2).unwrap().starts_with("attention"), "{table}");
    }
}
