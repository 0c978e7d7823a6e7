"""The drop-in for every model and call sdpa takes (issue 63): the calls
transformers' own model tests make, on tiny random models of the families
they cover (Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma 3), each compared
with sdpa on the same weights, every block chosen so the attention is
exact.

Mistral-style configs set a model-wide ``sliding_window`` and no
``layer_types``: every layer is windowed, attended sparsely while the
sequence fits the window and exactly (sdpa) beyond it; both are tried.
Qwen2 and Gemma 3 mix sliding-window and full layers.  The calls: greedy
``generate``; a left-padded batch; right padding followed by the tokens
generate appends; a mask with holes; a forward with grad mode on; beam
search continued from a ``deepcopy`` of a prefilled cache (the way to
reuse a prompt), twice from the same prefill."""
import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sat = pytest.importorskip("sparse_attn.integrations.transformers")

from transformers import (DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig,  # noqa: E402
                          GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from test_transformers import modest_cpu  # noqa: E402,F401  (autouse: one torch thread)

# float32 attention summed in another order than torch's, then the layers
# and the LM head: a few ulps of the logits' size
LOGITS_ATOL = 1e-4
# q8 K and V: ~0.4% error per element (test_transformers.py)
Q8_LOGITS_ATOL = 3e-2
ALL_BLOCKS = 64             # > every context here in 32-token blocks
PROMPT = 150                # 5 blocks
NEW = 6

COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=2048, attn_implementation="sdpa", pad_token_id=0,
              bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        **dict(COMMON, num_hidden_layers=3), use_sliding_window=True, sliding_window=48,
        max_window_layers=1)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON)),
    # the window above every sequence here: every layer sparse
    "mistral-window-above": lambda: MistralForCausalLM(MistralConfig(**COMMON,
                                                                     sliding_window=4096)),
    # the window below the prompt: the prompt and decode beyond it, exact
    "mistral-window-below": lambda: MistralForCausalLM(MistralConfig(**COMMON,
                                                                     sliding_window=64)),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**COMMON)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **dict(COMMON, num_hidden_layers=3), sliding_window=64, sliding_window_pattern=3,
        query_pre_attn_scalar=64)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def ref(request):
    torch.manual_seed(0)
    return FAMILIES[request.param]().eval()


def sparse(model, **settings):
    settings.setdefault("threads", 1)
    settings.setdefault("k_blocks", ALL_BLOCKS)
    return sat.enable(copy.deepcopy(model), **settings)


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g) for n in lengths]


def padded(ps, side):
    S = max(len(p) for p in ps)
    ids = torch.zeros((len(ps), S), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        at = slice(S - len(p), S) if side == "left" else slice(0, len(p))
        ids[i, at], mask[i, at] = p, 1
    return ids, mask


def generate(model, ids, mask=None, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def tolerance(kv_dtype):
    return Q8_LOGITS_ATOL if kv_dtype == "q8" else LOGITS_ATOL


def same_as_sdpa(ref, model, kv_dtype, ids, mask=None, **kwargs):
    want_seqs, want = generate(ref, ids, mask, **kwargs)
    seqs, got = generate(model, ids, mask, **kwargs)
    if kv_dtype != "q8":        # q8's error may flip a near tie
        assert torch.equal(seqs, want_seqs)
    if seqs.shape == want_seqs.shape and torch.equal(seqs, want_seqs):
        assert (got - want).abs().max() < tolerance(kv_dtype)


@pytest.mark.filterwarnings("ignore:SparseKVCache. every layer")
@pytest.mark.parametrize("kv_dtype", [None, "q8"])
@pytest.mark.parametrize("batch", ["one", "left", "right"])
def test_generate_is_sdpas(ref, kv_dtype, batch):
    """Greedy generate of one prompt, a left-padded batch and a right-padded
    one (the new tokens after the pads): sdpa's tokens and logits."""
    ps = prompts([PROMPT, 97, 120])
    if batch == "one":
        ids, mask = ps[0][None], None
    else:
        ids, mask = padded(ps, batch)
    same_as_sdpa(ref, sparse(ref, kv_dtype=kv_dtype), kv_dtype, ids, mask)


@pytest.mark.filterwarnings("ignore:SparseKVCache. every layer")
@pytest.mark.parametrize("kv_dtype", [None, "q8"])
def test_a_mask_with_holes_is_sdpas(ref, kv_dtype):
    """Padding between a sequence's tokens, and a sequence of padding only:
    one forward's logits at every real position, and generate's tokens."""
    ids, mask = padded(prompts([PROMPT, 97, 40]), "left")
    mask[0, 30:37] = 0
    mask[1, -20] = 0
    mask[2] = 0
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        model = sparse(ref, kv_dtype=kv_dtype)
        cache = sat.SparseKVCache(model) if kv_dtype else None
        got = model(ids, attention_mask=mask, cache=cache).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() < tolerance(kv_dtype)
    same_as_sdpa(ref, model, kv_dtype, ids, mask)


def test_a_forward_with_grad_mode_on_runs_as_sdpas(ref, request):
    """An eval model whose weights require grad, called outside no_grad:
    sdpa's logits, requiring grad as sdpa's do; a backward through a layer
    sparse_topk attended is refused (a model whose every layer ran sdpa,
    the prompt beyond its window, has sdpa's backward)."""
    ids = prompts([PROMPT])[0][None]
    want = ref(ids).logits
    got = sparse(ref)(ids).logits
    assert got.requires_grad == want.requires_grad
    assert (got - want).abs().max() < LOGITS_ATOL
    if request.node.callspec.params["ref"] == "mistral-window-below":
        got.sum().backward()
    else:
        with pytest.raises(sat.UnsupportedError, match="no backward"):
            got.sum().backward()


@pytest.mark.parametrize("beams", [2, 3])
def test_beam_search_from_a_deepcopy_of_a_prefilled_cache_is_sdpas(ref, beams):
    """The prompt prefilled once into a DynamicCache, then beam search
    continued twice, each from a deepcopy of it repeated for the beams:
    sdpa's tokens each time.  The copy's batch_repeat_interleave and
    reorder_cache (beam search's) move the copy's per-sequence states,
    never the original's."""
    ids = prompts([PROMPT + 20])[0][None]

    def runs(model):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :PROMPT], cache=cache)
        out = []
        for _ in range(2):
            again = copy.deepcopy(cache)
            again.batch_repeat_interleave(beams)
            seqs, _ = generate(model, ids, cache=again, num_beams=beams)
            out.append(seqs)
        return out

    want = runs(ref)
    got = runs(sparse(ref))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_used_cache_and_model_pickle_and_copy_with_their_states(ref):
    """A DynamicCache sparse_topk has used, and the model, survive pickling
    and deepcopy: the copies' batch methods are bound to the copies, and
    continuing from an unpickled cache gives what continuing from the
    original gives."""
    model = sparse(ref)
    ids = prompts([PROMPT + 20])[0][None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache)
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        for name in ("reorder_cache", "batch_select_indices", "batch_repeat_interleave"):
            method = twin.__dict__.get(name)
            assert method is None or method.cache is twin
        twin.batch_repeat_interleave(2)
        again = copy.deepcopy(cache)
        again.batch_repeat_interleave(2)
        assert torch.equal(generate(model, ids, cache=twin, num_beams=2)[0],
                           generate(model, ids, cache=again, num_beams=2)[0])
    twin = pickle.loads(pickle.dumps(model))
    assert twin._prepare_cache_for_generation.model is twin
    assert torch.equal(generate(twin, ids)[0], generate(model, ids)[0])


def test_a_static_cache_is_refused_by_name(ref):
    """A pre-allocated cache (generate's ``cache_implementation="static"``)
    is refused at its first call, with the reason, on every family: the
    Mistral-style windows too (whose layers had reached torch's sdpa and
    then crashed at the step that filled the cache)."""
    ids = prompts([40])[0][None]
    with pytest.raises(sat.UnsupportedError, match="static"):
        generate(sparse(ref), ids, cache_implementation="static", max_new_tokens=3)



@pytest.mark.filterwarnings("ignore:SparseKVCache. every layer")
@pytest.mark.parametrize("kv_dtype", ["q8", "float32"])
def test_a_sparse_kv_cache_pickles_with_its_rows(ref, kv_dtype):
    """A SparseKVCache holding a padded batch (a row per sequence), pickled
    after its prompt: generating from the unpickled cache gives the tokens
    generating from the original gives."""
    model = sparse(ref, k_blocks=2, kv_dtype=kv_dtype)
    ids, mask = padded(prompts([PROMPT, 97]), "left")
    cache = sat.SparseKVCache(model)
    with torch.no_grad():
        model(ids[:, :-10], attention_mask=mask[:, :-10], cache=cache)
    twin = pickle.loads(pickle.dumps(cache))
    want = generate(model, ids, mask, cache=cache)[0]
    assert torch.equal(generate(model, ids, mask, cache=twin)[0], want)
