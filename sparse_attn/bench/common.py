"""What every benchmark of the package shares: timing, the memory floor it
compares kernels with, and the cycling of KV buffers that keeps the KV out
of the last-level cache."""
import math
import sys
import time

import numpy as np

import sparse_attn as sa
from sparse_attn._ffi import ffi, lib
from sparse_attn.machine import fmt_bytes, llc_bytes

# When sysfs does not give the last-level cache: larger than any LLC seen
# on this project's machines (260 MB), so the floor and the cycling stay
# conservative.
LLC_FALLBACK = 512 << 20
# Bytes of distinct KV touched between two visits of one layer's buffers,
# as a multiple of the last-level cache.
COLD_FACTOR = 2.5


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def print_grouped(head, rows, line):
    """Print a table: its header, a rule, then line(r) for each row, with a
    blank line wherever the context length changes."""
    print(head)
    print("-" * len(head))
    last = None
    for r in rows:
        if last is not None and r["length"] != last:
            print()
        last = r["length"]
        print(line(r))


def needle_cell(found):
    """YES / NO, or the fraction of heads that found it."""
    return "YES" if found == 1 else ("NO" if found == 0 else f"{found:.0%}")


def config_cell(config, full):
    """``full`` ("dense" / "exact") as it is, a block budget as ``k=N``."""
    return config if config == full else f"k={config}"


def ratio_cell(x):
    """``1.23x``, or ``-`` when there is no ratio."""
    return "-" if x is None else f"{x:.2f}x"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (logged) when
    matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("--plot: matplotlib is not installed; skipping the plot")
        return None
    return plt


def timed(fn, repeats, warmup=1):
    """Run fn `repeats` times after `warmup` untimed runs; seconds as
    (median, min, max)."""
    for _ in range(max(1, warmup)):
        fn()
    return _runs(fn, repeats)


def _runs(fn, repeats):
    """(median, min, max) seconds of `repeats` timed calls of fn."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(min(times)), float(max(times))


def last_level_cache():
    """(bytes, how it was found) of the last-level cache."""
    llc = llc_bytes()
    if llc:
        return llc, f"{fmt_bytes(llc)} (sysfs)"
    return LLC_FALLBACK, f"unknown (sysfs silent), assumed {fmt_bytes(LLC_FALLBACK)}"


class Floor:
    """The memory floor: the best of several streaming reads of a buffer of
    4x the last-level cache (at least 256 MiB), with the widest loads of the
    ISA in use, split over the threads the kernels use.  The buffer is kept:
    `sample()` reads it again beside each row of a table (`timed_beside`),
    because on a shared machine the bandwidth moves between rows (seen: 16.6
    and 27.6 GB/s minutes apart on a Xeon VM, 65 and 35 GB/s on a Zen 4 VM),
    and a row's `x floor` should compare its time with the memory it had."""

    def __init__(self, threads, passes=7):
        llc, llc_text = last_level_cache()
        n_bytes = max(4 * llc, 256 << 20)
        self._buf = np.ones(n_bytes // 8, np.uint64)  # written: every page is real
        self._out = ffi.new("uint64_t *")
        self._ptr = ffi.from_buffer("uint64_t[]", self._buf)
        self.n_bytes, self.threads, self.isa = n_bytes, threads, sa.isa()
        self.llc, self.llc_text = llc, llc_text
        self._read()                                  # warm-up
        times = [self._read() for _ in range(passes)]
        self.bandwidth = n_bytes / min(times)
        self.median = n_bytes / float(np.median(times))
        self.passes = passes

    def _read(self):
        t0 = time.perf_counter()
        lib.sa_stream_read(self._ptr, self.n_bytes, self.threads, self._out)
        return time.perf_counter() - t0

    def sample(self, passes=2):
        """Bytes per second of the best of `passes` reads now."""
        return self.n_bytes / min(self._read() for _ in range(passes))

    def describe(self):
        return (f"streaming read {self.bandwidth / 1e9:.1f} GB/s: best of {self.passes} passes "
                f"over {fmt_bytes(self.n_bytes)} (4x the LLC of {self.llc_text}, at least 256 "
                f"MiB), {self.isa} loads, {self.threads} thread(s); median pass "
                f"{self.median / 1e9:.1f} GB/s")

    def as_dict(self):
        return dict(bandwidth_gbs=self.bandwidth / 1e9, median_gbs=self.median / 1e9,
                    buffer_bytes=self.n_bytes, threads=self.threads, passes=self.passes,
                    isa=self.isa, llc_bytes=self.llc, llc=self.llc_text)


def timed_beside(fn, repeats, warmup, floor):
    """timed(fn, repeats, warmup), with the floor read just before and just
    after the timed runs: (median, min, max, bytes per second), the last the
    best of those reads, this row's own floor."""
    for _ in range(max(1, warmup)):
        fn()
    before = floor.sample()
    med, lo, hi = _runs(fn, repeats)
    return med, lo, hi, max(before, floor.sample())


def distinct_buffers(read_bytes, layer_bytes, llc, memory_cap):
    """How many distinct layers' buffers to cycle so that between two visits
    of one, at least COLD_FACTOR x the LLC of other KV is read, when a
    visit reads read_bytes of a layer that holds layer_bytes: a sparse step
    reads part of each layer, and reads the same blocks again at its next
    visit, so it needs more layers than a dense one.  Capped by memory.
    Returns (count, note or None)."""
    want = max(1, math.ceil(COLD_FACTOR * llc / max(1, read_bytes)) + 1)
    count = want
    note = None
    if count * layer_bytes > memory_cap:
        count = max(1, int(memory_cap // layer_bytes))
        note = (f"cycled {count} distinct layers ({fmt_bytes(count * layer_bytes)}), not "
                f"the {want} that {COLD_FACTOR}x the LLC needs: memory is short, so part of "
                "the KV may be read from cache")
    return count, note


def available_memory():
    """Bytes the benchmark may fill: half of MemAvailable (or 4 GiB)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 4 << 30
