"""Every flag of every subcommand is checked before any work: a bad value
ends the command with exit status 2 and one argparse ``error:`` line that
names the flag, never a traceback, a run that quietly ignores the value, or
a failure after minutes of measuring (an unwritable --json)."""
import os
import subprocess
import sys
import time

import pytest

from sparse_attn import cli

# A refusal is a parse: it imports nothing heavy and loads no model, where
# the work it must come before takes minutes.  Generous for a shared machine.
REFUSAL_SECONDS = 10.0

HERE = os.path.dirname(os.path.abspath(__file__))
A_FILE = os.path.abspath(__file__)            # exists, and is not a folder
NO_FOLDER = "/nonexistent/dir"
BIG = str(2**31)                              # one past what a C int holds

# (argv, the flag the error line must name)
CASES = [
    # sparse-attn bench: the decode table
    (["bench", "--json", f"{NO_FOLDER}/x.json"], "--json"),
    (["bench", "--json", HERE], "--json"),
    (["bench", "--json", f"{A_FILE}/x.json"], "--json"),
    (["bench", "--json", ""], "--json"),
    (["bench", "--plot", f"{NO_FOLDER}/x.png"], "--plot"),
    (["bench", "--heads", "3", "--kv-heads", "2"], "--heads"),
    (["bench", "--heads", "8", "--kv-heads", "16"], "--kv-heads"),
    (["bench", "--head-dim", "33"], "--head-dim"),
    (["bench", "--head-dim", "2", "--group-size", "1"], "--head-dim"),
    (["bench", "--group-size", "7"], "--group-size"),
    (["bench", "--seed", "-1"], "--seed"),
    (["bench", "--seed", BIG], "--seed"),
    (["bench", "--configs", BIG], "--configs"),
    (["bench", "--configs", "0"], "--configs"),
    (["bench", "--configs", "sparse"], "--configs"),
    (["bench", "--configs", ""], "--configs"),
    (["bench", "--policies", ""], "--policies"),
    (["bench", "--policies", " ; "], "--policies"),
    (["bench", "--policies", "turbo"], "--policies"),
    (["bench", "--policies", "x:share=all"], "--policies"),
    (["bench", "--policies", "x:recency=maybe"], "--policies"),   # was read as "no"
    (["bench", "--lengths", "0"], "--lengths"),
    (["bench", "--lengths", "64"], "--lengths"),        # below 4 blocks of 32
    (["bench", "--lengths", "2061,x"], "--lengths"),
    (["bench", "--lengths", "2061,"], "--lengths"),
    (["bench", "--lengths", BIG], "--lengths"),
    (["bench", "--dtypes", "q4"], "--dtypes"),
    (["bench", "--dtypes", ""], "--dtypes"),
    (["bench", "--layers", "0"], "--layers"),
    (["bench", "--heads", "0"], "--heads"),
    (["bench", "--kv-heads", "-1"], "--kv-heads"),
    (["bench", "--head-dim", "0"], "--head-dim"),
    (["bench", "--block-size", "0"], "--block-size"),
    (["bench", "--block-size", BIG], "--block-size"),
    (["bench", "--n-probe", "0"], "--n-probe"),
    (["bench", "--group-size", "0"], "--group-size"),
    (["bench", "--prefill-tokens", "0"], "--prefill-tokens"),
    (["bench", "--prefill-lengths", "100"], "--prefill-lengths"),   # not among --lengths
    (["bench", "--prefill-lengths", "x"], "--prefill-lengths"),
    (["bench", "--prefill-lengths", ""], "--prefill-lengths"),
    (["bench", "--prefill-configs", "0"], "--prefill-configs"),
    (["bench", "--prefill-configs", BIG], "--prefill-configs"),
    (["bench", "--prefill-configs", ""], "--prefill-configs"),
    (["bench", "--exact-tail", "-1"], "--exact-tail"),
    (["bench", "--exact-tail", BIG], "--exact-tail"),
    (["bench", "--prefill-layers", "0"], "--prefill-layers"),
    (["bench", "--prefill-rounds", "0"], "--prefill-rounds"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--threads", BIG], "--threads"),
    (["bench", "--kernel-len", "0"], "--kernel-len"),
    (["bench", "--quick", "--layers", "x"], "--layers"),
    (["bench", "decode", "--lengths", "1"], "--lengths"),
    (["bench", "--quick", "model"], "model"),           # model's options come after it
    # sparse-attn bench kernels, and its alias sparse-attn kernels
    (["bench", "kernels", "--json", f"{NO_FOLDER}/x.json"], "--json"),
    (["kernels", "--json", f"{NO_FOLDER}/x.json"], "--json"),
    (["bench", "kernels", "--group-size", "7"], "--group-size"),
    (["bench", "kernels", "--heads", "3", "--kv-heads", "2"], "--heads"),
    (["bench", "kernels", "--kernel-len", "0"], "--kernel-len"),
    (["bench", "kernels", "--seed", "-1"], "--seed"),
    (["kernels", "--repeats", "-3"], "--repeats"),
    # sparse-attn bench model
    (["bench", "model", "--lengths", "0"], "--lengths"),
    (["bench", "model", "--lengths", "x"], "--lengths"),
    (["bench", "model", "--configs", ""], "--configs"),
    (["bench", "model", "--configs", "k=0"], "--configs"),
    (["bench", "model", "--configs", f"k={BIG}"], "--configs"),
    (["bench", "model", "--configs", "sdpa;k=32 frobnicate"], "--configs"),
    (["bench", "model", "--configs", "k=32 policy=turbo"], "--configs"),
    (["bench", "model", "--new-tokens", "1"], "--new-tokens"),
    (["bench", "model", "--prefill-rounds", "0"], "--prefill-rounds"),
    (["bench", "model", "--prefill-rounds", "x"], "--prefill-rounds"),
    (["bench", "model", "--new-tokens", BIG], "--new-tokens"),
    (["bench", "model", "--needle", "5"], "--needle"),
    (["bench", "model", "--needle", "-1"], "--needle"),
    (["bench", "model", "--depth", "1.5"], "--depth"),
    (["bench", "model", "--depth", "nan"], "--depth"),
    (["bench", "model", "--torch-threads", "0"], "--torch-threads"),
    (["bench", "model", "--torch-threads", "-1"], "--torch-threads"),
    (["bench", "model", "--threads", "0"], "--threads"),
    (["bench", "model", "--seed", "-1"], "--seed"),
    (["bench", "model", "--json", f"{NO_FOLDER}/x.json"], "--json"),
    (["bench", "model", "--plot", f"{NO_FOLDER}/x.png"], "--plot"),
    (["bench", "model", "--model", NO_FOLDER], "--model"),
    (["bench", "model", "--model", A_FILE], "--model"),
    (["bench", "model", "--gguf", "x.gguf"], "--gguf"),             # without --model
    (["bench", "model", "--model", HERE, "--gguf", "x.gguf"], "--gguf"),
    (["bench", "model", "--dtype", "float16"], "--dtype"),
    # sparse-attn eval
    (["eval", "--torch-threads", "-1"], "--torch-threads"),
    (["eval", "--torch-threads", "0"], "--torch-threads"),
    (["eval", "--threads", "0"], "--threads"),
    (["eval", "--threads", BIG], "--threads"),
    (["eval", "--json", f"{NO_FOLDER}/x.json"], "--json"),
    (["eval", "--json", HERE], "--json"),
    (["eval", "--lengths", "0"], "--lengths"),
    (["eval", "--lengths", "-5"], "--lengths"),
    (["eval", "--lengths", "1024,x"], "--lengths"),
    (["eval", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["eval", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["eval", "--depths", "1.5"], "--depths"),
    (["eval", "--depths", "0.5,nan"], "--depths"),
    (["eval", "--needles", "5"], "--needles"),
    (["eval", "--needles", "x"], "--needles"),
    (["eval", "--fillers", "poems"], "--fillers"),
    (["eval", "--fillers", ""], "--fillers"),
    (["eval", "--budgets", "0"], "--budgets"),
    (["eval", "--budgets", BIG], "--budgets"),
    (["eval", "--policies", ""], "--policies"),
    (["eval", "--policies", "turbo"], "--policies"),
    (["eval", "--policies", "seed;x:dense_layers=-1"], "--policies"),
    (["eval", "--kv-dtype", "q4"], "--kv-dtype"),
    (["eval", "--prefill", "dense"], "--prefill"),
    (["eval", "--exact-tail", "-1"], "--exact-tail"),
    (["eval", "--exact-tail", BIG], "--exact-tail"),
    (["eval", "--seed", "-1"], "--seed"),
    (["eval", "--quick", "--budgets", "0"], "--budgets"),
    (["eval", "--model", NO_FOLDER], "--model"),
    (["eval", "--gguf", "x.gguf"], "--gguf"),                       # without --model
    (["eval", "--model", HERE, "--gguf", "x.gguf"], "--gguf"),
    (["eval", "--save-model", A_FILE], "--save-model"),
    (["eval", "--save-model", f"{A_FILE}/copy"], "--save-model"),
    (["eval", "--save-model", ""], "--save-model"),
    # sparse-attn info
    (["info", "--json=yes"], "--json"),
    (["info", "--frobnicate"], "--frobnicate"),
]


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Whatever a subcommand does after its parse fails the test at once:
    a refusal must come before the floor's measurement, a kernel, a model
    load or a prompt."""
    import sparse_attn.bench as bench
    import sparse_attn.bench.model as bench_model
    import sparse_attn.eval as sa_eval

    def work(*args, **kwargs):
        raise AssertionError("the command started working: the flag was not refused")
    for module, name in ((bench, "Floor"), (bench, "run_kernels"), (bench_model, "main_model"),
                         (bench_model, "load_model"), (sa_eval, "run"),
                         (sa_eval, "load_model")):
        monkeypatch.setattr(module, name, work)


@pytest.mark.parametrize("argv, flag", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_flag_is_refused_in_one_line_before_any_work(argv, flag, capsys):
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert flag in errors[0], err
    assert elapsed < REFUSAL_SECONDS


@pytest.mark.parametrize("argv", [["eval", "--threads", "0"],
                                  ["bench", "--json", f"{NO_FOLDER}/x.json"]])
def test_the_console_command_refuses_without_a_traceback(argv):
    """The same through the command itself: status 2 from the process, no
    model loaded and no bench run first (either would outlast the timeout)."""
    res = subprocess.run([sys.executable, "-m", "sparse_attn", *argv], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "error:" in last and argv[1] in last, res.stderr


def test_good_flags_parse_to_typed_values():
    """The converters give the values the runs use, defaults included, and
    --quick fills only what was not given, however the flag was spelled."""
    from sparse_attn.bench import parse_args as bench_args
    from sparse_attn.eval import parse_args as eval_args
    a = bench_args(["--quick", "--lay", "3", "--prefill-configs", "none"])
    assert (a.lengths, a.configs, a.layers, a.repeats) == ([2061], ["dense", "32", "1"], 3, 1)
    assert a.prefill_lengths == [2061] and a.prefill_configs == []
    assert a.dtypes == ["q8", "float32"] and [name for name, _ in a.policies] == ["seed"]
    a = bench_args([])
    assert a.lengths == [2061, 4096, 8192, 32768] and a.prefill_lengths == [2061, 4096, 8192]
    assert a.configs == ["dense", "32", "16", "8", "4", "1"] and a.layers == 28
    assert a.threads >= 1 and a.json is None and a.seed == 0
    a = bench_args(["model", "--configs", "sdpa; k=8 q8", "--depth", "0"])
    assert [c["label"] for c in a.configs] == ["sdpa", "k=8 q8"] and a.lengths == [2048, 7000]
    assert a.torch_threads is None and a.depth == 0.0
    a = eval_args(["--depths", "0,1", "--torch-threads", "2", "--needles", "4"])
    assert a.depths == [0.0, 1.0] and a.torch_threads == 2 and a.needles == [4]
    assert a.lengths == [1024, 2048, 4096] and a.budgets == [1, 2, 4, 8, 16, 32]
