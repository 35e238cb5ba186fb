//! The trainable model: the unfrozen blocks (BN folded) and a new linear classifier as candle
//! variables, with seeded initialisation, and its Keras-style summary.

use candle_core::{Device, Tensor as CTensor, Var};
use kestrel_models::backbone::Backbone;
use kestrel_models::candle::CandleNet;
use kestrel_models::onnx::{Linear, LowerOpts};
use kestrel_models::{Tensor, Weights};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::train::head::Standardizer;
use crate::train::{TrainError, TrainingData};

/// The trainable part: unfrozen blocks (if any) + pooled features → linear classifier.
///
/// The classifier may train on standardized features: `standardize` is applied between the pooling
/// and the classifier, and [`Trainable::weights`] / [`Trainable::load`] fold it into / out of the
/// classifier, so that saved weights always take raw features (what the exported graph computes).
pub struct Trainable {
    pub net: CandleNet,
    pub vars: Vec<(String, Var)>,
    pub opts: LowerOpts,
    standardize: Option<(Standardizer, CTensor, CTensor)>,
}

impl Trainable {
    pub fn new(
        backbone: &Backbone,
        boundary: usize,
        classes: usize,
        init: Option<&Weights>,
        seed: u64,
        standardize: Option<Standardizer>,
        device: &Device,
    ) -> Result<Self, TrainError> {
        let net = &backbone.net;
        let folded = backbone
            .folded()
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
        let mut rng = StdRng::seed_from_u64(seed);
        let bound = 1.0 / (net.feature_dim as f32).sqrt();
        let classifier = Linear {
            weight: Tensor::new(
                vec![classes, net.feature_dim],
                (0..classes * net.feature_dim)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect(),
            ),
            bias: (0..classes)
                .map(|_| rng.random_range(-bound..bound))
                .collect(),
        };
        let opts = LowerOpts {
            blocks: boundary..net.blocks.len(),
            pool: boundary < net.blocks.len(),
            classifier: Some(classifier),
            output_name: "logits".into(),
            quant: Default::default(),
            probe: false,
            features_output: None,
        };
        let (cnet, vars) = CandleNet::trainable(net, &folded, &opts, device)?;
        let mut this = Self {
            net: cnet,
            vars,
            opts,
            standardize: None,
        };
        if let Some(st) = standardize {
            this.set_standardizer(st)?;
        }
        if let Some(w) = init {
            this.load(w)?;
        }
        Ok(this)
    }

    /// Standardizes the pooled features from now on (the classifier's values are kept as they
    /// are, i.e. they now act on standardized features).
    pub fn set_standardizer(&mut self, st: Standardizer) -> Result<(), TrainError> {
        let d = st.mean.len();
        let mean = CTensor::from_slice(&st.mean, (1, d), self.device())?;
        let inv_std = CTensor::from_slice(&st.inv_std, (1, d), self.device())?;
        self.standardize = Some((st, mean, inv_std));
        Ok(())
    }

    /// Sets every variable from weights on raw features (as [`Trainable::weights`] writes them).
    pub fn load(&self, w: &Weights) -> Result<(), TrainError> {
        self.load_vars(&self.unfold(w)?)
    }

    /// Sets every variable as it is (a checkpoint of [`Trainable::var_weights`]).
    pub fn load_vars(&self, w: &Weights) -> Result<(), TrainError> {
        for (name, var) in &self.vars {
            let t = w
                .get(name)
                .ok_or_else(|| TrainError::Invalid(format!("checkpoint lacks `{name}`")))?;
            if t.shape != var.dims() {
                return Err(TrainError::Invalid(format!(
                    "checkpoint `{name}` has shape {:?}, expected {:?}",
                    t.shape,
                    var.dims()
                )));
            }
            var.set(&CTensor::from_slice(
                &t.data,
                t.shape.as_slice(),
                var.device(),
            )?)?;
        }
        Ok(())
    }

    /// The variables as they are (on standardized features if the model standardizes):
    /// checkpoints, which must resume bit for bit.
    pub fn var_weights(&self) -> Result<Weights, TrainError> {
        self.vars
            .iter()
            .map(|(n, v)| Ok((n.clone(), to_plain(v.as_tensor())?)))
            .collect()
    }

    /// The weights on raw features: what `best.safetensors` holds and the export lowers.
    pub fn weights(&self) -> Result<Weights, TrainError> {
        let mut w = self.var_weights()?;
        if let Some((st, _, _)) = &self.standardize {
            let (wt, b) = (&w["classifier.weight"], &w["classifier.bias"]);
            let (fw, fb) = st.fold(&wt.data, &b.data);
            let (ws, bs) = (wt.shape.clone(), b.shape.clone());
            w.insert("classifier.weight".into(), Tensor::new(ws, fw));
            w.insert("classifier.bias".into(), Tensor::new(bs, fb));
        }
        Ok(w)
    }

    fn unfold(&self, w: &Weights) -> Result<Weights, TrainError> {
        let Some((st, _, _)) = &self.standardize else {
            return Ok(w.clone());
        };
        let (Some(wt), Some(b)) = (w.get("classifier.weight"), w.get("classifier.bias")) else {
            return Err(TrainError::Invalid("weights lack the classifier".into()));
        };
        let (uw, ub) = st.unfold(&wt.data, &b.data);
        let mut out = w.clone();
        out.insert(
            "classifier.weight".into(),
            Tensor::new(wt.shape.clone(), uw),
        );
        out.insert("classifier.bias".into(), Tensor::new(b.shape.clone(), ub));
        Ok(out)
    }

    /// Sets the classifier from weights on raw features (`[classes, dim]`, `[classes]`).
    pub fn set_classifier(&self, weight: &[f32], bias: &[f32]) -> Result<(), TrainError> {
        let mut w = self.var_weights()?;
        let (ws, bs) = (
            w["classifier.weight"].shape.clone(),
            w["classifier.bias"].shape.clone(),
        );
        w.insert("classifier.weight".into(), Tensor::new(ws, weight.to_vec()));
        w.insert("classifier.bias".into(), Tensor::new(bs, bias.to_vec()));
        self.load(&w)
    }

    /// A new model of `pp`'s classes on `device`, initialised from `seed`.
    pub fn fresh(pp: &TrainingData, seed: u64, device: &Device) -> Result<Self, TrainError> {
        let classes = pp.dataset_labels.len();
        Self::new(&pp.backbone, pp.boundary, classes, None, seed, None, device)
    }

    /// Where the variables live (and the batches go).
    pub fn device(&self) -> &Device {
        self.vars
            .first()
            .map(|(_, v)| v.device())
            .unwrap_or(&Device::Cpu)
    }

    /// The pooled features of `x` (the unfrozen blocks and the pooling, not the classifier),
    /// without a graph to keep.
    pub fn pooled(&self, x: &CTensor) -> Result<CTensor, TrainError> {
        Ok(self.net.features(x)?.detach())
    }

    pub fn forward(&self, x: &CTensor) -> Result<CTensor, TrainError> {
        let f = self.net.features(x)?;
        let f = match &self.standardize {
            Some((_, mean, inv_std)) => f.broadcast_sub(mean)?.broadcast_mul(inv_std)?,
            None => f,
        };
        Ok(self.net.classify(&f)?)
    }
}

pub(crate) fn to_plain(t: &CTensor) -> Result<Tensor, TrainError> {
    Ok(Tensor::new(
        t.dims().to_vec(),
        t.flatten_all()?.to_vec1::<f32>()?,
    ))
}

/// Keras/BigDL-style summary of the model being trained.
pub fn model_summary(pp: &TrainingData, t: &Trainable) -> String {
    let net = &pp.backbone.net;
    let mut s = format!(
        "{:<28}{:<18}{:>12}  {}\n",
        "Layer (block)", "Output shape", "Params", ""
    );
    s += &"-".repeat(68);
    s.push('\n');
    let (mut frozen, mut trainable) = (0usize, 0usize);
    for (i, b) in net.blocks.iter().enumerate() {
        let params: usize = b
            .convs
            .iter()
            .map(|c| c.weight_shape().iter().product::<usize>() + c.cout)
            .sum();
        let is_frozen = i < pp.boundary;
        if is_frozen {
            frozen += params
        } else {
            trainable += params
        }
        s += &format!(
            "{:<28}{:<18}{:>12}  {}\n",
            b.name,
            format!("{:?}", b.out_shape()),
            params,
            if is_frozen { "frozen" } else { "trainable" }
        );
    }
    s += &format!(
        "{:<28}{:<18}{:>12}  {}\n",
        "pool (GlobalAveragePool)",
        format!("[{}]", net.feature_dim),
        0,
        ""
    );
    let classes = pp.dataset_labels.len();
    let head = classes * net.feature_dim + classes;
    trainable += head;
    s += &format!(
        "{:<28}{:<18}{:>12}  {}\n",
        "classifier (Linear)",
        format!("[{classes}]"),
        head,
        "trainable"
    );
    s += &"-".repeat(68);
    let _ = t;
    s += &format!(
        "\nTotal params: {}  Trainable: {}  Frozen: {} (BN folded; frozen blocks precomputed once)\n",
        frozen + trainable,
        trainable,
        frozen
    );
    s
}
