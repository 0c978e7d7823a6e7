"""Block scorings that read a fraction of K, evaluated on a real model.

The research harness behind the channel scoring (docs/design.md, "What a
cache keeps beside K and V").  It runs ``sparse-attn eval``'s needle prompts (the same
runner, prompts, answer check and table) with the decode step's block
selection replaced, per layer, by a numpy scoring of the query against the
cache's keys, then the spec's choice (sinks, importance reserve, fill by
score with ties to the lower index, the recency block) and exact softmax
attention in float64 over the chosen blocks.  The C presets (``seed``,
``recall``, ``fast`` and their knobs) run as in ``sparse-attn eval``, side
by side; ``np-recall`` is the numpy path with recall's score, the check
that the harness itself keeps what the C ``recall`` keeps.

Scorings (``name:knob=value,...``; every one also takes ``share=group``,
``sink_blocks=N``, ``importance_fraction=F``):

  np-recall          each block's true max of q.k (reads all of K)
  sparq:r=R          SparQ: the R largest-|q| channels of each query head
                     against a channel-major copy of K; a block scores its
                     max.  ``channels=group`` takes one channel set per KV
                     head (the R largest of the group's summed |q|), so a
                     KV head reads R channels, not up to G*R
  loki:d=D           Loki: keys and query projected on the first D principal
                     directions of the prefill's keys (per layer and KV
                     head, uncentred), a block scores its max in D dims
  topnorm:m=M        the M keys of largest norm in each block (chosen as
                     rows are appended), scored exactly; its max
  refine:r=R,c=C     two stages: sparq:r=R picks C*k candidate blocks, then
                     their true max of q.k picks k (reads R/D of K plus C*k
                     blocks)

The winner, ``sparq:r=16,channels=group``, ships as ``policy="balanced"``
(``scoring="channels"``, docs/spec.md §6): the same choice, made in C from
a channel-major q8 copy of K (the harness scores float K; the C core its
q8 copy).

The ``K read`` column is the share of K's bytes a step reads to choose
(channels or rows read over all of them, averaged over layers, heads and
steps; metadata such as Loki's projected keys is counted at the bytes it
replaces).  Run from the repository root::

    python bench/scoring_eval.py --lengths 2048 --needles 0,1,2,3,4 \
        --budgets 8,16,32 --policies "recall;seed;fast;sparq:r=16,channels=group"
"""
import argparse
import math
import sys

import numpy as np

import sparse_attn as sa
import sparse_attn.eval as ev
import sparse_attn.integrations.transformers as sat
from sparse_attn.selection import importance_blocks, parse_policy

SCORERS = ("np-recall", "sparq", "loki", "topnorm", "refine")
_KNOBS = dict(r=int, d=int, m=int, c=float, channels=str, share=str, sink_blocks=int,
              importance_fraction=float)


def parse_scorer(spec):
    """(label, knobs) of a numpy scoring spec, or None for a C policy."""
    name, _, rest = spec.strip().partition(":")
    if name not in SCORERS:
        return None
    knobs = dict(scorer=name, r=16, d=16, m=8, c=2.0, channels="head", share="head",
                 sink_blocks=0, importance_fraction=0.0)
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in _KNOBS:
            raise SystemExit(f"{spec}: unknown knob {key!r} (knobs: {', '.join(_KNOBS)})")
        knobs[key] = _KNOBS[key](value)
    return spec.strip(), knobs


# --------------------------------------------------------------------------- choice

def choose(score, k_blocks, imp_sum, reserve, recency, sink_blocks):
    """docs/spec.md §2 steps 3-5 with §6's sinks and reserve for one score
    row, vectorised (tests it against sparse_attn.reference._choose)."""
    nb = len(score)
    total = min(k_blocks, nb)
    used = np.zeros(nb, bool)
    chosen = list(range(min(sink_blocks, total)))
    used[chosen] = True
    if imp_sum is not None and reserve:
        order = np.argsort(-np.asarray(imp_sum), kind="stable")
        picks = [int(b) for b in order if not used[b]][:min(reserve, total - len(chosen))]
        used[picks] = True
        chosen += picks
    order = np.argsort(-np.asarray(score, np.float64), kind="stable")
    fill = [int(b) for b in order[~used[order]][:total - len(chosen)]]
    if recency and fill and not used[nb - 1] and nb - 1 not in fill:
        fill[-1] = nb - 1
    return sorted(chosen + fill)


def _self_test():
    from sparse_attn.reference import _choose
    rng = np.random.default_rng(0)
    for trial in range(3000):
        nb = int(rng.integers(1, 40))
        score = rng.integers(0, 5, nb).astype(float)          # many ties
        imp = rng.integers(0, 4, nb).astype(float) if trial % 2 else None
        k, reserve, sinks = int(rng.integers(1, 45)), int(rng.integers(0, 6)), \
            int(rng.integers(0, 3))
        rec = bool(trial % 3)
        want = _choose(list(score), nb, k, imp, rec, reserve, sinks)
        got = choose(score, k, imp, reserve, rec, sinks)
        assert got == want, (trial, got, want)
    print("choose agrees with reference._choose on 3000 random rows")


# --------------------------------------------------------------------------- per layer state

class _Layer:
    """Float copies of one layer's K and V (rows of the prefill converted
    once, later rows each step), key norms, and the Loki basis."""

    def __init__(self, kv):
        self.kv, self.base = kv, None

    @staticmethod
    def _float(x, n):
        x = x.dequantize() if isinstance(x, sa.Q8) else x
        return np.asarray(x[:, :n], np.float32)

    def update(self, d_loki):
        kv, n = self.kv, self.kv.seq_len
        if self.base is None:                       # the first decode step after prefill
            self.base = n - 1
            self.fk, self.fv = self._float(kv.k, n), self._float(kv.v, n)
            keys = self.fk[:, :self.base].astype(np.float64)
            self.basis = []
            for h in range(keys.shape[0]):
                w, vec = np.linalg.eigh(keys[h].T @ keys[h])
                self.basis.append(vec[:, ::-1].astype(np.float32))   # largest first
            self.basis = np.stack(self.basis)
        else:                                        # rows from the prefill on may change
            b = self.base
            k_new, v_new = self._float(kv.k, n), self._float(kv.v, n)
            self.fk = np.concatenate([self.fk[:, :b], k_new[:, b:]], axis=1)
            self.fv = np.concatenate([self.fv[:, :b], v_new[:, b:]], axis=1)
        self.n = n
        return self


def _block_max(s, bs):
    nb = -(-len(s) // bs)
    pad = np.full(nb * bs, -np.inf)
    pad[:len(s)] = s
    return pad.reshape(nb, bs).max(axis=1)


class Scorer:
    """The numpy decode step of one scoring, with its read counter."""

    def __init__(self, knobs):
        self.kn = knobs
        self.read = []

    def scores(self, L, q, group, bs, k_blocks):
        kn, S = self.kn, L.n
        H, D = q.shape
        fk = L.fk[:, :S]
        out = np.empty((H, -(-S // bs)))
        name = kn["scorer"]
        read = 0.0
        for kh in range(fk.shape[0]):
            heads = range(kh * group, (kh + 1) * group)
            K = fk[kh].astype(np.float64)
            if name == "np-recall":
                for h in heads:
                    out[h] = _block_max(K @ q[h], bs)
                read += 1.0
            elif name in ("sparq", "refine"):
                r = min(kn["r"], D)
                if kn["channels"] == "group":
                    shared = np.argsort(-np.abs(q[list(heads)]).sum(0), kind="stable")[:r]
                chans = set()
                for h in heads:
                    idx = shared if kn["channels"] == "group" else \
                        np.argsort(-np.abs(q[h]), kind="stable")[:r]
                    chans.update(int(i) for i in idx)
                    out[h] = _block_max(K[:, idx] @ q[h, idx], bs)
                read += len(chans) / D
                if name == "refine":
                    nb = out.shape[1]
                    n_cand = min(nb, int(math.ceil(kn["c"] * k_blocks)))
                    cand_union = set()
                    for h in heads:
                        cand = np.argsort(-out[h], kind="stable")[:n_cand]
                        cand_union.update(int(b) for b in cand)
                        exact = _block_max(K @ q[h], bs)
                        row = np.full(nb, -np.inf)
                        row[cand] = exact[cand]
                        out[h] = row
                    read += len(cand_union) / nb
            elif name == "loki":
                d = min(kn["d"], D)
                P = L.basis[kh][:, :d].astype(np.float64)
                proj = K @ P
                for h in heads:
                    out[h] = _block_max(proj @ (P.T @ q[h]), bs)
                read += d / D
            elif name == "topnorm":
                m = min(kn["m"], bs)
                nb = -(-S // bs)
                norms = np.full(nb * bs, -np.inf)
                norms[:S] = (K * K).sum(1)
                rows = np.argsort(-norms.reshape(nb, bs), axis=1, kind="stable")[:, :m]
                rows = rows + np.arange(nb)[:, None] * bs
                valid = rows < S
                for h in heads:
                    s = np.full(rows.shape, -np.inf)
                    s[valid] = K[rows[valid]] @ q[h]
                    out[h] = s.max(axis=1)
                read += m / bs
        self.read.append(read / fk.shape[0])
        return out

    def __call__(self, L, q, scale, k_blocks, bs):
        kn = self.kn
        H, D = q.shape
        hkv = L.fk.shape[0]
        group = H // hkv
        q = q.astype(np.float64)
        score = self.scores(L, q, group, bs, k_blocks)
        nb = score.shape[1]
        imp_sum = None
        reserve = importance_blocks(kn["importance_fraction"], k_blocks)
        if reserve:
            imp = np.zeros(nb * bs)
            imp[:L.n] = L.kv.importance[:L.n]
            imp_sum = imp.reshape(nb, bs).sum(1)
        out = np.empty((H, D), np.float32)
        blocks = []
        for h in range(H):
            kh = h // group
            row = score[kh * group:(kh + 1) * group].sum(0) if kn["share"] == "group" \
                else score[h]
            chosen = choose(row, k_blocks, imp_sum, reserve, True, kn["sink_blocks"])
            blocks.append(chosen)
            tok = np.concatenate([np.arange(b * bs, min((b + 1) * bs, L.n)) for b in chosen])
            s = scale * (L.fk[kh, tok].astype(np.float64) @ q[h])
            p = np.exp(s - s.max())
            out[h] = (p @ L.fv[kh, tok]) / p.sum()
        width = max(len(b) for b in blocks)
        return out, np.array([b + [-1] * (width - len(b)) for b in blocks], np.int32)


# --------------------------------------------------------------------------- wiring

_active = {"scorer": None}
_c_decoder = sat.state.CacheState.decoder


def _decoder(self, settings, scale, threads, dense):
    scorer = _active["scorer"]
    if scorer is None or dense:
        return _c_decoder(self, settings, scale, threads, dense)
    layer = self.__dict__.get("_np_layer")
    if layer is None or layer.kv is not self.kv:
        layer = self.__dict__["_np_layer"] = _Layer(self.kv)
    k_blocks, bs = settings.k_blocks, settings.block_size
    return lambda q: scorer(layer.update(scorer.kn["d"]), q, scale, k_blocks, bs)


class Runner(ev.Runner):
    def _enable(self, settings):
        settings = dict(settings)
        knobs = settings.pop("np", None)
        if knobs is not None:
            _active["scorer"] = self.scorers.setdefault(
                (knobs["label"], settings["k_blocks"]), Scorer(knobs))
            settings = dict(k_blocks=settings["k_blocks"], compare_exact=True)
        else:
            _active["scorer"] = None
        super()._enable(settings)

    @property
    def scorers(self):
        return self.__dict__.setdefault("_scorers", {})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--self-test" in argv:
        _self_test()
        return 0
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--policies", default="recall;np-recall")
    known, rest = pre.parse_known_args(argv)
    specs = [p for p in known.policies.split(";") if p.strip()]
    args = ev.parse_args(rest + ["--policies", "seed"], prog="bench/scoring_eval.py")
    args.kv_dtype = args.kv_dtype if "--kv-dtype" in rest else "q8"
    policies = []
    for spec in specs:
        parsed = parse_scorer(spec)
        if parsed is None:
            policies.append(parse_policy(spec))
        else:
            label, knobs = parsed
            policies.append((label, dict(np=dict(knobs, label=label))))
    args.policies = policies
    holder = {}

    class _R(Runner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            holder["runner"] = self

    def on_prompt(results, length, length_done):
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump(dict(args={k: str(v) for k, v in vars(args).items()},
                               results=results), f, indent=1)
        if length_done:
            print(ev.summarise(results, length), flush=True)
            print(_read_table(holder["runner"]), flush=True)

    # The numpy decode step and the runner are swapped in for this run only.
    runner_class = ev.Runner
    ev.Runner, sat.state.CacheState.decoder = _R, _decoder
    try:
        ev.run(args, on_prompt)
    finally:
        ev.Runner, sat.state.CacheState.decoder = runner_class, _c_decoder
        _active["scorer"] = None
    return 0


def _read_table(runner):
    lines = ["share of K's bytes read to choose (numpy scorings; C presets: recall 100%, "
             "seed n_probe/block_size = 25%, fast 0% of K, its bounds 2/block_size rows)"]
    for (label, k), sc in sorted(runner.scorers.items()):
        if sc.read:
            lines.append(f"  {label:<40} k={k:<3} K read {np.mean(sc.read):6.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
