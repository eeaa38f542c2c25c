"""An error's troubleshooting entry, readable in the notebook: ``%xla_help ID``. Runs in the kernel.

Runs in the kernel (and in ranks, through notebook/strategy.py). A message that has
an entry ends with ``see(ID)``, which names the magic that shows it; each ID is
the ``<a id>`` of an entry in docs/troubleshooting.md, the one home of the
entries' text. The wheel carries that page as ``xla_magic/troubleshooting.md``
(pyproject.toml's force-include), so ``%xla_help`` works on Colab and Kaggle,
where there is no checkout; in a checkout it reads ``docs/`` directly.
tests/test_docs.py checks that every ID passed to ``see`` is an entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


_HERE = Path(__file__).resolve().parent
# The wheel's copy first, then a checkout's page.
PAGES = (_HERE.parent / "troubleshooting.md", _HERE.parent.parent / "docs" / "troubleshooting.md")

# An entry: <a id="ID"></a>, a blank line, ## `message`; or ## `message` ... {#ID}. Its text runs to the next entry.
_ENTRY = re.compile(r'^(?:<a id="(?P<id>[a-z0-9-]+)"></a>\n\n)?## (?P<heading>.+?)(?: \{#(?P<id2>[a-z0-9-]+)\})?$',
                    re.MULTILINE)
_LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


@dataclass(frozen=True)
class Entry:
    id: str
    message: str  # the heading: the error message, as the user sees it
    body: str  # the page's Markdown under the heading

    def markdown(self) -> str:
        return f"**{self.message}**\n\n{_local_links(self.body, markdown=True)}"

    def text(self) -> str:
        return f"{self.message}\n\n{_local_links(self.body, markdown=False)}"


def _local_links(body: str, markdown: bool) -> str:
    """The page's links, made to work in a notebook: another entry by its magic, a page by its name."""

    def replace(match: re.Match[str]) -> str:
        words, target = match.group(1), match.group(2)
        if target.startswith("#"):
            return f"{words} (`%xla_help {target[1:]}`)" if markdown else f"{words} (%xla_help {target[1:]})"
        if "://" in target:
            return match.group(0) if markdown else f"{words} ({target})"
        return f"{words} (the documentation's {target.split('#')[0].removesuffix('.md')} page)"

    return _LINK.sub(replace, body).strip()


def page_text() -> str | None:
    for path in PAGES:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def entries(text: str | None = None) -> dict[str, Entry]:
    """ID -> entry, in the page's order."""
    text = page_text() if text is None else text
    if text is None:
        return {}
    found: dict[str, Entry] = {}
    matches = list(_ENTRY.finditer(text))
    for match, following in zip(matches, matches[1:] + [None]):
        entry_id = match.group("id") or match.group("id2")
        if entry_id is None:
            continue
        end = following.start() if following is not None else len(text)
        heading = match.group("heading").strip()
        message = heading[1:-1] if heading.startswith("`") and heading.endswith("`") else heading.replace("`", "")
        found[entry_id] = Entry(entry_id, message, text[match.end() : end])
    return found
