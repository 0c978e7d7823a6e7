"""The transformers backend (attn_implementation="sparse_topk") on a tiny,
randomly initialised Qwen3 model built from a config (no download): Qwen3's
head_dim 128 and GQA (4 query heads, 2 KV heads), float32 unless stated.

Skipped as a whole when torch or transformers is not installed
(``bash scripts/install-transformers-extras.sh`` installs them)."""
import copy
import doctest
import functools
import json
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sat = pytest.importorskip("sparse_attn.integrations.transformers")

import sparse_attn as sa  # noqa: E402
from sparse_attn._ffi import ffi  # noqa: E402
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

# Same float32 attention, summed in another order than torch's matmul, then
# two decoder layers and the LM head: a few ulps of the logits' size.
LOGITS_ATOL = 1e-4
# bfloat16 weights and activations: the sparse path attends in float32 while
# eager attends in bfloat16; the logits' bf16 rounding alone is ~4e-3.
BF16_LOGITS_ATOL = 5e-2
# q8 K and V (int8 + one float32 scale per 32 values): ~0.4% error per
# element; measured <= 1e-2 on these logits (whose scale is ~1).
Q8_LOGITS_ATOL = 3e-2
# Block sparse with k_blocks=2 of 10 blocks: the logits move by O(0.1-1).
DROPPED_BLOCKS_MIN_DIFF = 1e-2

PROMPT_TOKENS = 300          # 10 blocks of 32 (the last partial)
NEW_TOKENS = 12
ALL_BLOCKS = 16              # > ceil((300 + 12) / 32): every block chosen


@pytest.fixture(scope="module", autouse=True)
def modest_cpu():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**overrides):
    kwargs = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  max_position_embeddings=4096, attn_implementation="eager")
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


@pytest.fixture(scope="module")
def eager():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_config()).eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 512, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))


def sparse_copy(model, **settings):
    """An independent copy (weights and config) switched to sparse_topk."""
    settings.setdefault("threads", 1)
    return sat.enable(copy.deepcopy(model), **settings)


def greedy(model, ids, n=NEW_TOKENS, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def forced_logits(model, ids, continuation, cache):
    """Logits of the prompt's last token and of each teacher-forced
    continuation token, one decode step at a time."""
    with torch.no_grad():
        logits = [model(ids, cache=cache, use_cache=True).logits[:, -1]]
        for t in range(continuation.shape[1] - 1):
            step = model(continuation[:, t:t + 1], cache=cache, use_cache=True)
            logits.append(step.logits[:, -1])
    return torch.stack(logits)


@pytest.fixture(scope="module")
def eager_run(eager, prompt):
    return greedy(eager, prompt)


# --------------------------------------------------------------------------- agreement

def test_every_block_matches_eager_token_for_token(eager, prompt, eager_run):
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS)
    seq, logits = greedy(model, prompt)
    want_seq, want_logits = eager_run
    assert torch.equal(seq, want_seq)
    assert (logits - want_logits).abs().max().item() < LOGITS_ATOL


def test_dense_layers_are_exact(eager, prompt, eager_run):
    model = sparse_copy(eager, k_blocks=1, dense_layers=[0, 1])
    seq, logits = greedy(model, prompt)
    assert torch.equal(seq, eager_run[0])
    assert (logits - eager_run[1]).abs().max().item() < LOGITS_ATOL


def test_sparse_prefill_with_every_block_is_exact(eager, prompt, eager_run):
    """prefill="sparse" with k_blocks >= the prompt's blocks: every row is
    exact, so the first token's logits are eager's; both caches."""
    for kv_dtype in (None, "float32"):
        model = sparse_copy(eager, k_blocks=ALL_BLOCKS, prefill="sparse", kv_dtype=kv_dtype)
        seq, logits = greedy(model, prompt)
        assert torch.equal(seq, eager_run[0])
        assert (logits - eager_run[1]).abs().max().item() < LOGITS_ATOL


def test_sparse_prefill_attends_to_fewer_blocks(eager, prompt, eager_run):
    """prefill="sparse" with k_blocks=2 changes the prompt's logits (each
    block of rows reads its own block and one chosen block), the same way
    on transformers' cache and a SparseKVCache, and layers in dense_layers
    prefill exactly."""
    runs = [greedy(sparse_copy(eager, k_blocks=2, prefill="sparse", kv_dtype=kv), prompt)
            for kv in (None, "float32")]
    for seq, logits in runs:
        assert torch.isfinite(logits).all()
        assert (logits[0] - eager_run[1][0]).abs().max().item() > DROPPED_BLOCKS_MIN_DIFF
    assert (runs[0][1] - runs[1][1]).abs().max().item() < LOGITS_ATOL
    seq, logits = greedy(sparse_copy(eager, k_blocks=2, prefill="sparse", dense_layers=[0, 1]),
                         prompt)
    assert (logits - eager_run[1]).abs().max().item() < LOGITS_ATOL
    with pytest.raises(ValueError, match="prefill"):
        sparse_copy(eager, prefill="dense")


def test_sparse_prefill_exact_tail(eager, prompt, eager_run):
    """exact_tail: a tail covering the whole prompt makes prefill="sparse"
    exact at k_blocks=2 (the first token's logits are eager's; decode stays
    sparse); the default tail (64 rows) and none (the plain rule) give
    different logits, both sparse."""
    logits = greedy(sparse_copy(eager, k_blocks=2, prefill="sparse",
                                exact_tail=PROMPT_TOKENS), prompt)[1]
    assert (logits[0] - eager_run[1][0]).abs().max().item() < LOGITS_ATOL
    tail = greedy(sparse_copy(eager, k_blocks=2, prefill="sparse"), prompt)[1]
    plain = greedy(sparse_copy(eager, k_blocks=2, prefill="sparse", exact_tail=0), prompt)[1]
    assert (tail[0] - plain[0]).abs().max().item() > DROPPED_BLOCKS_MIN_DIFF
    assert (plain[0] - eager_run[1][0]).abs().max().item() > DROPPED_BLOCKS_MIN_DIFF


def test_small_k_runs_and_differs(eager, prompt, eager_run):
    model = sparse_copy(eager, k_blocks=2, record_blocks=True)
    seq, logits = greedy(model, prompt)
    assert torch.isfinite(logits).all()
    # The prefill logits (step 0) are exact; the decode steps attend to 2 blocks.
    assert (logits[0] - eager_run[1][0]).abs().max().item() < LOGITS_ATOL
    assert (logits[1:] - eager_run[1][1:]).abs().max().item() > DROPPED_BLOCKS_MIN_DIFF
    for layer in model.model.layers:
        blocks = layer.self_attn.sparse_attn_blocks
        assert blocks.shape == (4, 2)            # 4 query heads, k_blocks=2 of 10 blocks


def test_decode_is_exact_attention_over_the_chosen_blocks(eager):
    """Differs from full attention only by the blocks selection dropped."""
    model = sparse_copy(eager, k_blocks=3, record_blocks=True)
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    S, D = 200, 128
    k = torch.randn(1, 2, S, D, generator=g)
    v = torch.randn(1, 2, S, D, generator=g)
    q_prompt = torch.randn(1, 4, S - 1, D, generator=g)
    q = torch.randn(1, 4, 1, D, generator=g)
    with torch.no_grad():
        sat.sparse_topk_attention(module, q_prompt, k[:, :, :S - 1], v[:, :, :S - 1], None,
                                  scaling=module.scaling)
        out, weights = sat.sparse_topk_attention(module, q, k, v, None, scaling=module.scaling)
    assert weights is None and out.shape == (1, 1, 4, D)
    blocks = module.sparse_attn_blocks
    for h in range(4):
        kh = h // 2
        tokens = torch.cat([torch.arange(b * 32, min(b * 32 + 32, S)) for b in blocks[h]])
        scores = (k[0, kh, tokens] @ q[0, h, 0]).double() * module.scaling
        want = torch.softmax(scores, 0) @ v[0, kh, tokens].double()
        full_scores = (k[0, kh] @ q[0, h, 0]).double() * module.scaling
        full = torch.softmax(full_scores, 0) @ v[0, kh].double()
        got = out[0, 0, h].double()
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
        assert (got - full).abs().max() > 1e-3


# --------------------------------------------------------------------------- importance

@pytest.mark.parametrize("kv_dtype", [None, "float32", "q8"])
def test_sdpa_prefill_is_torchs_attention_and_decode_stays_sparse(eager, prompt, kv_dtype,
                                                                  monkeypatch):
    """prefill="sdpa": the prompt's attention is torch's causal SDPA on the
    prompt's own K/V (the first token's logits are eager's), nothing is
    recorded as importance, the cache still holds every token, and decode
    runs sparse_attn's kernels."""
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS, policy="balanced", prefill="sdpa",
                        kv_dtype=kv_dtype)
    calls = []
    real = sat.attention._sdpa_prefill
    monkeypatch.setattr(sat.attention, "_sdpa_prefill", lambda *a: calls.append(a[0].shape) or real(*a))
    cache = sat.SparseKVCache(model) if kv_dtype else DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(prompt, cache=cache, use_cache=True).logits[0, -1]
        want = eager(prompt).logits[0, -1]
        assert (first - want).abs().max().item() < LOGITS_ATOL
        assert calls == [(1, 4, PROMPT_TOKENS, 128)] * 2          # both layers, once
        token = first.argmax().view(1, 1)
        step = model(token, cache=cache, use_cache=True).logits[0, -1]
        assert len(calls) == 2                                      # decode is not SDPA
        tol = Q8_LOGITS_ATOL if kv_dtype == "q8" else LOGITS_ATOL
        assert (step - eager(torch.cat([prompt, token], 1)).logits[0, -1]).abs().max().item() \
            < tol
    if kv_dtype:
        kv = cache.layers[0].kv
        assert kv.seq_len == PROMPT_TOKENS + 1
        assert not kv.importance[:PROMPT_TOKENS].any()
    else:
        assert not record(model)[:PROMPT_TOKENS].any()


def test_sdpa_prefill_serves_only_a_prompt_that_fills_the_cache(eager, prompt, monkeypatch):
    """A later chunk of a prompt (tokens already cached) runs the exact
    prefill, which records the importance of what it ran: the second
    chunk's share of an exact chunked prefill's."""
    calls = []
    real = sat.attention._sdpa_prefill
    monkeypatch.setattr(sat.attention, "_sdpa_prefill", lambda *a: calls.append(a[0].shape) or real(*a))
    imps = {}
    for mode in ("exact", "sdpa"):
        model = sparse_copy(eager, k_blocks=ALL_BLOCKS, policy="balanced", prefill=mode,
                            kv_dtype="q8")
        cache = sat.SparseKVCache(model)
        with torch.no_grad():
            model(prompt[:, :200], cache=cache, use_cache=True)
            first = cache.layers[0].kv.importance.copy()
            chunked = model(prompt[:, 200:], cache=cache, use_cache=True).logits[0, -1]
        imps[mode] = (first, cache.layers[0].kv.importance.copy())
        assert (chunked - eager(prompt).logits[0, -1]).abs().max().item() < Q8_LOGITS_ATOL
    assert calls == [(1, 4, 200, 128)] * 2           # the first chunk only, both layers
    (e1, e2), (s1, s2) = imps["exact"], imps["sdpa"]
    assert e1.any() and not s1.any()
    np.testing.assert_allclose(s2, e2 - np.pad(e1, (0, len(e2) - len(e1))), rtol=1e-4,
                               atol=1e-5)


def test_other_prefills_hold_no_prompt_kv(eager, prompt):
    """Whatever the prefill mode, a SparseKVCache layer keeps no reference to
    the prompt's K/V tensors after its attention call."""
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS, kv_dtype="q8")
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
    assert all(layer._prompt is None for layer in cache.layers)


def test_sdpa_prefill_refuses_an_importance_reserve(eager):
    with pytest.raises(sa.SparseAttnError, match="importance_fraction"):
        sat.enable(copy.deepcopy(eager), prefill="sdpa", policy="seed")  # reserves half
    sat.enable(copy.deepcopy(eager), prefill="sdpa", policy="seed", importance_fraction=0)
    sat.enable(copy.deepcopy(eager), prefill="sdpa")                # balanced: no reserve


def record(model, layer=0):
    return model.model.layers[layer].self_attn._sparse_attn_view.kv.importance.copy()


def test_chunked_prefill_accumulates_importance(eager, prompt):
    model = sparse_copy(eager, k_blocks=2)
    with torch.no_grad():
        whole = model(prompt, cache=DynamicCache(config=model.config), use_cache=True).logits
        want = record(model)
        cache = DynamicCache(config=model.config)
        model(prompt[:, :200], cache=cache, use_cache=True)
        first = record(model)
        chunked = model(prompt[:, 200:], cache=cache, use_cache=True).logits
        got = record(model)
    assert first.shape == (200,) and got.shape == want.shape == (PROMPT_TOKENS,)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert (got[:200] > first).all()     # the second chunk's queries added to the first's keys
    assert (chunked[0, -1] - whole[0, -1]).abs().max().item() < LOGITS_ATOL


def test_generate_prefill_chunks_give_the_same_tokens(eager, prompt):
    model = sparse_copy(eager, k_blocks=2)
    seq, _ = greedy(model, prompt)
    whole = record(model)
    chunked_seq, _ = greedy(model, prompt, prefill_chunk_size=64)
    assert torch.equal(chunked_seq, seq)
    np.testing.assert_allclose(record(model), whole, rtol=1e-4, atol=1e-5)


def test_sparse_kv_cache_keeps_importance_per_cache(eager, prompt):
    model = sparse_copy(eager, k_blocks=2, kv_dtype="float32")
    alone = forced_logits(model, prompt, prompt[:, :6], sat.SparseKVCache(model))
    other = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(5))
    c1, c2 = sat.SparseKVCache(model), sat.SparseKVCache(model)
    with torch.no_grad():
        steps = [model(prompt, cache=c1, use_cache=True).logits[:, -1]]
        model(other, cache=c2, use_cache=True)                  # a second sequence in between
        for t in range(5):
            steps.append(model(prompt[:, t:t + 1], cache=c1, use_cache=True).logits[:, -1])
            model(other[:, t:t + 1], cache=c2, use_cache=True)
    assert torch.equal(torch.stack(steps), alone)
    assert c1.layers[0].kv.importance.shape == (PROMPT_TOKENS + 5,)


def test_sparse_kv_cache_probe_rows_follow_the_policy(eager, prompt):
    """A SparseKVCache keeps probe-row copies only for a policy whose probe
    reads some rows; decoding from them gives exactly the logits of the same
    model on transformers' own cache (whose K the probe reads directly)."""
    model = sparse_copy(eager, k_blocks=2, policy="seed")
    cont = prompt[:, :6]
    cache = sat.SparseKVCache(model, dtype="float32")
    got = forced_logits(model, prompt, cont, cache)
    assert cache.layers[0].kv.channels is None
    rows = cache.layers[0].kv.probe_rows
    assert rows is not None and rows.k_rows == PROMPT_TOKENS + cont.shape[1] - 1
    want = forced_logits(model, prompt, cont, DynamicCache(config=eager.config))
    assert torch.equal(got, want)
    for policy in ("recall", "fast", "balanced"):
        other = sparse_copy(eager, k_blocks=2, policy=policy)
        c = sat.SparseKVCache(other, dtype="float32")
        forced_logits(other, prompt, cont[:, :2], c)
        assert c.layers[0].kv.probe_rows is None, policy


# --------------------------------------------------------------------------- settings

def test_settings_are_per_model_and_visible(eager, prompt):
    a = sparse_copy(eager, k_blocks=2)
    b = sparse_copy(eager, k_blocks=ALL_BLOCKS, n_probe=4)
    assert a.sparse_attn.k_blocks == 2 and b.sparse_attn.k_blocks == ALL_BLOCKS
    assert b.config.sparse_attn["n_probe"] == 4 and a.config.sparse_attn["n_probe"] == 8
    assert sat.get_settings(a) is a.sparse_attn
    seq_a, seq_b = greedy(a, prompt)[0], greedy(b, prompt)[0]
    cont_a, cont_b = seq_a[:, PROMPT_TOKENS:], seq_b[:, PROMPT_TOKENS:]
    want_a = forced_logits(a, prompt, cont_a, DynamicCache(config=a.config))
    want_b = forced_logits(b, prompt, cont_b, DynamicCache(config=b.config))
    assert (want_a - want_b).abs().max().item() > DROPPED_BLOCKS_MIN_DIFF
    ca, cb = DynamicCache(config=a.config), DynamicCache(config=b.config)
    with torch.no_grad():                       # the two models interleaved step by step
        got_a = [a(prompt, cache=ca, use_cache=True).logits[:, -1]]
        got_b = [b(prompt, cache=cb, use_cache=True).logits[:, -1]]
        for t in range(NEW_TOKENS - 1):
            got_a.append(a(cont_a[:, t:t + 1], cache=ca, use_cache=True).logits[:, -1])
            got_b.append(b(cont_b[:, t:t + 1], cache=cb, use_cache=True).logits[:, -1])
    assert torch.equal(torch.stack(got_a), want_a)
    assert torch.equal(torch.stack(got_b), want_b)


def test_register_alone_runs_with_defaults_or_the_config_dict(eager, prompt):
    sat.register()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(attn_implementation="sparse_topk")).eval()
    with torch.no_grad():
        model(prompt, use_cache=True)
    assert sat.get_settings(model) == sat.SparseAttnSettings()
    cfg = tiny_config(attn_implementation="sparse_topk")
    cfg.sparse_attn = {"k_blocks": 4, "dense_layers": [1]}
    model = Qwen3ForCausalLM(cfg).eval()
    assert sat.get_settings(model).k_blocks == 4 and sat.get_settings(model).dense_layers == (1,)


@pytest.mark.parametrize("bad, match", [
    (dict(k_blocks=0), "k_blocks"), (dict(block_size=0), "block_size"),
    (dict(n_probe=0), "n_probe"), (dict(share="all"), "share"),
    (dict(importance_fraction=1.5), "importance_fraction"), (dict(sink_blocks=-1), "sink_blocks"),
    (dict(dense_layers=[2]), "dense_layers"), (dict(dense_layers=[-1]), "dense_layers"),
    (dict(dense_layers=3), "dense_layers"), (dict(kv_dtype="int4"), "kv_dtype"),
    (dict(group_size=0), "group_size"), (dict(threads=0), "threads"),
    (dict(k_blocks=2.5), "k_blocks"), (dict(recency="yes"), "recency"),
    (dict(exact_tail=-1), "exact_tail"), (dict(exact_tail=1.5), "exact_tail"),
    (dict(exact_tail=2**31), "exact_tail"),
])
def test_bad_settings_are_refused(eager, bad, match):
    with pytest.raises(sa.SparseAttnError, match=match):
        sat.enable(copy.deepcopy(eager), **bad)


def test_settings_keep_checked_ints():
    """numpy integers are taken and stored as ints: the settings' dict is
    what config.sparse_attn holds and save_pretrained writes as JSON."""
    settings = sat.SparseAttnSettings(
        k_blocks=np.int64(8), block_size=np.int32(16), n_probe=np.int64(4),
        recency=np.bool_(False), sink_blocks=np.int8(1), exact_tail=np.int32(32),
        group_size=np.int64(32), threads=np.int16(1), profile=np.bool_(True))
    d = json.loads(json.dumps(settings.to_dict()))
    assert (d["k_blocks"], d["block_size"], d["n_probe"], d["recency"], d["sink_blocks"],
            d["exact_tail"], d["group_size"], d["threads"]) == (8, 16, 4, False, 1, 32, 32, 1)
    assert type(settings.k_blocks) is int and type(settings.recency) is bool
    assert type(settings.profile) is bool and d["profile"] is True
    assert sat.SparseAttnSettings(policy="recall", n_probe="all").n_probe == "all"


# --------------------------------------------------------------------------- KV caches and dtypes

def test_float32_kv_is_read_without_copies():
    kv = torch.randn(1, 2, 50, 128)
    view = sat.state._float32_kv("key", kv)
    assert np.shares_memory(view, kv.numpy()) and view.shape == (2, 50, 128)
    big = torch.randn(1, 2, 80, 128)                       # head stride of 80 rows, 50 valid
    assert np.shares_memory(sat.state._float32_kv("key", big[:, :, :50]), big.numpy())
    half = kv.to(torch.bfloat16)
    assert sat.state._float32_kv("key", half).dtype == np.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 5])
def test_update_rows_are_float32_hkv_t_d(dtype, T):
    """What a SparseKVCache appends from an update's K/V: float32 [Hkv, T, D]
    C-contiguous, from a model's transpose(1, 2) layout in any float dtype."""
    x = torch.randn(1, T, 3, 64).to(dtype).transpose(1, 2)       # [1, Hkv, T, D]
    ptr, owner = sat.cache._rows_at(x)
    got = np.frombuffer(ffi.buffer(ptr, 3 * T * 64 * 4), dtype=np.float32)
    np.testing.assert_array_equal(got, x.float().reshape(-1).numpy())
    assert owner.data_ptr() == int(ffi.cast("uintptr_t", ptr))


@pytest.mark.parametrize("kv_dtype", [None, "float32"])
def test_bfloat16_model(eager, prompt, eager_run, kv_dtype):
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS, kv_dtype=kv_dtype).to(torch.bfloat16)
    ref = copy.deepcopy(eager).to(torch.bfloat16)
    seq, logits = greedy(model, prompt, n=4)
    _, ref_logits = greedy(ref, prompt, n=4)
    assert model.dtype == torch.bfloat16
    # Closer to the float32 model than bf16 eager is, within bf16 rounding.
    err = (logits.float() - eager_run[1][:4]).abs().max().item()
    assert err < BF16_LOGITS_ATOL
    assert err <= (ref_logits.float() - eager_run[1][:4]).abs().max().item() + 1e-2


def test_q8_cache_feeds_the_q8_kernels_with_a_quarter_of_the_memory(eager, prompt, eager_run):
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS)
    continuation = eager_run[0][:, PROMPT_TOKENS:]
    want = forced_logits(eager, prompt, continuation, DynamicCache(config=eager.config))
    n = PROMPT_TOKENS + continuation.shape[1] - 1
    q8 = sat.SparseKVCache(model, dtype="q8", capacity=n)
    f32 = sat.SparseKVCache(model, dtype="float32", capacity=n)
    got = forced_logits(model, prompt, continuation, q8)
    got_f32 = forced_logits(model, prompt, continuation, f32)
    assert (got - want).abs().max().item() < Q8_LOGITS_ATOL
    assert (got_f32 - want).abs().max().item() < LOGITS_ATOL
    layer = q8.layers[0]
    assert isinstance(layer.kv.k, sa.Q8) and layer.kv.seq_len == n
    assert q8.get_seq_length() == n
    # int8 + one float32 scale per 32 values against 4 bytes a value: 128/36.
    dyn = DynamicCache(config=eager.config)
    forced_logits(eager, prompt, continuation, dyn)
    dyn_bytes = sum(lay.keys.nbytes + lay.values.nbytes for lay in dyn.layers)
    assert dyn_bytes == f32.nbytes
    assert dyn_bytes / q8.nbytes == pytest.approx(128 / 36)


def test_q8_decode_step_appends_and_attends_in_one_call(eager, prompt, monkeypatch):
    """A q8 layer's decode update hands the new token to the attention call,
    which appends it and attends under one lock: the same bits as appending
    first and decoding the cache after; anything that reads the layer
    between the two sees the token appended."""
    model = sparse_copy(eager, k_blocks=2, kv_dtype="q8", record_blocks=True)
    module = model.model.layers[0].self_attn
    settings = model.sparse_attn
    caches = [sat.SparseKVCache(model) for _ in range(3)]
    with torch.no_grad():
        for c in caches:
            model(prompt, cache=c, use_cache=True)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 1, 2, 1, 128, generator=g)
    q = torch.randn(1, 4, 1, 128, generator=g)
    n = PROMPT_TOKENS
    fused, ref, read = (c.layers[0] for c in caches)
    with torch.no_grad():
        K, V = fused.update(k, v)
        assert K.shape == (1, 2, n + 1, 128) and V is K
        out, _ = sat.sparse_topk_attention(module, q, K, V, None, scaling=module.scaling)
        ref.update(k, v)
        assert ref.kv.seq_len == n + 1              # reading kv appended the token
        want, blocks = ref.kv.decode(q[0, :, 0].numpy(), scale=module.scaling, threads=1,
                                     return_blocks=True, **settings.decode_kwargs())
    assert fused.kv.seq_len == n + 1 and fused.get_seq_length() == n + 1
    assert torch.equal(out.view(4, 128), torch.from_numpy(want))
    np.testing.assert_array_equal(module.sparse_attn_blocks, blocks)
    for name in ("k", "v"):
        a, b = getattr(fused.kv, name), getattr(ref.kv, name)
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(a.scales, b.scales)
    # Two updates with no attention between: both tokens, in order.  The
    # layer alone keeps the new rows alive (a model rebinds its names to
    # what update returns), through the append too: were they freed first,
    # the memory refilled below would be read.
    append = sa.KVCache._append_locked

    def refill_then_append(self, kp, vp, T):
        junk = [torch.full((1, 2, 1, 128), float("nan")) for _ in range(16)]
        return append(self, kp, vp, T)

    read.update(k.clone(), v.clone())
    monkeypatch.setattr(sa.KVCache, "_append_locked", refill_then_append)
    assert caches[2].get_seq_length() == n + 1
    monkeypatch.undo()
    read.update(k + 1, v - 1)
    read.crop(-1)
    assert read.kv.seq_len == n + 1
    np.testing.assert_array_equal(read.kv.k.data, fused.kv.k.data)
    read.reset()
    assert read.get_seq_length() == 0
    # Without record_blocks no blocks are kept.
    plain = sparse_copy(eager, k_blocks=2, kv_dtype="q8")
    with torch.no_grad():
        plain(prompt, cache=sat.SparseKVCache(plain), use_cache=True)
    assert not hasattr(plain.model.layers[0].self_attn, "sparse_attn_blocks")


def test_decode_placeholders_and_outputs_made_in_batches_stay_right(eager, prompt):
    """The decode steps' placeholders and output tensors are made a batch
    at a time: across batch boundaries and after a crop each placeholder
    has its step's length, and every step's output is a tensor of its own
    that later steps never write (a caller may keep it)."""
    model = sparse_copy(eager, k_blocks=2, kv_dtype="q8")
    module = model.model.layers[0].self_attn
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
    layer = cache.layers[0]
    n = PROMPT_TOKENS
    g = torch.Generator().manual_seed(9)
    steps = sat.tensors.PLACEHOLDER_BATCH + sat.tensors.OUTPUT_BATCH + 3
    outs, copies, seen = [], [], set()
    with torch.no_grad():
        for i in range(steps):
            if i == sat.tensors.PLACEHOLDER_BATCH // 2:     # a rollback inside a batch
                layer.crop(-2)
                n -= 2
            k, v = torch.randn(2, 1, 2, 1, 128, generator=g)
            q = torch.randn(1, 4, 1, 128, generator=g)
            K, V = layer.update(k, v)
            n += 1
            assert K.shape == (1, 2, n, 128) and V is K and K.dtype == torch.float32
            out, _ = sat.sparse_topk_attention(module, q, K, V, None, scaling=module.scaling)
            assert layer.kv.seq_len == n
            want = layer.kv.decode(q[0, :, 0].numpy(), scale=module.scaling, threads=1,
                                   **model.sparse_attn.decode_kwargs())
            assert torch.equal(out.view(4, 128), torch.from_numpy(want))
            assert out.data_ptr() not in seen
            seen.add(out.data_ptr())
            outs.append(out)
            copies.append(out.clone())
    for out, kept in zip(outs, copies):
        assert torch.equal(out, kept)


def test_reading_the_layers_from_another_thread_during_decode(eager, prompt, eager_run):
    """A thread that reads every layer's KVCache while the model decodes
    (a progress display, say) appends a pending token at most once: the
    logits and the lengths are those of the run without it."""
    model = sparse_copy(eager, k_blocks=2, kv_dtype="q8")
    continuation = eager_run[0][:, PROMPT_TOKENS:]
    want = forced_logits(model, prompt, continuation, sat.SparseKVCache(model))
    n = PROMPT_TOKENS + continuation.shape[1] - 1
    for _ in range(3):
        cache = sat.SparseKVCache(model)
        stop, seen = threading.Event(), []

        def watch():
            while not stop.is_set():
                seen.append(max(layer.kv.seq_len for layer in cache.layers))

        watcher = threading.Thread(target=watch)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)     # switch threads as often as the interpreter can
        watcher.start()
        try:
            got = forced_logits(model, prompt, continuation, cache)
        finally:
            stop.set()
            watcher.join()
            sys.setswitchinterval(interval)
        assert torch.equal(got, want)
        assert [layer.kv.seq_len for layer in cache.layers] == [n] * len(cache.layers)
        assert seen and max(seen) <= n


def test_sparse_kv_cache_allocates_its_layers_before_the_forward(eager, prompt, eager_run):
    """The layers' KVCaches are made with the cache (not inside the first
    forward pass, where their allocations cost torch page faults); a config
    whose K/V shape is wrong is corrected by the first update."""
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS)
    cache = sat.SparseKVCache(model, capacity=64)
    for layer in cache.layers:
        assert (layer.kv.n_kv_heads, layer.kv.head_dim, layer.kv.capacity) == (2, 128, 64)
        assert layer.kv.seq_len == 0 and cache.get_seq_length() == 0
    made = [layer.kv for layer in cache.layers]
    continuation = eager_run[0][:, PROMPT_TOKENS:PROMPT_TOKENS + 3]
    got = forced_logits(model, prompt, continuation, cache)
    assert [layer.kv for layer in cache.layers] == made       # grown in place, not remade
    wrong = copy.deepcopy(eager.config)
    wrong.head_dim, wrong.num_key_value_heads = 64, 4
    other = sat.SparseKVCache(wrong, dtype="q8", capacity=64)
    assert other.layers[0].kv.head_dim == 64
    got_other = forced_logits(model, prompt, continuation, other)
    assert other.layers[0].kv.head_dim == 128 and other.layers[0].kv.n_kv_heads == 2
    assert torch.equal(got, got_other)


def test_q8_placeholders_refuse_other_attention_implementations(eager, prompt):
    model = sparse_copy(eager)
    cache = sat.SparseKVCache(model, dtype="q8")
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(sat.UnsupportedError, match="sparse_topk"):
        model(prompt, cache=cache, use_cache=True)
    with pytest.raises(sat.UnsupportedError):
        cache.layers[0].keys + 1


def test_kv_dtype_setting_makes_generate_use_the_q8_cache(eager, prompt, eager_run):
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS, kv_dtype="q8")
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, sat.SparseKVCache) and cache.dtype == "q8"
    assert cache.get_seq_length() == PROMPT_TOKENS + 2
    # made at the size generate needs (the prompt and every new token but
    # the last), so it never grew
    assert {layer.kv.capacity for layer in cache.layers} == {PROMPT_TOKENS + 2}


def test_kv_dtype_on_a_transformers_cache_warns(eager, prompt):
    model = sparse_copy(eager, kv_dtype="q8")
    with torch.no_grad(), pytest.warns(UserWarning, match="SparseKVCache"):
        model(prompt, cache=DynamicCache(config=model.config), use_cache=True)


# --------------------------------------------------------------------------- refusals

def test_refuses_tensors_off_the_cpu(eager):
    model = sparse_copy(eager)
    module = model.model.layers[0].self_attn
    q = torch.empty(1, 4, 1, 128, device="meta")
    kv = torch.empty(1, 2, 10, 128, device="meta")
    with pytest.raises(sat.UnsupportedError, match="CPU"):
        sat.sparse_topk_attention(module, q, kv, kv, None, scaling=module.scaling)
    with pytest.raises(sat.UnsupportedError, match="CPU"):
        sat.enable(copy.deepcopy(eager).to("meta"))
    # a SparseKVCache layer checks every update's tensors, not only the first
    # (the C append reads their data by address)
    layer = sat.SparseKVCache(model).layers[0]
    cpu, meta = torch.randn(1, 2, 3, 128), torch.empty(1, 2, 3, 128, device="meta")
    layer.update(cpu, cpu)
    for bad in ((meta, cpu), (cpu, meta)):
        with pytest.raises(sat.UnsupportedError, match="CPU"):
            layer.update(*bad)
    assert layer.get_seq_length() == 3


def test_refusals_hold_after_a_good_call(eager):
    """The backend's per-call test is one cheap predicate once a module has
    been checked; each thing it guards must still be refused after a good
    call, with the full check's message."""
    model = sparse_copy(eager)
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 128, generator=g)
    kv = torch.randn(1, 2, 41, 128, generator=g)
    call = functools.partial(sat.sparse_topk_attention, module, scaling=module.scaling)
    with torch.no_grad():
        call(torch.randn(1, 4, 40, 128, generator=g), kv[:, :, :40], kv[:, :, :40], None)
        good, _ = call(q, kv, kv, None)                 # a decode step after that prefill
        assert good.shape == (1, 1, 4, 128)
        bad = [(dict(attention_mask=torch.zeros(1, 1, 1, 41)), "mask"),
               (dict(dropout=0.1), "dropout"),
               (dict(query=torch.randn(2, 4, 1, 128)), "one batch"),
               (dict(query=q.to(torch.float64)), "float32/bfloat16/float16"),
               (dict(key=torch.randn(1, 2, 41, 64)), "head_dim"),
               (dict(query=torch.empty(1, 4, 1, 128, device="meta")), "CPU"),
               (dict(sliding_window=16), "sliding"),
               (dict(softcap=30.0), "softcap")]
        for change, match in bad:
            args = dict(query=q, key=kv, value=kv, attention_mask=None)
            args.update(change)
            with pytest.raises(sat.UnsupportedError, match=match):
                call(**args)
    qg = q.clone().requires_grad_(True)
    out, _ = call(qg, kv, kv, None)             # grad mode on: runs, and has no backward
    assert out.requires_grad
    with pytest.raises(sat.UnsupportedError, match="no backward"):
        out.sum().backward()
    kv2 = torch.cat([kv, torch.randn(1, 2, 1, 128, generator=g)], dim=2)
    with torch.no_grad():                       # the next step still runs
        again, _ = call(q, kv2, kv2, None)
    assert again.shape == good.shape and torch.isfinite(again).all()


def test_refuses_training(eager, prompt):
    """Attention dropout (training) is refused; a forward with grad mode on
    (an eval model whose weights require grad) runs as sdpa's does, its
    output requiring grad, and only a backward through it is refused."""
    torch.manual_seed(0)
    model = sat.enable(Qwen3ForCausalLM(tiny_config(attention_dropout=0.1)))
    model.train()
    with torch.no_grad(), pytest.raises(sat.UnsupportedError, match="dropout"):
        model(prompt)
    model.eval()
    logits = model(prompt).logits
    assert logits.requires_grad
    with torch.no_grad():
        assert torch.equal(logits.detach(), model(prompt).logits)
    with pytest.raises(sat.UnsupportedError, match="no backward"):
        logits.sum().backward()


def sliding_model():
    """Three layers: 0 full attention, 1 and 2 sliding windows of 48 tokens
    (the 300-token prompt is six windows long)."""
    cfg = tiny_config(use_sliding_window=True, sliding_window=48, max_window_layers=1,
                      num_hidden_layers=3, attn_implementation="sdpa")
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kv_dtype", [None, "float32", "q8"])
def test_sliding_window_layers_beside_sparse_full_layers(prompt, kv_dtype):
    """Sliding-window layers attend their window exactly (sdpa, over the
    float window transformers' own layer keeps, in a DynamicCache or a
    SparseKVCache); full layers stay sparse_topk.  With every block chosen
    the whole model is sdpa's, token for token (q8: within q8's error)."""
    ref = sliding_model()
    want_seq, want_logits = greedy(ref, prompt)
    model = sparse_copy(ref, k_blocks=ALL_BLOCKS, kv_dtype=kv_dtype)
    seq, logits = greedy(model, prompt)
    if kv_dtype == "q8":
        assert (logits - want_logits).abs().max() < Q8_LOGITS_ATOL
    else:
        assert torch.equal(seq, want_seq)
        assert (logits - want_logits).abs().max() < LOGITS_ATOL
    cache = sat.SparseKVCache(model)
    assert [type(layer).__name__ for layer in cache.layers] == \
        ["SparseKVLayer", "DynamicSlidingWindowLayer", "DynamicSlidingWindowLayer"]
    assert len(cache.sparse_layers) == 1
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
    assert cache.layers[0].get_seq_length() == PROMPT_TOKENS
    assert cache.layers[1].keys.shape[2] <= 48       # transformers' own window, not the prompt


def test_sliding_window_model_with_few_blocks_runs_and_differs(prompt):
    ref = sliding_model()
    _, want = greedy(ref, prompt)
    model = sparse_copy(ref, k_blocks=2)
    _, got = greedy(model, prompt)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() > DROPPED_BLOCKS_MIN_DIFF


def test_refuses_layers_it_does_not_serve(prompt):
    """A chunked-attention mask and an unknown layer type are still refused,
    with the alternative named."""
    cfg = tiny_config()
    sat.register()
    with pytest.raises(sat.UnsupportedError, match="sdpa"):
        sat.sparse_topk_mask(1, 4, 4, mask_function=lambda b, h, q, k: q >= k,
                             local_size=8, config=cfg)
    model = Qwen3ForCausalLM(copy.deepcopy(cfg)).eval()
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(sat.UnsupportedError, match="chunked_attention"):
        sat.enable(model)
    with pytest.raises(sat.UnsupportedError, match="chunked_attention"):
        sat.SparseKVCache(model)


def test_refuses_custom_masks_and_static_caches(eager, prompt):
    """(Batches and padding: tests/test_transformers_batch.py.)"""
    model = sparse_copy(eager)
    with torch.no_grad():
        mask = torch.ones(1, 1, PROMPT_TOKENS, PROMPT_TOKENS, dtype=torch.bool).tril()
        with pytest.raises(sat.UnsupportedError, match="mask"):
            model(prompt, attention_mask=mask)
        with pytest.raises(sat.UnsupportedError, match="static"):
            model.generate(prompt, max_new_tokens=2, cache_implementation="static")


def test_refuses_output_attentions(eager, prompt):
    model = sparse_copy(eager)
    with torch.no_grad(), pytest.raises(sat.UnsupportedError, match="eager"):
        model(prompt, output_attentions=True)


def test_docstring_examples():
    attempted = 0
    for module in (sat, sat.settings, sat.patching, sat.cache, sat.state, sat.attention,
                   sat.tensors, sat.refusals):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
        attempted += result.attempted
    assert attempted > 0


def decode_steps(model, cache, first, n):
    """Greedy decode of n tokens from `first`, one step at a time."""
    out, token = [], first
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
    return out


@pytest.mark.parametrize("kv_dtype", ["float32", "q8"])
def test_crop_rolls_back_decode_steps_exactly(eager, prompt, kv_dtype):
    """SparseKVCache.crop undoes decode steps: decoding again from the
    rolled-back cache gives the same tokens (what python -m sparse_attn.eval
    relies on to decode many configurations from one prefill)."""
    model = sparse_copy(eager, k_blocks=2, kv_dtype=kv_dtype)
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(prompt[:, :-1], cache=cache, use_cache=True)
    n = cache.get_seq_length()
    imp = cache.layers[0].kv.importance.copy()
    first = decode_steps(model, cache, int(prompt[0, -1]), 5)
    cache.crop(n - cache.get_seq_length())
    assert cache.get_seq_length() == n
    np.testing.assert_array_equal(cache.layers[0].kv.importance, imp)
    assert decode_steps(model, cache, int(prompt[0, -1]), 5) == first
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)


def test_minmax_scoring_uses_the_caches_bounds(eager, prompt):
    model = sparse_copy(eager, k_blocks=3, scoring="minmax", sink_blocks=1, kv_dtype="q8",
                        record_blocks=True)
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        model(prompt[:, -1:], cache=cache, use_cache=True)
    layer = model.model.layers[0].self_attn
    kv = cache.layers[0].kv
    assert kv.bounds.k_rows == kv.seq_len == PROMPT_TOKENS + 1
    # The blocks chosen are those select_blocks picks from the same bounds.
    assert layer.sparse_attn_blocks.shape == (4, 3)
    assert (layer.sparse_attn_blocks[:, 0] == 0).all()          # the sink block


def test_compare_exact_records_the_attention_error(eager, prompt):
    model = sparse_copy(eager, k_blocks=2, compare_exact=True)
    greedy(model, prompt, n=3)
    errors = model.model.layers[1].self_attn.sparse_attn_errors
    assert len(errors) == 2 and all(e > 0 for e in errors)      # 2 decode steps, blocks dropped
    model = sparse_copy(eager, k_blocks=ALL_BLOCKS, compare_exact=True)
    greedy(model, prompt, n=3)
    assert model.model.layers[1].self_attn.sparse_attn_errors == [0.0, 0.0]


def test_policy_fills_the_knobs_left_unset(eager):
    s = sat.SparseAttnSettings(policy="seed", sink_blocks=2)
    assert (s.importance_fraction, s.sink_blocks, s.share, s.scoring) == (0.5, 2, "head", "probe")
    with pytest.raises(ValueError, match="policy must be one of"):
        sat.SparseAttnSettings(policy="turbo")


def test_balanced_policy_keeps_and_reads_the_channel_copy(eager, prompt):
    """policy="balanced" (the default): a SparseKVCache made for the model
    keeps the channel copy up to date, and decoding from it gives exactly
    the logits of the same model on transformers' own cache (where the
    backend keeps a copy of its own) and on a cache without the copy (made
    for each call)."""
    model = sparse_copy(eager, k_blocks=2)
    assert model.sparse_attn.policy == "balanced"
    assert model.sparse_attn.scoring == "channels" and model.sparse_attn.n_channels == 16
    cont = prompt[:, :6]
    cache = sat.SparseKVCache(model, dtype="float32")
    got = forced_logits(model, prompt, cont, cache)
    kv = cache.layers[0].kv
    assert kv.copy_channels and kv.channels.k_rows == kv.seq_len
    assert kv.metadata_for(k_blocks=2, policy="balanced") == "channels"
    want = forced_logits(model, prompt, cont, DynamicCache(config=eager.config))
    assert torch.equal(got, want)
    plain = sat.SparseKVCache(model, dtype="float32", copy_channels=False)
    assert torch.equal(forced_logits(model, prompt, cont, plain), want)
    assert plain.layers[0].kv.channels is None
    seeded = sparse_copy(eager, k_blocks=2, policy="seed")
    seed = sat.SparseKVCache(seeded, dtype="float32")
    forced_logits(seeded, prompt, cont[:, :2], seed)
    assert seed.layers[0].kv.channels is None
    # a model never passed to enable() runs with the defaults: its cache
    # keeps the channel copy; a layer that decodes densely keeps none
    assert sat.SparseKVCache(eager.config).layers[0].copy_channels
    layers = sat.SparseKVCache(sparse_copy(eager, dense_layers=[0])).layers
    assert not layers[0].copy_channels and layers[1].copy_channels
    c = sat.SparseKVCache(sparse_copy(eager, dense_layers=[0]), dtype="float32")
    meta = [layer.kv.metadata_nbytes for layer in c.layers]     # allocated from the config
    assert c.metadata_nbytes == sum(meta) and meta[0] < meta[1]
    layers = sat.SparseKVCache(sparse_copy(eager, dense_layers=[0]), copy_channels=True).layers
    assert layers[0].copy_channels


def assert_same_copy(got, k):
    want = sa.channel_copy(k)
    assert got.k_rows == want.k_rows == k.shape[1]
    assert np.array_equal(got.data, want.data) and np.array_equal(got.scales, want.scales)


def test_balanced_on_a_transformers_cache_keeps_its_channel_copy(eager, prompt):
    """On transformers' own cache the backend keeps each layer's channel copy
    between steps (making again only the blocks with new rows): after the
    steps it is channel_copy() of the cache's K, bit for bit."""
    model = sparse_copy(eager, k_blocks=2, policy="balanced")
    cache = DynamicCache(config=eager.config)
    module = model.model.layers[1].self_attn
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        for t in range(40):         # 300 -> 340 rows: across a block boundary
            model(prompt[:, t:t + 1], cache=cache, use_cache=True)
    assert_same_copy(module._sparse_attn_view.channels(32), cache.layers[1].keys[0].numpy())


def test_the_kept_channel_copy_grows_and_restarts():
    """The view state's copy over chunks and single rows, past its first
    room of 64 blocks, then a new sequence, then another block size."""
    g = torch.Generator().manual_seed(5)
    K = torch.randn(1, 2, 2200, 64, generator=g)
    state = sat.state._ViewState()
    for S, T in [(100, 100), (101, 1), (130, 29), (2100, 1970), (2101, 1), (2200, 99)]:
        state.bind(0, K[:, :, :S], K[:, :, :S], T)
        assert_same_copy(state.channels(32), K[0, :, :S].numpy())
    assert state.kv._copy[0][0].shape[2] >= 2200 // 32
    K2 = torch.randn(1, 2, 50, 64, generator=g)
    state.bind(0, K2, K2, 50)       # a new sequence (its prompt fills the cache)
    assert_same_copy(state.channels(32), K2[0].numpy())
    state.bind(0, K[:, :, :51], K[:, :, :51], 1)
    with pytest.raises(sat.UnsupportedError, match="another sequence"):
        state.bind(0, K[:, :, :80], K[:, :, :80], 1)
    state.bind(0, K[:, :, :52], K[:, :, :52], 1)
    got = state.channels(16)
    want = sa.channel_copy(K[0, :, :52].numpy(), block_size=16)
    assert np.array_equal(got.data, want.data) and np.array_equal(got.scales, want.scales)


@pytest.mark.parametrize("policy", ["seed", "recall", "fast", "balanced"])
def test_the_view_states_decode_is_sparse_decode(policy):
    """On transformers' own cache the decode step calls the C core on
    operands made once per step: bit for bit what sparse_decode (and
    dense_decode for a dense layer) gives with the same knobs, the layer's
    importance and, for balanced, a fresh channel copy."""
    g = torch.Generator().manual_seed(7)
    K = torch.randn(1, 2, 300, 64, generator=g)
    V = torch.randn(1, 2, 300, 64, generator=g)
    q = torch.randn(4, 64, generator=g).numpy()
    settings = sat.SparseAttnSettings(k_blocks=3, policy=policy, threads=1)
    state = sat.state._ViewState()
    state.bind(0, K[:, :, :200], V[:, :, :200], 200)
    state.prefill(torch.randn(4, 200, 64, generator=g).numpy(), 0.125, 1, {})
    assert state.kv.importance.any()       # the reserve has something to rank
    for S in (201, 202, 240):
        state.bind(0, K[:, :, :S], V[:, :, :S], S - state.kv.length)
        got, blocks = state.decoder(settings, 0.125, 1, False)(q)
        k, v = K[0, :, :S].numpy(), V[0, :, :S].numpy()
        want, want_blocks = sa.sparse_decode(q, k, v, importance=state.kv.importance,
                                             scale=0.125, threads=1, return_blocks=True,
                                             policy=policy, k_blocks=3)
        assert got.tobytes() == want.tobytes() and np.array_equal(blocks, want_blocks)
        dense = state.decoder(settings, 0.125, 1, True)(q)
        assert dense.tobytes() == sa.dense_decode(q, k, v, scale=0.125, threads=1).tobytes()
