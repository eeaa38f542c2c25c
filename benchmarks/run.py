"""``make bench``: every figure the project claims, beside its baseline, in one table.

Runs on the machine at hand. Each ``benchmarks/bench_*.py`` that defines
``main()`` runs in a fresh interpreter of its own, so one benchmark's
processes and memory never colour another's. ``main()`` returns rows
``(name, ours, baseline, unit, note)``, the baseline measured in the same
run; this prints them as one Markdown table (the docs' figures page,
docs/figures.md, holds this output) with each figure's ratio to its baseline. Units ending in
``/s`` are better higher; every other unit (s, GiB, ...) is better lower.

    python benchmarks/run.py            # every benchmark
    python benchmarks/run.py cell data  # only bench_cell.py and bench_data.py
    python benchmarks/run.py --page docs/figures.md  # also put the table in the figures page

Progress goes to stderr, the table to stdout. The exit status is 1 when a
benchmark failed (its row says so, its error is on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT = 900  # seconds for one benchmark module: a bound on a hang (bench_profile runs 7 kinds x 11 rounds)
ROWS_MARK = "BENCH-ROWS "

# Loads one module without running its __main__ block, calls main(), and
# prints the rows as one JSON line the runner can find among other output.
CHILD = f"""
import json, runpy, sys
sys.path.insert(0, {str(HERE)!r})
module = runpy.run_path(sys.argv[1], run_name="bench")
main = module.get("main")
if not callable(main):
    print({ROWS_MARK!r} + "null", flush=True)
    sys.exit(0)
rows = [list(row) for row in main()]
print({ROWS_MARK!r} + json.dumps(rows), flush=True)
"""


@dataclass
class Row:
    name: str
    ours: float | None
    baseline: float | None
    unit: str
    note: str

    @property
    def higher_is_better(self) -> bool:
        return self.unit.endswith("/s")

    def comparison(self) -> str:
        """How many times better (or worse) than the baseline."""
        if self.ours is None or not self.baseline or not self.ours:
            return "-"
        ratio = self.ours / self.baseline if self.higher_is_better else self.baseline / self.ours
        return f"{ratio:.3g}x better" if ratio >= 1 else f"{1 / ratio:.3g}x worse"


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def discover(only: list[str]) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        wanted = {name.removeprefix("bench_").removesuffix(".py") for name in only}
        found = [path for path in found if path.stem.removeprefix("bench_") in wanted]
    return found


def run_module(path: Path) -> tuple[list[Row] | None, str]:
    """The module's rows (None if it has no main()), or an error message."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(path)],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return [], f"{path.name}: no result within {TIMEOUT} s"
    for line in done.stdout.splitlines():
        if line.startswith(ROWS_MARK):
            rows = json.loads(line[len(ROWS_MARK) :])
            return (None if rows is None else [Row(*row) for row in rows]), ""
    return [], f"{path.name} failed (exit status {done.returncode}):\n{done.stderr[-4000:]}"


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    try:
        from importlib.metadata import version

        versions = f", torch {version('torch')}, torch_xla {version('torch_xla')}"
    except Exception:  # a missing distribution: the table still stands
        versions = ""
    return (
        f"{os.cpu_count()} CPUs, {memory:.0f} GiB memory, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}{versions}; {time.strftime('%Y-%m-%d')}"
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| figure | ours | baseline | unit | ours vs baseline | how measured |",
        "| --- | ---: | ---: | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {number(row.ours)} | {number(row.baseline)} | {row.unit} "
            f"| {row.comparison()} | {row.note} |"
        )
    return "\n".join(lines)


PAGE_START = "<!-- bench:start"
PAGE_END = "<!-- bench:end -->"


def write_page(path: Path, text: str) -> None:
    """Replace what lies between the page's bench markers with ``text``."""
    page = path.read_text()
    start = page.find(PAGE_START)
    end = page.find(PAGE_END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no {PAGE_START} ... {PAGE_END} markers to fill")
    opening_end = page.index("\n", start) + 1
    path.write_text(page[:opening_end] + text + "\n" + page[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="benchmark names to run (cell, data, ...); default all")
    parser.add_argument("--page", type=Path, help="also write the table between this file's bench markers (docs/figures.md)")
    args = parser.parse_args(argv)
    modules = discover(args.only)
    if not modules:
        parser.error(f"no benchmark matches {args.only}; found {[p.stem for p in discover([])]}")
    rows: list[Row] = []
    failed = False
    started = time.monotonic()
    for path in modules:
        print(f"{path.name} ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        found, error = run_module(path)
        print(f"{path.name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
        if error:
            failed = True
            print(error, file=sys.stderr)
            rows.append(Row(f"{path.stem}: FAILED (see stderr)", None, None, "", ""))
        rows.extend(found or [])
    text = f"Measured by `make bench` in {time.monotonic() - started:.0f} s on {machine()}.\n\n{table(rows)}"
    print(text)
    if args.page is not None and not failed:
        write_page(args.page, text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
