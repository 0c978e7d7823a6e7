"""What a SparseKVLayer does with a batch (a mixin of SparseKVLayer): one
batch-1 layer per sequence, the batch's update held until the attention
call hands each row its real tokens, and beam search's reordering."""
import torch

from sparse_attn import _checks as ck
from sparse_attn.errors import ArgumentError, UnsupportedError

from .refusals import check_cpu
from .state import CacheState


class BatchRows:
    """The batch methods of :class:`SparseKVLayer`.

    A layer given a batch (B sequences, padded to one length) holds one
    batch-1 layer per sequence (rows), each holding that sequence's
    tokens only: an update keeps the batch's new K/V (``_held``) and
    returns a placeholder of the padded length; the attention call, which
    knows each sequence's unpadded span from the mask, hands each row its
    own new tokens (take_row) and attends it as a batch of one."""

    def _batched_update(self, key_states, value_states):
        shape = key_states.shape
        check_cpu("key_states", key_states)
        check_cpu("value_states", value_states)
        if len(shape) != 4 or value_states.shape != shape:
            raise UnsupportedError(f"SparseKVCache layer expects K/V of shape [B, Hkv, T, D] "
                                   f"(one shape for both), got {list(key_states.shape)} and "
                                   f"{list(value_states.shape)}")
        if self._rows is None:
            self._to_rows(key_states)
        elif shape[0] != len(self._rows):
            raise UnsupportedError(f"this SparseKVCache layer holds a batch of {len(self._rows)} "
                                   f"sequences; an update brought {shape[0]}")
        if self._held is not None:
            raise UnsupportedError("a batched SparseKVCache layer was updated twice without an "
                                   "attention call between: its sparse_topk attention call "
                                   "stores each sequence's tokens (it knows their padding)")
        self._held = (key_states, value_states)
        self._batch_len += shape[2]
        self.keys = self.values = self._placeholder.make(
            (shape[0], shape[1], self._batch_len, shape[3]), self.model_dtype)
        return self.keys, self.values

    def _to_rows(self, key_states):
        """Become a layer of len(key_states) sequences, each in a batch-1
        layer of the same kind (this layer must hold no tokens)."""
        if self._kv is not None and self.kv.seq_len:
            raise UnsupportedError(f"this SparseKVCache layer holds one sequence of "
                                   f"{self._kv.seq_len} tokens; an update brought a batch of "
                                   f"{key_states.shape[0]}")
        b, hkv, _, d = key_states.shape
        rows = []
        for _ in range(b):
            row = type(self)(*self._args)
            row.allocate(hkv, d)
            rows.append(row)
        self._become_rows(rows, 0, key_states.dtype, key_states.device)

    def _become_rows(self, rows, length, model_dtype, device):
        self._rows, self._batch_len, self._held = rows, length, None
        # nothing of the batch-1 layer stays: no memory, no fast path
        self._kv = self.state = None
        self._token_shape, self._token_rows, self._phs = None, None, []
        self._pending[0] = self._prompt = None
        self.model_dtype, self.device, self.is_initialized = model_dtype, device, True

    def prompt_as_row(self, S):
        """A layer of one sequence whose first update (S tokens, still
        held for prefill="sdpa") turns out padded: become a batch of one
        holding that update, so the attention call keeps the real tokens
        only."""
        held = self._prompt
        if held is None or self._kv is None or self._kv.seq_len != S or held[0].shape[2] != S:
            raise UnsupportedError(
                "a padded sequence on a SparseKVCache layer that already holds tokens: pass "
                "the padding with the prompt's first forward (as generate does), or none")
        k, v = held[0], held[1]
        row = type(self)(*self._args)
        row.allocate(self._kv.n_kv_heads, self._kv.head_dim)
        self._become_rows([row], S, self.model_dtype, self.device)
        self._held = (k, v)

    def take_row(self, b, new):
        """Row b's real new tokens of the held update (``new``: a slice of
        its T rows, or an int64 tensor of them, ascending: its unpadded
        part), given to row b's layer; returns that layer's K and V (what the
        attention call reads as a batch of one).  The row notes their
        positions (for crop)."""
        k, v = self._held
        row = self._rows[b]
        first = self._batch_len - k.shape[2]
        if isinstance(new, slice):
            row._note_positions(first + new.start, first + new.stop)
        else:
            for lo, hi in _runs(new):
                row._note_positions(first + lo, first + hi)
        return row.update(k[b:b + 1, :, new], v[b:b + 1, :, new])

    def _note_positions(self, lo, hi):
        """A batch row's tokens [lo, hi) of the batch's positions are its
        next ones: kept as runs of consecutive positions, so crop knows how
        many of its tokens sit beyond the cropped length."""
        runs = self._runs
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        elif hi > lo:
            runs.append((lo, hi))

    def _crop_rows(self, length):
        """Each row keeps its tokens at batch positions below ``length``."""
        for row in self._rows:
            runs, drop = row._runs, 0
            while runs and runs[-1][1] > length:
                lo, hi = runs.pop()
                if lo < length:
                    runs.append((lo, length))
                    drop += hi - length
                else:
                    drop += hi - lo
            if drop:
                row.crop(-drop)

    def release_held(self):
        self._held = None

    def drop_held(self):
        """Forget a held update that was refused: none of its tokens went to
        a row, so the layer's length goes back to what it was."""
        if self._held is not None:
            self._batch_len -= self._held[0].shape[2]
            self._held = None

    def _copy_row(self):
        """A new batch-1 layer holding a copy of this one's sequence (q8 data
        and scales, importance, bounds and copies: no quantisation)."""
        new = type(self)(*self._args)
        kv = self.kv
        if kv is not None:
            new._kv = kv.copy()
            new.state = CacheState(new)
            new._token_shape = self._token_shape
        new._runs = list(self._runs)
        if self.is_initialized:
            new.model_dtype, new.device, new.is_initialized = \
                self.model_dtype, self.device, True
            new._handles()
        return new

    def __deepcopy__(self, memo):
        """An independent copy (``copy.deepcopy`` of a prefilled cache, as
        transformers reuses a prompt): each sequence's KVCache copied as
        stored (no quantisation)."""
        if self._held is not None:
            raise UnsupportedError("deepcopy between a batched update and its attention call")
        if self._rows is None:
            return self._copy_row()
        new = type(self)(*self._args)
        new._become_rows([row._copy_row() for row in self._rows], self._batch_len,
                         self.model_dtype, self.device)
        new.keys = new.values = None
        return new

    def __reduce__(self):
        """Pickling: the layer's settings, its KVCache (or each row's, for a
        batch: :meth:`sparse_attn.KVCache.__reduce__`, the data as stored)
        and where its rows' tokens sit; unpickled, a layer that attends as
        this one did."""
        if self._held is not None:
            raise UnsupportedError("pickling between a batched update and its attention call")
        state = dict(rows=self._rows, batch_len=self._batch_len, runs=self._runs,
                     initialized=self.is_initialized,
                     model_dtype=getattr(self, "model_dtype", None),
                     device=getattr(self, "device", None), token_shape=self._token_shape,
                     kv=None if self._rows is not None else self.kv)
        return (_unpickled_layer, (type(self), self._args, state))

    def _pick_rows(self, picks, what):
        """Rows picked by index, in order: a row picked again is copied."""
        if self._held is not None:
            raise UnsupportedError(f"{what} between a batched update and its attention call")
        n = len(self._rows)
        bad = [i for i in picks if not 0 <= i < n]
        if bad:
            raise ArgumentError(f"{what}: index {bad[0]} is out of range for a batch of {n}")
        taken, rows = set(), []
        for i in picks:
            rows.append(self._rows[i]._copy_row() if i in taken else self._rows[i])
            taken.add(i)
        self._rows = rows

    def _as_rows(self):
        """A layer of one sequence as a batch of one (before it is
        repeated), its KVCache moved to the row."""
        row = type(self)(*self._args)
        kv = self.kv
        row._kv, row._token_shape = kv, self._token_shape
        row.state = CacheState(row)
        row._runs = [(0, kv.seq_len)] if kv.seq_len else []
        row.model_dtype, row.device, row.is_initialized = self.model_dtype, self.device, True
        row._handles()
        self._become_rows([row], kv.seq_len, self.model_dtype, self.device)

    def reorder_cache(self, beam_idx):
        """Beam search: sequence i continues sequence ``beam_idx[i]``.  A
        sequence kept once keeps its KVCache; one kept twice or more is
        copied (q8 data, scales, importance, bounds, copies: no quantisation)."""
        self._select(torch.as_tensor(beam_idx).tolist(), "reorder_cache")

    def batch_repeat_interleave(self, repeats):
        """Each sequence repeated ``repeats`` times in place (copies)."""
        repeats = ck.check_int("repeats", repeats, minimum=1)
        n = 1 if self._rows is None else len(self._rows)
        self._select([i for i in range(n) for _ in range(repeats)], "batch_repeat_interleave")

    def batch_select_indices(self, indices):
        """Keep the sequences ``indices`` (ints, or a bool mask) names, in its order."""
        idx = torch.as_tensor(indices)
        if idx.dtype is torch.bool:
            idx = idx.nonzero().flatten()
        self._select(idx.tolist(), "batch_select_indices")

    def _select(self, picks, what):
        picks = [int(i) for i in picks]
        if not picks:
            raise ArgumentError(f"{what} keeps no sequence")
        if self._rows is None:
            if picks == [0] or not self.is_initialized or self.kv is None or \
                    not self.kv.seq_len:
                if any(i != 0 for i in picks):
                    raise ArgumentError(f"{what}: indices {picks} for a layer of one sequence")
                return
            self._as_rows()
        self._pick_rows(picks, what)


def _runs(index):
    """[(lo, hi)] runs of consecutive values of an ascending int64 tensor."""
    idx = index.tolist()
    runs, lo = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            runs.append((lo, a + 1))
            lo = b
    return runs


def _unpickled_layer(cls, args, state):
    """The layer SparseKVLayer.__reduce__ describes."""
    layer = cls(*args)
    layer._runs = list(state["runs"])
    if state["rows"] is not None:
        layer._become_rows(state["rows"], state["batch_len"], state["model_dtype"],
                           state["device"])
        return layer
    kv = state["kv"]
    if kv is not None:
        layer._kv, layer._token_shape = kv, state["token_shape"]
        layer.state = CacheState(layer)
    if state["initialized"]:
        layer.model_dtype, layer.device, layer.is_initialized = \
            state["model_dtype"], state["device"], True
        if kv is not None:
            layer._handles()
    return layer
