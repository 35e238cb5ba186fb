//! The trainable convolutions' custom ops timed against their composed forms (what a GPU runs,
//! [`crate::depthwise::depthwise_composed`], [`crate::planes::bias_act_composed`]): forward and
//! backward on MobileNetV2-sized activations, for `trainer bench --ops`.

use std::time::Instant;

use candle_core::{Device, Result, Var};
use serde::Serialize;

use crate::depthwise::{Depthwise, depthwise, depthwise_composed};
use crate::planes::{BiasAct, PlaneOrder, bias_act, bias_act_composed};

/// One op on one shape: milliseconds per forward + backward pass.
#[derive(Debug, Clone, Serialize)]
pub struct OpTiming {
    pub op: String,
    pub shape: Vec<usize>,
    /// The custom op on the CPU.
    pub cpu_op_ms: f64,
    /// The composed form on the CPU.
    pub composed_cpu_ms: f64,
    /// The composed form on `device` (`None` when that is the CPU).
    pub composed_device_ms: Option<f64>,
}

/// Times each op's forward and backward pass (the mean of `rounds` after one warm-up) as the
/// CPU op, composed on the CPU and, when `device` is not the CPU, composed on `device`.
pub fn time_ops(device: &Device, rounds: usize) -> Result<Vec<OpTiming>> {
    // Shapes of EfficientNet-Lite0's trainable end (`--fine-tune 2`) at 224x224, batch 32, laid
    // out [c, n, h, w] as fine-tuning lays them: the last block's 3x3 depthwise and a 5x5
    // stride-2 one before it.
    let dw = |kernel: usize, stride: usize, out: usize, pad: usize| Depthwise {
        kernel,
        stride,
        top: pad,
        left: pad,
        out_hw: [out, out],
        planes: PlaneOrder::Cnhw,
    };
    let cases: Vec<(String, [usize; 4], Kind)> = vec![
        (
            "depthwise 3x3 s1".into(),
            [1152, 32, 7, 7],
            Kind::Dw(dw(3, 1, 7, 1)),
        ),
        (
            "depthwise 5x5 s2".into(),
            [672, 32, 14, 14],
            Kind::Dw(dw(5, 2, 7, 1)),
        ),
        (
            "bias + relu6".into(),
            [1152, 32, 7, 7],
            Kind::Bias(BiasAct {
                relu6: true,
                planes: PlaneOrder::Cnhw,
            }),
        ),
    ];
    let mut out = Vec::new();
    for (op, shape, kind) in cases {
        let time = |dev: &Device, composed: bool| -> Result<f64> {
            let x = Var::randn(0f32, 1f32, shape.to_vec(), dev)?;
            let p = match kind {
                Kind::Dw(o) => Var::randn(0f32, 1f32, (shape[0], 1, o.kernel, o.kernel), dev)?,
                Kind::Bias(_) => Var::randn(0f32, 1f32, shape[0], dev)?,
            };
            let pass = || -> Result<()> {
                let y = match (kind, composed) {
                    (Kind::Dw(o), false) => depthwise(&x, &p, o)?,
                    (Kind::Dw(o), true) => depthwise_composed(&x, &p, o)?,
                    (Kind::Bias(o), false) => bias_act(&x, &p, o)?,
                    (Kind::Bias(o), true) => bias_act_composed(&x, &p, o)?,
                };
                let grads = y.sqr()?.sum_all()?.backward()?;
                // Reading a value back waits for a GPU's queued kernels.
                grads
                    .get(&p)
                    .map(|g| g.sum_all()?.to_scalar::<f32>())
                    .transpose()?;
                Ok(())
            };
            pass()?;
            let t0 = Instant::now();
            for _ in 0..rounds.max(1) {
                pass()?;
            }
            Ok(t0.elapsed().as_secs_f64() * 1000.0 / rounds.max(1) as f64)
        };
        out.push(OpTiming {
            op,
            shape: shape.to_vec(),
            cpu_op_ms: time(&Device::Cpu, false)?,
            composed_cpu_ms: time(&Device::Cpu, true)?,
            composed_device_ms: (!device.is_cpu()).then(|| time(device, true)).transpose()?,
        });
    }
    Ok(out)
}

#[derive(Clone, Copy)]
enum Kind {
    Dw(Depthwise),
    Bias(BiasAct),
}
