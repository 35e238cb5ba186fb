"""ONNX backbones as other tools export them, built with the `onnx` package (not Kestrel's writer).

    python foreign_backbones.py KESTREL_LITE0_LOGITS.onnx OUT_DIR

writes into OUT_DIR:
- lite0_foreign.onnx: Kestrel's EfficientNet-Lite0 logits graph re-emitted as a TensorFlow/Keras-style
  export: input `image` NHWC [batch, 224, 224, 3] (symbolic batch) behind a Transpose, every
  initializer renamed, BatchNormalization left unfolded after every Conv (epsilon 1e-3, random
  statistics, the conv weights divided so the network computes the same function), opset 17.
- mobilenetv2_torchvision.onnx: a MobileNetV2 in the layout `torch.onnx.export(
  torchvision.models.mobilenet_v2(), x, input_names=["input"])` gives (BN folded into the convs,
  whose weights are then named `onnx::Conv_N`, `features.N.M.weight`-style names elsewhere,
  Clip(0, 6), GlobalAveragePool, Flatten, Gemm `classifier.1`), random weights (seed 7), opset 17.
- mobilenetv2_headless.onnx: the same network (same weights) without its classifier, its pooled
  vector the graph's output `feat` [batch, 1280] (what timm exports with `num_classes=0`).
- not_image.onnx: an int64 token input [batch, 128] (Cast, Gemm): not an image model.
- rank2.onnx: a float input [batch, 10] (Gemm): wrong rank.
"""

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def model(graph):
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pytorch")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def lite0_foreign(src, out):
    g = onnx.load(src).graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    rng = np.random.default_rng(3)
    renamed = {name: f"StatefulPartitionedCall/model/tensor_{i}" for i, name in enumerate(inits)}
    new_inits, nodes = [], [
        helper.make_node("Transpose", ["image"], ["nchw"], perm=[0, 3, 1, 2], name="to_nchw")
    ]

    def ref(name):
        return "nchw" if name == "input" else renamed.get(name, name)

    for n in g.node:
        if n.op_type != "Conv":
            nodes.append(helper.make_node(n.op_type, [ref(i) for i in n.input], list(n.output),
                                          name=f"tf/{n.name}", **{a.name: helper.get_attribute_value(a) for a in n.attribute}))
            continue
        w = inits[n.input[1]].astype(np.float64)
        b = inits[n.input[2]].astype(np.float64)
        c = w.shape[0]
        gamma = rng.uniform(0.5, 2.0, c)
        mean = rng.normal(0.0, 0.5, c)
        var = rng.uniform(0.5, 2.0, c)
        eps = 1e-3
        s = gamma / np.sqrt(var + eps)
        wn, bn = f"{renamed[n.input[1]]}/kernel", f"{renamed[n.input[1]]}/bn"
        new_inits.append(numpy_helper.from_array((w / s[:, None, None, None]).astype(np.float32), wn))
        for field, v in [("gamma", gamma), ("beta", b + s * mean), ("mean", mean), ("var", var)]:
            new_inits.append(numpy_helper.from_array(v.astype(np.float32), f"{bn}/{field}"))
        conv_out = f"{n.output[0]}/conv"
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        nodes.append(helper.make_node("Conv", [ref(n.input[0]), wn], [conv_out], name=f"tf/{n.name}", **attrs))
        nodes.append(helper.make_node("BatchNormalization", [conv_out] + [f"{bn}/{f}" for f in ["gamma", "beta", "mean", "var"]],
                                      [n.output[0]], epsilon=eps, name=f"tf/{n.name}/bn"))
    for name, v in inits.items():
        if not any(name == n.input[1] for n in g.node if n.op_type == "Conv") and not name.endswith(".conv.bias"):
            new_inits.append(numpy_helper.from_array(v, renamed[name]))
    graph = helper.make_graph(
        nodes, "keras_lite0",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 224, 224, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])],
        new_inits)
    onnx.save(model(graph), out)


MBV2 = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


class Torchvision:
    """Builds nodes and initializers the way torch.onnx.export names them."""

    def __init__(self):
        self.rng = np.random.default_rng(7)
        self.nodes, self.inits, self.k = [], [], 100
        self.inits += [numpy_helper.from_array(np.array(0.0, np.float32), "onnx::Clip_min"),
                       numpy_helper.from_array(np.array(6.0, np.float32), "onnx::Clip_max")]

    def name(self):
        self.k += 1
        return self.k

    def conv(self, x, cin, cout, k, s, groups, relu, torch_name):
        # BN folded by the exporter: the weights get generated names, as torch's export does.
        fan_out = cout * k * k // groups
        w = self.rng.normal(0, np.sqrt(2.0 / fan_out), (cout, cin // groups, k, k)).astype(np.float32)
        b = self.rng.normal(0, 0.1, cout).astype(np.float32)
        wn = f"onnx::Conv_{self.name()}" if self.k % 3 else f"{torch_name}.weight"
        bn = f"onnx::Conv_{self.name()}"
        self.inits += [numpy_helper.from_array(w, wn), numpy_helper.from_array(b, bn)]
        y = f"/{torch_name}/Conv_output_0"
        self.nodes.append(helper.make_node("Conv", [x, wn, bn], [y], name=f"/{torch_name}/Conv", dilations=[1, 1], group=groups,
                                           kernel_shape=[k, k], pads=[k // 2] * 4, strides=[s, s]))
        if relu:
            r = f"/{torch_name}/Clip_output_0"
            self.nodes.append(helper.make_node("Clip", [y, "onnx::Clip_min", "onnx::Clip_max"], [r], name=f"/{torch_name}/Clip"))
            y = r
        return y

    def graph(self, head=True):
        x = self.conv("input", 3, 32, 3, 2, 1, True, "features/features.0/features.0.0")
        cin, i = 32, 1
        for t, c, n, s in MBV2:
            for r in range(n):
                stride = s if r == 0 else 1
                hidden = cin * t
                p = f"features/features.{i}/conv"
                y = x
                if t != 1:
                    y = self.conv(y, cin, hidden, 1, 1, 1, True, f"{p}/conv.0/conv.0.0")
                y = self.conv(y, hidden, hidden, 3, stride, hidden, True, f"{p}/conv.{1 if t != 1 else 0}/conv.x.0")
                y = self.conv(y, hidden, c, 1, 1, 1, False, f"{p}/conv.{2 if t != 1 else 1}")
                if stride == 1 and cin == c:
                    a = f"/features/features.{i}/Add_output_0"
                    self.nodes.append(helper.make_node("Add", [x, y], [a], name=f"/features/features.{i}/Add"))
                    y = a
                x, cin, i = y, c, i + 1
        x = self.conv(x, cin, 1280, 1, 1, 1, True, f"features/features.{i}/features.{i}.0")
        self.nodes += [
            helper.make_node("GlobalAveragePool", [x], ["/GlobalAveragePool_output_0"], name="/GlobalAveragePool"),
            helper.make_node("Flatten", ["/GlobalAveragePool_output_0"], ["/Flatten_output_0" if head else "feat"],
                             axis=1, name="/Flatten"),
        ]
        if not head:
            # What `timm.create_model(..., num_classes=0)` exports: the pooled vector is the output.
            return helper.make_graph(
                self.nodes, "main_graph",
                [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch_size", 3, 224, 224])],
                [helper.make_tensor_value_info("feat", TensorProto.FLOAT, ["batch_size", 1280])],
                self.inits)
        self.nodes += [
            helper.make_node("Gemm", ["/Flatten_output_0", "classifier.1.weight", "classifier.1.bias"], ["output"],
                             alpha=1.0, beta=1.0, transB=1, name="/classifier/classifier.1/Gemm"),
        ]
        self.inits += [
            numpy_helper.from_array(self.rng.normal(0, 0.01, (1000, 1280)).astype(np.float32), "classifier.1.weight"),
            numpy_helper.from_array(np.zeros(1000, np.float32), "classifier.1.bias"),
        ]
        return helper.make_graph(
            self.nodes, "main_graph",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch_size", 3, 224, 224])],
            [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch_size", 1000])],
            self.inits)


def small(out_dir):
    w = numpy_helper.from_array(np.ones((4, 128), np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)],
        "tokens", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w])
    onnx.save(model(g), f"{out_dir}/not_image.onnx")
    w = numpy_helper.from_array(np.ones((4, 10), np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)],
        "tabular", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w])
    onnx.save(model(g), f"{out_dir}/rank2.onnx")


if __name__ == "__main__":
    src, out_dir = sys.argv[1], sys.argv[2]
    lite0_foreign(src, f"{out_dir}/lite0_foreign.onnx")
    onnx.save(model(Torchvision().graph()), f"{out_dir}/mobilenetv2_torchvision.onnx")
    onnx.save(model(Torchvision().graph(head=False)), f"{out_dir}/mobilenetv2_headless.onnx")
    small(out_dir)
    print("ok")
