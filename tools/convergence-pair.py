#!/usr/bin/env python3
"""Two convergence studies seed by seed: for each recipe in both, the mean
and standard error of (its gap in B - its gap in A) over the seeds both ran.
A change to a recipe moves every seed's trajectory, and the seeds' spread
(about +-3% at the defaults) hides a shift of a point in the plain means;
the paired difference removes what the seeds share.

    tools/convergence-pair.py A/gaps.txt B/gaps.txt

A and B are the gaps.txt that tools/convergence.sh writes (FM_CONV_OUT,
default out/convergence): lines "seed recipe final-loss gap% bf16-forward-gap%".
Both studies must have run bf16 with the same seeds and build, so that the
gaps are to the same bf16 runs."""
import math
import statistics
import sys


def load(path):
    gaps = {}
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) >= 4 and p[3] != "-":
                gaps[(p[0], p[1])] = float(p[3])
    return gaps


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: tools/convergence-pair.py A/gaps.txt B/gaps.txt")
    a, b = load(sys.argv[1]), load(sys.argv[2])
    recipes = sorted({r for _, r in a} & {r for _, r in b})
    if not recipes:
        sys.exit("convergence-pair: no recipe with gaps in both studies")
    print("| recipe | seeds | gap in A | gap in B | B - A, seed by seed, +- SE |")
    print("|---|---:|---:|---:|---:|")
    for r in recipes:
        seeds = sorted({s for s, q in a if q == r} & {s for s, q in b if q == r}, key=int)
        da = [a[(s, r)] for s in seeds]
        db = [b[(s, r)] for s in seeds]
        d = [y - x for x, y in zip(da, db)]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        print(f"| {r} | {len(seeds)} | {statistics.mean(da):+.2f}% | {statistics.mean(db):+.2f}% | "
              f"{statistics.mean(d):+.2f} +- {se:.2f} |")


if __name__ == "__main__":
    main()
