//! A line chart: nice axis ticks, gridlines, one polyline per series, a legend above the plot
//! area (so it never covers a line), and the title.

use crate::canvas::{Canvas, Rect, Rgb, text_height, text_width};

/// One named line: (x, y) points in the order they were logged.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// What a chart shows. Series without points are left out of the picture and the legend.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub series: Vec<Series>,
}

/// Pixel size of a rendered chart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size {
    pub width: u32,
    pub height: u32,
}

impl Default for Size {
    fn default() -> Size {
        Size { width: 800, height: 480 }
    }
}

/// Tick positions along one axis; the axis spans exactly `first..=last`.
#[derive(Clone, Debug, PartialEq)]
pub struct Ticks {
    /// Distance between ticks: 1, 2 or 5 × 10^k.
    pub step: f64,
    pub values: Vec<f64>,
}

impl Ticks {
    pub fn first(&self) -> f64 {
        self.values[0]
    }

    pub fn last(&self) -> f64 {
        self.values[self.values.len() - 1]
    }

    /// The label of every tick, formatted alike: fixed decimals from the step, or the shortest
    /// exponent form when the numbers are very small or very large.
    pub fn labels(&self) -> Vec<String> {
        let largest = self.values.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let scientific = largest >= 1e6 || (largest > 0.0 && largest < 1e-3);
        let step_exponent = self.step.log10().floor() as i32;
        self.values
            .iter()
            .map(|&v| {
                // Snap what should be zero, so no "-0.00" from rounding error.
                let v = if v.abs() < self.step * 1e-6 { 0.0 } else { v };
                if v == 0.0 {
                    "0".to_string()
                } else if scientific {
                    let exponent = v.abs().log10().floor() as i32;
                    let decimals = (exponent - step_exponent).max(0) as usize;
                    format!("{v:.decimals$e}")
                } else {
                    let decimals = (-step_exponent).max(0) as usize;
                    format!("{v:.decimals$}")
                }
            })
            .collect()
    }
}

/// The smallest 1/2/5 × 10^k step that splits `span` into at most about `target` intervals.
fn nice_step(span: f64, target: usize) -> f64 {
    let raw = span / target.max(1) as f64;
    let exponent = raw.log10().floor() as i32;
    // 10^k built so that 2e-6 comes out as the literal 2e-6: powers of ten up to 1e22 are exact,
    // and one correctly rounded division (not powf) lands on the nearest double.
    let times_ten_to = |m: f64| {
        if exponent >= 0 { m * 10f64.powi(exponent) } else { m / 10f64.powi(-exponent) }
    };
    let fraction = raw / times_ten_to(1.0);
    // The slack keeps a quotient like 2.0000000000000004 on the step it means.
    let nice = [1.0, 2.0, 5.0].into_iter().find(|&m| fraction <= m * (1.0 + 1e-9)).unwrap_or(10.0);
    times_ten_to(nice)
}

/// Ticks covering `min..=max` with about `target` intervals (at least `min_step` apart, e.g. 1
/// for step numbers). A constant range is widened around its value so the line sits mid-axis.
pub fn nice_ticks(min: f64, max: f64, target: usize, min_step: f64) -> Ticks {
    assert!(min.is_finite() && max.is_finite() && min <= max, "bad axis range {min}..{max}");
    let (mut lo, mut hi) = (min, max);
    // "Constant" relative to the magnitude: 0.4 and 0.4 + 1e-17 are the same number.
    if hi - lo <= lo.abs().max(hi.abs()) * 1e-12 {
        let half = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        lo -= half;
        hi += half;
    }
    let mut step = nice_step(hi - lo, target).max(min_step);
    if !step.is_finite() || step <= 0.0 {
        // Only reachable for spans beyond f64 (e.g. -1e308..1e308); two ticks still draw.
        return Ticks { step: hi - lo, values: vec![lo, hi] };
    }
    loop {
        // A little slack so 0.30000000000000004 does not add a tick past 0.3.
        let first = (lo / step + 1e-9).floor() as i64;
        let last = (hi / step - 1e-9).ceil() as i64;
        if last - first <= 2 * target.max(1) as i64 {
            let values = (first..=last.max(first + 1)).map(|i| i as f64 * step).collect();
            return Ticks { step, values };
        }
        step = nice_step(step * 2.0, 1);
    }
}

const PALETTE: [Rgb; 8] = [
    Rgb(31, 119, 180),  // blue
    Rgb(230, 97, 1),    // orange
    Rgb(44, 160, 44),   // green
    Rgb(214, 39, 40),   // red
    Rgb(148, 103, 189), // purple
    Rgb(140, 86, 75),   // brown
    Rgb(227, 119, 194), // pink
    Rgb(23, 190, 207),  // cyan
];

/// The colour of the `index`-th drawn series.
pub fn series_color(index: usize) -> Rgb {
    PALETTE[index % PALETTE.len()]
}

const TEXT: Rgb = Rgb(34, 34, 34);
const AXIS: Rgb = Rgb(90, 90, 90);
const GRID: Rgb = Rgb(226, 226, 226);

const TITLE_SCALE: u32 = 2;
const LABEL_SCALE: u32 = 1;
const MARGIN: i32 = 12;
const TICK_LENGTH: i32 = 4;
const LINE_THICKNESS: u32 = 2;
/// Pixels between the frame and the end ticks, so a line along an end tick stays visible.
const INSET: i32 = 5;
const LEGEND_SWATCH: i32 = 18;
const LEGEND_ROW_HEIGHT: i32 = 14;
/// Series with at most this many points get a marker on every point.
const MARKED_POINTS: usize = 40;

impl Chart {
    fn drawn_series(&self) -> impl Iterator<Item = &Series> {
        self.series.iter().filter(|s| !s.points.is_empty())
    }

    /// Whether any series has a point to draw.
    pub fn has_data(&self) -> bool {
        self.drawn_series().next().is_some()
    }

    /// Where the plot area (inside the frame, where the lines go) falls at `size`.
    pub fn plot_area(&self, size: Size) -> Rect {
        self.layout(size).plot
    }

    fn layout(&self, size: Size) -> Layout<'_> {
        let (width, height) = (size.width as i32, size.height as i32);
        let series: Vec<&Series> = self.drawn_series().collect();
        let title_bottom = MARGIN + text_height(TITLE_SCALE);

        let (xs, ys) = ranges(&series);
        let integer_x = series.iter().flat_map(|s| &s.points).all(|(x, _)| x.fract() == 0.0);
        // The y labels set the left margin, which sets the plot width the x ticks divide.
        let y_ticks = nice_ticks(ys.0, ys.1, (height / 70).max(2) as usize, 0.0);
        let y_labels = y_ticks.labels();
        let y_label_w = y_labels.iter().map(|l| text_width(l, LABEL_SCALE)).max().unwrap_or(0);
        let left = MARGIN + y_label_w + TICK_LENGTH + 4;
        // Room for half of the last x label past the frame.
        let right = width - MARGIN - 12;

        let legend = legend_layout(&series, left, right);
        let legend_top = title_bottom + 10;
        let legend_rows = legend.iter().map(|(_, _, row)| row + 1).max().unwrap_or(0);
        let top = legend_top + legend_rows * LEGEND_ROW_HEIGHT + 6;
        let below_plot = TICK_LENGTH + 3 + text_height(LABEL_SCALE) + 6 + text_height(LABEL_SCALE);
        let bottom = height - MARGIN - below_plot;

        let x_target = ((right - left) / 90).max(2) as usize;
        let x_ticks = nice_ticks(xs.0, xs.1, x_target, if integer_x { 1.0 } else { 0.0 });
        Layout {
            series,
            plot: Rect { x0: left, y0: top, x1: right, y1: bottom },
            legend_top,
            legend,
            x_ticks,
            y_ticks,
            y_labels,
        }
    }

    /// The chart's pixels. A chart without data still renders its frame and title.
    pub fn render(&self, size: Size) -> Canvas {
        let mut canvas = Canvas::new(size.width, size.height, Rgb::WHITE);
        let Layout { series, plot, legend_top, legend, x_ticks, y_ticks, y_labels } =
            self.layout(size);
        let Rect { x0: left, y0: top, x1: right, y1: bottom } = plot;

        let title_w = text_width(&self.title, TITLE_SCALE);
        canvas.text((size.width as i32 - title_w) / 2, MARGIN, &self.title, TITLE_SCALE, TEXT);

        let to_px = |x: f64| {
            let t = (x - x_ticks.first()) / (x_ticks.last() - x_ticks.first());
            left + INSET + (t * (right - 1 - left - 2 * INSET) as f64).round() as i32
        };
        let to_py = |y: f64| {
            let t = (y - y_ticks.first()) / (y_ticks.last() - y_ticks.first());
            bottom - 1 - INSET - (t * (bottom - 1 - top - 2 * INSET) as f64).round() as i32
        };

        // Gridlines and ticks.
        let label_h = text_height(LABEL_SCALE);
        for (value, label) in y_ticks.values.iter().zip(&y_labels) {
            let py = to_py(*value);
            canvas.line((left, py), (right - 1, py), 1, GRID);
            canvas.line((left - TICK_LENGTH, py), (left - 1, py), 1, AXIS);
            let lx = left - TICK_LENGTH - 3 - text_width(label, LABEL_SCALE);
            // Digits are cap height; centre those rows, not the descender rows, on the tick.
            canvas.text(lx, py - 3, label, LABEL_SCALE, TEXT);
        }
        let x_labels = x_ticks.labels();
        let tick_label_top = bottom + TICK_LENGTH + 3;
        for (value, label) in x_ticks.values.iter().zip(&x_labels) {
            let px = to_px(*value);
            canvas.line((px, top), (px, bottom - 1), 1, GRID);
            canvas.line((px, bottom), (px, bottom + TICK_LENGTH - 1), 1, AXIS);
            let lw = text_width(label, LABEL_SCALE);
            canvas.text(px - lw / 2, tick_label_top, label, LABEL_SCALE, TEXT);
        }
        canvas.stroke_rect(Rect { x0: left - 1, y0: top - 1, x1: right + 1, y1: bottom + 1 }, AXIS);
        let x_label_w = text_width(&self.x_label, LABEL_SCALE);
        let x_label_top = tick_label_top + label_h + 6;
        canvas.text(left + (right - left - x_label_w) / 2, x_label_top, &self.x_label, 1, TEXT);

        // Lines, clipped to the plot area so markers on the edge stay inside the frame.
        canvas.set_clip(Some(plot));
        for (i, s) in series.iter().enumerate() {
            let color = series_color(i);
            let pixels: Vec<(i32, i32)> =
                s.points.iter().map(|&(x, y)| (to_px(x), to_py(y))).collect();
            for pair in pixels.windows(2) {
                canvas.line(pair[0], pair[1], LINE_THICKNESS, color);
            }
            if s.points.len() <= MARKED_POINTS {
                for &p in &pixels {
                    canvas.marker(p, 2, color);
                }
            }
        }
        canvas.set_clip(None);

        if series.is_empty() {
            let note = "no data";
            let w = text_width(note, TITLE_SCALE);
            canvas.text((left + right - w) / 2, (top + bottom) / 2 - 9, note, TITLE_SCALE, AXIS);
        }

        // Legend.
        for (i, (s, x, row)) in legend.iter().enumerate() {
            let color = series_color(i);
            let y = legend_top + row * LEGEND_ROW_HEIGHT;
            let mid = y + 3;
            canvas.line((*x, mid), (x + LEGEND_SWATCH - 1, mid), LINE_THICKNESS, color);
            if s.points.len() <= MARKED_POINTS {
                canvas.marker((x + LEGEND_SWATCH / 2, mid), 2, color);
            }
            canvas.text(x + LEGEND_SWATCH + 5, y, &s.name, LABEL_SCALE, TEXT);
        }
        canvas
    }
}

/// Where everything goes, worked out before any pixel is drawn.
struct Layout<'a> {
    series: Vec<&'a Series>,
    plot: Rect,
    legend_top: i32,
    legend: Vec<(&'a Series, i32, i32)>,
    x_ticks: Ticks,
    y_ticks: Ticks,
    y_labels: Vec<String>,
}

/// (min x, max x), (min y, max y) over every point; (0, 1) for an axis without points.
fn ranges(series: &[&Series]) -> ((f64, f64), (f64, f64)) {
    let mut xs = (f64::INFINITY, f64::NEG_INFINITY);
    let mut ys = (f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in series.iter().flat_map(|s| &s.points) {
        xs = (xs.0.min(x), xs.1.max(x));
        ys = (ys.0.min(y), ys.1.max(y));
    }
    let or_unit = |r: (f64, f64)| if r.0 <= r.1 { r } else { (0.0, 1.0) };
    (or_unit(xs), or_unit(ys))
}

/// Where each legend entry goes: (series, left x, row), filling rows left to right.
fn legend_layout<'a>(series: &[&'a Series], left: i32, right: i32) -> Vec<(&'a Series, i32, i32)> {
    let mut out = Vec::new();
    let (mut x, mut row) = (left, 0);
    for s in series {
        let w = LEGEND_SWATCH + 5 + text_width(&s.name, LABEL_SCALE);
        if x > left && x + w > right {
            x = left;
            row += 1;
        }
        out.push((*s, x, row));
        x += w + 22;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approx(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-9 * y.abs().max(1e-300))
    }

    fn ticks(min: f64, max: f64, target: usize) -> Ticks {
        nice_ticks(min, max, target, 0.0)
    }

    #[test]
    fn ticks_use_one_two_five_steps_and_cover_the_range() {
        let t = ticks(0.0, 59.0, 6);
        assert_eq!(t.step, 10.0);
        assert!(approx(&t.values, &[0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]));
        assert_eq!(ticks(0.0, 1.0, 5).step, 0.2);
        assert_eq!(ticks(0.13, 0.87, 6).step, 0.2);
        assert_eq!(ticks(0.0, 1000.0, 4).step, 500.0);
        for (min, max) in [(0.0, 7.3), (-3.1, 250.0), (0.001, 0.0042), (12.0, 12.5), (1e3, 1e9)] {
            for target in 2..10 {
                let t = ticks(min, max, target);
                let mantissa = t.step / 10f64.powf(t.step.log10().floor());
                assert!(
                    [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
                    "step {} for {min}..{max}",
                    t.step
                );
                assert!(t.first() <= min && t.last() >= max, "{t:?} misses {min}..{max}");
                assert!(t.values.len() <= 2 * target + 1, "{t:?} has too many ticks");
            }
        }
    }

    #[test]
    fn float_noise_does_not_add_a_tick() {
        let t = ticks(0.1, 0.1 + 0.2, 3);
        assert_eq!(t.step, 0.1);
        assert_eq!(t.values.len(), 3);
        assert_eq!(t.labels(), ["0.1", "0.2", "0.3"]);
    }

    #[test]
    fn constant_series_is_widened_around_its_value() {
        let t = ticks(0.4, 0.4, 5);
        assert!(t.first() < 0.4 && t.last() > 0.4);
        assert!(t.last() - t.first() <= 0.2 + 1e-12);
        let zero = ticks(0.0, 0.0, 5);
        assert!(approx(&[zero.first(), zero.last()], &[-1.0, 1.0]));
        let negative = ticks(-3.0, -3.0, 4);
        assert!(negative.first() < -3.0 && negative.last() > -3.0);
    }

    #[test]
    fn negative_ranges_tick_through_zero() {
        let t = ticks(-0.7, 0.35, 6);
        assert_eq!(t.step, 0.2);
        assert!(approx(&t.values, &[-0.8, -0.6, -0.4, -0.2, 0.0, 0.2, 0.4]));
        assert_eq!(t.labels(), ["-0.8", "-0.6", "-0.4", "-0.2", "0", "0.2", "0.4"]);
        let all_negative = ticks(-250.0, -10.0, 5);
        assert_eq!(all_negative.step, 50.0);
        assert!(approx(&[all_negative.first(), all_negative.last()], &[-250.0, 0.0]));
    }

    #[test]
    fn tiny_ranges_get_exponent_labels() {
        let t = ticks(0.0, 1e-5, 5);
        assert_eq!(t.step, 2e-6);
        assert_eq!(t.labels(), ["0", "2e-6", "4e-6", "6e-6", "8e-6", "1.0e-5"]);
        let kl = ticks(1.2e-4, 3.1e-4, 4);
        assert_eq!(kl.step, 5e-5);
        assert_eq!(kl.labels(), ["1.0e-4", "1.5e-4", "2.0e-4", "2.5e-4", "3.0e-4", "3.5e-4"]);
        // A tiny wiggle on a large value keeps fixed notation, with enough decimals.
        let offset = ticks(1000.0, 1000.00001, 5);
        assert_eq!(offset.labels()[1], "1000.000002");
    }

    #[test]
    fn large_values_get_exponent_labels_and_moderate_ones_do_not() {
        assert_eq!(ticks(0.0, 3e6, 3).labels(), ["0", "1e6", "2e6", "3e6"]);
        assert_eq!(ticks(0.0, 2048.0, 5).labels(), ["0", "500", "1000", "1500", "2000", "2500"]);
    }

    #[test]
    fn step_numbers_never_tick_in_fractions() {
        let t = nice_ticks(0.0, 2.0, 8, 1.0);
        assert_eq!(t.step, 1.0);
        assert_eq!(t.labels(), ["0", "1", "2"]);
        let single = nice_ticks(5.0, 5.0, 8, 1.0);
        assert_eq!(single.labels(), ["4", "5", "6"]);
    }

    #[test]
    fn legend_wraps_to_a_new_row_when_full() {
        let s = |n: &str| Series { name: n.to_string(), points: vec![(0.0, 0.0)] };
        let (a, b, c) = (s("aaaaaaaaaa"), s("bbbbbbbbbb"), s("cccccccccc"));
        let layout = legend_layout(&[&a, &b, &c], 0, 200);
        let rows: Vec<i32> = layout.iter().map(|(_, _, row)| *row).collect();
        assert_eq!(rows, [0, 0, 1]);
        assert_eq!(layout[2].1, 0);
    }

    #[test]
    fn chart_without_points_has_no_data() {
        let empty = Chart {
            title: "t".into(),
            x_label: "step".into(),
            series: vec![Series { name: "a".into(), points: vec![] }],
        };
        assert!(!empty.has_data());
        let canvas = empty.render(Size::default());
        assert_eq!((canvas.width(), canvas.height()), (800, 480));
    }
}
