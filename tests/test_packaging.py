"""The wheel: built from this checkout, installed into a clean virtual environment.

Runs pip and a fresh interpreter as subprocesses. The clean environment has no
system site-packages and gets only the wheel's own requirements (from the
package index), which is what a Colab or Kaggle user installs next to the
image's torch: the extension must load there, register its magics, import
neither torch nor torch_xla, and say what to install when a cell needs them.
A second environment holds Colab's pins (scripts/stacks/colab.txt): there
installing the wheel, with or without ``--no-deps``, must change nothing and
leave ``pip check`` with nothing to say about xla_magic.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SIDE_REQUIREMENTS = {"ipython", "ipywidgets", "cloudpickle"}

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

# Runs inside the clean environment; prints what it found as JSON.
PROBE = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "xla_magic")
magics = shell.magics_manager.magics
found = {
    "xla_magics": sorted(
        name for kind in ("line", "cell") for name, bound in magics[kind].items()
        if getattr(getattr(bound, "__func__", bound), "__module__", "").startswith("xla_magic")
    ),
    "imported_after_load": sorted(
        name for name in ("torch", "torch_xla", "xla_magic.launcher") if name in sys.modules
    ),
    "package_file": sys.modules["xla_magic"].__file__,
}
try:
    shell.run_cell_magic("xla_spawn", "--devices 1 --backend cpu", "rank")
    found["spawn_error"] = None
except Exception as exc:
    found["spawn_error"] = f"{type(exc).__name__}: {exc}"
found["imported_after_spawn"] = sorted(name for name in ("torch", "torch_xla") if name in sys.modules)
shell.run_line_magic("unload_ext", "xla_magic")
print("PROBE " + json.dumps(found))
"""


def run(command: list[str], cwd: Path) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel .``: the same build that ``pip install .`` makes."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], cwd=out)
    (built,) = out.glob("xla_magic-*.whl")
    return built


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(archive.read(name).decode())


def requirement_name(requirement: str) -> str:
    for stop in "<>=!~;[ ":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower().replace("_", "-")


def test_wheel_holds_the_package_and_only_kernel_side_requirements(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    package = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "xla_magic").rglob("*.py"))
    assert sorted(n for n in names if n.endswith(".py")) == package
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "benchmarks/"))]

    requires = metadata(wheel).get_all("Requires-Dist")
    plain = {requirement_name(r) for r in requires if "extra ==" not in r}
    assert plain == KERNEL_SIDE_REQUIREMENTS
    local = {requirement_name(r) for r in requires if "extra == 'local'" in r or 'extra == "local"' in r}
    assert local == {"torch", "torch-xla"}


def test_wheel_loads_in_a_clean_environment(wheel, tmp_path, ip):
    venv = tmp_path / "clean"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", str(wheel)], cwd=tmp_path)

    installed = {
        requirement_name(line.split("==")[0])
        for line in run([python, "-m", "pip", "freeze"], cwd=tmp_path).splitlines()
    }
    assert "xla-magic" in installed
    assert not installed & {"torch", "torch-xla", "jax", "tensorflow"}

    output = run([python, "-c", PROBE], cwd=tmp_path)  # cwd: not the checkout, so the wheel is what loads
    found = json.loads(output.split("PROBE ", 1)[1])
    assert found["package_file"].startswith(str(venv))
    expected = sorted(
        name for kind in ("line", "cell") for name, bound in ip.magics_manager.magics[kind].items()
        if getattr(getattr(bound, "__func__", bound), "__module__", "").startswith("xla_magic")
    )
    assert "xla_spawn" in found["xla_magics"]
    assert found["xla_magics"] == expected
    assert found["imported_after_load"] == []
    # Without torch_xla a cell cannot run; the error says what to install.
    assert found["spawn_error"] and "torch_xla" in found["spawn_error"]
    assert "xla_magic[local]" in found["spawn_error"]
    assert found["imported_after_spawn"] == []


def colab_kernel_side_pins() -> list[str]:
    """Colab's pins from scripts/stacks/colab.txt, without torch/torch_xla (the wheel never touches those)."""
    lines = (ROOT / "scripts" / "stacks" / "colab.txt").read_text().splitlines()
    pins = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return [pin for pin in pins if requirement_name(pin) not in {"torch", "torch-xla"}]


def freeze(python: str, cwd: Path) -> set[str]:
    lines = run([python, "-m", "pip", "freeze", "--all"], cwd=cwd).splitlines()
    return {line for line in lines if not requirement_name(line).startswith("xla-magic")}


def complaints_about_us(python: str, cwd: Path) -> list[str]:
    done = subprocess.run([python, "-m", "pip", "check"], cwd=cwd, capture_output=True, text=True)
    return [line for line in (done.stdout + done.stderr).splitlines() if "xla" in line.lower()]


@pytest.mark.parametrize("no_deps", [True, False], ids=["--no-deps", "with-deps"])
def test_installing_on_colabs_pins_changes_nothing(wheel, tmp_path, no_deps):
    venv = tmp_path / "colab"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    pins = colab_kernel_side_pins()
    assert "ipython==7.34.0" in pins and "ipywidgets==7.7.1" in pins
    run([python, "-m", "pip", "install", "-q", *pins], cwd=tmp_path)
    before = freeze(python, tmp_path)

    run([python, "-m", "pip", "install", "-q", *(["--no-deps"] if no_deps else []), str(wheel)], cwd=tmp_path)
    assert freeze(python, tmp_path) == before
    assert any(requirement_name(line) == "xla-magic" for line in run([python, "-m", "pip", "freeze"], cwd=tmp_path).splitlines())
    assert complaints_about_us(python, tmp_path) == []
