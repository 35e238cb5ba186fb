//! The search space of `trainer tune` and its TOML form.

use std::path::Path;

use rand::{Rng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use super::TuneError;
use crate::train::{FitParams, Optimizer};

/// The search space (also the TOML format of `--space`; every key optional).
///
/// ```toml
/// lr = [1e-4, 0.3]          # log-uniform
/// momentum = [0.0, 0.99]    # uniform
/// weight_decay = [0.0, 1e-3] # uniform
/// batch_size = [16, 32, 64] # categorical
/// optimizer = ["sgd", "adamw"] # categorical
/// epochs = [5, 30]          # integer, inclusive
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Space {
    pub lr: [f64; 2],
    pub momentum: [f64; 2],
    pub weight_decay: [f64; 2],
    pub batch_size: Vec<usize>,
    pub optimizer: Vec<Optimizer>,
    pub epochs: [usize; 2],
}

impl Default for Space {
    fn default() -> Self {
        Self {
            lr: [1e-4, 0.3],
            momentum: [0.0, 0.99],
            weight_decay: [0.0, 1e-3],
            batch_size: vec![16, 32, 64],
            optimizer: vec![Optimizer::Sgd, Optimizer::Adamw],
            epochs: [5, 30],
        }
    }
}

impl Space {
    pub fn validate(&self) -> Result<(), TuneError> {
        let bad = |m: String| Err(TuneError::Space(m));
        let [lo, hi] = self.lr;
        if !(lo > 0.0 && hi >= lo) {
            return bad(format!(
                "lr range [{lo}, {hi}] must be positive and ordered (it is log-uniform)"
            ));
        }
        for (name, [lo, hi]) in [
            ("momentum", self.momentum),
            ("weight_decay", self.weight_decay),
        ] {
            if !(lo >= 0.0 && hi >= lo && lo.is_finite() && hi.is_finite()) {
                return bad(format!(
                    "{name} range [{lo}, {hi}] must be non-negative and ordered"
                ));
            }
        }
        if self.momentum[1] >= 1.0 {
            return bad(format!(
                "momentum must stay below 1, got {}",
                self.momentum[1]
            ));
        }
        if self.batch_size.is_empty() || self.batch_size.contains(&0) {
            return bad("batch_size needs at least one positive value".into());
        }
        if self.optimizer.is_empty() {
            return bad("optimizer needs at least one of sgd, adamw".into());
        }
        let [lo, hi] = self.epochs;
        if lo == 0 || hi < lo {
            return bad(format!(
                "epochs range [{lo}, {hi}] must be positive and ordered"
            ));
        }
        Ok(())
    }

    /// The dimensions TPE searches, in a fixed order: lr (as ln lr), momentum, weight decay,
    /// batch size (index), optimizer (index), epochs.
    pub fn dims(&self) -> Vec<Dim> {
        vec![
            Dim::Float {
                lo: self.lr[0].ln(),
                hi: self.lr[1].ln(),
            },
            Dim::Float {
                lo: self.momentum[0],
                hi: self.momentum[1],
            },
            Dim::Float {
                lo: self.weight_decay[0],
                hi: self.weight_decay[1],
            },
            Dim::Cat {
                n: self.batch_size.len(),
            },
            Dim::Cat {
                n: self.optimizer.len(),
            },
            Dim::Int {
                lo: self.epochs[0] as i64,
                hi: self.epochs[1] as i64,
            },
        ]
    }

    pub fn decode(&self, x: &[f64]) -> TrialParams {
        TrialParams {
            lr: x[0].exp().clamp(self.lr[0], self.lr[1]),
            momentum: x[1],
            weight_decay: x[2],
            batch_size: self.batch_size[x[3] as usize],
            optimizer: self.optimizer[x[4] as usize],
            epochs: x[5] as usize,
        }
    }
}

/// What a trial trains with (the rest comes from the tune command's flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialParams {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub batch_size: usize,
    pub optimizer: Optimizer,
    pub epochs: usize,
}

impl TrialParams {
    pub fn apply(&self, base: &FitParams) -> FitParams {
        FitParams {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            batch_size: self.batch_size,
            optimizer: self.optimizer,
            epochs: self.epochs,
            ..base.clone()
        }
    }
}

/// One searched dimension, in TPE's internal coordinates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dim {
    Float { lo: f64, hi: f64 },
    Int { lo: i64, hi: i64 },
    Cat { n: usize },
}

impl Dim {
    pub(super) fn random(&self, rng: &mut StdRng) -> f64 {
        match *self {
            Dim::Float { lo, hi } if hi > lo => rng.random_range(lo..=hi),
            Dim::Float { lo, .. } => lo,
            Dim::Int { lo, hi } => rng.random_range(lo..=hi) as f64,
            Dim::Cat { n } => rng.random_range(0..n) as f64,
        }
    }

    /// Continuous bounds (integers as [lo - 0.5, hi + 0.5]).
    pub(super) fn bounds(&self) -> (f64, f64) {
        match *self {
            Dim::Float { lo, hi } => (lo, hi),
            Dim::Int { lo, hi } => (lo as f64 - 0.5, hi as f64 + 0.5),
            Dim::Cat { n } => (0.0, n as f64),
        }
    }
}

/// Reads a `--space` TOML file.
pub fn read_space(path: &Path) -> Result<Space, TuneError> {
    let err = |e: kestrel_shared::error::Cause| TuneError::File {
        path: path.display().to_string(),
        source: e,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.into()))?;
    let space: Space = toml::from_str(&text).map_err(|e| err(e.into()))?;
    space.validate().map_err(|e| err(e.into()))?;
    Ok(space)
}
