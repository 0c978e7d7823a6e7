"""sparse_attn: block-sparse top-k attention for long-context decoding.

The KV is split into blocks (32 tokens by default); a cheap probe scores
every block, the best ``k_blocks`` are chosen by the rules of docs/spec.md
§2, and exact softmax attention runs over those blocks only, on a float32 or
int8 (q8) KV cache.  The C core picks its kernels (portable, AVX2, AVX-512
VNNI, NEON, NEON dotprod) at import from what the CPU reports;
``SPARSE_ATTN_ISA=<name>`` forces a lower one.
"""
import os as _os

from .attention import (accumulate_v, dense_decode, prefill, probe_scores, q8_dot,
                        select_blocks, sparse_decode)
from .cache import KVCache
from .errors import (ArgumentError, ArgumentTypeError, KernelError, SparseAttnError,
                     UnsupportedError)
from .kv_state import KVState, StateDecoder, decode_batch
from .isa import available_isas, built_isas, isa, set_isa
from .metadata import BlockBounds, ChannelCopy, ProbeRows, block_bounds, channel_copy, probe_rows
from .q8 import Q8, quantize_q8
from .selection import POLICIES

__version__ = "0.2.0"

__all__ = [
    "POLICIES", "Q8", "KVCache", "KVState", "StateDecoder", "decode_batch", "BlockBounds", "quantize_q8", "probe_scores", "select_blocks",
    "block_bounds", "ProbeRows", "probe_rows", "ChannelCopy", "channel_copy", "sparse_decode",
    "dense_decode", "prefill", "q8_dot", "accumulate_v", "isa", "set_isa",
    "available_isas", "built_isas", "SparseAttnError", "ArgumentError",
    "ArgumentTypeError", "KernelError", "UnsupportedError",
]

if _os.environ.get("SPARSE_ATTN_ISA"):
    set_isa(_os.environ["SPARSE_ATTN_ISA"])
