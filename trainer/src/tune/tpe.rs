//! The Tree-structured Parzen Estimator (Bergstra et al. 2011, as in Hyperopt), see the module
//! docs of [`super`].

use rand::{Rng, SeedableRng, rngs::StdRng};

use super::space::Dim;

/// TPE settings.
#[derive(Debug, Clone)]
pub struct Tpe {
    pub dims: Vec<Dim>,
    /// Random warm-up trials.
    pub startup: usize,
    /// Fraction of finished trials in the good group (0.15: on the synthetic objective of the
    /// tests it found better optima than Hyperopt's 0.25 with the same budget).
    pub gamma: f64,
    /// Candidates drawn from l(x) per proposal.
    pub candidates: usize,
}

impl Tpe {
    pub fn new(dims: Vec<Dim>) -> Self {
        Self {
            dims,
            startup: 10,
            gamma: 0.15,
            candidates: 24,
        }
    }

    /// Proposal number `trial` given the finished trials `(point, loss)`: random during warm-up
    /// (or without at least two finished trials), TPE after. Deterministic in (`seed`, `trial`,
    /// `history`).
    pub fn propose(
        &self,
        trial: usize,
        history: &[(Vec<f64>, f64)],
        seed: u64,
    ) -> (Vec<f64>, bool) {
        let mut rng =
            StdRng::seed_from_u64(seed ^ (trial as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        if trial < self.startup || history.len() < 2 {
            return (
                self.dims.iter().map(|d| d.random(&mut rng)).collect(),
                false,
            );
        }
        let mut order: Vec<usize> = (0..history.len()).collect();
        order.sort_by(|&a, &b| history[a].1.total_cmp(&history[b].1).then(a.cmp(&b)));
        let n_good = ((self.gamma * history.len() as f64).ceil() as usize)
            .clamp(1, 25)
            .min(history.len() - 1);
        let (good, bad) = order.split_at(n_good);
        let x = self
            .dims
            .iter()
            .enumerate()
            .map(|(k, dim)| {
                let gv: Vec<f64> = good.iter().map(|&i| history[i].0[k]).collect();
                let bv: Vec<f64> = bad.iter().map(|&i| history[i].0[k]).collect();
                match *dim {
                    Dim::Cat { n } => {
                        let l = cat_density(&gv, n);
                        let g = cat_density(&bv, n);
                        (0..self.candidates)
                            .map(|_| sample_cat(&l, &mut rng))
                            .map(|c| (c as f64, l[c].ln() - g[c].ln()))
                            .fold((0.0, f64::NEG_INFINITY), best)
                            .0
                    }
                    _ => {
                        let (lo, hi) = dim.bounds();
                        if hi <= lo {
                            return lo;
                        }
                        let l = Parzen::new(&gv, lo, hi);
                        let g = Parzen::new(&bv, lo, hi);
                        (0..self.candidates)
                            .map(|_| {
                                let mut v = l.sample(&mut rng);
                                if let Dim::Int { lo, hi } = *dim {
                                    v = v.round().clamp(lo as f64, hi as f64);
                                }
                                v
                            })
                            .map(|v| (v, l.density(v).ln() - g.density(v).ln()))
                            .fold((lo, f64::NEG_INFINITY), best)
                            .0
                    }
                }
            })
            .collect();
        (x, true)
    }
}

fn best(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    if b.1 > a.1 { b } else { a }
}

/// Category probabilities: counts plus one (prior), normalised.
fn cat_density(obs: &[f64], n: usize) -> Vec<f64> {
    let mut c = vec![1.0; n];
    for &o in obs {
        c[o as usize] += 1.0;
    }
    let total: f64 = c.iter().sum();
    c.iter().map(|v| v / total).collect()
}

fn sample_cat(p: &[f64], rng: &mut StdRng) -> usize {
    let mut u: f64 = rng.random_range(0.0..1.0);
    for (i, &pi) in p.iter().enumerate() {
        if u < pi {
            return i;
        }
        u -= pi;
    }
    p.len() - 1
}

/// A mixture of truncated Gaussians on `[lo, hi]`: one per observation plus a prior at the centre
/// with the full width, equally weighted; bandwidths from the neighbouring observations.
struct Parzen {
    mus: Vec<f64>,
    sigmas: Vec<f64>,
    lo: f64,
    hi: f64,
}

impl Parzen {
    fn new(obs: &[f64], lo: f64, hi: f64) -> Self {
        let width = hi - lo;
        let mut mus: Vec<f64> = obs.to_vec();
        mus.push(lo + width / 2.0);
        mus.sort_by(f64::total_cmp);
        let n = mus.len();
        let min_sigma = width / (n as f64).min(100.0);
        let sigmas = (0..n)
            .map(|i| {
                let left = if i == 0 {
                    mus[0] - lo
                } else {
                    mus[i] - mus[i - 1]
                };
                let right = if i + 1 == n {
                    hi - mus[i]
                } else {
                    mus[i + 1] - mus[i]
                };
                left.max(right).clamp(min_sigma, width)
            })
            .collect::<Vec<_>>();
        // The prior component keeps the full width.
        let prior = mus
            .iter()
            .position(|&m| m == lo + width / 2.0)
            .expect("prior present");
        let mut sigmas = sigmas;
        sigmas[prior] = width;
        Self {
            mus,
            sigmas,
            lo,
            hi,
        }
    }

    fn density(&self, x: f64) -> f64 {
        let n = self.mus.len() as f64;
        let sum: f64 = self
            .mus
            .iter()
            .zip(&self.sigmas)
            .map(|(&m, &s)| {
                let mass = phi((self.hi - m) / s) - phi((self.lo - m) / s);
                let z = (x - m) / s;
                (-0.5 * z * z).exp() / (s * (2.0 * std::f64::consts::PI).sqrt()) / mass.max(1e-12)
            })
            .sum();
        (sum / n).max(1e-300)
    }

    fn sample(&self, rng: &mut StdRng) -> f64 {
        let k = rng.random_range(0..self.mus.len());
        for _ in 0..100 {
            // Box-Muller.
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            let v = self.mus[k] + self.sigmas[k] * z;
            if (self.lo..=self.hi).contains(&v) {
                return v;
            }
        }
        self.mus[k].clamp(self.lo, self.hi)
    }
}

/// Standard normal CDF (erf by Abramowitz–Stegun 7.1.26, |error| < 1.5e-7).
fn phi(z: f64) -> f64 {
    let x = z / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let y = 1.0
        - (((((1.061_405_429 * t - 1.453_152_027) * t) + 1.421_413_741) * t - 0.284_496_736) * t
            + 0.254_829_592)
            * t
            * (-x * x).exp();
    let erf = if x >= 0.0 { y } else { -y };
    0.5 * (1.0 + erf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{Optimizer, TrainError};
    use crate::tune::space::{Space, TrialParams, read_space};
    use crate::tune::{TrialResult, TuneError, sorted};
    use rand::SeedableRng;

    /// A synthetic objective with a known optimum: lr 1e-2, momentum 0.8, weight decay 3e-4,
    /// batch index 1, optimizer index 0, 20 epochs (loss 0 there).
    fn objective(x: &[f64]) -> f64 {
        (x[0] - 0.01f64.ln()).powi(2)
            + 4.0 * (x[1] - 0.8).powi(2)
            + ((x[2] - 3e-4) * 1e3).powi(2)
            + if x[3] as usize == 1 { 0.0 } else { 0.5 }
            + if x[4] as usize == 0 { 0.0 } else { 0.3 }
            + ((x[5] - 20.0) / 10.0).powi(2)
    }

    fn search(tpe: &Tpe, budget: usize, seed: u64, random_only: bool) -> f64 {
        let mut history = Vec::new();
        for t in 0..budget {
            let (x, _) = if random_only {
                let mut rng = StdRng::seed_from_u64(seed ^ ((t as u64 + 1) * 7919));
                (tpe.dims.iter().map(|d| d.random(&mut rng)).collect(), false)
            } else {
                tpe.propose(t, &history, seed)
            };
            let y = objective(&x);
            history.push((x, y));
        }
        history.iter().map(|h| h.1).fold(f64::INFINITY, f64::min)
    }

    #[test]
    fn tpe_beats_random_search_with_the_same_budget() {
        let tpe = Tpe::new(Space::default().dims());
        let seeds = 40;
        let (mut t_sum, mut r_sum, mut wins) = (0.0, 0.0, 0);
        for seed in 0..seeds {
            let t = search(&tpe, 50, seed, false);
            let r = search(&tpe, 50, 1000 + seed, true);
            t_sum += t;
            r_sum += r;
            wins += usize::from(t < r);
        }
        let (t, r) = (t_sum / seeds as f64, r_sum / seeds as f64);
        eprintln!(
            "mean best over {seeds} seeds, 50 trials: TPE {t:.4}, random {r:.4}, TPE wins {wins}"
        );
        // Measured: TPE 0.50, random 0.84, TPE better on 33 of 40 seeds (deterministic: seeded).
        assert!(t < 0.75 * r, "TPE {t} vs random {r}");
        assert!(wins >= 26, "TPE won only {wins} of {seeds}");
    }

    #[test]
    fn proposals_stay_in_the_space_and_are_seeded() {
        let space = Space::default();
        let tpe = Tpe::new(space.dims());
        let mut history = Vec::new();
        for t in 0..30 {
            let (x, by_tpe) = tpe.propose(t, &history, 5);
            assert_eq!(by_tpe, t >= 10);
            assert_eq!(
                tpe.propose(t, &history, 5).0,
                x,
                "same inputs, same proposal"
            );
            let p = space.decode(&x);
            assert!((1e-4..=0.3).contains(&p.lr), "{p:?}");
            assert!((0.0..=0.99).contains(&p.momentum), "{p:?}");
            assert!((0.0..=1e-3).contains(&p.weight_decay), "{p:?}");
            assert!((5..=30).contains(&p.epochs), "{p:?}");
            history.push((x.clone(), objective(&x)));
        }
    }

    #[test]
    fn space_reads_from_toml_and_rejects_nonsense() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("space.toml");
        std::fs::write(
            &p,
            "lr = [0.001, 0.1]\noptimizer = [\"adamw\"]\nepochs = [3, 4]\n",
        )
        .unwrap();
        let s = read_space(&p).unwrap();
        assert_eq!(s.lr, [0.001, 0.1]);
        assert_eq!(s.optimizer, vec![Optimizer::Adamw]);
        assert_eq!(s.batch_size, Space::default().batch_size);
        std::fs::write(&p, "lr = [0.0, 0.1]\n").unwrap();
        let why = |p: &std::path::Path| kestrel_shared::chain(&read_space(p).unwrap_err());
        assert!(why(&p).contains("lr range"), "{}", why(&p));
        std::fs::write(&p, "learning_rate = [0.1, 0.2]\n").unwrap();
        assert!(why(&p).contains("unknown field"), "{}", why(&p));
    }

    fn trial_params() -> TrialParams {
        TrialParams {
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: 0.0,
            batch_size: 32,
            optimizer: Optimizer::Sgd,
            epochs: 10,
        }
    }

    fn trial_result(trial: usize, val_loss: Option<f64>, val_accuracy: f64) -> TrialResult {
        TrialResult {
            trial,
            source: "random".into(),
            params: trial_params(),
            val_loss,
            val_accuracy,
            best_epoch: 1,
            seconds: 1.0,
            ended_ms: 0,
            error: None,
        }
    }

    #[test]
    fn trials_sort_by_loss_then_accuracy_then_number_with_diverged_ones_last() {
        let trials = [
            trial_result(0, None, 0.9),
            trial_result(1, Some(0.5), 0.6),
            trial_result(2, Some(0.5), 0.8),
            trial_result(3, Some(f64::NAN), 0.95),
            trial_result(4, Some(0.5), 0.8),
            trial_result(5, Some(0.2), 0.1),
        ];
        let order: Vec<usize> = sorted(&trials).iter().map(|t| t.trial).collect();
        assert_eq!(order, vec![5, 2, 4, 1, 3, 0]);
        // A NaN loss counts as diverged: the worst objective.
        assert_eq!(trials[3].loss(), f64::INFINITY);
    }

    #[test]
    fn a_trial_that_fails_is_recorded_with_its_error_and_ranks_as_diverged() {
        let err = TrainError::Invalid("batch larger than the data".into());
        let t = TrialResult::new(7, true, trial_params(), Err(err), 1.5);
        assert_eq!(
            (t.trial, t.source.as_str(), t.val_loss, t.best_epoch),
            (7, "tpe", None, 0)
        );
        assert_eq!(t.val_accuracy, 0.0);
        assert_eq!(t.error.as_deref(), Some("batch larger than the data"));
        assert_eq!(t.loss(), f64::INFINITY);
        let line = t.line();
        assert!(
            line.starts_with(
                "trial   7 (tpe   ) val loss diverged acc 0.000 | lr 1.00e-3 momentum 0.900"
            ),
            "{line}"
        );
        assert!(line.ends_with("batch 32 Sgd epochs 10 | 1.50s"), "{line}");
    }

    #[test]
    fn a_space_with_momentum_one_a_zero_batch_or_reversed_ranges_is_refused() {
        let why = |s: Space| match s.validate() {
            Err(TuneError::Space(m)) => m,
            other => panic!("{other:?}"),
        };
        let base = Space::default;
        assert_eq!(
            why(Space {
                momentum: [0.0, 1.0],
                ..base()
            }),
            "momentum must stay below 1, got 1"
        );
        assert_eq!(
            why(Space {
                batch_size: vec![16, 0],
                ..base()
            }),
            "batch_size needs at least one positive value"
        );
        assert_eq!(
            why(Space {
                weight_decay: [1e-3, 0.0],
                ..base()
            }),
            "weight_decay range [0.001, 0] must be non-negative and ordered"
        );
        assert_eq!(
            why(Space {
                epochs: [10, 5],
                ..base()
            }),
            "epochs range [10, 5] must be positive and ordered"
        );
    }

    #[test]
    fn decode_picks_categories_by_index_truncates_epochs_and_clamps_lr() {
        let space = Space::default();
        let p = space.decode(&[0.01f64.ln(), 0.5, 1e-4, 2.0, 1.0, 12.9]);
        assert!((p.lr - 0.01).abs() < 1e-12, "{p:?}");
        assert_eq!(
            (
                p.momentum,
                p.weight_decay,
                p.batch_size,
                p.optimizer,
                p.epochs
            ),
            (0.5, 1e-4, 64, Optimizer::Adamw, 12)
        );
        // ln lr outside [ln 1e-4, ln 0.3] is clamped to the range's ends.
        assert_eq!(space.decode(&[10.0, 0.0, 0.0, 0.0, 0.0, 5.0]).lr, 0.3);
        assert_eq!(space.decode(&[-100.0, 0.0, 0.0, 0.0, 0.0, 5.0]).lr, 1e-4);
    }

    #[test]
    fn tpe_stays_random_until_two_trials_have_finished() {
        let mut tpe = Tpe::new(Space::default().dims());
        tpe.startup = 0;
        let (a, by_tpe) = tpe.propose(0, &[], 3);
        assert!(!by_tpe);
        let (b, _) = tpe.propose(1, &[], 3);
        assert!(!tpe.propose(2, &[(a.clone(), 1.0)], 3).1);
        let (x, by_tpe) = tpe.propose(2, &[(a, 1.0), (b, 2.0)], 3);
        assert!(by_tpe);
        // Epochs (an Int dimension) come back as a whole number inside [5, 30].
        assert!((5.0..=30.0).contains(&x[5]) && x[5].fract() == 0.0, "{x:?}");
    }
}
