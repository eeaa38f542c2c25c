"""The wheel: built from this checkout, installed into a clean virtual environment.

Runs pip and a fresh interpreter as subprocesses. The clean environment has no
system site-packages and gets only the wheel's own requirements (from the
package index), which is what a Colab or Kaggle user installs next to the
image's torch: the extension must load there, register its magics, import
neither torch nor torch_xla, and say what to install when a cell needs them.
A second environment holds Colab's pins (scripts/stacks/colab.txt): there
installing the wheel, with or without ``--no-deps``, must change nothing and
leave ``pip check`` with nothing to say about xla_magic.

The release's files: ``python -m build`` writes the sdist and a wheel built
from it, both pass ``twine check``; a clean virtual environment builds a wheel
from the sdist alone. That wheel, installed with its ``local`` extra into an
environment that has only what ``pip install ".[local]"`` brings and a kernel,
runs the quickstart top to bottom on the CPU simulation: its ``%%xla_spawn``
cells run, the training cell draws its loss chart, and the cells that need
what the install does not bring (Lightning) skip with a one-line note.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import subprocess
import sys
import tarfile
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


# A clean environment sees no checkout: not through PYTHONPATH either.
CLEAN_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def run(command: list[str], cwd: Path) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=CLEAN_ENV)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel .``: the same build that ``pip install .`` makes."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], cwd=out)
    (built,) = out.glob("xla_magic-*.whl")
    return built


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> dict[str, Path]:
    """``python -m build``: the sdist, and the wheel it builds from the sdist."""
    out = tmp_path_factory.mktemp("release")
    run([sys.executable, "-m", "build", "-o", str(out), str(ROOT)], cwd=out)
    (sdist,) = out.glob("xla_magic-*.tar.gz")
    (wheel,) = out.glob("xla_magic-*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def wheel_from_sdist(release, tmp_path_factory) -> Path:
    """The wheel that a clean virtual environment (pip only, no checkout) builds from the sdist."""
    where = tmp_path_factory.mktemp("from-sdist")
    run([sys.executable, "-m", "venv", str(where / "venv")], cwd=where)
    run([str(where / "venv" / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(where),
         str(release["sdist"])], cwd=where)
    (built,) = where.glob("xla_magic-*.whl")
    return built


def uv() -> tuple[str, dict[str, str]]:
    """The uv that scripts/setup-venv installs, and its package cache: a venv with torch in seconds."""
    cache = Path(os.environ.get("XLA_MAGIC_CACHE", Path.home() / ".cache" / "xla_magic"))
    binary = cache / "uv" / "bin" / "uv"
    if not binary.exists():
        pytest.skip(f"{binary} is missing: scripts/setup-venv installs it")
    env = {**CLEAN_ENV, "UV_CACHE_DIR": str(cache / "uv-cache"), "UV_LINK_MODE": "hardlink", "UV_NO_PROGRESS": "1"}
    return str(binary), env


@pytest.fixture(scope="module")
def local_venv(wheel_from_sdist) -> Path:
    """A venv with only the sdist's wheel and its ``local`` extra (torch, torch_xla): the README's
    ``pip install ".[local]"``, plus ipykernel and nbclient to run a notebook in it.

    Made once, outside the clone, and kept: torch's first imports there write
    its bytecode, which a venv made afresh would compile again on every run.
    The wheel is installed anew each time.
    """
    binary, env = uv()
    venv = Path(env["UV_CACHE_DIR"]).parent / "venv-local-only"
    commands = [] if (venv / "bin" / "python").exists() else [[binary, "venv", "-q", "--python", sys.executable, str(venv)]]
    commands.append([binary, "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                     "--reinstall-package", "xla-magic", f"{wheel_from_sdist}[local]", "ipykernel", "nbclient"])
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run making or updating it at once
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
            assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return venv


def source_version() -> str:
    """``__version__`` as xla_magic/__init__.py writes it: the one place the version lives."""
    tree = ast.parse((ROOT / "xla_magic" / "__init__.py").read_text())
    (value,) = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [target.id for target in node.targets if isinstance(target, ast.Name)] == ["__version__"]]
    return value


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
        # %xla_help's text where there is no checkout (Colab, Kaggle): the troubleshooting page itself
        assert archive.read("xla_magic/troubleshooting.md") == (ROOT / "docs" / "troubleshooting.md").read_bytes()
    package = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "xla_magic").rglob("*.py"))
    assert sorted(n for n in names if n.endswith(".py")) == package
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "benchmarks/"))]

    requires = metadata(wheel).get_all("Requires-Dist")
    plain = {requirement_name(r) for r in requires if "extra ==" not in r}
    assert plain == KERNEL_SIDE_REQUIREMENTS
    local = {requirement_name(r) for r in requires if "extra == 'local'" in r or 'extra == "local"' in r}
    assert local == {"torch", "torch-xla"}
    assert metadata(wheel)["Version"] == source_version()


def test_sdist_and_wheel_pass_twine_check_and_carry_the_one_version(release):
    assert release["sdist"].name == f"xla_magic-{source_version()}.tar.gz"
    assert release["wheel"].name == f"xla_magic-{source_version()}-py3-none-any.whl"
    assert metadata(release["wheel"])["Version"] == source_version()
    checked = run([sys.executable, "-m", "twine", "check", "--strict", str(release["sdist"]), str(release["wheel"])],
                  cwd=release["sdist"].parent)
    assert checked.count("PASSED") == 2, checked
    with tarfile.open(release["sdist"]) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"CHANGELOG.md", "README.md", "pyproject.toml", "xla_magic/__init__.py"} <= names


def test_the_sdist_builds_in_a_clean_venv_the_same_wheel(wheel, release, wheel_from_sdist):
    def contents(built: Path) -> list[str]:
        with zipfile.ZipFile(built) as archive:
            return sorted(archive.namelist())

    assert wheel_from_sdist.name == release["wheel"].name
    assert contents(wheel_from_sdist) == contents(release["wheel"]) == contents(wheel)


# Runs in the venv of the local extra: the quickstart as a user's Jupyter runs it there, then a check cell.
QUICKSTART = r"""
import sys
import nbformat
from nbclient import NotebookClient

notebook = nbformat.read(sys.argv[1], as_version=4)
notebook.cells.append(nbformat.v4.new_code_cell(
    "import importlib.util, sys, xla_magic\n"
    "print('WHERE', sys.executable, xla_magic.__file__, importlib.util.find_spec('matplotlib'))"
))
NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(notebook, sys.argv[1])
"""


def test_the_sdists_wheel_runs_the_quickstart_where_the_local_install_puts_a_user(local_venv, tmp_path):
    import jupytext
    import nbformat

    path = tmp_path / "quickstart.ipynb"
    nbformat.write(jupytext.read(ROOT / "notebooks" / "quickstart.py"), path)
    run([str(local_venv / "bin" / "python"), "-c", QUICKSTART, str(path), str(tmp_path)], cwd=tmp_path)
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]

    def shown(cell) -> str:
        return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")

    word, kernel, package, matplotlib = shown(code[-1]).split()
    assert word == "WHERE" and kernel.startswith(str(local_venv)) and package.startswith(str(local_venv))
    assert matplotlib == "None"  # the local extra brings none
    for cell in code:
        if "raises-exception" not in cell.metadata.get("tags", []):
            errors = [f"{out.ename}: {out.evalue}" for out in cell.outputs if out.output_type == "error"]
            assert not errors, f"cell failed: {cell.source[:80]!r}: {errors}"
    (hello,) = [cell for cell in code if "hello from rank" in cell.source]  # %%xla_spawn cells run, from the wheel
    assert all(f"[rank {rank}] hello from rank {rank} of 8, on xla:0" in shown(hello) for rank in range(8))
    assert any("torch_xla imported in this kernel: False" in shown(cell) for cell in code)
    (train,) = [cell for cell in code if "xm.optimizer_step(optimizer)" in cell.source]
    # Its loss chart needs nothing the local extra lacks: xla_magic draws the SVG itself.
    assert any('class="xla-metrics"' in out.get("data", {}).get("text/html", "") for out in train.outputs)
    assert any("4 ranks, all with the same weights: True" in shown(cell) for cell in code)  # trained all the same
    lightning = [cell for cell in code if cell.source.startswith("%%needs lightning")]
    assert len(lightning) == 3
    for cell in lightning:
        assert shown(cell) == ("skipped: this cell needs lightning, which is not installed here "
                               "(pip install lightning)\n")
