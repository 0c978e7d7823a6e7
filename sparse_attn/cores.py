"""The cores this process may run on, and which of them are fast.

Boards like the RK3588 pair fast cores with slow ones (four Cortex-A76,
four Cortex-A55).  A decode step split over all of them waits for the work
that lands on the slow ones, and the fast ones alone already reach the
memory bus's limit, so by default the core uses the fast ones: the default
thread count is the number of fast cores this process may use, and the
worker threads are kept on them (a worker that polls and sleeps looks like
light work, which an energy-aware scheduler would move to a slow core).
``threads=`` or ``SPARSE_ATTN_NUM_THREADS`` still choose the count; workers
beyond the fast cores run wherever the system puts them.

A core's speed is read from Linux's sysfs: ``cpu_capacity`` (the
scheduler's relative capacity, 1024 for the fastest), else cpufreq's
``cpuinfo_max_freq``.  Cores within 15% of the fastest count as fast, so
the few "favoured" cores some x86 chips boost a little higher do not split
a homogeneous CPU.  Arm cores are named from their MIDR part numbers in
/proc/cpuinfo.
"""
import functools
import os

SYSFS = "/sys/devices/system/cpu"
CPUINFO = "/proc/cpuinfo"
FAST_WITHIN = 0.85  # a core at least this fraction of the fastest is fast

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


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


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
    "name": str or None, "fast": bool}].  One class, fast, on a CPU whose
    cores sysfs does not tell apart."""
    cpus = _allowed() if cpus is None else sorted(cpus)
    names = _arm_parts(cpuinfo)
    seen = {}
    for c in cpus:
        base = f"{sysfs}/cpu{c}"
        key = (_read_int(f"{base}/cpu_capacity"),
               _read_int(f"{base}/cpufreq/cpuinfo_max_freq"), names.get(c))
        seen.setdefault(key, []).append(c)
    classes = [{"cpus": v, "capacity": k[0], "max_khz": k[1], "name": k[2]}
               for k, v in seen.items()]
    # Speed by capacity where every class has one, else by clock.
    field = next((f for f in ("capacity", "max_khz")
                  if all(c[f] for c in classes)), None)
    best = max((c[field] for c in classes), default=0) if field else 0
    for c in classes:
        c["fast"] = not field or c[field] >= FAST_WITHIN * best
    classes.sort(key=lambda c: (-(c[field] or 0) if field else 0, c["cpus"][0]))
    return classes


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
        out.append(f"{cpu_list(c['cpus'])}: {', '.join(bits) or 'no sysfs speed'} ({tag})")
    return out


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
def default_cores():
    """The CPUs the default thread count covers: the fast ones this process
    may use (all of them where the cores are alike).  Read once."""
    return tuple(fast_cpus())
