//! Depthwise convolution as a candle custom op with its own backward pass.
//!
//! candle's grouped `conv2d` runs one convolution per channel, forward and backward; written as
//! shifted views it keeps `2 k^2` full-size intermediates in the graph. Here one pass over each
//! (sample, channel) plane computes the output, and the backward pass computes both gradients
//! the same way, planes and channels in parallel (rayon).

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::planes::{PlaneOrder, slice};

/// A depthwise convolution: `weight [c, 1, k, k]`, zero padding `top`/`left` (bottom and right
/// follow from `out_hw`), on activations laid out as `planes` says.
#[derive(Debug, Clone, Copy)]
pub struct Depthwise {
    pub kernel: usize,
    pub stride: usize,
    pub top: usize,
    pub left: usize,
    pub out_hw: [usize; 2],
    pub planes: PlaneOrder,
}

/// `x [n, c, h, w]` (or `[c, n, h, w]`) convolved with `weight [c, 1, k, k]`: `[n, c, oh, ow]`
/// (or `[c, n, oh, ow]`). On the CPU the op below; on another device (a GPU) the same
/// computation composed of candle's ops ([`depthwise_composed`]), which candle differentiates.
pub fn depthwise(x: &Tensor, weight: &Tensor, op: Depthwise) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return depthwise_composed(x, weight, op);
    }
    x.contiguous()?.apply_op2(&weight.contiguous()?, op)
}

/// The depthwise convolution as a sum over the `k x k` taps of shifted views of the zero-padded
/// input times the tap's weight per channel: candle's generic ops, so it runs (and has a backward
/// pass) on any device. With stride `s` the padded input is first split into its `s x s` phases
/// (rows `a, a+s, ...`, columns `b, b+s, ...`), so that every tap reads one phase at stride 1.
/// Keeps `k^2` full-size intermediates: on the CPU the custom op is faster, on a GPU these are a
/// few elementwise kernels each.
pub fn depthwise_composed(x: &Tensor, weight: &Tensor, op: Depthwise) -> Result<Tensor> {
    let (d0, d1, h, w) = x.dims4()?;
    let (k, s) = (op.kernel, op.stride);
    let [oh, ow] = op.out_hw;
    // Tap (kh, kw) reads rows kh + i*s (i < oh) = row kh/s + i of phase kh % s.
    let (rows, cols) = (oh + (k - 1) / s, ow + (k - 1) / s);
    let x = fit_rows(x, 2, op.top, h, rows * s)?;
    let x = fit_rows(&x, 3, op.left, w, cols * s)?;
    let split = x.reshape((d0, d1, rows, s, cols, s))?;
    let phase = |a: usize, b: usize| -> Result<Tensor> {
        split
            .narrow(3, a, 1)?
            .narrow(5, b, 1)?
            .reshape((d0, d1, rows, cols))
    };
    let phases = (0..s)
        .map(|a| (0..s).map(|b| phase(a, b)).collect::<Result<Vec<_>>>())
        .collect::<Result<Vec<_>>>()?;
    let channel_shape = match op.planes {
        PlaneOrder::Nchw => (1, d1, 1, 1),
        PlaneOrder::Cnhw => (d0, 1, 1, 1),
    };
    let mut y: Option<Tensor> = None;
    for kh in 0..k {
        for kw in 0..k {
            let tap = phases[kh % s][kw % s]
                .narrow(2, kh / s, oh)?
                .narrow(3, kw / s, ow)?;
            let wt = weight
                .narrow(2, kh, 1)?
                .narrow(3, kw, 1)?
                .reshape(channel_shape)?;
            let term = tap.broadcast_mul(&wt)?;
            y = Some(match y {
                Some(y) => (y + term)?,
                None => term,
            });
        }
    }
    y.ok_or_else(|| candle_core::Error::Msg("depthwise: a 0x0 kernel".into()))
}

/// Dimension `dim` (of length `len`) padded with `before` zeros in front and cut or padded
/// with zeros behind to `total`.
fn fit_rows(x: &Tensor, dim: usize, before: usize, len: usize, total: usize) -> Result<Tensor> {
    if before + len >= total {
        x.narrow(dim, 0, total - before)?
            .pad_with_zeros(dim, before, 0)
    } else {
        x.pad_with_zeros(dim, before, total - before - len)
    }
}

impl Depthwise {
    /// Calls `f(input index, output index, tap index)` for every tap that reads inside a
    /// `h x w` plane.
    fn taps(&self, [h, w]: [usize; 2], mut f: impl FnMut(usize, usize, usize)) {
        let (k, s) = (self.kernel, self.stride);
        let [oh, ow] = self.out_hw;
        for kh in 0..k {
            for i in 0..oh {
                let r = (i * s + kh) as isize - self.top as isize;
                if r < 0 || r >= h as isize {
                    continue;
                }
                for kw in 0..k {
                    for j in 0..ow {
                        let q = (j * s + kw) as isize - self.left as isize;
                        if q >= 0 && q < w as isize {
                            f(r as usize * w + q as usize, i * ow + j, kh * k + kw);
                        }
                    }
                }
            }
        }
    }
}

impl CustomOp2 for Depthwise {
    fn name(&self) -> &'static str {
        "depthwise-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (d0, d1, h, w) = l1.shape().dims4()?;
        let (x, wt) = (slice(s1, l1, "depthwise")?, slice(s2, l2, "depthwise")?);
        let [oh, ow] = self.out_hw;
        let kk = self.kernel * self.kernel;
        let mut y = vec![0f32; d0 * d1 * oh * ow];
        y.par_chunks_mut(oh * ow).enumerate().for_each(|(p, yp)| {
            let xp = &x[p * h * w..(p + 1) * h * w];
            let ch = self.planes.channel(p, d1);
            let wc = &wt[ch * kk..(ch + 1) * kk];
            self.taps([h, w], |xi, yi, t| yp[yi] += xp[xi] * wc[t]);
        });
        Ok((CpuStorage::F32(y), Shape::from((d0, d1, oh, ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (d0, d1, h, w) = x.dims4()?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let ws = weight.flatten_all()?.to_vec1::<f32>()?;
        let gs = grad.flatten_all()?.to_vec1::<f32>()?;
        let [oh, ow] = self.out_hw;
        let kk = self.kernel * self.kernel;
        let mut gx = vec![0f32; xs.len()];
        gx.par_chunks_mut(h * w).enumerate().for_each(|(p, gxp)| {
            let gp = &gs[p * oh * ow..(p + 1) * oh * ow];
            let ch = self.planes.channel(p, d1);
            let wc = &ws[ch * kk..(ch + 1) * kk];
            self.taps([h, w], |xi, yi, t| gxp[xi] += gp[yi] * wc[t]);
        });
        let mut gw = vec![0f32; ws.len()];
        gw.par_chunks_mut(kk).enumerate().for_each(|(ch, gwc)| {
            for p in self.planes.planes_of(ch, [d0, d1]) {
                let xp = &xs[p * h * w..(p + 1) * h * w];
                let gp = &gs[p * oh * ow..(p + 1) * oh * ow];
                self.taps([h, w], |xi, yi, t| gwc[t] += gp[yi] * xp[xi]);
            }
        });
        Ok((
            Some(Tensor::from_vec(gx, x.shape(), x.device())?),
            Some(Tensor::from_vec(gw, weight.shape(), weight.device())?),
        ))
    }
}
