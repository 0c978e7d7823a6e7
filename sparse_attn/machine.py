"""Facts about the machine and the build, for `sparse-attn info` and the
benchmarks' headers: the CPU, its caches (from sysfs), the ISAs, threads,
versions and how the C core was built."""
import glob
import os
import platform
import shlex
import sys

from . import cores
from ._ffi import ffi, lib
from .isa import available_isas, built_isas, default_threads, isa


def cpu_model():
    """The CPU's model name (or part number on Arm), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu part", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_id():
    """Vendor, family, model and stepping from /proc/cpuinfo (x86), or the
    implementer, variant and part (Arm); '' where it does not say.  A
    virtual machine's model name is often generic ("Intel(R) Xeon(R)
    Processor"): these numbers still tell the core generation."""
    keys = ("vendor_id", "cpu family", "model", "stepping",
            "cpu implementer", "cpu variant", "cpu part")
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break                   # the first CPU's entry is enough
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in keys and key not in found:
                    found[key] = value.strip()
    except OSError:
        return ""
    return " ".join(f"{k} {found[k]}" if k != "vendor_id" else found[k]
                    for k in keys if k in found)


def _size(text):
    text = text.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * mult


def cpu_caches():
    """The caches cpu0 sees, per sysfs: [{level, type, bytes, shared_by}],
    lowest level first; [] where sysfs does not tell."""
    caches = []
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(os.path.join(d, "level")) as f:
                level = int(f.read())
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(d, "size")) as f:
                size = _size(f.read())
            shared = ""
            if os.path.exists(os.path.join(d, "shared_cpu_list")):
                with open(os.path.join(d, "shared_cpu_list")) as f:
                    shared = f.read().strip()
        except (OSError, ValueError):
            continue
        caches.append(dict(level=level, type=kind, bytes=size, shared_by=shared))
    return sorted(caches, key=lambda c: (c["level"], c["type"]))


def llc_bytes():
    """The last-level cache's size in bytes, or None when sysfs does not say."""
    data = [c for c in cpu_caches() if c["type"] in ("Unified", "Data")]
    return max(data, key=lambda c: c["level"])["bytes"] if data else None


def fmt_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def build_info():
    return ffi.string(lib.sa_build_info()).decode()


def versions():
    import numpy
    import cffi
    from . import __version__
    out = dict(sparse_attn=__version__, python=platform.python_version(),
               numpy=numpy.__version__, cffi=cffi.__version__)
    for name in ("torch", "transformers"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                import importlib.metadata as md
                out[name] = md.version(name)
            except Exception:       # noqa: BLE001 - not installed
                out[name] = None
        else:
            out[name] = getattr(mod, "__version__", None)
    return out


# The environment variables a benchmark's figures depend on: the kernels and
# threads of sparse_attn, and the instruction sets torch's own kernels, oneDNN
# and MKL may use (set to AVX2 to measure a whole model as an AVX2 CPU runs it).
COMMAND_ENV = ("SPARSE_ATTN_ISA", "SPARSE_ATTN_NUM_THREADS", "ATEN_CPU_CAPABILITY",
               "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def command_line(command, argv):
    """The shell line that reruns a benchmark: `command` (e.g. "sparse-attn
    bench") and its arguments, after the environment variables that choose
    the kernels and threads when they are set; kept in every --json file so
    a table rendered from it names what produced it."""
    env = [f"{name}={os.environ[name]}" for name in COMMAND_ENV if os.environ.get(name)]
    return shlex.join(env + command.split() + [str(a) for a in argv])


def where_it_runs(threads):
    """'2 threads on CPUs 0-1', with the core classes on a big.LITTLE CPU:
    the line each benchmark logs before it starts."""
    line = f"{threads} thread(s) on CPUs {cores.cpu_list(cores.allowed_cpus())}"
    if cores.heterogeneous():
        line += f" ({'; '.join(cores.describe())})"
    return line


def info():
    """Everything `sparse-attn info` prints, as a dict."""
    from . import __file__ as package_file
    classes = cores.core_classes()
    threads = default_threads()    # keeps the workers on the fast cores first
    return dict(
        package=os.path.dirname(package_file), versions=versions(), isa=isa(),
        isa_env=os.environ.get("SPARSE_ATTN_ISA"), built_isas=built_isas(),
        available_isas=available_isas(), threads=threads,
        threads_env=os.environ.get("SPARSE_ATTN_NUM_THREADS"),
        usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        cpus=cores.cpu_list(cores.allowed_cpus()),
        core_classes=cores.describe(classes), heterogeneous=cores.heterogeneous(classes),
        default_cores=list(cores.default_cores()),
        # whether the pool's workers are kept on some CPUs, which, and why
        # (or why not): {"pinned", "cpus", "workers", "reason"}
        pinning=cores.worker_placement(),
        machine=platform.machine(), cpu=cpu_model(), cpu_id=cpu_id(), caches=cpu_caches(),
        build=build_info(),
        platform=platform.platform())
