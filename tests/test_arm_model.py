"""bench/arm_model.py --quick: the static cost model of the NEON kernels
builds, traces under qemu and runs llvm-mca, and what it
reports is sane.  Needs llvm-16 (llvm-mca-16, llvm-objdump-16, llvm-nm-16),
the aarch64 cross compiler and qemu-user; skipped without them."""
import importlib.util
import json
import runpy
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
    want = {"neoverse-n1@llvm-16", "cortex-a55@llvm-16"} | (
        {"neoverse-n1@llvm-19"} if shutil.which("llvm-mca-19") else set())
    assert set(m["models"]) == want
    # the A76 stand-in is LLVM 19's real N1 model when it is installed
    assert m["a76_model"] == ("neoverse-n1@llvm-19" if shutil.which("llvm-mca-19")
                              else "neoverse-n1@llvm-16")
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
    kvb = 2061 * 28 * 8 * 2 * 144
    assert p["kv_bytes"] == kvb
    # the floor at each bandwidth: reviews' 17-20 GB/s and the earlier 10-14
    assert p["floor_ms"]["at_GBps"] == [10.0, 14.0, 17.0, 20.0]
    for bw, ms in zip(p["floor_ms"]["at_GBps"], p["floor_ms"]["ms"]):
        assert ms == pytest.approx(kvb / (bw * 1e9) * 1e3, abs=0.01)
    a76, a55 = p["a76_x4"], p["a55_x1"]
    assert a76["model"] == quick["machine"]["a76_model"] and a76["cores"] == 4
    assert a76["model_ms"] > 0 and a55["model_ms"] > a76["model_ms"]
    # the modelled cycles as they are: no factor from another core applied
    for c in (a76, a55):
        assert "calibrated_ms" not in c
        assert c["model_ms"] == pytest.approx(
            c["cycles_per_token_kv_head"] * 2061 * 28 * 8 / (c["cores"] * c["ghz"] * 1e9) * 1e3,
            rel=1e-3)
        for s, fl in zip(c["step_ms"], p["floor_ms"]["ms"]):
            assert s["ms"] == pytest.approx(max(c["model_ms"], fl), abs=0.01)
            assert s["bound"] == ("compute" if c["model_ms"] > fl else "memory")
    assert quick["calibration_x86"] is None  # --quick skips the x86 check


def test_guide_corrections(quick):
    """The forms LLVM misprices are fed to llvm-mca as stand-ins LLVM prices as
    Arm's guide does, checked on this LLVM; the corrected traces cost more
    than the raw ones where the guide charges more, and the A76 figure stays
    under the floor of the vector-pipe uops its V loop executes."""
    g = quick["guide_corrections"]
    a55 = g["cortex-a55@llvm-16"]["corrected"]
    forms = {c["form"]: c for c in a55}
    # Q-form FMLA: LLVM two a cycle, the guide one (Q-forms issue only as instruction 0)
    fmla = forms["fmla/fmls v.4s (vector or by element)"]
    assert fmla["llvm"]["cycles_per_instruction"] == 0.5
    assert fmla["guide"]["cycles_per_instruction"] == fmla["standin_priced"][
        "cycles_per_instruction"] == 1.0
    for c in a55:
        assert c["standin_priced"]["cycles_per_instruction"] == pytest.approx(
            c["guide"]["cycles_per_instruction"])
        assert c["standin"] != [c["example"]]
    assert g["cortex-a55@llvm-16"]["not_corrected"]
    by = {c["model"]: c for c in quick["llvm_mca"]}
    a = by["cortex-a55@llvm-16"]
    # V's loop: 64 FMLA by element per token and KV head at G = 2, D = 128
    assert a["guide_corrections"]["v"]["fmla/fmls v.4s (vector or by element)"] == 64 * 32
    assert a["cycles_per_token_kv_head"]["v"] > a["llvm_raw_cycles_per_token_kv_head"]["v"]
    assert by["neoverse-n1@llvm-16"]["guide_corrections"] is None  # A57 tables: raw
    if "neoverse-n1@llvm-19" not in by:
        return
    n1 = by["neoverse-n1@llvm-19"]
    (scvtf,) = g["neoverse-n1@llvm-19"]["corrected"]
    assert scvtf["example"].startswith("scvtf") and "#" in scvtf["example"]
    assert scvtf["standin"] == ["scvtf v7.4s, v7.4s"]
    assert (scvtf["llvm"]["latency"], scvtf["llvm"]["cycles_per_instruction"]) == (2, 0.5)
    assert scvtf["standin_priced"] == {"latency": 4, "cycles_per_instruction": 2.0}
    # V dequantises each of the 128 values of a token's V row: 32 scvtf #24
    assert n1["guide_corrections"]["v"] == {scvtf["form"]: 32 * 32}
    assert n1["cycles_per_token_kv_head"]["v"] > n1["llvm_raw_cycles_per_token_kv_head"]["v"] + 8
    # at most 2 vector uops a cycle: V's 64 FMLA + 32 TBL + 32 x 2 SCVTF + 32 FMUL
    # alone take 96 cycles a token, so no more than 2 x 144 / 96 bytes a cycle
    assert n1["cycles_per_token_kv_head"]["v"] >= 96
    assert n1["bytes_per_cycle"]["total"] < 2 * 144 / 96


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


def _arm_model():
    spec = importlib.util.spec_from_file_location("arm_model", REPO / "bench" / "arm_model.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_corrections_replace_only_their_forms():
    """N1: only the fixed-point converts become the register form; the
    register form and other arrangements pass through as compiled.  A55: a
    Q-form load becomes two load-pipe turns, a D-form load stays."""
    m = _arm_model()
    n1 = m.CORRECTIONS["neoverse-n1@llvm-19"]
    lines = ["scvtf v7.4s, v7.4s, #24", "scvtf v7.4s, v7.4s", "fcvtzs v1.4s, v2.4s, #0x8",
             "scvtf v7.2s, v7.2s, #24", "fmla v0.4s, v1.4s, v2.s[0]"]
    fixed, used = m.correct_trace(lines, n1)
    assert fixed == ["scvtf v7.4s, v7.4s", "scvtf v7.4s, v7.4s", "fcvtzs v1.4s, v2.4s",
                     "scvtf v7.2s, v7.2s, #24", "fmla v0.4s, v1.4s, v2.s[0]"]
    assert dict(used) == {n1[0].name: 2}
    a55 = m.CORRECTIONS["cortex-a55@llvm-16"]
    fixed, used = m.correct_trace(["ldr q13, [x0, #352]", "ldr d13, [x0, #352]",
                                   "fmla v19.4s, v31.4s, v3.s[0]"], a55)
    assert fixed == ["ldr q13, [x0, xzr]", "prfm pldl1keep, [x0]", "ldr d13, [x0, #352]",
                     "mla v19.4s, v31.4s, v3.4s"]
    assert sum(used.values()) == 2


def test_rendered_arm_text_is_the_model_raw(quick):
    """docs/results.md's Arm block from a model run: the board figures are
    called modelled and are the JSON's raw ones, the guide-priced forms are
    named, no calibrated figure is printed."""
    render = runpy.run_path(str(REPO / "scripts" / "render-results.py"))
    text = render["render_arm"](quick)
    a76, a55 = quick["predicted_step"]["a76_x4"], quick["predicted_step"]["a55_x1"]
    assert "calibrat" not in text
    assert f"modelled: four A76 cores at 2.4 GHz {a76['model_ms']:.1f} ms of compute" in text
    assert f"one A55 at 1.8 GHz {a55['model_ms']:.0f} ms" in text
    assert "13.3 ms at 10, 9.5 ms at 14, 7.8 ms at 17, 6.7 ms at 20 GB/s" in text
    assert "Priced as Arm's optimisation guides do" in text and "scvtf" in text
    assert "--quick" in text
