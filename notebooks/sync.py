"""Writes each notebook from its source, and runs the quickstart to keep its outputs. Runs as a script, by hand.

    python notebooks/sync.py               # write all three; run the quickstart to keep its outputs
    python notebooks/sync.py --no-execute  # write them without running anything (outputs kept where cells are unchanged)

Each notebook's source is a jupytext percent-format script beside it
(``quickstart.py`` for ``quickstart.ipynb``): a reviewer reads Python, and
Jupyter with jupytext installed opens either file as the same notebook, paired
(``jupytext --sync`` also updates one from the other). tests/test_notebooks.py
checks that each committed ``.ipynb`` is what its source says.

Cell tags the tests read:
- ``install``: installs packages; skipped where the package is already installed.
- ``needs-tpu``: only meaningful on a TPU; skipped on the CPU simulation.
- ``raises-exception``: the cell shows an error on purpose (nbclient's own tag).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jupytext
import nbformat
from jupytext.combine import combine_inputs_with_outputs
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("quickstart", "colab_tpu", "kaggle_tpu")
EXECUTED = ("quickstart",)  # the TPU notebooks cannot run here: they keep no outputs


def from_source(name: str) -> nbformat.NotebookNode:
    """The notebook that ``notebooks/NAME.py`` describes, with stable cell ids (a rewrite changes only what changed)."""
    notebook = jupytext.read(HERE / f"{name}.py")
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index:02d}"
    return notebook


def execute(notebook: nbformat.NotebookNode, timeout: int = 600, **env: str) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel of this environment, in notebooks/, as a user's Jupyter would."""
    client = NotebookClient(
        notebook, timeout=timeout, kernel_name="python3", record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    )
    client.execute(env={**os.environ, **env})
    return notebook


def write(name: str, run: bool) -> Path:
    notebook = from_source(name)
    path = HERE / f"{name}.ipynb"
    if run and name in EXECUTED:
        execute(notebook)
    elif path.exists():
        notebook = combine_inputs_with_outputs(notebook, nbformat.read(path, as_version=4))
    nbformat.validate(notebook)
    jupytext.write(notebook, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="run nothing (outputs of unchanged cells stay)")
    args = parser.parse_args(argv)
    for name in NOTEBOOKS:
        print("wrote", write(name, run=not args.no_execute), file=sys.stderr)


if __name__ == "__main__":
    main()
