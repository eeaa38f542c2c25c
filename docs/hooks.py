"""mkdocs hooks (mkdocs.yml ``hooks:``): run in the ``mkdocs build``/``serve`` process.

- The home page is README.md: ``docs/index.md`` is a placeholder whose text
  this replaces with the README's, its links into ``docs/`` made relative to
  the page, so the landing page's facts live in one file.
- The changelog page's snippet (``--8<-- "CHANGELOG.md"``) is read from the
  repository's root wherever mkdocs runs from.
- A generated page that is not what its generator writes now fails the build:
  the magic reference (docs/magic_reference.py, from the magics' parsers),
  the errors, extras and environment variables (docs/api_reference.py, from
  the code and pyproject.toml) and the set-up figures (docs/figures.py, from
  docs/figures.json).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent


def doc_script(name: str) -> Any:
    """One of docs/'s generators (a script, not a package module), loaded as a module."""
    spec = importlib.util.spec_from_file_location(f"xla_magic_docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_as_home_page() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")


def on_config(config: Any) -> Any:
    config.mdx_configs.setdefault("pymdownx.snippets", {})["base_path"] = [str(ROOT)]
    return config


def on_pre_build(config: Any) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's xla_magic, not an installed one
    for name in ("magic_reference", "api_reference", "figures"):
        stale = doc_script(name).stale()
        if stale:
            raise PluginError(stale)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == "index.md":
        return readme_as_home_page()
    return markdown
