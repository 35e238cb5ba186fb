//! A depthwise convolution op for tract, put in place of tract's own before it optimises a plan.
//!
//! Profiled on EfficientNet-Lite0 (batch 1, one thread), tract's `DepthWiseConv` took a third of
//! the run: its vector kernel covers one output row at stride 1 (a 7- or 14-wide row is mostly
//! tail), stride 2 runs scalar, and the padded borders go through a generic zone walk. Here each
//! (sample, channel) plane is first copied into a zero-padded scratch buffer, split into
//! `stride_h * stride_w` phase planes (row and column parity at stride 2), so that every tap of
//! every output point reads at a fixed offset from that point: the whole plane is then one flat,
//! branch-free loop over fixed-size blocks of outputs, which the compiler vectorises (AVX2 + FMA
//! where the CPU has it, chosen at run time; NEON on aarch64). The few columns past each output
//! row that this computes are dropped when the rows are copied out.

use std::cell::RefCell;

use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::binary::TypedBinOp;
use tract_onnx::tract_core::ops::cnn::{Conv, KernelFormat};
use tract_onnx::tract_core::ops::nn::DataFormat;
use tract_onnx::tract_core::{as_op, op_as_typed_op, op_out_of_plan};

/// The outputs one block of [`Plane::convolve`] computes at once (its accumulators).
const BLOCK: usize = 32;

/// An NCHW (or CHW: tract drops a batch axis of 1) f32 depthwise convolution with constant
/// weights `[c, kh * kw]` and bias `[c]`.
#[derive(Debug, Clone)]
pub struct PlaneDepthwise {
    /// Whether the input has a batch axis (NCHW) or not (CHW).
    batched: bool,
    channels: usize,
    stride: [usize; 2],
    /// Zero padding before each spatial axis (top, left); what is after follows from `out_hw`.
    pad_before: [usize; 2],
    in_hw: [usize; 2],
    out_hw: [usize; 2],
    layout: Layout,
    weights: Vec<f32>,
    bias: Vec<f32>,
    /// The activation folded in, `(min, max)`: ReLU6 is `(0, 6)`, none is `(-inf, inf)`.
    clip: (f32, f32),
}

impl PartialEq for PlaneDepthwise {
    fn eq(&self, o: &Self) -> bool {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (self.batched, self.channels, self.stride, self.pad_before)
            == (o.batched, o.channels, o.stride, o.pad_before)
            && (self.in_hw, self.out_hw, &self.layout) == (o.in_hw, o.out_hw, &o.layout)
            && bits(&self.weights) == bits(&o.weights)
            && bits(&self.bias) == bits(&o.bias)
            && bits(&[self.clip.0, self.clip.1]) == bits(&[o.clip.0, o.clip.1])
    }
}
impl Eq for PlaneDepthwise {}

/// The scratch geometry of one plane: `stride_h * stride_w` phase planes of `hq x wq` each, and
/// each tap's offset in them from the output point it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    hq: usize,
    wq: usize,
    plane: usize,
    offsets: Vec<usize>,
    /// Length of the scratch buffer: the phase planes and the slack the last block reads into.
    len: usize,
}

impl Layout {
    fn new(
        [kh, kw]: [usize; 2],
        [sh, sw]: [usize; 2],
        [pt, pl]: [usize; 2],
        [h, w]: [usize; 2],
        [oh, ow]: [usize; 2],
    ) -> Layout {
        // Padded extent: enough for every output's window and every input (the padding after
        // may be cut short).
        let hp = ((oh - 1) * sh + kh).max(pt + h);
        let wp = ((ow - 1) * sw + kw).max(pl + w);
        let (hq, wq) = (hp.div_ceil(sh), wp.div_ceil(sw));
        let plane = hq * wq;
        let offsets = (0..kh * kw)
            .map(|t| {
                let (y, x) = (t / kw, t % kw);
                ((y % sh) * sw + x % sw) * plane + (y / sh) * wq + x / sw
            })
            .collect();
        Layout {
            hq,
            wq,
            plane,
            offsets,
            len: sh * sw * plane + kw + BLOCK,
        }
    }
}

impl PlaneDepthwise {
    /// Copies plane `x` (`in_hw`) into its zero-padded phase planes in `buf`, writing every
    /// element an output reads (zeros included: `buf` holds another plane's data); `row` is
    /// scratch.
    fn scatter(&self, x: &[f32], buf: &mut [f32], row: &mut Vec<f32>) {
        let ([sh, sw], [pt, pl], [h, w], l) =
            (self.stride, self.pad_before, self.in_hw, &self.layout);
        // The padded row, zeros around the input, dealt out column by column to its phases.
        row.resize(l.wq * sw, 0.0);
        row[..pl].fill(0.0);
        row[pl + w..].fill(0.0);
        for y in 0..l.hq * sh {
            let base = (y % sh) * sw * l.plane + (y / sh) * l.wq;
            let input = (pt..pt + h)
                .contains(&y)
                .then(|| &x[(y - pt) * w..(y - pt + 1) * w]);
            match input {
                Some(input) => row[pl..pl + w].copy_from_slice(input),
                None => row[pl..pl + w].fill(0.0),
            }
            if sw == 1 {
                buf[base..base + l.wq].copy_from_slice(row);
            } else if sw == 2 {
                let (even, odd) = buf[base..].split_at_mut(l.plane);
                let pairs = even[..l.wq]
                    .iter_mut()
                    .zip(&mut odd[..l.wq])
                    .zip(row.chunks_exact(2));
                for ((e, o), pair) in pairs {
                    (*e, *o) = (pair[0], pair[1]);
                }
            } else {
                for (q, cols) in row.chunks_exact(sw).enumerate() {
                    for (b, v) in cols.iter().enumerate() {
                        buf[base + b * l.plane + q] = *v;
                    }
                }
            }
        }
    }

    /// One (sample, channel) plane: `x` (`in_hw`) to `y` (`out_hw`).
    fn plane(&self, ch: usize, x: &[f32], y: &mut [f32], scratch: &mut Scratch) {
        let (l, taps) = (&self.layout, self.layout.offsets.len());
        scratch.buf.resize(l.len, 0.0);
        self.scatter(x, &mut scratch.buf, &mut scratch.row);
        let [oh, ow] = self.out_hw;
        // Row r of the output is flat[r * wq..][..ow]; the last row's tail is not computed.
        scratch.flat.resize((oh - 1) * l.wq + ow, 0.0);
        let plane = Plane {
            buf: &scratch.buf,
            offsets: &l.offsets,
            weights: &self.weights[ch * taps..(ch + 1) * taps],
            bias: self.bias[ch],
            clip: self.clip,
        };
        plane.convolve(&mut scratch.flat);
        for (r, out) in y.chunks_exact_mut(ow).enumerate() {
            out.copy_from_slice(&scratch.flat[r * l.wq..r * l.wq + ow]);
        }
    }
}

/// A thread's scratch: the padded phase planes, one padded row, the flat output of one plane.
#[derive(Default)]
struct Scratch {
    buf: Vec<f32>,
    row: Vec<f32>,
    flat: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// One plane's convolution: `out[i] = clip(bias + sum over taps t of weights[t] * buf[offsets[t] + i])`.
struct Plane<'a> {
    buf: &'a [f32],
    offsets: &'a [usize],
    weights: &'a [f32],
    bias: f32,
    clip: (f32, f32),
}

impl Plane<'_> {
    /// Computes `out` (`buf` reaches [`BLOCK`] past the last output's taps), vectorised for the
    /// CPU it runs on.
    fn convolve(&self, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { self.avx2_fma(out) };
        }
        // aarch64 always has NEON and a fused multiply-add.
        self.blocks::<{ cfg!(target_arch = "aarch64") }>(out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_fma(&self, out: &mut [f32]) {
        self.blocks::<true>(out)
    }

    /// The loop itself, inlined into each target-feature wrapper so it is vectorised for it:
    /// [`BLOCK`] outputs at a time. With `FMA` each tap is one fused multiply-add (only where the
    /// CPU has one: else `mul_add` would be a library call). Measured on Lite0 with AVX2, blocks
    /// of 32 beat 64, and AVX-512 (64 or 128) was slower still.
    #[inline(always)]
    fn blocks<const FMA: bool>(&self, out: &mut [f32]) {
        const B: usize = BLOCK;
        let (lo, hi) = self.clip;
        for (b, block) in out.chunks_mut(B).enumerate() {
            let start = b * B;
            let mut acc = [self.bias; B];
            for (&offset, &w) in self.offsets.iter().zip(self.weights) {
                let src: &[f32; B] = self.buf[offset + start..offset + start + B]
                    .try_into()
                    .expect("B long");
                for j in 0..B {
                    acc[j] = if FMA {
                        src[j].mul_add(w, acc[j])
                    } else {
                        acc[j] + src[j] * w
                    };
                }
            }
            for (y, a) in block.iter_mut().zip(acc) {
                *y = a.max(lo).min(hi);
            }
        }
    }
}

impl Op for PlaneDepthwise {
    fn name(&self) -> StaticName {
        "KestrelDepthwise".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        Ok(vec![format!(
            "{} channels, {} taps, stride {:?}, {:?} -> {:?}",
            self.channels,
            self.layout.offsets.len(),
            self.stride,
            self.in_hw,
            self.out_hw
        )])
    }

    fn validation(&self) -> Validation {
        Validation::Rounding
    }

    op_as_typed_op!();
}

impl EvalOp for PlaneDepthwise {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let input = &inputs[0];
        let x = input.try_as_plain_ram()?.as_slice::<f32>()?;
        let (c, [h, w], [oh, ow]) = (self.channels, self.in_hw, self.out_hw);
        let mut shape: TVec<usize> = tvec![c, oh, ow];
        if self.batched {
            shape.insert(0, input.shape()[0]);
        }
        // SAFETY: every element is written below (one plane after another).
        let mut output = unsafe { Tensor::uninitialized::<f32>(&shape)? };
        let mut view = output.try_as_plain_ram_mut()?;
        let y = view.as_slice_mut::<f32>()?;
        SCRATCH.with_borrow_mut(|scratch| {
            for (i, (xp, yp)) in x
                .chunks_exact(h * w)
                .zip(y.chunks_exact_mut(oh * ow))
                .enumerate()
            {
                self.plane(i % c, xp, yp, scratch);
            }
        });
        Ok(tvec!(output.into_tvalue()))
    }
}

impl TypedOp for PlaneDepthwise {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let [oh, ow] = self.out_hw;
        let mut shape: TVec<TDim> = tvec![self.channels.into(), oh.into(), ow.into()];
        if self.batched {
            shape.insert(0, inputs[0].shape[0].clone());
        }
        Ok(tvec!(f32::fact(shape)))
    }

    as_op!();
}

/// Replaces every f32 NCHW or CHW depthwise `Conv` of `model` (concrete shape, constant weights and bias,
/// no dilation) with a [`PlaneDepthwise`]; returns how many. Run on a decluttered model, before
/// `into_optimized`.
pub fn replace(model: &mut TypedModel) -> TractResult<usize> {
    let mut replaced = 0;
    for id in model.eval_order()? {
        let Some(mut op) = plane_depthwise(model, id)? else {
            continue;
        };
        // A clip (`Max` then `Min` with constants, as tract declutters ONNX's Clip and Relu)
        // right after it is done on the outputs while they are in registers.
        let mut last = OutletId::new(id, 0);
        for _ in 0..2 {
            let Some((next, clip)) = clip_after(model, last, op.clip)? else {
                break;
            };
            (last, op.clip) = (next, clip);
        }
        let node = &model.nodes[id];
        let mut patch = TypedModelPatch::new("kestrel-depthwise");
        let x = patch.tap_model(model, node.inputs[0])?;
        let y = patch.wire_node(&node.name, op, &[x])?[0];
        patch.shunt_outside(model, last, y)?;
        patch.apply(model)?;
        replaced += 1;
    }
    Ok(replaced)
}

/// The node after `from`, if it is its only reader and a `Max` or `Min` of it with a one-value
/// f32 constant of the same shape out: its output and `clip` narrowed by it.
fn clip_after(
    model: &TypedModel,
    from: OutletId,
    (lo, hi): (f32, f32),
) -> TractResult<Option<(OutletId, (f32, f32))>> {
    let Some(node) = model.single_succ(from.node)? else {
        return Ok(None);
    };
    let Some(op) = node.op_as::<TypedBinOp>() else {
        return Ok(None);
    };
    let out = OutletId::new(node.id, 0);
    if model.outputs.contains(&from)
        || node.inputs.len() != 2
        || model.outlet_fact(out)?.shape != model.outlet_fact(from)?.shape
    {
        return Ok(None);
    }
    let Some(k) = node
        .inputs
        .iter()
        .find(|i| **i != from)
        .and_then(|i| model.outlet_fact(*i).ok()?.konst.clone())
    else {
        return Ok(None);
    };
    if k.len() != 1 || k.datum_type() != f32::datum_type() {
        return Ok(None);
    }
    let v = k.try_as_plain_ram()?.as_slice::<f32>()?[0];
    Ok(match op.0.name() {
        "Max" => Some((out, (lo.max(v), hi.max(v)))),
        "Min" => Some((out, (lo.min(v), hi.min(v)))),
        _ => None,
    })
}

/// The [`PlaneDepthwise`] node `id` is, if it is a convolution this op covers.
fn plane_depthwise(model: &TypedModel, id: usize) -> TractResult<Option<PlaneDepthwise>> {
    let node = &model.nodes[id];
    let Some(conv) = node.op_as::<Conv>() else {
        return Ok(None);
    };
    let spec = &conv.pool_spec;
    let x = model.outlet_fact(node.inputs[0])?;
    let (Some(shape), Some(kernel), Some(bias)) = (
        x.shape.as_concrete(),
        model.outlet_fact(node.inputs[1])?.konst.clone(),
        node.inputs
            .get(2)
            .and_then(|b| model.outlet_fact(*b).ok()?.konst.clone()),
    ) else {
        return Ok(None);
    };
    let c = spec.input_channels;
    let batched = spec.data_format == DataFormat::NCHW;
    let rank = if batched { 4 } else { 3 };
    let dilated = spec
        .dilations
        .as_ref()
        .is_some_and(|d| d.iter().any(|&d| d != 1));
    if x.datum_type != f32::datum_type()
        || conv.q_params.is_some()
        || !matches!(spec.data_format, DataFormat::NCHW | DataFormat::CHW)
        || conv.kernel_fmt != KernelFormat::OIHW
        || shape.len() != rank
        || conv.group != c
        || spec.output_channels != c
        || shape[rank - 3] != c
        || spec.kernel_shape.len() != 2
        || dilated
        || kernel.datum_type() != f32::datum_type()
        || kernel.len() != c * spec.kernel_shape.iter().product::<usize>()
        || bias.datum_type() != f32::datum_type()
        || !(bias.len() == c || bias.len() == 1)
    {
        return Ok(None);
    }
    let in_hw = [shape[rank - 2], shape[rank - 1]];
    let padding = spec.computed_padding(&in_hw);
    let strides = spec.strides();
    let bias = bias.try_as_plain_ram()?.as_slice::<f32>()?;
    let kernel_hw = [spec.kernel_shape[0], spec.kernel_shape[1]];
    let stride = [strides[0], strides[1]];
    let pad_before = [padding[0].pad_before, padding[1].pad_before];
    let out_hw = [padding[0].convoluted, padding[1].convoluted];
    Ok(Some(PlaneDepthwise {
        batched,
        channels: c,
        stride,
        pad_before,
        in_hw,
        out_hw,
        layout: Layout::new(kernel_hw, stride, pad_before, in_hw, out_hw),
        weights: kernel.try_as_plain_ram()?.as_slice::<f32>()?.to_vec(),
        clip: (f32::NEG_INFINITY, f32::INFINITY),
        bias: if bias.len() == c {
            bias.to_vec()
        } else {
            vec![bias[0]; c]
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::cnn::{PaddingSpec, PoolSpec};
    use tract_onnx::tract_core::ops::math;

    /// The same convolution, straight from the definition.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f32],
        k: &[f32],
        bias: &[f32],
        [n, c, h, w]: [usize; 4],
        [kh, kw]: [usize; 2],
        [sh, sw]: [usize; 2],
        [pt, pl]: [usize; 2],
        [oh, ow]: [usize; 2],
    ) -> Vec<f32> {
        let mut y = vec![0.0; n * c * oh * ow];
        for (p, yp) in y.chunks_exact_mut(oh * ow).enumerate() {
            let ch = p % c;
            for i in 0..oh {
                for j in 0..ow {
                    let mut s = bias[ch];
                    for a in 0..kh {
                        for b in 0..kw {
                            let (r, q) = (
                                (i * sh + a) as isize - pt as isize,
                                (j * sw + b) as isize - pl as isize,
                            );
                            if r >= 0 && q >= 0 && (r as usize) < h && (q as usize) < w {
                                s += k[ch * kh * kw + a * kw + b]
                                    * x[p * h * w + r as usize * w + q as usize];
                            }
                        }
                    }
                    yp[i * ow + j] = s;
                }
            }
        }
        y
    }

    #[test]
    fn replaces_tract_depthwise_and_matches_the_definition() {
        use PaddingSpec::{Explicit, SameUpper, Valid};
        // (n, c, h, w, k, stride, padding): Lite0's shapes, odd sizes, uneven and no padding,
        // a stride of 3;
        // n = 0: no batch axis (CHW), as tract leaves a batch of 1 after decluttering.
        #[rustfmt::skip]
        let cases = [
            (1, 8, 112, 112, 3, 1, Explicit(tvec!(1, 1), tvec!(1, 1))),
            (2, 5, 15, 9, 3, 2, Explicit(tvec!(1, 1), tvec!(1, 1))),
            (1, 4, 14, 14, 5, 2, Explicit(tvec!(1, 1), tvec!(2, 2))),
            (1, 3, 7, 7, 5, 1, SameUpper),
            (1, 3, 10, 11, 3, 2, SameUpper),
            (1, 2, 6, 13, 3, 1, Valid),
            (1, 2, 9, 8, 3, 2, Explicit(tvec!(0, 2), tvec!(1, 0))),
            (0, 6, 28, 28, 5, 2, Explicit(tvec!(1, 1), tvec!(2, 2))),
            (0, 96, 112, 112, 3, 2, Explicit(tvec!(0, 0), tvec!(1, 1))),
            (1, 2, 13, 14, 5, 3, Explicit(tvec!(2, 1), tvec!(2, 2))),
        ];
        for (case, (n, c, h, w, k, s, pad)) in cases.into_iter().enumerate() {
            // Every other case ends in a ReLU6 (tract's Max then Min), which the op takes in.
            let relu6 = case % 2 == 0;
            let (fmt, shape) = match n {
                0 => (DataFormat::CHW, vec![c, h, w]),
                _ => (DataFormat::NCHW, vec![n, c, h, w]),
            };
            let n = n.max(1);
            let x: Vec<f32> = (0..n * c * h * w)
                .map(|i| (i as f32 * 0.137).sin())
                .collect();
            let kernel: Vec<f32> = (0..c * k * k)
                .map(|i| (i as f32 * 0.091).cos() * 0.3)
                .collect();
            let bias: Vec<f32> = (0..c).map(|i| i as f32 * 0.05 - 0.1).collect();
            let mut model = TypedModel::default();
            let xv = model.add_source("x", f32::fact(&shape)).unwrap();
            let kv = model
                .add_const("k", Tensor::from_shape(&[c, 1, k, k], &kernel).unwrap())
                .unwrap();
            let bv = model
                .add_const("b", Tensor::from_shape(&[c], &bias).unwrap())
                .unwrap();
            let pool_spec = PoolSpec {
                data_format: fmt,
                kernel_shape: tvec!(k, k),
                padding: pad.clone(),
                dilations: None,
                strides: Some(tvec!(s, s)),
                input_channels: c,
                output_channels: c,
            };
            let geo = pool_spec.computed_padding(&[h, w]);
            let conv = Conv {
                pool_spec,
                kernel_fmt: KernelFormat::OIHW,
                group: c,
                q_params: None,
            };
            let mut out = model.wire_node("dw", conv, &[xv, kv, bv]).unwrap();
            if relu6 {
                let ones = vec![1; shape.len()];
                for (name, v, op) in [("lo", 0f32, math::max()), ("hi", 6.0, math::min())] {
                    let bound = Tensor::from_shape(&ones, &[v]).unwrap();
                    let bound = model.add_const(name, bound).unwrap();
                    out = model
                        .wire_node(format!("{name}.op"), op, &[out[0], bound])
                        .unwrap();
                }
            }
            model.select_output_outlets(&out).unwrap();
            let mut model = model.into_decluttered().unwrap();
            assert_eq!(replace(&mut model).unwrap(), 1, "{pad:?}");
            let model = model.into_optimized().unwrap();
            // Source, the convolution, nothing else.
            let model_nodes = model.nodes.len() - 1;
            assert!(
                model
                    .nodes
                    .iter()
                    .any(|nd| nd.op_as::<PlaneDepthwise>().is_some())
            );
            let input = Tensor::from_shape(&shape, &x).unwrap();
            let got = model
                .into_runnable()
                .unwrap()
                .run(tvec![input.into_tvalue()])
                .unwrap();
            let got = got[0].to_plain_array_view::<f32>().unwrap();
            let (oh, ow) = (geo[0].convoluted, geo[1].convoluted);
            assert_eq!(got.len(), n * c * oh * ow);
            assert_eq!(got.shape()[shape.len() - 2..], [oh, ow]);
            let want = reference(
                &x,
                &kernel,
                &bias,
                [n, c, h, w],
                [k, k],
                [s, s],
                [geo[0].pad_before, geo[1].pad_before],
                [oh, ow],
            );
            assert_eq!(model_nodes, 1, "the clip is taken in: {case}");
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                let e = if relu6 { e.clamp(0.0, 6.0) } else { *e };
                assert!((g - e).abs() < 1e-5, "{pad:?} k{k} s{s} at {i}: {g} vs {e}");
            }
        }
    }
}
