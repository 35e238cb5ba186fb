//! Inference over MQTT (`trainer infer`): images sent to a device as requests, the replies
//! collected in request order, and what they add up to (errors, device latency, and for
//! labelled images the top-1 predictions against the true labels).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::now_unix;
use kestrel_shared::protocol::{InferReply, parse};
use kestrel_shared::stats::quantile;
use serde::Serialize;

use crate::{Conn, FleetError};

fn error_reply(request: &str, device: &str, error: String) -> InferReply {
    InferReply {
        request: request.to_string(),
        device: device.to_string(),
        prediction: None,
        error: Some(error),
    }
}

/// Sends images to `device` as inference requests (at most `window` outstanding) and collects
/// the replies in request order; a request without a reply within `timeout` is an error reply.
pub fn infer(
    cfg: &BrokerConfig,
    device: &str,
    images: &[(String, Vec<u8>)],
    window: usize,
    timeout: Duration,
) -> Result<Vec<InferReply>, FleetError> {
    let mut conn = Conn::connect(cfg, "infer")?;
    conn.subscribe(&conn.topics.result_filter(device))?;
    let tag = format!("{}-{}", std::process::id(), now_unix() % 100_000);
    let ids: Vec<String> = (0..images.len()).map(|i| format!("{tag}-{i}")).collect();
    let mut replies: BTreeMap<String, InferReply> = BTreeMap::new();
    let pb = crate::progress(images.len() as u64, "infer");
    let mut next = 0;
    let mut last_reply = Instant::now();
    while replies.len() < images.len() {
        while next < images.len() && next - replies.len() < window.max(1) {
            let (name, bytes) = &images[next];
            let topic = conn.topics.infer(device, &ids[next]);
            if bytes.len() + topic.len() + 16 > cfg.max_packet_bytes {
                // rumqttc would drop the whole connection on an oversize packet.
                let error = format!(
                    "{name}: {} bytes do not fit the broker packet limit of {} bytes",
                    bytes.len(),
                    cfg.max_packet_bytes
                );
                replies.insert(ids[next].clone(), error_reply(&ids[next], device, error));
                pb.inc(1);
            } else {
                conn.send(topic, bytes.clone())?;
            }
            next += 1;
        }
        match conn.recv(Duration::from_millis(200))? {
            Some((t, p)) => {
                let r: InferReply = parse(&t, &p)?;
                if ids.contains(&r.request) && replies.insert(r.request.clone(), r).is_none() {
                    pb.inc(1);
                    last_reply = Instant::now();
                }
            }
            None if last_reply.elapsed() > timeout => break,
            None => {}
        }
    }
    pb.finish_and_clear();
    conn.disconnect();
    Ok(ids
        .iter()
        .zip(images)
        .map(|(id, (name, _))| {
            replies.remove(id).unwrap_or_else(|| {
                error_reply(id, device, format!("{name}: no reply within {timeout:?}"))
            })
        })
        .collect())
}

/// One image to classify: a name for messages, its bytes, and its true label when known.
#[derive(Debug, Clone)]
pub struct Image {
    pub name: String,
    pub bytes: Vec<u8>,
    pub label: Option<String>,
}

/// What a batch of requests added up to (`trainer infer`'s summary line).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub device: String,
    pub requests: usize,
    pub errors: usize,
    pub seconds: f64,
    pub device_latency_p50_ms: f64,
    pub device_latency_p95_ms: f64,
}

/// Top-1 predictions of the answered labelled images against their true labels, as indices
/// into `labels` (the table's label names, sorted; the model's label order need not match the
/// table's). A predicted label the table does not have is `labels.len()`.
#[derive(Debug, Clone, PartialEq)]
pub struct Labelled {
    pub labels: Vec<String>,
    pub predicted: Vec<usize>,
    pub truth: Vec<usize>,
}

/// The replies to a batch of images (in the images' order) and what they add up to.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub replies: Vec<InferReply>,
    pub summary: Summary,
    /// When every image had a label.
    pub labelled: Option<Labelled>,
}

/// [`infer`] on `images`, summarised; see [`Outcome`].
pub fn classify(
    cfg: &BrokerConfig,
    device: &str,
    images: &[Image],
    window: usize,
    timeout: Duration,
) -> Result<Outcome, FleetError> {
    let inputs: Vec<(String, Vec<u8>)> = images
        .iter()
        .map(|i| (i.name.clone(), i.bytes.clone()))
        .collect();
    let start = Instant::now();
    let replies = infer(cfg, device, &inputs, window, timeout)?;
    let summary = summarise(device, &replies, start.elapsed().as_secs_f64());
    let truth: Option<Vec<&str>> = images.iter().map(|i| i.label.as_deref()).collect();
    let labelled = truth
        .filter(|t| !t.is_empty())
        .map(|t| labelled(&replies, &t));
    Ok(Outcome {
        replies,
        summary,
        labelled,
    })
}

/// Error count and device latency percentiles of `replies`.
pub fn summarise(device: &str, replies: &[InferReply], seconds: f64) -> Summary {
    let mut latencies: Vec<f64> = replies
        .iter()
        .filter_map(|r| r.prediction.as_ref().map(|p| p.latency_ms))
        .collect();
    latencies.sort_by(f64::total_cmp);
    let pct = |p: f64| quantile(&latencies, p);
    Summary {
        device: device.to_string(),
        requests: replies.len(),
        errors: replies.iter().filter(|r| r.prediction.is_none()).count(),
        seconds,
        device_latency_p50_ms: pct(0.5),
        device_latency_p95_ms: pct(0.95),
    }
}

/// The top-1 labels of the answered replies against `truth` (one label per reply).
pub fn labelled(replies: &[InferReply], truth: &[&str]) -> Labelled {
    let mut labels: Vec<String> = truth.iter().map(|s| s.to_string()).collect();
    labels.sort();
    labels.dedup();
    let idx = |s: &str| labels.iter().position(|l| l == s);
    let (mut predicted, mut gold) = (Vec::new(), Vec::new());
    for (r, t) in replies.iter().zip(truth) {
        if let Some(p) = r.prediction.as_ref().and_then(|p| p.top.first()) {
            predicted.push(idx(&p.label).unwrap_or(labels.len()));
            gold.push(idx(t).expect("label from the table"));
        }
    }
    Labelled {
        labels,
        predicted,
        truth: gold,
    }
}

/// What a paced load run added up to (`trainer infer --rate`): every request sent is answered
/// (a prediction, or `busy` when the device's queue was full, or another error) or lost.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    pub device: String,
    /// Requests per second asked for, and reached while sending.
    pub rate: f64,
    pub sent_rate: f64,
    pub seconds: f64,
    pub sent: usize,
    pub answered: usize,
    pub busy: usize,
    pub errors: usize,
    pub lost: usize,
    /// Round trip (publish to reply) of the answered requests, as the client sees it.
    pub round_trip_p50_ms: f64,
    pub round_trip_p99_ms: f64,
    /// The device's own inference latency of the answered requests.
    pub device_latency_p50_ms: f64,
    pub device_latency_p99_ms: f64,
}

/// Sends `images` round robin to `device` at `rate` requests per second for `duration` (no
/// window: a device that cannot keep up must answer `busy`), then waits up to `timeout` after
/// the last reply for the rest. Counts every reply by kind and every request without one.
pub fn load(
    cfg: &BrokerConfig,
    device: &str,
    images: &[Image],
    rate: f64,
    duration: Duration,
    timeout: Duration,
) -> Result<LoadReport, FleetError> {
    let mut conn = Conn::connect(cfg, "load")?;
    conn.subscribe(&conn.topics.result_filter(device))?;
    let tag = format!("load-{}-{}", std::process::id(), now_unix() % 100_000);
    let total = ((rate * duration.as_secs_f64()).round() as usize).max(1);
    let mut sent_at: BTreeMap<String, Instant> = BTreeMap::new();
    let mut replies: Vec<(InferReply, f64)> = Vec::new();
    let pb = crate::progress(total as u64, "load");
    let start = Instant::now();
    let (mut next, mut last_reply, mut sending_took) = (0, Instant::now(), 0.0);
    while replies.len() < total {
        let due = start + Duration::from_secs_f64(next as f64 / rate);
        if next < total && Instant::now() >= due {
            let id = format!("{tag}-{next}");
            let img = &images[next % images.len()];
            conn.send(conn.topics.infer(device, &id), img.bytes.clone())?;
            sent_at.insert(id, Instant::now());
            next += 1;
            if next == total {
                sending_took = start.elapsed().as_secs_f64();
                last_reply = Instant::now();
            }
            continue;
        }
        let wait = if next < total {
            due.saturating_duration_since(Instant::now())
        } else {
            Duration::from_millis(200)
        };
        match conn.recv(wait)? {
            Some((t, p)) => {
                let r: InferReply = parse(&t, &p)?;
                if let Some(at) = sent_at.remove(&r.request) {
                    replies.push((r, at.elapsed().as_secs_f64() * 1e3));
                    pb.inc(1);
                    last_reply = Instant::now();
                }
            }
            None if next == total && last_reply.elapsed() > timeout => break,
            None => {}
        }
    }
    pb.finish_and_clear();
    conn.disconnect();
    let busy = |r: &InferReply| r.error.as_deref().is_some_and(|e| e.contains("busy"));
    let mut rtt: Vec<f64> = replies
        .iter()
        .filter(|(r, _)| r.prediction.is_some())
        .map(|(_, ms)| *ms)
        .collect();
    let mut dev: Vec<f64> = replies
        .iter()
        .filter_map(|(r, _)| r.prediction.as_ref().map(|p| p.latency_ms))
        .collect();
    rtt.sort_by(f64::total_cmp);
    dev.sort_by(f64::total_cmp);
    Ok(LoadReport {
        device: device.to_string(),
        rate,
        sent_rate: total as f64 / sending_took.max(1e-9),
        seconds: start.elapsed().as_secs_f64(),
        sent: total,
        answered: rtt.len(),
        busy: replies.iter().filter(|(r, _)| busy(r)).count(),
        errors: replies
            .iter()
            .filter(|(r, _)| r.prediction.is_none() && !busy(r))
            .count(),
        lost: sent_at.len(),
        round_trip_p50_ms: quantile(&rtt, 0.5),
        round_trip_p99_ms: quantile(&rtt, 0.99),
        device_latency_p50_ms: quantile(&dev, 0.5),
        device_latency_p99_ms: quantile(&dev, 0.99),
    })
}
