//! `trainer infer`: images classified on a device over MQTT; for a labelled table (`--data`,
//! optionally only the images a run held out) also accuracy and a confusion matrix.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use crate::data::{SourceOpts, Split};
use crate::train::{RunDir, SplitRecord};
use anyhow::{Context, Result, bail};
use kestrel_fleet::infer::{Image, Outcome};
use kestrel_shared::protocol::InferReply;

use super::BrokerArgs;
use crate::cli::args::TableArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Device id (as in its agent.toml).
    #[arg(long)]
    device: String,
    /// A labelled table whose images are sent; its labels are compared with the replies.
    #[command(flatten)]
    table: TableArgs,
    /// Only the images of --data that a run held out for testing (its split.json).
    #[arg(long, requires = "data")]
    held_out: Option<PathBuf>,
    /// Requests outstanding at once [default: 8].
    #[arg(long)]
    window: Option<usize>,
    /// Load mode: send the images round robin at this many requests per second (no window; a
    /// device that cannot keep up answers `busy`) and print one report: answered, busy, errors,
    /// lost, round-trip and device latency p50/p99. Fails when a request is lost or errors.
    #[arg(long, value_name = "PER_SECOND", conflicts_with = "window")]
    rate: Option<f64>,
    /// Load mode: seconds to keep sending at --rate.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        requires = "rate"
    )]
    duration: f64,
    /// Seconds to wait for the device before giving up.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// One JSON line per reply, then one summary line.
    #[arg(long)]
    json: bool,
    /// Image files to classify (after those of --data).
    images: Vec<PathBuf>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let mut images = match args.table.optional_path()? {
        Some(path) => table_images(&path, &args.table.source(), args.held_out.as_deref())?,
        None => Vec::new(),
    };
    for p in &args.images {
        let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
        images.push(Image {
            name: p.display().to_string(),
            bytes,
            label: None,
        });
    }
    if images.is_empty() {
        bail!("no images: pass image files or --data TABLE");
    }
    let timeout = Duration::from_secs(args.timeout);
    if let Some(rate) = args.rate {
        return load(&args, &images, rate, timeout);
    }
    let out = kestrel_fleet::infer::classify(
        &args.broker.config(),
        &args.device,
        &images,
        args.window.unwrap_or(8),
        timeout,
    )?;
    for (img, r) in images.iter().zip(&out.replies) {
        print_reply(&img.name, r, args.json);
    }
    print_summary(&out, args.json)?;
    Ok(if out.summary.errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `--rate`: a paced load run and its report.
fn load(args: &Args, images: &[Image], rate: f64, timeout: Duration) -> Result<ExitCode> {
    if !(rate > 0.0 && args.duration > 0.0) {
        bail!("--rate and --duration must be positive");
    }
    let duration = Duration::from_secs_f64(args.duration);
    let r = kestrel_fleet::infer::load(
        &args.broker.config(),
        &args.device,
        images,
        rate,
        duration,
        timeout,
    )?;
    if args.json {
        outln!("{}", serde_json::to_string(&r)?);
    } else {
        outln!(
            "{}: {} requests in {:.1} s ({:.0}/s asked, {:.0}/s sent): {} answered, {} busy, \
             {} errors, {} lost; round trip p50 {:.1} ms p99 {:.1} ms; device p50 {:.1} ms p99 {:.1} ms",
            r.device,
            r.sent,
            r.seconds,
            r.rate,
            r.sent_rate,
            r.answered,
            r.busy,
            r.errors,
            r.lost,
            r.round_trip_p50_ms,
            r.round_trip_p99_ms,
            r.device_latency_p50_ms,
            r.device_latency_p99_ms
        );
    }
    Ok(if r.lost > 0 || r.errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// A table's images with their labels, or only those the run in `held_out` kept for testing.
fn table_images(path: &Path, source: &SourceOpts, held_out: Option<&Path>) -> Result<Vec<Image>> {
    let ds = crate::data::load(path, source)?;
    let keep = held_out.map(test_split).transpose()?;
    let out: Vec<Image> = ds
        .samples
        .into_iter()
        .filter(|s| keep.as_ref().is_none_or(|k| k.contains(&s.sha256)))
        .map(|s| {
            Ok(Image {
                bytes: s.bytes()?.into_owned(),
                name: s.id,
                label: Some(ds.labels[s.label].clone()),
            })
        })
        .collect::<Result<_>>()?;
    if out.is_empty() {
        let what = if held_out.is_some() {
            " held out by that run"
        } else {
            ""
        };
        bail!("{}: no images{what}", path.display());
    }
    Ok(out)
}

/// The sha256 of every image a run held out for testing (its split file).
fn test_split(run: &Path) -> Result<HashSet<String>> {
    let p = run.join(RunDir::SPLIT);
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let recs: Vec<SplitRecord> =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
    Ok(recs
        .into_iter()
        .filter(|r| r.split == Split::Test)
        .map(|r| r.sha256)
        .collect())
}

fn print_reply(name: &str, r: &InferReply, json: bool) {
    match (&r.prediction, &r.error, json) {
        (Some(p), _, true) => outln!(
            "{}",
            serde_json::json!({"image": name, "request": r.request, "prediction": p})
        ),
        (Some(p), _, false) => {
            let top = p
                .top
                .first()
                .map_or("-".into(), |c| format!("{} ({:.3})", c.label, c.score));
            outln!("{name}: {top}  [v{} {:.1} ms]", p.version, p.latency_ms);
        }
        (None, e, true) => outln!(
            "{}",
            serde_json::json!({"image": name, "request": r.request, "error": e.clone().unwrap_or_default()})
        ),
        (None, e, false) => tracing::error!("{name}: {}", e.as_deref().unwrap_or_default()),
    }
}

/// The evaluation (labelled tables) and the summary line.
fn print_summary(out: &Outcome, json: bool) -> Result<()> {
    let s = &out.summary;
    let mut summary = serde_json::to_value(s)?;
    if let Some(l) = &out.labelled {
        let e = crate::report::evaluate(&l.predicted, &l.truth, &l.labels, None);
        if !json {
            outln!("{}", e.to_table());
        }
        summary["evaluation"] = serde_json::to_value(&e)?;
    }
    if json {
        outln!("{summary}");
    } else {
        outln!(
            "{} requests to {} in {:.1} s: {} errors, device latency p50 {:.1} ms, p95 {:.1} ms",
            s.requests,
            s.device,
            s.seconds,
            s.errors,
            s.device_latency_p50_ms,
            s.device_latency_p95_ms
        );
    }
    Ok(())
}
