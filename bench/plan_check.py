#!/usr/bin/env python3
"""The planner's step time against train_gpt's on this machine.

For each layout, train_gpt trains the model a few steps (ranks as threads) and the median time of its steps after
the first is the measured step; loom-plan predicts the step for the same flags on a cluster file (loom-plan
--calibrate FILE measures one). The first run (one rank) completes the calibration: the ratio of its measured step to
the prediction from the kernels' rates alone is the cluster's compute_overhead (what loom's model and trainer add
between kernels), written to a copy of the cluster file that the other runs are predicted on (--no-overhead: the file
as given, every run checked). Prints a table of both, each error, the median absolute error and Spearman's rank
correlation between predicted and measured times over the runs checked; --json writes the rows and the summary.

  bench/plan_check.py --train-gpt build/examples/train_gpt --loom-plan build/examples/loom-plan \\
      --cluster this-machine.json [--layout dp2 --layout "pp2 --schedule zb-h1" ...] [--steps 6] [--json FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# One calibration run and 24 runs of train_gpt's small model: each parallelism alone and in combination, every pipeline schedule, ZeRO 1-3,
# both context-parallel kinds, recomputation; one to eight ranks; batches of 8 or 16 sequences of 64 to 256 tokens
# (a run's step time is ranked among runs of other sizes too).
LAYOUTS = [
    "single",  # the calibration run
    "single --batch 16",
    "single --seq 64",
    "single --recompute full",
    "dp2",
    "dp4 --batch 16",
    "dp8",
    "dp2,zero1 --seq 256",
    "dp4,zero2",
    "dp4,zero3 --batch 16",
    "tp2",
    "tp4 --seq 64",
    "tp2,sp --seq 256",
    "tp2,dp2 --batch 16",
    "tp2,dp4",
    "pp2",
    "pp2 --schedule gpipe --seq 64",
    "pp2 --schedule zb-h1 --batch 16",
    "pp2,v2",
    "pp4 --seq 256",
    "pp2,dp2",
    "tp2,pp2 --recompute selective",
    "cp2 --seq 256",
    "cp2,ulysses",
    "tp2,pp2,dp2 --batch 16",
]
COMMON = ["--model", "small"]


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"plan_check: {' '.join(cmd)} exited with {p.returncode}:\n{p.stdout}")
    return p.stdout


def layout_args(spec):
    words = spec.split()
    args = ["--parallel", words[0]] + words[1:]
    for flag, default in (("--batch", "8"), ("--seq", "128")):
        if flag not in words:
            args += [flag, default]
    # A pipeline needs micro-batches to fill; 4 per step wherever the layout has one.
    if "pp" in words[0] and "--micro-batches" not in words:
        args += ["--micro-batches", "4"]
    return args


def measured_step(train_gpt, spec, steps, scratch):
    log = os.path.join(scratch, "log.json")
    run([train_gpt, *COMMON, *layout_args(spec), "--steps", str(steps), "--no-progress", "--log-json", log])
    words = layout_args(spec)
    tokens = int(words[words.index("--batch") + 1]) * int(words[words.index("--seq") + 1])
    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    times = [tokens / r["tokens_per_s"] for r in rows if r["step"] >= 1]
    return statistics.median(times)


def predicted_step(loom_plan, spec, cluster, scratch):
    out = os.path.join(scratch, "plan.json")
    run([loom_plan, *COMMON, *layout_args(spec), "--cluster", cluster, "--json", out])
    with open(out) as f:
        record = json.load(f)  # one layout: its record (a search writes a list)
    return (record[0] if isinstance(record, list) else record)["step_s"]


def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--loom-plan", required=True)
    ap.add_argument("--cluster", required=True, help="a cluster file (loom-plan --calibrate FILE) or name")
    ap.add_argument("--layout", action="append", dest="layouts",
                    help="a layout and its flags, train_gpt's spelling; repeated (default: a calibration run and 24 more)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-overhead", action="store_true", help="do not fit compute_overhead on the first run")
    ap.add_argument("--json")
    a = ap.parse_args()
    layouts = a.layouts or LAYOUTS
    if a.steps < 2:
        sys.exit("plan_check: --steps must be at least 2 (the first step is not timed)")
    rows = []
    print(f"{'layout':<32} {'measured s':>11} {'predicted s':>12} {'error':>8}")
    with tempfile.TemporaryDirectory() as scratch:
        cluster = a.cluster
        fit = not a.no_overhead and len(layouts) > 1
        for i, spec in enumerate(layouts):
            m = measured_step(a.train_gpt, spec, a.steps, scratch)
            if fit and i == 0:  # the calibration run: the overhead that makes it come out as measured
                with open(a.cluster) as f:
                    c = json.load(f)
                c["compute_overhead"] = 1.0
                cluster = os.path.join(scratch, "cluster.json")
                with open(cluster, "w") as f:
                    json.dump(c, f)
                bare = predicted_step(a.loom_plan, spec, cluster, scratch)
                c["compute_overhead"] = m / bare
                with open(cluster, "w") as f:
                    json.dump(c, f)
                print(f"{spec:<32} {m:11.4f} {bare:12.4f}   (calibration: compute_overhead {m / bare:.3f})",
                      flush=True)
                continue
            p = predicted_step(a.loom_plan, spec, cluster, scratch)
            rows.append({"layout": spec, "measured_s": m, "predicted_s": p, "error": p / m - 1})
            print(f"{spec:<32} {m:11.4f} {p:12.4f} {100 * (p / m - 1):+7.1f}%", flush=True)
    errors = [abs(r["error"]) for r in rows]
    rho = spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    summary = {"layouts": len(rows), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
               "spearman": rho}
    print(f"plan_check: {len(rows)} layouts, median error {100 * summary['median_abs_error']:.1f}%, "
          f"worst {100 * summary['worst_abs_error']:.1f}%, spearman {rho:.3f}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
