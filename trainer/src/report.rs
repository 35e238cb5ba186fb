//! Training reports: per-epoch metrics (JSON lines), evaluation summaries (accuracy, per-class
//! precision/recall/F1, confusion matrix), loss/accuracy curves as PNG, and crash-safe JSON files.
//!
//! Curves are drawn with `plotters` on its bitmap backend; text goes through `ab_glyph` with a
//! font file read at run time (no fontconfig/freetype). Without a font file the curves are still
//! drawn, only without captions, tick labels and legend.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// One line of `metrics.jsonl`: the metrics of one finished epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochMetrics {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_accuracy: f64,
    pub val_loss: f64,
    pub val_accuracy: f64,
    pub samples_per_s: f64,
}

/// Precision, recall and F1 of one class (one-vs-rest); `support` is the number of true samples.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClassMetrics {
    pub label: String,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    pub support: usize,
}

/// Summary of predictions against ground truth.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Evaluation {
    pub accuracy: f64,
    pub loss: Option<f64>,
    pub samples: usize,
    pub labels: Vec<String>,
    pub per_class: Vec<ClassMetrics>,
    /// `confusion[true][pred]`: number of samples of class `true` predicted as `pred`.
    pub confusion: Vec<Vec<usize>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot serialise to JSON: {source}", path.display())]
    Serialize {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}:{line}: corrupt JSON line: {source}", path.display())]
    CorruptLine {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        source: serde_json::Error,
    },
    #[error("{}: drawing the chart failed: {message}", path.display())]
    Plot { path: PathBuf, message: String },
    #[error("{}: PNG encoding failed: {source}", path.display())]
    Png {
        path: PathBuf,
        source: image::ImageError,
    },
    #[error("no epoch metrics to plot")]
    NoMetrics,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------------------------------------
// Evaluation
// ---------------------------------------------------------------------------------------------

/// Compares predicted class indices with true ones.
///
/// Precision is 0 for a class that was never predicted, recall is 0 for a class with no support,
/// F1 is 0 when both are 0. Indices beyond `labels` get extra classes named `class_<i>` rather
/// than being dropped. With no samples the accuracy is 0.
///
/// # Panics
/// If `pred` and `truth` differ in length.
pub fn evaluate(
    pred: &[usize],
    truth: &[usize],
    labels: &[String],
    loss: Option<f64>,
) -> Evaluation {
    assert_eq!(
        pred.len(),
        truth.len(),
        "evaluate: {} predictions for {} ground-truth labels",
        pred.len(),
        truth.len()
    );
    let max_index = pred.iter().chain(truth).copied().max();
    let n = labels.len().max(max_index.map_or(0, |m| m + 1));
    let labels: Vec<String> = (0..n)
        .map(|i| {
            labels
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("class_{i}"))
        })
        .collect();

    let mut confusion = vec![vec![0usize; n]; n];
    for (&p, &t) in pred.iter().zip(truth) {
        confusion[t][p] += 1;
    }
    let samples = pred.len();
    let correct: usize = (0..n).map(|i| confusion[i][i]).sum();
    let accuracy = ratio(correct, samples);

    let per_class = (0..n)
        .map(|c| {
            let tp = confusion[c][c];
            let support: usize = confusion[c].iter().sum();
            let predicted: usize = confusion.iter().map(|row| row[c]).sum();
            let precision = ratio(tp, predicted);
            let recall = ratio(tp, support);
            let f1 = if precision + recall > 0.0 {
                2.0 * precision * recall / (precision + recall)
            } else {
                0.0
            };
            ClassMetrics {
                label: labels[c].clone(),
                precision,
                recall,
                f1,
                support,
            }
        })
        .collect();

    Evaluation {
        accuracy,
        loss,
        samples,
        labels,
        per_class,
        confusion,
    }
}

fn ratio(num: usize, den: usize) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Labels longer than this many characters are cut (the last kept character becomes `…`).
const MAX_LABEL_CHARS: usize = 10;

fn short_label(label: &str) -> String {
    if label.chars().count() <= MAX_LABEL_CHARS {
        label.to_string()
    } else {
        let mut s: String = label.chars().take(MAX_LABEL_CHARS - 1).collect();
        s.push('…');
        s
    }
}

/// Right-aligns `s` in `width` characters (counting chars, not bytes, so `…` pads correctly).
fn pad_left(s: &str, width: usize) -> String {
    let len = s.chars().count();
    format!("{}{s}", " ".repeat(width.saturating_sub(len)))
}

fn pad_right(s: &str, width: usize) -> String {
    let len = s.chars().count();
    format!("{s}{}", " ".repeat(width.saturating_sub(len)))
}

impl Evaluation {
    /// Human-readable report: accuracy (and loss) line, per-class table with a macro average,
    /// and the confusion matrix (rows: true class, columns: predicted class). Labels longer than
    /// 10 characters are truncated.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let correct: usize = (0..self.confusion.len())
            .map(|i| self.confusion[i].get(i).copied().unwrap_or(0))
            .sum();
        out.push_str(&format!(
            "accuracy: {:.4} ({correct}/{} correct)",
            self.accuracy, self.samples
        ));
        if let Some(loss) = self.loss {
            out.push_str(&format!("  loss: {loss:.4}"));
        }
        out.push_str("\n\n");

        let short: Vec<String> = self.labels.iter().map(|l| short_label(l)).collect();
        let label_w = short
            .iter()
            .map(|s| s.chars().count())
            .chain(["macro avg".len(), "label".len()])
            .max()
            .unwrap_or(5);
        out.push_str(&format!(
            "{}  {:>9}  {:>9}  {:>9}  {:>7}\n",
            pad_right("label", label_w),
            "precision",
            "recall",
            "f1",
            "support"
        ));
        for (c, m) in self.per_class.iter().enumerate() {
            let name = short
                .get(c)
                .cloned()
                .unwrap_or_else(|| short_label(&m.label));
            out.push_str(&format!(
                "{}  {:>9.4}  {:>9.4}  {:>9.4}  {:>7}\n",
                pad_right(&name, label_w),
                m.precision,
                m.recall,
                m.f1,
                m.support
            ));
        }
        if !self.per_class.is_empty() {
            let k = self.per_class.len() as f64;
            let mean = |f: fn(&ClassMetrics) -> f64| self.per_class.iter().map(f).sum::<f64>() / k;
            out.push_str(&format!(
                "{}  {:>9.4}  {:>9.4}  {:>9.4}  {:>7}\n",
                pad_right("macro avg", label_w),
                mean(|m| m.precision),
                mean(|m| m.recall),
                mean(|m| m.f1),
                self.samples
            ));
        }

        out.push_str("\nconfusion matrix (rows: true, columns: predicted)\n");
        let corner = "true\\pred";
        let row_w = short
            .iter()
            .map(|s| s.chars().count())
            .chain([corner.len()])
            .max()
            .unwrap_or(corner.len());
        let max_count = self.confusion.iter().flatten().copied().max().unwrap_or(0);
        let col_w: Vec<usize> = short
            .iter()
            .map(|s| s.chars().count().max(max_count.to_string().len()))
            .collect();
        out.push_str(&pad_right(corner, row_w));
        for (s, &w) in short.iter().zip(&col_w) {
            out.push_str("  ");
            out.push_str(&pad_left(s, w));
        }
        out.push('\n');
        for (t, row) in self.confusion.iter().enumerate() {
            let name = short.get(t).map(String::as_str).unwrap_or("?");
            out.push_str(&pad_right(name, row_w));
            for (p, count) in row.iter().enumerate() {
                out.push_str("  ");
                out.push_str(&pad_left(
                    &count.to_string(),
                    col_w.get(p).copied().unwrap_or(1),
                ));
            }
            out.push('\n');
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Curves
// ---------------------------------------------------------------------------------------------

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

fn plot_curves_with(
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
    for (chart, name) in [(loss, "loss.png"), (accuracy, "accuracy.png")] {
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

// ---------------------------------------------------------------------------------------------
// JSON files
// ---------------------------------------------------------------------------------------------

/// Appends `row` as one JSON line and fsyncs. If the file ends in a partial line (a crash during
/// an earlier append), that fragment is cut off first so the new line starts cleanly; a final
/// line that is valid JSON but lacks its newline is kept and terminated instead.
pub fn append_jsonl<T: Serialize>(path: &Path, row: &T) -> Result<(), ReportError> {
    let mut line = serde_json::to_vec(row).map_err(|source| ReportError::Serialize {
        path: path.to_path_buf(),
        source,
    })?;
    line.push(b'\n');

    let existed = path.exists();
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_err(path))?;
    repair_tail(&mut file).map_err(io_err(path))?;
    file.seek(SeekFrom::End(0)).map_err(io_err(path))?;
    file.write_all(&line).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))?;
    if !existed {
        sync_parent(path);
    }
    Ok(())
}

/// Makes the file end in `\n` (or be empty): drops an unterminated, unparseable last fragment.
fn repair_tail(file: &mut File) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(());
    }
    let mut last = [0u8; 1];
    file.seek(SeekFrom::Start(len - 1))?;
    file.read_exact(&mut last)?;
    if last[0] == b'\n' {
        return Ok(());
    }
    // Find the start of the unterminated fragment by scanning back in chunks.
    let mut end = len;
    let mut fragment_start = 0u64;
    let mut chunk = vec![0u8; 64 * 1024];
    'scan: while end > 0 {
        let start = end.saturating_sub(chunk.len() as u64);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut chunk[..n])?;
        if let Some(i) = chunk[..n].iter().rposition(|&b| b == b'\n') {
            fragment_start = start + i as u64 + 1;
            break 'scan;
        }
        end = start;
    }
    let mut fragment = Vec::with_capacity((len - fragment_start) as usize);
    file.seek(SeekFrom::Start(fragment_start))?;
    file.read_to_end(&mut fragment)?;
    if !is_blank(&fragment) && serde_json::from_slice::<serde_json::Value>(&fragment).is_ok() {
        file.seek(SeekFrom::End(0))?;
        file.write_all(b"\n")?;
    } else {
        file.set_len(fragment_start)?;
    }
    Ok(())
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(|&b| b.is_ascii_whitespace() || b == 0)
}

/// Reads a JSON-lines file. Blank lines are skipped. A last line without a terminating newline
/// that does not parse is taken to be a crash-truncated append and skipped; any other line that
/// does not parse is an error naming the file and the 1-based line number.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, ReportError> {
    let data = fs::read(path).map_err(io_err(path))?;
    let terminated = data.last().is_none_or(|&b| b == b'\n');
    let lines: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    let last = lines.len() - 1;
    let mut rows = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if is_blank(line) {
            continue;
        }
        match serde_json::from_slice(line) {
            Ok(row) => rows.push(row),
            Err(_) if i == last && !terminated => {}
            Err(source) => {
                return Err(ReportError::CorruptLine {
                    path: path.to_path_buf(),
                    line: i + 1,
                    source,
                });
            }
        }
    }
    Ok(rows)
}

/// Writes `value` as pretty JSON: to a temporary file in the same directory, fsync, rename over
/// `path`, then fsync the directory. Readers see the old or the new file, never a partial one.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), ReportError> {
    let mut json = serde_json::to_vec_pretty(value).map_err(|source| ReportError::Serialize {
        path: path.to_path_buf(),
        source,
    })?;
    json.push(b'\n');
    write_atomic(path, &json)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut file = File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(bytes).map_err(io_err(&tmp))?;
        file.sync_all().map_err(io_err(&tmp))?;
        drop(file);
        fs::rename(&tmp, path).map_err(io_err(path))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    } else {
        sync_parent(path);
    }
    result
}

/// Best-effort fsync of the directory holding `path` (makes a create/rename durable on Unix).
fn sync_parent(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    /// truth: cat cat cat dog dog bird bird bird bird (indices 0,0,0,1,1,2,2,2,2)
    /// pred:  cat cat dog dog cat bird bird cat  dog
    /// confusion (rows true): cat [2,1,0]; dog [1,1,0]; bird [1,1,2]
    /// cat:  tp 2, predicted 4, support 3 -> P 1/2, R 2/3, F1 4/7
    /// dog:  tp 1, predicted 3, support 2 -> P 1/3, R 1/2, F1 2/5
    /// bird: tp 2, predicted 2, support 4 -> P 1,   R 1/2, F1 2/3
    /// accuracy 5/9
    fn example() -> Evaluation {
        let truth = [0, 0, 0, 1, 1, 2, 2, 2, 2];
        let pred = [0, 0, 1, 1, 0, 2, 2, 0, 1];
        evaluate(
            &pred,
            &truth,
            &labels(&["cat", "dog", "bird"]),
            Some(0.8125),
        )
    }

    #[test]
    fn report_evaluate_three_classes() {
        let e = example();
        assert_eq!(e.samples, 9);
        assert!(close(e.accuracy, 5.0 / 9.0));
        assert_eq!(
            e.confusion,
            vec![vec![2, 1, 0], vec![1, 1, 0], vec![1, 1, 2]]
        );
        let expect = [
            ("cat", 0.5, 2.0 / 3.0, 4.0 / 7.0, 3),
            ("dog", 1.0 / 3.0, 0.5, 0.4, 2),
            ("bird", 1.0, 0.5, 2.0 / 3.0, 4),
        ];
        for (m, (label, p, r, f1, support)) in e.per_class.iter().zip(expect) {
            assert_eq!(m.label, label);
            assert!(close(m.precision, p), "{label} precision {}", m.precision);
            assert!(close(m.recall, r), "{label} recall {}", m.recall);
            assert!(close(m.f1, f1), "{label} f1 {}", m.f1);
            assert_eq!(m.support, support);
        }
    }

    #[test]
    fn report_evaluate_undefined_is_zero() {
        // Class 1 never predicted (precision undefined), class 2 has no support (recall undefined).
        let e = evaluate(&[0, 0, 2], &[0, 1, 1], &labels(&["a", "b", "c"]), None);
        assert!(close(e.accuracy, 1.0 / 3.0));
        let b = &e.per_class[1];
        assert_eq!((b.precision, b.recall, b.f1, b.support), (0.0, 0.0, 0.0, 2));
        let c = &e.per_class[2];
        assert_eq!((c.precision, c.recall, c.f1, c.support), (0.0, 0.0, 0.0, 0));
        // No samples at all.
        let empty = evaluate(&[], &[], &labels(&["a"]), None);
        assert_eq!(empty.accuracy, 0.0);
        assert_eq!(empty.confusion, vec![vec![0]]);
        // Out-of-range indices get their own class.
        let extra = evaluate(&[3], &[0], &labels(&["a"]), None);
        assert_eq!(
            extra.labels,
            labels(&["a", "class_1", "class_2", "class_3"])
        );
        assert_eq!(extra.confusion[0][3], 1);
    }

    #[test]
    fn report_table_has_labels_and_numbers() {
        let mut e = example();
        e.labels[2] = "a-very-long-bird-label".into();
        e.per_class[2].label = e.labels[2].clone();
        let t = e.to_table();
        println!("{t}");
        assert!(t.contains("accuracy: 0.5556 (5/9 correct)"), "{t}");
        assert!(t.contains("loss: 0.8125"), "{t}");
        for label in ["cat", "dog", "a-very-lo…"] {
            assert!(t.contains(label), "{label} missing:\n{t}");
        }
        assert!(!t.contains("a-very-long"), "long label not truncated:\n{t}");
        for number in ["0.5000", "0.6667", "0.5714", "0.3333", "0.4000", "1.0000"] {
            assert!(t.contains(number), "{number} missing:\n{t}");
        }
        assert!(t.contains("precision") && t.contains("recall") && t.contains("support"));
        assert!(t.contains("true\\pred"));
        let bird_row = t
            .lines()
            .rev()
            .find(|l| l.starts_with("a-very-lo…"))
            .unwrap();
        let counts: Vec<&str> = bird_row.split_whitespace().skip(1).collect();
        assert_eq!(counts, ["1", "1", "2"]);
    }

    fn sample_metrics(n: usize) -> Vec<EpochMetrics> {
        (1..=n)
            .map(|e| {
                let x = e as f64;
                EpochMetrics {
                    epoch: e,
                    train_loss: 2.0 / x,
                    train_accuracy: 1.0 - 0.5 / x,
                    val_loss: 2.2 / x + 0.05,
                    val_accuracy: 0.95 - 0.5 / x,
                    samples_per_s: 100.0,
                }
            })
            .collect()
    }

    fn check_png(path: &Path) {
        assert!(
            fs::metadata(path).unwrap().len() > 0,
            "{} empty",
            path.display()
        );
        let img = image::open(path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (800, 500), "{}", path.display());
        let first = *img.get_pixel(0, 0);
        assert!(
            img.pixels().any(|p| *p != first),
            "{} is blank",
            path.display()
        );
    }

    /// `KESTREL_KEEP_PLOTS=dir` copies the test plots to `dir/<case>/` for a look.
    fn keep_plots(paths: &[PathBuf], case: &str) {
        if let Some(keep) = std::env::var_os("KESTREL_KEEP_PLOTS") {
            let keep = PathBuf::from(keep).join(case);
            fs::create_dir_all(&keep).unwrap();
            for p in paths {
                fs::copy(p, keep.join(p.file_name().unwrap())).unwrap();
            }
        }
    }

    #[test]
    fn report_plot_curves_writes_pngs() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("plots");
        let paths = plot_curves(&sample_metrics(12), &out).unwrap();
        assert_eq!(paths, vec![out.join("loss.png"), out.join("accuracy.png")]);
        for p in &paths {
            check_png(p);
        }
        keep_plots(&paths, "twelve");
        // Nothing but the two PNGs (no temp files).
        let mut names: Vec<_> = fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["accuracy.png", "loss.png"]);
    }

    #[test]
    fn report_plot_curves_one_epoch_and_no_font() {
        let dir = tempfile::tempdir().unwrap();
        let one = plot_curves(&sample_metrics(1), dir.path()).unwrap();
        for p in &one {
            check_png(p);
        }
        keep_plots(&one, "one");
        // Without text (as when no font file exists) the curves are still drawn.
        let bare = dir.path().join("bare");
        let mut m = sample_metrics(5);
        m[2].val_loss = f64::NAN;
        let bare = plot_curves_with(&m, &bare, false).unwrap();
        for p in &bare {
            check_png(p);
        }
        keep_plots(&bare, "no-font");
        assert!(matches!(
            plot_curves(&[], dir.path()),
            Err(ReportError::NoMetrics)
        ));
    }

    #[test]
    fn report_jsonl_roundtrip_and_truncated_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let rows = sample_metrics(3);
        for r in &rows {
            append_jsonl(&path, r).unwrap();
        }
        assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), rows);

        // A crash mid-append leaves a partial last line: skipped on read.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"epoch":4,"train_loss":0.3,"trai"#)
            .unwrap();
        drop(f);
        assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), rows);

        // The next append cuts the fragment off rather than gluing onto it.
        let next = sample_metrics(4).pop().unwrap();
        append_jsonl(&path, &next).unwrap();
        let mut all = rows.clone();
        all.push(next);
        assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), all);
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 4);
    }

    #[test]
    fn report_jsonl_corrupt_middle_line_names_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let rows = sample_metrics(3);
        let mut text = String::new();
        text.push_str(&serde_json::to_string(&rows[0]).unwrap());
        text.push('\n');
        text.push_str("{\"epoch\": 2, garbage\n");
        text.push_str(&serde_json::to_string(&rows[2]).unwrap());
        text.push('\n');
        fs::write(&path, text).unwrap();
        let err = read_jsonl::<EpochMetrics>(&path).unwrap_err();
        assert!(
            matches!(err, ReportError::CorruptLine { line: 2, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("metrics.jsonl:2:"), "{msg}");

        // A complete (newline-terminated) corrupt last line is an error too, not a crash tail.
        let rows_text = format!("{}\nnot json\n", serde_json::to_string(&rows[0]).unwrap());
        fs::write(&path, rows_text).unwrap();
        let err = read_jsonl::<EpochMetrics>(&path).unwrap_err();
        assert!(
            matches!(err, ReportError::CorruptLine { line: 2, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn report_write_json_atomic_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("evaluation.json");
        let e = example();
        write_json_atomic(&path, &e).unwrap();
        write_json_atomic(&path, &e).unwrap(); // overwrite
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\n  \"accuracy\""), "not pretty:\n{text}");
        let back: Evaluation = serde_json::from_str(&text).unwrap();
        assert_eq!(back.confusion, e.confusion);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["evaluation.json"]);
        // A failing write (missing directory) leaves nothing behind either.
        assert!(write_json_atomic(&dir.path().join("missing/x.json"), &e).is_err());
    }
}
