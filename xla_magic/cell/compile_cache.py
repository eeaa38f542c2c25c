"""Where the ranks keep torch_xla's persistent compilation cache, as the kernel decides it. Runs in the kernel.

``--compile-cache DIR|on|off`` (on ``%%xla_spawn`` and ``%xla_pool
start``), else ``XLA_MAGIC_COMPILE_CACHE``, else the default, which follows
what torch_xla can load: on, under ``~/.cache/xla_magic/compile-cache``
(``$XDG_CACHE_HOME`` where set), on a TPU with a torch_xla that loads its
cache there (2.7 and earlier); off where it cannot load what it writes
("Deserializing serialized executable not supported"): on XLA:CPU (the
simulation, the tpu path on CPU threads) and on a TPU with torch_xla 2.8 or
2.9 (pytorch/xla#9094). That is decided by the installed version
(importlib.metadata, without importing torch_xla here), not by a failed
attempt. Given explicitly (a directory, or ``on``), it is on anywhere: that
exercises the TPU's path in the simulation. The home directory survives
kernel restarts everywhere; Colab's runtime reset and a new Kaggle session
lose it (docs/pools.md says where to point it there instead). Where the
cache cannot load, a kept pool (``%xla_pool start --keep``) is how compiled
graphs survive a restart.

A variable that names no usable place leaves the cells without the cache,
said once a session (``setting_line``); the option's bad value is a
UsageError, since it is typed in the cell.

Each rank process opens a directory of its own under the root
(launcher/compile_cache.py says why), reports what it found when it is
ready, and this module turns those reports into one line when the cache
could not be used, and into the status panel's fact.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Mapping

from IPython.core.error import UsageError

VARIABLE = "XLA_MAGIC_COMPILE_CACHE"
OPTION = "--compile-cache"
# torch_xla's warning for each graph it finds in the cache and cannot load, on a platform whose client cannot
# load serialized executables at all: XLA:CPU, and a TPU with torch_xla 2.8 and 2.9 (its PJRT C API
# client loads them by another call than torch_xla's: pytorch/xla#9094, still open on 2.9). One line per graph
# and rank: never shown in the cell (Ranks.quiet_line); the account says so, and a TPU's kernel once.
LOAD_UNSUPPORTED = re.compile(r"\] Failed to deserialize executable: UNIMPLEMENTED: Deserializing serialized "
                              r"executable not supported")
UNLOADABLE = "cannot load"  # the reason told once a session (unloadable_line)
DISTRIBUTION = "torch_xla"
# torch_xla releases whose TPU client cannot load a serialized executable: the XLA pin of 2.8 (pytorch/xla#8908)
# made DeserializeExecutable, which torch_xla calls, unimplemented in the TPU's PJRT C API client, and no release
# carries the fix (pytorch/xla#9759; 2.9 is the last release). 2.7 and earlier load it. (major, minor) pairs.
CANNOT_LOAD_ON_TPU = ((2, 8), (2, 9))
KEPT_POOL_HINT = "a kept pool (%xla_pool start --keep) is how compiled graphs survive a kernel restart there"


def installed_version() -> str | None:
    """torch_xla's version as installed for this Python, read from its metadata (nothing imported); None if absent."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def loads_on_tpu(version: str | None) -> bool:
    """Whether torch_xla ``version`` can load its persistent cache on a TPU. An unknown version (torch_xla not in
    the kernel's Python: XLA_MAGIC_PYTHON names another) counts as able: its ranks then say once if it cannot."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return found is None or (int(found.group(1)), int(found.group(2))) not in CANNOT_LOAD_ON_TPU


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xla_magic", "compile-cache")


@dataclass(frozen=True)
class CacheSetting:
    """What was asked for: a root (None: off) and whether explicitly, so on even where torch_xla cannot load it."""

    root: str | None
    forced: bool = False
    source: str = "default"  # --compile-cache, XLA_MAGIC_COMPILE_CACHE or default
    problem: str | None = None  # why the variable's value could not be used (the cells run without the cache)

    def job(self, on_cpu: bool) -> dict[str, Any] | None:
        """What the ranks' job carries: None when the ranks open no cache."""
        if self.root is None or (not self.forced and (on_cpu or not loads_on_tpu(installed_version()))):
            return None
        return {"root": self.root}

    def describe(self, on_cpu: bool) -> str:
        if self.problem is not None:
            return f"off ({self.problem})"
        if self.root is None:
            return f"off ({self.source} off)"
        if on_cpu and not self.forced:
            return (f"off on XLA:CPU, which cannot load compiled executables ({OPTION} DIR or "
                    f"{VARIABLE}=DIR forces it on, to exercise the TPU's path)")
        if not self.forced and not loads_on_tpu(version := installed_version()):
            return (f"off: torch_xla {version} cannot load its compile cache on a TPU (pytorch/xla#9094), so "
                    f"{KEPT_POOL_HINT}. {OPTION} DIR forces it on")
        return self.root


# Words a user may mean as on or off: as a directory name each would make a folder of that name here.
ON_WORDS = {"true", "yes", "1", "enable", "enabled"}
OFF_WORDS = {"false", "no", "0", "none", "disable", "disabled", "null"}


def parse(value: str, where: str) -> CacheSetting:
    """``off``, ``on`` (the default directory) or a directory; UsageError, saying what to give, for anything else.

    A relative directory is taken from the kernel's working directory (where the ranks run), now; ``~`` and
    ``~user`` are expanded; a value in quotes loses them (IPython's argument split keeps them)."""
    text = _unquoted(value.strip()).strip()
    example = f"like {OPTION} ~/xla-cache, {OPTION} on or {OPTION} off" if where == OPTION else \
        f"like {where}=~/xla-cache, {where}=on or {where}=off, or unset it"
    if text.lower() == "off":
        return CacheSetting(None, source=where)
    if text.lower() == "on":
        return CacheSetting(default_root(), forced=True, source=where)
    if not text:
        raise UsageError(f"{where} is empty: it takes a directory, on or off, {example}")
    if text.lower() in ON_WORDS | OFF_WORDS:
        meant = "on" if text.lower() in ON_WORDS else "off"
        raise UsageError(f"{where} {text}: did you mean {meant}? It takes a directory, on or off; for a folder "
                         f"named {text!r} here, give ./{text}")
    if "\0" in text:
        raise UsageError(f"{where} takes a directory, on or off: {value!r} holds a NUL character")
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        user = expanded[1:].split(os.sep)[0]
        raise UsageError(f"{where} {text}: there is no user {user!r} on this machine for ~{user} to name; give the "
                         f"directory in full, {example}")
    root = os.path.abspath(expanded)
    blocking = _file_on_the_way(root)
    if blocking == root:
        raise UsageError(f"{where} {text}: {root} is a file, not a directory. Give a directory for the cache "
                         f"(it is made if missing), or off")
    if blocking is not None:
        raise UsageError(f"{where} {text}: {blocking} is a file, so no directory can be made under it. Give a "
                         f"directory for the cache (it is made if missing), or off")
    return CacheSetting(root, forced=True, source=where)


def _unquoted(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _file_on_the_way(path: str) -> str | None:
    """The nearest existing part of ``path`` when it is not a directory (the path itself, or a parent), or None."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def option(text: str) -> CacheSetting:
    """The argparse type of --compile-cache (its UsageError becomes the magic's usage error)."""
    import argparse

    try:
        return parse(text, OPTION)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve(given: CacheSetting | None, environ: Mapping[str, str] = os.environ) -> CacheSetting:
    """The option if given, else the variable (read now: a cell may have set it), else the default.

    A variable that names no usable place is off, with its problem (``setting_line`` says it once)."""
    if given is not None:
        return given
    value = environ.get(VARIABLE)
    if value is not None:
        try:
            return parse(value, VARIABLE)
        except UsageError as exc:
            return CacheSetting(None, source=VARIABLE, problem=str(exc))
    return CacheSetting(default_root())


def setting_line(setting: CacheSetting, told: set[str]) -> str | None:
    """Once a session for each problem: the variable's place cannot be used, so the cells run without the cache."""
    if setting.problem is None or setting.problem in told:
        return None
    told.add(setting.problem)
    return f"compile cache: not used, the cells run without it: {setting.problem}"


def for_hosts(given: CacheSetting | None, environ: Mapping[str, str] = os.environ) -> CacheSetting | None:
    """What a pool across hosts sends each host: the option, else the kernel's variable; None leaves each host its
    own default (under its own home, on what its own devices are)."""
    setting = resolve(given, environ)
    return None if setting.source == "default" else setting


def refuse_for_one_cell(asked: CacheSetting, running: CacheSetting | None, on_cpu: bool, described: str) -> None:
    """A pool cell's --compile-cache: the pool's ranks opened theirs when they started, so only what they do is
    accepted (``running`` None: each host's own default, which is off on XLA:CPU)."""
    if running is None and on_cpu:
        running = CacheSetting(None)
    if running is not None and asked.job(on_cpu) == running.job(on_cpu):
        return
    raise UsageError(
        f"the pool's ranks opened their compilation cache when they started ({described}), so {OPTION} cannot "
        f"change it for one cell. Leave it out to run in the pool, add --fresh for new ranks, or %xla_pool "
        f"restart {OPTION} ... to replace the pool."
    )


def quiet_line(job: dict[str, Any] | None) -> Callable[[str], bool] | None:
    """What of the ranks' stderr not to show: torch_xla's line for each graph it cannot load, wherever it
    opened the cache (the account counts them, and ``unloadable_line`` says what they mean)."""
    if not job:
        return None
    return lambda line: LOAD_UNSUPPORTED.search(line) is not None


def unloadable_line(accounts: list[dict[str, Any]], on_cpu: bool, told: set[str]) -> str | None:
    """Once a session, where ranks on a device that is not XLA:CPU could load no graph their cache held: what
    that means and what to do. On XLA:CPU the cache is forced on only to exercise the TPU's path (the report's
    note says it there)."""
    if on_cpu or UNLOADABLE in told or not any(account.get("cannot_load") for account in accounts):
        return None
    told.add(UNLOADABLE)
    return (f"compile cache: this torch_xla could load none of the graphs its cache held here, so they compiled "
            f"as without it (torch_xla 2.8 and 2.9 cannot load it on a TPU: pytorch/xla#9094), and the cache "
            f"only costs disk; {KEPT_POOL_HINT}. {OPTION} off, or {VARIABLE}=off, turns it off")


# --- what the ranks reported ------------------------------------------------------


def problems(facts: Mapping[int, dict[str, Any]]) -> dict[str, list[int]]:
    """Why ranks run without the cache they were given, and which: one entry per reason."""
    found: dict[str, list[int]] = {}
    for rank, fact in sorted(facts.items()):
        if fact and fact.get("why"):
            found.setdefault(fact["why"], []).append(rank)
    return found


def problem_line(facts: Mapping[int, dict[str, Any]], told: set[str]) -> str | None:
    """The one line a start says when ranks could not use the cache (each reason once a session), or None."""
    lines = []
    for why, ranks in problems(facts).items():
        if why in told:
            continue
        told.add(why)
        who = ("every rank" if len(ranks) == len(facts)
               else f"rank{'s' * (len(ranks) > 1)} " + ", ".join(map(str, ranks)))
        lines.append(f"{who}: {why}")
    if not lines:
        return None
    return (f"compile cache: not used ({'; '.join(lines)}); the cells run without it and compile as usual. "
            f"{OPTION} DIR picks another place, {OPTION} off turns it off")


def directories(facts: Mapping[int, dict[str, Any]]) -> list[str]:
    """The directories the ranks use, once each (rank threads of one process share one)."""
    return sorted({fact["dir"] for fact in facts.values() if fact and fact.get("on")})


SIZE_KEPT = 5.0  # seconds a size is reused: the live panel redraws often while a cell runs, and a cache can be large
_sizes: dict[str, tuple[float, tuple[int, int]]] = {}


def size_of(path: str) -> tuple[int, int]:
    """(files, bytes) under ``path``; (0, 0) when it is not there. Read again at most every SIZE_KEPT seconds."""
    now = time.monotonic()
    kept = _sizes.get(path)
    if kept is not None and now - kept[0] < SIZE_KEPT:
        return kept[1]
    _sizes[path] = (now, _walk(path))
    return _sizes[path][1]


def _walk(path: str) -> tuple[int, int]:
    files = total = 0
    for folder, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
                files += 1
            except OSError:
                pass
    return files, total


def fact(setting: CacheSetting, on_cpu: bool, facts: Mapping[int, dict[str, Any]] | None) -> str:
    """%xla_status's line: where the cache is, how big, and how to clear or turn it off."""
    where = setting.describe(on_cpu)
    if setting.job(on_cpu) is None:
        return where
    files, total = size_of(setting.root or "")
    text = f"{where}: {files} file(s), {_size(total)}"
    if facts:
        used = directories(facts)
        wrong = problems(facts)
        if used:
            text += f"; the pool's ranks use {len(used)} folder(s) in it"
        if wrong:
            text += "; not used by the pool: " + "; ".join(wrong)
    return text + f". To clear it: rm -r {setting.root} (with no ranks running); {OPTION} off turns it off"


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"
