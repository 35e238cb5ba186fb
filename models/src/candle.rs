//! Lowering of a [`Network`] to candle: the same walk as [`crate::onnx::lower`] over the same
//! BN-folded weights, so the two lowerings compute the same function.

use candle_core::{Device, Module, Tensor as CTensor, Var};

use crate::arch::{ConvBn, Network};
use crate::depthwise::{Depthwise, depthwise};
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
        let c = &self.spec;
        let y = if c.kernel == 1 && c.stride == 1 && c.groups == 1 && c.pads == [0; 4] {
            self.pointwise(x)?
        } else if c.groups == c.cin && c.cin == c.cout && c.groups > 1 {
            self.depthwise(x)?
        } else {
            let [t, l, b, r] = c.pads;
            let (x, pad) = if t == b && l == r && t == l {
                (x.clone(), t)
            } else {
                (x.pad_with_zeros(2, t, b)?.pad_with_zeros(3, l, r)?, 0)
            };
            x.conv2d(&self.weight, pad, c.stride, 1, c.groups)?
        };
        let y = y.broadcast_add(&self.bias)?;
        if c.relu6 { y.clamp(0f32, 6f32) } else { Ok(y) }
    }
}

impl ConvLayer {
    /// A 1x1 convolution as one batched matrix product, `[cout, cin] x [n, cin, h*w]` (candle's
    /// conv2d would unfold the input first, and its backward pass is slower still).
    fn pointwise(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        let (n, cin, h, w) = x.dims4()?;
        let wt = self.weight.reshape((1, self.spec.cout, cin))?;
        wt.broadcast_matmul(&x.reshape((n, cin, h * w))?)?
            .reshape((n, self.spec.cout, h, w))
    }

    /// A depthwise convolution: [`crate::depthwise`] (candle's grouped conv2d runs one
    /// convolution per channel, forward and backward, which made fine-tuning crawl).
    fn depthwise(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        let c = &self.spec;
        let op = Depthwise {
            kernel: c.kernel,
            stride: c.stride,
            top: c.pads[0],
            left: c.pads[1],
            out_hw: c.out_hw,
        };
        depthwise(x, &self.weight, op)
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

impl CandleNet {
    /// The blocks (and pooling), without the classifier.
    pub fn features(&self, x: &CTensor) -> candle_core::Result<CTensor> {
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
        Ok(x)
    }
}

impl CandleNet {
    /// The classifier (if any) on features.
    pub fn classify(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        match &self.classifier {
            Some((w, b)) => x.matmul(&w.t()?)?.broadcast_add(b),
            None => Ok(x.clone()),
        }
    }
}

impl Module for CandleNet {
    fn forward(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        self.classify(&self.features(x)?)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The matmul and shifted-view paths compute what candle's conv2d computes.
    #[test]
    fn pointwise_and_depthwise_paths_equal_conv2d() {
        let dev = Device::Cpu;
        let cases = [
            // (cin, cout, kernel, stride, groups, pads, hw)
            (8, 12, 1, 1, 1, [0, 0, 0, 0], 7),
            (6, 6, 3, 1, 6, [1, 1, 1, 1], 7),
            (6, 6, 3, 2, 6, [0, 0, 1, 1], 14),
            (6, 6, 5, 2, 6, [1, 1, 2, 2], 14),
            (6, 6, 5, 1, 6, [2, 2, 2, 2], 9),
        ];
        for (cin, cout, k, s, g, pads, hw) in cases {
            let out = (hw + pads[0] + pads[2] - k) / s + 1;
            let spec = ConvBn {
                name: "t".into(),
                cin,
                cout,
                kernel: k,
                stride: s,
                groups: g,
                relu6: true,
                pads,
                in_hw: [hw, hw],
                out_hw: [out, out],
            };
            let n = cout * (cin / g) * k * k;
            let f = FoldedConv {
                weight: Tensor::new(
                    spec.weight_shape(),
                    (0..n).map(|i| ((i * 37 % 17) as f32 - 8.0) / 9.0).collect(),
                ),
                bias: (0..cout).map(|i| i as f32 / 10.0).collect(),
            };
            let layer = ConvLayer::new(&spec, &f, &dev, None).unwrap();
            let x = CTensor::randn(0f32, 1f32, (2, cin, hw, hw), &dev).unwrap();
            let got = layer.forward(&x).unwrap();
            let [t, l, b, r] = pads;
            let want = x
                .pad_with_zeros(2, t, b)
                .unwrap()
                .pad_with_zeros(3, l, r)
                .unwrap()
                .conv2d(&layer.weight, 0, s, 1, g)
                .unwrap()
                .broadcast_add(&layer.bias)
                .unwrap()
                .clamp(0f32, 6f32)
                .unwrap();
            assert_eq!(got.dims(), want.dims(), "case k{k} s{s} g{g}");
            let diff = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                diff < 1e-4,
                "case k{k} s{s} g{g} pads {pads:?}: max diff {diff}"
            );
        }
    }

    /// The depthwise op's gradients equal finite differences of its forward pass.
    #[test]
    fn depthwise_gradients_match_finite_differences() {
        let dev = Device::Cpu;
        let op = Depthwise {
            kernel: 3,
            stride: 2,
            top: 0,
            left: 1,
            out_hw: [3, 3],
        };
        let x = Var::from_tensor(&CTensor::randn(0f32, 1f32, (2, 3, 6, 6), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&CTensor::randn(0f32, 1f32, (3, 1, 3, 3), &dev).unwrap()).unwrap();
        let r = CTensor::randn(0f32, 1f32, (2, 3, 3, 3), &dev).unwrap();
        let loss = |x: &CTensor, w: &CTensor| -> f64 {
            (depthwise(x, w, op).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let l = (depthwise(x.as_tensor(), w.as_tensor(), op).unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = l.backward().unwrap();
        for (var, at) in [
            (&x, [1usize, 2, 3, 4]),
            (&w, [2, 0, 1, 2]),
            (&x, [0, 0, 0, 1]),
        ] {
            let g = grads.get(var.as_tensor()).unwrap();
            let analytic = g
                .get(at[0])
                .unwrap()
                .get(at[1])
                .unwrap()
                .get(at[2])
                .unwrap()
                .get(at[3])
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64;
            let eps = 1e-2f32;
            let bump = |d: f32| {
                let mut v = var
                    .as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let dims = var.dims();
                let i = ((at[0] * dims[1] + at[1]) * dims[2] + at[2]) * dims[3] + at[3];
                v[i] += d;
                CTensor::from_vec(v, dims, &dev).unwrap()
            };
            let (plus, minus) = if std::ptr::eq(var, &x) {
                (
                    loss(&bump(eps), w.as_tensor()),
                    loss(&bump(-eps), w.as_tensor()),
                )
            } else {
                (
                    loss(x.as_tensor(), &bump(eps)),
                    loss(x.as_tensor(), &bump(-eps)),
                )
            };
            let numeric = (plus - minus) / (2.0 * eps as f64);
            assert!(
                (analytic - numeric).abs() < 1e-2 * (1.0 + numeric.abs()),
                "at {at:?}: analytic {analytic}, numeric {numeric}"
            );
        }
    }
}
