//! Optimizers for head training, written out (rather than candle-nn's) so that their state can be
//! checkpointed and a resumed run continues bit for bit.

use candle_core::{Tensor as CTensor, Var};
use kestrel_models::Weights;

use super::model::to_plain;
use crate::train::{FitParams, Optimizer, TrainError};

/// SGD with momentum (PyTorch semantics, L2 weight decay) and AdamW (decoupled decay), written out so
/// their state can be checkpointed exactly.
pub struct Opt {
    kind: Optimizer,
    momentum: f64,
    weight_decay: f64,
    /// Per var: SGD momentum buffer, or AdamW (m, v).
    slots: Vec<Vec<CTensor>>,
    pub step: u64,
}

impl Opt {
    pub fn new(p: &FitParams, vars: &[(String, Var)]) -> Result<Self, TrainError> {
        let n = match p.optimizer {
            Optimizer::Sgd => 1,
            Optimizer::Adamw => 2,
            Optimizer::Lbfgs => {
                return Err(TrainError::Invalid(
                    "lbfgs solves the head in one piece (train::head), not per batch".into(),
                ));
            }
        };
        let slots = vars
            .iter()
            .map(|(_, v)| {
                (0..n)
                    .map(|_| v.as_tensor().zeros_like())
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            kind: p.optimizer,
            momentum: p.momentum,
            weight_decay: p.weight_decay,
            slots,
            step: 0,
        })
    }

    pub fn apply(
        &mut self,
        vars: &[(String, Var)],
        grads: &candle_core::backprop::GradStore,
        lr: f64,
    ) -> Result<(), TrainError> {
        let g: Vec<Option<CTensor>> = vars
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).cloned())
            .collect();
        self.apply_each(vars, &g, lr)
    }

    /// One step from gradients flattened var after var (as [`flatten_grads`] writes them, e.g.
    /// after an allreduce).
    pub fn apply_flat(
        &mut self,
        vars: &[(String, Var)],
        flat: &[f32],
        lr: f64,
    ) -> Result<(), TrainError> {
        let mut at = 0;
        let mut g = Vec::with_capacity(vars.len());
        for (_, v) in vars {
            let n = v.elem_count();
            g.push(Some(CTensor::from_slice(
                &flat[at..at + n],
                v.dims(),
                v.device(),
            )?));
            at += n;
        }
        if at != flat.len() {
            return Err(TrainError::Invalid(format!(
                "{} gradient values for {at} parameters",
                flat.len()
            )));
        }
        self.apply_each(vars, &g, lr)
    }

    fn apply_each(
        &mut self,
        vars: &[(String, Var)],
        grads: &[Option<CTensor>],
        lr: f64,
    ) -> Result<(), TrainError> {
        self.step += 1;
        for (((_, var), slot), g) in vars.iter().zip(&mut self.slots).zip(grads) {
            let Some(g) = g else {
                continue;
            };
            // Detached: the variable's tensor is tracked, and an update computed from it would
            // otherwise keep the previous step's graph alive in the slots (memory growing every
            // step).
            let p = &var.as_tensor().detach();
            let g = &g.detach();
            match self.kind {
                Optimizer::Lbfgs => unreachable!("Opt::new refuses lbfgs"),
                Optimizer::Sgd => {
                    let g = if self.weight_decay != 0.0 {
                        (g + (p * self.weight_decay)?)?
                    } else {
                        g.clone()
                    };
                    let buf = ((&slot[0] * self.momentum)? + g)?;
                    var.set(&(p - (&buf * lr)?)?)?;
                    slot[0] = buf;
                }
                Optimizer::Adamw => {
                    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
                    let m = ((&slot[0] * b1)? + (g * (1.0 - b1))?)?;
                    let v = ((&slot[1] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
                    let mhat = (&m / (1.0 - b1.powi(self.step as i32)))?;
                    let vhat = (&v / (1.0 - b2.powi(self.step as i32)))?;
                    let decayed = (p * (1.0 - lr * self.weight_decay))?;
                    let update = (mhat / (vhat.sqrt()? + eps)?)?;
                    var.set(&(decayed - (update * lr)?)?)?;
                    slot[0] = m;
                    slot[1] = v;
                }
            }
        }
        Ok(())
    }

    /// The optimizer's state flattened (slot after slot), to broadcast it from rank 0.
    pub fn state_flat(&self) -> Result<Vec<f32>, TrainError> {
        let mut out = Vec::new();
        for slot in &self.slots {
            for t in slot {
                out.extend(t.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        Ok(out)
    }

    /// Restores what [`Opt::state_flat`] wrote.
    pub fn set_state_flat(&mut self, flat: &[f32], step: u64) -> Result<(), TrainError> {
        let mut at = 0;
        for slot in &mut self.slots {
            for t in slot.iter_mut() {
                let n = t.elem_count();
                *t = CTensor::from_slice(&flat[at..at + n], t.dims(), t.device())?;
                at += n;
            }
        }
        self.step = step;
        Ok(())
    }

    pub(crate) fn state(&self, vars: &[(String, Var)]) -> Result<Weights, TrainError> {
        let mut w = Weights::new();
        for ((name, _), slot) in vars.iter().zip(&self.slots) {
            for (k, t) in slot.iter().enumerate() {
                w.insert(format!("opt.{k}.{name}"), to_plain(t)?);
            }
        }
        Ok(w)
    }

    pub(crate) fn load(
        &mut self,
        vars: &[(String, Var)],
        w: &Weights,
        step: u64,
    ) -> Result<(), TrainError> {
        for ((name, _), slot) in vars.iter().zip(&mut self.slots) {
            for (k, t) in slot.iter_mut().enumerate() {
                let key = format!("opt.{k}.{name}");
                let s = w.get(&key).ok_or_else(|| {
                    TrainError::Invalid(format!("checkpoint lacks optimizer state `{key}`"))
                })?;
                *t = CTensor::from_slice(&s.data, s.shape.as_slice(), t.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// Every var's gradient (zeros when it has none) flattened var after var and multiplied by
/// `scale` — the layout [`Opt::apply_flat`] reads.
pub fn flatten_grads(
    vars: &[(String, Var)],
    grads: &candle_core::backprop::GradStore,
    scale: f32,
) -> Result<Vec<f32>, TrainError> {
    let mut out = Vec::with_capacity(vars.iter().map(|(_, v)| v.elem_count()).sum());
    for (_, v) in vars {
        match grads.get(v.as_tensor()) {
            Some(g) => out.extend(
                g.flatten_all()?
                    .to_vec1::<f32>()?
                    .into_iter()
                    .map(|x| x * scale),
            ),
            None => out.extend(std::iter::repeat_n(0.0, v.elem_count())),
        }
    }
    Ok(out)
}

/// Every var's values flattened var after var.
pub fn flatten_vars(vars: &[(String, Var)]) -> Result<Vec<f32>, TrainError> {
    let mut out = Vec::new();
    for (_, v) in vars {
        out.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Sets every var from a flat buffer written by [`flatten_vars`].
pub fn set_vars(vars: &[(String, Var)], flat: &[f32]) -> Result<(), TrainError> {
    let mut at = 0;
    for (_, v) in vars {
        let n = v.elem_count();
        v.set(&CTensor::from_slice(
            &flat[at..at + n],
            v.dims(),
            v.device(),
        )?)?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// SGD with zeroed momentum buffers for `vars`.
    fn sgd(vars: &[(String, Var)], momentum: f64, weight_decay: f64) -> Opt {
        Opt {
            kind: Optimizer::Sgd,
            momentum,
            weight_decay,
            slots: vars
                .iter()
                .map(|(_, v)| vec![v.as_tensor().zeros_like().unwrap()])
                .collect(),
            step: 0,
        }
    }

    fn var(values: &[f32]) -> Vec<(String, Var)> {
        let v = Var::from_slice(values, values.len(), &Device::Cpu).unwrap();
        vec![("w".to_string(), v)]
    }

    #[test]
    fn sgd_adds_l2_decay_to_the_gradient_and_accumulates_momentum() {
        let vars = var(&[1.0, -2.0]);
        let mut opt = sgd(&vars, 0.9, 0.5);
        // Step 1: g + 0.5 p = [1.5, -1] is the buffer; p = [1, -2] - 0.1 [1.5, -1] = [0.85, -1.9].
        opt.apply_flat(&vars, &[1.0, 0.0], 0.1).unwrap();
        // Step 2: g + 0.5 p = [1.425, -0.95]; buffer 0.9 [1.5, -1] + that = [2.775, -1.85];
        // p = [0.85, -1.9] - 0.1 [2.775, -1.85] = [0.5725, -1.715].
        opt.apply_flat(&vars, &[1.0, 0.0], 0.1).unwrap();
        let p = vars[0].1.as_tensor().to_vec1::<f32>().unwrap();
        let buf = opt.state_flat().unwrap();
        for (a, e) in p.iter().chain(&buf).zip([0.5725f32, -1.715, 2.775, -1.85]) {
            assert!((a - e).abs() < 1e-5, "weights {p:?}, buffer {buf:?}");
        }
        assert_eq!(opt.step, 2);
    }

    #[test]
    fn flat_gradients_must_cover_exactly_the_parameters() {
        let vars = var(&[1.0, -2.0]);
        let mut opt = sgd(&vars, 0.0, 0.0);
        let e = opt.apply_flat(&vars, &[1.0, 2.0, 3.0], 0.1).unwrap_err();
        assert!(
            matches!(&e, TrainError::Invalid(m) if m == "3 gradient values for 2 parameters"),
            "{e}"
        );
        // Nothing was applied.
        assert_eq!(opt.step, 0);
        assert_eq!(vars[0].1.as_tensor().to_vec1::<f32>().unwrap(), [1.0, -2.0]);
    }
}
