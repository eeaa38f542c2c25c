"""The docs site (docs/, mkdocs.yml) and the README against the code.

The site builds strict (broken links, missing pages and stale generated pages
fail); each page's claims are checked against the code's own source of truth
(the magics' parsers, the strategy class, the known-problem table, the
layout), so the docs cannot drift. Runs in the test process, with the shared
IPython shell; only the first example starts ranks, and the build runs
mkdocs in a process of its own.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def page(name: str) -> str:
    """One page of the site, docs/NAME.md."""
    return (DOCS / f"{name}.md").read_text(encoding="utf-8")


def section(name: str, title: str) -> str:
    """A page's text under its '## title' heading, up to the next '## '."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page(name), re.MULTILINE | re.DOTALL)
    assert match, f"docs/{name}.md has no '## {title}' section"
    return match.group(1)


def doc_script(name: str):
    """One of docs/'s generators (a script, not a package module), loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return doc_script("magic_reference")


def readme_commands() -> dict[str, str]:
    """The README's `make` lines: command -> what its comment says."""
    block = re.search(r"```bash\n(.*?)```", readme(), re.DOTALL)
    assert block, "README.md has no bash block with the two commands"
    return dict(re.findall(r"^(make \w+)\s+# (.*)$", block.group(1), re.MULTILINE))


def test_the_readme_says_what_it_is_before_the_two_commands():
    text = readme()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0] == "# xla_magic" and lines[1].startswith("Run notebook cells on every TPU core")
    assert list(readme_commands()) == ["make demo", "make test"]
    before = text[: text.index("make demo   #")]
    assert len(before.splitlines()) <= 25, "the two commands belong near the top"
    assert "Linux" in before and "prctl" in before, "say that Linux is required, and why, before the commands"
    assert text.index("## What it solves") > text.index("make test   #")


def test_the_readme_says_what_each_command_costs_as_measured(figures):
    """The costs on the two command lines are docs/figures.json's (rounded as written), and make test's apt-get is said."""
    import json

    measured = json.loads(figures.FIGURES.read_text())
    commands = readme_commands()
    demo = re.search(r"\((\d+) s on a fresh machine\)", commands["make demo"])
    assert demo and int(demo.group(1)) == measured["demo_seconds"], commands["make demo"]
    test = re.search(r"about (\d+) minutes and (\d+) GiB", commands["make test"])
    assert test, commands["make test"]
    assert int(test.group(1)) == measured["test_seconds"] // 60
    assert int(test.group(2)) == round(measured["cache_bytes"] / 2**30)
    install = (ROOT / "scripts" / "install-browser").read_text(encoding="utf-8")
    assert "apt-get install" in install and "chromium" in install
    assert "apt-get" in commands["make test"] and "chromium" in commands["make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^test:\n\t@scripts/install-browser$", makefile, re.MULTILINE)


def quickstart(place: str) -> tuple[list[str], list[str]]:
    """A place's quickstart in docs/getting-started.md: its steps' commands in order, and what step 3 shows."""
    text = section("getting-started", place)
    steps = re.findall(r"^\d+\. ", text, re.MULTILINE)
    assert steps, f"docs/getting-started.md's '{place}' has no numbered steps"
    commands = [line.strip() for block in re.findall(r"^    ```bash\n(.*?)^    ```", text, re.MULTILINE | re.DOTALL)
                for line in block.splitlines() if line.strip()]
    shown = re.search(r"^    ```text\n(.*?)^    ```", text, re.MULTILINE | re.DOTALL)
    return commands, [line.strip() for line in shown.group(1).splitlines()] if shown else []


LAPTOP = ["git clone URL xla_magic", "cd xla_magic", "make demo",
          "~/.cache/xla_magic/venv/bin/jupyter lab notebooks/quickstart.ipynb"]


def test_the_laptop_quickstart_is_the_commands_the_makefile_and_readme_give():
    commands, _ = quickstart("On a Linux laptop")
    assert commands == LAPTOP
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo: setup$", makefile, re.MULTILINE)
    assert re.search(r"^VENV \?= \$\(HOME\)/\.cache/xla_magic/venv$", makefile, re.MULTILINE), (
        "step 4's ~/.cache/xla_magic/venv is the Makefile's VENV")
    assert "make demo" in readme_commands()
    assert (ROOT / "notebooks" / "quickstart.ipynb").exists()
    assert any(requirement.startswith("jupyterlab") for requirement in extras()["test"][0]), (
        "make demo's venv has the test extra; JupyterLab must be in it for step 4")


def extras():
    return doc_script("api_reference").extras()


def test_the_laptop_quickstart_followed_literally_in_a_clean_clone(tmp_path):
    """Steps 1-3 as written, in a fresh clone of this repository (its last commit): the clone's make demo makes
    its own venv (VENV points into the test's folder, never the shared one) and shows what step 3 says."""
    commands, shown = quickstart("On a Linux laptop")
    assert shown, "step 3 shows what make demo prints"
    venv = tmp_path / "venv"
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "XLA_MAGIC_VENV", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    clone, go, demo = commands[:3]
    done = subprocess.run(clone.replace("URL", str(ROOT)), shell=True, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    where = tmp_path / go.split()[1]
    done = subprocess.run(f"{demo} VENV={venv}", shell=True, cwd=where, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = [line.strip() for line in done.stdout.splitlines()]
    for line in shown:
        assert any(said.endswith(line) for said in printed), f"step 3 shows {line!r}; make demo printed {printed[-20:]}"
    # the clone's own code ran: its venv's xla_magic is the clone's, not this checkout's
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import xla_magic; print(xla_magic.__file__)"],
                           env=env, capture_output=True, text=True, cwd=tmp_path)
    assert found.stdout.strip().startswith(str(where)), found


def test_the_reference_pages_match_the_code():
    """docs/environment.md: the errors and extras as the code has them, and the XLA_MAGIC_* names the code reads."""
    assert doc_script("api_reference").stale() is None


def test_the_glossary_defines_the_words_the_pages_use():
    words = set(re.findall(r"^\| ([^|]+?) \|", page("glossary"), re.MULTILINE))
    for word in ("rank", "pool", "one-shot cell", "launcher", "tpu launch path", "kernel"):
        assert word in words, f"docs/glossary.md does not define {word!r}"


def test_each_fact_has_one_home():
    """The install table, the version pins, the fused-AdamW advice, torch_xla's 'Runtime is already initialized'
    and why --devices is 1 or all on a TPU are each written on one page only; the others link there."""
    pages = {path.name: path.read_text(encoding="utf-8") for path in DOCS.glob("*.md")}
    pages["README.md"] = readme()
    for fact in ("| where | how |", "| package | supported | lowest is | notes |", 'optim="adamw_torch"` to',
                 "Do not use the XLA device before calling xmp.spawn", "That is why `--devices` on a TPU is 1"):
        homes = [name for name, text in pages.items() if fact in text]
        assert len(homes) == 1, f"{fact!r} is written on {homes}"


def test_the_site_builds_strict_and_offline(tmp_path):
    """`make docs`'s build: any warning (a broken link or anchor, a page out of the nav, a stale
    generated page) fails it. The built pages load nothing from another host."""
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    # From another directory: nothing (the changelog's snippet included) may depend on where mkdocs runs.
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    newest = re.search(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert newest and newest.group(1) in (site / "changelog.html").read_text(encoding="utf-8")
    built = {path.name for path in site.glob("*.html")}
    assert {f"{path.stem}.html" for path in DOCS.glob("*.md")} <= built
    assert (site / "search" / "search_index.json").exists()
    for html in site.glob("*.html"):
        text = html.read_text(encoding="utf-8")
        remote = re.findall(r"<(?:link|script|img)\b[^>]*(?:href|src)=\"(?:https?:)?//[^\"]*\"", text)
        assert remote == [], f"{html.name} loads {remote}"
    assert "Run notebook cells on every TPU core" in (site / "index.html").read_text(encoding="utf-8")


def test_the_home_page_is_the_readme():
    hooks = doc_script("hooks")
    home = hooks.readme_as_home_page()
    assert "](docs/" not in home and "Run notebook cells on every TPU core" in home
    for target in re.findall(r"\]\(([^)#]+)", home):
        if "://" not in target:
            assert (DOCS / target).exists(), f"the home page links to {target}, which docs/ does not have"


def test_the_readme_is_a_landing_page():
    assert len(readme().splitlines()) <= 150
    for link in re.findall(r"\]\((docs/[^)#]+\.md)", readme()):
        assert (ROOT / link).exists()
    # contributor material lives under Development; the README only points there
    assert "make docs" in page("development") and "mkdocs serve" in page("development")
    assert "## Install" not in readme(), "the install table's one home is docs/getting-started.md"
    for place in ("on-a-linux-laptop", "on-kaggle", "on-colab", "on-a-tpu-vm"):
        assert f"docs/getting-started.md#{place}" in readme()


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for path in DOCS.glob("*.md"):
        assert re.search(rf":\s+{re.escape(path.name)}$", nav, re.MULTILINE), f"mkdocs.yml's nav lacks {path.name}"


def test_magic_reference_matches_the_magics(ip, reference):
    current = reference.section_in(page("reference"))
    assert current is not None, "docs/reference.md lost its magic-reference markers"
    assert current == reference.render(ip), (
        "docs/reference.md is stale: run python docs/magic_reference.py"
    )


def test_every_option_of_every_magic_is_in_the_reference(ip, reference):
    text = page("reference")
    magics = reference.xla_magics(ip)
    assert "xla_spawn" in magics
    for name, (prefix, function) in magics.items():
        assert f"`{prefix}{name}`" in text, f"{prefix}{name} is not documented"
        parser = getattr(function, "parser", None)
        for action in reference.options(parser) if parser else []:
            for flag in action.option_strings:
                assert f"`{flag}`" in text, f"{prefix}{name} {flag} is not documented"
            for choice in action.choices or ():
                assert f"`{choice}`" in text, f"{prefix}{name} {action.dest}={choice} is not documented"


def test_each_option_reads_as_the_magic_s_own_help_prints_it(ip, reference):
    """The page's help text for an option is what ``%%xla_spawn?`` prints (argparse's ``%%`` is one ``%``)."""
    text = " ".join(page("reference").split())
    for name, (prefix, function) in reference.xla_magics(ip).items():
        parser = getattr(function, "parser", None)
        printed = " ".join(parser.format_help().split()) if parser else ""
        for action in reference.options(parser) if parser else []:
            shown = " ".join(reference.help_of(parser, action).split())
            assert shown in printed, f"{prefix}{name} {action.dest}: {shown!r} is not what its help prints"
            assert shown.replace("|", "\\|") in text, f"{prefix}{name} {action.dest}'s help is not on the page"
    assert "%%xla_profile" not in text, "%xla_profile is a line magic"


def test_the_launch_default_is_the_one_the_code_uses(ip):
    from xla_magic.hosts.discovery import DEFAULT_TEMPLATE

    assert f"(default: '{DEFAULT_TEMPLATE}';" in page("reference")
    assert "ssh {host}`` by default" not in page("reference")


def prose(name: str) -> str:
    """A page without its fenced blocks: what the page says, not the output it quotes from a run."""
    return re.sub(r"^ *```.*?^ *```", "", page(name), flags=re.MULTILINE | re.DOTALL)


def test_defaults_written_in_prose_are_the_code_s():
    """Defaults the user pages state in words, each against the constant the code reads (the reference pages are
    generated; these are not): the hang delay, the launch template, the profile's line period, the heartbeats
    that notice a vanished controller, the simulation's device counts."""
    from xla_magic.hosts.discovery import DEFAULT_TEMPLATE
    from xla_magic.hosts.pool import HEARTBEAT_MS, MISSES
    from xla_magic.ranks.probe import CPU_SIMULATION_MAX
    from xla_magic.runs.watch import HANG_AFTER

    said = re.search(r"`--hang-after SECONDS` on .*?\(default (\d+(?:\.\d+)?) s", prose("stuck-cells"), re.DOTALL)
    assert said and float(said.group(1)) == HANG_AFTER, said
    assert f"`--launch`, default\n  `{DEFAULT_TEMPLATE}`" in page("several-hosts")
    period = int(doc_script("api_reference").default_in_code("XLA_MAGIC_PROFILE_LINES"))
    for name in ("profiling", "several-hosts"):
        for every, after in re.findall(r"every (\d+) ms(.{0,30})", " ".join(prose(name).split())):
            assert int(every) == period or "the period then" in after or "the period when" in after, (
                f"docs/{name}.md says the lines are sampled every {every} ms; the default is {period} ms")
    assert f"sampled every {period} ms" in " ".join(prose("profiling").split())
    heartbeats = f"after {MISSES} missed heartbeats, one a second" if HEARTBEAT_MS == 1000 else None
    for name in ("several-hosts", "several-hosts-security"):
        assert heartbeats and heartbeats in " ".join(prose(name).split()), f"docs/{name}.md: {MISSES} x {HEARTBEAT_MS} ms"
    assert f"| `--devices` | 1 to {CPU_SIMULATION_MAX} (default 8) |" in page("simulation")


def rank_strategy_members() -> set[str]:
    """Public attributes of the rank's strategy, read from its source (no import)."""
    tree = ast.parse((ROOT / "xla_magic" / "launcher" / "strategy.py").read_text(encoding="utf-8"))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "RankStrategy")
    members = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            members.add(node.name)
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for target in ast.walk(node):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "self" and isinstance(target.ctx, ast.Store):
                        members.add(target.attr)
    return {name for name in members if not name.startswith("_")}


def documented_strategy_members() -> set[str]:
    """The names in docs/cells.md's table headed | `strategy.` |."""
    text = page("cells")
    table = re.search(r"^\| `strategy\.` \|.*?\n\n", text, re.MULTILINE | re.DOTALL)
    assert table, "docs/cells.md has no | `strategy.` | table"
    return set(re.findall(r"^\| `(\w+)[(`]", table.group(0), re.MULTILINE))


def test_strategy_table_matches_the_rank_strategy():
    code, documented = rank_strategy_members(), documented_strategy_members()
    assert code - documented == set(), f"add these to docs/cells.md's strategy table: {sorted(code - documented)}"
    assert documented - code == set(), f"docs/cells.md documents strategy members that do not exist: {sorted(documented - code)}"


def test_in_cell_names_are_documented():
    text = page("cells")
    for name in ("rank", "world_size", "device", "strategy"):
        assert f"| `{name}` |" in text


# An entry: its stable anchor (an HTML id, which GitHub and the site both honour), then its heading.
TROUBLESHOOTING_ENTRY = re.compile(r'^(?:<a id="([a-z0-9-]+)"></a>\n\n)?## `([^`]+)`$', re.MULTILINE)


def troubleshooting_entries() -> list[tuple[str, str]]:
    """(message, id) of each entry: the heading ## `message`, and the <a id="id"></a> just above it."""
    return [(message, anchor) for anchor, message in TROUBLESHOOTING_ENTRY.findall(page("troubleshooting"))]


def troubleshooting_messages() -> list[str]:
    """Headings of the form ## `message`: an error message a user may see."""
    return [message for message, _ in troubleshooting_entries()]


def test_each_troubleshooting_entry_has_a_stable_id():
    entries = troubleshooting_entries()
    ids = [anchor for _, anchor in entries]
    assert all(ids), f"entries without an <a id>: {[message for message, anchor in entries if not anchor]}"
    assert len(set(ids)) == len(ids), "two troubleshooting entries share an id"


# Messages of other tools, listed because users meet them before they switch.
OTHER_TOOLS = ("Can't get attribute '_mp_fn'", "Unsupported nprocs")


def source_text() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted((ROOT / "xla_magic").rglob("*.py")))


def fragments(message: str) -> list[str]:
    """The literal runs of a message: what stays once example values are cut out."""
    parts = re.split(r"'[^']*'|\([^)]*\)|\d+(?:\.\d+)?G?|/dev/\S+|strategy\.\w+|%%?xla_\w+|: |, so ", message)
    return [part.strip(" :,.") for part in parts if len(part.strip(" :,.").split()) >= 2]


def test_each_troubleshooting_message_is_real():
    from xla_magic.runs.errors import known_problem

    source = source_text()
    messages = troubleshooting_messages()
    assert len(messages) >= 8
    for message in messages:
        if known_problem(message) or any(tool in message for tool in OTHER_TOOLS):
            continue
        pieces = fragments(message)
        assert pieces, f"no literal text to check in {message!r}"
        for piece in pieces:
            assert piece in source, f"docs/troubleshooting.md quotes {message!r}, but xla_magic never says {piece!r}"


def test_each_known_problem_is_in_troubleshooting():
    from xla_magic.runs.errors import KNOWN_PROBLEMS

    messages = troubleshooting_messages()
    for pattern, advice in KNOWN_PROBLEMS:
        assert any(re.search(pattern, message, re.IGNORECASE) for message in messages), (
            f"docs/troubleshooting.md has no message for the known problem {pattern!r} ({advice[:60]}...)"
        )


def linked_entries() -> dict[str, list[str]]:
    """Every troubleshooting.see("ID") in xla_magic's source: ID -> the modules that link to it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "xla_magic").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "see":
                assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), (
                    f"{path.name}:{node.lineno}: see() takes one literal entry id, so this test can check it"
                )
                found.setdefault(node.args[0].value, []).append(path.relative_to(ROOT).as_posix())
    return found


def test_each_message_links_to_an_entry_that_exists():
    from xla_magic.notebook.troubleshooting import PAGES

    assert PAGES[-1] == DOCS / "troubleshooting.md"
    anchors = {anchor for _, anchor in troubleshooting_entries()}
    linked = linked_entries()
    assert len(linked) >= 15, sorted(linked)
    missing = {entry: modules for entry, modules in linked.items() if entry not in anchors}
    assert missing == {}, f"messages link to troubleshooting entries that do not exist: {missing}"


def test_each_known_problem_links_to_the_entry_for_its_message():
    from xla_magic.runs.errors import KNOWN_PROBLEMS

    entries = {anchor: message for message, anchor in troubleshooting_entries()}
    for pattern, advice in KNOWN_PROBLEMS:
        link = re.search(r"%xla_help ([a-z0-9-]+) says more\.$", advice)
        assert link, f"the advice for {pattern!r} does not end with its troubleshooting link: {advice!r}"
        assert re.search(pattern, entries[link.group(1)], re.IGNORECASE), (
            f"{pattern!r} links to #{link.group(1)}, whose message is {entries[link.group(1)]!r}"
        )


def test_a_refusal_names_its_entry(monkeypatch):
    """A real refusal on this machine (no TPU chips): --backend tpu without PJRT_DEVICE."""
    from xla_magic.ranks import probe

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert probe.find_tpu() is None
    with pytest.raises(probe.PlacementError) as info:
        probe.place("tpu", None)
    message = str(info.value)
    assert message.startswith("no TPU was found on this machine")
    assert message.endswith("%xla_help no-tpu-found says more.")
    entries = dict((anchor, text) for text, anchor in troubleshooting_entries())
    assert message.startswith(entries["no-tpu-found"])


def shown_in_the_cell(ip, cell: str) -> str:
    """Everything a cell shows: its output, its error as IPython renders it, its display data as text."""
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        ip.run_cell(cell)
    displayed = [output.data.get("text/plain", "") for output in captured.outputs]
    return "\n".join([captured.stdout, captured.stderr, *displayed])


def entry_text(anchor: str) -> tuple[str, str]:
    """(message, first line of its explanation) of the entry, read from the page here, not by xla_magic."""
    text = page("troubleshooting")
    start = text.index(f'<a id="{anchor}"></a>')
    heading, body = text[start:].split("\n## `", 1)[1].split("\n", 1)
    return heading.rstrip("`"), body.strip().splitlines()[0]


def test_every_entry_a_message_names_is_shown_by_the_line_it_gives(ip):
    """Each see(ID) in the code gives a line (%xla_help ID) that shows the entry's text in the cell."""
    from xla_magic.wire.help import see

    for anchor in linked_entries():
        line = re.fullmatch(r"(%xla_help [a-z0-9-]+) says more\.", see(anchor)).group(1)
        shown = shown_in_the_cell(ip, line)
        message, explanation = entry_text(anchor)
        assert message in shown and explanation.split("(")[0].split("[")[0] in shown, (anchor, shown)
    assert "%xla_help no-tpu-found" in shown_in_the_cell(ip, "%xla_help")
    assert "UsageError: no troubleshooting entry 'nope'" in shown_in_the_cell(ip, "%xla_help nope")
    # never a path into a repository the user of Colab or Kaggle does not have
    assert re.findall(r"See docs/\S+", source_text()) == []


# Real errors, raised where a user meets them: the advice in the message, then the entry its line shows.
ERRORS_WITH_ADVICE = {
    "no-tpu-found": ("%%xla_spawn --backend tpu\nrank", "Use --backend cpu (or auto)"),
    "strategy-outside-cell": ("from xla_magic import strategy\nstrategy.barrier()", "move this call into a %%xla_spawn cell"),
    "cannot-send-variable": ("import threading\nheld = threading.Lock()\n%%xla_spawn --devices 1\nheld", "Create it inside"),
}


@pytest.mark.parametrize("anchor", sorted(ERRORS_WITH_ADVICE))
def test_an_error_s_advice_is_readable_in_the_cell(ip, monkeypatch, anchor):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)  # this machine has no TPU: --backend tpu is refused
    cell, advice = ERRORS_WITH_ADVICE[anchor]
    if "\n%%xla_spawn" in cell:
        setup, cell = cell.split("\n%%xla_spawn", 1)
        ip.run_cell(setup)
        cell = "%%xla_spawn" + cell
    shown = shown_in_the_cell(ip, cell)
    assert advice in shown, shown
    line = re.search(r"(%xla_help [a-z0-9-]+) says more\.", shown)
    assert line and line.group(1) == f"%xla_help {anchor}", shown
    message, explanation = entry_text(anchor)
    followed = shown_in_the_cell(ip, line.group(1))
    assert message in followed and explanation in followed, followed


def known_problem_cases() -> list[tuple[str, str, str]]:
    """(entry id, the entry's message, the advice) of every known problem a rank's error can carry."""
    from xla_magic.runs.errors import KNOWN_PROBLEMS

    entries = {anchor: message for message, anchor in troubleshooting_entries()}
    cases = []
    for _, advice in KNOWN_PROBLEMS:
        anchor = re.search(r"%xla_help ([a-z0-9-]+) says more\.$", advice).group(1)
        cases.append((anchor, entries[anchor], advice))
    return cases


@pytest.mark.parametrize("anchor, message, advice", known_problem_cases(), ids=lambda value: value[:24])
def test_a_known_problem_s_advice_is_readable_in_the_cell(ip, anchor, message, advice):
    """A rank that fails with the entry's message shows, in the cell, `What to do:` with the advice and the
    %xla_help line, and that line shows the entry."""
    shown = shown_in_the_cell(ip, f"%%xla_spawn --devices 1\nraise RuntimeError({message!r})")
    assert "What to do: " + advice.split(". ")[0].split("`")[0] in shown, shown
    assert f"%xla_help {anchor} says more." in shown, shown
    followed = shown_in_the_cell(ip, f"%xla_help {anchor}")
    assert message in followed and entry_text(anchor)[1].split("(")[0].split("[")[0] in followed, followed


def test_local_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)\)", readme()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_every_module_is_in_the_layout_table():
    text = section("development", "The code's layout")
    for path in sorted((ROOT / "xla_magic").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name == "xla_magic/launcher/__init__.py":
            continue
        assert f"| `{name}` |" in text, f"docs/development.md's layout table does not describe {name}"


def test_the_readme_s_recompilation_example_shows_what_it_prints(spawn):
    cells = re.findall(r"```python\n(%%xla_spawn[^\n]*)\n(.*?)```\n```text\n(.*?)```", readme(), re.DOTALL)
    line, body, shown = next(cell for cell in cells if "recompiled" in cell[2])
    run = spawn(line[len("%%xla_spawn") :], body)
    said = [printed for printed in run.stdout.splitlines() if printed.startswith("XLA:")]
    # the same line but for the compile time, which is this machine's
    assert [re.sub(r"\(\S+ m?s\)", "(…)", printed) for printed in said] == [
        re.sub(r"\(\S+ m?s\)", "(…)", printed) for printed in shown.strip().splitlines()], run.stdout


def test_the_first_example_shows_what_it_prints(spawn):
    text = readme()
    cell = re.search(r"```python\n(%%xla_spawn[^\n]*)\n(.*?)```\n```text\n(.*?)```", text, re.DOTALL)
    assert cell, "README's first %%xla_spawn example and its output are missing"
    line, body, shown = cell.group(1), cell.group(2), cell.group(3).splitlines()
    run = spawn(line[len("%%xla_spawn") :], body)
    *lines, value = shown
    assert repr(run.value) == value
    for printed in lines:
        if printed != "...":
            assert printed in run.lines(), f"the example shows {printed!r}, the cell printed {run.lines()}"


@pytest.fixture(scope="module")
def figures():
    return doc_script("figures")


def test_the_setup_and_suite_figures_are_the_measured_ones(figures):
    """docs/figures.md's figures are docs/figures.py's rendering of its last measurement, and the counts are today's."""
    import json
    import os
    import sys

    if os.environ.get("XLA_MAGIC_RESULTS"):
        pytest.skip("this run is the measurement (docs/figures.py --measure) that writes the figures")

    measured = json.loads(figures.FIGURES.read_text())
    assert figures.section_in(page("figures")) == figures.render(measured), (
        "docs/figures.md's set-up figures are not docs/figures.json's: run python docs/figures.py"
    )
    for stack in figures.STACKS:
        now = figures.collected(sys.executable, stack)
        assert measured["stacks"][stack]["collected"] == now, (
            f"the {stack} stack collects {now} tests, docs/figures.md says "
            f"{measured['stacks'][stack]['collected']}: measure again with python docs/figures.py --measure"
        )
        assert measured["stacks"][stack]["failed"] == 0, f"the measured {stack} run failed tests: fix them, measure again"
