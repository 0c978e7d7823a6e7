"""The `sparse-attn` command and what a new user meets first: the
subcommands answer --help, `info` tells what runs, and importing the package
from a source folder without a built core says what to do."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sparse_attn as sa
from sparse_attn import cli

ROOT = Path(__file__).resolve().parent.parent


def test_every_subcommand_answers_help(capsys):
    for cmd in (["bench"], ["kernels"], ["eval"], ["info"]):
        with pytest.raises(SystemExit) as e:
            cli.main(cmd + ["--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert f"sparse-attn {cmd[0]}" in out
    assert cli.main(["--help"]) == 0
    assert "sparse-attn bench" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown subcommand 'frobnicate'" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_info_tells_the_isa_threads_caches_and_build(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"ISA in use:  {sa.isa()}" in out and sa.__version__ in out
    assert "threads:" in out and "caches:" in out and "built with:" in out
    assert cli.main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["isa"] == sa.isa() and facts["available_isas"] == sa.available_isas()
    assert facts["threads"] >= 1 and "-O3" in facts["build"]


def test_the_console_script_and_python_m_forms_run():
    exe = shutil.which("sparse-attn")
    forms = [[sys.executable, "-m", "sparse_attn", "info"]]
    if exe and Path(exe).resolve().parent == Path(sys.executable).resolve().parent:
        forms.append([exe, "info"])
    for args in forms:
        res = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
        assert "ISA in use" in res.stdout


def test_importing_from_a_source_folder_without_the_core_says_what_to_do(tmp_path):
    """Python run in the root of a checkout without a built core (after
    `pip install .`, which builds outside the tree) finds the source folder
    first: `import sparse_attn` must end on one line that says what to do,
    not on a bare ModuleNotFoundError.  .ci/run checks the same from a fresh
    clone's root."""
    shutil.copytree(ROOT / "sparse_attn", tmp_path / "sparse_attn",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "build_ffi.py").write_text("")
    # an editable install's finder would map the name back to this checkout
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not "
            "getattr(f, '__module__', '').startswith('__editable__')]; import sparse_attn")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: you are importing sparse_attn from its source folder")
    assert "pip install -e ." in last
    assert "During handling" not in res.stderr


def test_a_closed_pipe_ends_quietly():
    """`sparse-attn info | head -1`: the reader leaves early; the command
    stops with the shell's SIGPIPE status and no traceback.  The read end is
    closed before the child has imported anything, so every write fails."""
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "import sys; from sparse_attn import cli; "
                          "sys.exit(cli.main(['info']))"],
                         stdout=w, stderr=subprocess.PIPE, cwd="/")
    os.close(w)
    os.close(r)
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "Traceback" not in err, err
    assert p.returncode == 141
