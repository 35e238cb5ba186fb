//! Loss/accuracy curves as PNG, drawn with `plotters` on its bitmap backend; text goes through
//! `ab_glyph` with a font file read at run time.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The curves' file names (in a run directory).
pub const LOSS_PLOT: &str = "loss.png";
pub const ACCURACY_PLOT: &str = "accuracy.png";

use super::{EpochMetrics, ReportError, io_err, write_atomic};

const PLOT_W: u32 = 800;
const PLOT_H: u32 = 500;
const FONT_FAMILY: &str = "sans-serif";
/// Font files tried in order; `KESTREL_PLOT_FONT` (a .ttf/.otf path) comes first when set.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a sans-serif font with plotters once per process; false when none could be loaded.
fn font_available() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        let env = std::env::var_os("KESTREL_PLOT_FONT").map(PathBuf::from);
        let candidates = env
            .into_iter()
            .chain(FONT_CANDIDATES.iter().map(PathBuf::from));
        for path in candidates {
            let Ok(bytes) = fs::read(&path) else { continue };
            // plotters keeps `&'static [u8]`; this happens at most once per process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(
                FONT_FAMILY,
                plotters::style::FontStyle::Normal,
                bytes,
            )
            .is_ok()
            {
                return true;
            }
        }
        false
    })
}

/// Writes `dir/loss.png` (train and validation loss per epoch) and `dir/accuracy.png` (train and
/// validation accuracy), 800x500, and returns their paths. `dir` is created if missing.
/// Non-finite values are left out of the curves. Text (captions, axis labels, legend) needs a
/// font file (DejaVuSans, see `FONT_CANDIDATES`); without one the curves are drawn without text.
pub fn plot_curves(metrics: &[EpochMetrics], dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    plot_curves_with(metrics, dir, font_available())
}

pub(super) fn plot_curves_with(
    metrics: &[EpochMetrics],
    dir: &Path,
    text: bool,
) -> Result<Vec<PathBuf>, ReportError> {
    if metrics.is_empty() {
        return Err(ReportError::NoMetrics);
    }
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let epochs: Vec<i64> = metrics.iter().map(|m| m.epoch as i64).collect();
    let loss = Chart {
        title: "Loss",
        y_desc: "loss",
        train: metrics.iter().map(|m| m.train_loss).collect(),
        val: metrics.iter().map(|m| m.val_loss).collect(),
        y_floor_one: false,
        legend_top: true,
    };
    let accuracy = Chart {
        title: "Accuracy",
        y_desc: "accuracy",
        train: metrics.iter().map(|m| m.train_accuracy).collect(),
        val: metrics.iter().map(|m| m.val_accuracy).collect(),
        y_floor_one: true,
        legend_top: false,
    };
    let mut paths = Vec::new();
    for (chart, name) in [(loss, LOSS_PLOT), (accuracy, ACCURACY_PLOT)] {
        let path = dir.join(name);
        let rgb = chart
            .render(&epochs, text)
            .map_err(|message| ReportError::Plot {
                path: path.clone(),
                message,
            })?;
        let mut png = Vec::new();
        image::RgbImage::from_raw(PLOT_W, PLOT_H, rgb)
            .expect("buffer is PLOT_W * PLOT_H * 3 bytes")
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .map_err(|source| ReportError::Png {
                path: path.clone(),
                source,
            })?;
        write_atomic(&path, &png)?;
        paths.push(path);
    }
    Ok(paths)
}

struct Chart {
    title: &'static str,
    y_desc: &'static str,
    train: Vec<f64>,
    val: Vec<f64>,
    /// Accuracy: the y axis spans at least 0..1.
    y_floor_one: bool,
    /// Legend in the upper right (falling curves) or lower right (rising curves).
    legend_top: bool,
}

impl Chart {
    /// Draws into an RGB buffer; errors come back as text (plotters' error types borrow the backend).
    fn render(&self, epochs: &[i64], text: bool) -> Result<Vec<u8>, String> {
        use plotters::prelude::*;

        let mut buf = vec![255u8; (PLOT_W * PLOT_H * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (PLOT_W, PLOT_H)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| e.to_string())?;

            let (x0, x1) = (*epochs.iter().min().unwrap(), *epochs.iter().max().unwrap());
            // One epoch (or all the same): widen so the point sits in the middle.
            let (x0, x1) = if x0 == x1 { (x0 - 1, x1 + 1) } else { (x0, x1) };
            let finite = self
                .train
                .iter()
                .chain(&self.val)
                .copied()
                .filter(|v| v.is_finite());
            let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
            let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
            let y0 = lo.min(0.0);
            let mut y1 = if self.y_floor_one {
                hi.max(1.0)
            } else {
                hi * 1.1
            };
            if y1 <= y0 {
                y1 = y0 + 1.0;
            }
            if !self.y_floor_one && hi > 0.0 {
                y1 = y1.max(hi * 1.05);
            }

            let mut builder = ChartBuilder::on(&root);
            builder.margin(20);
            if text {
                builder
                    .caption(self.title, (FONT_FAMILY, 28))
                    .x_label_area_size(50)
                    .y_label_area_size(70);
            }
            let mut chart = builder
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| e.to_string())?;

            let mut mesh = chart.configure_mesh();
            mesh.light_line_style(RGBColor(235, 235, 235))
                .bold_line_style(RGBColor(210, 210, 210));
            if text {
                let n_x = (x1 - x0 + 1).clamp(2, 11) as usize;
                mesh.x_labels(n_x)
                    .y_labels(10)
                    .x_desc("epoch")
                    .y_desc(self.y_desc)
                    .label_style((FONT_FAMILY, 16))
                    .axis_desc_style((FONT_FAMILY, 18))
                    .x_label_formatter(&|x| format!("{x}"))
                    .y_label_formatter(&|y| format!("{y:.2}"));
            }
            mesh.draw().map_err(|e| e.to_string())?;
            if !text {
                // Without label areas plotters draws no axes; frame the plot instead.
                let frame = Rectangle::new([(x0, y0), (x1, y1)], BLACK.stroke_width(1));
                chart
                    .draw_series(std::iter::once(frame))
                    .map_err(|e| e.to_string())?;
            }

            let markers = epochs.len() <= 60;
            let train_color = RGBColor(31, 119, 180);
            let val_color = RGBColor(214, 39, 40);
            for (name, values, color) in [
                ("train", &self.train, train_color),
                ("validation", &self.val, val_color),
            ] {
                let points: Vec<(i64, f64)> = epochs
                    .iter()
                    .zip(values.iter())
                    .filter(|(_, v)| v.is_finite())
                    .map(|(&e, &v)| (e, v))
                    .collect();
                let style = color.stroke_width(3);
                let series = chart
                    .draw_series(LineSeries::new(points.iter().copied(), style))
                    .map_err(|e| e.to_string())?;
                if text {
                    series.label(name).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
                    });
                }
                if markers {
                    chart
                        .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                        .map_err(|e| e.to_string())?;
                }
            }
            if text {
                chart
                    .configure_series_labels()
                    .position(if self.legend_top {
                        SeriesLabelPosition::UpperRight
                    } else {
                        SeriesLabelPosition::LowerRight
                    })
                    .label_font((FONT_FAMILY, 16))
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| e.to_string())?;
            }
            root.present().map_err(|e| e.to_string())?;
        }
        Ok(buf)
    }
}
