#!/usr/bin/env python3
"""ncu_summary.py: sum the kernel durations of an Nsight Compute CSV by kernel.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        PROGRAM ARGS... > ncu.csv
    python3 scripts/ncu_summary.py ncu.csv [--steps N] [--top K]

Prints one row per kernel name (template arguments kept, shortened): launches,
total and mean microseconds, and the share of all kernel time, largest first;
with --steps N the totals are also divided by N (the run's training steps).
Reads ncu's "details" CSV (a Metric Name / Metric Unit / Metric Value row per
kernel) or its "raw" one (a column per metric); other lines (==PROF== ...) are
skipped.
"""
import argparse
import csv
import io
import sys

UNIT_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
           "second": 1e9, "s": 1e9}


def rows_of(text):
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if not lines:
        return []
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def duration_ns(row):
    if row.get("Metric Name") == "gpu__time_duration.sum":
        unit = row.get("Metric Unit", "nsecond").strip()
        value = row["Metric Value"].replace(",", "")
        return float(value) * UNIT_NS.get(unit, 1.0)
    if "gpu__time_duration.sum" in row:
        value = row["gpu__time_duration.sum"].replace(",", "")
        try:
            return float(value)  # --print-units base: ns; the raw page's unit row is skipped
        except ValueError:
            return None
    return None


def short(name, width=96):
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.csv, errors="replace") as f:
        rows = rows_of(f.read())
    sums = {}
    for r in rows:
        ns = duration_ns(r)
        if ns is None:
            continue
        name = r.get("Kernel Name", "?")
        n, t = sums.get(name, (0, 0.0))
        sums[name] = (n + 1, t + ns)
    if not sums:
        print("ncu_summary: no kernel durations in %s" % a.csv)
        return 1
    total = sum(t for _, t in sums.values())
    launches = sum(n for n, _ in sums.values())
    per = " per step" if a.steps else ""
    print("kernels: %d launches, %.3f ms in all%s" % (launches, total / 1e6,
          ", %.3f ms per step over %d steps" % (total / 1e6 / a.steps, a.steps) if a.steps else ""))
    print("| kernel | launches | total us | mean us | share |%s" % (" us%s |" % per if a.steps else ""))
    print("|---|---|---|---|---|%s" % ("---|" if a.steps else ""))
    for name, (n, t) in sorted(sums.items(), key=lambda kv: -kv[1][1])[: a.top]:
        extra = " %.1f |" % (t / 1e3 / a.steps) if a.steps else ""
        print("| `%s` | %d | %.1f | %.2f | %.1f%% |%s" % (short(name), n, t / 1e3, t / 1e3 / n,
                                                      100.0 * t / total, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
