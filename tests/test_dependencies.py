"""pyproject.toml's dependencies are honest: each declared package is imported for the purpose its comment gives,
and the one used only where it is present (NVML) is an extra, with the code going on without it."""
import ast
import inspect
import os
import re
import sys

import pytest

import torch_mirage
from torch_mirage.analysis import device

tomllib = pytest.importorskip("tomllib")   # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(torch_mirage.__file__)

# distribution name -> the module it is imported as
MODULE = {"torch": "torch", "triton": "triton", "z3-solver": "z3", "pulp": "pulp", "tqdm": "tqdm", "numpy": "numpy",
          "nvidia-ml-py": "pynvml", "matplotlib": "matplotlib", "transformers": "transformers", "pytest": "pytest"}


def _declared() -> dict[str, list[str]]:
    """{"": core dependencies, extra: its dependencies}, as distribution names."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    groups = {"": [name(r) for r in project["dependencies"]]}
    groups.update({extra: [name(r) for r in reqs] for extra, reqs in project["optional-dependencies"].items()})
    return groups


def _imported(folder: str) -> set[str]:
    """Top-level modules imported anywhere under ``folder`` (module level, inside functions, or a test module's
    ``pytest.importorskip``)."""
    out = set()
    for where, _, files in os.walk(folder):
        for file in files:
            if file.endswith(".py"):
                with open(os.path.join(where, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        out |= {a.name.split(".")[0] for a in node.names}
                    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                        out.add(node.module.split(".")[0])
                    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip"
                          and node.args and isinstance(node.args[0], ast.Constant)):
                        out.add(node.args[0].value.split(".")[0])     # a test module that needs it
    return out


def test_every_declared_package_is_known_here():
    unknown = {d for deps in _declared().values() for d in deps} - set(MODULE)
    assert not unknown, f"add {sorted(unknown)} to MODULE with the module it is imported as"


def test_core_dependencies_are_imported_by_the_package():
    used = _imported(PACKAGE)
    missing = [d for d in _declared()[""] if MODULE[d] not in used and d != "numpy"]
    assert not missing, f"declared in pyproject.toml but imported nowhere in torch_mirage/: {missing}"


def test_numpy_is_what_tritons_interpreter_imports():
    """numpy is declared for Triton's interpreter (the CPU path), which imports it without Triton declaring it."""
    assert "numpy" in _declared()[""]
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    assert re.search(r"^import numpy\b", inspect.getsource(interpreter), re.M)


@pytest.mark.parametrize("extra,folder", [("bench", "torch_mirage/bench"), ("test", "tests")])
def test_extras_are_imported_where_they_serve(extra, folder):
    used = _imported(os.path.join(ROOT, folder))
    missing = [d for d in _declared()[extra] if MODULE[d] not in used]
    assert not missing, f"[{extra}] declares {missing}, which nothing under {folder}/ imports"


def test_nvml_is_an_extra_and_optional(monkeypatch):
    assert "nvidia-ml-py" not in _declared()[""] and "nvidia-ml-py" in _declared()["nvml"]
    assert "pynvml" in _imported(PACKAGE)
    monkeypatch.setitem(sys.modules, "pynvml", None)     # not installed: importing it raises ImportError
    assert device._nvml_figures(0) == {}
