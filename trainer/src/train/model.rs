//! The trainable model: the unfrozen blocks (BN folded) and a new linear classifier as candle
//! variables, with seeded initialisation, and its Keras-style summary.

use candle_core::{Device, Module, Tensor as CTensor, Var};
use kestrel_models::backbone::Backbone;
use kestrel_models::candle::CandleNet;
use kestrel_models::onnx::{Linear, LowerOpts};
use kestrel_models::{Tensor, Weights};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::train::{Prepped, TrainError};

/// The trainable part: unfrozen blocks (if any) + pooled features → linear classifier.
pub struct Trainable {
    pub net: CandleNet,
    pub vars: Vec<(String, Var)>,
    pub opts: LowerOpts,
}

impl Trainable {
    pub fn new(
        backbone: &Backbone,
        boundary: usize,
        classes: usize,
        init: Option<&Weights>,
        seed: u64,
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
        };
        let (cnet, vars) = CandleNet::trainable(net, &folded, &opts, &Device::Cpu)?;
        let this = Self {
            net: cnet,
            vars,
            opts,
        };
        if let Some(w) = init {
            this.load(w)?;
        }
        Ok(this)
    }

    pub fn load(&self, w: &Weights) -> Result<(), TrainError> {
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
                &Device::Cpu,
            )?)?;
        }
        Ok(())
    }

    pub fn weights(&self) -> Result<Weights, TrainError> {
        self.vars
            .iter()
            .map(|(n, v)| Ok((n.clone(), to_plain(v.as_tensor())?)))
            .collect()
    }

    pub fn forward(&self, x: &CTensor) -> Result<CTensor, TrainError> {
        Ok(self.net.forward(x)?)
    }
}

pub(crate) fn to_plain(t: &CTensor) -> Result<Tensor, TrainError> {
    Ok(Tensor::new(
        t.dims().to_vec(),
        t.flatten_all()?.to_vec1::<f32>()?,
    ))
}

/// Keras/BigDL-style summary of the model being trained.
pub fn model_summary(pp: &Prepped, t: &Trainable) -> String {
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
