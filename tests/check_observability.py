#!/usr/bin/env python3
"""Checks what --timeline, --tensorboard-dir and --report wrote against the run's --metrics-file.

Usage: check_observability.py --metrics M.jsonl --ranks N --steps S --buckets B --layers L
                              [--micro K] [--timeline T.json] [--tensorboard DIR] [--report R.html]
Exits 1 with one line per problem; prints what it checked. Plain python3, no packages.
"""
import argparse
import glob
import json
import os
import re
import struct
import sys
import xml.etree.ElementTree as ET

problems = []
PAYLOADS = []  # every record's Event bytes, for the cross-check


def fail(msg):
    problems.append(msg)


def close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


# ---- CRC32C (Castagnoli), as TFRecord uses it ----
_TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    _TABLE.append(c)


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf, i):
    v, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, i
        shift += 7


def fields(buf):
    i, out = 0, []
    while i < len(buf):
        key, i = varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(buf, i)
        elif wire == 1:
            v = buf[i:i + 8]; i += 8
        elif wire == 5:
            v = buf[i:i + 4]; i += 4
        elif wire == 2:
            n, i = varint(buf, i)
            v = buf[i:i + n]; i += n
        else:
            raise ValueError("wire type %d" % wire)
        out.append((num, wire, v))
    return out


def read_events(path):
    data = open(path, "rb").read()
    i, events = 0, []
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        (len_crc,) = struct.unpack_from("<I", data, i + 8)
        if len_crc != masked(crc32c(data[i:i + 8])):
            fail("%s: bad length CRC at byte %d" % (path, i))
        payload = data[i + 12:i + 12 + n]
        (data_crc,) = struct.unpack_from("<I", data, i + 12 + n)
        if data_crc != masked(crc32c(payload)):
            fail("%s: bad data CRC at byte %d" % (path, i))
        i += 16 + n
        PAYLOADS.append(bytes(payload))
        ev = {"values": {}}
        for num, wire, v in fields(payload):
            if num == 1 and wire == 1:
                ev["wall_time"] = struct.unpack("<d", v)[0]
            elif num == 2 and wire == 0:
                ev["step"] = v
            elif num == 3 and wire == 2:
                ev["file_version"] = v.decode()
            elif num == 5 and wire == 2:
                for vnum, vwire, value in fields(v):
                    assert vnum == 1 and vwire == 2
                    tag, simple = None, None
                    for xnum, xwire, x in fields(value):
                        if xnum == 1:
                            tag = x.decode()
                        elif xnum == 2 and xwire == 5:
                            simple = struct.unpack("<f", x)[0]
                    ev["values"][tag] = simple
            else:
                fail("%s: unexpected Event field %d" % (path, num))
        events.append(ev)
    return events


def protobuf_event_class():
    """TensorBoard's Event and Summary messages built for Google's protobuf library (Debian's
    python3-protobuf), as an independent parser of our bytes; None when it is not installed."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError:
        return None
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="mnist_mpi_check_event.proto", package="check", syntax="proto3")
    value = descriptor_pb2.DescriptorProto(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL, oneof_index=0)
    value.oneof_decl.add(name="value")
    summary = descriptor_pb2.DescriptorProto(name="Summary")
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, type_name=".check.Value", label=F.LABEL_REPEATED)
    event = descriptor_pb2.DescriptorProto(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL, oneof_index=0)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, type_name=".check.Summary", label=F.LABEL_OPTIONAL,
                    oneof_index=0)
    event.oneof_decl.add(name="what")
    fd.message_type.extend([value, summary, event])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    desc = pool.FindMessageTypeByName("check.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def cross_check_with_protobuf(payloads, events):
    Event = protobuf_event_class()
    if Event is None:
        return "python3-protobuf not installed, no cross-check"
    for raw, mine in zip(payloads, events):
        e = Event()
        try:
            e.ParseFromString(raw)
        except Exception as err:  # google.protobuf.message.DecodeError
            fail("protobuf: the library cannot parse an event: %s" % err)
            continue
        if hasattr(e, "UnknownFields") and len(e.UnknownFields()):
            fail("protobuf: unknown fields in an event")
        if e.wall_time != mine.get("wall_time") or e.step != mine.get("step", 0) or \
                e.file_version != mine.get("file_version", ""):
            fail("protobuf: the library reads %s, our decoder %s" % (e, mine))
        theirs = {v.tag: v.simple_value for v in e.summary.value}
        if theirs != mine["values"]:
            fail("protobuf: the library reads values %s, our decoder %s" % (theirs, mine["values"]))
    return "Google's protobuf library parses all %d events alike" % len(payloads)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--buckets", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--timeline")
    ap.add_argument("--tensorboard")
    ap.add_argument("--report")
    a = ap.parse_args()

    metrics = [json.loads(line) for line in open(a.metrics)]
    steps_m = [m for m in metrics if m["event"] == "step"]
    evals_m = [m for m in metrics if m["event"] == "eval"]
    if not steps_m or not evals_m:
        fail("the metrics file has no step or eval events")

    if a.timeline:
        tl = json.load(open(a.timeline))  # valid JSON or an exception
        ev = tl["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
        if sorted(names) != list(range(a.ranks)):
            fail("timeline: process rows %s, expected ranks 0..%d" % (sorted(names), a.ranks - 1))
        spans = [e for e in ev if e["ph"] == "X"]
        for e in spans:
            if e["dur"] < 0 or "ts" not in e or not isinstance(e["args"]["step"], int):
                fail("timeline: malformed span %s" % e)
        per_rank_step = {}
        for r in range(a.ranks):
            mine = [e for e in spans if e["pid"] == r]
            steps = {e["args"]["step"]: e for e in mine if e["cat"] == "step"}
            per_rank_step[r] = steps
            if sorted(steps) != list(range(a.steps)):
                fail("timeline: rank %d has step spans %s, expected 0..%d" % (r, sorted(steps)[:5], a.steps - 1))
                continue
            by = {}
            for e in mine:
                by.setdefault((e["cat"], e["args"]["step"]), []).append(e)
            for s, st in steps.items():
                b, end = st["ts"], st["ts"] + st["dur"]
                ar = by.get(("allreduce", s), [])
                if len(ar) != a.buckets:
                    fail("timeline: rank %d step %d has %d allreduce spans, expected %d" % (r, s, len(ar), a.buckets))
                for e in ar:
                    if e["tid"] == 0 or e["ts"] < b - 0.002 or e["ts"] + e["dur"] > end + 0.002:
                        fail("timeline: rank %d step %d: %s [%.3f, %.3f] not inside the step [%.3f, %.3f] or on the compute row"
                             % (r, s, e["name"], e["ts"], e["ts"] + e["dur"], b, end))
                layers = [e for e in by.get(("backward", s), []) if e["args"]["index"] >= 0]
                if len(layers) != a.layers:
                    fail("timeline: rank %d step %d has %d per-layer backward spans, expected %d" % (r, s, len(layers), a.layers))
                for cat, want in (("data", a.micro), ("forward", a.micro), ("wait for bucket", a.buckets),
                                  ("optimizer", a.buckets)):
                    if len(by.get((cat, s), [])) != want:
                        fail("timeline: rank %d step %d has %d '%s' spans, expected %d" % (r, s, len(by.get((cat, s), [])), cat, want))
                for e in by.get(("data", s), []) + by.get(("forward", s), []) + by.get(("backward", s), []) + \
                        by.get(("wait for bucket", s), []) + by.get(("optimizer", s), []):
                    if e["tid"] != 0 or e["ts"] < b - 0.002 or e["ts"] + e["dur"] > end + 0.002:
                        fail("timeline: rank %d step %d: %s outside its step span" % (r, s, e["name"]))
        # Ranks' clocks agree: a step's allreduce needs every rank, so step s overlaps on all ranks.
        if all(len(per_rank_step[r]) == a.steps for r in range(a.ranks)):
            for s in range(a.steps):
                lo = max(per_rank_step[r][s]["ts"] for r in range(a.ranks))
                hi = min(per_rank_step[r][s]["ts"] + per_rank_step[r][s]["dur"] for r in range(a.ranks))
                if lo > hi + 0.002:
                    fail("timeline: step %d does not overlap on all ranks (clocks misaligned by >= %.3f us)" % (s, lo - hi))
        # Every rank evaluates a share (Note [Every rank evaluates a share]): each evaluation in the
        # metrics file is one span on every rank.
        evals = [e for e in spans if e["cat"] == "evaluation"]
        per_pid = [sum(1 for e in evals if e["pid"] == r) for r in range(a.ranks)]
        if per_pid != [len(evals_m)] * a.ranks:
            fail("timeline: evaluation spans per rank %s, the metrics file has %d evaluations"
                 % (per_pid, len(evals_m)))
        if tl["otherData"]["dropped_spans"] != [0] * a.ranks:
            fail("timeline: dropped spans %s" % tl["otherData"]["dropped_spans"])
        print("timeline: %d spans from %d ranks, %d steps each, %d allreduce spans inside their steps"
              % (len(spans), a.ranks, a.steps, sum(1 for e in spans if e["cat"] == "allreduce")))

    if a.tensorboard:
        files = glob.glob(os.path.join(a.tensorboard, "events.out.tfevents.*"))
        if len(files) != 1:
            fail("tensorboard: %d event files in %s, expected 1" % (len(files), a.tensorboard))
        else:
            events = read_events(files[0])
            if events[0].get("file_version") != "brain.Event:2":
                fail("tensorboard: the first record is not file_version brain.Event:2")
            scal = {}
            for e in events[1:]:
                if "step" not in e or "wall_time" not in e:
                    fail("tensorboard: an event without step or wall_time")
                for k, v in e["values"].items():
                    scal[(k, e.get("step"))] = v
            checked = 0
            for m in steps_m:
                for tag, key in (("train/loss", "loss"), ("train/learning_rate", "lr"), ("train/images_per_s", "images_per_s")):
                    got = scal.get((tag, m["step"]))
                    if got is None or not close(got, f32(m[key]), 1e-6):
                        fail("tensorboard: %s at step %d is %s, the metrics file says %s" % (tag, m["step"], got, m[key]))
                    checked += 1
                for tag in ("time/compute_ms", "time/exposed_comm_ms"):
                    got = scal.get((tag, m["step"]))
                    if got is None or not got >= 0:
                        fail("tensorboard: %s at step %d is %s" % (tag, m["step"], got))
                    checked += 1
            for m in evals_m:
                for key in ("accuracy", "loss"):
                    tag = "%s/%s" % (m["split"], key)
                    got = scal.get((tag, m["step"]))
                    if got is None or not close(got, f32(m[key]), 1e-6):
                        fail("tensorboard: %s at step %d is %s, the metrics file says %s" % (tag, m["step"], got, m[key]))
                    checked += 1
            print("tensorboard: %d records, every CRC checked, %d scalars equal to the metrics file; %s"
                  % (len(events), checked, cross_check_with_protobuf(PAYLOADS, events)))

    if a.report:
        html = open(a.report, encoding="utf-8").read()
        m = re.search(r'<script type="application/json" id="mnist-mpi-report">\n(.*?)\n</script>', html, re.S)
        if not m:
            fail("report: no embedded data block")
        else:
            d = json.loads(m.group(1))
            train = [(p["step"], p["loss"], p["lr"]) for p in d["train"]]
            want = [(s["step"], s["loss"], s["lr"]) for s in steps_m]
            if len(train) != len(want) or any(t[0] != w[0] or not close(t[1], w[1], 1e-8) or not close(t[2], w[2], 1e-8)
                                              for t, w in zip(train, want)):
                fail("report: training curve %s differs from the metrics file %s" % (train[:3], want[:3]))
            ev = [(p["split"], p["step"], p["accuracy"], p["loss"]) for p in d["eval"]]
            want = [(s["split"], s["step"], s["accuracy"], s["loss"]) for s in evals_m]
            if len(ev) != len(want) or any(e[:2] != w[:2] or not close(e[2], w[2], 1e-8) or not close(e[3], w[3], 1e-8)
                                           for e, w in zip(ev, want)):
                fail("report: evaluation points %s differ from the metrics file %s" % (ev, want))
            for k in ("start-up", "data", "forward", "backward", "exposed communication", "optimizer", "evaluation", "other"):
                if not d["time_s"].get(k, -1) >= 0:
                    fail("report: no time for '%s'" % k)
            final = [x for x in metrics if x["event"] == "final"][0]
            if d["facts"].get("params_hash") != final["params_hash"]:
                fail("report: params_hash %s, the run's is %s" % (d["facts"].get("params_hash"), final["params_hash"]))
        svgs = re.findall(r"<svg.*?</svg>", html, re.S)
        if len(svgs) < 4:
            fail("report: %d SVG charts, expected 4" % len(svgs))
        for s in svgs:
            try:
                ET.fromstring(s)
            except ET.ParseError as e:
                fail("report: an SVG chart is not well-formed XML: %s" % e)
        stripped = html.replace("http://www.w3.org/2000/svg", "")
        for bad in ("http:", "https:", "<script src", "<link", "url(", "@import"):
            if bad in stripped:
                fail("report: refers to something outside the file (%s)" % bad)
        print("report: %d training points, %d evaluation points, %d charts, self-contained"
              % (len(d["train"]) if m else 0, len(d["eval"]) if m else 0, len(svgs)))

    for p in problems:
        print("FAIL " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
