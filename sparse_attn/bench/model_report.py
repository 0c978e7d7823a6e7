"""The model bench's report: its table on stdout and its plot."""
from sparse_attn.needles import NEEDLES

from .common import log, pyplot


def found_text(row):
    if row.get("batch", 1) > 1:
        return f"{row['found_count']}/{row['batch']}"
    return "YES" if row["found"] else "NO"


def print_model_table(model, rows, args):
    import sparse_attn as sa
    import torch
    from sparse_attn.isa import default_threads
    cfg = model.config.get_text_config(decoder=True)
    print(f"\nModel {cfg.model_type}: {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} q heads, {cfg.num_key_value_heads} KV heads, head_dim "
          f"{getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads}, "
          f"{str(model.dtype).replace('torch.', '')} weights; "
          f"kernels {sa.isa()}, {args.threads or default_threads()} kernel thread(s), "
          f"torch {torch.get_num_threads()} thread(s); needle {NEEDLES[args.needle][0]!r} at "
          f"depth {args.depth}; greedy, {args.new_tokens} tokens (decode timed past the "
          "end of the answer)" + (f"; a batch of {args.batch} left-padded prompts (needles "
                                  f"{args.needle}.., lengths down to 0.{100 - 5 * (args.batch - 1)}x),"
                                  " decode = ms per step of the whole batch (per sequence: "
                                  "/ batch), needle = sequences that answered"
                                  if args.batch > 1 else ""))
    rounds = args.prefill_rounds
    print("TTFT = prefill of the prompt and the first token" +
          (f" (median of {rounds} rounds of prefills, the configurations taking turns)"
           if rounds > 1 else "") + "; decode = ms per generated token, "
          "median [min–max]; attn = time inside attention per token, all layers (share of "
          "the step); glue = the backend's Python per layer and token outside the C core "
          "(the attention call and, with a SparseKVCache, its update; median over the "
          "steps, the mean in --json as glue_mean_us); +RSS = how far the resident memory "
          "rose over the configuration's prefill, its peak over what was resident before "
          "(the model, and the caches of the configurations before it, which stay for the "
          "turns; --json: rss_growth_mb, and peak_rss_mb, the peak itself; compare memory "
          "with one configuration per run); KV = the cache's K and V and what it keeps beside "
          "them for selection (the channel copy, key bounds, probe copies; --json: meta_mb).\n")
    head = (f"{'tokens':>6} {'config':<16} {'TTFT s':>7} {'decode ms/token [min–max]':>26} "
            f"{'attn ms':>8} {'share':>6} {'glue us':>8} {'+RSS MB':>7} {'KV MB':>6} "
            f"{'needle':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        glue = "-" if r["glue_us"] is None else f"{r['glue_us']:.1f}"
        dec = f"{r['decode_ms']:.1f} [{r['decode_ms_min']:.1f}–{r['decode_ms_max']:.1f}]"
        print(f"{r['tokens']:>6} {r['config']:<16} {r['ttft_s']:7.2f} {dec:>26} "
              f"{r['attn_ms']:8.1f} {r['attn_share']:6.0%} {glue:>8} {r['rss_growth_mb']:7.0f} "
              f"{r['kv_mb']:6.1f} {found_text(r):>6}")
    by_len = {}
    for r in rows:
        by_len.setdefault(r["length"], {})[r["config"]] = r
    for length, d in by_len.items():
        ref = d.get("sdpa")
        if not ref:
            continue
        parts = []
        for c, r in d.items():
            if c == "sdpa":
                continue
            part = f"{c} {r['decode_ms'] / ref['decode_ms']:.2f}x / {r['ttft_s'] / ref['ttft_s']:.2f}x"
            if r.get("vs_sdpa_paired_range"):
                lo, hi = r["vs_sdpa_paired_range"]
                part += f" (decode per round {r['vs_sdpa_paired']:.2f}x [{lo:.2f}–{hi:.2f}])"
            if r.get("ttft_vs_sdpa_paired_range") and len(r["ttft_rounds_s"]) > 1:
                lo, hi = r["ttft_vs_sdpa_paired_range"]
                part += (f" (TTFT per round {r['ttft_vs_sdpa_paired']:.2f}x "
                         f"[{lo:.2f}–{hi:.2f}] over {len(r['ttft_rounds_s'])})")
            parts.append(part)
        print(f"{length} tokens, decode / TTFT against sdpa: " + ", ".join(parts))
    if any("vs_sdpa_paired" in r for r in rows):
        print("(decode per round: each step's time over sdpa's step of the same round, the "
              "configurations' steps taking turns; median [min–max] over the rounds)")


def plot_model(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for conf in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["tokens"], r["decode_ms"], r["ttft_s"]) for r in rows
                     if r["config"] == conf)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=conf)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=conf)
    axes[0].set_ylabel("decode ms / token")
    axes[1].set_ylabel("time to first token, s")
    for ax in axes:
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")
