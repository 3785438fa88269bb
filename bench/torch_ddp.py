#!/usr/bin/python3
"""PyTorch DDP peer benchmark for mnist_mpi.

Trains the same two networks as mnist_mpi ("tiny" and "lenet") with
torch.distributed DistributedDataParallel on the gloo backend, as N local
processes started with torch.multiprocessing.spawn, and reports throughput,
test accuracy, start-up time and peak RSS per rank.

Run with the Debian interpreter (python3-torch, python3-numpy):
    /usr/bin/python3 bench/torch_ddp.py --model tiny --ranks 2 --json
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
    p.add_argument("--json-file", default=None, help="also write the final JSON object to this file")
    p.add_argument("--val", action="store_true", help="also evaluate the 5000 validation images at the end")
    p.add_argument("--eval-every", type=int, default=0,
                   help="the test set is evaluated every N steps, every rank a share (not counted as training time; 0 = only at the end)")
    p.add_argument("--target-accuracy", type=float, default=0.0,
                   help="stop when the validation accuracy, checked every --eval-every steps (every rank a share) and at each "
                        "epoch's end, reaches this fraction (mnist_mpi's --target-accuracy; then the periodic "
                        "evaluation is of the validation split, not the test split; 0 = off)")
    a = p.parse_args(argv)
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
    """mnist_mpi's evaluation (Note [Every rank evaluates a share] in src/train/trainer.cpp): each
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
    os.environ["MASTER_ADDR"] = "127.0.0.1"
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
    model = build_model(args.model)
    ddp = DDP(model)
    torch.manual_seed(args.seed * 1000 + rank + 1)  # per-rank dropout masks
    opt = torch.optim.Adam(ddp.parameters(), lr=d["lr"])

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
        perm = epoch_permutation(args.seed, epoch, N_TRAIN)
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
            "model": args.model,
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
        print(f"pytorch {args.model}: ranks={world} threads={args.threads} global_batch={args.global_batch} "
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
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args, free_port(), t_launcher), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
