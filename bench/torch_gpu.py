#!/usr/bin/env python3
"""PyTorch eager baseline on one GPU, for scripts/gpu_check.sh and bench/gpu_fast.sh.

Trains the same network as mnist_mpi's configs/lenet.ini (bench/torch_ddp.py's "lenet": Adam 1e-3,
global batch 100, dropout 0.5, one epoch of the first 55000 training images) on one CUDA device,
or with --config a mnist_mpi config file's recipe (its layer spec, initialisers, optimiser,
schedule, batch and epochs, and mnist_mpi's data order, as bench/torch_ddp.py --config), data
resident on the GPU (no loader in the timing). Prints images/s over the steady steps (the first
10 excluded, synchronised at both ends), the training time from the first step to the last
(synchronised), and the test accuracy. fp32 by default (TF32 off, as mnist_mpi --precision
fp32); --tf32 allows it; --bf16 runs forward and backward under torch.autocast(bfloat16) with
fp32 master weights and optimiser (as mnist_mpi --precision bf16).

    python3 bench/torch_gpu.py --data-dir data/mnist [--config configs/fast.ini] [--seed S]
                               [--epochs N] [--tf32 | --bf16] [--json]
"""
import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ddp  # noqa: E402  (data reading, the model, the permutation, recipes)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data/mnist")
    p.add_argument("--config", default=None, help="a mnist_mpi config file: its recipe instead of lenet's")
    p.add_argument("--epochs", type=int, default=None, help="default: the config's, else 1")
    p.add_argument("--batch-size", type=int, default=None, help="default: the config's global batch, else 100")
    p.add_argument("--seed", type=int, default=42)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tf32", action="store_true")
    g.add_argument("--bf16", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check this script where there is no GPU")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the whole budget)")
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    r = torch_ddp.read_config(a.config) if a.config else None
    batch = a.batch_size or (torch_ddp.recipe_global_batch(r, 1) if r else 100)  # one GPU, one rank
    epochs = a.epochs if a.epochs is not None else (int(r.get("epochs", 1)) if r else 1)
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.backends.cudnn.benchmark = True
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    data = torch_ddp.load_mnist(a.data_dir)
    xtr = torch.from_numpy(data["train"][0]).to(dev)
    ytr = torch.from_numpy(data["train"][1]).to(dev)
    xte = torch.from_numpy(data["test"][0]).to(dev)
    yte = torch.from_numpy(data["test"][1]).to(dev)
    torch.manual_seed(a.seed)
    if r:
        model = torch_ddp.recipe_model(r).to(dev)
        opt = torch_ddp.recipe_optimizer(r, model.parameters())
    else:
        model = torch_ddp.build_model("lenet").to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    autocast = (lambda: torch.autocast(device_type=a.device, dtype=torch.bfloat16)) if a.bf16 else contextlib.nullcontext
    steps_per_epoch = torch_ddp.N_TRAIN // batch
    total_steps = steps_per_epoch * epochs
    max_steps = a.max_steps or (int(r.get("max-steps", 0)) if r else 0)  # the command line's, else the config's
    if max_steps > 0:
        total_steps = min(total_steps, max_steps)
    warm = torch_ddp.WARMUP_STEPS
    step, t_steady, t_first, t_second = 0, None, None, None
    for epoch in range(epochs):
        order = (torch_ddp.mnist_mpi_permutation if r else torch_ddp.epoch_permutation)(a.seed, epoch, torch_ddp.N_TRAIN)
        perm = torch.from_numpy(order).to(dev)
        for s in range(steps_per_epoch):
            if step >= total_steps:
                break
            if step == 0:
                sync()
                t_first = time.perf_counter()
            if step == 1:
                sync()
                t_second = time.perf_counter()
            if step == warm:
                sync()
                t_steady = time.perf_counter()
            if r:
                for grp in opt.param_groups:
                    grp["lr"] = torch_ddp.recipe_lr(r, step, epoch, total_steps)
            idx = perm[s * batch:(s + 1) * batch]
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            step += 1
    sync()
    t_end = time.perf_counter()
    ips = (step - warm) * batch / (t_end - t_steady) if t_steady else float("nan")
    model.eval()
    correct = 0
    with torch.no_grad(), autocast():
        for i in range(0, len(xte), 1000):
            correct += (model(xte[i:i + 1000]).argmax(1) == yte[i:i + 1000]).sum().item()
    acc = correct / len(xte)
    precision = "bf16" if a.bf16 else "tf32" if a.tf32 else "fp32"
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    res = {"impl": "pytorch-eager-gpu", "device": name, "torch": torch.__version__,
           "config": a.config or "lenet", "precision": precision, "tf32": a.tf32, "seed": a.seed, "steps": step,
           "images_per_s": round(ips, 1), "train_s": round(t_end - t_first, 4),
           "train_after_first_step_s": round(t_end - t_second, 4) if t_second else None, "test_accuracy": acc}
    print(f"pytorch eager on {res['device']}, {res['config']}, {precision}, seed {a.seed}: {step} steps, "
          f"{ips:.0f} images/s, training {t_end - t_first:.3f} s, test accuracy {acc:.4f}", flush=True)
    if a.json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
