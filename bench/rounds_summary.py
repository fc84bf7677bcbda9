#!/usr/bin/env python3
"""The medians over rounds of a benchmark's RESULT lines (`impl=NAME ... median_ms=X`), and ratios of pairs.

    bench/rounds_summary.py OUT.txt [a/b ...]     # e.g. fitllm-tp/torch-tp
"""
import re
import statistics
import sys


def main():
    med = {}
    for line in open(sys.argv[1]):
        m = re.search(r"RESULT impl=(\S+).*?median_ms=([\d.]+)", line)
        if m:
            med.setdefault(m.group(1), []).append(float(m.group(2)))
    width = max([len(k) for k in med] + [16]) + 2
    print(f"\n{'impl':<{width}}median over rounds (ms/step)   rounds")
    for k, v in med.items():
        print(f"{k:<{width}}{statistics.median(v):>12.1f}   {v}")
    for pair in sys.argv[2:]:
        a, b = pair.split("/")
        if a in med and b in med:
            print(f"{a} / {b} = {statistics.median(med[a]) / statistics.median(med[b]):.3f}")


if __name__ == "__main__":
    main()
