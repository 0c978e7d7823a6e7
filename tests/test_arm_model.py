"""bench/arm_model.py --quick: the static cost model of the NEON kernels
builds, traces under qemu and runs llvm-mca, and what it
reports is sane.  Needs llvm-16 (llvm-mca-16, llvm-objdump-16, llvm-nm-16),
the aarch64 cross compiler and qemu-user; skipped without them."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = ["llvm-mca-16", "llvm-objdump-16", "llvm-nm-16", "aarch64-linux-gnu-gcc", "qemu-aarch64"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS),
                       reason="needs " + ", ".join(TOOLS) +
                              " (apt-get install llvm-16 gcc-aarch64-linux-gnu "
                              "libc6-dev-arm64-cross qemu-user)"),
    pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                       reason="needs a host C compiler (the qemu plugin)"),
]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm_model") / "arm-model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "arm_model.py"), "--quick",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def test_command_and_machine(quick):
    assert quick["command"].startswith("python bench/arm_model.py --quick --json ")
    m = quick["machine"]
    assert any("LLVM version 16" in v for v in m["llvm_mca"])
    assert set(m["models"]) == {"neoverse-n1@llvm-16", "cortex-a55@llvm-16"}
    flags = m["compile_flags"]
    assert set(flags) == {"x86_64", "aarch64"}
    for arch in flags:
        assert "-ffp-contract=off" in flags[arch] and "-O3" in flags[arch]
    # the package's aarch64 flags (csrc/build_ffi.py), not the host's
    assert "-frename-registers" in flags["aarch64"]
    assert "-frename-registers" not in flags["x86_64"]


def test_instruction_counts(quick):
    (c,) = quick["qemu_instruction_counts"]
    assert (c["isa"], c["G"], c["D"]) == ("neon-dotprod", 2, 128)
    assert c["kv_bytes"] == 2 * (128 + 4 * 128 // 32) * c["tokens"]
    i = c["instructions_per_kv_byte"]
    # every part ran, the kernels dominate, the parts add up to the whole
    assert all(i[k] > 0 for k in ("scores", "v", "softmax", "other"))
    assert 0.3 < i["total"] < 20
    assert abs(i["scores"] + i["v"] + i["softmax"] + i["other"] - i["total"]) < 0.01
    assert c["non_kernel_share"] < 0.2
    assert c["call_instructions"]["accumulate_v_q8_32_rows"] > 32
    assert c["hot_blocks"]["accumulate_v_q8"][0]["at"].startswith("accumulate_v_q8_neon_dotprod")


def test_cycles_sane_and_a55_slower(quick):
    by = {c["model"]: c for c in quick["llvm_mca"]}
    n1, a55 = by["neoverse-n1@llvm-16"], by["cortex-a55@llvm-16"]
    for c in (n1, a55):
        cyc, b = c["cycles_per_token_kv_head"], c["bytes_per_cycle"]
        assert all(cyc[k] > 0 for k in ("scores", "v", "softmax"))
        assert cyc["total"] == pytest.approx(cyc["scores"] + cyc["v"] + cyc["softmax"], abs=0.05)
        assert all(b[k] > 0 for k in ("scores", "v", "total"))
        assert b["total"] == pytest.approx(2 * 144 / cyc["total"], rel=1e-3)
        # llvm-mca's simulated cycles never beat its own resource bound
        assert cyc["total"] >= 0.99 * c["resource_bound_cycles_per_token_kv_head"]["total"]
        assert b["total"] < 16  # two 128-bit loads a cycle at most
    # the in-order little core is slower than the big out-of-order one
    assert a55["cycles_per_token_kv_head"]["total"] > n1["cycles_per_token_kv_head"]["total"]
    assert a55["bytes_per_cycle"]["total"] < n1["bytes_per_cycle"]["total"]


def test_step_prediction(quick):
    p = quick["predicted_step"]
    assert p["kv_bytes"] == 2061 * 28 * 8 * 2 * 144
    lo, hi = sorted(p["floor_ms"]["ms"])
    assert 9 < lo < hi < 14
    a76, a55 = p["a76_x4"], p["a55_x1"]
    assert a76["model"] == "neoverse-n1@llvm-16" and a76["cores"] == 4
    assert a76["model_ms"] > 0 and a55["model_ms"] > a76["model_ms"]
    assert quick["calibration_x86"] is None  # --quick skips the x86 calibration


def test_prefill_tile_and_prediction(quick):
    """Exact q8 prefill's kernels: one tile (32 rows x G heads) against 32
    keys through the table's q8 panels and float V, per (vector, key), and
    the article's prompt from them."""
    (c,) = quick["qemu_instruction_counts"]
    assert c["prefill_tile"] == {"vectors": 64, "keys": 32, "q8_panels": True}
    calls = c["call_instructions"]
    # 64 vectors x 32 keys x 128 channels: at least one 4-lane multiply-add
    # instruction per 4 scores' 16 products (sdot), per 4 V products (fmla)
    assert calls["prefill_scores_tile_32_keys"] > 64 * 32 * 128 / 64
    assert calls["prefill_v_tile_32_keys"] > 64 * 32 * 128 / 4
    for m in quick["llvm_mca"]:
        y = m["prefill_cycles_per_vector_key"]
        assert all(y[k] > 0 for k in ("scores", "softmax", "v"))
        assert y["total"] == pytest.approx(y["scores"] + y["softmax"] + y["v"], abs=1e-3)
        # the softmax element is the decode pass's, per score
        assert y["softmax"] == pytest.approx(
            m["cycles_per_token_kv_head"]["softmax"] / m["G"], rel=0.01)
        assert y["total"] >= 0.99 * m["prefill_resource_bound_cycles_per_vector_key"]["total"]
    pf = quick["predicted_step"]["prefill"]
    assert pf["vector_key_pairs"] == 16 * 28 * 2061 * 2062 // 2
    a76, a55 = pf["a76_x4"], pf["a55_x1"]
    assert a76["cores"] == 4 and 0 < a76["model_ms"] < a55["model_ms"]
    assert a76["model_ms"] == pytest.approx(
        a76["cycles_per_vector_key"]["total"] * pf["vector_key_pairs"] / (4 * 2.4e9) * 1e3,
        rel=1e-3)
