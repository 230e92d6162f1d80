#!/usr/bin/env python3
"""A loss mask (cross_entropy's ignore_index, fsdp-run --loss-mask) keeps
N ranks == 1 rank, whatever the sharding or the accumulation.

On text whose lines are half "prompt" (tools/make_tokens.py --loss-mask:
windows keep uneven numbers of targets, so a per-rank or per-micro-batch
mean would differ), the small GPT with ignore_index -100, clipped, AdamW:

  layouts   one rank with the global batch of 8 rows is the reference; each
            layout of the same 8 rows per step (ranks x micro-batches x
            rows: ZeRO-3 2x2x2, ZeRO-2 2x2x2 reducing each micro-batch,
            ZeRO-1 2x1x4, stage 0 4x1x2, HSDP 2x2 with 2 micro-batches of
            1) gives its losses within RTOL (relative; summation order);
  eval      --eval-loss-mask: one masked evaluation batch before the
            first step is step 1's loss, bit for bit;
  mask      the masked losses are not the unmasked run's (the mask acts);
  resume    a run checkpointed at step 3 and resumed gives steps 4-6 bit
            for bit (the mask follows the data position);
  all out   a mask of zeros: every loss is 0 and the gradient norm 0 (no
            NaN from 0 / 0), and the run completes.

usage: loss_mask.py BIN_DIR RTOL
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
GEN = os.path.join(ROOT, "examples", "gen_models.py")
TOKENS = os.path.join(ROOT, "tools", "make_tokens.py")
TEXT = "/usr/share/common-licenses/GPL-3"
STEPS = 6


def main():
    bindir, rtol = sys.argv[1], float(sys.argv[2])
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        data, mask = os.path.join(tmp, "t.bin"), os.path.join(tmp, "m.bin")
        subprocess.run([sys.executable, TOKENS, TEXT, "-o", data, "--loss-mask", mask],
                       check=True)

        def plan(batch, pipeline, tag):
            model = os.path.join(tmp, f"gpt{batch}.mlir")
            if not os.path.exists(model):
                subprocess.run([sys.executable, GEN, "gpt", "--ignore-index", "-100", "--batch",
                                str(batch), "-o", model], check=True)
            path = os.path.join(tmp, tag + ".plan")
            subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw max-grad-norm=1.0 {pipeline} "
                            f"plan={path} report=false"], check=True)
            return path

        def run(path, nproc=1, masked=mask, extra=()):
            cmd = [os.path.join(bindir, "fsdp-run"), path, "--steps", str(STEPS), "--lr", "3e-3",
                   "--threads", "1", "--json", "--data", data] + list(extra)
            if masked:
                cmd += ["--loss-mask", masked]
            if nproc > 1:
                cmd += ["--nproc", str(nproc)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            return [r for r in rows if "step" in r]

        ref = [r["loss"] for r in run(plan(8, "", "ref"))]
        layouts = (("ZeRO-3, 2 ranks x 2 micro-batches x 2", 2, 2,
                    "world-size=2 stage=3 grad-accum=2"),
                   ("ZeRO-2, 2 x 2 x 2, reduced each micro-batch", 2, 2,
                    "world-size=2 stage=2 grad-accum=2 accum-reduce=microbatch"),
                   ("ZeRO-1, 2 ranks x 4", 2, 4, "world-size=2 stage=1"),
                   ("stage 0, 4 ranks x 2", 4, 2, "world-size=4 stage=0"),
                   ("HSDP 2x2, 2 micro-batches x 1", 4, 1,
                    "world-size=4 stage=3 mesh=2x2 grad-accum=2"))
        for name, n, batch, pipeline in layouts:
            tag = "".join(c if c.isalnum() else "_" for c in name)
            got = [r["loss"] for r in run(plan(batch, pipeline, tag), nproc=n)]
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
            ok = len(got) == len(ref) and worst <= rtol
            print(f"layout {name}: max relative loss difference {worst:.2e} "
                  f"(bound {rtol:g}): {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(name)

        # --eval-loss-mask: one evaluation batch of the training data before
        # the first step is step 1's forward pass on the same batch.
        ev = subprocess.run([os.path.join(bindir, "fsdp-run"), plan(8, "", "ref"), "--steps", "1",
                             "--threads", "1", "--data", data, "--loss-mask", mask,
                             "--eval-every", "1", "--eval-batches", "1", "--eval-data", data,
                             "--eval-loss-mask", mask, "--json"],
                            check=True, capture_output=True, text=True, timeout=300).stdout
        evals = [r for r in (json.loads(l) for l in ev.splitlines() if l.startswith("{"))
                 if r.get("eval")]
        val = evals[0]["val_loss"] if evals else None
        ok = val == ref[0]
        print(f"eval: the masked validation loss before step 1 is step 1's loss, bitwise "
              f"({val} vs {ref[0]}): {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append("eval")

        plain = [r["loss"] for r in run(plan(8, "", "ref"), masked=None)]
        moved = min(abs(a - b) / abs(b) for a, b in zip(ref, plain))
        ok = moved > 1e-3
        print(f"mask: the masked losses differ from the unmasked ones by at least "
              f"{moved:.2e}: {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append("mask")

        ckpt = os.path.join(tmp, "ckpt")
        p2 = plan(2, "world-size=2 stage=3 grad-accum=2", "ckpt")
        whole = [r["loss"] for r in run(p2, nproc=2)]
        subprocess.run([os.path.join(bindir, "fsdp-run"), p2, "--steps", str(STEPS), "--lr",
                        "3e-3", "--threads", "1", "--data", data, "--loss-mask", mask,
                        "--nproc", "2", "--ckpt-dir", ckpt, "--save-every", "3", "--quiet"],
                       check=True, capture_output=True, timeout=300)
        subprocess.run(["sh", "-c", f"rm -rf {ckpt}/step-00000006"], check=True)
        rest = [r["loss"] for r in run(p2, nproc=2, extra=["--resume", ckpt])]
        ok = rest == whole[3:]
        print(f"resume: steps 4-{STEPS} from the step-3 checkpoint bitwise the uninterrupted "
              f"run: {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append("resume")

        zeros = os.path.join(tmp, "zeros.bin")
        with open(data, "rb") as f:
            n = struct.unpack("<3i", f.read(12))[2]
        with open(zeros, "wb") as f:
            f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
            f.write(bytes(2 * n))
        rows = run(p2, nproc=2, masked=zeros)
        ok = len(rows) == STEPS and all(r["loss"] == 0 and r["grad_norm"] == 0
                                        for r in rows)
        print(f"all out: {len(rows)} steps, losses {sorted({r['loss'] for r in rows})}, "
              f"gradient norms {sorted({r['grad_norm'] for r in rows})}: "
              f"{'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append("all out")

    print("MATCH" if not failures else f"MISMATCH: {', '.join(failures)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
