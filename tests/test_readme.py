"""README.md tells the truth: its knob table is the configuration's own (every knob, its `options=` key, default and
meaning, row for row), every ``MIRAGE_*`` name it mentions exists, its table of reasons is the report's, and the
files, links, markers and console script it names exist."""
import os
import re

import pytest

from torch_mirage import config
from torch_mirage.report import Reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as _f:
    README = _f.read()

_KNOB_ROW = re.compile(r"^\| `(MIRAGE_[A-Z0-9_]+)` \|.*\|$", re.M)


def knob_rows(text: str) -> dict[str, str]:
    """Variable -> its whole table row, for every knob row in ``text``."""
    return {m.group(1): m.group(0) for m in _KNOB_ROW.finditer(text)}


def knob_table_problems(readme: str, described: str) -> list[str]:
    """How README's knob table differs from :func:`config.describe` (empty: it does not)."""
    documented, declared = knob_rows(readme), knob_rows(described)
    problems = [f"{v} is a knob but README's table lacks it" for v in declared if v not in documented]
    problems += [f"README documents {v}, which is no knob" for v in documented if v not in declared]
    problems += [f"README's row for {v} differs from the config's:\n  README: {documented[v]}\n  config: {row}"
                 for v, row in declared.items() if v in documented and documented[v] != row]
    return problems


def test_the_knob_table_is_the_configs_own():
    problems = knob_table_problems(README, config.describe())
    assert not problems, "\n".join(problems) + "\n(paste the table `python -m torch_mirage config` prints)"


def test_the_comparison_catches_a_wrong_default_a_missing_and_an_unknown_knob():
    described = config.describe()
    stitch = knob_rows(described)["MIRAGE_STITCH"]
    wrong_default = described.replace(stitch, stitch.replace("`True`", "`False`"))
    assert any("MIRAGE_STITCH differs" in p for p in knob_table_problems(wrong_default, described))
    wrong_meaning = described.replace(stitch, stitch.replace("AStitch", "BStitch"))
    assert any("MIRAGE_STITCH differs" in p for p in knob_table_problems(wrong_meaning, described))
    missing = described.replace(stitch + "\n", "")
    assert knob_table_problems(missing, described) == ["MIRAGE_STITCH is a knob but README's table lacks it"]
    extra = described + "\n| `MIRAGE_TURBO` | `turbo` | `True` | Faster. |"
    assert knob_table_problems(extra, described) == ["README documents MIRAGE_TURBO, which is no knob"]


def test_every_mirage_variable_it_names_exists():
    knobs = {config.env_name(name) for name in config.Config.__dataclass_fields__}
    named = set(re.findall(r"MIRAGE_[A-Z0-9_]*[A-Z0-9]", README))
    unknown = named - knobs - set(config.NON_KNOB_VARIABLES)
    assert not unknown, f"README names {sorted(unknown)}: neither knobs nor config.NON_KNOB_VARIABLES"
    for variable in ("MIRAGE_UPDATE_GOLDEN", "MIRAGE_BUILD_CSRC", "MIRAGE_LLM_FULL"):   # the ones for people
        assert variable in named, f"README does not say what {variable} does"


def test_the_reasons_table_is_the_reports():
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|`]+) \|$", README, re.M))
    assert rows == {r.name: r.value for r in Reason}


def test_local_links_and_named_files_exist():
    links = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if not re.match(r"[a-z]+://", t)]
    paths = re.findall(r"`((?:torch_mirage|tests|benchmarks|csrc)/[\w./-]*\w)`", README)
    assert links and paths
    missing = [p for p in links + paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README points at files that do not exist: {missing}"


def test_markers_console_script_and_extras_it_names_are_declared():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    markers = {m.split(":")[0] for m in project["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"slow", "gpu"} <= markers and '-m "not slow"' in README and "`gpu`" in README
    assert project["project"]["scripts"]["torch-mirage"] == "torch_mirage.__main__:main" and "`torch-mirage`" in README
    for extra in re.findall(r'-e "\.\[(\w+)\]"', README):
        assert extra in project["project"]["optional-dependencies"], extra
    assert "<!-- test-command -->" in README and "<!-- /test-command -->" in README   # what .ci/run runs
