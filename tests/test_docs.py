"""The examples in the docstrings and the README run as written; the
docs' measured tables are their JSON's, and the docs stay for users."""
import doctest
import pathlib
import re
import runpy

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
    ran = 0
    for code in blocks:
        if "(...)" in code:         # an outline with the user's own arguments to fill in
            continue
        exec(compile(code, "README.md", "exec"), {})
        ran += 1
    assert ran


def test_the_docs_tables_are_rendered_from_their_json():
    """Every table between render markers is what scripts/render-results.py
    makes of its JSON under docs/results/, and every JSON there is shown."""
    render = runpy.run_path(str(ROOT / "scripts" / "render-results.py"))
    shown = set()
    for doc in render["DOCS"]:
        text = doc.read_text()
        assert render["render_text"](text) == text, \
            f"{doc.name}: a table differs from its JSON (python scripts/render-results.py)"
        shown |= {m.group(3) for m in render["BLOCK"].finditer(text)}
    kept = {p.name for p in (ROOT / "docs" / "results").glob("*.json")}
    assert kept and kept <= shown, f"JSON under docs/results/ no table shows: {kept - shown}"


def test_the_docs_are_for_users():
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "docs" / "results.md").read_text()
    assert len(readme.splitlines()) <= 250 and len(results.splitlines()) <= 700
    assert len(re.findall(r"20[0-9][0-9]-", readme)) <= 3      # current figures, not a run log
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "../shared" not in doc.read_text(), f"{doc.name} points outside the repository"


def test_no_module_of_the_package_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "sparse_attn").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
