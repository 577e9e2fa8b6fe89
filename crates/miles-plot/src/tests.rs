//! Reading metrics.jsonl, and whole runs drawn to PNG and decoded back.

use std::fs;
use std::path::{Path, PathBuf};

use super::*;
use crate::canvas::Rgb;
use crate::chart::series_color;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("miles-plot-{label}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn missing_keys_null_and_non_numeric_values_are_skipped() {
    let dir = TempDir::new("read");
    let path = dir.write(
        "metrics.jsonl",
        r#"{"step": 1, "a": 0.5, "b": 2}
{"step": 2, "a": null, "b": "n/a"}

{"step": 3, "a": 0.7, "b": true}
{"a": 0.9}
"#,
    );
    let records = read_metrics(&path).unwrap();
    assert_eq!(records.len(), 4, "the blank line is not a record");
    assert_eq!(series(&records, "a").points, [(1.0, 0.5), (3.0, 0.7), (3.0, 0.9)]);
    assert_eq!(series(&records, "b").points, [(1.0, 2.0)]);
    assert!(series(&records, "c").points.is_empty());
}

#[test]
fn records_without_a_step_use_their_position() {
    let dir = TempDir::new("index");
    let path = dir.write("metrics.jsonl", "{\"r\": 1}\n{\"r\": 2}\n{\"step\": \"x\", \"r\": 3}\n");
    let records = read_metrics(&path).unwrap();
    assert_eq!(series(&records, "r").points, [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]);
}

#[test]
fn malformed_line_names_file_and_line_number() {
    let dir = TempDir::new("malformed");
    let path = dir.write("metrics.jsonl", "{\"step\": 1}\n\n{\"step\": 2,\n{\"step\": 3}\n");
    let err = read_metrics(&path).unwrap_err();
    assert!(matches!(err, PlotError::Malformed { line: 3, .. }), "{err:?}");
    let message = err.to_string();
    let expected = format!("{}:3:11: not valid JSON (EOF while parsing", path.display());
    assert!(message.starts_with(&expected), "{message}");
    assert!(!message.contains("line 1"), "{message}");
}

#[test]
fn a_line_that_is_not_an_object_is_an_error() {
    let dir = TempDir::new("array");
    let path = dir.write("metrics.jsonl", "{\"step\": 1}\n[1, 2]\n");
    let err = read_metrics(&path).unwrap_err();
    assert!(matches!(err, PlotError::NotAnObject { line: 2, found: "an array", .. }), "{err:?}");
}

#[test]
fn empty_and_missing_files_name_the_path() {
    let dir = TempDir::new("empty");
    let empty = dir.write("metrics.jsonl", "\n  \n");
    let err = read_metrics(&empty).unwrap_err();
    assert!(matches!(err, PlotError::Empty { .. }));
    assert!(err.to_string().contains(&empty.display().to_string()));

    let missing = dir.path().join("nope").join(METRICS_FILE);
    let err = plot_run(missing.parent().unwrap(), dir.path()).unwrap_err();
    assert!(matches!(err, PlotError::Read { .. }));
    assert!(err.to_string().contains(&missing.display().to_string()), "{err}");
}

/// 5 SFT warm-up lines, then 60 RL steps of rising reward with eval every 10 steps, a null
/// here and there, and no `rollout/truncated_ratio` (so truncated.png has nothing to draw).
fn synthetic_run() -> String {
    let mut lines = Vec::new();
    for step in 0..5 {
        lines.push(format!(
            r#"{{"step": {step}, "phase": "sft", "sft/loss": {}}}"#,
            2.0 - 0.3 * step as f64
        ));
    }
    for step in 5..65 {
        let t = (step - 5) as f64 / 59.0;
        let wiggle = (step as f64 * 1.7).sin();
        let mut line = format!(
            concat!(
                r#"{{"step": {step}, "rollout/raw_reward": {reward}, "#,
                r#""rollout/response_len/mean": {len}, "#,
                r#""train/loss": {loss}, "train/pg_loss": {pg}, "train/pg_clipfrac": {clip}, "#,
                r#""train/ppo_kl": {kl}, "train/kl_loss": 0.0, "train/grad_norm": 0.8, "#,
                r#""train/tis_clipfrac": {tis}, "train/entropy_loss": {ent}, "#,
                r#""perf/step_time": {st}, "perf/rollout_time": {rt}, "perf/train_time": 0.5"#
            ),
            step = step,
            reward = 0.1 + 0.6 * t + 0.05 * wiggle,
            len = 40.0 + 80.0 * t + 6.0 * wiggle,
            loss = 0.02 * wiggle - 0.01,
            pg = if step == 20 { "null".to_string() } else { (0.015 * wiggle).to_string() },
            clip = 0.02 + 0.01 * wiggle,
            kl = 1e-4 * (1.0 + t + 0.3 * wiggle),
            tis = 0.01 + 0.004 * wiggle,
            ent = 2.5 - 0.5 * t + 0.05 * wiggle,
            st = 1.3 + 0.1 * wiggle,
            rt = 0.8 + 0.1 * wiggle,
        );
        if step % 10 == 0 {
            let eval = 0.05 + 0.6 * t;
            line.push_str(&format!(r#", "eval/reward": {eval}, "eval/pass@1": {}"#, eval * 0.9));
        }
        line.push_str(&format!(r#", "rollout/spec_accept_rate": {}"#, 0.7 + 0.1 * wiggle));
        line.push('}');
        lines.push(line);
    }
    lines.join("\n") + "\n"
}

/// Every chart's file but truncated.png, in [`CHARTS`] order.
const ALL_BUT_TRUNCATED: [&str; 9] = [
    "reward.png",
    "eval_time.png",
    "kl.png",
    "clipfrac.png",
    "response_len.png",
    "entropy.png",
    "step_time.png",
    "loss.png",
    "spec_accept.png",
];

fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
    let file = std::io::BufReader::new(fs::File::open(path).unwrap());
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

fn count_color(pixels: &[u8], width: u32, area: canvas::Rect, color: Rgb) -> usize {
    let mut n = 0;
    for y in area.y0..area.y1 {
        for x in area.x0..area.x1 {
            let i = 3 * (y as usize * width as usize + x as usize);
            n += usize::from(pixels[i..i + 3] == [color.0, color.1, color.2]);
        }
    }
    n
}

#[test]
fn end_to_end_run_draws_every_chart_with_data_and_skips_the_rest() {
    let run = TempDir::new("e2e");
    run.write(METRICS_FILE, &synthetic_run());
    let out = run.path().join("plots");
    let written = plot_run(run.path(), &out).unwrap();
    let names: Vec<_> =
        written.iter().map(|p| p.file_name().unwrap().to_str().unwrap().to_string()).collect();
    assert_eq!(names, ALL_BUT_TRUNCATED);
    assert!(!out.join("truncated.png").exists());

    let records = read_metrics(&run.path().join(METRICS_FILE)).unwrap();

    for (path, spec) in written.iter().zip(CHARTS.iter().filter(|s| s.file != "truncated.png")) {
        let (width, height, pixels) = decode(path);
        assert_eq!((width, height), (800, 480), "{}", path.display());
        let chart = spec.chart(&records);
        let area = chart.plot_area(Size::default());
        for (i, s) in chart.series.iter().enumerate() {
            // 2-px lines over ~700 px, or at least the markers of 6 eval points.
            let expected = if s.points.len() > 10 { 300 } else { 6 * 25 };
            let found = count_color(&pixels, width, area, series_color(i));
            assert!(found >= expected, "{}: {} drew {found} pixels", spec.file, s.name);
        }
        let background = count_color(&pixels, width, area, Rgb::WHITE);
        assert!(background > area_pixels(area) / 2, "{}: plot area mostly not white", spec.file);
    }

    let reward = CHARTS[0].chart(&records);
    let names: Vec<_> = reward.series.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["rollout/raw_reward", "eval/reward", "eval/pass@1"]);
    let loss = CHARTS.iter().find(|s| s.file == "loss.png").unwrap().chart(&records);
    assert_eq!(loss.series[1].points.len(), 59, "the null pg_loss is skipped");
    assert_eq!(loss.series[2].name, "sft/loss");

    // The eval chart against training time: rollout + train time summed up to each eval.
    let timed = CHARTS.iter().find(|s| s.file == "eval_time.png").unwrap().chart(&records);
    assert_eq!(timed.x_label, "training time (s)");
    let clock: f64 = records[5..=10]
        .iter()
        .map(|r| r.get("perf/rollout_time").and_then(Value::as_f64).unwrap() + 0.5)
        .sum();
    assert_eq!(timed.series[1].name, "eval/pass@1");
    let first = timed.series[1].points[0].0;
    assert!(
        (first - clock).abs() < 1e-9,
        "step 10's eval at {first}, not after 6 RL steps' {clock}"
    );
}

fn area_pixels(area: canvas::Rect) -> usize {
    ((area.x1 - area.x0) * (area.y1 - area.y0)) as usize
}

#[test]
fn charts_without_data_are_skipped_and_reported() {
    let run = TempDir::new("skip");
    let records = [
        r#"{"step": 0, "custom/thing": 1.0, "rollout/truncated_ratio": null}"#,
        r#"{"step": 1, "rollout/truncated_ratio": 0.25}"#,
    ]
    .map(|line| serde_json::from_str::<Record>(line).unwrap());
    let out = run.path().join("plots");
    let report = plot_records(&records, &out).unwrap();
    assert_eq!(report.written, [out.join("truncated.png")]);
    let skipped: Vec<_> = report.skipped.iter().map(|s| s.file).collect();
    assert_eq!(skipped, ALL_BUT_TRUNCATED);
    assert_eq!(report.skipped[0].describe(), "rollout/raw_reward, eval/*");
    assert_eq!(fs::read_dir(&out).unwrap().count(), 1);

    let only_unknown = [serde_json::from_str::<Record>(r#"{"custom/thing": 1}"#).unwrap()];
    let report = plot_records(&only_unknown, &out.join("none")).unwrap();
    assert!(report.written.is_empty());
    assert_eq!(report.skipped.len(), CHARTS.len());
}

/// Two runs side by side: each chart draws both runs' series under their labels, in run order,
/// and a chart only one run has data for is still drawn.
#[test]
fn runs_side_by_side_name_their_series_by_run() {
    let run = TempDir::new("compare");
    run.write(METRICS_FILE, &synthetic_run());
    let records = read_metrics(&run.path().join(METRICS_FILE)).unwrap();
    let truncated =
        [serde_json::from_str::<Record>(r#"{"step": 1, "rollout/truncated_ratio": 0.5}"#).unwrap()];
    let out = run.path().join("compare");
    let report = plot_runs(&[("one", &records[..]), ("two", &truncated[..])], &out).unwrap();
    assert_eq!(report.written.len(), CHARTS.len(), "every chart has a run with data");
    let both = [("one", &records[..]), ("two", &records[..])];
    let reward = &CHARTS[0];
    let mut names = Vec::new();
    for (label, r) in both {
        names.extend(reward.chart(r).series.into_iter().map(|s| format!("{label}: {}", s.name)));
    }
    assert_eq!(names[0], "one: rollout/raw_reward");
    assert_eq!(names[3], "two: rollout/raw_reward");
    let report = plot_runs(&both, &out.join("same")).unwrap();
    let (_, _, pixels) = decode(&report.written[0]);
    let chart = reward.chart(&records);
    let area = chart.plot_area(Size::default());
    // The second run's raw reward is the chart's fourth series: drawn in the fourth colour.
    assert!(count_color(&pixels, 800, area, series_color(3)) >= 300);
}
