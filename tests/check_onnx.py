#!/usr/bin/env python3
"""Checks that an ONNX file written by `mnist_mpi export` is the checkpoint's model, without our C++.

    check_onnx.py MODEL.onnx CHECKPOINT DATA_DIR LOGITS.npy ACCURACY [--params-hash HEX]

1. ONNX's own checks (Debian's python3-onnx): onnx.checker.check_model(full_check=True) and strict
   shape inference; opset >= 13; the input `image` (N, 1, 28, 28) float with N symbolic; the outputs
   `logits` and `probabilities` (N, classes); the metadata (spec, step, params_hash, input scaling).
2. The weights: every initializer equals, bit for bit, the checkpoint tensor of its name as
   scripts/read_checkpoint.py (numpy only) reads it, and every checkpoint tensor is used.
3. The model: a numpy evaluator of the graph's nodes (Conv, MaxPool, Relu, Flatten, Reshape, Gemm,
   BatchNormalization, Softmax, Identity, in float32 with OpenBLAS's products; any other op fails the check) runs the 10,000 MNIST test images,
   read here from the IDX files and scaled as the metadata says. Its accuracy must be within one
   image of ACCURACY (what `mnist_mpi evaluate` printed) and of the accuracy of LOGITS.npy (what
   `mnist_mpi evaluate --logits-file` wrote), and every logit must match: |onnx - ours| <= 1e-5 *
   max|ours| of its image's row (relative to the scale of the logits that decide the argmax; a
   logit near zero has no meaningful elementwise relative error).
float32, not float64: lenet's 10,000 images took about three times as long in float64 on the 2-core CI
machine, and both precisions stay an order of magnitude inside the bound (docs/model_use.md has the numbers);
the evaluator is independent of ours either way (other code, other summation order).
Exit 0 when everything holds, 1 otherwise; the numbers are printed either way.
"""
import argparse
import gzip
import os
import sys

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from read_checkpoint import read_checkpoint  # noqa: E402

RTOL = 1e-5
EVAL_DTYPE = np.float32


def read_idx(path):
    opener = gzip.open if not os.path.exists(path) and os.path.exists(path + ".gz") else open
    with opener(path if opener is open else path + ".gz", "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def windows(x, kh, kw, stride):  # (N, C, H, W) -> (N, C, OH, OW, kh, kw), a view
    v = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))
    return v[:, :, ::stride[0], ::stride[1]]


def run_graph(graph, init, x):
    env = dict(init)
    env[graph.input[0].name] = x
    for node in graph.node:
        a = attrs(node)
        ins = [env[i] for i in node.input]
        op = node.op_type
        if op == "Conv":
            w, b = ins[1], ins[2]  # (O, I, KH, KW), (O)
            assert a.get("group", 1) == 1 and list(a.get("dilations", [1, 1])) == [1, 1] and "auto_pad" not in a
            t, l, btm, r = a.get("pads", [0, 0, 0, 0])
            xp = np.pad(ins[0], ((0, 0), (0, 0), (t, btm), (l, r)))
            kh, kw = a["kernel_shape"]
            win = windows(xp, kh, kw, a.get("strides", [1, 1]))  # (N, C, OH, OW, KH, KW)
            n, c, oh, ow = win.shape[:4]
            cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(n * oh * ow, c * kh * kw)  # im2col (N*OH*OW, C*KH*KW)
            y = (cols @ w.reshape(w.shape[0], -1).T).reshape(n, oh, ow, -1).transpose(0, 3, 1, 2) + b[None, :, None, None]
        elif op == "MaxPool":
            assert not any(a.get("pads", [0])) and a.get("ceil_mode", 0) == 0 and "auto_pad" not in a
            kh, kw = a["kernel_shape"]
            y = windows(ins[0], kh, kw, a.get("strides", [1, 1])).max(axis=(4, 5))
        elif op == "Relu":
            y = np.maximum(ins[0], 0.0)
        elif op == "Flatten":
            axis = a.get("axis", 1)
            y = ins[0].reshape(int(np.prod(ins[0].shape[:axis])), -1)
        elif op == "Reshape":
            y = ins[0].reshape([int(d) for d in ins[1]])
        elif op == "Gemm":
            A, B = ins[0], ins[1]
            if a.get("transA", 0):
                A = A.T
            if a.get("transB", 0):
                B = B.T
            y = a.get("alpha", 1.0) * (A @ B) + a.get("beta", 1.0) * ins[2]
        elif op == "BatchNormalization":  # inference: the running statistics
            X, scale, shift, mean, var = ins
            shape = (1, -1) + (1,) * (X.ndim - 2)  # per channel, axis 1
            inv = (1.0 / np.sqrt(var.astype(np.float64) + a.get("epsilon", 1e-5))).astype(np.float32)
            y = (X - mean.reshape(shape)) * (scale * inv).reshape(shape) + shift.reshape(shape)
        elif op == "Softmax":
            z = ins[0] - ins[0].max(axis=a.get("axis", -1), keepdims=True)
            e = np.exp(z)
            y = e / e.sum(axis=a.get("axis", -1), keepdims=True)
        elif op == "Identity":
            y = ins[0]
        else:
            raise SystemExit(f"FAIL: the graph has a {op} node, which the export should not write")
        env[node.output[0]] = y
    return [env[o.name] for o in graph.output]


def dims(value_info):
    return [d.dim_param if d.HasField("dim_param") else d.dim_value
            for d in value_info.type.tensor_type.shape.dim]


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("checkpoint")
    ap.add_argument("data_dir")
    ap.add_argument("logits")
    ap.add_argument("accuracy", type=float)
    ap.add_argument("--params-hash")
    args = ap.parse_args(argv)
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)
            print("FAIL:", what)

    model = onnx.load(args.model)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    check(opset >= 13, f"opset {opset} < 13")
    g = inferred.graph
    ck = read_checkpoint(args.checkpoint, verify=False)
    check([i.name for i in g.input] == ["image"], f"inputs {[i.name for i in g.input]}, expected ['image']")
    in_dims = dims(g.input[0])
    check(isinstance(in_dims[0], str) and in_dims[1:] == [1, 28, 28], f"input shape {in_dims}, expected (N, 1, 28, 28)")
    check(g.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT, "input is not float32")
    check([o.name for o in g.output] == ["logits", "probabilities"], f"outputs {[o.name for o in g.output]}")
    for o in g.output:
        check(isinstance(dims(o)[0], str) and dims(o)[1:] == [10], f"output {o.name} shape {dims(o)}, expected (N, 10)")
    meta = {p.key: p.value for p in model.metadata_props}
    print("metadata:", meta)
    check(meta.get("mnist_mpi.model_spec") == ck["spec"], "metadata model_spec differs from the checkpoint's spec")
    check(meta.get("mnist_mpi.step") == str(int(ck["meta"]["step"])), "metadata step differs from the checkpoint's")
    check("pixel / 255" in meta.get("mnist_mpi.input_scaling", ""), "metadata lacks the input scaling")
    check(len(meta.get("mnist_mpi.params_hash", "")) == 16, "metadata lacks a params_hash")
    if args.params_hash:
        check(meta.get("mnist_mpi.params_hash") == args.params_hash,
              f"metadata params_hash {meta.get('mnist_mpi.params_hash')} != the run's {args.params_hash}")

    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    used = set()
    for name, value in init.items():
        if value.dtype != np.float32:
            continue  # a Reshape's target shape
        used.add(name)
        ref = ck["params"].get(name, ck["model_state"].get(name))
        check(ref is not None and ref.shape == value.shape and np.array_equal(ref.view(np.uint32),
                                                                              value.view(np.uint32)),
              f"initializer {name} is not the checkpoint's tensor bit for bit")
    tensors = set(ck["params"]) | set(ck["model_state"])  # batch norm's running statistics too
    check(used == tensors, f"checkpoint tensors not in the graph: {tensors - used}")

    images = read_idx(os.path.join(args.data_dir, "t10k-images-idx3-ubyte"))
    labels = read_idx(os.path.join(args.data_dir, "t10k-labels-idx1-ubyte")).astype(np.int64)
    x = (images.astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)  # as the metadata says
    init_eval = {k: (v.astype(EVAL_DTYPE) if v.dtype == np.float32 else v) for k, v in init.items()}
    logits, probs = [], []
    for first in range(0, len(x), 250):
        lo, pr = run_graph(model.graph, init_eval, x[first:first + 250].astype(EVAL_DTYPE))
        logits.append(lo)
        probs.append(pr)
    logits, probs = np.concatenate(logits), np.concatenate(probs)
    ours = np.load(args.logits).astype(np.float64)
    check(ours.shape == logits.shape, f"logits file shape {ours.shape}, ONNX gives {logits.shape}")
    onnx_correct = int((logits.argmax(1) == labels).sum())
    ours_correct = int((ours.argmax(1) == labels).sum())
    eval_correct = int(round(args.accuracy * len(labels)))
    scale = np.abs(ours).max(axis=1, keepdims=True)
    rel = np.abs(logits - ours) / scale
    worst = np.unravel_index(np.argmax(rel), rel.shape)
    print(f"ONNX graph (numpy, {np.dtype(EVAL_DTYPE).name}): {onnx_correct}/{len(labels)} correct; mnist_mpi evaluate: accuracy "
          f"{args.accuracy:.4f} ({eval_correct}), its logits file {ours_correct}; argmax differs on "
          f"{int((logits.argmax(1) != ours.argmax(1)).sum())} images")
    print(f"logits: max |onnx - ours| / max|ours| of the row = {rel.max():.3g} (image {worst[0]}, class {worst[1]}: "
          f"{logits[worst]:.7g} vs {ours[worst]:.7g}); limit {RTOL}")
    check(abs(onnx_correct - eval_correct) <= 1, "accuracy differs from mnist_mpi evaluate by more than one image")
    check(abs(onnx_correct - ours_correct) <= 1, "accuracy differs from the logits file by more than one image")
    check(rel.max() <= RTOL, f"a logit differs by more than {RTOL} relative")
    check(np.allclose(probs.sum(1), 1.0) and np.array_equal(probs.argmax(1), logits.argmax(1)),
          "probabilities are not the softmax of the logits")
    print("check_onnx:", "FAIL" if failures else "ok", args.model)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
