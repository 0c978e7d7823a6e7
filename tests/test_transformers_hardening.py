"""The transformers backend's state between calls, and what it reads of a
caller's tensors: each sequence's state is its own (keyed to the cache it
was built from, not to lengths), a one-token update is copied when it is
made, and q8 settings are checked against the model up front.

On the tiny random Qwen3 of test_transformers.py (its fixtures and helpers).
Run under the ASan build too (scripts/test-sanitized-python.sh): a deferred
read of a freed tensor there is a heap-use-after-free report, not a
silently wrong value."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sat = pytest.importorskip("sparse_attn.integrations.transformers")

import sparse_attn as sa  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from test_transformers import (  # noqa: E402,F401  (fixtures: used by name)
    PROMPT_TOKENS, decode_steps, eager, forced_logits, greedy, modest_cpu,
    prompt, sparse_copy)


@pytest.fixture(scope="module")
def other_prompt():
    """A second prompt of the first one's length, other tokens."""
    return torch.randint(0, 512, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(9))


def assert_same_copy(got, k):
    want = sa.channel_copy(k)
    assert got.k_rows == want.k_rows == k.shape[1]
    assert np.array_equal(got.data, want.data) and np.array_equal(got.scales, want.scales)


# --------------------------------------------------------------------------- state per sequence

def test_generate_after_a_shorter_sequence_is_the_sequence_alone(eager, prompt):
    """The default policy's channel copy of a DynamicCache belongs to the
    sequence it was made from: a generate on a prompt longer than the last
    sequence gives what it gives on a fresh model, bit for bit."""
    alone = greedy(sparse_copy(eager, k_blocks=2), prompt)
    model = sparse_copy(eager, k_blocks=2)
    greedy(model, prompt[:, 150:250])         # 100 + 11 rows, all within the next prompt's
    after = greedy(model, prompt)
    assert torch.equal(after[0], alone[0]) and torch.equal(after[1], alone[1])


def test_a_new_sequence_restarts_the_kept_channel_copy():
    """At the array level: a prefill of a new sequence (no earlier rows)
    drops the copy made from the last one, however long either is."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(1, 2, 101, 64, generator=g)
    B = torch.randn(1, 2, 201, 64, generator=g)
    state = sat.state._ViewState()
    state.bind(0, A[:, :, :100], A[:, :, :100], 100)
    state.bind(0, A, A, 1)
    assert_same_copy(state.channels(32), A[0].numpy())
    state.bind(0, B[:, :, :200], B[:, :, :200], 200)
    state.bind(0, B, B, 1)
    assert_same_copy(state.channels(32), B[0].numpy())


@pytest.mark.parametrize("policy", ["balanced", "seed"])
def test_two_transformers_caches_in_turn_are_each_the_sequence_alone(eager, prompt,
                                                                     other_prompt, policy):
    """Two DynamicCaches of equal length decoded in turn on one model: each
    sequence's logits are those it has alone (its own channel copy and
    importance record, which seed's reserve reads)."""
    model = sparse_copy(eager, k_blocks=2, policy=policy)
    cont = [p[:, :6] for p in (prompt, other_prompt)]
    alone = [forced_logits(model, p, c, DynamicCache(config=model.config))
             for p, c in zip((prompt, other_prompt), cont)]
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    steps = [[], []]
    with torch.no_grad():
        for i, p in enumerate((prompt, other_prompt)):
            steps[i].append(model(p, cache=caches[i], use_cache=True).logits[:, -1])
        for t in range(5):
            for i in (0, 1):
                step = model(cont[i][:, t:t + 1], cache=caches[i], use_cache=True)
                steps[i].append(step.logits[:, -1])
    for i in (0, 1):
        assert torch.equal(torch.stack(steps[i]), alone[i]), i


def registered_only(model, **settings):
    """A copy of `model` on sparse_topk with `settings` from its config's
    dict, never passed to enable(): its modules get the pre-hook at their
    first call."""
    sat.register()
    model = copy.deepcopy(model)
    model.config.sparse_attn = dict(settings, threads=1)
    model.set_attn_implementation(sat.NAME)
    return model


def test_a_modules_first_call_names_no_cache_and_is_taken_over(eager, prompt, other_prompt):
    """A model never passed to enable() serves its first forward before its
    modules have the pre-hook: that state is the module's own until a call
    that continues it names its cache; another cache's prefill in between
    does not take it, and a second copy of its cache is refused."""
    want = forced_logits(sparse_copy(eager, k_blocks=2, policy="seed"), prompt, prompt[:, :4],
                         DynamicCache(config=eager.config))
    model = registered_only(eager, k_blocks=2, policy="seed")
    c1, c2 = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        got = [model(prompt, cache=c1, use_cache=True).logits[:, -1]]     # not yet named
        twin = copy.deepcopy(c1)
        model(other_prompt, cache=c2, use_cache=True)
        for t in range(3):
            got.append(model(prompt[:, t:t + 1], cache=c1, use_cache=True).logits[:, -1])
        with pytest.raises(sat.UnsupportedError, match="before the backend could tell"):
            model(prompt[:, :1], cache=twin, use_cache=True)
    assert torch.equal(torch.stack(got), want)
    assert all(0 in c.__dict__["_sparse_attn_views"] for c in (c1, c2))


def test_a_cache_sparse_topk_did_not_fill_is_refused(eager, prompt):
    """Importance and channel copy cannot be had for tokens another
    implementation attended: a decode on such a cache is refused."""
    cache = DynamicCache(config=eager.config)
    with torch.no_grad():
        eager(prompt, cache=cache, use_cache=True)
        model = sparse_copy(eager, k_blocks=2)
        with pytest.raises(sat.UnsupportedError, match="sparse_topk attended 0"):
            model(prompt[:, :1], cache=cache, use_cache=True)


def test_a_cropped_transformers_cache_decodes_again_exactly(eager, prompt):
    """DynamicCache.crop rolls back decode steps: decoding again from it
    gives the same tokens, as a SparseKVCache's crop does."""
    model = sparse_copy(eager, k_blocks=2, policy="seed")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :-1], cache=cache, use_cache=True)
    first = decode_steps(model, cache, int(prompt[0, -1]), 5)
    cache.crop(-5)
    assert decode_steps(model, cache, int(prompt[0, -1]), 5) == first


def test_a_deepcopy_of_a_prefilled_cache_carries_its_state(eager, prompt):
    """transformers' way to reuse a prompt (decode from deepcopies of one
    prefilled cache): each copy decodes as the original did."""
    model = sparse_copy(eager, k_blocks=2, policy="seed")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :-1], cache=cache, use_cache=True)
    prefilled = copy.deepcopy(cache)
    first = decode_steps(model, cache, int(prompt[0, -1]), 5)
    for _ in range(2):
        assert decode_steps(model, copy.deepcopy(prefilled), int(prompt[0, -1]), 5) == first


def test_only_models_on_transformers_caches_have_the_pre_hook(eager, prompt):
    """The pre-hook costs every call of the module: enable() gives it to a
    model that generates on transformers' cache (kv_dtype None), not to
    one that generates on a SparseKVCache, which gets it at its first call
    on transformers' cache, once."""
    def hooks(model):
        return [len(m._forward_pre_hooks) for m in sat.attention_modules(model)]

    assert hooks(sparse_copy(eager, k_blocks=2)) == [1, 1]
    model = sparse_copy(eager, k_blocks=2, kv_dtype="q8")
    greedy(model, prompt, n=3)
    assert hooks(model) == [0, 0]
    with torch.no_grad(), pytest.warns(UserWarning, match="SparseKVCache"):
        model(prompt, cache=DynamicCache(config=model.config), use_cache=True)
    assert hooks(model) == [1, 1]
    sat.enable(model, k_blocks=2, threads=1)
    assert hooks(model) == [1, 1]


# --------------------------------------------------------------------------- the caller's tensors

def reuse(t, g):
    t.copy_(torch.randn(t.shape, generator=g))


def set_elsewhere(t, g):
    """Point the tensor at new storage: the old one is freed (nothing else
    holds it), and new tensors of its size are likely to get its memory."""
    shape = t.shape
    t.set_(torch.empty(0, dtype=t.dtype))
    for _ in range(4):
        torch.full(shape, 7.0, dtype=t.dtype)


def one_token(kind, g):
    if kind == "float32":
        return torch.randn(1, 2, 1, 64, generator=g)
    if kind == "bfloat16":
        return torch.randn(1, 2, 1, 64, generator=g).to(torch.bfloat16)
    return torch.randn(1, 1, 2, 128, generator=g)[..., ::2].transpose(1, 2)   # strided rows


@pytest.mark.parametrize("change", [reuse, set_elsewhere])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "strided"])
@pytest.mark.parametrize("after_prompt", [True, False])
def test_a_one_token_q8_update_is_read_when_it_is_made(change, kind, after_prompt):
    """A q8 layer's one-token update (a decode step's, appended later by
    the attention call) stores the token as it was when update() was
    called, whatever the caller does with its tensors afterwards."""
    g = torch.Generator().manual_seed(4)
    layer, want = sat.SparseKVLayer("q8", capacity=64), sat.SparseKVLayer("q8", capacity=64)
    if after_prompt:
        p = torch.randn(1, 2, 40, 64, generator=g)
        layer.update(p, p)
        want.update(p.clone(), p.clone())
    k, v = one_token(kind, g), one_token(kind, g)
    want.update(k.clone(), v.clone())
    layer.update(k, v)
    assert layer._pending[0] is not None       # the token waits for the attention call
    change(k, g)
    change(v, g)
    got, ref = layer.kv, want.kv
    for a, b in ((got.k, ref.k), (got.v, ref.v)):
        assert np.array_equal(a.data, b.data) and np.array_equal(a.scales, b.scales)


def test_many_decode_steps_each_keep_their_own_token():
    """The layer copies the tokens to rows it reuses: each step's token is
    its own, with the caller's tensors rewritten after every update, and
    updates in a row without an attention call in between."""
    g = torch.Generator().manual_seed(6)
    p = torch.randn(1, 2, 8, 64, generator=g)
    layer, want = sat.SparseKVLayer("q8", capacity=8), sat.SparseKVLayer("q8", capacity=8)
    layer.update(p, p)
    want.update(p, p)
    k, v = torch.empty(1, 2, 1, 64), torch.empty(1, 2, 1, 64)
    for step in range(41):
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
        layer.update(k, v)          # appended by the next update, or by kv below
        want.update(k.clone(), v.clone())
        if step % 3:
            layer.kv
    got, ref = layer.kv, want.kv
    assert got.seq_len == ref.seq_len == 8 + 41
    for a, b in ((got.k, ref.k), (got.v, ref.v)):
        assert np.array_equal(a.data, b.data) and np.array_equal(a.scales, b.scales)


def test_a_layer_allocated_again_takes_tokens_of_its_new_shape_only():
    """After allocate() with another head layout, a decode step's token of
    the old one is refused (the C append would read the new layout's size
    from it), and one of the new layout is stored."""
    g = torch.Generator().manual_seed(10)
    layer = sat.SparseKVLayer("q8", capacity=64)
    p2, p4 = torch.randn(1, 2, 8, 64, generator=g), torch.randn(1, 4, 8, 64, generator=g)
    layer.update(p2, p2)
    layer.allocate(4, 64)
    layer.update(p4, p4)
    with pytest.raises(sat.UnsupportedError, match="expects K/V of shape"):
        layer.update(p2[:, :, :1], p2[:, :, :1])
    layer.update(p4[:, :, :1], p4[:, :, :1])
    want = sa.KVCache(4, 64, capacity=16)
    want.append(p4[0].numpy(), p4[0].numpy())
    want.append(p4[0, :, :1].numpy(), p4[0, :, :1].numpy())
    assert np.array_equal(layer.kv.k.data, want.k.data)


def test_sdpa_prefill_skips_a_prompt_changed_after_its_update(eager):
    """prefill="sdpa" attends the prompt's own tensors, not the cache's
    copy; a prompt changed in place after the update would give an output
    the cache does not hold, so the exact prefill (from the cache) runs."""
    model = sparse_copy(eager, k_blocks=2, prefill="sdpa")
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(8)
    K, V = torch.randn(1, 2, 64, 128, generator=g), torch.randn(1, 2, 64, 128, generator=g)
    q = torch.randn(1, 4, 64, 128, generator=g)
    layer = sat.SparseKVLayer("float32", capacity=64)
    keys, values = layer.update(K, V)
    K.mul_(3.0)
    with torch.no_grad():
        out, _ = sat.sparse_topk_attention(module, q, keys, values, None, scaling=module.scaling)
    want, _ = sa.prefill(q[0].numpy(), keys[0].numpy(), values[0].numpy(),
                         scale=module.scaling, threads=1)
    np.testing.assert_allclose(out[0].transpose(0, 1).numpy(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- settings

def test_a_q8_group_size_is_checked_against_the_models_head_dim(eager):
    with pytest.raises(sa.ArgumentError, match=r"group_size \(48\).*head_dim \(128\)"):
        sat.enable(copy.deepcopy(eager), kv_dtype="q8", group_size=48)
    assert sat.enable(copy.deepcopy(eager), kv_dtype="q8", group_size=64).sparse_attn.group_size \
        == 64
    # unused without a q8 cache (a head_dim of 80 with the default 32 runs on a DynamicCache)
    sat.enable(copy.deepcopy(eager), group_size=48)


# --------------------------------------------------------------------------- batches

@pytest.mark.parametrize("kv_dtype", [None, "q8"])
def test_padded_batch_and_beams_read_only_their_own_rows(eager, prompt, kv_dtype):
    """A left-padded batch (a batched prefill, then batched decode steps in
    one C call per layer) and beam search (rows reordered and copied): each
    sequence's tokens are its own run's.  Under the ASan build, a row read
    past its sequence or a freed handoff is a report here."""
    model = sparse_copy(eager, k_blocks=2, kv_dtype=kv_dtype, threads=2)
    lengths = (PROMPT_TOKENS, 170, 41)
    S = max(lengths)
    ids = torch.zeros((3, S), dtype=torch.long)
    mask = torch.zeros((3, S), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, S - n:], mask[i, S - n:] = prompt[0, :n], 1
    with torch.no_grad():
        seqs = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
        for i, n in enumerate(lengths):
            alone = model.generate(prompt[:, :n], max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)
            assert torch.equal(seqs[i, S:], alone[0, n:])
        beams = model.generate(prompt[:, :170], max_new_tokens=6, do_sample=False, num_beams=3,
                               num_return_sequences=3, pad_token_id=0)
    assert beams.shape == (3, 176)
