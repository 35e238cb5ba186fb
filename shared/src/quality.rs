//! Model quality without labels: a reference profile of a model's outputs and pooled features on
//! its validation split (made at export, carried in the signed manifest), and the statistics a
//! device computes over a window of its live requests against it.
//!
//! The drift statistic is a per-direction mean-shift test over a fixed random projection of the
//! pooled features:
//! - the features (`dim` values) are projected on [`PROJECTIONS`] Gaussian directions drawn from
//!   the reference's seed ([`Projection`]; the same on every machine, no table to ship);
//! - the reference holds each projection's mean `mu_j` and standard deviation `sigma_j` over the
//!   validation split;
//! - a window of `n` requests has projected means `m_j`; under no drift
//!   `z_j = (m_j - mu_j) / (sigma_j * sqrt(1/n + 1/N))` is about standard normal (a two-sample
//!   test: `mu_j` is itself the mean of the reference's `N` samples, as uncertain as the window's
//!   when the validation split is small);
//! - the p-value is Bonferroni's over the directions, `min(1, k * P(|Z| >= max_j |z_j|))`, valid
//!   whatever the correlation between directions; a window is flagged below [`DRIFT_ALPHA`].
//!
//! The top-1 confidence histogram and the predicted-class distribution are kept too, but inputs a
//! model stays confident on (an inverted or blurred camera, a new background) move the features
//! without moving those: the test is on the features.
//!
//! The window slides (a report covers the last `size` requests), and every `size` requests it is
//! also judged as a whole: [`QualityReport::windows`] and [`QualityReport::flagged_windows`]
//! count those disjoint windows since the model became active, the share a fleet gate reads.
//!
//! [`ShadowTally`] compares a shadow model with the active one on the same requests.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::stats::quantile;

/// Directions of the feature projection.
pub const PROJECTIONS: usize = 16;
/// Bins of the top-1 confidence histogram, equal widths over [0, 1].
pub const CONFIDENCE_BINS: usize = 10;
/// A window is flagged as drifted when its p-value is below this.
pub const DRIFT_ALPHA: f64 = 0.01;

/// What the exported model does on its validation split (the manifest's `reference`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QualityReference {
    /// Validation samples the profile was computed on.
    pub samples: usize,
    /// Share of the samples predicted as each class (in label order).
    pub class_distribution: Vec<f64>,
    /// Share of the samples per top-1 confidence bin ([`CONFIDENCE_BINS`] over [0, 1]).
    pub confidence_histogram: Vec<f64>,
    /// Mean top-1 confidence.
    pub mean_confidence: f64,
    pub features: FeatureReference,
}

/// The pooled features' reference: the graph output that carries them and their projection's
/// mean and standard deviation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeatureReference {
    /// The graph output with the pooled features, `[N, dim]`.
    pub output: String,
    pub dim: usize,
    pub projection_seed: u64,
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
}

/// [`PROJECTIONS`] directions in feature space, each `dim` values drawn N(0, 1/dim) from `seed`
/// (splitmix64 and Box-Muller, written out so that every build draws the same).
pub struct Projection {
    dim: usize,
    rows: Vec<f64>,
}

impl Projection {
    pub fn new(seed: u64, dim: usize) -> Self {
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            // 53 random bits in (0, 1].
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 + f64::EPSILON / 2.0
        };
        let scale = 1.0 / (dim as f64).sqrt();
        let rows = (0..PROJECTIONS * dim)
            .map(|_| {
                let (u, v) = (next(), next());
                (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * scale
            })
            .collect();
        Projection { dim, rows }
    }

    /// The projections of one feature vector (`dim` values).
    pub fn project(&self, features: &[f32]) -> [f64; PROJECTIONS] {
        let mut out = [0.0; PROJECTIONS];
        for (o, row) in out.iter_mut().zip(self.rows.chunks(self.dim)) {
            *o = row.iter().zip(features).map(|(w, &x)| w * x as f64).sum();
        }
        out
    }
}

/// The top-1 class and its softmax probability.
pub fn top1(logits: &[f32]) -> (usize, f64) {
    let (best, max) =
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                if v > bv { (i, v) } else { (bi, bv) }
            });
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (best, 1.0 / sum)
}

fn confidence_bin(c: f64) -> usize {
    ((c * CONFIDENCE_BINS as f64) as usize).min(CONFIDENCE_BINS - 1)
}

/// The predicted-class shares, confidence-histogram shares and mean confidence of
/// `(top-1 class, confidence)` pairs (reference and window count them alike).
fn output_shares(
    top: impl IntoIterator<Item = (usize, f64)>,
    classes: usize,
) -> (Vec<f64>, Vec<f64>, f64) {
    let classes = classes.max(1);
    let (mut class, mut conf) = (vec![0.0; classes], vec![0.0; CONFIDENCE_BINS]);
    let (mut n, mut sum) = (0usize, 0.0);
    for (c, p) in top {
        class[c.min(classes - 1)] += 1.0;
        conf[confidence_bin(p)] += 1.0;
        sum += p;
        n += 1;
    }
    let nf = n.max(1) as f64;
    let share = |v: Vec<f64>| v.into_iter().map(|c| c / nf).collect();
    (share(class), share(conf), sum / nf)
}

impl QualityReference {
    /// The profile of `(logits, features)` rows (the exported graph's two outputs on every
    /// validation sample); the features are named `output` in the graph.
    pub fn build<'a>(
        rows: impl IntoIterator<Item = (&'a [f32], &'a [f32])>,
        classes: usize,
        output: &str,
        projection_seed: u64,
    ) -> Option<Self> {
        let mut rows = rows.into_iter().peekable();
        let dim = rows.peek()?.1.len();
        let proj = Projection::new(projection_seed, dim);
        let (mut sum, mut sq) = ([0.0; PROJECTIONS], [0.0; PROJECTIONS]);
        let mut top = Vec::new();
        let mut n = 0usize;
        for (logits, features) in rows {
            top.push(top1(logits));
            for (j, v) in proj.project(features).into_iter().enumerate() {
                sum[j] += v;
                sq[j] += v * v;
            }
            n += 1;
        }
        let nf = n as f64;
        let mean: Vec<f64> = sum.iter().map(|s| s / nf).collect();
        let std = sq
            .iter()
            .zip(&mean)
            .map(|(q, m)| ((q / nf - m * m).max(0.0) * nf / (nf - 1.0).max(1.0)).sqrt())
            .collect();
        let (class_distribution, confidence_histogram, mean_confidence) =
            output_shares(top, classes);
        Some(QualityReference {
            samples: n,
            class_distribution,
            confidence_histogram,
            mean_confidence,
            features: FeatureReference {
                output: output.into(),
                dim,
                projection_seed,
                mean,
                std,
            },
        })
    }
}

/// One live request as the window keeps it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    class: usize,
    confidence: f64,
    projected: [f64; PROJECTIONS],
    latency_ms: f64,
}

/// The last `size` requests of a device, judged against a reference.
pub struct QualityWindow {
    reference: QualityReference,
    projection: Projection,
    size: usize,
    seen: VecDeque<Seen>,
    /// Requests since the window was created (not only those in it).
    pub total: u64,
    /// Disjoint full windows judged, and how many of them were flagged.
    windows: u64,
    flagged_windows: u64,
    /// Whether the last judged window was flagged.
    flagged_now: bool,
}

/// A window's statistics (what `P/devices/<id>/quality` carries).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QualityReport {
    /// Requests in the window.
    pub requests: usize,
    /// Requests since the model became active.
    pub total_requests: u64,
    pub mean_confidence: f64,
    /// Share of the window per confidence bin, as the reference's.
    pub confidence_histogram: Vec<f64>,
    /// Share of the window predicted as each class.
    pub class_distribution: Vec<f64>,
    /// Total variation distance between the window's and the reference's class distributions.
    pub class_distance: f64,
    /// The reference's mean confidence, for comparison.
    pub reference_confidence: f64,
    pub drift: Drift,
    /// Disjoint windows of `size` requests judged since the model became active...
    pub windows: u64,
    /// ...and how many of them were flagged as drifted.
    pub flagged_windows: u64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
}

/// The feature drift test of a window (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drift {
    /// The largest standardized mean shift over the projections.
    pub max_z: f64,
    pub p_value: f64,
    pub flagged: bool,
}

impl QualityWindow {
    pub fn new(reference: QualityReference, size: usize) -> Self {
        let projection =
            Projection::new(reference.features.projection_seed, reference.features.dim);
        QualityWindow {
            reference,
            projection,
            size: size.max(1),
            seen: VecDeque::new(),
            total: 0,
            windows: 0,
            flagged_windows: 0,
            flagged_now: false,
        }
    }

    /// The reference the window judges against.
    pub fn reference(&self) -> &QualityReference {
        &self.reference
    }

    /// Records one request: the model's logits, its pooled features, and how long it took.
    pub fn push(&mut self, logits: &[f32], features: &[f32], latency_ms: f64) {
        let (class, confidence) = top1(logits);
        if self.seen.len() == self.size {
            self.seen.pop_front();
        }
        self.seen.push_back(Seen {
            class,
            confidence,
            projected: self.projection.project(features),
            latency_ms,
        });
        self.total += 1;
        if self.total % self.size as u64 == 0 {
            // The window now holds `size` requests none of the previous judged windows held.
            self.windows += 1;
            self.flagged_now = self.drift().flagged;
            self.flagged_windows += u64::from(self.flagged_now);
        }
    }

    /// Whether the last judged window (of `size` requests) was flagged as drifted.
    pub fn drifting(&self) -> bool {
        self.flagged_now
    }

    /// The feature drift test over the requests in the window (see the module docs).
    fn drift(&self) -> Drift {
        let nf = self.seen.len().max(1) as f64;
        let r = &self.reference.features;
        let scale = (1.0 / nf + 1.0 / self.reference.samples.max(1) as f64).sqrt();
        let mut sum = [0.0; PROJECTIONS];
        for s in &self.seen {
            for (a, v) in sum.iter_mut().zip(s.projected) {
                *a += v;
            }
        }
        let max_z = sum
            .iter()
            .zip(&r.mean)
            .zip(&r.std)
            .map(|((s, mu), sd)| ((s / nf - mu) / (sd.max(1e-12) * scale)).abs())
            .fold(0.0, f64::max);
        let p_value = (PROJECTIONS as f64 * erfc(max_z / std::f64::consts::SQRT_2)).min(1.0);
        Drift {
            max_z,
            p_value,
            flagged: p_value < DRIFT_ALPHA,
        }
    }

    /// The statistics of the requests in the window; `None` while it is empty.
    pub fn report(&self) -> Option<QualityReport> {
        let n = self.seen.len();
        if n == 0 {
            return None;
        }
        let r = &self.reference;
        let (class, conf, mean_confidence) = output_shares(
            self.seen.iter().map(|s| (s.class, s.confidence)),
            r.class_distribution.len(),
        );
        let mut lat: Vec<f64> = self.seen.iter().map(|s| s.latency_ms).collect();
        lat.sort_by(f64::total_cmp);
        let pct = |q: f64| quantile(&lat, q);
        Some(QualityReport {
            requests: n,
            total_requests: self.total,
            mean_confidence,
            class_distance: 0.5
                * class
                    .iter()
                    .zip(&r.class_distribution)
                    .map(|(a, b)| (a - b).abs())
                    .sum::<f64>(),
            confidence_histogram: conf,
            class_distribution: class,
            reference_confidence: r.mean_confidence,
            drift: self.drift(),
            windows: self.windows,
            flagged_windows: self.flagged_windows,
            latency_p50_ms: pct(0.5),
            latency_p99_ms: pct(0.99),
        })
    }
}

/// A shadow model against the active one on the same requests (what the device's quality
/// report carries as `shadow`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowReport {
    pub name: String,
    pub version: u64,
    /// Requests both models answered.
    pub compared: u64,
    /// Share of them with the same top-1 class.
    pub agreement: f64,
    pub active_mean_confidence: f64,
    pub shadow_mean_confidence: f64,
    /// Compared requests on which the two disagreed, by the active model's class.
    pub disagreements: Vec<u64>,
    pub active_latency_p50_ms: f64,
    pub shadow_latency_p50_ms: f64,
    /// Requests the shadow did not run on (not its turn, or requests were waiting).
    pub skipped: u64,
}

/// Running totals of a shadow model's comparisons since it was loaded.
#[derive(Debug, Clone)]
pub struct ShadowTally {
    name: String,
    version: u64,
    compared: u64,
    agreed: u64,
    active_confidence: f64,
    shadow_confidence: f64,
    disagreements: Vec<u64>,
    /// The last [`LATENCIES`] (active, shadow) latencies.
    latencies: VecDeque<(f64, f64)>,
    pub skipped: u64,
}

/// Latencies a shadow tally keeps for its medians.
const LATENCIES: usize = 1000;

impl ShadowTally {
    pub fn new(name: &str, version: u64, classes: usize) -> Self {
        ShadowTally {
            name: name.into(),
            version,
            compared: 0,
            agreed: 0,
            active_confidence: 0.0,
            shadow_confidence: 0.0,
            disagreements: vec![0; classes.max(1)],
            latencies: VecDeque::new(),
            skipped: 0,
        }
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// One request both models answered: their logits and latencies.
    pub fn push(&mut self, active: (&[f32], f64), shadow: (&[f32], f64)) {
        let ((a, ac), (b, bc)) = (top1(active.0), top1(shadow.0));
        self.compared += 1;
        if a == b {
            self.agreed += 1;
        } else {
            let last = self.disagreements.len() - 1;
            self.disagreements[a.min(last)] += 1;
        }
        self.active_confidence += ac;
        self.shadow_confidence += bc;
        if self.latencies.len() == LATENCIES {
            self.latencies.pop_front();
        }
        self.latencies.push_back((active.1, shadow.1));
    }

    pub fn report(&self) -> ShadowReport {
        let n = self.compared.max(1) as f64;
        let median = |f: fn(&(f64, f64)) -> f64| {
            let mut v: Vec<f64> = self.latencies.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            quantile(&v, 0.5)
        };
        ShadowReport {
            name: self.name.clone(),
            version: self.version,
            compared: self.compared,
            agreement: self.agreed as f64 / n,
            active_mean_confidence: self.active_confidence / n,
            shadow_mean_confidence: self.shadow_confidence / n,
            disagreements: self.disagreements.clone(),
            active_latency_p50_ms: median(|l| l.0),
            shadow_latency_p50_ms: median(|l| l.1),
            skipped: self.skipped,
        }
    }
}

/// A device's retained quality report (`P/devices/<id>/quality`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceQuality {
    pub device: String,
    /// The active model the window is about.
    pub model: String,
    pub version: u64,
    /// None while the model has served no request, or when its manifest has no reference
    /// profile (exported before there was one).
    pub window: Option<QualityReport>,
    /// Why there is no window, when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowReport>,
    /// RFC 3339 UTC.
    pub updated: String,
}

/// The complementary error function (Numerical Recipes' Chebyshev fit, relative error below
/// 1.2e-7 everywhere): `P(|Z| >= z) = erfc(z / sqrt 2)` for a standard normal Z.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erfc_matches_known_values() {
        for (x, want) in [
            (0.0, 1.0),
            (0.5, 0.479_500_122),
            (1.0, 0.157_299_207),
            (2.0, 0.004_677_735),
            (3.0, 2.209_049_7e-5),
            (-1.0, 1.842_700_793),
        ] {
            let got = erfc(x);
            assert!(
                ((got - want) / want).abs() < 1e-6,
                "erfc({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn projections_are_fixed_by_the_seed() {
        let (a, b) = (Projection::new(7, 32), Projection::new(7, 32));
        assert_eq!(a.rows, b.rows);
        assert_ne!(a.rows, Projection::new(8, 32).rows);
        // N(0, 1/dim): each direction's squared norm is about 1.
        let norms: Vec<f64> = a
            .rows
            .chunks(32)
            .map(|r| r.iter().map(|v| v * v).sum())
            .collect();
        assert!(norms.iter().all(|n| (0.3..3.0).contains(n)), "{norms:?}");
    }

    #[test]
    fn top1_is_the_softmax_maximum() {
        let (c, p) = top1(&[1.0, 3.0, 0.0]);
        assert_eq!(c, 1);
        let want = 3f64.exp() / (1f64.exp() + 3f64.exp() + 1.0);
        assert!((p - want).abs() < 1e-6);
    }

    /// Features drawn from the reference's distribution are not flagged; the same features
    /// shifted by half a standard deviation along every axis are, while the class distribution
    /// and confidence (the logits are the same) do not move at all.
    #[test]
    fn a_mean_shift_is_flagged_and_the_same_distribution_is_not() {
        let dim = 64;
        let mut draw = {
            // Independent uniform features with a per-feature offset (not centred, not scaled).
            let mut state = 12345u64;
            move || {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 33) as f64 / (1u64 << 31) as f64) as f32
            }
        };
        let sample = |draw: &mut dyn FnMut() -> f32, shift: f32| -> Vec<f32> {
            (0..dim).map(|i| i as f32 * 0.1 + draw() + shift).collect()
        };
        let logits = [2.0f32, 0.5];
        let val: Vec<Vec<f32>> = (0..2000).map(|_| sample(&mut draw, 0.0)).collect();
        let reference = QualityReference::build(
            val.iter().map(|f| (&logits[..], f.as_slice())),
            2,
            "features",
            42,
        )
        .unwrap();
        assert_eq!(reference.samples, 2000);
        assert_eq!(reference.class_distribution, vec![1.0, 0.0]);
        let windows = |shift: f32, draw: &mut dyn FnMut() -> f32| -> Vec<QualityReport> {
            (0..40)
                .map(|_| {
                    let mut w = QualityWindow::new(reference.clone(), 50);
                    for _ in 0..50 {
                        w.push(&logits, &sample(draw, shift), 1.0);
                    }
                    w.report().unwrap()
                })
                .collect()
        };
        let same = windows(0.0, &mut draw);
        let flagged = same.iter().filter(|r| r.drift.flagged).count();
        assert!(
            flagged <= 2,
            "{flagged} of 40 windows of the same distribution flagged"
        );
        // Uniform(0, 1) has std 0.29: a shift of 0.15 is half of it.
        let shifted = windows(0.15, &mut draw);
        let flagged = shifted.iter().filter(|r| r.drift.flagged).count();
        assert!(
            flagged >= 38,
            "only {flagged} of 40 shifted windows flagged"
        );
        for r in same.iter().chain(&shifted) {
            assert_eq!(r.class_distance, 0.0);
            assert_eq!(r.confidence_histogram, reference.confidence_histogram);
        }
    }

    #[test]
    fn the_window_keeps_the_last_requests() {
        let reference =
            QualityReference::build([(&[1.0f32, 0.0][..], &[0.5f32; 4][..])], 2, "features", 1)
                .unwrap();
        let mut w = QualityWindow::new(reference, 3);
        assert!(w.report().is_none());
        for (i, logits) in [[1.0f32, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
            .iter()
            .enumerate()
        {
            w.push(logits, &[0.5; 4], i as f64);
        }
        let r = w.report().unwrap();
        assert_eq!((r.requests, r.total_requests), (3, 4));
        assert_eq!(r.class_distribution, vec![0.0, 1.0]);
        assert_eq!(r.class_distance, 1.0);
        assert_eq!((r.latency_p50_ms, r.latency_p99_ms), (2.0, 3.0));
    }

    /// Every `size` requests the window is judged as a whole: held-out-like windows are counted
    /// and not flagged, shifted ones are counted and flagged.
    #[test]
    fn disjoint_windows_are_counted_and_flagged() {
        let mut state = 99u64;
        let mut uniform = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let rows: Vec<Vec<f32>> = (0..400)
            .map(|_| (0..8).map(|_| uniform()).collect())
            .collect();
        let logits = [1.0f32, 0.0];
        let reference = QualityReference::build(
            rows[..200].iter().map(|f| (&logits[..], f.as_slice())),
            2,
            "f",
            3,
        )
        .unwrap();
        let mut w = QualityWindow::new(reference, 50);
        // Fresh draws of the same distribution (not the reference's own rows).
        for f in rows.iter().skip(200).take(150) {
            w.push(&logits, f, 1.0);
        }
        let r = w.report().unwrap();
        assert_eq!((r.windows, r.flagged_windows), (3, 0));
        for f in rows.iter().take(50) {
            let shifted: Vec<f32> = f.iter().map(|v| v + 5.0).collect();
            w.push(&logits, &shifted, 1.0);
        }
        let r = w.report().unwrap();
        assert_eq!(r.total_requests, 200);
        assert_eq!((r.windows, r.flagged_windows), (4, 1));
        assert!(r.drift.flagged);
    }

    #[test]
    fn the_shadow_tally_counts_agreement_by_class() {
        let mut t = ShadowTally::new("m", 3, 2);
        t.push((&[2.0, 0.0], 10.0), (&[2.0, 0.0], 20.0));
        t.push((&[2.0, 0.0], 12.0), (&[0.0, 2.0], 22.0));
        t.push((&[0.0, 2.0], 14.0), (&[0.0, 2.0], 24.0));
        t.push((&[0.0, 2.0], 16.0), (&[0.0, 2.0], 26.0));
        t.skipped = 5;
        let r = t.report();
        assert_eq!((r.compared, r.skipped, r.version), (4, 5, 3));
        assert_eq!(r.agreement, 0.75);
        assert_eq!(r.disagreements, vec![1, 0]);
        let p = 1.0 / (1.0 + (-2f64).exp());
        assert!((r.active_mean_confidence - p).abs() < 1e-9);
        assert!((r.shadow_mean_confidence - p).abs() < 1e-9);
        assert_eq!(
            (r.active_latency_p50_ms, r.shadow_latency_p50_ms),
            (14.0, 24.0)
        );
    }
}
