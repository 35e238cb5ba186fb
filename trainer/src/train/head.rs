//! The head as the convex problem it is: with the backbone frozen, training a linear classifier on
//! pooled features is L2-regularized multinomial logistic regression. This module solves it to
//! convergence with L-BFGS (argmin's, with a More-Thuente line search) on standardized features,
//! choosing the L2 strength by stratified k-fold cross-validation on the training split (the
//! validation split is never looked at), and folds the standardization back into the linear layer,
//! so that the saved weights, the exported graph and the edge see raw features as before.
//!
//! Data-parallel like the first-order loop: every rank evaluates the loss and gradient on its share
//! of the rows, the sums are allreduced, and every rank takes the same L-BFGS step.

use std::cell::RefCell;

use argmin::core::{CostFunction, Executor, Gradient, State};
use argmin::solver::linesearch::MoreThuenteLineSearch;
use argmin::solver::quasinewton::LBFGS;
use candle_core::{D, DType, Device, Tensor as CTensor};
use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::loss::Loss;
use crate::distributed::{self, Collective, Rank};

/// L2 strengths tried by cross-validation, strongest first (each fold's solve starts from the
/// previous strength's solution): 100 down to 1e-5 in half decades.
const L2_GRID: [f64; 15] = [
    100.0, 31.6, 10.0, 3.16, 1.0, 0.316, 0.1, 0.0316, 0.01, 3.16e-3, 1e-3, 3.16e-4, 1e-4, 3.16e-5,
    1e-5,
];
/// Cross-validation folds (fewer when the smallest class has fewer training samples).
const FOLDS: usize = 5;
/// Gradient-norm tolerances: the cross-validation solves only rank strengths, the final one is kept.
const CV_TOL: f64 = 1e-4;
const TOL: f64 = 1e-5;
const CV_MAX_ITERS: u64 = 300;
const MAX_ITERS: u64 = 1000;

/// Features of samples as rows: `data[i * dim..(i + 1) * dim]` is sample `i`.
#[derive(Clone, Copy)]
pub struct FeatureRows<'a> {
    pub data: &'a [f32],
    pub dim: usize,
    pub labels: &'a [usize],
}

impl FeatureRows<'_> {
    fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }
}

/// Mean and 1/std of every feature over a set of samples (std floored at the median std).
#[derive(Debug, Clone)]
pub struct Standardizer {
    pub mean: Vec<f32>,
    pub inv_std: Vec<f32>,
}

impl Standardizer {
    pub fn fit(f: FeatureRows<'_>, idx: &[usize]) -> Self {
        let (mut s, mut s2) = (vec![0f64; f.dim], vec![0f64; f.dim]);
        for &i in idx {
            for (j, &v) in f.row(i).iter().enumerate() {
                s[j] += v as f64;
                s2[j] += v as f64 * v as f64;
            }
        }
        let n = idx.len().max(1) as f64;
        let mean: Vec<f64> = s.iter().map(|v| v / n).collect();
        let sd: Vec<f64> = s2
            .iter()
            .zip(&mean)
            .map(|(q, m)| (q / n - m * m).max(0.0).sqrt())
            .collect();
        // Scales are floored at the median standard deviation: pooled features include nearly
        // dead ones (std ~1e-4), and dividing by their std would give them huge weights once
        // folded, which int8 quantization of the layer cannot represent (and which amplify
        // rounding). Features above the median are standardized exactly.
        let mut sorted = sd.clone();
        sorted.sort_by(f64::total_cmp);
        let floor = sorted
            .get(sorted.len() / 2)
            .copied()
            .unwrap_or(1.0)
            .max(1e-6);
        Standardizer {
            mean: mean.into_iter().map(|m| m as f32).collect(),
            inv_std: sd.iter().map(|d| (1.0 / d.max(floor)) as f32).collect(),
        }
    }

    /// The rows `idx`, standardized, as an `[n, dim]` tensor.
    fn rows(&self, f: FeatureRows<'_>, idx: &[usize]) -> candle_core::Result<CTensor> {
        let mut x = Vec::with_capacity(idx.len() * f.dim);
        for &i in idx {
            x.extend(
                f.row(i)
                    .iter()
                    .zip(self.mean.iter().zip(&self.inv_std))
                    .map(|(v, (m, s))| (v - m) * s),
            );
        }
        CTensor::from_vec(x, (idx.len(), f.dim), &Device::Cpu)
    }

    /// The linear layer on raw features that equals `(weight [k, dim], bias [k])` on standardized
    /// ones: `w' = w / std`, `b' = b - w' . mean`.
    pub fn fold(&self, weight: &[f32], bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let w: Vec<f32> = self.scale_rows(weight, |w, s| w * s);
        let b = self.shift_bias(&w, bias, -1.0);
        (w, b)
    }

    /// The inverse of [`Standardizer::fold`].
    pub fn unfold(&self, weight: &[f32], bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let b = self.shift_bias(weight, bias, 1.0);
        (self.scale_rows(weight, |w, s| w / s), b)
    }

    /// Every weight row combined element-wise with `inv_std`.
    fn scale_rows(&self, weight: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
        let d = self.mean.len();
        weight
            .chunks(d)
            .flat_map(|r| r.iter().zip(&self.inv_std).map(|(&w, &s)| f(w, s)))
            .collect()
    }

    /// `bias + sign * (row . mean)` for every row of raw-feature weights.
    fn shift_bias(&self, raw_weight: &[f32], bias: &[f32], sign: f64) -> Vec<f32> {
        bias.iter()
            .zip(raw_weight.chunks(self.mean.len()))
            .map(|(b, r)| {
                let dot: f64 = r.iter().zip(&self.mean).map(|(w, m)| (w * m) as f64).sum();
                (*b as f64 + sign * dot) as f32
            })
            .collect()
    }
}

#[cfg(test)]
#[test]
fn fold_then_unfold_is_the_identity_and_fold_matches_standardizing() {
    let st = Standardizer {
        mean: vec![0.5, -1.0, 2.0],
        inv_std: vec![2.0, 0.25, 1.0],
    };
    let (w, b) = (vec![1.0, 2.0, -3.0, 0.5, 0.0, 4.0], vec![0.1, -0.2]);
    let (fw, fb) = st.fold(&w, &b);
    let x = [1.5f32, 3.0, -2.0];
    for c in 0..2 {
        let raw: f32 = fb[c] + (0..3).map(|j| fw[c * 3 + j] * x[j]).sum::<f32>();
        let std: f32 = b[c]
            + (0..3)
                .map(|j| w[c * 3 + j] * (x[j] - st.mean[j]) * st.inv_std[j])
                .sum::<f32>();
        assert!((raw - std).abs() < 1e-5, "class {c}: {raw} vs {std}");
    }
    let (uw, ub) = st.unfold(&fw, &fb);
    for (a, e) in uw.iter().chain(&ub).zip(w.iter().chain(&b)) {
        assert!((a - e).abs() < 1e-5, "{a} vs {e}");
    }
}

/// One cross-validated L2 strength.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CvPoint {
    pub l2: f64,
    /// Mean held-out cross-entropy over the folds, logits scaled by `temperature`.
    pub loss: f64,
    pub temperature: f64,
    pub accuracy: f64,
}

/// How the head was solved (in `summary.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeadSolve {
    pub l2: f64,
    /// `cross-validation (k folds)` or `--l2`.
    pub l2_from: String,
    /// Scale of the solved logits (cross-validated calibration; 1 with `--l2`).
    pub temperature: f64,
    pub iterations: u64,
    /// Gradient norm at the solution.
    pub grad_norm: f64,
    pub cv: Vec<CvPoint>,
    pub seconds: f64,
}

/// A solved head on raw (unstandardized) features.
pub struct Head {
    /// `[classes, dim]`, row-major.
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub solve: HeadSolve,
}

/// Solves the head on the training samples `train` (every rank passes the same arguments),
/// starting the final solve from `init` (a head on raw features, `[k, dim]` and `[k]`) when given,
/// else from zero.
pub fn fit_head(
    f: FeatureRows<'_>,
    train: &[usize],
    l2: Option<f64>,
    loss: &Loss,
    seed: u64,
    r: &Rank<'_>,
    init: Option<(&[f32], &[f32])>,
) -> Result<Head, TrainError> {
    let started = std::time::Instant::now();
    let k = loss.classes();
    let (l2, temperature, l2_from, cv) = match l2 {
        Some(l) => (l, 1.0, "--l2".to_string(), Vec::new()),
        None => choose_l2(f, train, loss, seed, r)?,
    };
    let st = Standardizer::fit(f, train);
    let rows = Rows::new(f, &st, train, loss, r)?;
    // The solution is scaled by the temperature below: the start is the head on standardized
    // features, unscaled.
    let start = match init {
        Some((w, b)) => {
            let (w, b) = st.unfold(w, b);
            w.iter()
                .chain(&b)
                .map(|&v| v as f64 / temperature)
                .collect()
        }
        None => vec![0.0; k * f.dim + k],
    };
    let (theta, iterations, grad_norm) = solve(
        &rows,
        train.len(),
        k,
        f.dim,
        l2,
        start,
        (TOL, MAX_ITERS),
        r.comm,
    )?;
    let scaled: Vec<f64> = theta.iter().map(|v| v * temperature).collect();
    let (w, b) = split_theta(&scaled, k, f.dim);
    let (weight, bias) = st.fold(&w, &b);
    Ok(Head {
        weight,
        bias,
        solve: HeadSolve {
            l2,
            l2_from,
            temperature,
            iterations,
            grad_norm,
            cv,
            seconds: started.elapsed().as_secs_f64(),
        },
    })
}

/// The L2 strength of [`L2_GRID`] with the lowest mean held-out cross-entropy over stratified
/// folds of `train`, each strength's held-out logits scaled by the temperature that suits them
/// best (a strongly regularized head ranks well but is under-confident; without the temperature
/// the loss would pick a weaker one that generalizes worse on small tables, and held-out accuracy
/// alone ties too often to choose). The descent stops three strengths after the loss last fell.
/// Returns the strength, the temperature the final head is scaled by, and the table.
fn choose_l2(
    f: FeatureRows<'_>,
    train: &[usize],
    loss: &Loss,
    seed: u64,
    r: &Rank<'_>,
) -> Result<(f64, f64, String, Vec<CvPoint>), TrainError> {
    let k = loss.classes();
    let folds = stratified_folds(f.labels, train, k, seed);
    if folds.len() < 2 {
        let l2 = 1e-2;
        r.log(format!(
            "head: a class has fewer than 2 training samples, no cross-validation: l2 {l2}"
        ));
        return Ok((
            l2,
            1.0,
            "default (too few samples to cross-validate)".into(),
            Vec::new(),
        ));
    }
    let plain = Loss::plain(k);
    let mut parts = Vec::new();
    for held in &folds {
        let fit_idx: Vec<usize> = train
            .iter()
            .copied()
            .filter(|i| !held.contains(i))
            .collect();
        let st = Standardizer::fit(f, &fit_idx);
        parts.push((
            Rows::new(f, &st, &fit_idx, loss, r)?,
            fit_idx.len(),
            Rows::new(f, &st, held, &plain, r)?,
            vec![0.0; k * f.dim + k],
        ));
    }
    let mut cv: Vec<CvPoint> = Vec::new();
    for &l2 in &L2_GRID {
        let mut correct = 0.0;
        let mut logits = Vec::new();
        for (fit, n, held, theta) in parts.iter_mut() {
            let start = std::mem::take(theta);
            *theta = solve(fit, *n, k, f.dim, l2, start, (CV_TOL, CV_MAX_ITERS), r.comm)?.0;
            let (z, c) = held.held_out(theta, k, f.dim)?;
            logits.push((z, held.targets.clone()));
            correct += c;
        }
        let mut sums = [correct];
        r.comm.allreduce_sum_f64(&mut sums)?;
        let (temperature, loss) = fit_temperature(&logits, r.comm)?;
        cv.push(CvPoint {
            l2,
            loss: loss / train.len() as f64,
            temperature,
            accuracy: sums[0] / train.len() as f64,
        });
        let best = cv.iter().map(|c| c.loss).fold(f64::INFINITY, f64::min);
        if cv.len() > 3 && cv[cv.len() - 3..].iter().all(|c| c.loss > best) {
            break;
        }
    }
    let best = cv
        .iter()
        .min_by(|a, b| a.loss.total_cmp(&b.loss))
        .expect("at least one strength");
    r.log(format!(
        "head: l2 {:.2e} by {}-fold cross-validation (held-out loss {:.4} at temperature {:.2}, accuracy {:.3})",
        best.l2,
        folds.len(),
        best.loss,
        best.temperature,
        best.accuracy
    ));
    Ok((
        best.l2,
        best.temperature,
        format!("cross-validation ({} folds)", folds.len()),
        cv,
    ))
}

/// `train` in `FOLDS` (or as many as the smallest class allows) folds, every class spread evenly.
fn stratified_folds(
    labels: &[usize],
    train: &[usize],
    classes: usize,
    seed: u64,
) -> Vec<Vec<usize>> {
    let mut by_class = vec![Vec::new(); classes];
    for &i in train {
        by_class[labels[i]].push(i);
    }
    let smallest = by_class
        .iter()
        .map(Vec::len)
        .filter(|&n| n > 0)
        .min()
        .unwrap_or(0);
    let k = FOLDS.min(smallest);
    if k < 2 {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6b65_7374_7265_6c00);
    let mut folds = vec![Vec::new(); k];
    let mut next = 0;
    for mut members in by_class {
        members.shuffle(&mut rng);
        for i in members {
            folds[next % k].push(i);
            next += 1;
        }
    }
    for f in &mut folds {
        f.sort_unstable();
    }
    folds
}

/// This rank's share of some samples: standardized features, weighted targets and weights.
struct Rows {
    x: CTensor,
    targets: CTensor,
    weights: CTensor,
    /// Plain labels (for accuracy).
    y: Vec<u32>,
}

impl Rows {
    fn new(
        f: FeatureRows<'_>,
        st: &Standardizer,
        idx: &[usize],
        loss: &Loss,
        r: &Rank<'_>,
    ) -> Result<Self, TrainError> {
        let mine = &idx[distributed::share(idx.len(), r.rank(), r.world())];
        let y: Vec<usize> = mine.iter().map(|&i| f.labels[i]).collect();
        let n = mine.len();
        Ok(Rows {
            x: st.rows(f, mine)?,
            targets: CTensor::from_vec(
                loss.weighted_targets(&y),
                (n, loss.classes()),
                &Device::Cpu,
            )?,
            weights: CTensor::from_vec(loss.sample_weights(&y), (n, 1), &Device::Cpu)?,
            y: y.into_iter().map(|c| c as u32).collect(),
        })
    }

    fn logits(&self, theta: &[f64], k: usize, d: usize) -> candle_core::Result<CTensor> {
        let (w, b) = split_theta(theta, k, d);
        let w = CTensor::from_vec(w, (k, d), &Device::Cpu)?;
        let b = CTensor::from_vec(b, (1, k), &Device::Cpu)?;
        self.x.matmul(&w.t()?)?.broadcast_add(&b)
    }

    /// Summed weighted loss and its gradient `[d loss / d W (k x d), d loss / d b (k)]` over this
    /// rank's rows, as `[loss, grad...]`.
    fn local_sums(&self, theta: &[f64], k: usize, d: usize) -> candle_core::Result<Vec<f64>> {
        let mut out = vec![0.0; 1 + k * d + k];
        if self.y.is_empty() {
            return Ok(out);
        }
        let logp = candle_nn::ops::log_softmax(&self.logits(theta, k, d)?, D::Minus1)?;
        out[0] = -(&self.targets * &logp)?
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
        // d/dlogits of -sum_c t_c log p_c with sum_c t_c = w: w p - t.
        let g = (logp.exp()?.broadcast_mul(&self.weights)? - &self.targets)?;
        let gw = g.t()?.matmul(&self.x)?.flatten_all()?.to_vec1::<f32>()?;
        let gb = g.sum(0)?.to_vec1::<f32>()?;
        for (o, v) in out[1..].iter_mut().zip(gw.into_iter().chain(gb)) {
            *o = v as f64;
        }
        Ok(out)
    }

    /// This rank's held-out logits and its count of correct predictions.
    fn held_out(&self, theta: &[f64], k: usize, d: usize) -> candle_core::Result<(CTensor, f64)> {
        if self.y.is_empty() {
            return Ok((CTensor::zeros((0, k), DType::F32, &Device::Cpu)?, 0.0));
        }
        let logits = self.logits(theta, k, d)?;
        let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let correct = pred.iter().zip(&self.y).filter(|(a, b)| a == b).count();
        Ok((logits, correct as f64))
    }
}

/// The temperature `T >= 1` that minimises the summed cross-entropy of `T * logits` over held-out
/// rows `(logits, one-hot targets)` of every rank (Newton's method on a convex function of one
/// variable), and that sum.
fn fit_temperature(
    held: &[(CTensor, CTensor)],
    comm: &dyn Collective,
) -> Result<(f64, f64), TrainError> {
    let mut t = 1.0f64;
    let mut loss = f64::INFINITY;
    for _ in 0..50 {
        // Loss, dL/dT and d2L/dT2 at t.
        let mut s = [0.0f64; 3];
        for (z, y) in held {
            if z.dim(0)? == 0 {
                continue;
            }
            let z = z.to_dtype(DType::F64)?;
            let y = y.to_dtype(DType::F64)?;
            let logp = candle_nn::ops::log_softmax(&(&z * t)?, D::Minus1)?;
            let p = logp.exp()?;
            let ez = (&p * &z)?.sum(1)?;
            let ez2 = (&p * z.sqr()?)?.sum(1)?;
            s[0] -= (&y * &logp)?.sum_all()?.to_scalar::<f64>()?;
            s[1] += (&ez - (&y * &z)?.sum(1)?)?.sum_all()?.to_scalar::<f64>()?;
            s[2] += (ez2 - ez.sqr()?)?.sum_all()?.to_scalar::<f64>()?;
        }
        comm.allreduce_sum_f64(&mut s)?;
        loss = s[0];
        if s[2] <= 0.0 {
            break;
        }
        let step = s[1] / s[2];
        let next = (t - step).max(1.0);
        if (next - t).abs() < 1e-6 * t {
            break;
        }
        t = next;
    }
    Ok((t, loss))
}

fn split_theta(theta: &[f64], k: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    (
        theta[..k * d].iter().map(|&v| v as f32).collect(),
        theta[k * d..].iter().map(|&v| v as f32).collect(),
    )
}

/// The objective `sum loss / n + l2 / 2 |W|^2` over every rank's rows, for argmin. The last
/// evaluation is cached (argmin asks for the cost and the gradient of the same point separately),
/// so is the lowest point seen; a collective or candle error is kept for the caller (argmin's
/// errors are strings).
struct Objective<'a> {
    rows: &'a Rows,
    n: f64,
    k: usize,
    d: usize,
    l2: f64,
    comm: &'a dyn Collective,
    last: RefCell<Option<(Vec<f64>, f64, Vec<f64>)>>,
    best: &'a RefCell<Option<(Vec<f64>, f64, Vec<f64>)>>,
    failed: &'a RefCell<Option<TrainError>>,
}

impl Objective<'_> {
    fn eval(&self, theta: &[f64]) -> Result<(f64, Vec<f64>), argmin::core::Error> {
        if let Some((p, f, g)) = &*self.last.borrow() {
            if p == theta {
                return Ok((*f, g.clone()));
            }
        }
        let result = (|| -> Result<(f64, Vec<f64>), TrainError> {
            let mut sums = self.rows.local_sums(theta, self.k, self.d)?;
            self.comm.allreduce_sum_f64(&mut sums)?;
            let kd = self.k * self.d;
            let mut f = sums[0] / self.n;
            let mut g: Vec<f64> = sums[1..].iter().map(|v| v / self.n).collect();
            for (gi, wi) in g[..kd].iter_mut().zip(&theta[..kd]) {
                *gi += self.l2 * wi;
                f += 0.5 * self.l2 * wi * wi;
            }
            Ok((f, g))
        })();
        match result {
            Ok((f, g)) => {
                let point = (theta.to_vec(), f, g.clone());
                let better = self.best.borrow().as_ref().is_none_or(|b| f < b.1);
                if better {
                    *self.best.borrow_mut() = Some(point.clone());
                }
                *self.last.borrow_mut() = Some(point);
                Ok((f, g))
            }
            Err(e) => {
                let msg = e.to_string();
                *self.failed.borrow_mut() = Some(e);
                Err(argmin::core::Error::msg(msg))
            }
        }
    }
}

impl CostFunction for Objective<'_> {
    type Param = Vec<f64>;
    type Output = f64;
    fn cost(&self, theta: &Vec<f64>) -> Result<f64, argmin::core::Error> {
        Ok(self.eval(theta)?.0)
    }
}

impl Gradient for Objective<'_> {
    type Param = Vec<f64>;
    type Gradient = Vec<f64>;
    fn gradient(&self, theta: &Vec<f64>) -> Result<Vec<f64>, argmin::core::Error> {
        Ok(self.eval(theta)?.1)
    }
}

/// Minimises the objective from `start`: the lowest point evaluated, the iterations taken and its
/// gradient norm. A line search that can no longer improve (rounding) ends the solve there too.
#[allow(clippy::too_many_arguments)]
fn solve(
    rows: &Rows,
    n: usize,
    k: usize,
    d: usize,
    l2: f64,
    start: Vec<f64>,
    (tol, max_iters): (f64, u64),
    comm: &dyn Collective,
) -> Result<(Vec<f64>, u64, f64), TrainError> {
    let (failed, best) = (RefCell::new(None), RefCell::new(None));
    let objective = Objective {
        rows,
        n: n.max(1) as f64,
        k,
        d,
        l2,
        comm,
        last: RefCell::new(None),
        best: &best,
        failed: &failed,
    };
    let solver = LBFGS::new(MoreThuenteLineSearch::new(), 10)
        .with_tolerance_grad(tol)
        .and_then(|s| s.with_tolerance_cost(1e-12))
        .expect("valid tolerances");
    let iters = Executor::new(objective, solver)
        .configure(|s| s.param(start).max_iters(max_iters))
        .run()
        .map(|r| r.state().get_iter());
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    let iters = match (iters, best.into_inner()) {
        (Ok(i), Some(b)) => (i, b),
        // The line search found no lower point (rounding): the lowest point so far stands.
        (Err(_), Some(b)) => (0, b),
        (Err(e), None) => return Err(TrainError::Invalid(format!("head solve: {e}"))),
        (Ok(_), None) => return Err(TrainError::Invalid("head solve: no evaluation".into())),
    };
    let (n_iters, (theta, _, g)) = iters;
    let grad_norm = g.iter().map(|v| v * v).sum::<f64>().sqrt();
    Ok((theta, n_iters, grad_norm))
}

#[cfg(test)]
mod tests;
