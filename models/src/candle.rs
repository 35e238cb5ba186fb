//! Lowering of a [`Network`] to candle: the same walk as [`crate::onnx::lower`] over the same
//! BN-folded weights, so the two lowerings compute the same function.

use candle_core::{Device, Module, Tensor as CTensor, Var};

use crate::arch::{ConvBn, Network};
use crate::engine::{Engine, EngineError, EngineKind};
use crate::onnx::LowerOpts;
use crate::tensor::Tensor;
use crate::weights::FoldedConv;

fn cerr(e: candle_core::Error) -> EngineError {
    EngineError::Candle(e.to_string())
}

/// One conv (+bias, +ReLU6) with explicit, possibly asymmetric, padding.
pub struct ConvLayer {
    spec: ConvBn,
    weight: CTensor,
    bias: CTensor,
}

impl ConvLayer {
    /// A conv from folded weights; with `vars`, its weight and bias become trainable variables
    /// named `{conv}.conv.weight` / `{conv}.conv.bias` and are appended there.
    pub fn new(
        spec: &ConvBn,
        f: &FoldedConv,
        device: &Device,
        vars: Option<&mut Vec<(String, Var)>>,
    ) -> candle_core::Result<Self> {
        let weight = CTensor::from_slice(&f.weight.data, f.weight.shape.as_slice(), device)?;
        let bias = CTensor::from_slice(&f.bias, (1, spec.cout, 1, 1), device)?;
        let (weight, bias) = match vars {
            None => (weight, bias),
            Some(vars) => {
                let (w, b) = (Var::from_tensor(&weight)?, Var::from_tensor(&bias)?);
                let out = (w.as_tensor().clone(), b.as_tensor().clone());
                vars.push((spec.weight_name(), w));
                vars.push((format!("{}.conv.bias", spec.name), b));
                out
            }
        };
        Ok(Self {
            spec: spec.clone(),
            weight,
            bias,
        })
    }
}

impl Module for ConvLayer {
    fn forward(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        let [t, l, b, r] = self.spec.pads;
        let (x, pad) = if t == b && l == r && t == l {
            (x.clone(), t)
        } else {
            (x.pad_with_zeros(2, t, b)?.pad_with_zeros(3, l, r)?, 0)
        };
        let y = x
            .conv2d(&self.weight, pad, self.spec.stride, 1, self.spec.groups)?
            .broadcast_add(&self.bias)?;
        if self.spec.relu6 {
            y.clamp(0f32, 6f32)
        } else {
            Ok(y)
        }
    }
}

/// The lowered blocks (+ pool + classifier) as a candle module.
pub struct CandleNet {
    blocks: Vec<(Vec<ConvLayer>, bool)>,
    pool: bool,
    classifier: Option<(CTensor, CTensor)>,
    input_shape: Vec<usize>,
}

impl CandleNet {
    pub fn new(
        net: &Network,
        convs: &[FoldedConv],
        opts: &LowerOpts,
        device: &Device,
    ) -> candle_core::Result<Self> {
        Self::build(net, convs, opts, device, None)
    }

    /// Like [`Self::new`], with every conv (and the classifier) as trainable variables, returned
    /// by name (`{conv}.conv.weight`, `{conv}.conv.bias`, `classifier.weight` `[out, in]`, `classifier.bias`).
    pub fn trainable(
        net: &Network,
        convs: &[FoldedConv],
        opts: &LowerOpts,
        device: &Device,
    ) -> candle_core::Result<(Self, Vec<(String, Var)>)> {
        let mut vars = Vec::new();
        let this = Self::build(net, convs, opts, device, Some(&mut vars))?;
        Ok((this, vars))
    }

    fn build(
        net: &Network,
        convs: &[FoldedConv],
        opts: &LowerOpts,
        device: &Device,
        mut vars: Option<&mut Vec<(String, Var)>>,
    ) -> candle_core::Result<Self> {
        let first_conv: usize = net.blocks[..opts.blocks.start]
            .iter()
            .map(|b| b.convs.len())
            .sum();
        let mut folded = convs[first_conv..].iter();
        let mut blocks = Vec::new();
        for block in &net.blocks[opts.blocks.clone()] {
            let layers = block
                .convs
                .iter()
                .map(|c| {
                    ConvLayer::new(
                        c,
                        folded.next().expect("one folded conv per conv"),
                        device,
                        vars.as_deref_mut(),
                    )
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            blocks.push((layers, block.residual));
        }
        let classifier = match &opts.classifier {
            Some(l) => {
                let w = CTensor::from_slice(&l.weight.data, l.weight.shape.as_slice(), device)?;
                let b = CTensor::from_slice(&l.bias, l.bias.len(), device)?;
                Some(match vars {
                    None => (w, b),
                    Some(vars) => {
                        let (w, b) = (Var::from_tensor(&w)?, Var::from_tensor(&b)?);
                        let out = (w.as_tensor().clone(), b.as_tensor().clone());
                        vars.push(("classifier.weight".into(), w));
                        vars.push(("classifier.bias".into(), b));
                        out
                    }
                })
            }
            None => None,
        };
        Ok(Self {
            blocks,
            pool: opts.pool,
            classifier,
            input_shape: opts.input_shape(net),
        })
    }
}

impl Module for CandleNet {
    fn forward(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        let mut x = x.clone();
        for (layers, residual) in &self.blocks {
            let input = x.clone();
            for l in layers {
                x = l.forward(&x)?;
            }
            if *residual {
                x = (x + input)?;
            }
        }
        if self.pool {
            x = x.flatten_from(2)?.mean(2)?;
        }
        if let Some((w, b)) = &self.classifier {
            x = x.matmul(&w.t()?)?.broadcast_add(b)?;
        }
        Ok(x)
    }
}

/// candle (CPU) as an [`Engine`].
pub struct CandleEngine {
    net: CandleNet,
    device: Device,
}

impl CandleEngine {
    pub fn new(net: &Network, convs: &[FoldedConv], opts: &LowerOpts) -> Result<Self, EngineError> {
        let device = Device::Cpu;
        Ok(Self {
            net: CandleNet::new(net, convs, opts, &device).map_err(cerr)?,
            device,
        })
    }
}

impl Engine for CandleEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Candle
    }

    fn run(&self, input: &Tensor) -> Result<Tensor, EngineError> {
        if input.shape.len() != self.net.input_shape.len() + 1
            || input.shape[1..] != self.net.input_shape
        {
            return Err(EngineError::InputShape {
                expected: self.net.input_shape.clone(),
                found: input.shape.clone(),
            });
        }
        let x =
            CTensor::from_slice(&input.data, input.shape.as_slice(), &self.device).map_err(cerr)?;
        let y = self.net.forward(&x).map_err(cerr)?;
        let shape = y.dims().to_vec();
        let data = y
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(cerr)?;
        Ok(Tensor::new(shape, data))
    }
}
