"""Where a process spent its slow steps: the functions of ``perf`` samples taken inside given
time windows, against the other samples of the same span.

    perf record -k CLOCK_MONOTONIC -e cpu-clock -F 2000 -p PID -o sweep.data   # while it runs
    perf script -i sweep.data -F time,ip,sym > samples.txt
    .venv/bin/python benchmarks/perf_windows.py WINDOWS samples.txt

WINDOWS is what ``master_core.py --slow-steps`` writes: a first line ``sweep START END
STEPS`` (the span of the sweep in CLOCK_MONOTONIC seconds and how many steps it took), then
one ``start end`` line for each step over 10 ms. Samples outside the span are left out. Each
function's share of the samples is printed inside the windows and outside them, and its
samples per step: a step that did the same work as the others but took longer shows, function
by function, where the time went.
"""

from __future__ import annotations

import argparse
import bisect
from collections import Counter


def read_windows(path: str) -> tuple[tuple[float, float, int], list[tuple[float, float]]]:
    """The span line's (start, end, steps) and the windows, sorted."""
    with open(path) as lines:
        rows = [line.split() for line in lines if line.strip()]
    if not rows or rows[0][0] != "sweep" or len(rows[0]) != 4:
        raise SystemExit(f"{path}: the first line must be 'sweep START END STEPS'")
    span = (float(rows[0][1]), float(rows[0][2]), int(rows[0][3]))
    return span, sorted((float(start), float(end)) for start, end in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("windows", help="master_core.py --slow-steps output")
    parser.add_argument("samples", help="`perf script -F time,ip,sym` output")
    parser.add_argument("--top", type=int, default=12, help="functions to print")
    args = parser.parse_args()
    (span_start, span_end, num_steps), windows = read_windows(args.windows)
    if not windows:
        raise SystemExit("no step over 10 ms")
    starts = [start for start, _ in windows]
    inside: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    with open(args.samples) as lines:
        for line in lines:
            fields = line.split(None, 2)   # time, address, function (by function only)
            if len(fields) < 3:
                continue
            at_s = float(fields[0].rstrip(":"))
            if not span_start <= at_s <= span_end:
                continue
            i = bisect.bisect_right(starts, at_s) - 1
            (inside if i >= 0 and at_s <= windows[i][1] else outside)[fields[2].strip()] += 1
    window_s = sum(end - start for start, end in windows)
    total_in, total_out = sum(inside.values()), sum(outside.values())
    steps_in, steps_out = len(windows), num_steps - len(windows)
    print(f"{steps_in} steps over 10 ms: {window_s:.3f} s, {total_in} samples; "
          f"the other {steps_out} steps and the time between: "
          f"{span_end - span_start - window_s:.1f} s, {total_out} samples")
    print(f"{'function':36} {'share in':>9} {'share out':>9} {'per step in / out':>20} "
          f"{'factor':>7}")
    for symbol, count in inside.most_common(args.top):
        per_in, per_out = count / steps_in, outside[symbol] / max(steps_out, 1)
        factor = f"{per_in / per_out:.0f}x" if per_out else "-"
        print(f"{symbol[:36]:36} {count / total_in:9.1%} {outside[symbol] / max(total_out, 1):9.1%}"
              f" {per_in:9.2f} / {per_out:8.3f} {factor:>7}")


if __name__ == "__main__":
    main()
