#!/usr/bin/env python3
"""Reads a mnist_mpi checkpoint with numpy alone (the format: docs/checkpoint.md).

    python3 scripts/read_checkpoint.py runs/ckpt/step-00000200.ckpt          # summary
    python3 scripts/read_checkpoint.py FILE --meta                           # every META field
    python3 scripts/read_checkpoint.py FILE --config                         # the run's options
    python3 scripts/read_checkpoint.py FILE --save weights.npz               # tensors by name

As a module: `ck = read_checkpoint(path)` gives a dict with "meta" (dict), "spec", "config",
"params" (name -> numpy array of its shape), "first_moment" and "second_moment" (same form, the
second empty for SGD), "flat_params" (the flat float32 buffer) and "codec_state" (every rank's
gradient-codec state, one row a rank: bf16's residuals, PowerSGD's residuals then its factors; shape (0, 0)
when its codec kept none) with "codec_shared" (how many of a row's last values are the same on every
rank: PowerSGD's factors). Every section's CRC32C is
checked (verify=False skips it: pure Python does ~20 MB/s).
"""
import struct
import sys

import numpy as np

MAGIC = b"MNISTCKP"
VERSION = 1

# The META section: 240 bytes, little-endian, in this order.
META_DTYPE = np.dtype([
    ("step", "<i8"), ("epoch", "<i8"), ("steps_per_epoch", "<i8"), ("sampler_position", "<i8"),
    ("global_batch", "<i8"), ("train_count", "<i8"), ("total_steps", "<i8"), ("world_size", "<i8"),
    ("seed", "<u8"), ("sampler_epoch", "<i8"), ("dropout_step", "<i8"), ("param_count", "<i8"),
    ("optimizer_steps", "<i8"), ("optimizer_kind", "<u4"), ("nesterov", "<u4"),
    ("beta1", "<f8"), ("beta2", "<f8"), ("eps", "<f8"), ("momentum", "<f8"), ("weight_decay", "<f8"),
    ("schedule_kind", "<u4"), ("reserved", "<u4"),
    ("base_lr", "<f8"), ("gamma", "<f8"), ("step_epochs", "<f8"), ("min_lr", "<f8"), ("warmup_steps", "<i8"),
    ("last_lr", "<f8"), ("next_lr", "<f8"),
    ("validation_accuracy", "<f8"), ("validation_loss", "<f8"), ("train_loss", "<f8"),
])
assert META_DTYPE.itemsize == 240


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data, crc=0):
    """CRC32C (Castagnoli), continuing from crc like the C++ crc32c()."""
    crc ^= 0xFFFFFFFF
    t = _TABLE
    for b in bytes(data):
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


class CheckpointError(Exception):
    pass


def sections(buf, verify=True):
    """Yields (tag, payload memoryview) for every section, checking structure and CRCs."""
    if len(buf) < 16 or buf[:8] != MAGIC:
        raise CheckpointError("not a mnist_mpi checkpoint (no MNISTCKP magic)")
    version, header_crc = struct.unpack_from("<II", buf, 8)
    if verify and crc32c(buf[:12]) != header_crc:
        raise CheckpointError("header fails its CRC32C check")
    if version != VERSION:
        raise CheckpointError("format version %d, this script reads %d" % (version, VERSION))
    at = 16
    view = memoryview(buf)
    while True:
        if len(buf) - at < 16:
            raise CheckpointError("truncated before the END section")
        tag = bytes(buf[at:at + 4]).decode("ascii", "replace")
        crc, length = struct.unpack_from("<IQ", buf, at + 4)
        start = at + 16
        if start + length > len(buf):
            raise CheckpointError("section %r claims %d bytes, only %d follow" % (tag, length, len(buf) - start))
        payload = view[start:start + length]
        if verify:
            c = crc32c(buf[at:at + 4])
            c = crc32c(buf[at + 8:at + 16], c)
            if crc32c(payload, c) != crc:
                raise CheckpointError("section %r fails its CRC32C check" % tag)
        yield tag, payload
        at = start + ((length + 7) & ~7)
        if tag == "END ":
            return


def tensor_index(index):
    """PIDX or SIDX: (name, shape, offset, size) per tensor."""
    (count,) = struct.unpack_from("<I", index, 0)
    q = 4
    tensors = []
    for _ in range(count):
        (nl,) = struct.unpack_from("<I", index, q)
        name = bytes(index[q + 4:q + 4 + nl]).decode()
        q += 4 + nl
        (nd,) = struct.unpack_from("<I", index, q)
        shape = struct.unpack_from("<%dq" % nd, index, q + 4)
        q += 4 + 8 * nd
        offset, size = struct.unpack_from("<qq", index, q)
        q += 16
        tensors.append((name, shape, offset, size))
    return tensors


def read_checkpoint(path, verify=True):
    with open(path, "rb") as f:
        buf = f.read()
    parts = dict(sections(buf, verify))
    meta_arr = np.frombuffer(parts["META"], dtype=META_DTYPE, count=1)[0]
    meta = {name: meta_arr[name].item() for name in META_DTYPE.names}
    spec = parts["SPEC"]
    c, h, w, classes = struct.unpack_from("<IIII", spec, 0)
    tensors = tensor_index(parts["PIDX"])
    state_tensors = tensor_index(parts["SIDX"]) if "SIDX" in parts else []  # a model with batch norm
    flat = {tag: np.frombuffer(parts[tag], dtype="<f4") for tag in ("PARM", "MOM1", "MOM2")}
    flat["STAT"] = np.frombuffer(parts["STAT"], dtype="<f4") if "STAT" in parts else np.zeros(0, "<f4")
    codec = np.zeros((0, 0), "<f4")
    shared = 0
    if "CDEC" in parts:  # u32 ranks, u32 shared, u64 floats a rank, then the ranks' states in rank order
        ranks, shared, per_rank = struct.unpack_from("<IIQ", parts["CDEC"], 0)
        codec = np.frombuffer(parts["CDEC"], dtype="<f4", offset=16).reshape(ranks, per_rank)

    def by_name(arr, table=tensors):
        if arr.size == 0:
            return {}
        return {name: arr[off:off + size].reshape(shape) for name, shape, off, size in table}

    return {
        "meta": meta,
        "input": (c, h, w),
        "num_classes": classes,
        "spec": bytes(spec[16:]).decode(),
        "config": bytes(parts["CONF"]).decode(),
        "tensors": tensors,
        "flat_params": flat["PARM"],
        "params": by_name(flat["PARM"]),
        "first_moment": by_name(flat["MOM1"]),
        "second_moment": by_name(flat["MOM2"]),
        "state_tensors": state_tensors,
        "model_state": by_name(flat["STAT"], state_tensors),  # batch norm's running statistics
        "codec_state": codec,
        "codec_shared": shared,
    }


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description="Read a mnist_mpi checkpoint with numpy.")
    ap.add_argument("file")
    ap.add_argument("--meta", action="store_true", help="print every META field")
    ap.add_argument("--config", action="store_true", help="print the options of the run that wrote it")
    ap.add_argument("--save", metavar="NPZ", help="save the parameters by name into a .npz file")
    ap.add_argument("--no-verify", action="store_true", help="skip the CRC32C checks (faster)")
    args = ap.parse_args(argv)
    try:
        ck = read_checkpoint(args.file, verify=not args.no_verify)
    except (CheckpointError, OSError, KeyError) as e:
        print("read_checkpoint: %s: %s" % (args.file, e), file=sys.stderr)
        return 4
    m = ck["meta"]
    if args.meta:
        for k, v in m.items():
            print("%s = %r" % (k, v))
    elif args.config:
        print(ck["config"], end="")
    else:
        print("%s: step %d, epoch %d, model %s" % (args.file, m["step"], m["epoch"], ck["spec"]))
        for name, shape, off, size in ck["tensors"]:
            p = ck["params"][name]
            print("  %-16s %-18s offset %-8d mean %+.6f std %.6f" % (name, tuple(shape), off, p.mean(), p.std()))
        for name, shape, off, size in ck["state_tensors"]:
            s = ck["model_state"][name]
            print("  %-22s %-12s state %-6d mean %+.6f std %.6f" % (name, tuple(shape), off, s.mean(), s.std()))
        if ck["codec_state"].size:
            c = ck["codec_state"]
            print("  gradient-codec state: %d ranks x %d values (the last %d the same on every rank), max |value| %.3g"
                  % (c.shape[0], c.shape[1], ck["codec_shared"], abs(c).max()))
    if args.save:
        np.savez(args.save, **ck["params"], **ck["model_state"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
