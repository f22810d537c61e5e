#!/usr/bin/env python3
"""ncu_summary.py: sum the kernel durations of an Nsight Compute CSV by kernel.

    ncu --clock-control none --csv --print-units base \
        --metrics gpu__time_duration.sum[,dram__bytes_read.sum,dram__bytes_write.sum,
                  sm__throughput.avg.pct_of_peak_sustained_elapsed] PROGRAM ARGS... > ncu.csv
    python3 scripts/ncu_summary.py ncu.csv [--steps N] [--top K]
    python3 scripts/ncu_summary.py --self-test

Prints one row per kernel name (template arguments kept, shortened): launches,
total and mean microseconds, and the share of all kernel time, largest first;
with --steps N the totals are also divided by N (the run's training steps).
Where the CSV has the DRAM byte counts it adds the kernel's DRAM bandwidth
(bytes read + written over its time, GB/s), and where it has the SM
throughput its time-weighted mean (% of peak): a kernel far below both
bounds is waiting on latency, one near the SM bound is compute-bound.
Reads ncu's "details" CSV (a Metric Name / Metric Unit / Metric Value row per
kernel and metric, grouped by the launch's ID) or its "raw" one (a column per
metric); other lines (==PROF== ...) are skipped.
"""
import argparse
import csv
import io
import sys

TIME = "gpu__time_duration.sum"
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
SCALE = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
         "second": 1e9, "s": 1e9, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9,
         "%": 1.0, "": 1.0}


def rows_of(text):
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if not lines:
        return []
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def number(text, unit=""):
    try:
        return float((text or "").replace(",", "")) * SCALE.get((unit or "").strip(), 1.0)
    except ValueError:
        return None  # the raw page's unit row, an n/a, or a short row


def launches_of(rows):
    """[(kernel name, {metric: value in base units})], one per launch."""
    if rows and "Metric Name" in rows[0]:
        by_id = {}
        for i, r in enumerate(rows):
            # a launch's rows share its ID; without the column each row is its own
            key = (r.get("ID", i) if "ID" in r else i, r.get("Kernel Name", "?"))
            v = number(r.get("Metric Value", ""), r.get("Metric Unit", ""))
            if v is not None:
                by_id.setdefault(key, {})[r["Metric Name"]] = v
        return [(name, m) for (_, name), m in by_id.items()]
    out = []
    for r in rows:  # raw: --print-units base, so the values are ns, bytes and %
        m = {k: number(r[k]) for k in (TIME,) + DRAM + (SM,) if k in r}
        out.append((r.get("Kernel Name", "?"), {k: v for k, v in m.items() if v is not None}))
    return out


def short(name, width=96):
    return name if len(name) <= width else name[: width - 3] + "..."


def summary(launches, steps=0, top=40):
    """The table's lines."""
    sums = {}  # name: [launches, ns, dram bytes, ns with dram, sm % x ns, ns with sm %]
    has_dram = has_sm = False
    for name, m in launches:
        ns = m.get(TIME)
        if ns is None:
            continue
        s = sums.setdefault(name, [0, 0.0, 0.0, 0.0, 0.0, 0.0])
        s[0] += 1
        s[1] += ns
        if all(k in m for k in DRAM):
            s[2] += m[DRAM[0]] + m[DRAM[1]]
            s[3] += ns
            has_dram = True
        if SM in m:
            s[4] += m[SM] * ns
            s[5] += ns
            has_sm = True
    if not sums:
        return []
    total = sum(s[1] for s in sums.values())
    n_all = sum(s[0] for s in sums.values())
    per = ", %.3f ms per step over %d steps" % (total / 1e6 / steps, steps) if steps else ""
    lines = ["kernels: %d launches, %.3f ms in all%s" % (n_all, total / 1e6, per)]
    head = "| kernel | launches | total us | mean us | share |"
    rule = "|---|---|---|---|---|"
    if steps:
        head, rule = head + " us per step |", rule + "---|"
    if has_dram:
        head, rule = head + " DRAM GB/s |", rule + "---|"
    if has_sm:
        head, rule = head + " SM % |", rule + "---|"
    lines += [head, rule]
    for name, (n, t, b, bns, smt, smns) in sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]:
        row = "| `%s` | %d | %.1f | %.2f | %.1f%% |" % (short(name), n, t / 1e3, t / 1e3 / n,
                                                      100.0 * t / total)
        if steps:
            row += " %.1f |" % (t / 1e3 / steps)
        if has_dram:
            row += " %.0f |" % (b / bns) if bns else " |"  # bytes per ns = GB/s
        if has_sm:
            row += " %.0f |" % (smt / smns) if smns else " |"
        lines.append(row)
    return lines


SAMPLE_DETAILS = '''==PROF== Connected to process 1
"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","1","copy","gpu__time_duration.sum","nsecond","1,000"
"0","1","copy","dram__bytes_read.sum","byte","2000000"
"0","1","copy","dram__bytes_write.sum","byte","2000000"
"0","1","copy","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","10"
"1","1","gemm","gpu__time_duration.sum","usecond","3"
"1","1","gemm","dram__bytes_read.sum","Mbyte","1.5"
"1","1","gemm","dram__bytes_write.sum","byte","0"
"1","1","gemm","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","90"
"2","1","copy","gpu__time_duration.sum","nsecond","1000"
"2","1","copy","dram__bytes_read.sum","byte","2000000"
"2","1","copy","dram__bytes_write.sum","byte","2000000"
"2","1","copy","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","30"
'''
SAMPLE_RAW = '''"ID","Kernel Name","gpu__time_duration.sum"
"","","nsecond"
"0","a","500"
"1","b","1500"
"2","a","500"
'''


def self_test():
    lines = summary(launches_of(rows_of(SAMPLE_DETAILS)), steps=2)
    assert lines[0] == "kernels: 3 launches, 0.005 ms in all, 0.003 ms per step over 2 steps", lines
    assert lines[1].endswith("| us per step | DRAM GB/s | SM % |"), lines[1]
    assert lines[3] == "| `gemm` | 1 | 3.0 | 3.00 | 60.0% | 1.5 | 500 | 90 |", lines[3]
    assert lines[4] == "| `copy` | 2 | 2.0 | 1.00 | 40.0% | 1.0 | 4000 | 20 |", lines[4]
    lines = summary(launches_of(rows_of(SAMPLE_RAW)))
    assert lines[0] == "kernels: 3 launches, 0.003 ms in all", lines
    assert lines[1] == "| kernel | launches | total us | mean us | share |", lines[1]
    assert lines[3] == "| `b` | 1 | 1.5 | 1.50 | 60.0% |", lines[3]
    assert summary(launches_of(rows_of("==PROF== nothing\n"))) == []
    no_id = '"Kernel Name","Metric Name","Metric Unit","Metric Value"\n' \
            '"k","gpu__time_duration.sum","nsecond","100"\n"k","gpu__time_duration.sum","nsecond","300"\n'
    assert summary(launches_of(rows_of(no_id)))[3] == "| `k` | 2 | 0.4 | 0.20 | 100.0% |"
    short_raw = '"ID","Kernel Name","gpu__time_duration.sum"\n"0","a"\n"1","a","200"\n'
    assert summary(launches_of(rows_of(short_raw)))[0] == "kernels: 1 launches, 0.000 ms in all"
    print("ncu_summary self-test: ok")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.csv:
        ap.error("the CSV is required")
    with open(a.csv, errors="replace") as f:
        lines = summary(launches_of(rows_of(f.read())), a.steps, a.top)
    if not lines:
        print("ncu_summary: no kernel durations in %s" % a.csv)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
