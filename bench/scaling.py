#!/usr/bin/env python3
"""Note [The step's alpha-beta model]
An alpha-beta model of a data-parallel step, fitted on bench/network.sh's measurements, checked
on the points it was not fitted on, and projected to 8-1,024 ranks (docs/scaling.md).

The model (Note [The step's alpha-beta model]):
  - a sum of b bytes over n ranks (ring reduce-scatter + all-gather, what Open MPI's TCP allreduce
    and the sharded optimiser's pair move) takes t(b) = 2(n-1) alpha + 2(n-1)/n b beta, alpha the
    per-message latency and beta the time per byte on the link; both fitted per link on the
    communicator's sums of 1 KB-16 MB (reducer_bench --sizes, 2 ranks: t = 2 alpha + b beta);
  - the gradient is cut into buckets as src/train/reducer.cpp's plan_buckets cuts it; bucket k is
    ready when backward has passed its lowest layer (the layer times from the --timeline file,
    scaled to the run's backward), and the sums run one after another as the buckets become ready;
    exposed communication = when the last sum ends - when backward ends (no overlap: the whole
    buffer's sum after backward);
  - a run's compute (step minus exposed communication) is taken from the same run unshaped.
Nothing of the training runs is fitted: every shaped run is held out, and the error is the
predicted step time's, as a fraction of the measured one (docs/scaling.md).

Usage:
  bench/scaling.py check [bench/network.tsv]          the fit and the held-out errors
  bench/scaling.py project LINK RANKS [--model lenet|fast] [--gpu] [--bucket-mb MB] [--fit TSV]
  bench/scaling.py table [bench/network.tsv]          docs/scaling.md's projection table
LINK: 10gbit, 25gbit, 100gbit, 400gbit, ...
"""
import builtins
import csv
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MB = 1048576.0
MODELS = {  # the configs' layer specs (configs/lenet.ini, configs/fast.ini)
    "lenet": "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10",
    "fast": "conv:5x5:16:same,relu,maxpool:2,conv:3x3:32:same,relu,maxpool:2,flatten,fc:256,relu,fc:10",
}
# GPU ranks: lenet's step on one H200, 100 images, --cuda-graph, fp32: 136,447 images/s
# (docs/gpu.md) = 0.733 ms, of which backward is taken as the CPU's share (the timeline's).
GPU_STEP_MS = {"lenet": 100 / 136447 * 1e3}
# Links the projection assumes (not measured here): per-message latency and the fraction of the
# line rate a large sum reaches. CPU ranks on Ethernet with TCP; GPU ranks with NCCL on RDMA.
ASSUMED = {"cpu": (25e-6, 0.90), "gpu": (5e-6, 0.90)}


def layer_params(spec):
    """[(layer index, [tensor sizes])] of a model spec on 1x28x28 inputs, weights before biases."""
    c, h, w = 1, 28, 28
    out = []
    for i, l in enumerate(spec.split(",")):
        parts = l.split(":")
        if parts[0] == "conv":
            k = [int(x) for x in parts[1].split("x")]
            oc = int(parts[2])
            out.append((i, [k[0] * k[1] * c * oc, oc]))
            c = oc
        elif parts[0] == "maxpool":
            s = int(parts[1])
            h, w = h // s, w // s
        elif parts[0] == "flatten":
            c, h, w = c * h * w, 1, 1
        elif parts[0] == "fc":
            n = int(parts[1])
            out.append((i, [c * n, n]))
            c = n
    return out


def plan_buckets(spec, cap_mb, first_mb):
    """[(floats, ready_after_layer)] as src/train/reducer.cpp's plan_buckets: flat order is the last
    layer first; a tensor that does not fit closes the bucket, an empty bucket splits it at the cap."""
    cap, first = int(cap_mb * MB / 4), int(first_mb * MB / 4)
    tensors = [(layer, n) for layer, sizes in reversed(layer_params(spec)) for n in sizes]
    out, cur, ready = [], 0, 1 << 30
    for layer, n in tensors:
        left = n
        while left > 0:
            limit = first if not out else cap
            if cur > 0 and cur + left > limit:
                out.append((cur, ready))
                cur, ready = 0, 1 << 30
                limit = cap
            take = min(left, limit - cur)
            cur += take
            ready = min(ready, layer)
            left -= take
            if cur == limit and left > 0:
                out.append((cur, ready))
                cur, ready = 0, 1 << 30
    if cur:
        out.append((cur, ready))
    return out


def backward_profile(timeline):
    """layer index -> the fraction of backward done when that layer's backward ends (rank 0, steps 10+)."""
    ev = json.load(open(timeline))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    dur = {}
    for e in ev:
        m = re.match(r"backward (\d+) ", e.get("name", ""))
        if m and e.get("pid") == 0 and e["args"].get("step", 0) >= 10:
            dur.setdefault(int(m.group(1)), []).append(e["dur"])
    mean = {i: sum(v) / len(v) for i, v in dur.items()}
    total = sum(mean.values())
    done, frac = 0.0, {}
    for i in sorted(mean, reverse=True):
        done += mean[i]
        frac[i] = done / total
    return frac  # empty: every bucket ready at the end of backward


def sum_time(b, n, alpha, beta):
    """Seconds for a sum of b bytes over n ranks on an unshaped link: ring 2(n-1) alpha + 2(n-1)/n b beta."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * b * beta


class Link:
    """A link as the sums see it: alpha (s) per message and beta (s) per byte, t = 2(n-1) alpha +
    2(n-1)/n b beta."""

    def __init__(self, alpha, beta):
        self.alpha, self.beta = alpha, beta

    def sums(self, buckets, n):
        """[(ready s, bytes)] in order -> when the last sum ends (s), each starting when its bucket
        is ready and the one before it has ended."""
        end = 0.0
        for ready, b in buckets:
            end = max(ready, end) + sum_time(b, n, self.alpha, self.beta)
        return end


def exposed_ms(buckets, profile, backward_ms, link, n, overlap=True):
    """Exposed communication (ms): the sums of the buckets, [(floats, ready_after_layer)], after
    backward ends (backward_ms, its layers' ends as the profile's fractions)."""
    ready = [((profile.get(layer, 1.0) if overlap else 1.0) * backward_ms / 1e3, floats * 4) for floats, layer in buckets]
    return max(0.0, 1e3 * link.sums(ready, n) - backward_ms)


def least_squares(pts):
    """(intercept, slope) of the points' least-squares line."""
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts) or 1.0
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return my - slope * mx, slope


FIT_MAX_BYTES = 4 * MB  # the sizes the buckets have (the default cap); 16 MB sums are checked, not fitted


def fit_links(rows):
    """link -> Link, from its "sum" rows (2 ranks: t = 2 alpha + b beta), sizes up to 4 MB."""
    by = {}
    for r in rows:
        if r["kind"] == "sum" and float(r["bytes"]) <= FIT_MAX_BYTES:
            by.setdefault(r["link"], []).append((float(r["bytes"]), float(r["step_ms"]) / 1e3))
    out = {}
    for l, pts in by.items():
        a, beta = least_squares(pts)
        out[l] = Link(max(a, 1e-7) / 2, max(beta, 1e-13))
    return out


def load(tsv):
    rows = list(csv.DictReader(open(tsv), delimiter="\t"))
    links = list(dict.fromkeys(r["link"] for r in rows))
    fits = fit_links(rows)
    train = {(r["link"], r["name"]): r for r in rows if r["kind"] == "train" and r["backward_ms"]}
    base = os.path.splitext(tsv)[0]
    profiles = {}
    for m in MODELS:
        p = f"{base}.{m}.timeline.json"
        profiles[m] = backward_profile(p) if os.path.exists(p) else None
    return links, fits, train, profiles


def variant(name):
    """(model, bucket cap MB, first bucket MB, overlap) of a bench/network.sh run name."""
    model = name.split("_")[0]
    cap, first, overlap = 4.0, 1.0, "no_overlap" not in name
    m = re.search(r"_(\d+)mb", name)
    if m:
        cap = first = float(m.group(1))
    return model, cap, first, overlap


def predict(link, name, fits, train, profiles):
    """Predicted step ms of run NAME on LINK: the same run's compute unshaped (its step less its
    exposed communication), and the sums of its buckets on the link as fitted."""
    model, cap, first, overlap = variant(name)
    un = train[("unshaped", name)]
    compute = float(un["step_ms"]) - float(un["exposed_ms"])
    buckets = plan_buckets(MODELS[model], cap, first)
    prof = profiles.get(model) or profiles.get("lenet") or {}
    return compute + exposed_ms(buckets, prof, float(un["backward_ms"]), fits[link], 2, overlap)


def check(tsv, quiet=False):
    """Prints each link's fit and every shaped run's measured and predicted step (unless quiet);
    returns the fit."""
    links, fits, train, profiles = load(tsv)
    print = (lambda *a, **k: None) if quiet else builtins.print  # noqa: A001
    print("per link, fitted on the communicator's sums of 1 KB-4 MB on 2 ranks (t = 2 alpha + b beta):")
    for l in links:
        k = fits[l]
        eff = "" if l == "unshaped" else ", %.0f %% of the line rate" % (100 * 8 / k.beta / rate_bits(l))
        print("  %-9s alpha %6.1f us, 1/beta %6.3f Gbit/s%s" % (l, k.alpha * 1e6, 8 / k.beta / 1e9, eff))
    print("%-18s %-9s %10s %10s %7s" % ("run (held out)", "link", "measured", "predicted", "error"))
    errors = []
    for (l, n), r in sorted(train.items(), key=lambda x: (x[0][1], links.index(x[0][0]))):
        if l == "unshaped":
            continue
        p = predict(l, n, fits, train, profiles)
        m = float(r["step_ms"])
        errors.append(abs(p / m - 1))
        print("%-18s %-9s %8.1f ms %8.1f ms %+6.1f%%" % (n, l, m, p, 100 * (p / m - 1)))
    if errors:
        print("held-out points: %d, mean |error| %.1f %%, largest %.1f %%, within 15 %%: %d of %d" % (
            len(errors), 100 * sum(errors) / len(errors), 100 * max(errors), sum(e <= 0.15 for e in errors),
            len(errors)))
    return fits, train, profiles


def rate_bits(link):
    m = re.fullmatch(r"([0-9.]+)([kmg])bit", link)
    if not m:
        sys.exit(f"scaling.py: a link like 25gbit, not '{link}'")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def measured_efficiency(fits):
    """The fraction of a shaped link's rate the sums reached (1/beta against the rate), the median
    over the shaped links: what a CPU rank's TCP gets of a link."""
    effs = sorted(8 / k.beta / rate_bits(l) for l, k in fits.items() if l != "unshaped")
    return effs[len(effs) // 2] if effs else ASSUMED["cpu"][1]


def project(link, n, model="lenet", gpu=False, cap=None, fitted=None):
    """(step ms, compute ms, exposed ms, best bucket MB) for N ranks on LINK, weak scaling (the
    per-rank batch of the measured 2-rank run, or 100 images a GPU). CPU ranks: the latency
    ASSUMED gives Ethernet TCP and the efficiency measured on the shaped links; GPU ranks: ASSUMED's."""
    fits, train, profiles = fitted
    alpha, eff = ASSUMED["gpu" if gpu else "cpu"]
    if not gpu:
        eff = measured_efficiency(fits)
    real = Link(alpha, 8 / (rate_bits(link) * eff))
    if gpu:
        compute = GPU_STEP_MS[model]
        backward = compute * 2 / 3
    else:
        un = train[("unshaped", model)]
        compute = float(un["step_ms"]) - float(un["exposed_ms"])
        backward = float(un["backward_ms"])
    prof = profiles.get(model) or profiles.get("lenet") or {}
    best = None
    for mb in ([cap] if cap else [0.25, 1, 4, 16, 64]):
        buckets = plan_buckets(MODELS[model], mb, min(mb, 1.0))
        ex = exposed_ms(buckets, prof, backward, real, n)
        if best is None or compute + ex < best[0]:
            best = (compute + ex, compute, ex, mb)
    return best


def main(argv):
    if not argv or argv[0] not in ("check", "project", "table"):
        sys.exit(__doc__)
    tsv = os.path.join(HERE, "network.tsv")
    if argv[0] == "check":
        check(argv[1] if len(argv) > 1 else tsv)
        return
    if argv[0] == "project":
        args = argv[1:]
        opts = {"--model": "lenet", "--bucket-mb": None, "--fit": tsv}
        gpu = "--gpu" in args
        args = [a for a in args if a != "--gpu"]
        pos = []
        while args:
            a = args.pop(0)
            if a in opts:
                opts[a] = args.pop(0)
            else:
                pos.append(a)
        if len(pos) != 2:
            sys.exit(__doc__)
        fitted = check(opts["--fit"], quiet=True)
        n = int(pos[1])
        step, compute, ex, mb = project(pos[0], n, opts["--model"], gpu, float(opts["--bucket-mb"]) if opts["--bucket-mb"] else None, fitted)
        print("%s ranks of %s on %s: step %.2f ms (compute %.2f, exposed communication %.2f), scaling efficiency %.0f %%, "
              "bucket %g MB" % (n, "GPU" if gpu else "CPU", pos[0], step, compute, ex, 100 * compute / step, mb))
        return
    fitted = check(argv[1] if len(argv) > 1 else tsv, quiet=True)
    worlds = [8, 16, 32, 64, 128, 256, 512, 1024]
    for model, gpu, link in [("lenet", False, "10gbit"), ("lenet", False, "25gbit"), ("fast", False, "10gbit"),
                             ("fast", False, "25gbit"), ("lenet", True, "100gbit"), ("lenet", True, "400gbit")]:
        res = [project(link, n, model, gpu, None, fitted) for n in worlds]
        dominated = next((n for n, r in zip(worlds, res) if r[2] > r[1]), None)
        print("| %s, %s ranks, %s | %s | %s |" % (
            model, "GPU" if gpu else "CPU", link,
            " | ".join("%.2f ms, %.0f %%, %g MB" % (r[0], 100 * r[1] / r[0], r[3]) for r in res),
            f"{dominated}" if dominated else "beyond 1,024"))


if __name__ == "__main__":
    main(sys.argv[1:])
