//! The trainable convolutions' own candle ops: how 4-d activations are laid out ([`PlaneOrder`]),
//! and the bias + ReLU6 that ends every convolution as one op with its own backward pass.
//!
//! Written with candle's generic ops, `clamp(x + b, 0, 6)` is a broadcast add and two broadcast
//! extrema forward, and masks, products and a strided sum over three dimensions (the bias)
//! backward: in a profile of fine-tuning, more time than the matrix products.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// The order of a 4-d activation's `h x w` planes: `[n, c, h, w]` (ONNX's, and every engine's),
/// or `[c, n, h, w]`, where a 1x1 convolution over the whole batch is one matrix product
/// `[cout, cin] x [cin, n*h*w]` and its weight gradient another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlaneOrder {
    Nchw,
    Cnhw,
}

impl PlaneOrder {
    /// The channel of plane `p` of an activation whose second dimension is `d1`.
    pub fn channel(self, p: usize, d1: usize) -> usize {
        match self {
            PlaneOrder::Nchw => p % d1,
            PlaneOrder::Cnhw => p / d1,
        }
    }

    /// The planes of channel `ch`, as plane indices.
    pub fn planes_of(self, ch: usize, [d0, d1]: [usize; 2]) -> impl Iterator<Item = usize> {
        let (start, step, count) = match self {
            PlaneOrder::Nchw => (ch, d1, d0),
            PlaneOrder::Cnhw => (ch * d1, 1, d1),
        };
        (0..count).map(move |i| start + i * step)
    }
}

/// A contiguous operand's values.
pub(crate) fn slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: non-contiguous operand")))?;
    Ok(&s.as_slice::<f32>()?[a..b])
}

/// `x + bias[channel]`, clamped to `[0, 6]` when `relu6`; `bias` has one value per channel.
#[derive(Debug, Clone, Copy)]
pub struct BiasAct {
    pub relu6: bool,
    pub planes: PlaneOrder,
}

/// `x [d0, d1, h, w]` (laid out as `op.planes` says) plus the bias `[c]` (any shape of `c` values).
/// On the CPU the op below; on another device (a GPU) [`bias_act_composed`].
pub fn bias_act(x: &Tensor, bias: &Tensor, op: BiasAct) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return bias_act_composed(x, bias, op);
    }
    x.contiguous()?.apply_op2(&bias.contiguous()?, op)
}

/// The same as [`BiasAct`] with candle's generic ops (a broadcast add, then a clamp), which run
/// and differentiate on any device.
pub fn bias_act_composed(x: &Tensor, bias: &Tensor, op: BiasAct) -> Result<Tensor> {
    let (d0, d1, _, _) = x.dims4()?;
    let b = match op.planes {
        PlaneOrder::Nchw => bias.reshape((1, d1, 1, 1))?,
        PlaneOrder::Cnhw => bias.reshape((d0, 1, 1, 1))?,
    };
    let y = x.broadcast_add(&b)?;
    if op.relu6 { y.clamp(0f32, 6f32) } else { Ok(y) }
}

impl CustomOp2 for BiasAct {
    fn name(&self) -> &'static str {
        "bias-relu6"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, d1, h, w) = l1.shape().dims4()?;
        let (x, b) = (slice(s1, l1, "bias")?, slice(s2, l2, "bias")?);
        let mut y = x.to_vec();
        y.par_chunks_mut(h * w).enumerate().for_each(|(p, yp)| {
            let bc = b[self.planes.channel(p, d1)];
            if self.relu6 {
                yp.iter_mut().for_each(|v| *v = (*v + bc).clamp(0.0, 6.0));
            } else {
                yp.iter_mut().for_each(|v| *v += bc);
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (d0, d1, h, w) = x.dims4()?;
        let mut gx = grad.flatten_all()?.to_vec1::<f32>()?;
        if self.relu6 {
            // The gradient passes where the output is strictly inside (0, 6), as candle's clamp.
            let ys = res.flatten_all()?.to_vec1::<f32>()?;
            gx.par_chunks_mut(h * w)
                .zip(ys.par_chunks(h * w))
                .for_each(|(g, y)| {
                    g.iter_mut()
                        .zip(y)
                        .for_each(|(g, &y)| *g = if y > 0.0 && y < 6.0 { *g } else { 0.0 })
                });
        }
        let hw = h * w;
        let gb: Vec<f32> = (0..bias.elem_count())
            .into_par_iter()
            .map(|ch| {
                self.planes
                    .planes_of(ch, [d0, d1])
                    .map(|p| gx[p * hw..(p + 1) * hw].iter().sum::<f32>())
                    .sum()
            })
            .collect();
        Ok((
            Some(Tensor::from_vec(gx, x.shape(), x.device())?),
            Some(Tensor::from_vec(gb, bias.shape(), bias.device())?),
        ))
    }
}
