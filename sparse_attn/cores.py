"""The cores this process may run on, and which of them are fast.

Boards like the RK3588 pair fast cores with slow ones (four Cortex-A76,
four Cortex-A55).  A decode step split over all of them waits for the work
that lands on the slow ones, and the fast ones alone take about as long as
memory does (modelled), so by default the core uses the fast ones: the default
thread count is the number of fast cores this process may use, and the
worker threads are kept on them (a worker that polls and sleeps looks like
light work, which an energy-aware scheduler would move to a slow core).
``threads=`` or ``SPARSE_ATTN_NUM_THREADS`` still choose the count; workers
beyond the fast cores run wherever the system puts them.

A core's speed is read from Linux's sysfs: ``cpu_capacity`` (the
scheduler's relative capacity, 1 to 1024, 1024 for the fastest) and
cpufreq's ``cpuinfo_max_freq`` (kHz, taken up to 100 GHz).  A file that is
missing, empty, not an integer or out of that range is no reading.  The
first reading that tells the cores apart decides, one every core has
before one some cores lack, capacity before clock: capacity on every core,
then clock on every core, then capacity on some, then clock on some (a
reading all cores share tells nothing: 1024 everywhere is also what Arm
kernels report when the device tree gives no capacities).  Cores within
15% of the fastest reading count as fast, so the few "favoured" cores some
x86 chips boost a little higher do not split a homogeneous CPU; a core the
deciding reading lacks counts as fast, and where no reading tells the
cores apart all are fast.  So the fastest core read is always fast, and a
process with CPUs has at least one fast core.  Arm cores are named from
their MIDR part numbers in /proc/cpuinfo.

The workers are kept on the fast cores with ``sa_set_worker_cpus`` (once,
at the first call that uses threads; :func:`worker_placement` says what it
did): workers 1 .. n - 1 on the n fast CPUs, with the calling thread the
first n threads of a call.  The pool has at most 64 threads, the most
CPUs ``sa_set_worker_cpus`` takes, so beyond 64 fast CPUs it takes the
first 64.
"""
import functools
import os
import sys

SYSFS = "/sys/devices/system/cpu"
CPUINFO = "/proc/cpuinfo"
FAST_WITHIN = 0.85  # a core at least this fraction of the fastest is fast
# The readings taken, with the range a reading must be in: cpu_capacity is
# scaled to SCHED_CAPACITY_SCALE (1024) for the fastest core; no CPU clocks
# near 100 GHz.  Anything else (negative, zero, huge) is no reading.
READINGS = (("capacity", "cpu_capacity", 1024),
            ("max_khz", "cpufreq/cpuinfo_max_freq", 100_000_000))
MAX_PINNED = 64  # the most CPUs sa_set_worker_cpus takes: the pool's threads (threads.c)

# (implementer, part) of the Arm cores boards and laptops carry.
ARM_PARTS = {
    (0x41, 0xd03): "Cortex-A53", (0x41, 0xd04): "Cortex-A35", (0x41, 0xd05): "Cortex-A55",
    (0x41, 0xd07): "Cortex-A57", (0x41, 0xd08): "Cortex-A72", (0x41, 0xd09): "Cortex-A73",
    (0x41, 0xd0a): "Cortex-A75", (0x41, 0xd0b): "Cortex-A76", (0x41, 0xd0c): "Neoverse-N1",
    (0x41, 0xd0d): "Cortex-A77", (0x41, 0xd41): "Cortex-A78", (0x41, 0xd44): "Cortex-X1",
    (0x41, 0xd46): "Cortex-A510", (0x41, 0xd47): "Cortex-A710", (0x41, 0xd48): "Cortex-X2",
    (0x41, 0xd4d): "Cortex-A715", (0x41, 0xd4e): "Cortex-X3", (0x41, 0xd80): "Cortex-A520",
    (0x41, 0xd81): "Cortex-A720", (0x41, 0xd82): "Cortex-X4",
}


def _read_int(path, top):
    """The integer in `path` if it is in [1, top], else None (no file, an
    empty one, text, a number out of range; UnicodeDecodeError is a
    ValueError)."""
    try:
        with open(path) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return value if 1 <= value <= top else None


def _arm_parts(cpuinfo):
    """{cpu: core name} from /proc/cpuinfo's per-processor MIDR fields."""
    names, cpu, impl = {}, None, None
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return names
    for line in text.splitlines():
        key, _, value = (s.strip() for s in line.partition(":"))
        key = key.lower()
        try:
            if key == "processor":
                cpu, impl = int(value), None
            elif key == "cpu implementer":
                impl = int(value, 16)
            elif key == "cpu part" and cpu is not None and impl is not None:
                part = int(value, 16)
                names[cpu] = ARM_PARTS.get((impl, part), f"part {impl:#x}/{part:#x}")
        except ValueError:
            continue
    return names


def _allowed():
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def core_classes(cpus=None, sysfs=SYSFS, cpuinfo=CPUINFO):
    """The cores in `cpus` (default: those this process may run on) grouped
    by what sysfs says of them, fastest class first:
    [{"cpus": [...], "capacity": int or None, "max_khz": int or None,
    "name": str or None, "fast": bool, "by": "capacity", "max_khz" or None}],
    "by" naming the reading that decided (the module's docstring has the
    rule).  One class, fast, on a CPU whose cores sysfs does not tell apart;
    never no fast class when `cpus` has one."""
    cpus = _allowed() if cpus is None else sorted(cpus)
    names = _arm_parts(cpuinfo)
    seen = {}
    for c in cpus:
        key = tuple(_read_int(f"{sysfs}/cpu{c}/{file}", top) for _, file, top in READINGS)
        seen.setdefault(key + (names.get(c),), []).append(c)
    classes = [{"cpus": v, "capacity": k[0], "max_khz": k[1], "name": k[2]}
               for k, v in seen.items()]
    by = _deciding_reading(classes)
    best = max((c[by] for c in classes if c[by]), default=0) if by else 0
    for c in classes:
        c["by"] = by
        c["fast"] = not by or c[by] is None or c[by] >= FAST_WITHIN * best
    classes.sort(key=lambda c: (not c["fast"], -((by and c[by]) or 0), c["cpus"][0]))
    return classes


def _deciding_reading(classes):
    """The first reading that tells the classes apart (two values or more):
    one every class has before one some lack, capacity before clock; None
    if none does."""
    fields = [f for f, _, _ in READINGS]
    for complete in (True, False):
        for f in fields:
            values = [c[f] for c in classes]
            if complete and None in values:
                continue
            if len({v for v in values if v is not None}) > 1:
                return f
    return None


def fast_cpus(classes=None):
    """The CPUs of the fast classes, ascending."""
    classes = core_classes() if classes is None else classes
    return sorted(c for cls in classes if cls["fast"] for c in cls["cpus"])


def heterogeneous(classes=None):
    classes = core_classes() if classes is None else classes
    return any(not c["fast"] for c in classes)


def describe(classes=None):
    """One line per class, e.g. '4-7: Cortex-A76, capacity 1024, 2400 MHz (fast)'."""
    classes = core_classes() if classes is None else classes
    out = []
    for c in classes:
        bits = [b for b in (c["name"],
                            c["capacity"] and f"capacity {c['capacity']}",
                            c["max_khz"] and f"{c['max_khz'] // 1000} MHz") if b]
        tag = "fast" if c["fast"] else "slow"
        if c.get("by") and c[c["by"]] is None:
            tag += f", no {_LABELS[c['by']]} read"
        out.append(f"{cpu_list(c['cpus'])}: {', '.join(bits) or 'no sysfs speed'} ({tag})")
    return out


_LABELS = {"capacity": "capacity", "max_khz": "clock"}


def cpu_list(cpus):
    """[0, 1, 2, 5] -> '0-2,5'."""
    cpus = sorted(cpus)
    parts, start, prev = [], None, None
    for c in cpus + [None]:
        if start is None:
            start = prev = c
        elif c is not None and c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = c
    return ",".join(parts)


def allowed_cpus():
    """The CPUs this process may run on, ascending."""
    return _allowed()


@functools.lru_cache(maxsize=None)
def _classes():
    """core_classes(), read once for this process."""
    return core_classes()


@functools.lru_cache(maxsize=None)
def default_cores():
    """The CPUs the default thread count covers: the fast ones this process
    may use (all of them where the cores are alike).  Read once."""
    return tuple(fast_cpus(_classes()))


def place_workers(classes, set_worker_cpus, linux=sys.platform.startswith("linux")):
    """Keep the pool's workers on the fast cores of `classes` if some are
    slow, through `set_worker_cpus(cpus) -> status` (sa_set_worker_cpus;
    a test passes its own).  Returns what it did:
    {"pinned": bool, "cpus": [...], "workers": n, "reason": str}: workers
    1 .. n on `cpus` (n = 0 and no CPUs when not pinned), and why."""
    fast = fast_cpus(classes)
    pin = fast[:MAX_PINNED]

    def report(cpus, why):
        return {"pinned": bool(cpus), "cpus": list(cpus),
                "workers": max(0, len(cpus) - 1), "reason": why}

    if not heterogeneous(classes):
        return report([], "the cores are alike")
    if not linux:
        return report([], "threads cannot be placed on this system")
    if len(pin) < 2:
        return report([], "one fast core: a call's own thread, no worker")
    status = set_worker_cpus(pin)
    if status != 0:
        return report([], f"sa_set_worker_cpus refused CPUs {cpu_list(pin)} (status {status})")
    if len(fast) > MAX_PINNED:
        return report(pin, f"the first {MAX_PINNED} of the {len(fast)} fast cores: "
                           f"the pool has at most {MAX_PINNED} threads")
    return report(pin, "the fast cores")


@functools.lru_cache(maxsize=None)
def worker_placement():
    """Keep the workers on the fast cores (place_workers), once for this
    process, and say what was done; every call that uses threads comes
    here first."""
    from ._ffi import ffi, lib

    def set_worker_cpus(cpus):
        return lib.sa_set_worker_cpus(ffi.new("int[]", cpus), len(cpus))
    return place_workers(_classes(), set_worker_cpus)


def describe_placement(placement):
    """'workers 1-3 on CPUs 4-7 (the fast cores)', or 'none (why)'."""
    if not placement["pinned"]:
        return f"none ({placement['reason']})"
    n = placement["workers"]
    who = "worker 1" if n == 1 else f"workers 1-{n}"
    return f"{who} on CPUs {cpu_list(placement['cpus'])} ({placement['reason']})"
