"""The exceptions sparse_attn raises.  Each is a subclass of one builtin
(so ``except ValueError`` still catches a bad argument) and of
:class:`SparseAttnError` (so ``except SparseAttnError`` catches all of
them)."""


class SparseAttnError(Exception):
    """Base class of every error this package raises."""


class ArgumentError(SparseAttnError, ValueError):
    """An argument has the right type but a wrong value, shape or layout."""


class ArgumentTypeError(SparseAttnError, TypeError):
    """An argument has the wrong type or dtype."""


class KernelError(SparseAttnError, RuntimeError):
    """The C core reported a failure the Python checks did not foresee."""


class UnsupportedError(SparseAttnError, NotImplementedError):
    """A model, input or setting the transformers backend (``sparse_topk``)
    does not handle; the message names the alternative.  Raised instead of
    computing something wrong."""
