//! Pretrained weights from an ONNX export of an architecture Kestrel describes
//! (`trainer import-weights --from model.onnx --arch mobilenetv2`).
//!
//! Exporters rename tensors (torchvision's export folds BN into the convs and names the results
//! `onnx::Conv_538`; TensorFlow and Keras use their own scopes), so weights are mapped by graph
//! structure, never by name: the k-th Conv node in graph order is the k-th conv of the
//! description ([`Network::convs`]), checked by weight shape, stride and groups; the last Gemm (or
//! MatMul + Add) is the classifier. A BatchNormalization right after a Conv becomes that conv's
//! BN (the conv's own bias moved into its running mean, a different epsilon into its variance);
//! a Conv without one (BN folded by the exporter) gets an identity BN that carries its bias.
//! Initializers and Constant nodes are read with the ONNX protobuf types of `tract_onnx::pb`
//! (see docs/training.md for why not `candle-onnx`).

use std::collections::HashMap;
use std::path::Path;

use tract_onnx::pb::{GraphProto, NodeProto};

use crate::arch::{ConvBn, Network};
use crate::onnx_backbone::{OnnxBackboneError, read_model};
use crate::onnx_graph::float_tensor;
use crate::tensor::{Tensor, Weights};

#[derive(Debug, thiserror::Error)]
pub enum OnnxWeightsError {
    #[error(transparent)]
    Read(#[from] OnnxBackboneError),
    #[error(
        "{path}: {found} Conv nodes, {arch} has {expected} convolutions: not this architecture"
    )]
    ConvCount {
        path: String,
        arch: String,
        found: usize,
        expected: usize,
    },
    #[error("{path}: Conv node {index} (`{node}`) {what}, {arch}'s `{canonical}` {expected}")]
    Mismatch {
        path: String,
        index: usize,
        node: String,
        what: String,
        arch: String,
        canonical: String,
        expected: String,
    },
    #[error("{path}: `{tensor}` (input of {op} `{node}`) is not a float initializer or Constant")]
    NotConstant {
        path: String,
        tensor: String,
        op: String,
        node: String,
    },
}

/// Every float constant of the graph: initializers and Constant nodes' values.
fn constants(g: &GraphProto) -> HashMap<String, Tensor> {
    let mut out: HashMap<String, Tensor> = g
        .initializer
        .iter()
        .filter_map(|t| Some((t.name.clone(), float_tensor(t)?)))
        .collect();
    for n in g.node.iter().filter(|n| n.op_type == "Constant") {
        let value = n.attribute.iter().find(|a| a.name == "value");
        if let (Some(t), Some(o)) = (value.and_then(|a| a.t.as_ref()), n.output.first()) {
            out.extend(float_tensor(t).map(|t| (o.clone(), t)));
        }
    }
    out
}

fn int_attr(n: &NodeProto, name: &str) -> Option<i64> {
    n.attribute.iter().find(|a| a.name == name).map(|a| a.i)
}

fn ints_attr(n: &NodeProto, name: &str) -> Vec<i64> {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map(|a| a.ints.clone())
        .unwrap_or_default()
}

fn transpose2(t: &Tensor) -> Tensor {
    let (r, c) = (t.shape[0], t.shape[1]);
    let mut data = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            data[j * r + i] = t.data[i * c + j];
        }
    }
    Tensor::new(vec![c, r], data)
}

struct Reader<'a> {
    path: String,
    arch: String,
    g: &'a GraphProto,
    consts: HashMap<String, Tensor>,
}

impl Reader<'_> {
    fn constant(&self, n: &NodeProto, i: usize) -> Result<Option<&Tensor>, OnnxWeightsError> {
        let Some(name) = n.input.get(i).filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        self.consts
            .get(name)
            .map(Some)
            .ok_or_else(|| OnnxWeightsError::NotConstant {
                path: self.path.clone(),
                tensor: name.clone(),
                op: n.op_type.clone(),
                node: n.name.clone(),
            })
    }

    /// The single consumer of `tensor`, if it is a node of type `op`.
    fn only_consumer(&self, tensor: &str, op: &str) -> Option<&NodeProto> {
        let mut users = self
            .g
            .node
            .iter()
            .filter(|n| n.input.iter().any(|i| i == tensor));
        let first = users.next()?;
        (users.next().is_none() && first.op_type == op).then_some(first)
    }

    fn mismatch(
        &self,
        k: usize,
        n: &NodeProto,
        c: &ConvBn,
        what: String,
        expected: String,
    ) -> OnnxWeightsError {
        OnnxWeightsError::Mismatch {
            path: self.path.clone(),
            index: k,
            node: n.name.clone(),
            what,
            arch: self.arch.clone(),
            canonical: c.weight_name(),
            expected,
        }
    }

    /// The canonical weight and BN of conv `c` from Conv node `n` (and its BatchNormalization).
    fn conv(
        &self,
        k: usize,
        n: &NodeProto,
        c: &ConvBn,
        eps: f32,
        w: &mut Weights,
    ) -> Result<(), OnnxWeightsError> {
        let weight = self.constant(n, 1)?.expect("Conv has a weight input");
        if weight.shape != c.weight_shape() {
            let e = format!("has {:?}", c.weight_shape());
            return Err(self.mismatch(k, n, c, format!("has weight shape {:?}", weight.shape), e));
        }
        let groups = int_attr(n, "group").unwrap_or(1) as usize;
        let strides = ints_attr(n, "strides");
        let stride = strides.first().copied().unwrap_or(1) as usize;
        if groups != c.groups || stride != c.stride {
            let e = format!("has stride {} and groups {}", c.stride, c.groups);
            return Err(self.mismatch(
                k,
                n,
                c,
                format!("has stride {stride} and groups {groups}"),
                e,
            ));
        }
        let cout = c.cout;
        let bias = self
            .constant(n, 2)?
            .map_or(vec![0.0; cout], |b| b.data.clone());
        let (gamma, beta, mean, var) = match self.only_consumer(&n.output[0], "BatchNormalization")
        {
            Some(bn) => {
                let p: Vec<Vec<f32>> = (1..5)
                    .map(|i| {
                        Ok(self
                            .constant(bn, i)?
                            .map(|t| t.data.clone())
                            .unwrap_or_default())
                    })
                    .collect::<Result<_, OnnxWeightsError>>()?;
                let file_eps = bn
                    .attribute
                    .iter()
                    .find(|a| a.name == "epsilon")
                    .map_or(1e-5, |a| a.f);
                // BN(conv + b) with the file's epsilon == BN(conv) with mean - b and Kestrel's.
                let mean = p[2].iter().zip(&bias).map(|(m, b)| m - b).collect();
                let var = p[3].iter().map(|v| (v + file_eps - eps).max(0.0)).collect();
                (p[0].clone(), p[1].clone(), mean, var)
            }
            // BN folded by the exporter: an identity BN (var + eps == 1) carrying the bias.
            None => (
                vec![1.0; cout],
                bias,
                vec![0.0; cout],
                vec![1.0 - eps; cout],
            ),
        };
        w.insert(c.weight_name(), weight.clone());
        for (field, v) in [
            ("weight", gamma),
            ("bias", beta),
            ("running_mean", mean),
            ("running_var", var),
        ] {
            if v.len() != cout {
                let e = format!("has {cout} channels");
                return Err(self.mismatch(
                    k,
                    n,
                    c,
                    format!("has a BatchNormalization {field} of {}", v.len()),
                    e,
                ));
            }
            w.insert(c.bn_name(field), Tensor::new(vec![cout], v));
        }
        Ok(())
    }

    /// The classifier `[classes, feature_dim]`: the last Gemm, or a MatMul followed by an Add.
    fn classifier(&self, feature_dim: usize) -> Result<Option<(Tensor, Tensor)>, OnnxWeightsError> {
        let Some(n) = self
            .g
            .node
            .iter()
            .rev()
            .find(|n| matches!(n.op_type.as_str(), "Gemm" | "MatMul"))
        else {
            return Ok(None);
        };
        let Some(b) = self.constant(n, 1)?.filter(|b| b.shape.len() == 2) else {
            return Ok(None);
        };
        let w = if n.op_type == "Gemm" && int_attr(n, "transB") == Some(1) {
            b.clone()
        } else {
            transpose2(b)
        };
        let bias = if n.op_type == "Gemm" {
            self.constant(n, 2)?.cloned()
        } else {
            match self.only_consumer(&n.output[0], "Add") {
                Some(add) => (0..2).find_map(|i| self.consts.get(&add.input[i]).cloned()),
                None => None,
            }
        };
        let classes = w.shape[0];
        let bias = bias.unwrap_or_else(|| Tensor::new(vec![classes], vec![0.0; classes]));
        Ok((w.shape[1] == feature_dim && bias.data.len() == classes)
            .then(|| (w, Tensor::new(vec![classes], bias.data))))
    }
}

/// Reads `path`'s weights into `net`'s canonical names (the classifier too, when the graph has
/// one on `net.feature_dim` features).
pub fn read(path: &Path, net: &Network) -> Result<Weights, OnnxWeightsError> {
    let (model, _) = read_model(path)?;
    let g = model.graph.as_ref().expect("read_model checks the graph");
    let r = Reader {
        path: path.display().to_string(),
        arch: net.arch.to_string(),
        g,
        consts: constants(g),
    };
    let convs: Vec<&NodeProto> = g.node.iter().filter(|n| n.op_type == "Conv").collect();
    let expected: Vec<&ConvBn> = net.convs().collect();
    if convs.len() != expected.len() {
        return Err(OnnxWeightsError::ConvCount {
            path: r.path,
            arch: net.arch.to_string(),
            found: convs.len(),
            expected: expected.len(),
        });
    }
    let mut w = Weights::new();
    for (k, (n, c)) in convs.iter().zip(expected).enumerate() {
        r.conv(k, n, c, net.bn_eps, &mut w)?;
    }
    if let Some((weight, bias)) = r.classifier(net.feature_dim)? {
        w.insert("classifier.weight".into(), weight);
        w.insert("classifier.bias".into(), bias);
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Arch;
    use crate::onnx::{self, Linear, LowerOpts};
    use crate::onnx_backbone::{InputLayout, OnnxBackbone, OnnxBackboneError};
    use crate::weights::{Part, fold, random};

    /// Kestrel's own MobileNetV2 logits graph (BN folded, seeded random weights) in a file.
    fn lowered(dir: &Path) -> (Network, Weights, std::path::PathBuf) {
        let net = Network::new(Arch::Mobilenetv2);
        let w = random(&net, Part::BackboneAndClassifier, 5);
        let head = Linear {
            weight: w["classifier.weight"].clone(),
            bias: w["classifier.bias"].data.clone(),
        };
        let model = onnx::lower(
            &net,
            &fold(&net, &w).unwrap(),
            &LowerOpts::logits(&net, head),
        );
        let path = dir.join("mbv2.onnx");
        std::fs::write(&path, onnx::to_bytes(&model)).unwrap();
        (net, w, path)
    }

    #[test]
    fn folded_weights_come_back_by_structure() {
        let dir = tempfile::tempdir().unwrap();
        let (net, w, path) = lowered(dir.path());
        let back = read(&path, &net).unwrap();
        let (a, b) = (fold(&net, &w).unwrap(), fold(&net, &back).unwrap());
        for (x, y) in a.iter().zip(&b) {
            let d = x
                .weight
                .data
                .iter()
                .zip(&y.weight.data)
                .map(|(p, q)| (p - q).abs());
            assert!(d.fold(0f32, f32::max) <= 1e-6);
            let d = x.bias.iter().zip(&y.bias).map(|(p, q)| (p - q).abs());
            assert!(d.fold(0f32, f32::max) <= 1e-6);
        }
        assert_eq!(back["classifier.weight"].data, w["classifier.weight"].data);
        let other = Network::new(Arch::EfficientnetLite0);
        let e = read(&path, &other).unwrap_err().to_string();
        assert!(
            e.contains("52 Conv nodes, efficientnet-lite0 has 49"),
            "{e}"
        );
    }

    #[test]
    fn feature_graph_cuts_at_the_classifier_input() {
        let dir = tempfile::tempdir().unwrap();
        let (_, _, path) = lowered(dir.path());
        let g = OnnxBackbone::load(&path, None, [224, 224]).unwrap();
        assert_eq!(
            (g.layout, g.feature_dim, g.input.as_str()),
            (InputLayout::Nchw, 1280, "input")
        );
        let graph = g.model.graph.as_ref().unwrap();
        assert!(graph.node.iter().all(|n| n.op_type != "Gemm"));
        assert_eq!(graph.output[0].name, "features");
        let e = OnnxBackbone::load(&path, Some("nope"), [224, 224]).unwrap_err();
        assert!(matches!(e, OnnxBackboneError::NoSuchTensor { .. }), "{e}");
        let e = OnnxBackbone::load(&path, None, [192, 192]).unwrap_err();
        assert!(e.to_string().contains("[224, 224]"), "{e}");
    }
}
