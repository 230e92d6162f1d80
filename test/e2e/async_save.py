#!/usr/bin/env python3
"""Checkpoints written in the background (fsdp-run --async-save).

usage: async_save.py BIN_DIR WORK_DIR [FSDP_OPT]

Every rank's file is written while the next steps run (FSDP_FAULT_SLOW_SAVE_MS
holds each write back so that they certainly do), so what must hold is:
- the checkpoints are those a synchronous save writes, byte for byte (every
  rank file and index.json): the snapshot is this step's state, not what
  the steps after it wrote into the same buffers;
- training is undisturbed (losses bitwise those of the synchronous run) and
  a resume from the asynchronous checkpoint is bitwise the uninterrupted run;
- --keep applies; every step that saved reports save_ms, the summary the
  count and the time training was held;
- failures: a rank killed before its file is durable leaves the previous
  checkpoint the newest committed one; a rank killed after its file is
  durable leaves a checkpoint that resumes exactly whichever is newest; a
  background write that fails is a clear error (exit 1, no COMMIT).
"""
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
failures = 0


def report(ok, what):
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {what}")


def sh(args, env=None, check=True):
    e = dict(os.environ)
    for k in list(e):
        if k.startswith("FSDP_FAULT_"):
            del e[k]
    e.update(env or {})
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=e)
    if check and r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(args)}\n{r.stderr}")
    return r


def committed(ck):
    return sorted(d for d in os.listdir(ck) if os.path.exists(os.path.join(ck, d, "COMMIT")))


def files_of(step_dir):
    """Every file of a checkpoint directory but COMMIT, name -> bytes."""
    return {f: open(os.path.join(step_dir, f), "rb").read()
            for f in sorted(os.listdir(step_dir)) if f != "COMMIT"}


def main():
    bindir, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    opt, run = (os.path.join(bindir, t) for t in ("fsdp-opt", "fsdp-run"))
    if len(sys.argv) > 3:
        opt = sys.argv[3]
    mlir = os.path.join(work, "m.mlir")
    sh([sys.executable, GEN, "mlp", "--hidden", "16", "--blocks", "2", "--batch", "4",
        "-o", mlir])

    def plan(tag, n, stage, extra=""):
        path = os.path.join(work, tag + ".plan")
        sh([opt, mlir, "-o", os.devnull, f"--fsdp-pipeline=optimizer=adamw world-size={n} "
            f"stage={stage} plan={path} report=false{extra}"])
        return path

    def train(p, n, *extra, env=None, check=True):
        args = [run, p, "--threads", "1", "--lr", "1e-2", "--json"] + list(extra)
        if n > 1:
            args += ["--nproc", str(n)]
        r = sh(args, env=env, check=check)
        steps, summary = {}, {}
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                j = json.loads(line)
                if "step" in j:
                    steps[j["step"]] = j
                elif j.get("summary"):
                    summary = j
        return r, steps, summary

    slow = {"FSDP_FAULT_SLOW_SAVE_MS": "400"}
    for n, stage, extra in ((1, 0, ""), (2, 3, ""), (2, 1, " param-dtype=bf16")):
        tag = f"n{n}s{stage}" + ("bf16" if extra else "")
        p = plan(tag, n, stage, extra)
        sync_ck, async_ck = (os.path.join(work, f"{tag}.{k}") for k in ("sync", "async"))
        _, ref, ref_sum = train(p, n, "--steps", "6", "--ckpt-dir", sync_ck, "--save-every", "2")
        _, got, got_sum = train(p, n, "--steps", "6", "--ckpt-dir", async_ck, "--save-every",
                                "2", "--async-save", env=slow)
        report(sorted(got) == list(range(1, 7)) and
               all(got[s]["loss"] == ref[s]["loss"] for s in ref),
               f"{tag}: losses of the run saving in the background equal the synchronous run's")
        report(committed(async_ck) == ["step-00000002", "step-00000004", "step-00000006"],
               f"{tag}: checkpoints 2, 4, 6 committed ({committed(async_ck)})")
        for s in ("step-00000002", "step-00000004", "step-00000006"):
            a, b = files_of(os.path.join(async_ck, s)), files_of(os.path.join(sync_ck, s))
            report(a == b and len(a) == n + 1,
                   f"{tag}: {s}: every rank file and the index equal the synchronous save's "
                   f"byte for byte ({sorted(a)})")
        report(all(("save_ms" in got[s]) == (s % 2 == 0) for s in got) and
               got_sum.get("checkpoints") == 3 and "save_finish_ms" in got_sum,
               f"{tag}: save_ms on steps 2, 4, 6; summary: {got_sum.get('checkpoints')} "
               f"checkpoints, {got_sum.get('save_blocking_ms', 0):.1f} ms holding training, "
               f"{got_sum.get('save_finish_ms', 0):.1f} ms waiting at the end (synchronous: "
               f"{ref_sum.get('save_blocking_ms', 0):.1f} ms)")
        _, after, _ = train(p, n, "--steps", "6", "--resume",
                            os.path.join(async_ck, "step-00000004"))
        report(sorted(after) == [5, 6] and all(after[s]["loss"] == ref[s]["loss"] for s in after),
               f"{tag}: resumed from the background step-4 checkpoint: losses 5-6 bitwise")

    p = plan("n2s3k", 2, 3)
    _, ref, _ = train(p, 2, "--steps", "8")
    keep = os.path.join(work, "keep.ck")
    train(p, 2, "--steps", "8", "--ckpt-dir", keep, "--save-every", "2", "--keep", "2",
          "--async-save", env=slow)
    report(sorted(os.listdir(keep)) == ["step-00000006", "step-00000008"],
           f"--keep 2 with --async-save leaves {sorted(os.listdir(keep))}")

    # Rank 1 killed at the start of step 5, while its step-4 file is held
    # back: no COMMIT for step 4; step 2 resumes exactly.
    ck = os.path.join(work, "killed-early.ck")
    r, _, _ = train(p, 2, "--steps", "8", "--ckpt-dir", ck, "--save-every", "2",
                    "--async-save", check=False,
                    env={"FSDP_FAULT_SLOW_SAVE_MS": "1500", "FSDP_FAULT_KILL_RANK": "1",
                         "FSDP_FAULT_KILL_STEP": "5"})
    report(r.returncode == 1 and committed(ck) == ["step-00000002"],
           f"rank 1 killed before its step-4 file was durable: exit {r.returncode}, "
           f"committed {committed(ck)}")
    _, after, _ = train(p, 2, "--steps", "8", "--resume", ck)
    report(sorted(after) == list(range(3, 9)) and all(after[s]["loss"] == ref[s]["loss"]
                                                      for s in after),
           "resumed from step 2: losses 3-8 bitwise the uninterrupted run")

    # Rank 1 killed right after its step-4 file is durable: rank 0 may have
    # committed step 4 before the job stopped, or not; either way the newest
    # committed checkpoint resumes exactly.
    ck = os.path.join(work, "killed-late.ck")
    r, _, _ = train(p, 2, "--steps", "8", "--ckpt-dir", ck, "--save-every", "2",
                    "--async-save", check=False,
                    env={"FSDP_FAULT_KILL_RANK": "1", "FSDP_FAULT_KILL_SAVE_STEP": "4"})
    done = committed(ck)
    report(r.returncode == 1 and done in (["step-00000002"], ["step-00000002", "step-00000004"]),
           f"rank 1 killed after its step-4 file: exit {r.returncode}, committed {done}")
    newest = int(done[-1].split("-")[1]) if done else 0
    _, after, _ = train(p, 2, "--steps", "8", "--resume", ck)
    report(sorted(after) == list(range(newest + 1, 9)) and
           all(after[s]["loss"] == ref[s]["loss"] for s in after),
           f"resumed from step {newest}: the rest bitwise the uninterrupted run")

    # A background write that fails: exit 1, the error names it, no COMMIT.
    ck = os.path.join(work, "failed.ck")
    r, _, _ = train(p, 2, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2",
                    "--async-save", check=False, env={"FSDP_FAULT_SAVE_ERROR_RANK": "1"})
    report(r.returncode == 1 and "injected failure" in r.stderr and committed(ck) == [],
           f"rank 1's background write fails: exit {r.returncode}, committed {committed(ck)}: "
           f"{[ln for ln in r.stderr.splitlines() if 'injected' in ln][:1]}")
    r, _, _ = train(p, 2, "--steps", "4", "--async-save", check=False)
    report(r.returncode != 0 and "--async-save needs --ckpt-dir" in r.stderr,
           f"--async-save without --ckpt-dir: exit {r.returncode}")

    print("all async-save checks passed" if not failures else f"FAIL: {failures} check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
