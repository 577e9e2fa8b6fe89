//! An RGB pixel buffer with the few primitives a line chart needs: rectangles, Bresenham lines
//! (1 or more pixels thick), square markers and bitmap text, and PNG output.

use std::io::Write;

use crate::font::{self, ADVANCE, GLYPH_HEIGHT, GLYPH_WIDTH};

/// An 8-bit sRGB colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    pub const WHITE: Rgb = Rgb(255, 255, 255);
    pub const BLACK: Rgb = Rgb(0, 0, 0);
}

/// A rectangle of pixels, `x0..x1` × `y0..y1` (end exclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rect {
    pub x0: i32,
    pub y0: i32,
    pub x1: i32,
    pub y1: i32,
}

impl Rect {
    pub fn contains(&self, x: i32, y: i32) -> bool {
        (self.x0..self.x1).contains(&x) && (self.y0..self.y1).contains(&y)
    }

    fn intersect(&self, other: &Rect) -> Rect {
        Rect {
            x0: self.x0.max(other.x0),
            y0: self.y0.max(other.y0),
            x1: self.x1.min(other.x1),
            y1: self.y1.min(other.y1),
        }
    }
}

/// Row-major RGB8 pixels. Drawing outside the clip rectangle (the whole canvas unless
/// [`Canvas::set_clip`] narrowed it) is silently dropped, so callers need not clip.
#[derive(Clone, Debug)]
pub struct Canvas {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
    clip: Rect,
}

impl Canvas {
    /// A canvas filled with `background`.
    pub fn new(width: u32, height: u32, background: Rgb) -> Canvas {
        let pixels = [background.0, background.1, background.2].repeat((width * height) as usize);
        let clip = Rect { x0: 0, y0: 0, x1: width as i32, y1: height as i32 };
        Canvas { width, height, pixels, clip }
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    /// RGB8 bytes, row by row.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// Restricts drawing to `clip` (within the canvas); `None` restores the whole canvas.
    pub fn set_clip(&mut self, clip: Option<Rect>) {
        let full = Rect { x0: 0, y0: 0, x1: self.width as i32, y1: self.height as i32 };
        self.clip = clip.map_or(full, |c| c.intersect(&full));
    }

    pub fn get(&self, x: u32, y: u32) -> Option<Rgb> {
        if x >= self.width || y >= self.height {
            return None;
        }
        let i = 3 * (y * self.width + x) as usize;
        Some(Rgb(self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]))
    }

    pub fn put(&mut self, x: i32, y: i32, color: Rgb) {
        if self.clip.contains(x, y) {
            let i = 3 * (y as usize * self.width as usize + x as usize);
            self.pixels[i..i + 3].copy_from_slice(&[color.0, color.1, color.2]);
        }
    }

    pub fn fill_rect(&mut self, rect: Rect, color: Rgb) {
        let r = rect.intersect(&self.clip);
        for y in r.y0..r.y1 {
            for x in r.x0..r.x1 {
                self.put(x, y, color);
            }
        }
    }

    /// The one-pixel outline just inside `rect`.
    pub fn stroke_rect(&mut self, rect: Rect, color: Rgb) {
        let (x1, y1) = (rect.x1 - 1, rect.y1 - 1);
        self.line((rect.x0, rect.y0), (x1, rect.y0), 1, color);
        self.line((rect.x0, y1), (x1, y1), 1, color);
        self.line((rect.x0, rect.y0), (rect.x0, y1), 1, color);
        self.line((x1, rect.y0), (x1, y1), 1, color);
    }

    /// A Bresenham line from `a` to `b`, both ends included. A `thickness` of n draws n pixels
    /// across the line at every step (a vertical span on a mostly horizontal line, a horizontal
    /// one otherwise), centred on it; for even n the extra pixel goes down or right.
    pub fn line(&mut self, a: (i32, i32), b: (i32, i32), thickness: u32, color: Rgb) {
        let t = thickness.max(1) as i32;
        let before = (t - 1) / 2;
        let (mut x, mut y) = a;
        let dx = (b.0 - a.0).abs();
        let dy = -(b.1 - a.1).abs();
        let sx = if a.0 < b.0 { 1 } else { -1 };
        let sy = if a.1 < b.1 { 1 } else { -1 };
        let mostly_horizontal = dx >= -dy;
        let mut err = dx + dy;
        loop {
            for o in -before..t - before {
                if mostly_horizontal {
                    self.put(x, y + o, color);
                } else {
                    self.put(x + o, y, color);
                }
            }
            if (x, y) == b {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// A filled square of side `2 * radius + 1` centred on `center`.
    pub fn marker(&mut self, center: (i32, i32), radius: i32, color: Rgb) {
        let (cx, cy) = center;
        let rect =
            Rect { x0: cx - radius, y0: cy - radius, x1: cx + radius + 1, y1: cy + radius + 1 };
        self.fill_rect(rect, color);
    }

    /// Draws `text` with its top-left corner at (`x`, `y`), each font pixel a `scale`×`scale`
    /// block. Returns the x just past the last character's advance.
    pub fn text(&mut self, x: i32, y: i32, text: &str, scale: u32, color: Rgb) -> i32 {
        let s = scale.max(1) as i32;
        let mut pen = x;
        for c in text.chars() {
            let g = font::glyph(c);
            for gy in 0..GLYPH_HEIGHT {
                for gx in 0..GLYPH_WIDTH {
                    if font::ink(g, gx, gy) {
                        let px = pen + gx as i32 * s;
                        let py = y + gy as i32 * s;
                        self.fill_rect(Rect { x0: px, y0: py, x1: px + s, y1: py + s }, color);
                    }
                }
            }
            pen += ADVANCE as i32 * s;
        }
        pen
    }

    /// Encodes the canvas as an RGB8 PNG.
    pub fn write_png(&self, out: impl Write) -> Result<(), png::EncodingError> {
        let mut encoder = png::Encoder::new(out, self.width, self.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.pixels)?;
        writer.finish()
    }
}

/// Width in pixels of `text` drawn at `scale`, without the trailing space of the last character.
pub fn text_width(text: &str, scale: u32) -> i32 {
    let n = text.chars().count() as i32;
    if n == 0 { 0 } else { (n * ADVANCE as i32 - 1) * scale.max(1) as i32 }
}

/// Height in pixels of a line of text at `scale`, descenders included.
pub fn text_height(scale: u32) -> i32 {
    (GLYPH_HEIGHT as u32 * scale.max(1)) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    const RED: Rgb = Rgb(255, 0, 0);

    fn inked(canvas: &Canvas) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for y in 0..canvas.height() {
            for x in 0..canvas.width() {
                if canvas.get(x, y) != Some(Rgb::WHITE) {
                    out.push((x, y));
                }
            }
        }
        out
    }

    #[test]
    fn line_includes_both_ends_and_is_connected() {
        let mut c = Canvas::new(20, 20, Rgb::WHITE);
        c.line((2, 3), (15, 9), 1, RED);
        let px = inked(&c);
        assert!(px.contains(&(2, 3)) && px.contains(&(15, 9)));
        // A one-pixel line along a shallow slope sets exactly one pixel per column.
        assert_eq!(px.len(), 14);
    }

    #[test]
    fn thick_line_is_two_pixels_wide() {
        let mut c = Canvas::new(10, 10, Rgb::WHITE);
        c.line((1, 4), (8, 4), 2, RED);
        assert_eq!(inked(&c).len(), 8 * 2);
        assert_eq!(c.get(1, 5), Some(RED));
    }

    #[test]
    fn drawing_outside_the_clip_is_dropped() {
        let mut c = Canvas::new(10, 10, Rgb::WHITE);
        c.set_clip(Some(Rect { x0: 2, y0: 2, x1: 5, y1: 5 }));
        c.line((-100, 3), (100, 3), 3, RED);
        c.marker((9, 9), 4, RED);
        assert!(inked(&c).iter().all(|&(x, y)| (2..5).contains(&x) && (2..5).contains(&y)));
        c.set_clip(None);
        c.put(9, 9, RED);
        assert_eq!(c.get(9, 9), Some(RED));
    }

    #[test]
    fn text_advances_by_cell_and_scales() {
        let mut c = Canvas::new(40, 30, Rgb::WHITE);
        let end = c.text(1, 1, "Ab", 2, RED);
        assert_eq!(end, 1 + 2 * 6 * 2);
        assert_eq!(text_width("Ab", 2), 22);
        let px = inked(&c);
        assert!(px.iter().all(|&(x, y)| (1..1 + 22).contains(&x) && (1..1 + 18).contains(&y)));
        // The top of 'A' (.###.) at scale 2 starts two pixels in from the left.
        assert_eq!(c.get(3, 1), Some(RED));
        assert_eq!(c.get(1, 1), Some(Rgb::WHITE));
    }

    #[test]
    fn png_round_trips() {
        let mut c = Canvas::new(7, 5, Rgb::WHITE);
        c.put(3, 2, RED);
        let mut bytes = Vec::new();
        c.write_png(&mut bytes).unwrap();
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height, info.color_type), (7, 5, png::ColorType::Rgb));
        assert_eq!(&buf[..info.buffer_size()], c.pixels());
    }
}
