#!/usr/bin/env python3
"""Fault tests for `fsdp-run --nproc`: the job dies with its launcher, the
rendezvous directory never leaks, and a stalled rank is named.

Each case starts a long 4-rank run (--steps 1000000) with a short collective
timeout, waits until every rank has issued collectives (read from the
flight recorder's records in the rendezvous directory), injects the fault
and checks what follows against generous bounds (a loaded 2-core machine
must pass). Every case runs under its own TMPDIR, so the store directory is
known, and in its own session, so nothing it started can outlive it.

  faults.py --fsdp-run BIN --plan PLAN --work DIR CASE...
  CASE: launcher-kill | launcher-kill-stopped-rank | launcher-term |
        launcher-int | rank-kill | stop-rank | stalled-rank-resumes

Prints one line per case ("ok: ..." with measured times) and exits 1 on the
first failure, with the job's stderr.
"""

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

COMM_TIMEOUT_S = 3
START_BOUND_S = 180  # plan load + rendezvous + first collectives, loaded machine
GONE_BOUND_S = 20  # ranks gone after the launcher is killed
# A stall is reported after the timeout plus four heartbeats; the launcher
# then stops the others within a few seconds.
STALL_BOUND_S = COMM_TIMEOUT_S + 60


class Failure(Exception):
    pass


def state_of(pid):
    """'' when the process is gone (or a zombie), else its state letter."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return ""
    st = s[s.rfind(")") + 2]
    return "" if st in "ZX" else st


def wait_until(pred, bound, what):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > bound:
            raise Failure(f"{what}: not within {bound} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def entered(record_path):
    try:
        with open(record_path) as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return -1


class Job:
    def __init__(self, args, tag, nproc=4, env=None, argv=None):
        self.tmp = os.path.join(args.work, tag)
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.env = dict(os.environ, TMPDIR=self.tmp,
                        FSDP_COMM_TIMEOUT_S=str(COMM_TIMEOUT_S), **(env or {}))
        self.nproc = nproc
        self.err = open(os.path.join(self.tmp, "stderr.txt"), "w+")
        argv = (argv or [args.fsdp_run, args.plan, "--nproc", str(nproc),
                         "--steps", "1000000", "--quiet"])
        if args.comm:
            argv = argv + ["--comm", args.comm]
        if args.nnodes:
            argv = argv + ["--nnodes", str(args.nnodes)]
        self.proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=self.err, start_new_session=True)

    def store(self):
        dirs = glob.glob(os.path.join(self.tmp, "fsdp-store-*"))
        return dirs[0] if dirs else None

    def wait_running(self, min_collectives=20):
        """Until every rank has entered `min_collectives` collectives."""
        def ready():
            if self.proc.poll() is not None:
                raise Failure(f"the job exited early ({self.proc.returncode}):\n"
                              + self.stderr())
            d = self.store()
            return d is not None and all(
                entered(os.path.join(d, f"progress.{r}")) >= min_collectives
                for r in range(self.nproc))
        wait_until(ready, START_BOUND_S, "the job did not start")
        return self.store()

    def ranks(self):
        """rank -> pid, from the launcher's children and their FSDP_RANK."""
        out = {}
        for task in glob.glob(f"/proc/{self.proc.pid}/task/*/children"):
            with open(task) as f:
                for pid in map(int, f.read().split()):
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as e:
                            for kv in e.read().split(b"\0"):
                                if kv.startswith(b"FSDP_RANK="):
                                    out[int(kv[10:])] = pid
                    except OSError:
                        pass
        if len(out) != self.nproc:
            raise Failure(f"found ranks {sorted(out)} of {self.nproc}")
        return out

    def stderr(self):
        self.err.flush()
        self.err.seek(0)
        return self.err.read()

    def cleanup(self):
        # Whatever the outcome, nothing of this job survives the test.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()


def check_gone(pids, what):
    t = wait_until(lambda: all(not state_of(p) for p in pids), GONE_BOUND_S,
                   f"{what}: ranks still running")
    return t


def check_no_store(job, store, what):
    wait_until(lambda: not os.path.exists(store), 10,
               f"{what}: the rendezvous directory {store} was left behind")
    left = glob.glob(os.path.join(job.tmp, "fsdp-store-*"))
    if left:
        raise Failure(f"{what}: left behind {left}")


def launcher_signal(args, sig, tag, stop_rank=None):
    job = Job(args, tag)
    try:
        store = job.wait_running()
        ranks = job.ranks()
        pids = list(ranks.values())
        if stop_rank is not None:
            # Stopped, it cannot act on the parent-death signal until a
            # sibling continues it.
            os.kill(ranks[stop_rank], signal.SIGSTOP)
            wait_until(lambda: state_of(ranks[stop_rank]) == "T", 10, "SIGSTOP")
        t0 = time.monotonic()
        os.kill(job.proc.pid, sig)
        gone = check_gone(pids, tag)
        if sig != signal.SIGKILL:
            job.proc.wait(timeout=GONE_BOUND_S)
            if job.proc.returncode != -sig:
                raise Failure(f"{tag}: the launcher exited with {job.proc.returncode}, "
                              f"expected death by signal {sig}")
            if f"stopped by signal {int(sig)}" not in job.stderr():
                raise Failure(f"{tag}: no 'stopped by signal' message:\n" + job.stderr())
        check_no_store(job, store, tag)
        print(f"ok: {tag}: all {len(pids)} ranks gone {gone:.2f} s after "
              f"signal {int(sig)} to the launcher; rendezvous directory removed "
              f"({time.monotonic() - t0:.2f} s)")
    except Failure:
        sys.stderr.write(job.stderr())
        raise
    finally:
        job.cleanup()


def stop_rank(args):
    job = Job(args, "stop-rank")
    try:
        store = job.wait_running()
        ranks = job.ranks()
        t0 = time.monotonic()
        os.kill(ranks[2], signal.SIGSTOP)
        try:
            job.proc.wait(timeout=STALL_BOUND_S)
        except subprocess.TimeoutExpired:
            raise Failure(f"stop-rank: the job still runs {STALL_BOUND_S} s after "
                          "rank 2 was stopped")
        took = time.monotonic() - t0
        err = job.stderr()
        if job.proc.returncode == 0:
            raise Failure("stop-rank: the job succeeded with a stopped rank")
        named = re.search(r"rank 2 (did not arrive: it|entered it but) is stopped", err)
        wrong = re.search(r"rank [013] (did not arrive: it|entered it but) is stopped", err)
        if not named or wrong:
            raise Failure("stop-rank: the error does not name rank 2 as stopped:\n" + err)
        check_gone(ranks.values(), "stop-rank")
        check_no_store(job, store, "stop-rank")
        line = next(l for l in err.splitlines() if "rank 2" in l)
        print(f"ok: stop-rank: job failed {took:.1f} s after SIGSTOP (timeout "
              f"{COMM_TIMEOUT_S} s) naming rank 2")
        print("message: " + line[line.index("collective #"):])
    except Failure:
        sys.stderr.write(job.stderr())
        raise
    finally:
        job.cleanup()


def rank_kill(args):
    """The case that already worked: a killed rank ends the job at once."""
    job = Job(args, "rank-kill")
    try:
        store = job.wait_running()
        ranks = job.ranks()
        t0 = time.monotonic()
        os.kill(ranks[2], signal.SIGKILL)
        job.proc.wait(timeout=GONE_BOUND_S)
        took = time.monotonic() - t0
        err = job.stderr()
        if job.proc.returncode != 1 or "rank 2 was killed by signal 9" not in err:
            raise Failure(f"rank-kill: exit {job.proc.returncode}, message:\n" + err)
        check_gone(ranks.values(), "rank-kill")
        check_no_store(job, store, "rank-kill")
        print(f"ok: rank-kill: job over {took:.2f} s after SIGKILL of rank 2")
    except Failure:
        sys.stderr.write(job.stderr())
        raise
    finally:
        job.cleanup()


def stalled_rank_resumes(args):
    """Two ranks joined by hand (no launcher): rank 1 is stopped, rank 0
    gives up; rank 1, continued, says that it was the one that stalled."""
    tmp = os.path.join(args.work, "resume")
    store = os.path.join(tmp, "store")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(store)
    procs = []
    try:
        for r in range(2):
            env = dict(os.environ, FSDP_RANK=str(r), FSDP_WORLD_SIZE="2",
                       FSDP_STORE_DIR=store, FSDP_COMM_TIMEOUT_S=str(COMM_TIMEOUT_S))
            err = open(os.path.join(tmp, f"rank{r}.err"), "w+")
            procs.append((subprocess.Popen(
                [args.fsdp_run, args.plan2, "--steps", "1000000", "--quiet"]
                + (["--comm", args.comm] if args.comm else []), env=env,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True), err))
        wait_until(lambda: all(entered(os.path.join(store, f"progress.{r}")) >= 20
                               for r in range(2)) or any(p.poll() is not None for p, _ in procs),
                   START_BOUND_S, "the ranks did not start")
        (p0, e0), (p1, e1) = procs
        os.kill(p1.pid, signal.SIGSTOP)
        p0.wait(timeout=STALL_BOUND_S)
        e0.seek(0)
        msg0 = e0.read()
        if p0.returncode == 0 or not re.search(
                r"rank 1 (did not arrive: it|entered it but) is stopped", msg0):
            raise Failure("resume: rank 0 did not name rank 1:\n" + msg0)
        os.kill(p1.pid, signal.SIGCONT)
        p1.wait(timeout=STALL_BOUND_S)
        e1.seek(0)
        msg1 = e1.read()
        if p1.returncode == 0 or "this rank (1) itself was not running for" not in msg1 \
                or "rank 0 gave up" not in msg1:
            raise Failure("resume: rank 1 does not say it stalled:\n" + msg1)
        print("ok: stalled-rank-resumes")
        print("message: " + msg1[msg1.index("collective #"):].strip())
    finally:
        for p, _ in procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp-run", required=True)
    ap.add_argument("--plan", required=True, help="a plan for 4 ranks")
    ap.add_argument("--plan2", help="a plan for 2 ranks (stalled-rank-resumes)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--comm", help="fsdp-run --comm (default: fsdp-run's, auto)")
    ap.add_argument("--nnodes", type=int,
                    help="fsdp-run --nnodes for the 4-rank jobs (2: the hybrid communicator)")
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    cases = {
        "launcher-kill": lambda: launcher_signal(args, signal.SIGKILL, "launcher-kill"),
        "launcher-kill-stopped-rank": lambda: launcher_signal(
            args, signal.SIGKILL, "launcher-kill-stopped-rank", stop_rank=2),
        "launcher-term": lambda: launcher_signal(args, signal.SIGTERM, "launcher-term"),
        "launcher-int": lambda: launcher_signal(args, signal.SIGINT, "launcher-int"),
        "rank-kill": lambda: rank_kill(args),
        "stop-rank": lambda: stop_rank(args),
        "stalled-rank-resumes": lambda: stalled_rank_resumes(args),
    }
    for c in args.cases:
        try:
            cases[c]()
        except (Failure, subprocess.TimeoutExpired) as e:
            print(f"FAIL: {c}: {e}", file=sys.stderr)
            return 1
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
