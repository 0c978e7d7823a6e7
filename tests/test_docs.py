"""The examples in the docstrings and the README run as written."""
import doctest
import pathlib
import re

import pytest

import sparse_attn
import sparse_attn.attention
import sparse_attn.cache
import sparse_attn.q8

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", [sparse_attn.attention, sparse_attn.q8, sparse_attn.cache])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_readme_python_example_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
