//! Small-kernel convolutions for tract, put in place of tract's own before it optimises a plan:
//! depthwise ones, and full ones over few input channels (a backbone's stem: 3 channels, 3x3).
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
//! memory traffic was shared, camera extraction 0.77-0.82x -> 0.92-1.02x the peer.
//!
//! Measured and left out (Lite0, this VM's Sapphire Rapids): AVX-512 kernels, for the depthwise
//! tile (4 chains of 2 registers) and the full one (32 x 4), were slower than AVX2 or no faster:
//! the unaligned loads and the memory traffic bound them, not the arithmetic.

use std::cell::RefCell;

use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::binary::TypedBinOp;
use tract_onnx::tract_core::ops::cnn::{Conv, KernelFormat};
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::nn::DataFormat;
use tract_onnx::tract_core::{as_op, op_as_typed_op, op_out_of_plan};

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
    layout: Layout,
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
struct Layout {
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

impl Layout {
    fn new(
        planes: usize,
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
        let region = sh * sw * plane;
        let offsets = (0..planes * kh * kw)
            .map(|t| {
                let (p, y, x) = (t / (kh * kw), t / kw % kh, t % kw);
                p * region + ((y % sh) * sw + x % sw) * plane + (y / sh) * wq + x / sw
            })
            .collect();
        Layout {
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
            let planes = Planes {
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
                let cols = (0..ow - positions)
                    .step_by(positions)
                    .chain([ow - positions]);
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
        let starts = (0..hw - positions)
            .step_by(positions)
            .chain([hw - positions])
            .map(|s| (s, s));
        let taps = e.in_channels * channels;
        for (t, ys) in y.chunks_mut(channels * out).enumerate() {
            Planes {
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

/// A thread's scratch: a group's padded phase planes, one padded row, the flat outputs of a tile,
/// the expanded planes of a tile.
#[derive(Default)]
struct Scratch {
    buf: Vec<f32>,
    /// The layout `buf` was last zeroed for: where no input goes, it is still zeros.
    zeroed_for: Option<Layout>,
    row: Vec<f32>,
    flat: Vec<f32>,
    expanded: Vec<f32>,
}

impl Scratch {
    /// Makes `buf` hold `layout`'s regions, zeros but where the input goes: zeroed whole when
    /// the layout changes (once per op and thread), untouched between the planes of one op,
    /// which all write the same places.
    fn prepare(&mut self, layout: &Layout) {
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
struct Planes<'a> {
    buf: &'a [f32],
    offsets: &'a [usize],
    weights: &'a [f32],
    bias: &'a [f32],
    clip: (f32, f32),
}

impl Planes<'_> {
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

/// Replaces every f32 NCHW or CHW convolution of `model` this op covers (depthwise, or full
/// over at most [`MAX_DENSE_TAPS`] taps with a kernel wider than 1x1; concrete shape, constant
/// weights and bias, no dilation) with a [`PlaneConv`]; returns how many. Run on a decluttered
/// model, before `into_optimized`.
pub fn replace(model: &mut TypedModel) -> TractResult<usize> {
    let mut replaced = 0;
    for id in model.eval_order()? {
        let Some(mut op) = plane_conv(model, id)? else {
            continue;
        };
        let mut input = model.nodes[id].inputs[0];
        if let Some((expand, from)) = expansion_before(model, id, &op)? {
            (op.expand, input) = (Some(expand), from);
        }
        put(model, op, input, OutletId::new(id, 0))?;
        replaced += 1;
    }
    // 1x1 convolutions over few channels not taken into a depthwise op above, on planes at least
    // a block wide: tract's packing of their input cost more than the product (Lite0's first
    // projection, 32 -> 16 on 112x112: 0.3-0.4 ms packing, 0.24 ms product).
    for id in model.eval_order()? {
        if let Some(p) = pointwise(model, id)?.filter(|p| p.hw[1] >= Tile::Dense.positions()) {
            put(model, p.conv(), p.input, p.end)?;
            replaced += 1;
        }
    }
    Ok(replaced)
}

/// Puts `op`, reading `input`, in place of the nodes up to `end`, and of a clip after them (`Max`
/// then `Min` with constants, as tract declutters ONNX's Clip and Relu), which is done on the
/// outputs while they are in registers.
fn put(
    model: &mut TypedModel,
    mut op: PlaneConv,
    input: OutletId,
    end: OutletId,
) -> TractResult<()> {
    let mut last = end;
    for _ in 0..2 {
        let Some((next, clip)) = clip_after(model, last, op.clip)? else {
            break;
        };
        (last, op.clip) = (next, clip);
    }
    let mut patch = TypedModelPatch::new("kestrel-conv");
    let x = patch.tap_model(model, input)?;
    let y = patch.wire_node(&model.nodes[end.node].name, op, &[x])?[0];
    patch.shunt_outside(model, last, y)?;
    patch.apply(model)
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

/// The [`PlaneConv`] node `id` is, if it is a convolution this op covers.
fn plane_conv(model: &TypedModel, id: usize) -> TractResult<Option<PlaneConv>> {
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
    let (ci, co, groups) = (spec.input_channels, spec.output_channels, conv.group);
    let batched = spec.data_format == DataFormat::NCHW;
    let rank = if batched { 4 } else { 3 };
    let dilated = spec
        .dilations
        .as_ref()
        .is_some_and(|d| d.iter().any(|&d| d != 1));
    let window: usize = spec.kernel_shape.iter().product();
    let tile = if groups == ci && co == ci {
        Tile::Depthwise
    } else if groups == 1 && window > 1 && ci * window <= MAX_DENSE_TAPS {
        Tile::Dense
    } else {
        return Ok(None);
    };
    if x.datum_type != f32::datum_type()
        || conv.q_params.is_some()
        || !matches!(spec.data_format, DataFormat::NCHW | DataFormat::CHW)
        || conv.kernel_fmt != KernelFormat::OIHW
        || shape.len() != rank
        || shape[rank - 3] != ci
        || spec.kernel_shape.len() != 2
        || dilated
        || kernel.datum_type() != f32::datum_type()
        || kernel.len() != co * ci / groups * window
        || bias.datum_type() != f32::datum_type()
        || !(bias.len() == co || bias.len() == 1)
    {
        return Ok(None);
    }
    let in_hw = [shape[rank - 2], shape[rank - 1]];
    let padding = spec.computed_padding(&in_hw);
    let strides = spec.strides();
    let bias = bias.try_as_plain_ram()?.as_slice::<f32>()?;
    let bias: Vec<f32> = (0..co).map(|c| bias[c % bias.len()]).collect();
    let kernel_hw = [spec.kernel_shape[0], spec.kernel_shape[1]];
    let stride = [strides[0], strides[1]];
    let pad_before = [padding[0].pad_before, padding[1].pad_before];
    let out_hw = [padding[0].convoluted, padding[1].convoluted];
    let (weights, bias) = tiled(
        kernel.try_as_plain_ram()?.as_slice::<f32>()?,
        &bias,
        groups,
        tile.channels(),
    );
    Ok(Some(PlaneConv {
        batched,
        in_channels: ci,
        out_channels: co,
        groups,
        stride,
        pad_before,
        in_hw,
        out_hw,
        layout: Layout::new(ci / groups, kernel_hw, stride, pad_before, in_hw, out_hw),
        tile,
        weights,
        bias,
        clip: (f32::NEG_INFINITY, f32::INFINITY),
        expand: None,
    }))
}

/// The most input channels of a 1x1 convolution taken over (into a depthwise op or on its own):
/// more, and tract's matrix product is the better tool (measured on Lite0: 16, 24 and 40 are
/// faster here).
const MAX_POINTWISE_CHANNELS: usize = 48;

/// The expansion feeding depthwise convolution `dw` (whose op is `op`), if it can be taken in:
/// a [`Pointwise`] convolution of the same planes, then at most a `Max` and a `Min` with
/// constants, each read by the next only. Returns it and its input.
fn expansion_before(
    model: &TypedModel,
    dw: usize,
    op: &PlaneConv,
) -> TractResult<Option<(Expand, OutletId)>> {
    if op.tile != Tile::Depthwise || op.in_hw[0] * op.in_hw[1] < Tile::Dense.positions() {
        return Ok(None);
    }
    // Back over the clip to the bias and the product ...
    let mut at = model.nodes[dw].inputs[0];
    for _ in 0..2 {
        match binary_with_const(model, at.node)? {
            Some(("Max" | "Min", from, _)) => at = from,
            _ => break,
        }
    }
    let Some(("Add", product, _)) = binary_with_const(model, at.node)? else {
        return Ok(None);
    };
    let Some(p) = pointwise(model, product.node)? else {
        return Ok(None);
    };
    if p.end != at || p.channels[1] != op.in_channels || p.batched != op.batched || p.hw != op.in_hw
    {
        return Ok(None);
    }
    // ... and forward again: the clip, and the convolution its only reader.
    let mut clip = (f32::NEG_INFINITY, f32::INFINITY);
    let mut last = at;
    while let Some((next, c)) = clip_after(model, last, clip)? {
        (last, clip) = (next, c);
    }
    if last != model.nodes[dw].inputs[0]
        || model.outputs.contains(&last)
        || model.single_succ(last.node)?.map(|n| n.id) != Some(dw)
    {
        return Ok(None);
    }
    let (ci, hw) = (p.channels[0], p.hw[0] * p.hw[1]);
    let (weights, bias) = tiled(&p.weights, &p.bias, 1, Tile::Dense.channels());
    let expand = Expand {
        in_channels: ci,
        offsets: (0..ci).map(|k| k * hw).collect(),
        weights,
        bias,
        clip,
    };
    Ok(Some((expand, p.input)))
}

/// A 1x1 convolution as tract declutters it: an f32 `EinSum` of planes `[(n,) in, h, w]` with a
/// constant `[out, in]` into `[(n,) out, h, w]`, then an `Add` of a per-channel constant, the
/// only reader of the product.
struct Pointwise {
    input: OutletId,
    /// The `Add`'s output.
    end: OutletId,
    /// Whether the planes have a batch axis.
    batched: bool,
    /// In, out.
    channels: [usize; 2],
    hw: [usize; 2],
    /// `[out][in]`.
    weights: Vec<f32>,
    /// Per output channel.
    bias: Vec<f32>,
}

impl Pointwise {
    /// The op computing it on its own.
    fn conv(&self) -> PlaneConv {
        let [ci, co] = self.channels;
        let (weights, bias) = tiled(&self.weights, &self.bias, 1, Tile::Dense.channels());
        PlaneConv {
            batched: self.batched,
            in_channels: ci,
            out_channels: co,
            groups: 1,
            stride: [1, 1],
            pad_before: [0, 0],
            in_hw: self.hw,
            out_hw: self.hw,
            layout: Layout::new(ci, [1, 1], [1, 1], [0, 0], self.hw, self.hw),
            tile: Tile::Dense,
            weights,
            bias,
            clip: (f32::NEG_INFINITY, f32::INFINITY),
            expand: None,
        }
    }
}

/// The [`Pointwise`] convolution whose product is node `id`, if there is one with at most
/// [`MAX_POINTWISE_CHANNELS`] input channels.
fn pointwise(model: &TypedModel, id: usize) -> TractResult<Option<Pointwise>> {
    let node = &model.nodes[id];
    let Some(einsum) = node.op_as::<EinSum>() else {
        return Ok(None);
    };
    let (Some(w), Some(mut x_shape)) = (
        model.outlet_fact(node.inputs[1])?.konst.clone(),
        model
            .outlet_fact(node.inputs[0])?
            .shape
            .as_concrete()
            .map(|s| s.to_vec()),
    ) else {
        return Ok(None);
    };
    let (inputs, outputs) = einsum.axes.to_strs();
    let chars = |s: &str| s.chars().collect::<Vec<char>>();
    let (mut x, k, y) = (chars(&inputs[0]), chars(&inputs[1]), chars(&outputs[0]));
    // A leading batch of one summed away is the same planes (tract declutters a model's NCHW
    // input so: "NIHW,OI->OHW").
    if x.len() == y.len() + 1 && !y.contains(&x[0]) && x_shape.first() == Some(&1) {
        (x, x_shape) = (x[1..].to_vec(), x_shape[1..].to_vec());
    }
    let rank = y.len();
    let ok = einsum.q_params.is_none()
        && einsum.operating_dt == f32::datum_type()
        && node.inputs.len() == 2
        && k.len() == 2
        && (rank == 3 || rank == 4)
        && x.len() == rank
        // [(n,) in, h, w] x [out, in] -> [(n,) out, h, w]
        && x[rank - 3] == k[1]
        && y[rank - 3] == k[0]
        && x[..rank - 3] == y[..rank - 3]
        && x[rank - 2..] == y[rank - 2..]
        && !y.contains(&k[1])
        && w.datum_type() == f32::datum_type()
        && w.shape()[1] <= MAX_POINTWISE_CHANNELS
        && x_shape[rank - 3] == w.shape()[1];
    let product = OutletId::new(id, 0);
    if !ok || model.outputs.contains(&product) {
        return Ok(None);
    }
    // The bias.
    let Some(add) = model.single_succ(id)? else {
        return Ok(None);
    };
    let (co, end) = (w.shape()[0], OutletId::new(add.id, 0));
    let Some(("Add", from, bias)) = binary_with_const(model, add.id)? else {
        return Ok(None);
    };
    if from != product
        || !(bias.len() == co || bias.len() == 1)
        || model.outlet_fact(end)?.shape != model.outlet_fact(product)?.shape
    {
        return Ok(None);
    }
    let bias = bias.try_as_plain_ram()?.as_slice::<f32>()?;
    Ok(Some(Pointwise {
        input: node.inputs[0],
        end,
        batched: rank == 4,
        channels: [w.shape()[1], co],
        hw: [x_shape[rank - 2], x_shape[rank - 1]],
        weights: w.try_as_plain_ram()?.as_slice::<f32>()?.to_vec(),
        bias: (0..co).map(|c| bias[c % bias.len()]).collect(),
    }))
}

/// Node `id`'s op name, non-constant input and constant, if it is a binary op of a tensor and an
/// f32 constant.
fn binary_with_const(
    model: &TypedModel,
    id: usize,
) -> TractResult<Option<(&'static str, OutletId, Arc<Tensor>)>> {
    let node = &model.nodes[id];
    let Some(op) = node.op_as::<TypedBinOp>() else {
        return Ok(None);
    };
    let name = match op.0.name() {
        "Add" => "Add",
        "Max" => "Max",
        "Min" => "Min",
        _ => return Ok(None),
    };
    let konst = |i: usize| model.outlet_fact(node.inputs[i]).ok()?.konst.clone();
    Ok(match (node.inputs.len(), konst(0), konst(1)) {
        (2, None, Some(k)) => Some((name, node.inputs[0], k)),
        (2, Some(k), None) => Some((name, node.inputs[1], k)),
        _ => None,
    }
    .filter(|(_, _, k)| k.datum_type() == f32::datum_type()))
}

/// OIHW `kernel` and `bias` laid out by tiles of `channels` output channels of each group:
/// `[taps][channels]` per tile, zeros past a group's last channel.
fn tiled(kernel: &[f32], bias: &[f32], groups: usize, channels: usize) -> (Vec<f32>, Vec<f32>) {
    let per_group = bias.len() / groups;
    let taps = kernel.len() / bias.len();
    let tiles = per_group.div_ceil(channels);
    let (mut w, mut b) = (Vec::new(), Vec::new());
    for g in 0..groups {
        for tile in 0..tiles {
            let chans: Vec<Option<usize>> = (0..channels)
                .map(|c| Some(tile * channels + c).filter(|&c| c < per_group))
                .map(|c| c.map(|c| g * per_group + c))
                .collect();
            for t in 0..taps {
                w.extend(
                    chans
                        .iter()
                        .map(|c| c.map_or(0.0, |c| kernel[c * taps + t])),
                );
            }
            b.extend(chans.iter().map(|c| c.map_or(0.0, |c| bias[c])));
        }
    }
    (w, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::cnn::{PaddingSpec, PoolSpec};
    use tract_onnx::tract_core::ops::math;

    /// A convolution's shapes: samples (0: CHW, no batch axis), channels in and out, groups,
    /// input size, kernel size, stride and padding.
    struct Case {
        n: usize,
        ci: usize,
        co: usize,
        groups: usize,
        hw: [usize; 2],
        k: usize,
        s: usize,
        pad: PaddingSpec,
    }

    /// The same convolution, straight from the definition (`geo`: padding before, output size).
    fn reference(t: &Case, x: &[f32], k: &[f32], bias: &[f32], geo: [[usize; 2]; 2]) -> Vec<f32> {
        let ([h, w], [[pt, pl], [oh, ow]], kk) = (t.hw, geo, t.k);
        let (cig, cog) = (t.ci / t.groups, t.co / t.groups);
        let mut y = vec![0.0; t.n.max(1) * t.co * oh * ow];
        for (p, yp) in y.chunks_exact_mut(oh * ow).enumerate() {
            let (n, o) = (p / t.co, p % t.co);
            for (i, j) in (0..oh).flat_map(|i| (0..ow).map(move |j| (i, j))) {
                let mut s = bias[o];
                for (c, a, b) in
                    (0..cig).flat_map(|c| (0..kk * kk).map(move |ab| (c, ab / kk, ab % kk)))
                {
                    let (r, q) = (
                        (i * t.s + a) as isize - pt as isize,
                        (j * t.s + b) as isize - pl as isize,
                    );
                    if r >= 0 && q >= 0 && (r as usize) < h && (q as usize) < w {
                        let plane = n * t.ci + o / cog * cig + c;
                        s += k[((o * cig + c) * kk + a) * kk + b]
                            * x[(plane * h + r as usize) * w + q as usize];
                    }
                }
                yp[i * ow + j] = s;
            }
        }
        y
    }

    /// Deterministic values for a case's input, kernel (`salt` tells two kernels apart) and bias.
    fn data(n: usize, salt: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.091 + salt).cos() * 0.3)
            .collect()
    }

    /// Wires convolution `t` of `x` (kernel and bias from [`data`]) into `model`, with a ReLU6
    /// after it (tract's Max then Min) if `relu6`; returns its output, kernel and bias.
    fn wire_conv(
        model: &mut TypedModel,
        name: &str,
        x: OutletId,
        t: &Case,
        relu6: bool,
    ) -> (OutletId, Vec<f32>, Vec<f32>) {
        let (ci, co, k) = (t.ci, t.co, t.k);
        let kernel = data(co * ci / t.groups * k * k, ci as f32);
        let bias: Vec<f32> = (0..co).map(|i| i as f32 * 0.05 - 0.1).collect();
        let kshape = [co, ci / t.groups, k, k];
        let kv = Tensor::from_shape(&kshape, &kernel).unwrap();
        let kv = model.add_const(format!("{name}.k"), kv).unwrap();
        let bv = Tensor::from_shape(&[co], &bias).unwrap();
        let bv = model.add_const(format!("{name}.b"), bv).unwrap();
        let pool_spec = PoolSpec {
            data_format: if t.n == 0 {
                DataFormat::CHW
            } else {
                DataFormat::NCHW
            },
            kernel_shape: tvec!(k, k),
            padding: t.pad.clone(),
            dilations: None,
            strides: Some(tvec!(t.s, t.s)),
            input_channels: ci,
            output_channels: co,
        };
        let conv = Conv {
            pool_spec,
            kernel_fmt: KernelFormat::OIHW,
            group: t.groups,
            q_params: None,
        };
        let mut out = model.wire_node(name, conv, &[x, kv, bv]).unwrap()[0];
        if relu6 {
            let ones = vec![1; if t.n == 0 { 3 } else { 4 }];
            for (bound, v, op) in [("lo", 0f32, math::max()), ("hi", 6.0, math::min())] {
                let v = Tensor::from_shape(&ones, &[v]).unwrap();
                let v = model.add_const(format!("{name}.{bound}"), v).unwrap();
                out = model
                    .wire_node(format!("{name}.{bound}.op"), op, &[out, v])
                    .unwrap()[0];
            }
        }
        (out, kernel, bias)
    }

    /// The input shape of `t`: NCHW, or CHW for `n = 0`.
    fn input_shape(t: &Case) -> Vec<usize> {
        let [h, w] = t.hw;
        match t.n {
            0 => vec![t.ci, h, w],
            n => vec![n, t.ci, h, w],
        }
    }

    /// Replaces what `model` holds (expecting `ops` replacements and a plan of the source and
    /// one op after that), runs it on `x` and returns the output.
    fn replace_and_run(model: TypedModel, ops: usize, x: Tensor) -> Tensor {
        let mut model = model.into_decluttered().unwrap();
        assert_eq!(replace(&mut model).unwrap(), ops);
        let model = model.into_optimized().unwrap();
        // Source, the convolution, nothing else: clips and expansions are taken in.
        assert_eq!(model.nodes.len(), 2, "{model}");
        assert!(
            model
                .nodes
                .iter()
                .any(|nd| nd.op_as::<PlaneConv>().is_some())
        );
        let out = model
            .into_runnable()
            .unwrap()
            .run(tvec![x.into_tvalue()])
            .unwrap();
        out[0].clone().into_tensor()
    }

    /// Asserts `got` is `want` (clipped to ReLU6 if `relu6`) to within rounding.
    fn assert_close(got: &Tensor, want: &[f32], relu6: bool, what: &str) {
        let got = got.to_plain_array_view::<f32>().unwrap();
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, e)) in got.iter().zip(want).enumerate() {
            let e = if relu6 { e.clamp(0.0, 6.0) } else { *e };
            assert!((g - e).abs() < 1e-5, "{what} at {i}: {g} vs {e}");
        }
    }

    /// Builds `t` (with a ReLU6 after it if `relu6`), replaces it, runs it and compares with the
    /// definition.
    fn check(t: &Case, relu6: bool) {
        let shape = input_shape(t);
        let x = data(shape.iter().product(), 0.5);
        let mut model = TypedModel::default();
        let xv = model.add_source("x", f32::fact(&shape)).unwrap();
        let (out, kernel, bias) = wire_conv(&mut model, "conv", xv, t, relu6);
        model.select_output_outlets(&[out]).unwrap();
        let got = replace_and_run(model, 1, Tensor::from_shape(&shape, &x).unwrap());
        let geo = geometry(t);
        let want = reference(t, &x, &kernel, &bias, geo);
        let what = format!("{:?} {}->{} k{} s{}", t.pad, t.ci, t.co, t.k, t.s);
        assert_eq!(got.shape()[shape.len() - 2..], geo[1], "{what}");
        assert_close(&got, &want, relu6, &what);
    }

    /// Padding before and output size of `t`.
    fn geometry(t: &Case) -> [[usize; 2]; 2] {
        let spec = PoolSpec {
            data_format: DataFormat::NCHW,
            kernel_shape: tvec!(t.k, t.k),
            padding: t.pad.clone(),
            dilations: None,
            strides: Some(tvec!(t.s, t.s)),
            input_channels: t.ci,
            output_channels: t.co,
        };
        let geo = spec.computed_padding(&t.hw);
        [
            [geo[0].pad_before, geo[1].pad_before],
            [geo[0].convoluted, geo[1].convoluted],
        ]
    }

    #[test]
    fn replaces_tract_convolutions_and_matches_the_definition() {
        use PaddingSpec::{Explicit, SameUpper, Valid};
        let e = |a: usize, b: usize, c: usize, d: usize| Explicit(tvec!(a, b), tvec!(c, d));
        // Depthwise (groups = channels): Lite0's shapes, odd sizes, uneven and no padding, a
        // stride of 3. Full (one group, few input channels): a stem (3 -> 32, 3x3, stride 2),
        // output channels not a multiple of the tile's four, a batch. Rows a block wide or
        // more are written in place, narrower ones copied out: both are here. n = 0: no batch axis
        // (CHW), as tract leaves a batch of 1 after decluttering. The cases run large to small
        // on one thread, so a scratch buffer reused across planes is covered.
        #[rustfmt::skip]
        let cases = [
            (1, 8, 8, 8, [112, 112], 3, 1, e(1, 1, 1, 1)),
            (0, 96, 96, 96, [112, 112], 3, 2, e(0, 0, 1, 1)),
            (1, 3, 32, 1, [225, 225], 3, 2, Valid),
            (2, 3, 10, 1, [17, 19], 3, 2, SameUpper),
            (0, 6, 6, 6, [28, 28], 5, 2, e(1, 1, 2, 2)),
            (2, 5, 5, 5, [15, 9], 3, 2, e(1, 1, 1, 1)),
            (1, 4, 4, 4, [14, 14], 5, 2, e(1, 1, 2, 2)),
            (0, 2, 7, 1, [12, 10], 3, 1, e(1, 1, 1, 1)),
            (1, 2, 6, 1, [20, 37], 3, 1, e(1, 1, 1, 1)),
            (1, 3, 3, 3, [7, 7], 5, 1, SameUpper),
            (1, 3, 3, 3, [10, 11], 3, 2, SameUpper),
            (1, 2, 2, 2, [6, 13], 3, 1, Valid),
            (1, 2, 2, 2, [9, 8], 3, 2, e(0, 2, 1, 0)),
            (1, 2, 2, 2, [13, 14], 5, 3, e(2, 1, 2, 2)),
            // Unpadded at stride 1, rows a block wide: read from the input itself.
            (0, 3, 3, 3, [40, 36], 3, 1, Valid),
            (1, 2, 4, 1, [20, 37], 3, 1, Valid),
            // 1x1 over few channels on rows a block wide (Lite0's 32 -> 16 on 112x112).
            (0, 32, 16, 1, [20, 24], 1, 1, Valid),
            (2, 5, 6, 1, [3, 17], 1, 1, Valid),
            (1, MAX_POINTWISE_CHANNELS, 7, 1, [16, 16], 1, 1, Valid),
        ];
        for (i, (n, ci, co, groups, hw, k, s, pad)) in cases.into_iter().enumerate() {
            // Every other case ends in a ReLU6 (tract's Max then Min), which the op takes in.
            let case = Case {
                n,
                ci,
                co,
                groups,
                hw,
                k,
                s,
                pad,
            };
            check(&case, i % 2 == 0);
        }
    }

    /// An expansion (1x1, ReLU6) and a depthwise convolution after it, as in an inverted-residual
    /// block: the model (its output the depthwise convolution's), its input, the definition's
    /// output and the expansion's outlet.
    fn block(expand: &Case, dw: &Case, relu6: bool) -> (TypedModel, Tensor, Vec<f32>, OutletId) {
        let shape = input_shape(expand);
        let x = data(shape.iter().product(), 0.5);
        let mut model = TypedModel::default();
        let xv = model.add_source("x", f32::fact(&shape)).unwrap();
        let (e, ek, eb) = wire_conv(&mut model, "expand", xv, expand, true);
        let (out, dk, db) = wire_conv(&mut model, "dw", e, dw, relu6);
        model.select_output_outlets(&[out]).unwrap();
        let expanded: Vec<f32> = reference(expand, &x, &ek, &eb, geometry(expand))
            .iter()
            .map(|v| v.clamp(0.0, 6.0))
            .collect();
        let want = reference(dw, &expanded, &dk, &db, geometry(dw));
        (model, Tensor::from_shape(&shape, &x).unwrap(), want, e)
    }

    /// An expansion `ci -> co` of `n` samples of `hw` and a 3x3 depthwise convolution of stride `s`.
    fn cases(n: usize, ci: usize, co: usize, hw: [usize; 2], s: usize) -> (Case, Case) {
        let expand = Case {
            n,
            ci,
            co,
            groups: 1,
            hw,
            k: 1,
            s: 1,
            pad: PaddingSpec::Valid,
        };
        let pad = PaddingSpec::Explicit(tvec!(1, 1), tvec!(1, 1));
        let dw = Case {
            n,
            ci: co,
            co,
            groups: co,
            hw,
            k: 3,
            s,
            pad,
        };
        (expand, dw)
    }

    #[test]
    fn takes_in_the_expansion_before_a_depthwise_convolution() {
        // Lite0's second stage (16 -> 96, then stride 2) on a smaller plane, without a batch axis
        // (as tract leaves a batch of 1 inside a graph), with one (a model's input) and with a
        // batch of 2; channels not a multiple of four, no clip after.
        #[rustfmt::skip]
        let all = [
            (0, 16, 96, [30, 30], 2, true),
            (1, 5, 10, [9, 13], 1, false),
            (2, 3, 6, [8, 8], 1, true),
            (0, 48, 8, [4, 5], 2, true),
        ];
        for (n, ci, co, hw, s, relu6) in all {
            let (expand, dw) = cases(n, ci, co, hw, s);
            let (model, x, want, _) = block(&expand, &dw, relu6);
            let got = replace_and_run(model, 1, x);
            assert_close(
                &got,
                &want,
                relu6,
                &format!("{n} x {ci} -> {co}, stride {s}"),
            );
        }
    }

    #[test]
    fn leaves_expansions_it_cannot_take_in() {
        // More input channels than taken in (tract's, and the depthwise op); an expansion whose
        // output is read elsewhere too (an op of its own, and the depthwise op).
        for (ci, read_elsewhere, ops) in [(MAX_POINTWISE_CHANNELS + 1, false, 1), (8, true, 2)] {
            let (expand, dw) = cases(0, ci, 8, [16, 16], 1);
            let (mut model, x, want, e) = block(&expand, &dw, true);
            if read_elsewhere {
                let out = model.outputs[0];
                model.select_output_outlets(&[out, e]).unwrap();
            }
            let mut model = model.into_decluttered().unwrap();
            assert_eq!(replace(&mut model).unwrap(), ops);
            let model = model.into_optimized().unwrap();
            let fused = model.nodes.iter().filter_map(|n| n.op_as::<PlaneConv>());
            assert!(fused.into_iter().all(|op| op.expand.is_none()), "{ci}");
            let out = model
                .into_runnable()
                .unwrap()
                .run(tvec![x.into_tvalue()])
                .unwrap();
            assert_close(&out[0].clone().into_tensor(), &want, true, &format!("{ci}"));
        }
    }

    #[test]
    fn leaves_pointwise_and_wide_convolutions_to_tract() {
        // 1x1 on rows narrower than a block, or over more channels than taken over; 4 x 3x3 =
        // 36 taps: more than a full convolution is taken over with.
        for (ci, k, hw) in [(3, 1, 8), (MAX_POINTWISE_CHANNELS + 1, 1, 16), (4, 3, 8)] {
            let mut model = TypedModel::default();
            let x = model.add_source("x", f32::fact([1, ci, hw, hw])).unwrap();
            let kv = Tensor::from_shape(&[8, ci, k, k], &vec![0.5f32; 8 * ci * k * k]).unwrap();
            let kv = model.add_const("k", kv).unwrap();
            let bv = model.add_const("b", Tensor::from_shape(&[8], &[0f32; 8]).unwrap());
            let pool_spec = PoolSpec {
                data_format: DataFormat::NCHW,
                kernel_shape: tvec!(k, k),
                padding: PaddingSpec::Valid,
                dilations: None,
                strides: None,
                input_channels: ci,
                output_channels: 8,
            };
            let conv = Conv {
                pool_spec,
                kernel_fmt: KernelFormat::OIHW,
                group: 1,
                q_params: None,
            };
            let y = model
                .wire_node("conv", conv, &[x, kv, bv.unwrap()])
                .unwrap();
            model.select_output_outlets(&y).unwrap();
            let mut model = model.into_decluttered().unwrap();
            assert_eq!(
                replace(&mut model).unwrap(),
                0,
                "{ci} channels, {k}x{k}, {hw}x{hw}"
            );
        }
    }
}
