"""The benchmark entry points run and report what the README says they do."""
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=True, **kw)


def test_quick_bench_reports_the_needle_and_the_collapse(tmp_path):
    out = tmp_path / "bench.json"
    res = run([sys.executable, "-m", "sparse_attn.bench", "--quick", "--no-baselines",
               "--policies", "seed;fast", "--json", str(out)])
    assert "k=1: the importance reserve" in res.stdout
    d = json.loads(out.read_text())
    assert {"command", "machine", "args", "rows"} <= set(d)
    # the command that reruns it, which the docs' tables print above themselves
    assert d["command"].endswith("sparse-attn bench --quick --no-baselines --policies "
                                 f"'seed;fast' --json {out}")
    assert d["machine"]["floor"]["bandwidth_gbs"] > 0 and d["machine"]["isa"]
    floor = d["machine"]["floor"]
    assert floor["buffer_bytes"] >= 4 * floor["llc_bytes"] and floor["passes"] >= 5
    assert "streaming read" in res.stdout and "4x the LLC" in res.stdout
    assert "read again beside each row" in res.stdout
    rows = {(r["dtype"], r["config"], r["policy"]): r for r in d["rows"]}
    for dtype in ("q8", "float32"):
        dense, k32, k1 = (rows[(dtype, "dense", None)], rows[(dtype, "32", "seed")],
                          rows[(dtype, "1", "seed")])
        assert dense["rel_err"] == 0.0 and dense["recall"] == 1.0
        assert k32["recall"] == 1.0 and k32["rel_err"] < 1e-2      # the article's k=32
        assert k1["recall"] == 0.0 and k1["rel_err"] > 0.5         # the article's k=1
        assert rows[(dtype, "32", "fast")]["recall"] == 1.0
        for r in (dense, k32, k1):
            assert r["ms"] > 0 and r["bytes"] > 0 and r["floor_ms"] > 0
            # each row against the floor read beside it
            assert r["floor_ms"] == pytest.approx(r["bytes"] / (r["floor_gbs"] * 1e9) * 1e3)
            assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
        assert k32["bytes"] < dense["bytes"] and k1["bytes"] < k32["bytes"]
        # Every row reads 2.5x the LLC between two visits of one layer (or
        # says memory was short): a sparse row, reading less of each layer,
        # cycles more layers than dense instead of finding its blocks cached.
        llc, layers = floor["llc_bytes"], d["args"]["layers"]
        for r in (dense, k32, k1, rows[(dtype, "32", "fast")]):
            between = (r["distinct_layers"] - 1) * r["bytes"] / layers
            assert between >= 2.5 * llc or "memory is short" in res.stdout, r
        assert dense["distinct_layers"] < k32["distinct_layers"] < k1["distinct_layers"]
    # the prefill column: exact and sparse k=32 at both dtypes, the needle
    # still found after a sparse prefill of the prompt
    assert "Prefill of the whole context" in res.stdout
    pre = {(r["dtype"], r["config"], r["policy"]): r for r in d["prefill"]}
    for dtype in ("q8", "float32"):
        exact, sparse = pre[(dtype, "exact", None)], pre[(dtype, "32", "seed")]
        assert exact["s"] > 0 and sparse["s"] > 0 and exact["speedup_vs_exact"] == 1.0
        assert sparse["needle"] == 1.0 and pre[(dtype, "32", "fast")]["needle"] == 1.0
    # the docs' table shows each row's floor, and the machine line their range
    spec = importlib.util.spec_from_file_location("render", ROOT / "scripts" / "render-results.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    table = render.render_decode(d)
    assert "| floor GB/s | x floor |" in table
    assert f"| {d['rows'][0]['floor_gbs']:.1f} | {d['rows'][0]['x_floor']:.2f} |" in table
    assert "read beside each row" in render.render_machine(d)


def test_prefill_rounds_alternate_the_rows_and_report_medians(tmp_path):
    out = tmp_path / "bench.json"
    res = run([sys.executable, "-m", "sparse_attn.bench", "--quick", "--no-baselines",
               "--configs", "dense", "--prefill-rounds", "3", "--json", str(out)])
    assert "3 round(s), the rows alternated" in res.stdout and "[min-max]" in res.stdout
    pre = {(r["dtype"], r["config"], r["policy"]): r for r in json.loads(out.read_text())["prefill"]}
    assert len(pre) == 4
    for r in pre.values():
        t = r["s_rounds"]
        assert len(t) == 3 and r["s"] == sorted(t)[1]
        assert (r["s_min"], r["s_max"]) == (min(t), max(t))
    for config, policy in (("exact", None), ("32", "seed")):
        q8, f32 = pre[("q8", config, policy)], pre[("float32", config, policy)]
        assert q8["vs_float32"] == pytest.approx(f32["s"] / q8["s"])
        lo, hi = q8["vs_float32_range"]
        per_round = [a / b for a, b in zip(f32["s_rounds"], q8["s_rounds"])]
        assert (lo, hi) == (min(per_round), max(per_round))
        assert f32["vs_float32"] is None and f32["vs_float32_range"] is None
    exact = pre[("q8", "exact", None)]
    assert exact["speedup_vs_exact"] == 1.0 and exact["speedup_vs_exact_range"] == [1.0, 1.0]
    bad = subprocess.run([sys.executable, "-m", "sparse_attn.bench", "--prefill-rounds", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--prefill-rounds" in bad.stderr


def test_baseline_rows_compare_with_sparse_attn_dense_float32_only(tmp_path):
    # Without a sparse_attn float32 dense row there is nothing to compare the
    # baselines with: torch's row must not be measured against numpy's.
    out = tmp_path / "bench.json"
    run([sys.executable, "-m", "sparse_attn.bench", "--quick", "--dtypes", "q8",
         "--configs", "dense", "--prefill-lengths", "none", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    base = [r for r in rows if r["impl"] != "sparse_attn"]
    assert base and all(r["speedup_vs_dense"] is None for r in base)


def test_kernels_mode_times_every_available_path(tmp_path):
    import sparse_attn as sa
    out = tmp_path / "kernels.json"
    run([sys.executable, "-m", "sparse_attn.bench", "kernels", "--quick", "--json", str(out)])
    d = json.loads(out.read_text())
    isas = {k["isa"] for k in d["kernels"]}
    assert isas == set(sa.available_isas()) | {"numpy"}   # numpy: the baseline row
    assert all(k["us"] > 0 for k in d["kernels"])


def _c_compiler():
    """$CC (default cc) if on PATH, else the compiler Python was built with, or None."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc):
        return cc
    built = sysconfig.get_config_var("CC")
    return built.split()[0] if built else None


needs_cc = pytest.mark.skipif(_c_compiler() is None, reason="no C compiler")


@needs_cc
def test_scattered_blocks_microbenchmark_builds_and_runs(tmp_path):
    cc = _c_compiler()
    exe = tmp_path / "scattered_blocks"
    run([cc, "-O2", "-pthread", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
         str(ROOT / "bench" / "scattered_blocks.c")])
    for args in ([], ["huge"], ["small"], ["huge", "2"]):
        res = run([str(exe), "160" if len(args) < 2 else "320", "1", *args])
        head = res.stdout.splitlines()[0]
        assert f"{(args or ['huge'])[0]} pages" in head
        assert f"{args[1] if len(args) > 1 else 1} thread(s)" in head
        lines = {l.split()[0]: l.split() for l in res.stdout.splitlines()[2:6]}
        assert set(lines) == {"none", "ahead-1", "ahead-2", "ahead-4"}
        for cols in lines.values():
            contig, rand, ratio = float(cols[1]), float(cols[2]), float(cols[3].rstrip("x"))
            assert contig > 0 and rand > 0 and ratio == pytest.approx(rand / contig, abs=0.01)
            threads = int(args[1]) if len(args) > 1 else 1
            assert float(cols[4]) == pytest.approx(threads * 4608 / rand * 1e-3, rel=0.01, abs=0.1)
    for bad in (["1", "1"],                    # a buffer too small to leave the caches
                ["160", "1", "huge", "2"],     # too small for two threads' fresh sets
                ["160", "1", "huge", "0"],     # no thread
                ["160", "1", "tiny"]):         # pages other than huge or small
        with pytest.raises(subprocess.CalledProcessError) as e:
            run([str(exe), *bad])
        assert e.value.returncode == 2 and "usage" in e.value.stderr


def _kernel_sources():
    """The core and the kernel files csrc/isa_list.h lists for this machine."""
    import platform
    import re
    arch = {"x86_64": "X86_64", "AMD64": "X86_64", "aarch64": "AARCH64",
            "arm64": "AARCH64"}.get(platform.machine(), "none")
    files = sorted(str(p) for p in (ROOT / "csrc").glob("*.c"))
    for m in re.finditer(r'^SA_ISA\(\w+, "[^"]+", (\w+), "([^"]+)"\)$',
                         (ROOT / "csrc" / "isa_list.h").read_text(), re.M):
        if m.group(1) in ("ANY", arch):
            files.append(str(ROOT / "csrc" / m.group(2)))
    return files


def _build_bench(tmp_path, name):
    """bench/<name>.c built with the core and this CPU's kernel files,
    warnings as errors; the executable's path."""
    exe = tmp_path / name
    run([_c_compiler(), "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
         "-pthread", "-I", str(ROOT / "csrc"), *_kernel_sources(),
         str(ROOT / "bench" / f"{name}.c"), "-o", str(exe), "-lm"])
    return exe


@needs_cc
def test_kernel_costs_microbenchmark_builds_and_runs(tmp_path):
    exe = _build_bench(tmp_path, "kernel_costs")
    res = run([str(exe), "portable", "3", "16"])
    lines = res.stdout.splitlines()
    assert "ISA portable" in lines[0] and "G=3" in lines[0]
    for line in lines[1:3]:                 # in cache, then streamed
        nums = [float(x) for x in line.split("scores")[1].replace("ns/token", "").split()
                if x[0].isdigit()]
        scores, softmax, v, total = nums
        assert min(nums) > 0 and total == pytest.approx(scores + softmax + v, abs=0.15)
    assert "streaming read" in lines[3] and "GB/s" in lines[3]
    for bad in (["no-such-isa"], ["portable", "0"], ["portable", "2", "1"],
                ["portable", "2", "99999999999"]):
        with pytest.raises(subprocess.CalledProcessError) as e:
            run([str(exe), *bad])
        assert e.value.returncode == 2


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")
def test_x86_pipes_microbenchmark_builds_and_runs(tmp_path):
    exe = tmp_path / "x86_pipes"
    run([_c_compiler(), "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I",
         str(ROOT / "bench"), str(ROOT / "bench" / "x86_pipes.c"), "-o", str(exe)])
    import sparse_attn as sa
    if "avx2" not in sa.available_isas():
        with pytest.raises(subprocess.CalledProcessError) as e:
            run([str(exe), "1"])
        assert e.value.returncode == 2 and "AVX2" in e.value.stderr
        return
    lines = run([str(exe), "1"]).stdout.splitlines()
    ghz = float(lines[0].split("clock")[1].split()[0])
    assert 0.3 < ghz < 10
    alone = {}
    for line in lines[lines.index("alone: instructions per cycle (12 independent copies)") + 1:]:
        if not line.strip():
            break
        name, ipc = line.rsplit(None, 1)
        alone[name.strip()] = float(ipc)
    assert {"vpmaddubsw", "vpmaddwd", "vfmadd231ps", "vcvtdq2ps", "vpmovsxbd"} <= set(alone)
    assert len(alone) == 14 and all(0.2 < v < 8 for v in alone.values())
    pairs = [l for l in lines if l.startswith("  ") and " + " in l]
    assert len(pairs) == 14 * 13 // 2
    for line in pairs:
        a, rest = line.split(" + ")
        b = rest.split()[0]
        nums = [float(x.rstrip("),")) for x in rest.replace("(", " ").split() if x[0].isdigit()]
        took, sep, shared = nums
        # the reference points follow from the two instructions' rates alone
        assert sep == pytest.approx(6 / min(alone[a.strip()], alone[b]), rel=0.02)
        assert shared == pytest.approx(6 / alone[a.strip()] + 6 / alone[b], rel=0.02)
        assert took > 0 and line.split()[-1] in ("shared", "separate")
        if abs((took - sep) - (shared - took)) > 0.03:   # not a tie in the printed digits
            assert line.split()[-1] == ("shared" if took - sep > shared - took else "separate")
    for bad in (["0"], ["x"], ["1001"], ["2", "3"]):
        with pytest.raises(subprocess.CalledProcessError) as e:
            run([str(exe), *bad])
        assert e.value.returncode == 2 and "usage" in e.value.stderr


@needs_cc
def test_prefill_ceiling_microbenchmark_builds_and_runs(tmp_path):
    import sparse_attn as sa
    exe = _build_bench(tmp_path, "prefill_ceiling")
    for isa in sa.available_isas():
        lines = run([str(exe), isa, "17", "64"]).stdout.splitlines()
        assert f"ISA {isa}" in lines[0] and "G=17" in lines[0] and "64 keys" in lines[0]
        peak = lines[1]
        if isa == "portable":
            assert "not measured" in peak
        else:       # the FMA and int8-dot peaks of the ISA's instructions
            nums = [float(x.rstrip(",")) for x in peak.split() if x[0].isdigit()]
            assert len(nums) == 2 and min(nums) > 0
        names = ["scores f32", "scores q8", "softmax", "V f32", "dequantise V"]
        for name, line in zip(names, lines[2:7]):
            assert line.split()[:len(name.split())] == name.split()
            assert float(line.split()[len(name.split())]) > 0
        assert "q8 prefill at most" in lines[7] and lines[7].split()[4].endswith("x")
    for bad in (["no-such-isa"], ["portable", "0"], ["portable", "2", "31"],
                ["portable", "2", "99999999"]):
        with pytest.raises(subprocess.CalledProcessError) as e:
            run([str(exe), *bad])
        assert e.value.returncode == 2


def test_model_bench_configurations_parse_policies_with_knobs():
    """`bench model --configs` words, policies with eval's knob syntax (the
    commas inside a policy's knobs are not word separators), and bad words
    refused with what is wrong."""
    import sparse_attn as sa
    from sparse_attn.bench.model import parse_config
    conf = parse_config("k=32 q8 policy=balanced:importance_fraction=0.25,sink_blocks=1 "
                        "prefill=sparse")
    assert (conf["k_blocks"], conf["kv_dtype"], conf["policy"], conf["prefill"]) == \
        (32, "q8", "balanced", "sparse")
    assert conf["knobs"] == dict(sa.POLICIES["balanced"], importance_fraction=0.25,
                                 sink_blocks=1)
    conf = parse_config("k=8,float32,policy=seed")
    assert (conf["k_blocks"], conf["kv_dtype"], conf["policy"], conf["knobs"]) == \
        (8, "float32", "seed", sa.POLICIES["seed"])
    # a name that is not a preset builds on the seed's, as in eval
    assert parse_config("k=32 policy=mine:share=group")["policy"] == "seed"
    assert parse_config("exact")["k_blocks"] is None
    for bad, match in [("k=32 policy=nope", "policy must be one of"),
                       ("k=32 policy=balanced:share=all", "share must be one of"),
                       ("k=32 policy=balanced:colour=red", "unknown knob 'colour'"),
                       ("k=0", "k must be >= 1"), ("sdpa q8", "sdpa takes no other words"),
                       ("k=32 exact_tail=2147483648", "exact_tail must be in"),
                       ("k=32 frobnicate", "unknown word")]:
        with pytest.raises(ValueError, match=match):
            parse_config(bad)


def test_decode_builds_ab_times_two_builds_and_refuses_a_folder_without_one():
    """bench/decode_builds_ab.py against the installed build itself: both
    builds' outputs agree, so every policy is timed and its ratio printed."""
    import sparse_attn
    installed = str(Path(sparse_attn.__file__).resolve().parent.parent)
    res = run([sys.executable, str(ROOT / "bench" / "decode_builds_ab.py"), installed,
               "--lengths", "300", "--layers", "1", "--rounds", "2", "--threads", "1",
               "--policies", "dense,seed,balanced"])
    lines = res.stdout.splitlines()
    assert [l.split()[:2] for l in lines] == [["300", "dense"], ["300", "seed"],
                                              ["300", "balanced"]]
    assert all("this/other per round: median" in l for l in lines)
    with pytest.raises(subprocess.CalledProcessError) as e:
        run([sys.executable, str(ROOT / "bench" / "decode_builds_ab.py"), str(ROOT / "docs")])
    assert "has no sparse_attn package folder" in e.value.stderr


def test_split_kv_bench_times_thread_counts_and_writes_its_table(tmp_path):
    """bench/split_kv.py: per shape, length and mode the time of each thread
    count (outputs checked bitwise equal inside), and a JSON the docs'
    `threads` tables render."""
    out = tmp_path / "threads.json"
    res = run([sys.executable, str(ROOT / "bench" / "split_kv.py"), "--shapes", "qwen2.5",
               "--lengths", "300,2100", "--rounds", "2", "--threads", "1,2", "--json", str(out)])
    assert len([l for l in res.stdout.splitlines() if l.startswith("qwen2.5")]) == 4
    d = json.loads(out.read_text())
    assert d["command"].startswith("python bench/split_kv.py --shapes qwen2.5")
    assert d["machine"]["cpus"] and not d["slow_core"]
    assert [(r["tokens"], r["mode"]) for r in d["rows"]] == \
        [(300, "dense"), (300, "k=32"), (2100, "dense"), (2100, "k=32")]
    for r in d["rows"]:
        assert set(r["us"]) == {"1", "2"} and len(r["speedup"]["2"]) == 2
    spec = importlib.util.spec_from_file_location("render", ROOT / "scripts" / "render-results.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    table = render.render_threads(d)
    assert table.count("| qwen2.5 (14/2, 64) |") == 4 and "2 vs 1 thread" in table


def test_plain_vs_cache_bench_compares_the_two_ways():
    res = run([sys.executable, str(ROOT / "bench" / "plain_vs_cache.py"), "--tokens", "300",
               "--layers", "2", "--rounds", "2", "--small-pages"])
    lines = res.stdout.splitlines()
    assert "small pages" in lines[0]
    assert lines[1].startswith("KVCache") and lines[2].startswith("plain Q8")
    assert "vs KVCache" in lines[2]


def test_arm_model_checks_against_the_hosts_own_core_model(monkeypatch):
    """bench/arm_model.py times its AVX2 check of the method on this host and
    compares it with llvm-mca's model of this host's core: an AMD Zen by
    family and model, else Intel's Golden Cove family."""
    spec = importlib.util.spec_from_file_location("arm_model", ROOT / "bench" / "arm_model.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    for cpu, new, old in ((("AuthenticAMD", 25, 0x01), "znver3", "znver3"),
                          (("AuthenticAMD", 25, 0x21), "znver3", "znver3"),
                          (("AuthenticAMD", 25, 0x11), "znver4", "znver4"),
                          (("AuthenticAMD", 25, 0x61), "znver4", "znver4"),
                          (("AuthenticAMD", 26, 0x02), "znver5", "znver4"),
                          (("AuthenticAMD", 23, 0x31), "znver2", "znver2")):
        monkeypatch.setattr(m, "host_cpu", lambda cpu=cpu: cpu)
        assert [x.key for x in m.host_models()] == [f"{new}@llvm-19", f"{old}@llvm-16"], cpu
    monkeypatch.setattr(m, "host_cpu", lambda: ("GenuineIntel", 6, 207))
    assert m.host_models()[0].key == "sapphirerapids@llvm-19"
    assert all(x.arch == "x86_64" for x in m.host_models())
    monkeypatch.undo()  # this machine's own /proc/cpuinfo: numbers, -1 where it is silent
    vendor, family, model = m.host_cpu()
    assert isinstance(vendor, str) and isinstance(family, int) and isinstance(model, int)

