"""llama.cpp's attention computed by sparse_attn's C core, in llama-cpp-python.

Two lines, before the model is created::

    import sparse_attn.integrations.llama_cpp as sal
    sal.load("build/llama-backend/libsparse_attn_ggml.so")
    llm = llama_cpp.Llama(model_path=..., flash_attn=True)

:func:`load` loads the ggml backend that ``scripts/build-llama-backend.sh
LLAMA_CPP_DIR`` builds (against the llama.cpp that llama-cpp-python was
built from: its sdist vendors it under ``vendor/llama.cpp``) into the
running llama-cpp-python, through the very ``libggml`` its ``libllama``
uses.  From then on every context created gets the backend, and llama.cpp's
scheduler hands it each attention node (``GGML_OP_FLASH_ATTN_EXT``, so
``flash_attn=True``) it accepts: f16 or q8_0 K/V (``type_k`` / ``type_v``),
no ALiBi, softcap or attention sinks; the others, and everything else in the
model, run on llama.cpp's CPU backend as before.  By default attention is
exact: the same text as llama.cpp's own flash attention within float
rounding (llama.cpp's CPU path rounds the query to f16 and adds V in f16;
this one computes in float32).

With ``k_blocks`` (``load(..., k_blocks=32)``, :func:`configure`, or
``SPARSE_ATTN_K_BLOCKS`` read when the backend is loaded) each decode step
(a graph of at most 4 query rows) reads, per KV head group, only the
``k_blocks`` blocks of 32 of its sequence's cells that a probe of 8 keys a
block scores highest, the latest block always among them (docs/spec.md
§8); prompt batches, ``dense_layers`` and rows with no more than
``k_blocks`` blocks stay exact.  Nothing is kept beside llama.cpp's cache,
so the choice is made from K alone at every step: policies that need an
importance record, key bounds or a channel copy (``seed``, ``fast``,
``balanced``) are refused.  Threads: ``SPARSE_ATTN_NUM_THREADS``, else the
context's ``n_threads`` (``n_threads_batch`` for prompts).  Kernels: the best
this CPU runs, or ``SPARSE_ATTN_ISA``'s (read when the backend is loaded).

llama.cpp's own tools take the same file without Python:
``GGML_BACKEND_PATH=/path/libsparse_attn_ggml.so llama-cli -fa on ...`` (a
llama.cpp built with ``GGML_BACKEND_DL=ON``), and its settings from
``SPARSE_ATTN_K_BLOCKS``, ``SPARSE_ATTN_POLICY`` and
``SPARSE_ATTN_DENSE_LAYERS``.  Flash attention must be on
explicitly: llama.cpp's ``auto`` finds the attention nodes on a device other
than their layer's and turns flash attention off.
"""
import ctypes
import os
from pathlib import Path

from .. import _checks as ck
from .._ffi import lib
from ..errors import ArgumentError, KernelError, UnsupportedError
from ..selection import POLICIES, parse_policy, stateless_selection, stateless_spec

#: The name the backend registers with ggml (ggml_backend_reg_by_name).
REGISTRY_NAME = b"sparse_attn"
#: Where scripts/build-llama-backend.sh puts the backend by default, in a
#: checkout of the project.
_CHECKOUT_BUILD = Path(__file__).resolve().parents[2] / "build" / "llama-backend" / \
    "libsparse_attn_ggml.so"

_state = {"reg": None, "path": None, "calls": None, "sparse_calls": None, "configure": None,
          "text": None}
_CONFIGURE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                              ctypes.c_char_p, ctypes.c_int)
_TEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int)


def _libggml():
    """ctypes handle of the libggml that llama-cpp-python's libllama is
    linked against: the one already loaded under the name libllama asks for
    (``libggml.so.0``), else its ``lib/libggml.so.0``.  Not
    ``lib/libggml.so`` by path: the wheel stores that as a separate copy,
    with a backend registry of its own whose devices libllama never sees."""
    try:
        import llama_cpp     # loads libllama and, with it, its libggml
    except ImportError as e:
        raise ImportError(
            "sparse_attn.integrations.llama_cpp needs llama-cpp-python (pip install "
            "llama-cpp-python, built from source with the llama.cpp the backend was built "
            f"against): {e}") from None
    lib = None
    for name in ("libggml.so.0", "libggml.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
            break
        except (OSError, AttributeError):   # not loaded under that name; not Linux
            pass
    if lib is None:
        path = Path(llama_cpp.__file__).resolve().parent / "lib" / "libggml.so.0"
        if not path.exists():
            raise ImportError(f"llama-cpp-python's libggml was not found (looked for {path})")
        lib = ctypes.CDLL(str(path))
    lib.ggml_backend_load.restype = ctypes.c_void_p
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


def _plugin_path(plugin_path):
    if plugin_path is None:
        plugin_path = os.environ.get("SPARSE_ATTN_LLAMA_BACKEND") or _CHECKOUT_BUILD
    path = Path(plugin_path)
    if not path.is_file():
        raise ArgumentError(
            f"plugin_path: no ggml backend at {path}: build it with "
            "scripts/build-llama-backend.sh LLAMA_CPP_DIR [OUT] (LLAMA_CPP_DIR the llama.cpp "
            "source llama-cpp-python was built from) and pass its path, or set "
            "SPARSE_ATTN_LLAMA_BACKEND")
    return path.resolve()


def load(plugin_path=None, *, k_blocks=None, policy=None, dense_layers=None, **knobs):
    """Load the ggml backend into the running llama-cpp-python; idempotent.

    Call it before creating a ``llama_cpp.Llama`` (a context made earlier
    keeps the backends it was made with), with ``flash_attn=True`` on the
    model.

    Parameters
    ----------
    plugin_path : str or path-like, default ``SPARSE_ATTN_LLAMA_BACKEND``,
        else ``build/llama-backend/libsparse_attn_ggml.so`` of the checkout
        this package runs from
        The shared object ``scripts/build-llama-backend.sh`` built.
    k_blocks, policy, dense_layers, **knobs
        If any is given, :func:`configure` is called with them; else the
        settings stay those of the environment (``SPARSE_ATTN_K_BLOCKS``,
        ``SPARSE_ATTN_POLICY``, ``SPARSE_ATTN_DENSE_LAYERS``, read when the
        backend was loaded; none set: exact).

    Returns
    -------
    str
        The path loaded (the one loaded first, when the backend is already
        registered; None if it came from ``GGML_BACKEND_PATH``).

    Raises
    ------
    ImportError
        llama-cpp-python is not installed.
    ArgumentError
        No file at ``plugin_path``.
    KernelError
        ggml could not load it (its log says why: most often a backend built
        against another llama.cpp).
    """
    lib = _libggml()
    if _state["reg"] is None:
        reg = lib.ggml_backend_reg_by_name(REGISTRY_NAME)
        if reg:         # registered already (GGML_BACKEND_PATH, or another loader)
            _state["reg"] = reg
        else:
            path = _plugin_path(plugin_path)
            reg = lib.ggml_backend_load(os.fsencode(path))
            if not reg:
                raise KernelError(
                    f"ggml could not load the backend {path} (its message above says why; "
                    "a backend must be built against the llama.cpp it is loaded into)")
            _state["reg"], _state["path"] = reg, str(path)
        for name, kind in (("calls", ctypes.CFUNCTYPE(ctypes.c_longlong)),
                           ("sparse_calls", ctypes.CFUNCTYPE(ctypes.c_longlong)),
                           ("configure", _CONFIGURE), ("text", _TEXT)):
            symbol = b"sa_ggml_" + (b"settings_text" if name == "text" else name.encode())
            address = lib.ggml_backend_reg_get_proc_address(_state["reg"], symbol)
            _state[name] = kind(address) if address else None
    if k_blocks is not None or policy is not None or dense_layers is not None or knobs:
        configure(k_blocks, policy, dense_layers=dense_layers, **knobs)
    return _state["path"]


def configure(k_blocks=None, policy=None, *, dense_layers=None, block_size=None, n_probe=None,
              sink_blocks=None, share=None, recency=None, importance_fraction=None,
              scoring=None):
    """Set the loaded backend's sparse decode (docs/spec.md §8) for every
    graph computed from now on, in every context of the process.

    Parameters
    ----------
    k_blocks : int or None
        Blocks of ``block_size`` valid cells each decode row reads per KV
        head; None or 0: exact attention (the other arguments are still
        checked).
    policy : str or None
        A preset (``recall``), or ``name:knob=value,...`` as ``sparse-attn
        eval --policies`` takes it (knobs over the preset ``name``, else over
        ``seed``; ``block_size=`` and ``dense_layers=`` too); default
        :data:`sparse_attn.selection.LLAMA_CPP_POLICY` (the probe of 8 rows
        a block, one choice per KV head group).
    dense_layers : iterable of int, optional
        Layers whose attention stays exact (known from llama.cpp's name for
        a layer's cache, ``cache_k_l{il}``); added to the policy's.
    block_size, n_probe, sink_blocks, share, recency, importance_fraction, scoring
        Knobs over the policy's (spec §6); None: the policy's (block_size
        32, recency on).

    Returns
    -------
    str
        The settings now in force, as the backend reads them back
        (``k_blocks=32 policy=recall:n_probe=8,... dense_layers=``).

    Raises
    ------
    UnsupportedError
        A policy or knob that needs state kept beside llama.cpp's cache: an
        importance reserve (``importance_fraction`` above 0, as ``seed``
        has) or scoring from key bounds or a channel copy (``fast``,
        ``balanced``); the settings are unchanged.
    ArgumentError, ArgumentTypeError
        A value out of range or of the wrong type, named.
    """
    if _state["configure"] is None:
        raise KernelError("configure: load() the backend first (or it is a backend built "
                          "before it had settings: rebuild it)")
    base, spec_knobs = policy, {}
    if policy is not None and ":" in str(policy):
        base, spec_knobs = _parse_policy_text(policy)
    given = dict(n_probe=n_probe, sink_blocks=sink_blocks, share=share,
                 importance_fraction=importance_fraction, scoring=scoring,
                 block_size=block_size, recency=recency)
    knobs = {k: v if v is not None else spec_knobs.get(k) for k, v in given.items()}
    knobs["block_size"] = 32 if knobs["block_size"] is None else knobs["block_size"]
    knobs["recency"] = True if knobs["recency"] is None else knobs["recency"]
    k_blocks = 0 if k_blocks is None else ck.check_int("k_blocks", k_blocks, minimum=0)
    sel = stateless_selection(base, k_blocks=max(k_blocks, 1), **knobs)
    dense = set(spec_knobs.get("dense_layers", ()))
    for i, layer in enumerate(dense_layers or ()):
        dense.add(ck.check_int(f"dense_layers[{i}]", layer, minimum=0))
    why = ctypes.create_string_buffer(256)
    texts = [str(k_blocks).encode(), stateless_spec(sel).encode(),
             "+".join(map(str, sorted(dense))).encode()]
    rc = _state["configure"](*texts, why, len(why))
    if rc:   # the Python checks above refuse what the C parser does: a drift
        error = UnsupportedError if rc == lib.SA_ERR_UNSUPPORTED else ArgumentError
        raise error(f"the backend refused the settings {[t.decode() for t in texts]}: "
                    f"{why.value.decode()}")
    return settings()


def _parse_policy_text(policy):
    """(preset, knobs) of ``name:knob=value,...``: parse_policy's knobs in
    full over the preset ``name`` (else ``seed``), and ``block_size``, a
    knob of this path's text that parse_policy's callers take as an
    argument of its own."""
    name, _, rest = policy.strip().partition(":")
    items = [item for item in rest.split(",") if item]
    sizes = [item.partition("=")[2] for item in items if item.partition("=")[0] == "block_size"]
    others = ",".join(item for item in items if item.partition("=")[0] != "block_size")
    knobs = parse_policy(f"{name}:{others}")[1] if others else \
        dict(POLICIES[name] if name in POLICIES else POLICIES["seed"])
    if sizes:
        try:
            knobs["block_size"] = int(sizes[-1])
        except ValueError:
            raise ArgumentError(f"policy {name}: block_size={sizes[-1]!r} is not a valid "
                                "block_size") from None
    return (name if name in POLICIES else "seed"), knobs


def settings():
    """The loaded backend's settings as text, as :func:`configure` returns
    them (None before :func:`load`)."""
    if _state["text"] is None:
        return None
    buf = ctypes.create_string_buffer(1024)
    _state["text"](buf, len(buf))
    return buf.value.decode()


def calls():
    """How many attention nodes the backend has computed since it was
    loaded (None before :func:`load`): how a test tells that llama.cpp
    really handed them over."""
    return _state["calls"]() if _state["calls"] else None


def sparse_calls():
    """Of :func:`calls`, the attention nodes whose rows had blocks chosen
    (decode steps of the layers not kept dense, while ``k_blocks`` > 0;
    None before :func:`load`)."""
    return _state["sparse_calls"]() if _state["sparse_calls"] else None
