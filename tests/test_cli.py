"""The command line answers bad input with argparse usage errors: exit status 2, no traceback, the valid choices."""
import os
import subprocess
import sys

import pytest

from torch_mirage.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (arguments, environment, what the error line must say)
BAD = [
    (["bench", "--workloads", "nonexistent"], {}, ["--workloads", "'nonexistent'", "'gqa'", "'none'"]),
    (["bench", "--workloads", "gqa,nonexistent"], {}, ["--workloads", "'nonexistent'", "'bert_softmax'"]),
    (["bench", "--llms", "nonexistent"], {}, ["--llms", "'nonexistent'", "'llama3-8b-4l'"]),
    (["bench", "--dtype", "float8"], {}, ["--dtype", "'float8'", "'float16'", "'bfloat16'", "'float32'"]),
    (["bench", "--llm-dtype", "float8"], {}, ["--llm-dtype", "'float8'", "'bfloat16'"]),
    (["bench", "--modes", "tvm"], {}, ["--modes", "'tvm'", "'inductor'", "'mirage'"]),
    (["bench", "--batch", "-1"], {}, ["--batch", "'-1'", "positive integers"]),
    (["bench", "--batch", "abc"], {}, ["--batch", "'abc'", "positive integers"]),
    (["bench", "--batch", "1,0"], {}, ["--batch", "'0'", "positive integers"]),
    (["bench", "--repeats", "0"], {}, ["--repeats", "positive integer"]),
    (["bench", "--merge", "/nonexistent.json"], {}, ["--merge", "/nonexistent.json", "No such file"]),
    (["config", "extra"], {}, ["unrecognized arguments: extra"]),
    (["config"], {"MIRAGE_STITCH": "x"}, ["MIRAGE_STITCH='x'", "not a boolean", "1/0"]),
    (["config"], {"MIRAGE_MIN_REGION_US": "-5"}, ["MIRAGE_MIN_REGION_US='-5'", "must be >= 0"]),
    (["bench", "--quick"], {"MIRAGE_FALLBACK": "tvm"}, ["MIRAGE_FALLBACK='tvm'", "'inductor', 'eager'"]),
    (["frobnicate"], {}, ["invalid choice: 'frobnicate'", "'demo'", "'bench'", "'config'"]),
]


@pytest.mark.parametrize("argv,env,says", BAD, ids=[" ".join(a) + "".join(f" {k}" for k in e) for a, e, _ in BAD])
def test_bad_arguments_are_usage_errors(argv, env, says, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: ")
    (error_line,) = [line for line in err.splitlines() if ": error: " in line]
    for word in says:
        assert word in error_line, error_line


def test_bad_merge_file_contents(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--merge", str(bad)])
    assert info.value.code == 2 and str(bad) in capsys.readouterr().err


def test_a_failing_command_prints_one_line_unless_verbose(monkeypatch, capsys):
    import torch_mirage.__main__ as cli

    def broken(argv):
        raise RuntimeError("the demo broke")
    monkeypatch.setitem(cli._RUN, "demo", broken)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "python -m torch_mirage demo: error: RuntimeError: the demo broke (-v shows the traceback)"
    with pytest.raises(RuntimeError, match="the demo broke"):
        main(["-v", "demo"])


def test_help_and_config_succeed(capsys):
    assert main([]) == 0 and "bench" in capsys.readouterr().out
    assert main(["config"]) == 0 and "MIRAGE_STITCH" in capsys.readouterr().out


def test_usage_error_in_a_real_process():
    env = dict(os.environ, PYTHONPATH=ROOT, MIRAGE_STITCH="x")
    done = subprocess.run([sys.executable, "-m", "torch_mirage", "config"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == ("python -m torch_mirage config: error: torch_mirage config: "
                                            "MIRAGE_STITCH='x' is not a boolean (use 1/0, true/false, yes/no, on/off)")
