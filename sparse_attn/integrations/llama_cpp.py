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
model, run on llama.cpp's CPU backend as before.  Attention is exact for
now: the same text as llama.cpp's own flash attention within float
rounding (llama.cpp's CPU path rounds the query to f16 and adds V in f16;
this one computes in float32).  Threads: ``SPARSE_ATTN_NUM_THREADS``, else
the context's ``n_threads`` (``n_threads_batch`` for prompts).

llama.cpp's own tools take the same file without Python:
``GGML_BACKEND_PATH=/path/libsparse_attn_ggml.so llama-cli -fa on ...`` (a
llama.cpp built with ``GGML_BACKEND_DL=ON``).  Flash attention must be on
explicitly: llama.cpp's ``auto`` finds the attention nodes on a device other
than their layer's and turns flash attention off.
"""
import ctypes
import os
from pathlib import Path

from ..errors import ArgumentError, KernelError

#: The name the backend registers with ggml (ggml_backend_reg_by_name).
REGISTRY_NAME = b"sparse_attn"
#: Where scripts/build-llama-backend.sh puts the backend by default, in a
#: checkout of the project.
_CHECKOUT_BUILD = Path(__file__).resolve().parents[2] / "build" / "llama-backend" / \
    "libsparse_attn_ggml.so"

_state = {"reg": None, "path": None, "calls": None}


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


def load(plugin_path=None):
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
        address = lib.ggml_backend_reg_get_proc_address(_state["reg"], b"sa_ggml_calls")
        _state["calls"] = ctypes.CFUNCTYPE(ctypes.c_longlong)(address) if address else None
    return _state["path"]


def calls():
    """How many attention nodes the backend has computed since it was
    loaded (None before :func:`load`): how a test tells that llama.cpp
    really handed them over."""
    return _state["calls"]() if _state["calls"] else None
