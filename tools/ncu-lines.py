#!/usr/bin/env python3
"""Per-source-line totals of an Nsight Compute SourceCounters export.

The kernels carry -lineinfo, so `ncu -i REPORT --page source --csv
--print-source cuda,sass` (tools/gpu-profile.sh writes it as ncu-N-src.csv)
gives one row per source line of every file the kernel inlines. This sums
the executed warp instructions and the warp-stall samples of each line and
prints the heaviest lines with their top stall reasons:

    tools/ncu-lines.py ncu-1-src.csv [--top 40] [--by stalls]

Instruction counts add up to the kernel's total; a line of a helper that is
inlined in several places is one row. Standard library only.
"""
import argparse
import collections
import csv
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by", choices=("instructions", "stalls"), default="instructions")
    a = ap.parse_args()
    instr = collections.Counter()
    samples = collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    text = {}
    cur = None
    col = {}
    with open(a.csv, newline="") as f:
        for r in csv.reader(f):
            if len(r) == 2 and r[0] == "File Path":
                cur = r[1].rsplit("/", 1)[-1]
                continue
            if r and r[0] == "Line No":
                col = {h: i for i, h in enumerate(r)}
                continue
            if not (cur and col and r and r[0].isdigit()):
                continue

            def num(h):
                i = col.get(h)
                try:
                    return int(r[i].replace(",", "")) if i is not None and r[i] not in ("", "-") else 0
                except ValueError:
                    return 0

            k = (cur, int(r[0]))
            text[k] = r[1].strip()
            instr[k] += num("Instructions Executed")
            samples[k] += num("Warp Stall Sampling (All Samples)")
            for h in col:
                if h.startswith("stall_") and "(Not" not in h:
                    v = num(h)
                    if v:
                        reasons[k][h[6:]] += v
    ti, ts = sum(instr.values()), sum(samples.values())
    if not ti and not ts:
        sys.exit("no SourceCounters rows in %s" % a.csv)
    print("warp instructions %.1fM, stall samples %d" % (ti / 1e6, ts))
    key = instr if a.by == "instructions" else samples
    for k, _ in key.most_common(a.top):
        why = ", ".join("%s %d" % kv for kv in reasons[k].most_common(3))
        print("%8.2fM %5.1f%% %6d %5.1f%%  %s:%d  %s  [%s]" % (instr[k] / 1e6, 100.0 * instr[k] / max(ti, 1), samples[k],
                                                          100.0 * samples[k] / max(ts, 1), k[0], k[1], text[k][:80], why))


if __name__ == "__main__":
    main()
