//! Where the op goes: finding the convolutions (and the expansions, clips and 1x1 convolutions
//! around them) it computes in a decluttered tract graph, and putting it in their place.

use tract_onnx::tract_core::ops::binary::TypedBinOp;
use tract_onnx::tract_core::ops::cnn::{Conv, KernelFormat};
use tract_onnx::tract_core::ops::einsum::EinSum;
use tract_onnx::tract_core::ops::nn::DataFormat;

use super::*;

/// Replaces every f32 NCHW or CHW convolution of `model` this op covers (depthwise, or full
/// over at most [`MAX_DENSE_TAPS`] taps with a kernel wider than 1x1; concrete shape, constant
/// weights and bias, no dilation) with a [`PlaneConv`], taking in the 1x1 expansion before a
/// depthwise one, then the 1x1 convolutions over at most [`MAX_POINTWISE_CHANNELS`] channels
/// left; returns how many ops it put in. Run on a decluttered model, before `into_optimized`.
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
    let (last, clip) = clips_after(model, end)?;
    op.clip = clip;
    let mut patch = TypedModelPatch::new("kestrel-conv");
    let x = patch.tap_model(model, input)?;
    let y = patch.wire_node(&model.nodes[end.node].name, op, &[x])?[0];
    patch.shunt_outside(model, last, y)?;
    patch.apply(model)
}

/// Where the clip after `from` ends (at most a `Max` and a `Min`, each read by the next only;
/// `from` itself when there is none) and its bounds (`(-inf, inf)` for none).
fn clips_after(model: &TypedModel, from: OutletId) -> TractResult<(OutletId, (f32, f32))> {
    let (mut last, mut clip) = (from, (f32::NEG_INFINITY, f32::INFINITY));
    for _ in 0..2 {
        let Some((next, c)) = clip_after(model, last, clip)? else {
            break;
        };
        (last, clip) = (next, c);
    }
    Ok((last, clip))
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
        layout: Geometry::new(ci / groups, kernel_hw, stride, pad_before, in_hw, out_hw),
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
pub(super) const MAX_POINTWISE_CHANNELS: usize = 48;

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
    let (last, clip) = clips_after(model, at)?;
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
            layout: Geometry::new(ci, [1, 1], [1, 1], [0, 0], self.hw, self.hw),
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
    // One value per output channel: no axis but the channels' (the third from the right, as
    // broadcasting aligns them) longer than one.
    let per_channel = bias
        .shape()
        .iter()
        .rev()
        .enumerate()
        .all(|(i, &d)| d == 1 || (i == 2 && d == co));
    if from != product
        || !per_channel
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
