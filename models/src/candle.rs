//! Lowering of a [`Network`] to candle: the same walk as [`crate::onnx::lower`] over the same
//! BN-folded weights, so the two lowerings compute the same function.

use candle_core::{Device, Module, Tensor as CTensor, Var};

use crate::arch::{ConvBn, Network};
use crate::depthwise::{Depthwise, depthwise};
use crate::engine::{Engine, EngineError, EngineKind};
use crate::onnx::LowerOpts;
use crate::planes::{BiasAct, PlaneOrder, bias_act};
use crate::tensor::Tensor;
use crate::weights::FoldedConv;

fn cerr(e: candle_core::Error) -> EngineError {
    EngineError::Candle(e.into())
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
        self.forward_planes(x, PlaneOrder::Nchw)
    }
}

impl ConvLayer {
    fn is_pointwise(&self) -> bool {
        let c = &self.spec;
        c.kernel == 1 && c.stride == 1 && c.groups == 1 && c.pads == [0; 4]
    }

    fn is_depthwise(&self) -> bool {
        let c = &self.spec;
        c.groups == c.cin && c.cin == c.cout && c.groups > 1
    }

    /// The conv on `x` laid out as `planes` says (only pointwise and depthwise convs take
    /// [`PlaneOrder::Cnhw`]).
    fn forward_planes(&self, x: &CTensor, planes: PlaneOrder) -> candle_core::Result<CTensor> {
        let c = &self.spec;
        let y = if self.is_pointwise() {
            self.pointwise(x, planes)?
        } else if self.is_depthwise() {
            self.depthwise(x, planes)?
        } else {
            assert_eq!(
                planes,
                PlaneOrder::Nchw,
                "a full convolution takes [n, c, h, w]"
            );
            let [t, l, b, r] = c.pads;
            let (x, pad) = if t == b && l == r && t == l {
                (x.clone(), t)
            } else {
                (x.pad_with_zeros(2, t, b)?.pad_with_zeros(3, l, r)?, 0)
            };
            x.conv2d(&self.weight, pad, c.stride, 1, c.groups)?
        };
        let op = BiasAct {
            relu6: c.relu6,
            planes,
        };
        bias_act(&y, &self.bias, op)
    }

    /// A 1x1 convolution as a matrix product (candle's conv2d would unfold the input first, and
    /// its backward pass is slower still): on `[c, n, h, w]` one product over the whole batch,
    /// `[cout, cin] x [cin, n*h*w]`; on `[n, c, h, w]` one per sample.
    fn pointwise(&self, x: &CTensor, planes: PlaneOrder) -> candle_core::Result<CTensor> {
        let (d0, d1, h, w) = x.dims4()?;
        let cout = self.spec.cout;
        match planes {
            PlaneOrder::Cnhw => {
                let wt = self.weight.reshape((cout, d0))?;
                wt.matmul(&x.reshape((d0, d1 * h * w))?)?
                    .reshape((cout, d1, h, w))
            }
            PlaneOrder::Nchw => {
                let wt = self.weight.reshape((1, cout, d1))?;
                wt.broadcast_matmul(&x.reshape((d0, d1, h * w))?)?
                    .reshape((d0, cout, h, w))
            }
        }
    }

    /// A depthwise convolution: [`crate::depthwise`] (candle's grouped conv2d runs one
    /// convolution per channel, forward and backward, which made fine-tuning crawl).
    fn depthwise(&self, x: &CTensor, planes: PlaneOrder) -> candle_core::Result<CTensor> {
        let c = &self.spec;
        let op = Depthwise {
            kernel: c.kernel,
            stride: c.stride,
            top: c.pads[0],
            left: c.pads[1],
            out_hw: c.out_hw,
            planes,
        };
        depthwise(x, &self.weight, op)
    }
}

/// The lowered blocks (+ pool + classifier) as a candle module.
pub struct CandleNet {
    blocks: Vec<(Vec<ConvLayer>, bool)>,
    /// How the blocks lay out activations: [`PlaneOrder::Cnhw`] when every conv is pointwise or
    /// depthwise (the unfrozen end of a backbone, where training spends its time).
    planes: PlaneOrder,
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
        let all_cnhw = blocks
            .iter()
            .flat_map(|(layers, _)| layers)
            .all(|l| l.is_pointwise() || l.is_depthwise());
        Ok(Self {
            planes: if all_cnhw && !blocks.is_empty() {
                PlaneOrder::Cnhw
            } else {
                PlaneOrder::Nchw
            },
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
        let cnhw = self.planes == PlaneOrder::Cnhw;
        let mut x = if cnhw {
            x.transpose(0, 1)?.contiguous()?
        } else {
            x.clone()
        };
        for (layers, residual) in &self.blocks {
            let input = x.clone();
            for l in layers {
                x = l.forward_planes(&x, self.planes)?;
            }
            if *residual {
                x = (x + input)?;
            }
        }
        match (self.pool, cnhw) {
            (true, true) => x.flatten_from(2)?.mean(2)?.t()?.contiguous(),
            (true, false) => x.flatten_from(2)?.mean(2),
            (false, true) => x.transpose(0, 1)?.contiguous(),
            (false, false) => Ok(x),
        }
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
            let cnhw = (layer.is_pointwise() || layer.is_depthwise()).then(|| {
                let xt = x.transpose(0, 1).unwrap().contiguous().unwrap();
                let y = layer.forward_planes(&xt, PlaneOrder::Cnhw).unwrap();
                y.transpose(0, 1).unwrap().contiguous().unwrap()
            });
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
            let diff = max_diff(&got, &want);
            assert!(
                diff < 1e-4,
                "case k{k} s{s} g{g} pads {pads:?}: max diff {diff}"
            );
            let cnhw = cnhw.expect("every case is pointwise or depthwise");
            let diff = max_diff(&cnhw, &got);
            assert!(
                diff < 1e-5,
                "case k{k} s{s} g{g}: [c, n, h, w] differs by {diff}"
            );
        }
    }

    fn max_diff(a: &CTensor, b: &CTensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
            .unwrap()
    }

    /// The depthwise and bias ops' gradients equal finite differences of their forward passes,
    /// in both layouts.
    #[test]
    fn fused_op_gradients_match_finite_differences() {
        let dev = Device::Cpu;
        for planes in [PlaneOrder::Nchw, PlaneOrder::Cnhw] {
            let dw = Depthwise {
                kernel: 3,
                stride: 2,
                top: 0,
                left: 1,
                out_hw: [3, 3],
                planes,
            };
            // x [2, 3, 6, 6] is [n, c, ..] or [c, n, ..]: 3 channels either way for the weight.
            let (xs, c) = match planes {
                PlaneOrder::Nchw => ((2, 3, 6, 6), 3),
                PlaneOrder::Cnhw => ((3, 2, 6, 6), 3),
            };
            let x = CTensor::randn(0f32, 1f32, xs, &dev).unwrap();
            let w = CTensor::randn(0f32, 1f32, (c, 1, 3, 3), &dev).unwrap();
            check_gradients("depthwise", &[x, w], |v| depthwise(&v[0], &v[1], dw));
            for relu6 in [false, true] {
                // Values below, inside and above (0, 6), each at least 0.5 from an edge (with
                // the bias), so that the differences do not cross one.
                let n = 2 * 3 * 36;
                let levels =
                    (0..n).map(|i| [-1.0f32, 3.0, 7.0][i * 37 % 3] + (i % 5) as f32 * 0.05);
                let x = CTensor::from_vec(levels.collect(), xs, &dev).unwrap();
                let b = (CTensor::randn(0f32, 1f32, (1, c, 1, 1), &dev).unwrap() * 0.1).unwrap();
                let op = BiasAct { relu6, planes };
                check_gradients("bias", &[x, b], |v| bias_act(&v[0], &v[1], op));
            }
        }
    }

    /// The composed forms of the depthwise and bias ops (what a GPU runs) compute the CPU ops'
    /// values and gradients, in both layouts, for odd and even sizes, strides 1 and 2,
    /// symmetric and asymmetric padding.
    #[test]
    fn composed_ops_equal_the_cpu_ops() {
        use crate::depthwise::depthwise_composed;
        use crate::planes::bias_act_composed;
        let dev = Device::Cpu;
        // (kernel, stride, top, left, h, w, oh, ow)
        let cases = [
            (3, 1, 1, 1, 7, 7, 7, 7),
            (3, 2, 0, 0, 8, 8, 4, 4),
            (3, 2, 0, 1, 7, 6, 3, 3),
            (3, 2, 1, 1, 7, 7, 4, 4),
            (5, 2, 2, 2, 9, 9, 5, 5),
            (3, 1, 0, 0, 5, 4, 3, 2),
        ];
        for planes in [PlaneOrder::Nchw, PlaneOrder::Cnhw] {
            for (k, s, top, left, h, w, oh, ow) in cases {
                let op = Depthwise {
                    kernel: k,
                    stride: s,
                    top,
                    left,
                    out_hw: [oh, ow],
                    planes,
                };
                let (xs, c) = match planes {
                    PlaneOrder::Nchw => ((2, 4, h, w), 4),
                    PlaneOrder::Cnhw => ((4, 2, h, w), 4),
                };
                let x = CTensor::randn(0f32, 1f32, xs, &dev).unwrap();
                let wt = CTensor::randn(0f32, 1f32, (c, 1, k, k), &dev).unwrap();
                let what = format!("depthwise {planes:?} k{k} s{s} pads {top},{left} {h}x{w}");
                same_values_and_gradients(
                    &what,
                    &[x, wt],
                    |v| depthwise(&v[0], &v[1], op),
                    |v| depthwise_composed(&v[0], &v[1], op),
                );
            }
            for relu6 in [false, true] {
                let xs = match planes {
                    PlaneOrder::Nchw => (2, 4, 5, 5),
                    PlaneOrder::Cnhw => (4, 2, 5, 5),
                };
                // Values spread over (-3, 9): below, inside and above (0, 6).
                let x = (CTensor::randn(0f32, 1f32, xs, &dev).unwrap() * 4.0).unwrap();
                let x = (x + 3.0).unwrap();
                let b = CTensor::randn(0f32, 1f32, 4, &dev).unwrap();
                let op = BiasAct { relu6, planes };
                same_values_and_gradients(
                    &format!("bias {planes:?} relu6 {relu6}"),
                    &[x, b],
                    |v| bias_act(&v[0], &v[1], op),
                    |v| bias_act_composed(&v[0], &v[1], op),
                );
            }
        }
    }

    /// `f` and `g` give the same output and the same gradients of `sum(out * r)` for each input.
    fn same_values_and_gradients(
        what: &str,
        inputs: &[CTensor],
        f: impl Fn(&[CTensor]) -> candle_core::Result<CTensor>,
        g: impl Fn(&[CTensor]) -> candle_core::Result<CTensor>,
    ) {
        let run = |h: &dyn Fn(&[CTensor]) -> candle_core::Result<CTensor>, r: Option<&CTensor>| {
            let vars: Vec<Var> = inputs
                .iter()
                .map(|t| Var::from_tensor(t).unwrap())
                .collect();
            let ts: Vec<CTensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let out = h(&ts).unwrap();
            let r = r
                .cloned()
                .unwrap_or_else(|| CTensor::randn(0f32, 1f32, out.dims(), &Device::Cpu).unwrap());
            let grads = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let gs: Vec<CTensor> = vars
                .iter()
                .map(|v| grads.get(v.as_tensor()).unwrap().clone())
                .collect();
            (out, r, gs)
        };
        let (out_f, r, grads_f) = run(&f, None);
        let (out_g, _, grads_g) = run(&g, Some(&r));
        assert_eq!(out_f.dims(), out_g.dims(), "{what}: shapes");
        let diff = max_diff(&out_f, &out_g);
        assert!(diff < 1e-5, "{what}: outputs differ by {diff}");
        for (k, (a, b)) in grads_f.iter().zip(&grads_g).enumerate() {
            let diff = max_diff(&a.flatten_all().unwrap(), &b.flatten_all().unwrap());
            assert!(
                diff < 1e-4,
                "{what}: gradients of input {k} differ by {diff}"
            );
        }
    }

    /// For every input, the analytic gradient of `sum(f(inputs) * r)` at a few coordinates
    /// equals the central difference.
    fn check_gradients(
        what: &str,
        inputs: &[CTensor],
        f: impl Fn(&[CTensor]) -> candle_core::Result<CTensor>,
    ) {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let ts: Vec<CTensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&ts).unwrap();
        let r = CTensor::randn(0f32, 1f32, out.dims(), &Device::Cpu).unwrap();
        let loss = |ts: &[CTensor]| -> f64 {
            (f(ts).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let grads = (out * &r).unwrap().sum_all().unwrap().backward().unwrap();
        for (k, var) in vars.iter().enumerate() {
            let g = grads.get(var.as_tensor()).unwrap();
            let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let v0 = ts[k].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for i in [0, v0.len() / 3, v0.len() / 2 + 1, v0.len() - 1] {
                let eps = 1e-2f32;
                let bumped = |d: f32| {
                    let mut v = v0.clone();
                    v[i] += d;
                    let mut all = ts.clone();
                    all[k] = CTensor::from_vec(v, ts[k].dims(), &Device::Cpu).unwrap();
                    loss(&all)
                };
                let numeric = (bumped(eps) - bumped(-eps)) / (2.0 * eps as f64);
                let analytic = g[i] as f64;
                assert!(
                    (analytic - numeric).abs() < 1e-2 * (1.0 + numeric.abs()),
                    "{what}: input {k} at {i}: analytic {analytic}, numeric {numeric}"
                );
            }
        }
    }
}
