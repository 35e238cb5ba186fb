//! Architecture descriptions: the single source of truth for each network.
//!
//! Both supported backbones are inverted-residual networks (a stem conv, a chain of
//! expand → depthwise → project blocks, a 1x1 head conv, global average pooling, a linear
//! classifier). A [`Network`] lists every conv with its resolved geometry (padding included),
//! so lowering to ONNX ([`crate::onnx`]) and to candle ([`crate::candle`]) is a plain walk with no
//! architecture knowledge of its own.
//!
//! Canonical weight names (what `models` writes to safetensors):
//! `{conv}.conv.weight`, `{conv}.bn.{weight,bias,running_mean,running_var}` for every conv
//! (`stem`, `blocks.{i}.{expand,dw,project}`, `head`), and `classifier.{weight,bias}`.
//!
//! The head attaches after the global pool (`feature_dim` inputs). Blocks may be unfrozen from the
//! end: [`Network::blocks`] is ordered input → output and `freeze boundary = blocks.len() - N`.

use serde::{Deserialize, Serialize};

use kestrel_shared::PreprocessSpec;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum Arch {
    EfficientnetLite0,
    Mobilenetv2,
    /// A user's ONNX graph used whole as the frozen backbone (`--backbone model.onnx`): no blocks
    /// Kestrel describes ([`Network::imported`]); not an `--arch` value.
    Onnx,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::EfficientnetLite0, Arch::Mobilenetv2];

    pub fn name(self) -> &'static str {
        match self {
            Arch::EfficientnetLite0 => "efficientnet-lite0",
            Arch::Mobilenetv2 => "mobilenetv2",
            Arch::Onnx => "onnx",
        }
    }

    pub fn parse(s: &str) -> Option<Arch> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How convolutions pad.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Padding {
    /// PyTorch style: `k / 2` on every side.
    Symmetric,
    /// TensorFlow "SAME": total `max((ceil(n/s)-1)*s + k - n, 0)`, the extra pixel at bottom/right.
    TfSame,
}

/// One stage of inverted-residual blocks.
#[derive(Debug, Clone, Copy)]
struct Stage {
    expand: usize,
    kernel: usize,
    stride: usize,
    out: usize,
    repeats: usize,
}

const fn st(expand: usize, kernel: usize, stride: usize, out: usize, repeats: usize) -> Stage {
    Stage {
        expand,
        kernel,
        stride,
        out,
        repeats,
    }
}

const LITE0_STAGES: [Stage; 7] = [
    st(1, 3, 1, 16, 1),
    st(6, 3, 2, 24, 2),
    st(6, 5, 2, 40, 2),
    st(6, 3, 2, 80, 3),
    st(6, 5, 1, 112, 3),
    st(6, 5, 2, 192, 4),
    st(6, 3, 1, 320, 1),
];

const MOBILENETV2_STAGES: [Stage; 7] = [
    st(1, 3, 1, 16, 1),
    st(6, 3, 2, 24, 2),
    st(6, 3, 2, 32, 3),
    st(6, 3, 2, 64, 4),
    st(6, 3, 1, 96, 3),
    st(6, 3, 2, 160, 3),
    st(6, 3, 1, 320, 1),
];

/// A convolution followed by batch norm and optionally ReLU6, with resolved geometry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConvBn {
    /// Canonical prefix, e.g. `blocks.3.dw`.
    pub name: String,
    pub cin: usize,
    pub cout: usize,
    pub kernel: usize,
    pub stride: usize,
    pub groups: usize,
    pub relu6: bool,
    /// `[top, left, bottom, right]`.
    pub pads: [usize; 4],
    pub in_hw: [usize; 2],
    pub out_hw: [usize; 2],
}

impl ConvBn {
    pub fn weight_shape(&self) -> Vec<usize> {
        vec![self.cout, self.cin / self.groups, self.kernel, self.kernel]
    }

    pub fn weight_name(&self) -> String {
        format!("{}.conv.weight", self.name)
    }

    pub fn bn_name(&self, field: &str) -> String {
        format!("{}.bn.{field}", self.name)
    }
}

pub const BN_FIELDS: [&str; 4] = ["weight", "bias", "running_mean", "running_var"];

/// A unit of freezing/unfreezing: the stem, one inverted-residual block, or the head conv.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Block {
    pub name: String,
    pub convs: Vec<ConvBn>,
    /// Output = input + convs(input).
    pub residual: bool,
}

impl Block {
    pub fn in_shape(&self) -> [usize; 3] {
        let c = &self.convs[0];
        [c.cin, c.in_hw[0], c.in_hw[1]]
    }

    pub fn out_shape(&self) -> [usize; 3] {
        let c = self.convs.last().expect("block has convs");
        [c.cout, c.out_hw[0], c.out_hw[1]]
    }
}

/// A fully resolved network description for a fixed input size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Network {
    pub arch: Arch,
    pub input_hw: [usize; 2],
    pub bn_eps: f32,
    pub padding: Padding,
    pub blocks: Vec<Block>,
    /// Channels after the head conv = inputs of the classifier.
    pub feature_dim: usize,
    /// Classes of the pretrained classifier (ImageNet: 1000).
    pub pretrained_classes: usize,
    pub preprocess: PreprocessSpec,
}

fn geometry(padding: Padding, n: usize, k: usize, s: usize) -> (usize, usize, usize) {
    match padding {
        Padding::Symmetric => {
            let p = k / 2;
            (p, p, (n + 2 * p - k) / s + 1)
        }
        Padding::TfSame => {
            let out = n.div_ceil(s);
            let total = ((out - 1) * s + k).saturating_sub(n);
            (total / 2, total - total / 2, out)
        }
    }
}

struct Builder {
    padding: Padding,
    hw: [usize; 2],
}

impl Builder {
    fn conv(
        &mut self,
        name: String,
        cin: usize,
        cout: usize,
        k: usize,
        s: usize,
        groups: usize,
        relu6: bool,
    ) -> ConvBn {
        let (t, b, oh) = geometry(self.padding, self.hw[0], k, s);
        let (l, r, ow) = geometry(self.padding, self.hw[1], k, s);
        let c = ConvBn {
            name,
            cin,
            cout,
            kernel: k,
            stride: s,
            groups,
            relu6,
            pads: [t, l, b, r],
            in_hw: self.hw,
            out_hw: [oh, ow],
        };
        self.hw = [oh, ow];
        c
    }
}

impl Network {
    /// The network at its native 224x224 input.
    pub fn new(arch: Arch) -> Network {
        Self::with_input(arch, [224, 224])
    }

    /// A user's ONNX graph as the frozen backbone: no blocks, only its features' size and the
    /// preprocessing its user gave (the graph itself is [`crate::onnx_backbone::OnnxBackbone`]).
    pub fn imported(feature_dim: usize, preprocess: PreprocessSpec) -> Network {
        let [h, w] = preprocess.input_size;
        Network {
            arch: Arch::Onnx,
            input_hw: [h as usize, w as usize],
            bn_eps: 0.0,
            padding: Padding::Symmetric,
            blocks: Vec::new(),
            feature_dim,
            pretrained_classes: 0,
            preprocess,
        }
    }

    pub fn with_input(arch: Arch, input_hw: [usize; 2]) -> Network {
        let (stages, padding, bn_eps, preprocess) = match arch {
            Arch::Onnx => {
                return Self::imported(0, PreprocessSpec::imagenet());
            }
            Arch::EfficientnetLite0 => (
                &LITE0_STAGES,
                Padding::TfSame,
                1e-3,
                PreprocessSpec::tf_inception(),
            ),
            Arch::Mobilenetv2 => (
                &MOBILENETV2_STAGES,
                Padding::Symmetric,
                1e-5,
                PreprocessSpec::imagenet(),
            ),
        };
        let preprocess = PreprocessSpec {
            input_size: [input_hw[0] as u32, input_hw[1] as u32],
            ..preprocess
        };
        let (stem, head) = (32, 1280);
        let mut b = Builder {
            padding,
            hw: input_hw,
        };
        let mut blocks = vec![Block {
            name: "stem".into(),
            convs: vec![b.conv("stem".into(), 3, stem, 3, 2, 1, true)],
            residual: false,
        }];
        let mut cin = stem;
        for stage in stages {
            for r in 0..stage.repeats {
                let i = blocks.len() - 1;
                let stride = if r == 0 { stage.stride } else { 1 };
                let mid = cin * stage.expand;
                let mut convs = Vec::new();
                if stage.expand != 1 {
                    convs.push(b.conv(format!("blocks.{i}.expand"), cin, mid, 1, 1, 1, true));
                }
                convs.push(b.conv(
                    format!("blocks.{i}.dw"),
                    mid,
                    mid,
                    stage.kernel,
                    stride,
                    mid,
                    true,
                ));
                convs.push(b.conv(
                    format!("blocks.{i}.project"),
                    mid,
                    stage.out,
                    1,
                    1,
                    1,
                    false,
                ));
                blocks.push(Block {
                    name: format!("blocks.{i}"),
                    convs,
                    residual: stride == 1 && cin == stage.out,
                });
                cin = stage.out;
            }
        }
        blocks.push(Block {
            name: "head".into(),
            convs: vec![b.conv("head".into(), cin, head, 1, 1, 1, true)],
            residual: false,
        });
        Network {
            arch,
            input_hw,
            bn_eps,
            padding,
            blocks,
            feature_dim: head,
            pretrained_classes: 1000,
            preprocess,
        }
    }

    pub fn convs(&self) -> impl Iterator<Item = &ConvBn> {
        self.blocks.iter().flat_map(|b| b.convs.iter())
    }

    /// Every backbone parameter (canonical name, shape), in network order.
    pub fn backbone_params(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for c in self.convs() {
            out.push((c.weight_name(), c.weight_shape()));
            for f in BN_FIELDS {
                out.push((c.bn_name(f), vec![c.cout]));
            }
        }
        out
    }

    /// The pretrained classifier's parameters.
    pub fn classifier_params(&self) -> Vec<(String, Vec<usize>)> {
        vec![
            (
                "classifier.weight".into(),
                vec![self.pretrained_classes, self.feature_dim],
            ),
            ("classifier.bias".into(), vec![self.pretrained_classes]),
        ]
    }

    /// Name of this tensor in the architecture's upstream PyTorch layout
    /// (lukemelas EfficientNet-PyTorch for Lite0, torchvision for MobileNetV2).
    pub fn source_name(&self, canonical: &str) -> String {
        let (prefix, field) = split_param(canonical);
        let (module, kind) = match prefix.rsplit_once('.') {
            Some((m, k @ ("conv" | "bn"))) => (m, k),
            _ => (prefix, ""),
        };
        let blk = |m: &str| -> Option<(usize, String)> {
            let rest = m.strip_prefix("blocks.")?;
            let (i, part) = rest.split_once('.')?;
            Some((i.parse().ok()?, part.to_string()))
        };
        let mapped = match self.arch {
            Arch::Onnx => return canonical.to_string(),
            Arch::EfficientnetLite0 => match (module, kind) {
                ("classifier", _) => "_fc".to_string(),
                ("stem", "conv") => "_conv_stem".into(),
                ("stem", "bn") => "_bn0".into(),
                ("head", "conv") => "_conv_head".into(),
                ("head", "bn") => "_bn1".into(),
                (m, k) => match blk(m) {
                    Some((i, part)) => {
                        let sub = match (part.as_str(), k) {
                            ("expand", "conv") => "_expand_conv",
                            ("expand", "bn") => "_bn0",
                            ("dw", "conv") => "_depthwise_conv",
                            ("dw", "bn") => "_bn1",
                            ("project", "conv") => "_project_conv",
                            ("project", "bn") => "_bn2",
                            _ => return canonical.to_string(),
                        };
                        format!("_blocks.{i}.{sub}")
                    }
                    None => return canonical.to_string(),
                },
            },
            Arch::Mobilenetv2 => {
                let last = self.blocks.len() - 1;
                let idx = |k: &str| if k == "conv" { 0 } else { 1 };
                match (module, kind) {
                    ("classifier", _) => "classifier.1".to_string(),
                    ("stem", k) => format!("features.0.{}", idx(k)),
                    ("head", k) => format!("features.{last}.{}", idx(k)),
                    (m, k) => match blk(m) {
                        Some((i, part)) => {
                            let expands = self.blocks[i + 1].convs.len() == 3;
                            let sub = match (part.as_str(), expands) {
                                ("expand", true) => format!("conv.0.{}", idx(k)),
                                ("dw", true) => format!("conv.1.{}", idx(k)),
                                ("project", true) => format!("conv.{}", 2 + idx(k)),
                                ("dw", false) => format!("conv.0.{}", idx(k)),
                                ("project", false) => format!("conv.{}", 1 + idx(k)),
                                _ => return canonical.to_string(),
                            };
                            format!("features.{}.{sub}", i + 1)
                        }
                        None => return canonical.to_string(),
                    },
                }
            }
        };
        format!("{mapped}.{field}")
    }
}

fn split_param(name: &str) -> (&str, &str) {
    for field in ["running_mean", "running_var", "weight", "bias"] {
        if let Some(prefix) = name.strip_suffix(field).and_then(|p| p.strip_suffix('.')) {
            return (prefix, field);
        }
    }
    (name, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lite0_geometry() {
        let n = Network::new(Arch::EfficientnetLite0);
        assert_eq!(n.blocks.len(), 18); // stem + 16 + head
        assert_eq!(n.blocks[0].convs[0].pads, [0, 0, 1, 1]); // TF SAME, stride 2, 224 -> 112
        assert_eq!(n.blocks.last().unwrap().out_shape(), [1280, 7, 7]);
        assert_eq!(n.backbone_params().len(), (1 + 16 * 3 - 1 + 1) * 5);
        assert_eq!(
            n.source_name("blocks.0.dw.conv.weight"),
            "_blocks.0._depthwise_conv.weight"
        );
        assert_eq!(
            n.source_name("blocks.5.expand.bn.running_var"),
            "_blocks.5._bn0.running_var"
        );
        assert_eq!(n.source_name("head.bn.bias"), "_bn1.bias");
        assert_eq!(n.source_name("classifier.weight"), "_fc.weight");
    }

    #[test]
    fn mobilenetv2_torchvision_names() {
        let n = Network::new(Arch::Mobilenetv2);
        assert_eq!(n.blocks.len(), 19); // features.0 .. features.18
        assert_eq!(n.blocks[0].convs[0].pads, [1, 1, 1, 1]);
        assert_eq!(n.source_name("stem.conv.weight"), "features.0.0.weight");
        assert_eq!(
            n.source_name("blocks.0.dw.conv.weight"),
            "features.1.conv.0.0.weight"
        );
        assert_eq!(
            n.source_name("blocks.0.project.bn.weight"),
            "features.1.conv.2.weight"
        );
        assert_eq!(
            n.source_name("blocks.1.expand.bn.running_mean"),
            "features.2.conv.0.1.running_mean"
        );
        assert_eq!(
            n.source_name("blocks.1.project.conv.weight"),
            "features.2.conv.2.weight"
        );
        assert_eq!(
            n.source_name("blocks.1.project.bn.bias"),
            "features.2.conv.3.bias"
        );
        assert_eq!(n.source_name("head.conv.weight"), "features.18.0.weight");
        assert_eq!(n.source_name("classifier.bias"), "classifier.1.bias");
        let residuals = n.blocks.iter().filter(|b| b.residual).count();
        assert_eq!(residuals, 10);
    }
}
