//! The op against the convolution's definition, and what it leaves to tract.

use tract_onnx::tract_core::ops::cnn::{Conv, KernelFormat, PaddingSpec, PoolSpec};
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::math;
use tract_onnx::tract_core::ops::nn::DataFormat;

use super::graph::MAX_POINTWISE_CHANNELS;
use super::*;

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

impl Case {
    /// A 1x1 convolution `ci -> co` of `n` samples of `hw`.
    fn pointwise(n: usize, ci: usize, co: usize, hw: [usize; 2]) -> Case {
        Case {
            n,
            ci,
            co,
            groups: 1,
            hw,
            k: 1,
            s: 1,
            pad: PaddingSpec::Valid,
        }
    }
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
    let expand = Case::pointwise(n, ci, co, hw);
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

#[test]
fn a_bias_along_another_axis_is_not_taken_for_the_channels() {
    // A 1x1 convolution (8 -> 16 channels, as tract declutters one) plus a constant along the
    // rows, 16 wide: as long as the channels, but not per channel.
    let t = Case::pointwise(0, 8, 16, [8, 16]);
    let shape = input_shape(&t);
    let (x, kernel, along_w) = (data(8 * 8 * 16, 0.5), data(16 * 8, 1.0), data(16, 2.0));
    let mut model = TypedModel::default();
    let xv = model.add_source("x", f32::fact(&shape)).unwrap();
    let k = Tensor::from_shape(&[16, 8], &kernel).unwrap();
    let k = model.add_const("k", k).unwrap();
    let einsum = EinSum::new("IHW,OI->OHW".parse().unwrap(), f32::datum_type());
    let y = model.wire_node("conv", einsum, &[xv, k]).unwrap();
    let c = Tensor::from_shape(&[1, 1, 16], &along_w).unwrap();
    let c = model.add_const("along_w", c).unwrap();
    let y = model.wire_node("add", math::add(), &[y[0], c]).unwrap();
    model.select_output_outlets(&y).unwrap();
    let mut model = model.into_decluttered().unwrap();
    assert_eq!(replace(&mut model).unwrap(), 0);
    let out = model.into_optimized().unwrap().into_runnable().unwrap();
    let got = out
        .run(tvec![Tensor::from_shape(&shape, &x).unwrap().into_tvalue()])
        .unwrap();
    let mut want = reference(&t, &x, &kernel, &[0.0; 16], geometry(&t));
    for (i, v) in want.iter_mut().enumerate() {
        *v += along_w[i % 16];
    }
    assert_close(&got[0].clone().into_tensor(), &want, false, "bias along W");
}
