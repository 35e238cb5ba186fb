//! Small-kernel convolutions for tract, put in place of tract's own before it optimises a plan:
//! depthwise ones (with the 1x1 expansion before them), full ones over few input channels (a
//! backbone's stem: 3 channels, 3x3) and 1x1 ones over few channels. This file is the op and its
//! loop; `graph.rs` finds what it replaces in a tract graph; `tests.rs` checks it against the
//! convolution's definition.
//!
//! Profiled on EfficientNet-Lite0 (batch 1, one thread), tract's `DepthWiseConv` took a third of
//! the run: its vector kernel covers one output row at stride 1 (a 7- or 14-wide row is mostly
//! tail), stride 2 runs scalar, and the padded borders go through a generic zone walk. Its stem
//! (im2col of 27 values per output, then a matrix product with k = 27) took another tenth. Here
//! each input plane is first copied into a zero-padded scratch buffer, split into
//! `stride_h * stride_w` phase planes (row and column parity at stride 2), so that every tap of
//! every output point reads at a fixed offset from that point: a whole output plane is then one
//! flat, branch-free loop over fixed-size blocks of outputs, which the compiler vectorises
//! (AVX2 and FMA where the CPU has them, chosen at run time; NEON on aarch64). A full
//! convolution computes four output channels per block, so each input load serves four fused
//! multiply-adds. Rows at least a block wide are computed block by block in place (the last
//! block of a row overlapping the one before); narrower ones as one flat run over the padded
//! plane, whose rows are then copied out without the few columns past each row.
//!
//! A depthwise convolution also takes in the 1x1 "expansion" before it (an inverted-residual
//! block's few channels to many, and its clip): tract ran it as a matrix product at 14-23
//! GMAC/s (its kernel choice for k = 16 and 24), wrote the expanded tensor (4.8 MB at Lite0's
//! second stage) and this op read it back. Here four expanded planes at a time are computed
//! with the full convolution's block (about 37 GMAC/s) into a thread's scratch and convolved
//! from there: Lite0 per image 14.7 -> 13.5 ms, and with two workers on two cores, where the
//! memory traffic was shared, camera extraction 0.77-0.82x -> 0.92-1.02x the peer. A 1x1
//! convolution over few channels on its own reads its input in place, without tract's packing
//! (Lite0's 32 -> 16 on 112x112: 0.55-0.65 -> 0.23 ms).
//!
//! Measured and left out (Lite0, this VM's Sapphire Rapids): AVX-512 kernels, for the depthwise
//! tile (4 chains of 2 registers) and the full one (32 x 4), were slower than AVX2 or no faster:
//! the unaligned loads and the memory traffic bound them, not the arithmetic.

use std::cell::RefCell;

use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::{as_op, op_as_typed_op, op_out_of_plan};

mod graph;
#[cfg(test)]
mod tests;

pub use graph::replace;

/// The most outputs of one plane a block computes at once (what the scratch reaches past its taps).
const MAX_POSITIONS: usize = 32;

/// The most taps (input channels times kernel size) a full convolution may have to be taken
/// over: more, and tract's im2col and matrix product are the better tool.
const MAX_DENSE_TAPS: usize = 32;

/// How an op's outputs are computed: a block of outputs of one plane, for some output channels
/// at once (accumulators: positions x channels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tile {
    /// One output channel per group (depthwise), 32 outputs a block. Measured on Lite0 with
    /// AVX2, 32 beat 64, and AVX-512 (64 or 128) was slower still.
    Depthwise,
    /// Four output channels, 16 outputs a block: 8 AVX2 registers of accumulators, and each
    /// input load serves four channels.
    Dense,
}

impl Tile {
    fn positions(self) -> usize {
        match self {
            Tile::Depthwise => 32,
            Tile::Dense => 16,
        }
    }

    fn channels(self) -> usize {
        match self {
            Tile::Depthwise => 1,
            Tile::Dense => 4,
        }
    }
}

/// An NCHW (or CHW: tract drops a batch axis of 1) f32 convolution with constant weights and
/// bias, depthwise or over few input channels.
#[derive(Debug, Clone)]
pub struct PlaneConv {
    /// Whether the input has a batch axis (NCHW) or not (CHW).
    batched: bool,
    in_channels: usize,
    out_channels: usize,
    groups: usize,
    stride: [usize; 2],
    /// Zero padding before each spatial axis (top, left); what is after follows from `out_hw`.
    pad_before: [usize; 2],
    in_hw: [usize; 2],
    out_hw: [usize; 2],
    layout: Geometry,
    tile: Tile,
    /// For each tile of output channels (`tile.channels()` of a group, zeros past its last
    /// channel), `[taps][channels]`.
    weights: Vec<f32>,
    /// Per output channel, laid out like `weights`' tiles.
    bias: Vec<f32>,
    /// The activation folded in, `(min, max)`: ReLU6 is `(0, 6)`, none is `(-inf, inf)`.
    clip: (f32, f32),
    /// A pointwise convolution taken in before a depthwise one: the op's input is then the
    /// expansion's, and each expanded plane is computed just before it is convolved.
    expand: Option<Expand>,
}

/// The 1x1 convolution in front of an inverted-residual block's depthwise one ("expansion",
/// a few channels to many, then a clip). Tract would write its whole output to memory (4.8 MB
/// per image at Lite0's second stage) and read it back; here four expanded planes at a time are
/// computed into a thread's scratch (`Tile::Dense` over the input planes as taps) and convolved
/// from there.
#[derive(Debug, Clone)]
struct Expand {
    in_channels: usize,
    /// Input plane `k` is tap `k`: its offset in the input (`k * h * w`).
    offsets: Vec<usize>,
    /// Per tile of four expanded channels, `[in_channels][4]`, as [`PlaneConv::weights`].
    weights: Vec<f32>,
    bias: Vec<f32>,
    clip: (f32, f32),
}

/// The bits of `v`: f32 slices compared exactly (NaN included) for `Eq`.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

impl PartialEq for Expand {
    fn eq(&self, o: &Self) -> bool {
        (self.in_channels, &self.offsets) == (o.in_channels, &o.offsets)
            && bits(&self.weights) == bits(&o.weights)
            && bits(&self.bias) == bits(&o.bias)
            && bits(&[self.clip.0, self.clip.1]) == bits(&[o.clip.0, o.clip.1])
    }
}

impl PartialEq for PlaneConv {
    fn eq(&self, o: &Self) -> bool {
        (
            self.batched,
            self.in_channels,
            self.out_channels,
            self.groups,
        ) == (o.batched, o.in_channels, o.out_channels, o.groups)
            && (self.stride, self.pad_before, self.in_hw, self.out_hw)
                == (o.stride, o.pad_before, o.in_hw, o.out_hw)
            && (&self.layout, self.tile) == (&o.layout, o.tile)
            && bits(&self.weights) == bits(&o.weights)
            && bits(&self.bias) == bits(&o.bias)
            && bits(&[self.clip.0, self.clip.1]) == bits(&[o.clip.0, o.clip.1])
            && self.expand == o.expand
    }
}
impl Eq for PlaneConv {}

/// The scratch geometry of one group: for each of its input planes, `stride_h * stride_w` phase
/// planes of `hq x wq` each (a region), and each tap's offset in them from the output point it
/// serves.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Geometry {
    hq: usize,
    wq: usize,
    plane: usize,
    region: usize,
    /// Per tap (input plane, then kernel row, then column): its offset.
    offsets: Vec<usize>,
    /// Length of the scratch buffer: the regions and the slack the last block reads into.
    len: usize,
    /// Stride, padding before and input size: with the above, where the input goes.
    interior: [[usize; 2]; 3],
}

impl Geometry {
    fn new(
        planes: usize,
        [kh, kw]: [usize; 2],
        [sh, sw]: [usize; 2],
        [pt, pl]: [usize; 2],
        [h, w]: [usize; 2],
        [oh, ow]: [usize; 2],
    ) -> Geometry {
        // Padded extent: enough for every output's window and every input (the padding after
        // may be cut short).
        let hp = ((oh - 1) * sh + kh).max(pt + h);
        let wp = ((ow - 1) * sw + kw).max(pl + w);
        let (hq, wq) = (hp.div_ceil(sh), wp.div_ceil(sw));
        let plane = hq * wq;
        let region = sh * sw * plane;
        let offsets = (0..planes * kh * kw)
            .map(|t| {
                let (p, y, x) = (t / (kh * kw), t / kw % kh, t % kw);
                p * region + ((y % sh) * sw + x % sw) * plane + (y / sh) * wq + x / sw
            })
            .collect();
        Geometry {
            hq,
            wq,
            plane,
            region,
            offsets,
            len: planes * region + kw + MAX_POSITIONS,
            interior: [[sh, sw], [pt, pl], [h, w]],
        }
    }
}

impl PlaneConv {
    /// Copies plane `x` (`in_hw`) into its phase planes in `buf` (a region), where the input
    /// goes: the padding around it is zeros already ([`Scratch::prepare`]). `row` is scratch.
    fn scatter(&self, x: &[f32], buf: &mut [f32], row: &mut Vec<f32>) {
        let ([sh, sw], [pt, pl], [_, w], l) =
            (self.stride, self.pad_before, self.in_hw, &self.layout);
        // Past stride 1, a padded row (zeros around the input) is dealt out column by column to
        // its phases.
        if sw > 1 {
            row.resize(l.wq * sw, 0.0);
            row[..pl].fill(0.0);
            row[pl + w..].fill(0.0);
        }
        for (i, input) in x.chunks_exact(w).enumerate() {
            let y = i + pt;
            // (A division per row showed in profiles: strides 1 and 2 go without.)
            let (phase, q) = match sh {
                1 => (0, y),
                2 => (y & 1, y >> 1),
                _ => (y % sh, y / sh),
            };
            let base = phase * sw * l.plane + q * l.wq;
            if sw == 1 {
                buf[base + pl..base + pl + w].copy_from_slice(input);
                continue;
            }
            row[pl..pl + w].copy_from_slice(input);
            if sw == 2 {
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

    /// One group of one sample: its input planes `x` to its output planes `y`.
    fn group(&self, g: usize, x: &[f32], y: &mut [f32], scratch: &mut Scratch) {
        let (l, [h, w], [oh, ow]) = (&self.layout, self.in_hw, self.out_hw);
        let (positions, channels) = (self.tile.positions(), self.tile.channels());
        // Unpadded at stride 1 (a 1x1 convolution), the scratch would be a copy of the input:
        // rows at least a block wide read the input itself (no block reaches past a plane).
        let direct = ow >= positions && self.stride == [1, 1] && l.region == h * w;
        if !direct {
            scratch.prepare(l);
            for (i, plane) in x.chunks_exact(h * w).enumerate() {
                self.scatter(plane, &mut scratch.buf[i * l.region..], &mut scratch.row);
            }
        }
        // Row r of an output plane is flat[r * wq..][..ow]; whole blocks are computed (the
        // scalar tail of a last partial block cost more than computing it whole).
        let n = ((oh - 1) * l.wq + ow).next_multiple_of(positions);
        let taps = l.offsets.len();
        let tiles = (self.out_channels / self.groups).div_ceil(channels);
        for (i, outs) in y.chunks_mut(channels * oh * ow).enumerate() {
            let tile = g * tiles + i;
            let planes = TileConv {
                buf: if direct { x } else { &scratch.buf[..] },
                offsets: &l.offsets,
                weights: &self.weights[tile * channels * taps..(tile + 1) * channels * taps],
                bias: &self.bias[tile * channels..(tile + 1) * channels],
                clip: self.clip,
            };
            if ow >= positions {
                // Rows at least a block wide: whole blocks along each row (the last one
                // overlapping the one before), written in place.
                let wq = l.wq;
                let cols = overlapping_blocks(ow, positions);
                let starts =
                    (0..oh).flat_map(|r| cols.clone().map(move |c| (r * wq + c, r * ow + c)));
                planes.convolve(self.tile, outs, oh * ow, starts);
                continue;
            }
            // Narrower rows: the flat plane, then its rows copied out.
            scratch.flat.resize(n * channels, 0.0);
            let starts = (0..n).step_by(positions).map(|s| (s, s));
            planes.convolve(self.tile, &mut scratch.flat, n, starts);
            for (out, flat) in outs.chunks_exact_mut(oh * ow).zip(scratch.flat.chunks(n)) {
                for (r, row) in out.chunks_exact_mut(ow).enumerate() {
                    row.copy_from_slice(&flat[r * l.wq..r * l.wq + ow]);
                }
            }
        }
    }

    /// One sample of an op with an expansion: `x` its input planes (the expansion's), `y` its
    /// output planes. Four expanded planes at a time go to `scratch.expanded`, then each is
    /// one group of the depthwise convolution.
    fn expand_and_convolve(&self, e: &Expand, x: &[f32], y: &mut [f32], scratch: &mut Scratch) {
        let (hw, out) = (
            self.in_hw[0] * self.in_hw[1],
            self.out_hw[0] * self.out_hw[1],
        );
        let (positions, channels) = (Tile::Dense.positions(), Tile::Dense.channels());
        let mut planes = std::mem::take(&mut scratch.expanded);
        planes.resize(channels * hw, 0.0);
        // Whole blocks over each flat plane, the last one overlapping the one before.
        let starts = overlapping_blocks(hw, positions).map(|s| (s, s));
        let taps = e.in_channels * channels;
        for (t, ys) in y.chunks_mut(channels * out).enumerate() {
            TileConv {
                buf: x,
                offsets: &e.offsets,
                weights: &e.weights[t * taps..(t + 1) * taps],
                bias: &e.bias[t * channels..(t + 1) * channels],
                clip: e.clip,
            }
            .convolve(Tile::Dense, &mut planes, hw, starts.clone());
            for (c, (plane, yc)) in planes
                .chunks_exact(hw)
                .zip(ys.chunks_exact_mut(out))
                .enumerate()
            {
                self.group(t * channels + c, plane, yc, scratch);
            }
        }
        scratch.expanded = planes;
    }
}

/// Where the blocks of `positions` covering `len >= positions` values start: every
/// `positions`, the last one ending at `len` (overlapping the one before it unless `len` is a
/// multiple of `positions`).
fn overlapping_blocks(len: usize, positions: usize) -> impl Iterator<Item = usize> + Clone {
    (0..len - positions)
        .step_by(positions)
        .chain([len - positions])
}

/// A thread's scratch: a group's padded phase planes, one padded row, the flat outputs of a tile,
/// the expanded planes of a tile.
#[derive(Default)]
struct Scratch {
    buf: Vec<f32>,
    /// The layout `buf` was last zeroed for: where no input goes, it is still zeros.
    zeroed_for: Option<Geometry>,
    row: Vec<f32>,
    flat: Vec<f32>,
    expanded: Vec<f32>,
}

impl Scratch {
    /// Makes `buf` hold `layout`'s regions, zeros but where the input goes: zeroed whole when
    /// the layout changes (once per op and thread), untouched between the planes of one op,
    /// which all write the same places.
    fn prepare(&mut self, layout: &Geometry) {
        if self.zeroed_for.as_ref() != Some(layout) {
            self.buf.clear();
            self.buf.resize(layout.len, 0.0);
            self.zeroed_for = Some(layout.clone());
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// One tile's convolution: for each of its channels `c`,
/// `out[c][i] = clip(bias[c] + sum over taps t of weights[t][c] * buf[offsets[t] + i])`.
struct TileConv<'a> {
    buf: &'a [f32],
    offsets: &'a [usize],
    weights: &'a [f32],
    bias: &'a [f32],
    clip: (f32, f32),
}

impl TileConv<'_> {
    /// Computes the tile's channels into `out` (planes `plane` apart; a group's last tile may
    /// have fewer than its channels), one block at each `(start, at)`: the block of flat
    /// positions from `start` (`buf` reaches a block past the taps of every one) goes to `at`.
    fn convolve(
        &self,
        tile: Tile,
        out: &mut [f32],
        plane: usize,
        starts: impl Iterator<Item = (usize, usize)>,
    ) {
        match tile {
            Tile::Depthwise => self.dispatch::<32, 1, 32>(out, plane, starts),
            Tile::Dense => self.dispatch::<16, 4, 64>(out, plane, starts),
        }
    }

    /// [`Self::blocks`] vectorised for the CPU it runs on.
    fn dispatch<const P: usize, const C: usize, const N: usize>(
        &self,
        out: &mut [f32],
        plane: usize,
        starts: impl Iterator<Item = (usize, usize)>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { self.avx2_fma::<P, C, N>(out, plane, starts) };
        }
        // aarch64 always has NEON and a fused multiply-add.
        self.blocks::<{ cfg!(target_arch = "aarch64") }, P, C, N>(out, plane, starts)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_fma<const P: usize, const C: usize, const N: usize>(
        &self,
        out: &mut [f32],
        plane: usize,
        starts: impl Iterator<Item = (usize, usize)>,
    ) {
        self.blocks::<true, P, C, N>(out, plane, starts)
    }

    /// The loop itself, inlined into each target-feature wrapper so it is vectorised for it:
    /// `P` outputs of `C` channels at a time. With `FMA` each tap is one fused multiply-add per
    /// channel (only where the CPU has one: else `mul_add` would be a library call).
    #[inline(always)]
    fn blocks<const FMA: bool, const P: usize, const C: usize, const N: usize>(
        &self,
        out: &mut [f32],
        plane: usize,
        starts: impl Iterator<Item = (usize, usize)>,
    ) {
        let (lo, hi) = self.clip;
        let planes = out.len().div_ceil(plane);
        debug_assert_eq!(N, P * C);
        let mut init = [0.0; N];
        for (a, &b) in init.chunks_exact_mut(P).zip(self.bias) {
            a.fill(b);
        }
        for (start, at) in starts {
            // Channel c's accumulators are acc[c * P..][..P] (one flat array: the compiler keeps
            // it in registers, which it did not for an array of arrays).
            let mut acc = init;
            for (&offset, w) in self.offsets.iter().zip(self.weights.chunks_exact(C)) {
                let src: &[f32; P] = self.buf[offset + start..offset + start + P]
                    .try_into()
                    .expect("P long");
                for (a, &w) in acc.chunks_exact_mut(P).zip(w) {
                    for (a, &x) in a.iter_mut().zip(src) {
                        *a = if FMA { x.mul_add(w, *a) } else { *a + x * w };
                    }
                }
            }
            for (c, a) in acc.chunks_exact(P).enumerate() {
                if c >= planes {
                    break;
                }
                // Written so as to be one `max` and one `min` instruction (f32::max would add
                // a NaN check).
                let at = c * plane + at;
                for (y, &a) in out[at..at + P].iter_mut().zip(a) {
                    let a = if a > lo { a } else { lo };
                    *y = if a < hi { a } else { hi };
                }
            }
        }
    }
}

impl Op for PlaneConv {
    fn name(&self) -> StaticName {
        "KestrelConv".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        let expand = match &self.expand {
            Some(e) => format!("1x1 {} -> ", e.in_channels),
            None => String::new(),
        };
        Ok(vec![format!(
            "{expand}{} -> {} channels in {} groups, {} taps, stride {:?}, {:?} -> {:?}",
            self.in_channels,
            self.out_channels,
            self.groups,
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

impl EvalOp for PlaneConv {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let input = &inputs[0];
        let x = input.try_as_plain_ram()?.as_slice::<f32>()?;
        let ([h, w], [oh, ow]) = (self.in_hw, self.out_hw);
        let (ci, co, g) = (self.in_channels, self.out_channels, self.groups);
        let mut shape: TVec<usize> = tvec![co, oh, ow];
        if self.batched {
            shape.insert(0, input.shape()[0]);
        }
        // SAFETY: every element is written below (one group after another).
        let mut output = unsafe { Tensor::uninitialized::<f32>(&shape)? };
        let mut view = output.try_as_plain_ram_mut()?;
        let y = view.as_slice_mut::<f32>()?;
        let (group_in, group_out) = (ci / g * h * w, co / g * oh * ow);
        let sample_in = self.expand.as_ref().map_or(ci, |e| e.in_channels) * h * w;
        SCRATCH.with_borrow_mut(|scratch| {
            for (xs, ys) in x
                .chunks_exact(sample_in)
                .zip(y.chunks_exact_mut(co * oh * ow))
            {
                if let Some(e) = &self.expand {
                    self.expand_and_convolve(e, xs, ys, scratch);
                    continue;
                }
                let groups = xs
                    .chunks_exact(group_in)
                    .zip(ys.chunks_exact_mut(group_out));
                for (i, (xg, yg)) in groups.enumerate() {
                    self.group(i, xg, yg, scratch);
                }
            }
        });
        Ok(tvec!(output.into_tvalue()))
    }
}

impl TypedOp for PlaneConv {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let [oh, ow] = self.out_hw;
        let mut shape: TVec<TDim> = tvec![self.out_channels.into(), oh.into(), ow.into()];
        if self.batched {
            shape.insert(0, inputs[0].shape[0].clone());
        }
        Ok(tvec!(f32::fact(shape)))
    }

    as_op!();
}
