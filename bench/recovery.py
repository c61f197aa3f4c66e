#!/usr/bin/env python3
"""What surviving a failure costs: in-memory snapshots against disk checkpoints, on the same run.

Cost: train_gpt trains the same run without snapshots, with an in-memory snapshot every 1, 2, 5 and 10 steps, and with
a disk checkpoint every 10 steps (in place, and in the background); each row gives the median step, its slowdown
against the run without, and the time the training loop itself waited per snapshot (the host copy, the exchange with
the peer, the previous snapshot's writing) as a fraction of the steps between snapshots. The background writing runs
on the CPU's cores: on a machine whose cores all train (this one, ranks as threads) it slows the steps, which the
slowdown column shows; on a GPU it runs on a host that is otherwise idle.

Recovery: the run under loom-run, one process killed (SIGKILL) after step --kill-at, restarted from the newest disk
checkpoint (every --disk-every steps) or from the newest in-memory snapshot (every step): detection (from the signal
to loom-run's decision), restart (from the decision to the first step of the new attempt), the steps done again, and
the wall time lost (detection, restart and the steps done again). A frozen process (SIGSTOP) is detected after the
heartbeat.

  bench/recovery.py --build BUILD [--parallel dp2] [--steps 20] [--batch 16] [--seq 256] [--kill-at 15]
                    [--disk-every 10] [--heartbeat-s 2] [--json FILE]
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def train_gpt(args, *extra):
    return [os.path.join(args.build, "examples", "train_gpt"), "--model", "small", "--parallel", args.parallel,
            "--no-progress", *extra]


def step_times(log, batch, seq):
    """Seconds of each logged step (tokens over its tokens_per_s)."""
    return [batch * seq / json.loads(l)["tokens_per_s"] for l in open(log)]


def cost_rows(args, tmp):
    rows = []
    kinds = [("none", []), *[(f"snapshot every {k}", ["--snapshot-every", str(k)]) for k in (1, 2, 5, 10)],
             ("disk every 10, in place", ["--save-every", "10"]),
             ("disk every 10, background", ["--save-every", "10", "--async-save"])]
    for name, flags in kinds:
        d = tempfile.mkdtemp(dir=tmp)
        extra = ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                 "--log-json", f"{d}/log.jsonl", "--save", f"{d}/ck", *flags]
        if "--snapshot-every" in flags:
            extra += ["--snapshot-dir", f"{d}/store"]
        out = subprocess.run(train_gpt(args, *extra), capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"recovery: train_gpt failed ({name}):\n{out.stdout}{out.stderr}")
        steps = step_times(f"{d}/log.jsonl", args.batch, args.seq)[2:]  # past the first steps' warm-up
        row = {"kind": name, "step_s": statistics.median(steps)}
        m = re.search(r"(\d+) in-memory snapshots? .*training waited ([0-9.]+) s in all \(host copy ([0-9.]+), "
                      r"exchange ([0-9.]+), previous writing ([0-9.]+)\)", out.stdout)
        if m:
            n = int(m.group(1))
            every = int(flags[1])
            row.update(per_snapshot_s=float(m.group(2)) / n, copy_s=float(m.group(3)) / n,
                       exchange_s=float(m.group(4)) / n, wait_s=float(m.group(5)) / n, every=every)
        m = re.search(r"saved .*\((\d+) checkpoints?, .*training waited ([0-9.]+) s in all", out.stdout)
        if m and "--save-every" in flags:
            n = int(m.group(1))
            row.update(per_snapshot_s=float(m.group(2)) / n, every=10)
        rows.append(row)
        shutil.rmtree(d, ignore_errors=True)
    base = rows[0]["step_s"]
    for r in rows:
        r["slowdown"] = r["step_s"] / base - 1
        if "per_snapshot_s" in r:
            r["waited_fraction"] = r["per_snapshot_s"] / (r["every"] * base)
    return rows


def lines(path):
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def train_gpt_pids(root):
    """The train_gpt processes under process `root`."""
    out, queue = [], [root]
    while queue:
        p = queue.pop()
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        for k in map(int, kids):
            queue.append(k)
            comm = subprocess.run(["ps", "-o", "comm=", "-p", str(k)], capture_output=True, text=True).stdout.strip()
            if comm == "train_gpt":
                out.append(k)
    return out


def recovery_row(args, tmp, name, flags, sig):
    d = tempfile.mkdtemp(dir=tmp)
    log = f"{d}/log.jsonl"
    cmd = [os.path.join(args.build, "examples", "loom-run"), "--heartbeat-s", str(args.heartbeat_s), "--log",
           f"{d}/failures.jsonl", "--",
           *train_gpt(args, "--steps", str(args.recovery_steps), "--batch", "8", "--seq", "64", "--save", f"{d}/ck",
                      "--log-json", log, "--auto-resume", *flags)]
    if "--snapshot-every" in flags:
        cmd += ["--snapshot-dir", f"{d}/store"]
    sup = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while lines(log) < args.kill_at and sup.poll() is None:
        time.sleep(0.01)
    victim = train_gpt_pids(sup.pid)[0]
    at = lines(log)
    sent = time.time()
    os.kill(victim, sig)
    # The first step of the new attempt: the log grows past what it held when the signal went.
    first = None
    while sup.poll() is None:
        now = lines(log)
        if first is None and now > at:
            first = time.time()
        time.sleep(0.01)
    err = sup.stderr.read()
    if sup.returncode != 0:
        sys.exit(f"recovery: loom-run failed ({name}):\n{err}")
    recs = [json.loads(l) for l in open(f"{d}/failures.jsonl")]
    fail = next(r for r in recs if "detected_unix_ms" in r)
    start = next(r for r in recs if "starts_at" in r)
    steps = step_times(log, 8, 64)
    step_s = statistics.median(steps[2:])
    detect = fail["detected_unix_ms"] / 1000 - sent
    restart = first - fail["detected_unix_ms"] / 1000 - step_s  # to the start of the attempt's first step
    shutil.rmtree(d, ignore_errors=True)
    redone = start["redone_steps"]
    return {"kind": name, "signal": "SIGKILL" if sig == signal.SIGKILL else "SIGSTOP", "at_step": at,
            "detect_s": detect, "restart_s": restart, "resumed_at": start["starts_at"], "redone_steps": redone,
            "step_s": step_s, "lost_s": detect + restart + redone * step_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--parallel", default="dp2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--recovery-steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=17)
    ap.add_argument("--disk-every", type=int, default=10)
    ap.add_argument("--heartbeat-s", type=float, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom-recovery-")
    try:
        cost = cost_rows(args, tmp)
        disk = ["--save-every", str(args.disk_every)]
        rec = [recovery_row(args, tmp, f"disk checkpoint every {args.disk_every}", disk, signal.SIGKILL),
               recovery_row(args, tmp, "in-memory snapshot every step", disk + ["--snapshot-every", "1"],
                            signal.SIGKILL),
               recovery_row(args, tmp, "in-memory snapshot every step", disk + ["--snapshot-every", "1"],
                            signal.SIGSTOP)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"Snapshot cost: train_gpt --model small --parallel {args.parallel} --batch {args.batch} --seq {args.seq}, "
          f"{args.steps} steps")
    print(f"{'':28} {'step ms':>8} {'slowdown':>9} {'waited/snap ms':>15} {'copy':>6} {'exch':>6} {'wait':>6} "
          f"{'waited/steps':>13}")
    for r in cost:
        extra = ""
        if "per_snapshot_s" in r:
            parts = "".join(f" {r[k] * 1e3:6.1f}" if k in r else f" {'':>6}" for k in ("copy_s", "exchange_s", "wait_s"))
            extra = f" {r['per_snapshot_s'] * 1e3:15.1f}{parts} {r['waited_fraction'] * 100:12.2f}%"
        print(f"{r['kind']:28} {r['step_s'] * 1e3:8.1f} {r['slowdown'] * 100:8.1f}%{extra}")
    print(f"\nRecovery: the same model, batch 8 x 64, {args.recovery_steps} steps under loom-run --heartbeat-s "
          f"{args.heartbeat_s:g}, one fault after step {args.kill_at}")
    print(f"{'':32} {'signal':>8} {'detect s':>9} {'restart s':>10} {'resumed at':>11} {'redone':>7} {'lost s':>7}")
    for r in rec:
        print(f"{r['kind']:32} {r['signal']:>8} {r['detect_s']:9.2f} {r['restart_s']:10.2f} {r['resumed_at']:11d} "
              f"{r['redone_steps']:7d} {r['lost_s']:7.2f}")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump({"cost": cost, "recovery": rec}, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
