"""Core classes (sparse_attn/cores.py): which cores are fast, the default
thread count, and the worker threads kept on the fast cores."""
import json
import os
import subprocess
import sys

import pytest

from sparse_attn import _core, cores

RK3588_CPUINFO = "".join(
    f"processor\t: {c}\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
    f"CPU variant\t: {'0x2' if c < 4 else '0x4'}\nCPU part\t: {'0xd05' if c < 4 else '0xd0b'}\n\n"
    for c in range(8))


def fake_sysfs(tmp_path, capacity=None, khz=None):
    """A sysfs cpu tree with the given per-CPU cpu_capacity / max freq: an
    int is written as sysfs does, a str or bytes as they stand, None leaves
    the file out."""
    root = tmp_path / "cpu"
    n = len(capacity or khz)
    for c in range(n):
        d = root / f"cpu{c}"
        (d / "cpufreq").mkdir(parents=True)
        for value, path in ((capacity, d / "cpu_capacity"),
                            (khz, d / "cpufreq" / "cpuinfo_max_freq")):
            if value and isinstance(value[c], bytes):
                path.write_bytes(value[c])
            elif value and value[c] is not None:
                path.write_text(value[c] if isinstance(value[c], str) else f"{value[c]}\n")
    info = tmp_path / "cpuinfo"
    info.write_text(RK3588_CPUINFO if n == 8 else "")
    return str(root), str(info)


RK3588_KHZ = [1800000] * 4 + [2352000] * 2 + [2304000] * 2


def test_rk3588_fast_cores_are_the_a76s(tmp_path):
    sysfs, info = fake_sysfs(tmp_path, capacity=[414] * 4 + [1024] * 4,
                             khz=[1800000] * 4 + [2352000] * 2 + [2304000] * 2)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.heterogeneous(classes)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]
    assert classes[0]["name"] == "Cortex-A76" and classes[-1]["name"] == "Cortex-A55"
    assert not classes[-1]["fast"] and classes[-1]["cpus"] == [0, 1, 2, 3]
    lines = cores.describe(classes)
    assert lines[0].startswith("4-5: Cortex-A76, capacity 1024, 2352 MHz (fast)")
    assert lines[-1] == "0-3: Cortex-A55, capacity 414, 1800 MHz (slow)"
    # A process allowed only some cores sees only those.
    sub = cores.core_classes([0, 1, 6], sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(sub) == [6]


def test_clock_decides_without_capacity(tmp_path):
    sysfs, info = fake_sysfs(tmp_path, khz=[1800000, 1800000, 2400000, 2400000])
    classes = cores.core_classes(range(4), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [2, 3] and cores.heterogeneous(classes)


@pytest.mark.parametrize("khz", [None, [3000000, 3100000, 3000000, 2900000]])
def test_alike_or_favoured_cores_are_one_class(tmp_path, khz):
    """No sysfs speed (a VM), or a few cores boosting a few percent higher:
    every core is fast."""
    sysfs, info = fake_sysfs(tmp_path, khz=khz or [0] * 4)
    if khz is None:
        for c in range(4):
            os.remove(f"{sysfs}/cpu{c}/cpufreq/cpuinfo_max_freq")
    classes = cores.core_classes(range(4), sysfs=sysfs, cpuinfo=info)
    assert not cores.heterogeneous(classes)
    assert cores.fast_cpus(classes) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [-1, 0, -1024, "", "garbage\n", "1024 MHz\n", "0x400\n",
                                 b"\xff\xfe\n", 1025, 10**30, "9" * 5000])
def test_capacities_that_are_no_reading_leave_the_clocks_to_decide(tmp_path, bad):
    """A negative, zero, empty, non-integer or out-of-range (over 1024)
    cpu_capacity is no reading: the A76s' clocks still tell them apart.  A
    capacity of -1 on every core had made no core fast, so the default
    thread count fell to 1."""
    sysfs, info = fake_sysfs(tmp_path, capacity=[bad] * 8, khz=RK3588_KHZ)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]
    assert all(c["capacity"] is None for c in classes)


@pytest.mark.parametrize("capacity", [[414] * 4 + [-1] * 4, [414] * 4 + [0] * 4,
                                      [10**20] * 4 + [1024] * 4, [414] * 4 + ["x"] * 4])
def test_a_bad_capacity_on_the_fast_cores_does_not_make_them_slow(tmp_path, capacity):
    """Bad readings on the A76s only (-1 had made them the slow ones, a huge
    value on the A55s had made those the fast ones): the clocks, which every
    core has, decide."""
    sysfs, info = fake_sysfs(tmp_path, capacity=capacity, khz=RK3588_KHZ)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]
    assert {c["by"] for c in classes} == {"max_khz"}


@pytest.mark.parametrize("khz", [None, [2000000] * 8])
def test_capacity_on_some_cores_decides_where_the_clocks_cannot(tmp_path, khz):
    """cpu_capacity on six cores (414 on the A55s, 1024 on two A76s, none on
    the other two), the clocks missing or alike: the capacities decide, and
    the two cores without one are fast, not slow for lack of a reading.
    Falling back to the clocks had made every core fast."""
    sysfs, info = fake_sysfs(tmp_path, capacity=[414] * 4 + [1024, 1024, None, None], khz=khz)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]
    assert [c["cpus"] for c in classes] == [[4, 5], [6, 7], [0, 1, 2, 3]]
    lines = cores.describe(classes)
    assert lines[1] == f"6-7: Cortex-A76{', 2000 MHz' if khz else ''} (fast, no capacity read)"
    assert lines[2].endswith("(slow)")


def test_a_reading_every_core_has_comes_first(tmp_path):
    """Capacity on some cores only and clocks on all that differ: the clocks
    decide (here they disagree with the partial capacities, which would
    have made 0-3 fast)."""
    sysfs, info = fake_sysfs(tmp_path, capacity=[1024] * 4 + [414, 414, None, None],
                             khz=RK3588_KHZ)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]


def test_clocks_on_some_cores_decide_and_the_unread_cores_are_fast(tmp_path):
    sysfs, info = fake_sysfs(tmp_path, khz=[1800000] * 4 + [2400000] * 2 + [None, ""])
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]
    assert classes[0]["cpus"] == [4, 5] and classes[-1]["cpus"] == [0, 1, 2, 3]


def test_a_capacity_every_core_shares_leaves_the_clocks_to_decide(tmp_path):
    """1024 on every core is what an Arm kernel reports when the device tree
    gives no capacities: it tells nothing, and the clocks decide.  (Had
    made every core fast.)"""
    sysfs, info = fake_sysfs(tmp_path, capacity=[1024] * 8, khz=RK3588_KHZ)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == [4, 5, 6, 7]


def test_whatever_sysfs_holds_some_core_is_fast(tmp_path):
    """Random trees of good, bad and missing readings: never no fast core,
    and the fastest core read (by the deciding reading) always fast."""
    import random
    rng = random.Random(63)
    values = [None, "", "junk", -5, 0, 1, 414, 1024, 1025, 10**12, 1800000, 2400000, 10**9]
    for t in range(150):
        n = rng.randint(1, 6)
        cap = [rng.choice(values) for _ in range(n)]
        khz = [rng.choice(values) for _ in range(n)]
        sysfs, info = fake_sysfs(tmp_path / str(t), capacity=cap, khz=khz)
        classes = cores.core_classes(range(n), sysfs=sysfs, cpuinfo=info)
        assert sorted(c for cls in classes for c in cls["cpus"]) == list(range(n))
        assert cores.fast_cpus(classes), (cap, khz)
        by = classes[0]["by"]
        if by:
            top = max(cls[by] for cls in classes if cls[by])
            assert all(cls["fast"] for cls in classes if cls[by] == top)
    assert cores.core_classes([], sysfs=sysfs, cpuinfo=info) == []


def placement(classes, status=0, linux=True):
    """cores.place_workers with a stand-in for sa_set_worker_cpus: the report
    and the CPU lists it was given."""
    calls = []

    def set_worker_cpus(cpus):
        calls.append(list(cpus))
        return status
    return cores.place_workers(classes, set_worker_cpus, linux=linux), calls


def test_workers_are_kept_on_the_fast_cores_and_the_report_says_so(tmp_path):
    sysfs, info = fake_sysfs(tmp_path, capacity=[414] * 4 + [1024] * 4, khz=RK3588_KHZ)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    report, calls = placement(classes)
    assert calls == [[4, 5, 6, 7]]
    assert report == {"pinned": True, "cpus": [4, 5, 6, 7], "workers": 3,
                      "reason": "the fast cores"}
    assert cores.describe_placement(report) == "workers 1-3 on CPUs 4-7 (the fast cores)"


def test_over_64_fast_cores_pin_the_first_64(tmp_path):
    """sa_set_worker_cpus takes 64 CPUs at most (the pool's threads): 96
    fast cores and 32 slow ones pin workers 1-63 on the first 64 fast ones,
    and say so; the whole list had been refused, unchecked."""
    sysfs, info = fake_sysfs(tmp_path, capacity=[512] * 32 + [1024] * 96)
    classes = cores.core_classes(range(128), sysfs=sysfs, cpuinfo=info)
    assert cores.fast_cpus(classes) == list(range(32, 128))
    report, calls = placement(classes)
    assert calls == [list(range(32, 96))]
    assert report["pinned"] and report["cpus"] == list(range(32, 96)) and report["workers"] == 63
    assert cores.describe_placement(report) == (
        "workers 1-63 on CPUs 32-95 (the first 64 of the 96 fast cores: "
        "the pool has at most 64 threads)")
    # The real function refuses the 96, as its argument check says.
    ffi, lib = _core.ffi, _core.lib
    assert lib.sa_set_worker_cpus(ffi.new("int[]", list(range(96))), 96) == lib.SA_ERR_PARAM


def test_a_refused_pinning_is_reported_not_pinned(tmp_path):
    sysfs, info = fake_sysfs(tmp_path, capacity=[414] * 4 + [1024] * 4)
    classes = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    report, calls = placement(classes, status=_core.lib.SA_ERR_PARAM)
    assert calls == [[4, 5, 6, 7]] and not report["pinned"] and report["cpus"] == []
    assert cores.describe_placement(report) == (
        f"none (sa_set_worker_cpus refused CPUs 4-7 (status {_core.lib.SA_ERR_PARAM}))")


def test_no_pinning_where_nothing_is_to_be_kept_or_it_cannot_be(tmp_path):
    sysfs, info = fake_sysfs(tmp_path, capacity=[1024] * 4, khz=[3000000] * 4)
    alike = cores.core_classes(range(4), sysfs=sysfs, cpuinfo=info)
    assert placement(alike) == ({"pinned": False, "cpus": [], "workers": 0,
                                 "reason": "the cores are alike"}, [])
    sysfs, info = fake_sysfs(tmp_path / "b", capacity=[414] * 4 + [1024] * 4)
    mixed = cores.core_classes(range(8), sysfs=sysfs, cpuinfo=info)
    report, calls = placement(mixed, linux=False)
    assert calls == [] and report["reason"] == "threads cannot be placed on this system"
    one = cores.core_classes([0, 1, 4], sysfs=sysfs, cpuinfo=info)
    report, calls = placement(one)
    assert calls == [] and not report["pinned"] and "one fast core" in report["reason"]


def test_info_says_whether_the_workers_are_pinned(capsys):
    from sparse_attn import cli, machine
    facts = machine.info()
    assert facts["pinning"] == cores.worker_placement()
    assert set(facts["pinning"]) == {"pinned", "cpus", "workers", "reason"}
    fast = facts["default_cores"]
    assert facts["pinning"]["pinned"] == (facts["heterogeneous"] and len(fast) > 1)
    assert cli.main(["info"]) == 0
    assert f"pinned:      {cores.describe_placement(facts['pinning'])}\n" in capsys.readouterr().out


@pytest.mark.parametrize("env", [None, "2"])
def test_every_call_keeps_the_workers_first_however_its_count_is_chosen(monkeypatch, env):
    """threads=, SPARSE_ATTN_NUM_THREADS and the default all place the
    workers first (the default had been the only one)."""
    import numpy as np
    import sparse_attn as sa
    calls = []
    monkeypatch.setattr(cores, "worker_placement", lambda: calls.append(1))
    if env:
        monkeypatch.setenv("SPARSE_ATTN_NUM_THREADS", env)
    else:
        monkeypatch.delenv("SPARSE_ATTN_NUM_THREADS", raising=False)
    k = np.ones((1, 64, 8), np.float32)
    sa.dense_decode(np.ones((1, 8), np.float32), k, k)
    sa.dense_decode(np.ones((1, 8), np.float32), k, k, threads=2)
    assert len(calls) == 2


PLACE_CHILD = r"""
import json, os, sys
import numpy as np
import sparse_attn as sa
from sparse_attn import cores
sysfs, info = sys.argv[1:]
a, b = sorted(os.sched_getaffinity(0))[:2]
slow = max(os.sched_getaffinity(0)) + 1     # a slow core the process is not given
classes = cores.core_classes([a, b, slow], sysfs=sysfs, cpuinfo=info)
cores._classes = lambda: classes
k = np.ones((1, 64, 8), np.float32)
sa.dense_decode(np.ones((1, 8), np.float32), k, k, threads=2)
report = cores.worker_placement()
# the C limit cores.MAX_PINNED stands for
ffi, lib = sa._ffi.ffi, sa._ffi.lib
n = cores.MAX_PINNED
limit = [lib.sa_set_worker_cpus(ffi.new("int[]", [a] * m), m) for m in (n, n + 1)]
print(json.dumps([a, b, report, limit]))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two usable CPUs")
def test_the_real_pinning_reports_what_sa_set_worker_cpus_did(tmp_path):
    """Through the real sa_set_worker_cpus (in a child, which keeps its own
    placement): two fast CPUs beside a slow one are pinned, status checked;
    and the C call takes cores.MAX_PINNED CPUs but not one more."""
    n = max(os.sched_getaffinity(0)) + 2
    cap = [1024] * n
    cap[-1] = 400
    sysfs, info = fake_sysfs(tmp_path, capacity=cap)
    run = subprocess.run([sys.executable, "-c", PLACE_CHILD, sysfs, info],
                         capture_output=True, text=True, check=True)
    a, b, report, limit = json.loads(run.stdout)
    assert report == {"pinned": True, "cpus": [a, b], "workers": 1, "reason": "the fast cores"}
    assert limit == [_core.lib.SA_OK, _core.lib.SA_ERR_PARAM]


def test_set_worker_cpus_checks_its_arguments():
    ffi, lib = _core.ffi, _core.lib
    assert lib.sa_set_worker_cpus(ffi.NULL, 0) == lib.SA_OK
    assert lib.sa_set_worker_cpus(ffi.NULL, 2) == lib.SA_ERR_PARAM
    assert lib.sa_set_worker_cpus(ffi.new("int[]", [0]), -1) == lib.SA_ERR_PARAM
    assert lib.sa_set_worker_cpus(ffi.new("int[]", [0]), 65) == lib.SA_ERR_PARAM
    assert lib.sa_set_worker_cpus(ffi.new("int[]", [-1]), 1) == lib.SA_ERR_PARAM
    assert lib.sa_set_worker_cpus(ffi.new("int[]", [1 << 20]), 1) == lib.SA_ERR_PARAM
    assert lib.sa_set_worker_cpus(ffi.NULL, 0) == lib.SA_OK


CHILD = r"""
import json, os, re, sys
import numpy as np
import sparse_attn as sa
from sparse_attn import _core


def tasks_cpus():
    # {thread id: its Cpus_allowed_list} of this process's threads
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            out[int(tid)] = re.search(r"^Cpus_allowed_list:\s*(\S+)", f.read(), re.M).group(1)
    return out


pin = json.loads(sys.argv[1])
ffi, lib = _core.ffi, _core.lib
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 9000, 32), dtype=np.float32)  # 5 chunks
q = rng.standard_normal((2, 32), dtype=np.float32)
want = sa.dense_decode(q, k, k, threads=1)
before = set(tasks_cpus())
assert lib.sa_set_worker_cpus(ffi.new("int[]", pin), len(pin)) == 0
out = sa.dense_decode(q, k, k, threads=4)
assert out.tobytes() == want.tobytes()
print(json.dumps({str(t): c for t, c in tasks_cpus().items() if t not in before}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two usable CPUs")
def test_pinned_workers_run_on_the_cpus_given():
    """With workers 1 .. n-1 placed on one CPU, a 4-thread call starts three
    workers: the first (n = 2) on that CPU, the rest anywhere; same bits."""
    cpu = min(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps([cpu, cpu])],
                         capture_output=True, text=True, check=True)
    workers = sorted((int(t), c) for t, c in json.loads(run.stdout).items())
    assert len(workers) == 3
    assert workers[0][1] == str(cpu)
    assert all(c != str(cpu) for _, c in workers[1:])
