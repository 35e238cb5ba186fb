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
/// (or `[c, n, oh, ow]`).
pub fn depthwise(x: &Tensor, weight: &Tensor, op: Depthwise) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&weight.contiguous()?, op)
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
