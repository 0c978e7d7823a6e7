"""sparse_attn.integrations.llama_cpp.load() says what is missing, with or
without llama-cpp-python installed (tests/test_llama_cpp.py runs it with
llama.cpp)."""
import sys

import pytest

import sparse_attn as sa
import sparse_attn.integrations.llama_cpp as sal


class _EmptyRegistry:
    """A libggml in which the backend is not registered."""

    @staticmethod
    def ggml_backend_reg_by_name(name):
        return None


def test_without_llama_cpp_python_it_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # import llama_cpp fails
    monkeypatch.setitem(sal._state, "reg", None)
    with pytest.raises(ImportError, match="needs llama-cpp-python"):
        sal.load("anything.so")


def test_a_missing_backend_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sal._state, "reg", None)
    monkeypatch.setattr(sal, "_libggml", lambda: _EmptyRegistry())
    monkeypatch.delenv("SPARSE_ATTN_LLAMA_BACKEND", raising=False)
    with pytest.raises(sa.ArgumentError, match="plugin_path: no ggml backend at .*missing.so"):
        sal.load(tmp_path / "missing.so")
    monkeypatch.setenv("SPARSE_ATTN_LLAMA_BACKEND", str(tmp_path / "from-env.so"))
    with pytest.raises(sa.ArgumentError, match="from-env.so"):
        sal.load()


def test_configure_before_load_says_so(monkeypatch):
    monkeypatch.setitem(sal._state, "configure", None)
    with pytest.raises(sa.KernelError, match="load\\(\\) the backend first"):
        sal.configure(32)
    monkeypatch.setitem(sal._state, "text", None)
    assert sal.settings() is None
