#!/usr/bin/env python3
"""PyTorch eager baseline on one GPU, for scripts/gpu_check.sh.

Trains the same network as mnist_mpi's configs/lenet.ini (bench/torch_ddp.py's "lenet": Adam 1e-3,
global batch 100, dropout 0.5, one epoch of the first 55000 training images) on one CUDA device,
data resident on the GPU (no loader in the timing), and prints images/s over the steady steps
(the first 10 excluded, synchronised at both ends) and the test accuracy. fp32 by default
(TF32 off, as mnist_mpi --precision fp32); --tf32 allows it.

    python3 bench/torch_gpu.py --data-dir data/mnist [--epochs 1] [--tf32] [--json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ddp  # noqa: E402  (data reading, the model, the permutation)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data/mnist")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    data = torch_ddp.load_mnist(a.data_dir)
    xtr = torch.from_numpy(data["train"][0]).to(dev)
    ytr = torch.from_numpy(data["train"][1]).to(dev)
    xte = torch.from_numpy(data["test"][0]).to(dev)
    yte = torch.from_numpy(data["test"][1]).to(dev)
    torch.manual_seed(a.seed)
    model = torch_ddp.build_model("lenet").to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps_per_epoch = torch_ddp.N_TRAIN // a.batch_size
    warm = torch_ddp.WARMUP_STEPS
    step, t_steady = 0, None
    for epoch in range(a.epochs):
        perm = torch.from_numpy(torch_ddp.epoch_permutation(a.seed, epoch, torch_ddp.N_TRAIN)).to(dev)
        for s in range(steps_per_epoch):
            if step == warm:
                torch.cuda.synchronize()
                t_steady = time.perf_counter()
            idx = perm[s * a.batch_size:(s + 1) * a.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            step += 1
    torch.cuda.synchronize()
    ips = (step - warm) * a.batch_size / (time.perf_counter() - t_steady)
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(xte), 1000):
            correct += (model(xte[i:i + 1000]).argmax(1) == yte[i:i + 1000]).sum().item()
    acc = correct / len(xte)
    res = {"impl": "pytorch-eager-gpu", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "tf32": a.tf32, "steps": step, "images_per_s": round(ips, 1), "test_accuracy": acc}
    print(f"pytorch eager on {res['device']}: {step} steps, {ips:.0f} images/s, test accuracy {acc:.4f}", flush=True)
    if a.json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
