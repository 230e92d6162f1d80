#!/usr/bin/env python3
"""Checkpoints: exact resume, a save killed half way, export, bad checkpoints.

usage: checkpoint.py BIN_DIR WORK_DIR [FSDP_OPT]

FSDP_OPT defaults to BIN_DIR/fsdp-opt (a runtime-only build, e.g. the
sanitizer build, passes the normal build's compiler).

For a small MLP (AdamW) at N=1 and at N=2 with stages 0-3: 8 uninterrupted
steps against 4 steps with --ckpt-dir, then --resume to 8. The losses of
steps 5-8 and the final parameters must be bitwise identical. A rank killed
while the step-4 checkpoint is being written leaves step 2 usable, and the
resumed run is again bitwise the uninterrupted one. `fsdp-ckpt export`
gives the parameters --save gives. A checkpoint converted to another world
size, stage, mesh or storage dtype offline (`fsdp-ckpt reshard`) and the
same checkpoint resharded on load (`--resume` with the other plan) give
bitwise the same run, and a rank reads only its slices. Corrupt, truncated and mismatched
checkpoints are clear errors (exit 1).
"""
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
MAKE_TOKENS = os.path.join(HERE, "..", "..", "tools", "make_tokens.py")
README = os.path.join(HERE, "..", "..", "README.md")
failures = 0


def report(ok, what):
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {what}")


def sh(args, env=None, check=True):
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=e)
    if check and r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(args)}\n{r.stderr}")
    return r


def main():
    bindir, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    opt, run, ckpt = (os.path.join(bindir, t) for t in ("fsdp-opt", "fsdp-run", "fsdp-ckpt"))
    if len(sys.argv) > 3:
        opt = sys.argv[3]

    def model(name, hidden, batch):
        path = os.path.join(work, name + ".mlir")
        sh([sys.executable, GEN, "mlp", "--hidden", str(hidden), "--blocks", "2",
            "--batch", str(batch), "-o", path])
        return path

    def plan(mlir, tag, n, stage, extra=""):
        path = os.path.join(work, tag + ".plan")
        sh([opt, mlir, "-o", os.devnull, f"--fsdp-pipeline=optimizer=adamw world-size={n} "
            f"stage={stage} plan={path} report=false{extra}"])
        return path

    def train(p, n, *extra, env=None, check=True):
        args = [run, p, "--threads", "1", "--lr", "1e-2", "--json"] + list(extra)
        if n > 1:
            args += ["--nproc", str(n)]
        r = sh(args, env=env, check=check)
        losses = {}
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                j = json.loads(line)
                if "step" in j:
                    losses[j["step"]] = j["loss"]
        return r, losses

    def summary(r):
        """The run's JSON summary line (the one without a step)."""
        for line in r.stdout.splitlines():
            if line.startswith("{") and "step" not in json.loads(line):
                return json.loads(line)
        return {}

    def same_files(a, b):
        return open(a, "rb").read() == open(b, "rb").read()

    m = model("m", 16, 4)
    # Stages 1/2 with bf16 compute keep f32 master shards (ZeRO's mixed-
    # precision layout): a checkpoint holds those shards.
    configs = [(1, 0, "")] + [(2, s, "") for s in range(4)] + \
        [(2, s, " param-dtype=bf16") for s in (1, 2)]
    plans, refs = {}, {}
    for n, stage, extra in configs:
        tag = f"n{n}s{stage}" + ("bf16" if extra else "")
        p = plans[tag] = plan(m, tag, n, stage, extra)
        full = os.path.join(work, tag + ".full.safetensors")
        _, ref = train(p, n, "--steps", "8", "--save", full)
        refs[tag] = ref
        ck = os.path.join(work, tag + ".ck")
        train(p, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2", "--keep", "1")
        kept = sorted(os.listdir(ck))
        report(kept == ["step-00000004"], f"N={n} stage={stage}{extra}: --keep 1 leaves {kept}")
        res = os.path.join(work, tag + ".res.safetensors")
        _, after = train(p, n, "--steps", "8", "--resume", ck, "--save", res)
        same = all(after.get(s) == ref[s] for s in range(5, 9)) and sorted(after) == [5, 6, 7, 8]
        report(same, f"N={n} stage={stage}{extra}: resumed losses 5-8 equal the uninterrupted "
               f"run bitwise ({[after.get(s) for s in range(5, 9)]})")
        report(open(res, "rb").read() == open(full, "rb").read(),
               f"N={n} stage={stage}{extra}: resumed final parameters equal bitwise")
        # The consolidated export equals --save (whole tensors, model names).
        exp = os.path.join(work, tag + ".export.safetensors")
        ck8 = os.path.join(work, tag + ".ck8")
        train(p, n, "--steps", "8", "--resume", ck, "--ckpt-dir", ck8)
        sh([ckpt, "export", ck8, exp])
        _, from_export = train(plans["n1s0"], 1, "--steps", "1", "--init-from", exp,
                               "--save", exp + ".again")
        report(tensors(exp) == tensors(full),
               f"N={n} stage={stage}{extra}: fsdp-ckpt export equals --save")

    # A rank killed while writing the step-4 checkpoint: step 2 stays usable.
    p = plans["n2s3"]
    ck = os.path.join(work, "killed.ck")
    r, _ = train(p, 2, "--steps", "8", "--ckpt-dir", ck, "--save-every", "2", check=False,
                 env={"FSDP_FAULT_KILL_RANK": "1", "FSDP_FAULT_KILL_SAVE_STEP": "4"})
    report(r.returncode == 1 and "rank 1 was killed" in r.stderr,
           f"killed during the step-4 save: the job fails (exit {r.returncode})")
    committed = sorted(d for d in os.listdir(ck) if os.path.exists(os.path.join(ck, d, "COMMIT")))
    report(committed == ["step-00000002"], f"only step 2 is committed: {committed}")
    res = os.path.join(work, "killed.res.safetensors")
    _, after = train(p, 2, "--steps", "8", "--resume", ck, "--save", res)
    _, ref = train(p, 2, "--steps", "8")
    report(sorted(after) == list(range(3, 9)) and all(after[s] == ref[s] for s in after),
           "resumed from step 2 after the killed save: losses 3-8 bitwise equal")
    report(open(res, "rb").read() == open(os.path.join(work, "n2s3.full.safetensors"), "rb").read(),
           "resumed from step 2 after the killed save: final parameters bitwise equal")

    other = plan(model("other", 24, 4), "other", 2, 3)
    # Offline resharding: a ZeRO-3 checkpoint of 2 ranks (global batch 12),
    # continued on 1 rank, on 3 ranks at stage 1 (uneven shards) and on 4
    # ranks at stage 2 with one unit: losses within 1e-6 of the 2-rank
    # continuation (the reduction order differs), parameters unchanged.
    src = plan(model("g6", 16, 6), "rs-src", 2, 3)
    _, cont = train(src, 2, "--steps", "8")
    rck = os.path.join(work, "rs.ck")
    train(src, 2, "--steps", "4", "--ckpt-dir", rck)
    for n, stage, batch, extra in ((1, 0, 12, ""), (3, 1, 4, ""), (4, 2, 3, " unit-policy=none")):
        tag = f"rs-n{n}s{stage}"
        tgt = os.path.join(work, tag + ".plan")
        sh([opt, model(tag, 16, batch), "-o", os.devnull,
            f"--fsdp-pipeline=optimizer=adamw world-size={n} stage={stage}{extra} "
            f"plan={tgt} report=false"])
        out = os.path.join(work, tag + ".ck")
        sh([ckpt, "reshard", rck, "--plan", tgt, out])
        off, on = os.path.join(work, tag + ".off.st"), os.path.join(work, tag + ".on.st")
        _, after = train(tgt, n, "--steps", "8", "--resume", out, "--save", off)
        worst = max(abs(after[s] - cont[s]) / abs(cont[s]) for s in range(5, 9))
        report(sorted(after) == [5, 6, 7, 8] and worst <= 1e-6,
               f"resharded 2 ranks stage 3 -> {n} rank(s) stage {stage}: losses 5-8 "
               f"within {worst:.1e} of the 2-rank continuation")
        # Resharded on load, from the 2-rank checkpoint itself: every rank
        # holds the bytes the offline conversion gave it, so the run is
        # bitwise the one resumed from the converted checkpoint.
        r, online = train(tgt, n, "--steps", "8", "--resume", rck, "--save", on)
        res = summary(r).get("resumed", {})
        report(online == after and same_files(on, off) and res.get("resharded") is True
               and res.get("written_for") == "2 rank(s) (mesh 1x2) at stage 3",
               f"2 ranks stage 3 -> {n} rank(s) stage {stage}, resharded on load: losses 5-8 "
               f"and final parameters bitwise those resumed from the offline conversion ({res})")
        a, b = os.path.join(work, tag + ".a.st"), os.path.join(work, tag + ".b.st")
        sh([ckpt, "export", rck, a])
        sh([ckpt, "export", out, b])
        report(tensors(a) == tensors(b), f"resharded to {n} rank(s): parameters unchanged")
    # An f32 stage-2 checkpoint (whole parameters) on the bf16 stage-2
    # plan (f32 master shards): the same world size and stage, other
    # buffers. Converted offline, and resharded on load.
    f32ck = os.path.join(work, "n2s2.ck")
    conv = os.path.join(work, "n2s2-to-bf16.ck")
    sh([ckpt, "reshard", f32ck, "--plan", plans["n2s2bf16"], conv])
    a, b = os.path.join(work, "conv.a.st"), os.path.join(work, "conv.b.st")
    sh([ckpt, "export", f32ck, a])
    sh([ckpt, "export", conv, b])
    off, on = os.path.join(work, "conv.off.st"), os.path.join(work, "conv.on.st")
    r, after = train(plans["n2s2bf16"], 2, "--steps", "6", "--resume", conv, "--save", off)
    report(tensors(a) == tensors(b) and sorted(after) == [5, 6],
           "reshard f32 stage 2 -> bf16 stage 2 (master shards): parameters unchanged, "
           "training resumes")
    r, online = train(plans["n2s2bf16"], 2, "--steps", "6", "--resume", f32ck, "--save", on)
    report(online == after and same_files(on, off) and summary(r)["resumed"]["resharded"]
           and summary(r)["resumed"]["converted"] == [],
           "f32 stage 2 -> bf16 stage 2, resharded on load: losses 5-6 and final parameters "
           "bitwise those resumed from the offline conversion; no storage converted (the "
           "master shards are f32 too)")
    # Hybrid sharding (mesh 2x2, ZeRO-3 inside each replica): exact resume,
    # and the 2-rank checkpoint resharded onto it.
    hs = plan(model("hs", 16, 3), "hs", 4, 3, " mesh=2x2")
    hfull = os.path.join(work, "hs.full.safetensors")
    _, href = train(hs, 4, "--steps", "8", "--save", hfull)
    hck = os.path.join(work, "hs.ck")
    train(hs, 4, "--steps", "4", "--ckpt-dir", hck)
    hres = os.path.join(work, "hs.res.safetensors")
    _, hafter = train(hs, 4, "--steps", "8", "--resume", hck, "--save", hres)
    report(sorted(hafter) == [5, 6, 7, 8] and all(hafter[s] == href[s] for s in hafter)
           and open(hres, "rb").read() == open(hfull, "rb").read(),
           "mesh 2x2 stage 3: resumed losses 5-8 and final parameters bitwise equal")
    hout = os.path.join(work, "rs-hs.ck")
    sh([ckpt, "reshard", rck, "--plan", hs, hout])
    off, on = os.path.join(work, "rs-hs.off.st"), os.path.join(work, "rs-hs.on.st")
    _, hafter = train(hs, 4, "--steps", "8", "--resume", hout, "--save", off)
    worst = max(abs(hafter[s] - cont[s]) / abs(cont[s]) for s in range(5, 9))
    report(sorted(hafter) == [5, 6, 7, 8] and worst <= 1e-6,
           f"resharded 2 ranks stage 3 -> mesh 2x2 stage 3: losses 5-8 within "
           f"{worst:.1e} of the 2-rank continuation")
    # The same on load: both replicas read the same shards.
    _, online = train(hs, 4, "--steps", "8", "--resume", rck, "--save", on)
    report(online == hafter and same_files(on, off),
           "2 ranks stage 3 -> mesh 2x2 stage 3, resharded on load: losses 5-8 and final "
           "parameters bitwise those resumed from the offline conversion")
    # The mesh 2x2 checkpoint on a 1-D 4-rank ZeRO-3 plan, resharded on
    # load: each rank reads its quarter of one replica's state, no more
    # than the data of its file in the offline conversion (the 2x2
    # checkpoint holds two replicas: 8 such quarters).
    flat4 = plan(os.path.join(work, "hs.mlir"), "hs-flat", 4, 3)
    fout = os.path.join(work, "hs-flat.ck")
    sh([ckpt, "reshard", hck, "--plan", flat4, fout])
    off, on = os.path.join(work, "hs-flat.off.st"), os.path.join(work, "hs-flat.on.st")
    _, after = train(flat4, 4, "--steps", "8", "--resume", fout, "--save", off)
    r, online = train(flat4, 4, "--steps", "8", "--resume", hck, "--save", on)
    res = summary(r).get("resumed", {})
    rank0 = sum(len(v) for v in tensors(os.path.join(
        fout, "step-00000004", "rank-00000-of-00004.safetensors")).values())
    worst = max(abs(online[s] - href[s]) / abs(href[s]) for s in range(5, 9))
    report(online == after and same_files(on, off) and worst <= 1e-6,
           f"mesh 2x2 -> 1-D 4 ranks stage 3, resharded on load: bitwise the offline "
           f"conversion's run, losses 5-8 within {worst:.1e} of the 2x2 run")
    report(res.get("written_for") == "4 rank(s) (mesh 2x2) at stage 3"
           and 0 < res.get("rank0_read_bytes", 0) <= rank0
           and 8 * res["rank0_read_bytes"] <= res["checkpoint_bytes"],
           f"resharded on load, rank 0 read {res.get('rank0_read_bytes')} bytes: at most its "
           f"shard ({rank0}) and an eighth of the checkpoint ({res.get('checkpoint_bytes')})")
    # The text output says so.
    r = sh([run, flat4, "--threads", "1", "--lr", "1e-2", "--nproc", "4", "--steps", "5",
            "--resume", hck])
    report("resharded on load: written for 4 rank(s) (mesh 2x2) at stage 3, this plan is for "
           "4 rank(s) (mesh 1x4) at stage 3" in r.stdout,
           "the text output names both layouts: " +
           next((l for l in r.stdout.splitlines() if "resharded" in l), "(no line)"))

    # --init-from a training checkpoint directory: its parameters only, in
    # any layout, under another optimizer (fine-tuning with SGD from the
    # 2-rank AdamW checkpoint, on 1 rank): bitwise the run started from its
    # export (the same f32 values); another model is refused.
    sgd1 = os.path.join(work, "init-sgd.plan")
    sh([opt, os.path.join(work, "rs-n1s0.mlir"), "-o", os.devnull,
        f"--fsdp-pipeline=optimizer=sgd momentum=0.9 plan={sgd1} report=false"])
    exported = os.path.join(work, "rs.export.st")
    sh([ckpt, "export", rck, exported])
    _, from_file = train(sgd1, 1, "--steps", "3", "--init-from", exported)
    r, from_dir = train(sgd1, 1, "--steps", "3", "--init-from", rck)
    report(from_dir == from_file and sorted(from_dir) == [1, 2, 3],
           "--init-from a 2-rank ZeRO-3 AdamW checkpoint directory on a 1-rank SGD plan: "
           "losses 1-3 bitwise those from its export")
    r = sh([run, sgd1, "--threads", "1", "--steps", "1", "--init-from", rck], check=True)
    report("parameters from the training checkpoint " + os.path.join(rck, "step-00000004")
           in r.stdout, "--init-from a checkpoint directory names the checkpoint it used")
    r, _ = train(other, 2, "--steps", "1", "--init-from", rck, check=False)
    report(r.returncode == 1 and "another model" in r.stderr,
           f"--init-from a checkpoint of another model: exit {r.returncode}")

    # A token file's position in its stream carries over a change of the
    # global batch: 2 ranks x 2 rows for 4 steps consume rows 0-15; resumed
    # on 1 rank x 2 rows, step 5 reads rows 16-17 and step 6 rows 18-19
    # (the step alone would give rows 8-11). With the same plan the resume
    # is bitwise the uninterrupted run.
    tok = os.path.join(work, "tokens.bin")
    sh([sys.executable, MAKE_TOKENS, README, "-o", tok, "--max-bytes", "20000"])
    gm = os.path.join(work, "tok.mlir")
    sh([sys.executable, GEN, "gpt", "--vocab", "256", "--ctx", "8", "--layers", "1", "--heads",
        "2", "--width", "16", "--batch", "2", "-o", gm])
    t2, t1 = plan(gm, "tok-n2", 2, 3), plan(gm, "tok-n1", 1, 0)
    tck = os.path.join(work, "tok.ck")
    _, tref = train(t2, 2, "--steps", "6", "--data", tok)
    train(t2, 2, "--steps", "4", "--data", tok, "--ckpt-dir", tck)
    _, tafter = train(t2, 2, "--steps", "6", "--data", tok, "--resume", tck)
    report(sorted(tafter) == [5, 6] and all(tafter[s] == tref[s] for s in (5, 6)),
           "token file, same plan: resumed losses 5-6 bitwise the uninterrupted run's")
    info = sh([ckpt, "info", tck]).stdout
    report("step 4, 2 rank(s) (mesh 1x2), stage 3" in info and
           f"data: {tok}, 32 per step, 16 rows of the stream consumed" in info and
           "storage: parameters f32, exp_avg f32, exp_avg_sq f32" in info,
           "fsdp-ckpt info names the layout, the storage dtypes and the data position: " + " | ".join(
               line.strip() for line in info.splitlines()))
    dump = os.path.join(work, "tok.dump")
    r, _ = train(t1, 1, "--steps", "6", "--data", tok, "--resume", tck, "--dump-dir", dump)
    stream = token_windows(tok, 8)
    got = int_tensors(os.path.join(dump, "batches.safetensors"))
    rows = {s: [v for k, v in got.items() if k.startswith(f"step{s}.")] for s in (5, 6)}
    want = {5: [stream[16], stream[17]], 6: [stream[18], stream[19]]}
    ok = all(any(t == [w[:8] for w in want[s]] for t in rows[s]) for s in (5, 6))
    report(ok and "goes on at row 16 of the stream" in r.stderr,
           "token file, 2x2 rows -> 1x2 rows per step: steps 5 and 6 read rows 16-17 and "
           "18-19 of the stream, where the 2-rank run stopped; stderr: " +
           (r.stderr.strip().splitlines() or ["(none)"])[0][:120])

    r = sh([ckpt, "reshard", rck, "--plan", other, os.path.join(work, "rs-other")], check=False)
    report(r.returncode == 1 and "another shape" in r.stderr,
           f"reshard onto another model: exit {r.returncode}: {r.stderr.strip()[:120]}")
    sgd = os.path.join(work, "rs-sgd.plan")
    sh([opt, os.path.join(work, "rs-n1s0.mlir"), "-o", os.devnull,
        f"--fsdp-pipeline=optimizer=sgd momentum=0.9 plan={sgd} report=false"])
    r = sh([ckpt, "reshard", rck, "--plan", sgd, os.path.join(work, "rs-sgd")], check=False)
    report(r.returncode == 1 and "another optimizer" in r.stderr,
           f"reshard onto another optimizer: exit {r.returncode}: {r.stderr.strip()[:120]}")
    r = sh([ckpt, "reshard", rck, "--plan", src, os.path.join(work, "rs-n1s0.ck")], check=False)
    report(r.returncode == 1 and "exists" in r.stderr,
           f"reshard into an existing checkpoint: exit {r.returncode}")

    # Bad checkpoints: exit 1 and a message naming the problem.
    good = os.path.join(work, "n2s3.ck")

    def bad(label, ck_path, p, n, expect, *extra):
        r, _ = train(p, n, "--steps", "8", "--resume", ck_path, *extra, check=False)
        ok = r.returncode == 1 and expect in r.stderr
        report(ok, f"bad checkpoint: {label}: exit {r.returncode}: "
               f"{(r.stderr.strip().splitlines() or [''])[0][:160]}")

    def copy(tag):
        dst = os.path.join(work, "bad-" + tag)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(good, dst)
        return dst, os.path.join(dst, "step-00000004")

    # Another world size resumes (resharded on load); the global batch
    # changed with it (1 rank of 4 rows, not 2), and stderr says so.
    r, after = train(plans["n1s0"], 1, "--steps", "6", "--resume", good)
    report(r.returncode == 0 and sorted(after) == [5, 6] and
           "trained on 8 samples per step, this one on 4" in r.stderr,
           f"another world size and global batch: resumes, with a note: "
           f"{(r.stderr.strip().splitlines() or ['(none)'])[0][:160]}")
    r, after = train(plans["n2s2"], 2, "--steps", "8", "--resume", good)
    ref = refs["n2s3"]
    worst = max(abs(after[s] - ref[s]) / abs(ref[s]) for s in range(5, 9))
    report(r.returncode == 0 and "note" not in r.stderr and worst <= 1e-6,
           f"another stage (3 -> 2), resharded on load: losses 5-8 within {worst:.1e} of the "
           f"uninterrupted stage-3 run, no note")
    bad("another model", good, other, 2, "another model")
    d, s4 = copy("missing")
    os.remove(os.path.join(s4, "rank-00001-of-00002.safetensors"))
    bad("a missing shard file", d, p, 2, "rank-00001-of-00002.safetensors")
    d, s4 = copy("truncated")
    f = os.path.join(s4, "rank-00000-of-00002.safetensors")
    os.truncate(f, os.path.getsize(f) - 10)
    bad("a truncated shard file", d, p, 2, "rank-00000-of-00002.safetensors")
    bad("a truncated shard file, resharded on load", d, plans["n1s0"], 1,
        "rank-00000-of-00002.safetensors")
    d, s4 = copy("index")
    open(os.path.join(s4, "index.json"), "w").write("{not json")
    bad("a corrupt index", d, p, 2, "not valid JSON")
    d, s4 = copy("format")
    idx = json.load(open(os.path.join(s4, "index.json")))
    idx["files"] = idx["files"][:1]
    json.dump(idx, open(os.path.join(s4, "index.json"), "w"))
    bad("an index listing one file for two ranks", d, p, 2, "one file per rank")
    # Integers as floats far out of int64's range (converting them would
    # be undefined behaviour: the fuzzer's find), and a mesh whose factors'
    # product overflows.
    d, s4 = copy("float-id")
    idx = json.load(open(os.path.join(s4, "index.json")))
    idx["shard_map"]["buffers"][0]["id"] = -8.88889e+83
    json.dump(idx, open(os.path.join(s4, "index.json"), "w"))
    bad("a shard-map id that is a float", d, p, 2, "'id' is not an integer")
    d, s4 = copy("float-shape")
    idx = json.load(open(os.path.join(s4, "index.json")))
    idx["shard_map"]["params"][0]["shape"] = [1e300]
    json.dump(idx, open(os.path.join(s4, "index.json"), "w"))
    bad("a shard-map shape of floats", d, p, 2, "'shape' is not an integer")
    d, s4 = copy("mesh-overflow")
    idx = json.load(open(os.path.join(s4, "index.json")))
    idx["mesh"] = [2**62, 4]
    json.dump(idx, open(os.path.join(s4, "index.json"), "w"))
    bad("a mesh whose product overflows", d, p, 2, "mesh must be")
    d, s4 = copy("nocommit")
    os.remove(os.path.join(s4, "COMMIT"))
    bad("no committed checkpoint", d, p, 2, "no complete checkpoint")
    bad("a checkpoint at the last step", good, p, 2, "nothing to run", "--steps", "4")
    bad("not a directory", os.path.join(work, "nothing-here"), p, 2, "is not a directory")

    print("all checkpoint checks passed" if not failures else f"FAIL: {failures} check(s)")
    return 1 if failures else 0


def token_windows(path, T):
    """The windows of T + 1 tokens the token-file source cuts (row w starts
    at token w * T)."""
    import struct
    data = open(path, "rb").read()
    n = struct.unpack("<i", data[8:12])[0]
    toks = struct.unpack(f"<{n}H", data[1024:1024 + 2 * n])
    return [list(toks[w * T:w * T + T + 1]) for w in range((n - 1) // T)]


def int_tensors(path):
    """{name: rows as lists of ints} of a safetensors file of 2-D integer
    tensors."""
    import struct
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    fmt = {"I32": "i", "I64": "q", "U16": "H", "I16": "h"}
    out = {}
    for k, v in header.items():
        if v["dtype"] not in fmt or len(v["shape"]) != 2:
            continue
        a, b = v["data_offsets"]
        vals = struct.unpack(f"<{(b - a) // struct.calcsize(fmt[v['dtype']])}{fmt[v['dtype']]}",
                             data[8 + n + a:8 + n + b])
        cols = v["shape"][1]
        out[k] = [list(vals[i:i + cols]) for i in range(0, len(vals), cols)]
    return out


def tensors(path):
    """{name: bytes} of a safetensors file (metadata aside)."""
    import struct
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items()}


if __name__ == "__main__":
    sys.exit(main())
