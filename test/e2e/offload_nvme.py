#!/usr/bin/env python3
"""Optimizer state on disk (offload-nvme=true, ZeRO-Infinity's optimizer
offload to NVMe): the same training with less host memory.

usage: offload_nvme.py BIN_DIR

Keeping the offloaded optimizer state in a per-rank swap file moves bytes
between the file and a staging buffer of the host arena around each
update; the update itself is the same kernel on the same bytes. So, for
every configuration below, against the same plan with the state in the
host arena (offload=optimizer):
(a) the losses of 6 steps and the final parameters are bitwise equal;
(b) memory: every offloaded state buffer is in the swap file (none in the
    host arena: memory.host.state = 0, memory.nvme.state = the host
    plan's state bytes), the host arena shrinks by at least the state it
    no longer holds less the staging live at once and one more gradient
    copy (two updates in flight instead of one: [Note: swap pipeline]; not
    with next-step, where every update's operands live through the step),
    the device arena is the same, and fsdp-run measures both arenas' high-water and
    peak live bytes equal to the plan's;
(c) traffic: fsdp-run reports the swap file's size as the plan's
    nvme_bytes, and per step reads exactly the bytes of every swap of
    every instruction and writes back those of the updates, with the time
    its transfers took each way;
(d) nothing is left in --nvme-dir after a run;
(e) checkpoints: 4 steps with --ckpt-dir, --resume to 8 gives the
    uninterrupted run's losses and parameters bitwise; the checkpoint
    resumes in the plan with the state in host memory and back (the same
    shards), bitwise;
(f) refusals: a plan with state on disk run without --nvme-dir, or with a
    directory that does not exist, fails naming the flag / the directory;
(g) the cost model (h100 profile, fsdp-sim and fsdp-opt simulate=true):
    the host stream's busy time is the same as with the state in host
    memory, the swap streams' is exactly the swaps' bytes at the profile's
    NVMe read and write rates (the two streams share the drive, so its
    busy time is their sum: [Note: swap pipeline]), the predicted trace
    has every read on the swap-in track ending before its update starts
    and every write on the swap-out track starting after it ends, and the
    two tools agree on the step, the host and the swap time; with other
    duplex shares (the fraction of its rate each swap stream keeps while
    the other moves data) the drive is busy exactly R + W - D (share_r +
    share_w - 1) (reads and writes alone, D both at once), a drive that
    does both at full rate predicts no longer a step, and fsdp-opt agrees;
(i) fsdp-run --trace of that plan: every update's read (swap-in thread)
    ends before it starts and its write-back (swap-out thread) starts after
    it ends, on every rank and step (how many reads ran ahead, beside the
    previous update, is timing and only printed);
(j) direct I/O ([Note: swap file I/O]): where the directory takes O_DIRECT
    (probed here first; skipped visibly elsewhere) every run above moved
    the state with it and the page cache holds none of the swap file at
    the end (fsdp-run's nvme_cached_bytes); --nvme-io buffered trains
    bitwise the same, moving the same bytes, through the page cache; a
    plan without swap_alignment (from before it) runs buffered under
    auto, saying why, bitwise the same; every buffer in the swap file and
    every staging buffer is on a 4096-byte block (checked in (b));
(h) the memory-budget search with offload-nvme=auto keeps the state in
    host memory where it fits host-memory-budget (the swaps only add
    time) and puts it on disk where only that fits, recording the choice
    (strategy.offload_nvme), and the plan it chose trains as the plan
    compiled with offload-nvme=true for the same schedule; under a host
    budget between the host arenas of 1 update in flight without a read
    ahead and 2 with one it chooses the first
    (strategy.offload_nvme_in_flight, offload_nvme_read_ahead), where with
    the second pinned nothing fits;
(k) part of the state on disk (offload-nvme-units=K): the state of the
    first K units the step updates is in the swap file, the rest in host
    memory, bitwise the same training, K units' bytes read a step and the
    drive's predicted time below all-on-disk, its checkpoint resuming with
    the state in host memory bitwise; K out of range refused; under
    a host budget that some K fits but not the state in host memory, the
    search keeps fewer units on disk than all, predicted faster, and its
    plan trains as the one compiled with that K (the search also tries
    each K without the read ahead, whose staging may be what keeps a unit
    out of host memory);
(l) the reads ahead (offload-nvme-read-ahead=R, default 1): with R = 0, 2
    and 3 (MLP with clipping; GPT with next-step) the k-th async swapping
    update's swap_read_at is the (k-R)-th's index (the first R: 0; none
    with R = 0), each staging buffer is live from there, the losses and
    final parameters are bitwise R = 1's, both arenas are measured ==
    predicted and the host arena never shrinks as R grows; the cost model
    (fsdp-sim, fsdp-opt agreeing) predicts a shorter step with R = 1 than
    0, its first read starting by the end of the step's first instruction
    rather than when compute reaches the update; the memory-budget search
    (read-ahead unpinned) reads further ahead than 1 where that is
    predicted faster and fits, for more host memory.
"""
import re
import json
import mmap
import os
import subprocess
import sys
import tempfile

from e2e_lib import Checks, arenas_as_planned, gen_models, run_json

HERE = os.path.dirname(os.path.abspath(__file__))

# (model, ranks, pipeline options)
CONFIGS = [
    ("mlp", 1, "optimizer=adamw stage=3"),
    ("mlp", 2, "optimizer=adamw stage=3 max-grad-norm=0.5"),
    ("mlp", 3, "optimizer=sgd momentum=0.9 stage=2"),
    ("mlp", 2, "optimizer=adamw stage=3 offload-overlap=false"),
    ("gpt", 2, "optimizer=adamw stage=3 param-dtype=bf16 recompute=unit "
               "weight-decay-params=matrices"),
    # LAMB: its norms read the moments (read-only swaps), its update writes
    ("gpt", 2, "optimizer=lamb stage=3 max-grad-norm=1.0 weight-decay=0.1 "
               "weight-decay-params=matrices"),
    ("gpt", 2, "optimizer=adamw stage=3 max-grad-norm=1.0 offload-next-step=true"),
]


def direct_io_works(d):
    """Whether files in directory d can be read and written with O_DIRECT
    (one page-aligned 4096-byte block each way)."""
    path = os.path.join(d, ".direct-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.ftruncate(fd, 4096)
        block = mmap.mmap(-1, 4096)
        return os.preadv(fd, [block], 0) == 4096 and os.pwritev(fd, [block], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def main():
    bindir = sys.argv[1]
    report = Checks()

    with tempfile.TemporaryDirectory() as tmp:
        models = gen_models(tmp, {
            # Wide enough that a unit's state is many 4 KiB blocks (the
            # swap's padding: [Note: swap file I/O]).
            "mlp": ["mlp", "--hidden", "256", "--blocks", "4", "--batch", "16"],
            "gpt": ["gpt", "--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "2",
                    "--width", "64", "--batch", "4"]})
        swapdir = os.path.join(tmp, "nvme")
        os.mkdir(swapdir)
        direct = direct_io_works(swapdir)
        if not direct:
            print(f"(j) SKIPPED: {swapdir} does not take O_DIRECT; the runs below are buffered")

        def compile_(model, n, pipeline, nvme, tag):
            plan = os.path.join(tmp, tag + ".plan")
            subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                            f"--fsdp-pipeline=world-size={n} {pipeline} offload=optimizer "
                            f"offload-nvme={'true' if nvme else 'false'} plan={plan} "
                            f"report=false"], check=True, capture_output=True, text=True)
            return plan

        def run(plan, n, *extra):
            return subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json",
                                   "--threads", "1", "--lr", "1e-2"] + list(extra)
                                  + (["--nproc", str(n)] if n > 1 else []),
                                  capture_output=True, text=True, timeout=300)

        def train(plan, n, *extra):
            return run_json(bindir, plan, n, "--threads", "1", "--lr", "1e-2", "--nvme-dir",
                            swapdir, *extra)

        def read(path):
            with open(path, "rb") as f:
                return f.read()

        disks = []  # (config, plan, losses, summary) with the state on disk
        for i, (model, n, pipeline) in enumerate(CONFIGS):
            what = f"{model} N={n} {pipeline}"
            host = compile_(model, n, pipeline, False, f"c{i}-host")
            disk = compile_(model, n, pipeline, True, f"c{i}-nvme")
            ref, sh = train(host, n, "--steps", "6", "--save", host + ".st")
            got, s = train(disk, n, "--steps", "6", "--save", disk + ".st")
            # (a)
            report(got == ref and len(got) == 6 and read(host + ".st") == read(disk + ".st"),
                   f"(a) {what}: losses and final parameters bitwise equal")
            # (b)
            ph, pd = json.load(open(host)), json.load(open(disk))
            mh, md = ph["memory"], pd["memory"]
            bufs = pd["buffers"]
            states = [bufs[x["buffer"]] for x in pd["states"]]
            on_disk = all(b.get("space") == "nvme" for b in states) and bool(states)
            freed = mh["host"]["state"] - md["host"]["staging"]
            nextstep = "next-step" in pipeline
            grad_copy = max(b["bytes"] for b in bufs if b.get("space") == "host"
                            and b["kind"] == "grad" and not b["persistent"])
            # Each staging buffer starts on a block and reserves its last
            # block whole (swap_alignment): less than 2 blocks more each.
            align = pd["swap_alignment"]
            staging = {st for x in pd["program"] for _, st, _ in x.get("attrs", {}).get("swap", [])}
            pad = sum(2 * align - 64 for _ in staging)
            shrunk = (ph["host_arena_bytes"] <= pd["host_arena_bytes"] <= ph["host_arena_bytes"] + pad
                      if nextstep else
                      pd["host_arena_bytes"] <= ph["host_arena_bytes"] - freed + grad_copy + pad)
            blocks = align == 4096 and pd["nvme_bytes"] % align == 0 and all(
                b["offset"] % align == 0 for b in bufs if b.get("space") == "nvme"
                or b["id"] in staging)
            report(on_disk and md["host"]["state"] == 0 and
                   md["nvme"]["state"] == mh["host"]["state"] and shrunk and blocks and
                   pd["arena_bytes"] == ph["arena_bytes"],
                   f"(b) {what}: {len(states)} state buffers, {md['nvme']['state']} B, in the "
                   f"swap file, each with its staging on {align}-byte blocks; host arena "
                   f"{pd['host_arena_bytes']} B (state in host memory: "
                   f"{ph['host_arena_bytes']} B" + (", next-step keeps every staging live)"
                                                    if nextstep else ")"))
            measured = arenas_as_planned(s, pd)
            report(measured, f"(b) {what}: measured == predicted, device "
                             f"{s['measured_high_water']} B and host "
                             f"{s['measured_host_high_water']} B")
            # (c) per step: every swap read, the written ones written back
            swaps = [sw for x in pd["program"] for sw in x.get("attrs", {}).get("swap", [])]
            rd = sum(bufs[f]["bytes"] for f, _, _ in swaps)
            wr = sum(bufs[f]["bytes"] for f, _, w in swaps if w)
            report(s.get("nvme_bytes") == pd["nvme_bytes"] and
                   s.get("nvme_read_bytes_per_step") == rd and
                   s.get("nvme_written_bytes_per_step") == wr and wr > 0 and
                   s.get("nvme_read_seconds_per_step", 0) > 0 and
                   s.get("nvme_write_seconds_per_step", 0) > 0,
                   f"(c) {what}: swap file {s.get('nvme_bytes')} B, {rd} B read and {wr} B "
                   f"written a step ({len(swaps)} swaps) in "
                   f"{1e3 * s.get('nvme_read_seconds_per_step', 0):.3f} and "
                   f"{1e3 * s.get('nvme_write_seconds_per_step', 0):.3f} ms")
            # (d)
            report(os.listdir(swapdir) == [], f"(d) {what}: nothing left in --nvme-dir")
            # (j)
            if direct:
                report(s.get("nvme_io") == "direct" and s.get("nvme_cached_bytes") == 0,
                       f"(j) {what}: {s.get('nvme_io')} I/O, {s.get('nvme_cached_bytes')} B of "
                       f"the swap file in the page cache at the end")
            disks.append((i, disk, ref, s))

        # (j) buffered against direct, and a plan from before swap_alignment.
        for i, disk, ref, s in (disks[1], disks[6]):
            model, n, pipeline = CONFIGS[i]
            what = f"{model} N={n} {pipeline}"
            got, sb = train(disk, n, "--steps", "6", "--nvme-io", "buffered", "--save",
                            disk + ".buffered.st")
            report(got == ref and read(disk + ".buffered.st") == read(disk + ".st") and
                   sb.get("nvme_io") == "buffered" and
                   sb["nvme_read_bytes_per_step"] == s["nvme_read_bytes_per_step"] and
                   sb["nvme_written_bytes_per_step"] == s["nvme_written_bytes_per_step"],
                   f"(j) {what}: --nvme-io buffered trains bitwise as {s.get('nvme_io')}, the "
                   f"same bytes a step ({sb.get('nvme_cached_bytes')} B of the file in the page "
                   f"cache at the end)")
            old = json.load(open(disk))
            old.pop("swap_alignment")
            with open(disk + ".old", "w") as f:
                json.dump(old, f)
            got, so = train(disk + ".old", n, "--steps", "6")
            report(got == ref and so.get("nvme_io") == "buffered" and
                   "no swap_alignment" in so.get("nvme_io_note", ""),
                   f"(j) {what}: a plan without swap_alignment runs buffered under auto, "
                   f"bitwise the same: {so.get('nvme_io_note')}")

        # (e) checkpoints on the 2-rank clipped MLP and the bf16 GPT.
        for i in (1, 4):
            model, n, pipeline = CONFIGS[i]
            disk = os.path.join(tmp, f"c{i}-nvme.plan")
            host = os.path.join(tmp, f"c{i}-host.plan")
            ref, _ = train(disk, n, "--steps", "8", "--save", disk + ".ref.st")
            ck = os.path.join(tmp, f"ck{i}")
            train(disk, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2")
            after, sa = train(disk, n, "--steps", "8", "--resume", ck, "--save",
                              disk + ".res.st")
            report(after == ref[4:] and read(disk + ".ref.st") == read(disk + ".res.st"),
                   f"(e) {model} N={n}: resumed losses 5-8 and final parameters bitwise equal")
            # The summary's traffic is the steps' swaps, not the resume's
            # writes of the state into the file.
            pd = json.load(open(disk))
            wr = sum(pd["buffers"][f]["bytes"] for x in pd["program"]
                     for f, _, w in x.get("attrs", {}).get("swap", []) if w)
            report(sa.get("nvme_written_bytes_per_step") == wr,
                   f"(e) {model} N={n}: after a resume {sa.get('nvme_written_bytes_per_step')} B "
                   f"written a step, the steps' swaps only ({wr} B)")
            other, _ = train(host, n, "--steps", "8", "--resume", ck)
            report(other == ref[4:], f"(e) {model} N={n}: the checkpoint of state on disk "
                                     f"resumes with the state in host memory, bitwise")
            ckh = os.path.join(tmp, f"ckh{i}")
            train(host, n, "--steps", "4", "--ckpt-dir", ckh, "--save-every", "4")
            back, _ = train(disk, n, "--steps", "8", "--resume", ckh)
            report(back == ref[4:], f"(e) {model} N={n}: the host-memory checkpoint resumes "
                                    f"with the state on disk, bitwise")

        # (f)
        disk = os.path.join(tmp, "c0-nvme.plan")
        r = run(disk, 1, "--steps", "1")
        report(r.returncode == 1 and "--nvme-dir" in r.stderr and "swap file" in r.stderr,
               "(f) no --nvme-dir refused: " + r.stderr.strip().splitlines()[-1][-110:])
        missing = os.path.join(tmp, "no-such-dir")
        r = run(disk, 1, "--steps", "1", "--nvme-dir", missing)
        report(r.returncode == 1 and "is not a directory" in r.stderr and missing in r.stderr,
               "(f) a missing --nvme-dir refused: " + r.stderr.strip().splitlines()[-1][-80:])

        # (g)
        sim = os.path.join(HERE, "..", "..", "tools", "fsdp-sim", "fsdp-sim")
        model, n, pipeline = CONFIGS[1]
        disk, host = (os.path.join(tmp, f"c1-{t}.plan") for t in ("nvme", "host"))
        out = subprocess.run([sys.executable, sim, disk, host, "--json"], check=True,
                             capture_output=True, text=True).stdout
        sd, shost = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
        pd = json.load(open(disk))
        io_ms = 1e3 * sum(pd["buffers"][f]["bytes"] * (1 / 6.5e9 + (1 / 3.5e9 if w else 0))
                          for x in pd["program"] for f, _, w in x.get("attrs", {}).get("swap", []))
        grew = sd["host_ms"] - shost["host_ms"]
        report(abs(grew) <= 1e-9 and abs(sd["swap_ms"] - io_ms) <= 1e-9 + 1e-9 * io_ms
               and io_ms > 0 and shost["swap_ms"] == 0,
               f"(g) {model} N={n}: fsdp-sim's host stream as busy ({grew:+.6f} ms), the drive "
               f"{sd['swap_ms']:.6f} ms = the swaps at 6.5 / 3.5 GB/s ({io_ms:.6f} ms)")
        trace = os.path.join(tmp, "sim-trace.json")
        subprocess.run([sys.executable, sim, disk, "--trace", trace], check=True,
                       capture_output=True, text=True)
        spans = {}
        for e in json.load(open(trace))["traceEvents"]:
            if e.get("ph") == "X" and e["tid"] in (2, 4, 5):
                spans.setdefault(e["args"]["instruction"], {})[e["tid"]] = (
                    e["ts"], e["ts"] + e["dur"])
        swapping = [j for j, x in enumerate(pd["program"]) if x.get("attrs", {}).get("swap")]
        ordered = [j for j in swapping if {2, 4, 5} <= spans.get(j, {}).keys()
                   and spans[j][4][1] <= spans[j][2][0] + 1e-6
                   and spans[j][2][1] <= spans[j][5][0] + 1e-6]
        overlapped = sum(1 for a, b in zip(swapping, swapping[1:])
                         if a in ordered and b in ordered
                         and spans[b][4][0] < spans[a][2][1] - 1e-6)
        report(swapping and ordered == swapping,
               f"(g) {model} N={n}: the predicted trace reads each of the {len(swapping)} "
               f"updates' state before it and writes it after ({len(ordered)} in order; "
               f"{overlapped} reads start before the previous update ends)")
        r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                            f"--fsdp-pipeline=world-size={n} {pipeline} offload=optimizer "
                            f"offload-nvme=true report=false simulate=true"],
                           capture_output=True, text=True)
        m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
        h = re.search(r"host updates\s+([0-9.]+) ms", r.stderr)
        w = re.search(r"swaps \(drive busy\)\s+([0-9.]+) ms", r.stderr)
        report(m is not None and h is not None and w is not None
               and abs(float(m.group(1)) - sd["step_ms"]) <= 6e-4
               and abs(float(h.group(1)) - sd["host_ms"]) <= 6e-4
               and abs(float(w.group(1)) - sd["swap_ms"]) <= 6e-4,
               f"(g) {model} N={n}: fsdp-opt simulate=true agrees (step "
               f"{m.group(1) if m else '?'} ms, host {h.group(1) if h else '?'} ms, swaps "
               f"{w.group(1) if w else '?'} ms; fsdp-sim {sd['step_ms']:.3f}, "
               f"{sd['host_ms']:.3f}, {sd['swap_ms']:.3f})")
        # The drive's duplex shares: while both swap streams move data each
        # runs at its share of its rate, so with R and W the reads' and
        # writes' seconds alone and D the time both ran, the drive is busy
        # R + W - D (share_r + share_w - 1): the sum at half and half (or
        # any shares adding to 1), less where the drive does more at once.
        rd_ms = 1e3 * sum(pd["buffers"][f]["bytes"] / 6.5e9
                          for x in pd["program"] for f, _, w in x.get("attrs", {}).get("swap", []))
        wr_ms = io_ms - rd_ms
        h100 = json.loads(subprocess.run(
            [sys.executable, "-c", "import importlib.machinery as m, json, sys; "
             "print(json.dumps(m.SourceFileLoader('sim', sys.argv[1]).load_module()"
             ".BUILTIN['h100']))", sim], check=True, capture_output=True, text=True).stdout)
        steps = {}
        for sr, sw in ((0.5, 0.5), (0.25, 0.75), (1.0, 1.0), (0.72, 0.87)):
            prof = os.path.join(tmp, f"duplex-{sr}-{sw}.json")
            with open(prof, "w") as f:
                json.dump(dict(h100, name=f"duplex {sr}/{sw}", compute=dict(
                    h100["compute"], nvme_duplex_read_share=sr,
                    nvme_duplex_write_share=sw)), f)
            x = json.loads(subprocess.run([sys.executable, sim, disk, "--profile", prof, "--json"],
                                          check=True, capture_output=True, text=True).stdout)
            steps[(sr, sw)] = x["step_ms"]
            want = rd_ms + wr_ms - x["swap_duplex_ms"] * (sr + sw - 1)
            report(x["swap_duplex_ms"] > 0 and abs(x["swap_ms"] - want) <= 1e-9 * want,
                   f"(g) {model} N={n}, duplex shares {sr} / {sw}: the drive busy "
                   f"{x['swap_ms']:.6f} ms = reads {rd_ms:.6f} + writes {wr_ms:.6f} - "
                   f"{x['swap_duplex_ms']:.6f} ms at once x {sr + sw - 1:+.2f}")
            if (sr, sw) != (0.72, 0.87):
                continue
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} offload=optimizer "
                                f"offload-nvme=true report=false simulate=true "
                                f"device-profile={prof}"], capture_output=True, text=True)
            m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
            w = re.search(r"swaps \(drive busy\)\s+([0-9.]+) ms", r.stderr)
            d = re.search(r"reads and writes at once\s+([0-9.]+) ms", r.stderr)
            report(m and w and d and abs(float(m.group(1)) - x["step_ms"]) <= 6e-4
                   and abs(float(w.group(1)) - x["swap_ms"]) <= 6e-4
                   and abs(float(d.group(1)) - x["swap_duplex_ms"]) <= 6e-4,
                   f"(g) {model} N={n}, duplex shares {sr} / {sw}: fsdp-opt simulate=true agrees "
                   f"(step {m.group(1) if m else '?'}, drive {w.group(1) if w else '?'}, at once "
                   f"{d.group(1) if d else '?'} ms; fsdp-sim {x['step_ms']:.3f}, "
                   f"{x['swap_ms']:.3f}, {x['swap_duplex_ms']:.3f}) {r.stderr[-200:] if r.returncode else ''}")
        report(steps[(1.0, 1.0)] <= steps[(0.5, 0.5)] * (1 + 1e-12)
               and abs(steps[(0.5, 0.5)] - sd["step_ms"]) <= 1e-9 * sd["step_ms"],
               f"(g) {model} N={n}: a drive that reads and writes at once at full rate "
               f"predicts a step no longer ({steps[(1.0, 1.0)]:.4f} ms) than half and half "
               f"({steps[(0.5, 0.5)]:.4f} ms, the h100 profile's {sd['step_ms']:.4f})")

        # (i) the measured trace of the same plan
        trace = os.path.join(tmp, "run-trace.json")
        train(disk, n, "--steps", "4", "--trace", trace)
        spans = {}  # (rank, step, instruction) -> {track: (start, end)}
        for e in json.load(open(trace))["traceEvents"]:
            if e.get("ph") == "X" and e["tid"] in (2, 4, 5):
                key = (e["pid"], e["args"]["step"], e["args"]["instruction"])
                spans.setdefault(key, {})[e["tid"]] = (e["ts"], e["ts"] + e["dur"])
        writes = {j for j in swapping if any(w for _, _, w in pd["program"][j]["attrs"]["swap"])}
        keys = [(r, st, j) for r in range(n) for st in range(1, 5) for j in swapping]
        bad = [k for k in keys if not (
            {2, 4} <= spans.get(k, {}).keys() and spans[k][4][1] <= spans[k][2][0]
            and (k[2] not in writes or (5 in spans[k] and spans[k][2][1] <= spans[k][5][0])))]
        ahead = sum(1 for r in range(n) for st in range(1, 5)
                    for a, b in zip(swapping, swapping[1:])
                    if not {(r, st, a), (r, st, b)} & set(bad)
                    and spans[(r, st, b)][4][0] < spans[(r, st, a)][2][1])
        names = json.load(open(trace))["traceEvents"]
        threads = {e["args"]["name"] for e in names if e.get("name") == "thread_name"}
        report(not bad and {"swap-in", "swap-out", "host"} <= threads,
               f"(i) {model} N={n}: fsdp-run --trace: each of {len(keys)} updates (ranks x steps "
               f"x swapping instructions) read on the swap-in thread before it ran and written "
               f"back on the swap-out thread after ({len(bad)} out of order: {bad[:3]}); "
               f"{ahead} reads started before the previous update ended")

        # (h)
        def search(tag, nvme, host_budget=None, extra="", check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models["mlp"], "-o", os.devnull,
                                "--fsdp-pipeline=world-size=2 optimizer=adamw stage=3 "
                                f"memory-budget=64MiB offload=optimizer offload-nvme={nvme} "
                                f"plan={plan} report=false {extra}"
                                + (f" host-memory-budget={host_budget}" if host_budget else "")],
                               check=check, capture_output=True, text=True)
            if r.returncode:
                return None, r.stderr
            return plan, json.load(open(plan))
        _, free = search("auto-free", "auto")
        # (one read ahead pinned: the search's deeper ones hold more host
        # memory than the state in host memory does on this small model)
        pinned_plan, pinned = search("pinned", "true", extra="offload-nvme-read-ahead=1")
        budget = (free["host_arena_bytes"] + pinned["host_arena_bytes"]) // 2
        tight_plan, tight = search("auto-tight", "auto", budget)
        report(free["strategy"]["offload_nvme"] is False and "nvme_bytes" not in free and
               pinned["host_arena_bytes"] < free["host_arena_bytes"] and
               tight["strategy"]["offload_nvme"] is True and tight.get("nvme_bytes", 0) > 0 and
               tight["host_arena_bytes"] <= budget,
               f"(h) mlp N=2 offload-nvme=auto: state in host memory without a host budget "
               f"(host arena {free['host_arena_bytes']} B), on disk under "
               f"host-memory-budget={budget} (host arena {tight['host_arena_bytes']} B)")
        keys = ("layers_per_unit", "recompute", "recompute_units", "reshard_after_forward",
                "reshard_units", "prefetch_depth", "offload", "offload_activations",
                "offload_next_step", "offload_prefetch", "offload_nvme",
                "offload_nvme_in_flight")
        if all(tight["strategy"][k] == pinned["strategy"][k] for k in keys):
            a, _ = train(tight_plan, 2, "--steps", "4")
            b2, _ = train(pinned_plan, 2, "--steps", "4")
            report(a == b2 and len(a) == 4, "(h) mlp N=2: the chosen plan trains bitwise as "
                                            "offload-nvme=true's (the same schedule)")
        else:
            report(False, f"(h) mlp N=2: the search chose {tight['strategy']}, "
                          f"offload-nvme=true {pinned['strategy']}")
        # One update in flight and no read ahead where only that fits the
        # host budget.
        one = {k: search(f"in-flight-{k}", "true", extra=f"offload-nvme-in-flight={k} "
                         f"offload-nvme-read-ahead={k - 1}")[1] for k in (1, 2)}
        budget1 = (one[1]["host_arena_bytes"] + one[2]["host_arena_bytes"]) // 2
        _, tight1 = search("auto-tight-1", "auto", budget1)
        _, err = search("pinned-2-tight", "auto", budget1,
                        "offload-nvme-in-flight=2 offload-nvme-read-ahead=1", check=False)
        report(one[1]["host_arena_bytes"] < one[2]["host_arena_bytes"] and
               tight1["strategy"]["offload_nvme"] is True and
               tight1["strategy"]["offload_nvme_in_flight"] == 1 and
               tight1["strategy"]["offload_nvme_read_ahead"] == 0 and
               tight1["host_arena_bytes"] <= budget1 and
               f"no schedule fits host-memory-budget={budget1}" in err,
               f"(h) mlp N=2: host arenas {one[1]['host_arena_bytes']} B (1 update in flight, "
               f"no read ahead) and {one[2]['host_arena_bytes']} B (2, one read ahead): under "
               f"host-memory-budget={budget1} the search keeps the state on disk with "
               f"{tight1['strategy']['offload_nvme_in_flight']} in flight and "
               f"{tight1['strategy']['offload_nvme_read_ahead']} read ahead; with 2 and 1 "
               "pinned nothing fits")

        # (k) part of the state on disk: offload-nvme-units=K
        def units_of(plan):
            """The units of a plan's updates in program order, and those whose
            state is in the swap file."""
            bufs = plan["buffers"]
            unit = {s["buffer"]: s["unit"] for s in plan["states"]}
            order, seen = [], set()
            for x in plan["program"]:
                if x["op"].endswith("_update"):
                    u = next((s["unit"] for s in plan["states"] if s["unit"] == bufs[x["out"][0]]["name"]), None)
                    if u and u not in seen:
                        seen.add(u)
                        order.append(u)
            disk = {unit[b["id"]] for b in bufs if b.get("space") == "nvme"}
            return order, disk
        model, n, pipeline = CONFIGS[1]
        host = os.path.join(tmp, "c1-host.plan")
        ph = json.load(open(host))
        pall = json.load(open(os.path.join(tmp, "c1-nvme.plan")))
        order, _ = units_of(pall)
        ref, _ = train(host, n, "--steps", "4", "--save", host + ".k")
        for k in (1, len(order) // 2):
            plan = os.path.join(tmp, f"units-{k}.plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} offload=optimizer "
                                f"offload-nvme=true offload-nvme-units={k} plan={plan} "
                                "report=false simulate=true"],
                               check=True, capture_output=True, text=True)
            pk = json.load(open(plan))
            _, disk = units_of(pk)
            bufs = pk["buffers"]
            want = sum(bufs[s["buffer"]]["bytes"] for s in pk["states"] if s["unit"] in disk)
            swapped = sum(bufs[f]["bytes"] for x in pk["program"]
                          for f, _, _ in x.get("attrs", {}).get("swap", []))
            got, s = train(plan, n, "--steps", "4", "--save", plan + ".k")
            report(got == ref and read(plan + ".k") == read(host + ".k")
                   and disk == set(order[:k]) and pk["memory"]["nvme"]["state"] == want
                   and swapped == want and s["nvme_read_bytes_per_step"] == want
                   and pk["memory"]["host"]["state"] == ph["memory"]["host"]["state"] - want,
                   f"(k) {model} N={n} offload-nvme-units={k}: the state of the first {k} of "
                   f"{len(order)} units updated ({sorted(disk)}) on disk, {want} B, read a step; "
                   f"the rest in host memory; losses and parameters bitwise the host plan's")
            if k > 1:
                # A checkpoint of part of the state on disk resumes in the
                # plan with all of it in host memory, bitwise.
                ck = os.path.join(tmp, f"ck-units-{k}")
                train(plan, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "4")
                whole, _ = train(plan, n, "--steps", "8")
                resumed, _ = train(host, n, "--steps", "8", "--resume", ck)
                report(resumed == whole[4:] and len(resumed) == 4,
                       f"(k) {model} N={n} offload-nvme-units={k}: its checkpoint resumes with "
                       f"the state in host memory, bitwise")
            m = re.search(r"swaps \(drive busy\)\s+([0-9.]+) ms", r.stderr)
            report(m and 0 <= float(m.group(1)) < sd["swap_ms"],
                   f"(k) {model} N={n} offload-nvme-units={k}: the drive busy "
                   f"{m.group(1) if m else '?'} ms a step, all units on disk {sd['swap_ms']:.3f}")
        for k in (0, len(order) + 1):
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} offload=optimizer "
                                f"offload-nvme=true offload-nvme-units={k} report=false"],
                               capture_output=True, text=True)
            report(r.returncode != 0 and f"nvme-units={k} must be 1 to {len(order)}" in r.stderr,
                   f"(k) offload-nvme-units={k} refused: "
                   f"{(r.stderr.strip().splitlines() or [''])[0][-110:]}")
        # The search under a host budget that all on disk fits but not half.
        pinned_k = {}
        for k in range(1, len(order) + 1):
            pinned_k[k] = search(f"units-pinned-{k}", "true",
                                 extra=f"offload-nvme-units={k} offload-nvme-read-ahead=1"
                                 )[1]["host_arena_bytes"]
        fit_k = [k for k in pinned_k if pinned_k[k] < free["host_arena_bytes"]]
        k_best = min(fit_k)
        budget_k = (pinned_k[k_best] + free["host_arena_bytes"]) // 2
        part_plan, part = search("auto-part", "auto", budget_k)
        pk_strategy = part["strategy"] if part else {}
        same = all(pk_strategy.get(k) == pinned["strategy"][k] for k in keys if k != "offload_nvme")
        report(pk_strategy.get("offload_nvme") is True
               and pk_strategy.get("offload_nvme_units", 0) < len(order)
               and part["host_arena_bytes"] <= budget_k
               and pk_strategy["predicted_step_s"] < pinned["strategy"]["predicted_step_s"],
               f"(k) mlp N=2 under host-memory-budget={budget_k} (host arenas: all state in "
               f"host memory {free['host_arena_bytes']} B; on disk, by units "
               f"{dict(sorted(pinned_k.items()))}): the search keeps "
               f"{pk_strategy.get('offload_nvme_units')} of {len(order)} units' state on "
               f"disk, {pk_strategy.get('offload_nvme_read_ahead')} read ahead (host arena {part['host_arena_bytes'] if part else '?'} B), predicted "
               f"{1e3 * pk_strategy.get('predicted_step_s', 0):.3f} ms against "
               f"{1e3 * pinned['strategy']['predicted_step_s']:.3f} with all on disk")
        if part and same:
            again, _ = search("auto-part-pinned", "true", extra=(
                f"offload-nvme-units={pk_strategy['offload_nvme_units']} "
                f"offload-nvme-read-ahead={pk_strategy['offload_nvme_read_ahead']}"))
            a, _ = train(part_plan, 2, "--steps", "4")
            b2, _ = train(again, 2, "--steps", "4")
            report(a == b2 and len(a) == 4,
                   "(k) mlp N=2: the chosen plan trains bitwise as the one compiled with its "
                   "offload-nvme-units pinned")

        # (l) the reads ahead: offload-nvme-read-ahead=R
        def read_points(plan):
            """The async swapping updates' indices and their swap_read_at
            (None: read at the update)."""
            prog = plan["program"]
            ups = [k for k, x in enumerate(prog) if x.get("attrs", {}).get("swap")
                   and x["attrs"].get("async")]
            return ups, [prog[k]["attrs"].get("swap_read_at") for k in ups]

        for cfg in (1, 6):  # mlp N=2 with clipping; gpt N=2 next-step
            model, n, pipeline = CONFIGS[cfg]
            ref_plan = os.path.join(tmp, f"c{cfg}-nvme.plan")  # R = 1, the default
            ref, _ = train(ref_plan, n, "--steps", "6", "--save", ref_plan + ".ra.st")
            arenas = {1: json.load(open(ref_plan))["host_arena_bytes"]}
            for ra in (0, 2, 3):
                plan = compile_(model, n, f"{pipeline} offload-nvme-read-ahead={ra}", True,
                                f"c{cfg}-ra{ra}")
                p = json.load(open(plan))
                ups, at = read_points(p)
                want = [None] * len(ups) if ra == 0 else \
                    [ups[k - ra] if k >= ra else 0 for k in range(len(ups))]
                live = all(p["buffers"][st]["first"] <= (a if a is not None else k)
                           for k, a in zip(ups, at)
                           for _, st, _ in p["program"][k]["attrs"]["swap"])
                got, s = train(plan, n, "--steps", "6", "--save", plan + ".st")
                arenas[ra] = p["host_arena_bytes"]
                measured = (s["measured_host_high_water"] == s["predicted_host_peak"] ==
                            p["host_arena_bytes"] and
                            s["measured_host_peak_live"] == s["predicted_host_peak_live"] and
                            s["measured_high_water"] == s["predicted_peak"])
                report(len(ups) > 1 and at == want and live and got == ref and len(got) == 6
                       and read(plan + ".st") == read(ref_plan + ".ra.st") and measured,
                       f"(l) {model} N={n} {pipeline} offload-nvme-read-ahead={ra}: the "
                       f"{len(ups)} updates' reads issued after instructions {at} (each staging "
                       f"live from there), losses and parameters bitwise R = 1's, host arena "
                       f"measured == predicted {s['measured_host_high_water']} B")
            report(arenas[0] <= arenas[1] <= arenas[2] <= arenas[3],
                   f"(l) {model} N={n}: host arenas by read-ahead 0..3: "
                   f"{[arenas[r] for r in range(4)]} B (each more staging live, never less)")

        # The cost model: the reads ahead shorten the predicted step, the
        # first update's read starting when compute passes the step's first
        # instruction (beside the forward pass) rather than when it reaches
        # the update; fsdp-sim and fsdp-opt agree.
        model, n, pipeline = CONFIGS[1]
        sims = {}
        for ra in (0, 1):
            plan = os.path.join(tmp, f"c1-ra{ra}.plan") if ra == 0 else \
                os.path.join(tmp, "c1-nvme.plan")
            trace = os.path.join(tmp, f"sim-ra{ra}.json")
            out = subprocess.run([sys.executable, sim, plan, "--json", "--trace", trace],
                                 check=True, capture_output=True, text=True).stdout
            summary = [json.loads(l) for l in out.splitlines() if l.startswith("{")][0]
            ev = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
            ups, _ = read_points(json.load(open(plan)))
            read0 = min(e["ts"] for e in ev if e["tid"] == 4
                        and e["args"]["instruction"] == ups[0])
            # compute reaching the first update: the end of the compute span
            # just before it
            reach = max(e["ts"] + e["dur"] for e in ev if e["tid"] == 0
                        and e["args"]["instruction"] < ups[0])
            first_end = min(e["ts"] + e["dur"] for e in ev if e["tid"] == 0)
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} offload=optimizer "
                                f"offload-nvme=true offload-nvme-read-ahead={ra} report=false "
                                f"simulate=true"], capture_output=True, text=True)
            m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
            sims[ra] = (summary["step_ms"], read0, reach, first_end,
                        float(m.group(1)) if m else None)
        (s0, r0, reach0, _, o0), (s1, r1, _, first1, o1) = sims[0], sims[1]
        report(s1 < s0 and r1 <= first1 + 1e-3 and r0 >= reach0 - 1e-3 and
               o0 is not None and o1 is not None and abs(o0 - s0) <= 1e-3 * s0 + 1e-3
               and abs(o1 - s1) <= 1e-3 * s1 + 1e-3,
               f"(l) {model} N={n}: predicted step {s1:.4f} ms with one read ahead, {s0:.4f} "
               f"without (fsdp-opt {o1}, {o0}); the first update's read starts at "
               f"{r1:.1f} us (the first instruction ends at {first1:.1f}) instead of "
               f"{r0:.1f} us (compute reaches the update at {reach0:.1f})")

        # The memory-budget search reads further ahead where that fits and
        # is predicted faster (deepenReadAhead); with it pinned, it does not.
        _, deep = search("ra-search", "true")
        st, st1 = deep["strategy"], pinned["strategy"]
        report(st["offload_nvme_read_ahead"] > 1 and st1["offload_nvme_read_ahead"] == 1 and
               st["predicted_step_s"] < st1["predicted_step_s"] and
               deep["host_arena_bytes"] > pinned["host_arena_bytes"],
               f"(l) mlp N=2 memory-budget search: {st['offload_nvme_read_ahead']} read ahead, "
               f"predicted {1e3 * st['predicted_step_s']:.3f} ms for a host arena of "
               f"{deep['host_arena_bytes']} B; with 1 pinned {1e3 * st1['predicted_step_s']:.3f}"
               f" ms, {pinned['host_arena_bytes']} B")

    return report.finish("all offload-nvme checks passed")


if __name__ == "__main__":
    sys.exit(main())
