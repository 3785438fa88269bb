#!/usr/bin/python3
"""PyTorch DDP peer benchmark for mnist_mpi.

Trains the same networks as mnist_mpi with torch.distributed
DistributedDataParallel on the gloo backend, as N local processes started with
torch.multiprocessing.spawn, and reports throughput, test accuracy, start-up
time and peak RSS per rank. Either one of two built-in recipes ("tiny" and
"lenet", --model), or any of mnist_mpi's config files (--config): the model is
then built from the file's layer spec, and the initialisers, optimiser,
learning-rate schedule, batch, budget and the data order are mnist_mpi's
(its sampler's permutation, ported below).

Run with the Debian interpreter (python3-torch, python3-numpy):
    /usr/bin/python3 bench/torch_ddp.py --model tiny --ranks 2 --json
    /usr/bin/python3 bench/torch_ddp.py --config configs/fast.ini --ranks 2 --seed 1
"""
import time

_T_SCRIPT = time.time()  # before importing torch

import argparse
import json
import os
import resource
import socket
import sys


def _proc_start_time(pid="self"):
    """Wall-clock (epoch) time at which process `pid` was started, from /proc; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()
        start_ticks = int(fields[19])  # field 22 overall: starttime, in clock ticks since boot
        with open("/proc/stat") as f:
            btime = next(int(l.split()[1]) for l in f if l.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except Exception:
        return None


MODEL_DEFAULTS = {
    # per_rank_batch: batch is per rank (global = per_rank * ranks); otherwise global.
    "tiny": dict(epochs=2, lr=0.01, lr_decay=0.7, lr_floor=1e-5, batch=128, per_rank_batch=True),
    "lenet": dict(epochs=1, lr=1e-3, lr_decay=1.0, lr_floor=0.0, batch=100, per_rank_batch=False),
}
N_TRAIN = 55000  # first 55000 training images are trained on; the last 5000 are validation
N_VAL = 5000
WARMUP_STEPS = 10  # steps excluded from the steady throughput


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="tiny")
    p.add_argument("--config", default=None,
                   help="an mnist_mpi config file: its model spec, initialisers, optimiser, schedule, batch and "
                        "epochs (instead of --model's recipe); the command line's --epochs, --max-steps and batch win")
    p.add_argument("--ranks", type=int, default=2, help="number of local processes (world size)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each rank")
    p.add_argument("--epochs", type=int, default=None, help="default: tiny 2, lenet 1")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many global steps (0 = no limit)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-dir", default="data/mnist")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batch-size", type=int, default=None, help="per-rank batch (global = this * ranks)")
    g.add_argument("--global-batch-size", type=int, default=None, help="global batch (must divide by ranks)")
    p.add_argument("--json", action="store_true", help="print one final JSON line (last line of stdout)")
    p.add_argument("--rank", type=int, default=None,
                   help="run only this rank, started by someone else (one process per node: bench/network.sh); "
                        "with --master")
    p.add_argument("--master", default=None, help="ADDRESS:PORT of rank 0, with --rank")
    p.add_argument("--json-file", default=None, help="also write the final JSON object to this file")
    p.add_argument("--val", action="store_true", help="also evaluate the 5000 validation images at the end")
    p.add_argument("--hook", default="none",
                   help="DDP's communication hook: none, bf16 (bf16_compress_hook: CUDA and NCCL only), fp16 "
                        "(fp16_compress_hook), powersgd:RANK (powerSGD_hook with error feedback and warm start, its "
                        "defaults) or batched_powersgd:RANK (batched_powerSGD_hook: one matrix per bucket)")
    p.add_argument("--compression-start-steps", type=int, default=2,
                   help="powersgd: start_powerSGD_iter (at least 2, DDP's own floor)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="the test set is evaluated every N steps, every rank a share (not counted as training time; 0 = only at the end)")
    p.add_argument("--target-accuracy", type=float, default=0.0,
                   help="stop when the validation accuracy, checked every --eval-every steps (every rank a share) and at each "
                        "epoch's end, reaches this fraction (mnist_mpi's --target-accuracy; then the periodic "
                        "evaluation is of the validation split, not the test split; 0 = off)")
    a = p.parse_args(argv)
    a.recipe = read_config(a.config) if a.config else None
    if a.recipe:
        r = a.recipe
        if a.epochs is None:
            a.epochs = int(r.get("epochs", 1))
        if a.max_steps == 0:
            a.max_steps = int(r.get("max-steps", 0))
        if a.batch_size is None and a.global_batch_size is None:
            a.global_batch_size = recipe_global_batch(r, a.ranks)
    d = MODEL_DEFAULTS[a.model]
    if a.ranks < 1 or a.threads < 1:
        p.error("--ranks and --threads must be >= 1")
    if not 0.0 <= a.target_accuracy <= 1.0:
        p.error("--target-accuracy must be in [0, 1] (0 = off)")
    if a.epochs is None:
        a.epochs = d["epochs"]
    if a.batch_size is not None:
        a.global_batch = a.batch_size * a.ranks
    elif a.global_batch_size is not None:
        a.global_batch = a.global_batch_size
    elif d["per_rank_batch"]:
        a.global_batch = d["batch"] * a.ranks
    else:
        a.global_batch = d["batch"]
    if a.global_batch % a.ranks != 0:
        p.error(f"global batch {a.global_batch} is not divisible by {a.ranks} ranks")
    a.local_batch = a.global_batch // a.ranks
    if a.global_batch > N_TRAIN:
        p.error("global batch larger than the training set")
    return a


# --------------------------------------------------------------------------- data
def read_idx(path):
    import numpy as np
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # gzip
        import gzip
        raw = gzip.decompress(raw)
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    return data.reshape(dims)


def find_file(data_dir, stem):
    for name in (stem, stem.replace("-idx", ".idx"), stem + ".gz", stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{stem} not found in {data_dir}")


def load_mnist(data_dir):
    import numpy as np
    xtr = read_idx(find_file(data_dir, "train-images-idx3-ubyte"))
    ytr = read_idx(find_file(data_dir, "train-labels-idx1-ubyte"))
    xte = read_idx(find_file(data_dir, "t10k-images-idx3-ubyte"))
    yte = read_idx(find_file(data_dir, "t10k-labels-idx1-ubyte"))
    assert xtr.shape[0] == N_TRAIN + N_VAL and xte.shape[0] == 10000

    def img(x):
        return (x.astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)

    def lab(y):
        return y.astype(np.int64)

    return dict(
        train=(img(xtr[:N_TRAIN]), lab(ytr[:N_TRAIN])),
        val=(img(xtr[N_TRAIN:]), lab(ytr[N_TRAIN:])),
        test=(img(xte), lab(yte)),
    )


def epoch_permutation(seed, epoch, n):
    """One global permutation per epoch, a function of (seed, epoch) only: identical on every rank."""
    import numpy as np
    return np.random.default_rng([seed, epoch]).permutation(n)


# mnist_mpi's sampler (src/data/sampler.cpp, include/mnist_mpi/rng.hpp): a Fisher-Yates shuffle whose
# swap partner of position i is key(seed, 0x5A3, epoch, i) % (i + 1), key a chain of splitmix64
# finalisers. With --config the PyTorch side reads the images in this order, mnist_mpi's own.
_M64 = (1 << 64) - 1


def _mix(z):  # numpy uint64 arrays, wrapping like C++
    import numpy as np
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def mnist_mpi_permutation(seed, epoch, n):
    import numpy as np
    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint64)
        h = _mix(np.full(n, seed & _M64, dtype=np.uint64))
        h = _mix(h ^ np.uint64(0x5A3))
        h = _mix(h ^ np.uint64(epoch))
        h = _mix(h ^ i)
        h = _mix(h ^ np.uint64(0))
        j = (h % (i + np.uint64(1))).astype(np.int64)
    p = list(range(n))
    for k in range(n - 1, 0, -1):
        jj = int(j[k])
        p[k], p[jj] = p[jj], p[k]
    return np.array(p, dtype=np.int64)


# --------------------------------------------------------------------------- recipes from config files
def read_config(path):
    """mnist_mpi's config file: KEY = VALUE lines, '#' comments (docs/usage.md)."""
    r = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                k, _, v = line.partition("=")
                r[k.strip()] = v.strip()
    if "model" not in r:
        sys.exit(f"torch_ddp.py: {path} has no model")
    return r


def recipe_global_batch(r, ranks):
    """A config's global batch as mnist_mpi reads it: global-batch-size, else batch-size per rank times
    the ranks, else mnist_mpi's default of 100 (kDefaultGlobalBatch)."""
    if int(r.get("global-batch-size", 0)) > 0:
        return int(r["global-batch-size"])
    if int(r.get("batch-size", 0)) > 0:
        return int(r["batch-size"]) * ranks
    return 100


def recipe_model(r):
    """A config's model with its initialisers (mnist_mpi's defaults: truncated_normal:0.1, zeros)."""
    return model_from_spec(r["model"], r.get("weight-init", "truncated_normal:0.1"), r.get("bias-init", "zeros"))


def model_from_spec(spec, weight_init, bias_init):
    """The layer spec of src/model/spec.cpp as an nn.Sequential on a 1 x 28 x 28 input: conv:KxK:C[:same|
    valid][:sS] (same padding with stride 1 only, split as TensorFlow's SAME), maxpool:K[:S], relu,
    flatten, fc:N, dropout:P. Initialisers as mnist_mpi's: he (normal, fan-in), xavier (uniform),
    truncated_normal:STD and normal:STD for weights; zeros and constant:V."""
    import torch.nn as nn
    import torch.nn.functional as F
    c, h, w = 1, 28, 28
    layers = []
    for token in spec.split(","):
        f = token.split(":")
        if f[0] == "conv":
            kh, kw = (int(x) for x in f[1].split("x")) if "x" in f[1] else (int(f[1]),) * 2
            out, same, stride = int(f[2]), True, 1
            for x in f[3:]:
                if x in ("same", "valid"):
                    same = x == "same"
                elif x.startswith("s"):
                    stride = int(x[1:])
            if same and stride != 1:
                sys.exit(f"torch_ddp.py: {token}: same padding with a stride is not built here")
            conv = nn.Conv2d(c, out, (kh, kw), stride=stride)
            if same and (kh > 1 or kw > 1):
                pad = (((kw - 1) // 2, kw // 2, (kh - 1) // 2, kh // 2))
                layers += [nn.ZeroPad2d(pad), conv]
            else:
                layers.append(conv)
                h, w = (h - kh) // stride + 1, (w - kw) // stride + 1
            c = out
        elif f[0] == "maxpool":
            k = int(f[1])
            st = int(f[2]) if len(f) > 2 else k
            layers.append(nn.MaxPool2d(k, st))
            h, w = (h - k) // st + 1, (w - k) // st + 1
        elif f[0] == "relu":
            layers.append(nn.ReLU())
        elif f[0] == "flatten":
            layers.append(nn.Flatten())
            c, h, w = c * h * w, 1, 1
        elif f[0] == "fc":
            if h * w != 1:
                layers.append(nn.Flatten())
                c, h, w = c * h * w, 1, 1
            layers.append(nn.Linear(c, int(f[1])))
            c = int(f[1])
        elif f[0] == "dropout":
            layers.append(nn.Dropout(float(f[1])))
        else:
            sys.exit(f"torch_ddp.py: unknown layer {token!r} in the model spec")
    m = nn.Sequential(*layers)

    def init(t, text):
        kind, _, v = text.partition(":")
        if kind == "he":
            nn.init.kaiming_normal_(t, mode="fan_in", nonlinearity="relu")
        elif kind in ("xavier", "glorot"):
            nn.init.xavier_uniform_(t)
        elif kind == "truncated_normal":
            std = float(v or 0.1)
            nn.init.trunc_normal_(t, mean=0.0, std=std, a=-2 * std, b=2 * std)
        elif kind == "normal":
            nn.init.normal_(t, 0.0, float(v or 0.1))
        elif kind == "zeros":
            nn.init.zeros_(t)
        elif kind == "constant":
            nn.init.constant_(t, float(v or 0.0))
        else:
            sys.exit(f"torch_ddp.py: unknown initialiser {text!r}")

    for mod in m.modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            init(mod.weight, weight_init)
            init(mod.bias, bias_init)
    return m


def recipe_lr(r, step, epoch, total_steps):
    """learning_rate() of src/train/optimizer.cpp."""
    import math
    kind = r.get("lr-schedule", "constant")
    base, warmup = float(r.get("lr", 1e-3)), int(r.get("warmup-steps", 0))
    lo = float(r.get("lr-min", 0.0))
    lr = base
    if kind == "step":
        k = math.floor(epoch / float(r.get("lr-step-epochs", 1)))
        lr = max(base * float(r.get("lr-gamma", 0.1)) ** k, lo)
    elif kind == "cosine":
        span = float(max(total_steps - warmup, 1))
        t = min(max((step - warmup) / span, 0.0), 1.0)
        lr = lo + 0.5 * (base - lo) * (1.0 + math.cos(math.pi * t))
    elif kind != "constant":
        sys.exit(f"torch_ddp.py: unknown lr-schedule {kind!r}")
    if step < warmup:
        lr *= (step + 1) / warmup
    return lr


def recipe_optimizer(r, params):
    import torch
    kind, lr, wd = r.get("optimizer", "adam"), float(r.get("lr", 1e-3)), float(r.get("weight-decay", 0.0))
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(float(r.get("beta1", 0.9)), float(r.get("beta2", 0.999))),
                                eps=float(r.get("eps", 1e-8)), weight_decay=wd)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(r.get("momentum", 0.0)),
                               nesterov=r.get("nesterov", "false") in ("true", "1", "yes", "on"), weight_decay=wd)
    sys.exit(f"torch_ddp.py: unknown optimizer {kind!r}")


# --------------------------------------------------------------------------- models
def build_model(name):
    import torch
    import torch.nn as nn

    if name == "tiny":
        m = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
        )
        for mod in m.modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(mod.weight)
                nn.init.zeros_(mod.bias)
    elif name == "lenet":
        m = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 1024), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(1024, 10),
        )
        for mod in m.modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(mod.weight, mean=0.0, std=0.1, a=-0.2, b=0.2)
                nn.init.zeros_(mod.bias)
    else:
        raise ValueError(name)
    return m


def eval_sums(model, x, y, first, end, batch):
    """(correct, loss sum) over images [first, end) in batches of `batch`, in eval mode."""
    import torch
    import torch.nn.functional as F
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for i in range(first, end, batch):
            xb = torch.from_numpy(x[i:min(i + batch, end)])
            yb = torch.from_numpy(y[i:min(i + batch, end)])
            out = model(xb)
            loss_sum += F.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
    model.train()
    return correct, loss_sum


def evaluate(model, x, y, batch=1000):
    correct, loss_sum = eval_sums(model, x, y, 0, len(x), batch)
    return correct / len(x), loss_sum / len(x)


def evaluate_shared(model, x, y, rank, world, batch=1000):
    """mnist_mpi's evaluation (Note [Every rank evaluates a share] in src/train/evaluator.cpp): each
    rank evaluates a contiguous run of whole batches, and one all_reduce of (correct, loss sum)
    gives every rank the split's accuracy and mean loss."""
    import torch
    import torch.distributed as dist
    batches = (len(x) + batch - 1) // batch
    first, end = batches * rank // world * batch, min(batches * (rank + 1) // world * batch, len(x))
    sums = torch.tensor(eval_sums(model, x, y, first, end, batch), dtype=torch.float64)
    dist.all_reduce(sums)
    return sums[0].item() / len(x), sums[1].item() / len(x)


# --------------------------------------------------------------------------- worker
def worker(rank, args, port, t_launcher):
    t_rank_start = _proc_start_time() or time.time()
    os.environ["MASTER_ADDR"] = args.master.rsplit(":", 1)[0] if args.master else "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    world = args.ranks
    d = MODEL_DEFAULTS[args.model]

    data = load_mnist(args.data_dir)
    xtr, ytr = data["train"]

    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    r = args.recipe
    if r:
        model = recipe_model(r)
    else:
        model = build_model(args.model)
    ddp = DDP(model)
    if args.hook == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook.startswith("powersgd") or args.hook.startswith("batched_powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        rank_r = int(args.hook.split(":")[1]) if ":" in args.hook else 2
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                   start_powerSGD_iter=max(2, args.compression_start_steps))
        hook = psgd.batched_powerSGD_hook if args.hook.startswith("batched") else psgd.powerSGD_hook
        ddp.register_comm_hook(state, hook)
    elif args.hook != "none":
        raise SystemExit("torch_ddp.py: --hook must be none, bf16, fp16, powersgd[:RANK] or batched_powersgd[:RANK], got "
                         + args.hook)
    torch.manual_seed(args.seed * 1000 + rank + 1)  # per-rank dropout masks
    opt = recipe_optimizer(r, ddp.parameters()) if r else torch.optim.Adam(ddp.parameters(), lr=d["lr"])

    steps_per_epoch = N_TRAIN // args.global_batch  # drop the last partial batch
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps) if args.epochs > 0 else args.max_steps
    lo, hi = rank * args.local_batch, (rank + 1) * args.local_batch

    step = 0
    t_first_step = None
    t_steady_start = None  # time at the start of step WARMUP_STEPS (or of step 0 if too few steps)
    train_time = 0.0  # time spent in training steps only, from the steady start
    last_loss = float("nan")
    lr = d["lr"]
    epoch = 0
    evals = []  # [step, test accuracy] every --eval-every steps; validation with a target
    target = None  # where --target-accuracy was reached: step, wall time, validation accuracy
    done = total_steps == 0
    while not done:
        perm = mnist_mpi_permutation(args.seed, epoch, N_TRAIN) if r else epoch_permutation(args.seed, epoch, N_TRAIN)
        for s in range(steps_per_epoch):
            if step >= total_steps:
                done = True
                break
            t0 = time.perf_counter()
            if t_first_step is None:
                t_first_step = time.time()
            idx = perm[s * args.global_batch + lo: s * args.global_batch + hi]
            xb = torch.from_numpy(xtr[idx])
            yb = torch.from_numpy(ytr[idx])
            if r:
                for g in opt.param_groups:
                    g["lr"] = recipe_lr(r, step, epoch, total_steps)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            opt.step()
            last_loss = loss.item()
            t1 = time.perf_counter()
            if step >= WARMUP_STEPS or total_steps <= WARMUP_STEPS:
                train_time += t1 - t0
            step += 1
            eval_due = args.eval_every > 0 and step % args.eval_every == 0 and step < total_steps
            if args.target_accuracy > 0:
                # mnist_mpi's rule: the validation split is checked every --eval-every steps and at
                # each epoch's end, every rank evaluating a share, so every rank learns the same
                # accuracy and makes the same decision.
                if eval_due or s == steps_per_epoch - 1:
                    val_acc_now = evaluate_shared(model, *data["val"], rank, world)[0]
                    evals.append([step, round(val_acc_now, 6)])
                    if val_acc_now >= args.target_accuracy:
                        target = dict(step=step, time=time.time(), val=val_acc_now)
                        done = True
                        break
            elif eval_due:
                evals.append([step, round(evaluate_shared(model, *data["test"], rank, world)[0], 6)])
        else:
            epoch += 1
            if not r:  # a recipe's schedule sets the rate per step
                lr = max(lr * d["lr_decay"], d["lr_floor"])
                for g in opt.param_groups:
                    g["lr"] = lr
            if step >= total_steps:
                done = True
    timed_steps = step - WARMUP_STEPS if total_steps > WARMUP_STEPS else step
    epochs_done = step / steps_per_epoch

    result = None
    t_eval = time.perf_counter()
    test_acc, test_loss = evaluate_shared(model, *data["test"], rank, world)  # every rank, a share each
    t_eval = time.perf_counter() - t_eval
    if rank == 0:
        evals.append([step, round(test_acc, 6)])
        val_acc, val_loss = evaluate(model, *data["val"]) if args.val else (None, None)
        ips = timed_steps * args.global_batch / train_time if train_time > 0 else 0.0
        result = {
            "impl": "pytorch",
            "model": args.config or args.model,
            "ranks": world,
            "threads": args.threads,
            "global_batch": args.global_batch,
            "steps": step,
            "epochs": round(epochs_done, 4),
            "images_per_s": round(ips, 2),
            "test_accuracy": round(test_acc, 6),
            "test_loss": round(test_loss, 6),
            "val_accuracy": None if val_acc is None else round(val_acc, 6),
            "last_train_loss": round(last_loss, 6),
            # from the launcher process start (python + torch import + spawn) to step 0 begun on rank 0
            "startup_s": round(t_first_step - t_launcher, 3) if t_first_step else None,
            # from rank 0's own process start to step 0 begun
            "rank0_startup_s": round(t_first_step - t_rank_start, 3) if t_first_step else None,
            "timed_steps": timed_steps,
            "train_time_s": round(train_time, 3),
            "test_eval_s": round(t_eval, 3),
            "evals": evals,
            "target_accuracy": args.target_accuracy if args.target_accuracy > 0 else None,
            "target_reached": target is not None,
            "target_step": target["step"] if target else None,
            "target_validation_accuracy": round(target["val"], 6) if target else None,
            # from the launcher process start (start-up included) to the stop decision on rank 0
            "time_to_target_s": round(target["time"] - t_launcher, 3) if target else None,
            "seed": args.seed,
            "torch": torch.__version__,
            "blas": blas_library(),
        }
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    rss = [None] * world
    dist.all_gather_object(rss, round(rss_mb, 1))
    if rank == 0:
        result["peak_rss_mb"] = rss
        result["wall_s"] = round(time.time() - t_launcher, 3)
        print(f"pytorch {args.config or args.model}: ranks={world} threads={args.threads} global_batch={args.global_batch} "
              f"steps={step} ({epochs_done:.2f} epochs) images/s={result['images_per_s']:.1f} "
              f"test_acc={test_acc:.4f} test_loss={test_loss:.4f} startup={result['startup_s']}s "
              f"peak_rss_mb={rss}", flush=True)
        if args.json_file:
            with open(args.json_file, "w") as f:
                f.write(json.dumps(result) + "\n")
        if args.json:
            print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without Python's teardown: PyTorch 1.13 can deadlock when the DDP object is freed at
    # exit (its Reducer's destructor joins a gloo thread that waits for the GIL the main thread
    # holds; seen with gdb in 1 of ~6 runs, the process spinning at 100 % until killed). Every
    # result is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def blas_library():
    """The BLAS shared object this process actually mapped (Debian switches it via alternatives)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {l.split()[-1] for l in f if "blas" in l.lower() and "/" in l}
        return ",".join(sorted(os.path.realpath(x) for x in libs)) or None
    except OSError:
        return None


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    t_launcher = _proc_start_time() or _T_SCRIPT
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        try:
            find_file(args.data_dir, name)
        except FileNotFoundError as e:
            sys.exit(f"torch_ddp.py: {e}")
    # Children inherit this; keeps OpenMP/MKL pools at --threads before torch is imported there.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.rank is not None:  # one rank of a job whose ranks are started apart (on nodes of their own)
        if not args.master or not 0 <= args.rank < args.ranks:
            sys.exit("torch_ddp.py: --rank R needs 0 <= R < --ranks and --master ADDRESS:PORT")
        worker(args.rank, args, int(args.master.rsplit(":", 1)[1]), t_launcher)
        return
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args, free_port(), t_launcher), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
