//! Training reports: per-epoch metrics (JSON lines), evaluation summaries (accuracy, per-class
//! precision/recall/F1, confusion matrix), loss/accuracy curves as PNG, and crash-safe JSON files.
//!
//! Curves are drawn with `plotters` on its bitmap backend; text goes through `ab_glyph` with a
//! font file read at run time (no fontconfig/freetype). Without a font file the curves are still
//! drawn, only without captions, tick labels and legend.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

mod plot;

#[cfg(test)]
use plot::plot_curves_with;
pub use plot::{ACCURACY_PLOT, LOSS_PLOT, plot_curves};

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
    /// The most frequent mistakes, most frequent first (at most [`CONFUSED_PAIRS`]).
    #[serde(default)]
    pub most_confused: Vec<Confusion>,
}

/// How many of the most frequent mistakes an [`Evaluation`] names.
pub const CONFUSED_PAIRS: usize = 5;

/// One kind of mistake: samples of `truth` predicted as `predicted`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Confusion {
    pub truth: String,
    pub predicted: String,
    pub count: usize,
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

    let mut most_confused: Vec<Confusion> = confusion
        .iter()
        .enumerate()
        .flat_map(|(t, row)| row.iter().enumerate().map(move |(p, &c)| (t, p, c)))
        .filter(|&(t, p, c)| t != p && c > 0)
        .map(|(t, p, count)| Confusion {
            truth: labels[t].clone(),
            predicted: labels[p].clone(),
            count,
        })
        .collect();
    // Stable: ties keep the matrix order.
    most_confused.sort_by(|a, b| b.count.cmp(&a.count));
    most_confused.truncate(CONFUSED_PAIRS);
    Evaluation {
        accuracy,
        loss,
        samples,
        labels,
        per_class,
        confusion,
        most_confused,
    }
}

/// The share of predictions equal to the truth, pair by pair (0 with no pairs): the one
/// accuracy of the reports, the export checks and the training logs.
pub fn accuracy<P, T>(pred: P, truth: T) -> f64
where
    P: IntoIterator<Item = usize>,
    T: IntoIterator<Item = usize>,
{
    let (mut pairs, mut hits) = (0, 0);
    for (p, t) in pred.into_iter().zip(truth) {
        pairs += 1;
        hits += usize::from(p == t);
    }
    ratio(hits, pairs)
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
        if !self.most_confused.is_empty() {
            let pairs: Vec<String> = self
                .most_confused
                .iter()
                .map(|c| format!("{} as {} ({})", c.truth, c.predicted, c.count))
                .collect();
            out.push_str(&format!("\nmost confused: {}\n", pairs.join(", ")));
        }
        out
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
    kestrel_shared::fsutil::write_atomic(path, bytes).map_err(io_err(path))
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

/// A progress bar (stderr, or the host's sink: [`kestrel_shared::progress`]).
pub fn progress(len: u64, what: &str) -> ProgressBar {
    kestrel_shared::progress::bar(len, what)
}

#[cfg(test)]
mod tests;
