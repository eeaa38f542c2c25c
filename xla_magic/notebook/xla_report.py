"""What XLA did in a cell, told from the ranks' accounts. Runs in the kernel.

Each rank sends its account (launcher/xla_account.py) with its reply; the
request stores it on the run's record (``RankState.xla``). From the record
this module makes the one line shown under a cell when something deserves
a look (recompilations and the line that caused them, device-to-host syncs
in a loop, CPU fallbacks, long compiles, ranks that differ) and, on every
cell that used device memory, the ranks' peak in it; and the full report: a table in a notebook, text in a terminal.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any

from xla_magic.notebook import memory_view
from xla_magic.runs.sink import in_notebook
from xla_magic.runs.record import RunRecord

MODES = ("auto", "full", "off")
# Syncs from one line (a loop: a few, printing a short run's loss, are fine), or ...
SYNCS_WORTH_A_LOOK = 10
ALL_SYNCS_WORTH_A_LOOK = 20  # ... in all, before the summary names them
KEEPS_COMPILING = 5  # compilations from one place (a warm-up compiles two or three)
LONG_COMPILE = 10.0  # seconds of compiling that are worth a word on their own
RANKS_NAMED = 2  # sets of ranks that differ from the rest, named one by one in the summary


@dataclass
class Group:
    """Ranks whose accounts tell the same story (or one process's rank threads, which share one)."""

    ranks: list[int]
    account: dict[str, Any]
    shared: bool  # one account of a process that several rank threads share


# What a rank that finished its cell without sending an account did on XLA: nothing (xla_account.py).
IDLE: dict[str, Any] = {
    "ranks": [], "cell": None, "analysis": "ours", "compiles": 0, "compile_seconds": 0.0, "cached": 0,
    "loaded": 0, "load_seconds": 0.0, "load_failures": 0, "cannot_load": False, "executions": 0,
    "execute_seconds": 0.0, "transfers": 0, "scalar_reads": 0, "fallbacks": {},
    "compilations": [], "sync_lines": [],
}


def account_of(record: RunRecord, state: Any) -> dict[str, Any] | None:
    """A rank's account: the one it sent, IDLE if it finished without one, None if it did not finish."""
    if state.xla is not None:
        return state.xla
    return IDLE if state.state == "done" and record.xla_report != "off" else None


def groups(record: RunRecord) -> list[Group]:
    """The record's accounts, ranks with the same story together, by first rank."""
    found: dict[int, Group] = {}
    by_story: dict[tuple[Any, ...], Group] = {}
    for rank, state in sorted(record.ranks.items()):
        account = account_of(record, state)
        if account is None or id(account) in found:
            if account is not None and rank not in found[id(account)].ranks:
                found[id(account)].ranks.append(rank)
            continue
        shared = len(account.get("ranks", ())) > 1
        story = _story(account)
        if not shared and story in by_story:
            by_story[story].ranks.append(rank)
            found[id(account)] = by_story[story]
            continue
        group = Group([rank], account, shared)
        found[id(account)] = group
        if not shared:
            by_story[story] = group
    return sorted({id(group): group for group in found.values()}.values(), key=lambda group: group.ranks[0])


def _story(account: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two ranks' accounts the same for the report: what compiled where, and the counts."""
    return (
        tuple((c["line"], c["hash"]) for c in account["compilations"]),
        account["compiles"], account["cached"], account.get("loaded", 0), account["transfers"],
        tuple(sorted(account["fallbacks"].items())),
    )


# --- the summary line -----------------------------------------------------------------


def summary(record: RunRecord) -> str | None:
    """The line under the cell: what deserves a look, and the ranks' peak device memory in the cell when XLA
    worked in it; None when neither."""
    if all(state.xla is None for state in record.ranks.values()):  # the common case, first: nothing happened
        near = memory_view.peak_finding(record, always=False)  # unless a device came near its limit
        return f"XLA: {near}" if near else None
    found = groups(record)
    cell = record.cell
    findings: list[str] = []
    main = max(found, key=lambda group: (group.account["compiles"], len(group.ranks)))
    account = main.account
    findings += _recompilations(account)
    findings += _syncs(account)
    findings += _fallbacks(account, cell)
    if account["compile_seconds"] >= LONG_COMPILE and not any(f.startswith(("line", "recompiled")) for f in findings):
        findings.append(f"compiling took {_seconds(account['compile_seconds'])}")
    differ = _ranks_differ(found, record)
    if differ:
        findings.append(differ)
    findings += _cache_loads(account)
    peak = memory_view.peak_finding(record)  # on every cell that used device memory, last
    if not findings and not peak:
        return None
    head = ""
    if account["compiles"] > 1 and any("compiled" in finding for finding in findings[:1]):
        head = f"{account['compiles']} compilations ({_seconds(account['compile_seconds'])}) — "
    return "XLA: " + head + "; ".join(findings + ([peak] if peak else []))


def _cache_loads(account: dict[str, Any]) -> list[str]:
    """Graphs loaded from the persistent compilation cache instead of compiled; those it could not load where
    torch_xla can load (where it cannot at all, the report's note and compile_cache.unloadable_line say so)."""
    findings = []
    if account.get("loaded"):
        findings.append(f"{_graphs(account['loaded'])} loaded from the compile cache "
                        f"({_seconds(account['load_seconds'])}) instead of compiled")
    if account.get("load_failures") and not account.get("cannot_load"):
        findings.append(f"{_graphs(account['load_failures'])} in the compile cache could not be loaded and "
                        f"compiled again (a damaged or half-written file, which torch_xla replaced)")
    return findings


def _where(account: dict[str, Any], compilation: dict[str, Any]) -> str:
    if compilation["line"] is None:
        return "outside the cell's code"
    if compilation["cell"] == account["cell"]:
        return f"line {compilation['line']}"
    return f"line {compilation['line']} of {_cell_name(compilation['cell'])}"


def _cell_name(filename: str | None) -> str:
    match = re.match(r"<xla_spawn cell (\d+)>", filename or "")
    return f"cell {match.group(1)}" if match else (filename or "an earlier cell")


def _recompilations(account: dict[str, Any]) -> list[str]:
    """Lines that compiled again in this cell with other input shapes, or over and over; lines an earlier cell compiled.

    A loop's first two steps often compile two graphs (the first also runs
    the initialisation that was pending): that alone is not worth a word.
    Compilations count together when they come from the same cell line by
    the same path (a library's several sync points are several graphs).
    """
    by_line: dict[tuple[Any, ...], list[dict[str, Any]]] = {}  # the same line, reached the same way
    for compilation in account["compilations"]:
        if compilation["line"] is not None:
            by_line.setdefault(_place(compilation), []).append(compilation)
    findings = []
    for compilations in by_line.values():
        where = _where(account, compilations[0])
        code = f" ({compilations[0]['code']})" if compilations[0]["code"] else ""
        pairs = list(zip(compilations, compilations[1:]))
        reshaped = [(a, b) for a, b in pairs if _sizes_differ(a, b)]
        if len(compilations) >= KEEPS_COMPILING:
            findings.append(f"{where}{code} compiled {len(compilations)} times: the graph changes from step to step "
                            f"({_why(*(reshaped[-1] if reshaped else pairs[-1]))})")
        elif reshaped:
            findings += [f"recompiled at {where}{code}: {_why(a, b)}" for a, b in reshaped]
    for compilation in account["compilations"]:
        earlier = compilation.get("earlier")
        if earlier is not None and len(by_line.get(_place(compilation), ())) < 2:
            findings.append(
                f"{_where(account, compilation)} compiled again (the same code compiled in run {earlier['run']}): "
                f"this cell's {_why(earlier, compilation, across=True)}"
            )
    return findings


def _place(compilation: dict[str, Any]) -> tuple[Any, ...]:
    return compilation["cell"], compilation["line"], tuple(compilation.get("path", ()))


def _sizes_differ(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Shapes changed: a tensor the cell names has another shape, or the same inputs have other sizes.
    (Another number of inputs alone is another graph, as a first step's that also ran the pending
    initialisation.)"""
    if _shapes_changed(before, after):
        return True
    return before.get("inputs") == after.get("inputs") and before.get("input_bytes") != after.get("input_bytes")


def _shapes_changed(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, shape before, shape after) of the tensors both compilations saw the cell name, that changed shape."""
    old, new = before.get("shapes") or {}, after.get("shapes") or {}
    return [(name, old[name], new[name]) for name in old if name in new and old[name] != new[name]]


def _shape_change(changed: list[tuple[str, str, str]]) -> str:
    """x: f32[8,16] → f32[5,16] (two at most, and how many more)."""
    told = ", ".join(f"{name}: {old} → {new}" for name, old, new in changed[:2])
    return told + (f" and {len(changed) - 2} more" if len(changed) > 2 else "")


def _why(before: dict[str, Any], after: dict[str, Any], across: bool = False) -> str:
    """What differs between two compilations of the same code."""
    changed = _shapes_changed(before, after)
    if changed:
        return f"shapes differ from the last ({_shape_change(changed)})" if across else \
            f"shapes changed, {_shape_change(changed)}"
    if before.get("input_bytes") != after.get("input_bytes") and None not in (before.get("input_bytes"), after.get("input_bytes")):
        change = f"{_bytes(before['input_bytes'])} → {_bytes(after['input_bytes'])} of graph inputs"
        return f"input shapes differ from the last ({change})" if across else f"input shapes changed, {change}"
    if before.get("inputs") != after.get("inputs"):
        return f"graph inputs differ, {before.get('inputs')} → {after.get('inputs')}"
    return ("graph differs from the last" if across else
            "the graph changed with inputs of the same size (a Python value baked into the graph?)")


def _syncs(account: dict[str, Any]) -> list[str]:
    lines = [entry for entry in account["sync_lines"] if entry["count"] >= SYNCS_WORTH_A_LOOK]
    total = account["transfers"]
    if not lines and total < ALL_SYNCS_WORTH_A_LOOK:
        return []
    if lines:
        places = ", ".join(
            f"{_where(account, entry)}: {_short(entry['code']) or '…'} ×{entry['count']}" for entry in lines[:2]
        )
        return [f"{max(total, sum(e['count'] for e in lines))} device→host syncs ({places})"]
    return [f"{total} device→host syncs"]


def _fallbacks(account: dict[str, Any], cell: str) -> list[str]:
    findings = []
    for op, count in sorted(account["fallbacks"].items(), key=lambda item: -item[1]):
        line = _line_naming(cell, op.partition("::")[2])
        findings.append(f"CPU fallback {op} ×{count}" + (f" (line {line})" if line else ""))
    return findings


def _line_naming(cell: str, name: str) -> int | None:
    """The one line of the cell that calls ``name``, if exactly one does."""
    pattern = re.compile(rf"\b{re.escape(name)}\s*\(")
    lines = [number for number, text in enumerate(cell.splitlines(), 1) if pattern.search(text)]
    return lines[0] if len(lines) == 1 else None


def _ranks_differ(found: list[Group], record: RunRecord) -> str:
    """Ranks that compiled another number of graphs than the rest, or graphs of other input sizes.

    A TPU hangs when ranks run different programs around a collective.
    Graphs that differ only in a constant (``x * rank``: torch_xla bakes 0
    and 1 into the graph) are not named: they are harmless and common.
    """
    apart = [group for group in found if not group.shared]
    if len(apart) < 2:
        return ""
    # Ranks that did the same, for this purpose, together; the largest such set is "the rest".
    alike: dict[tuple[Any, ...], list[int]] = {}
    first: dict[tuple[Any, ...], Group] = {}
    for group in apart:
        compilations = group.account["compilations"]
        key = (group.account["compiles"], tuple(c["input_bytes"] for c in compilations),
               tuple(tuple(sorted((c.get("shapes") or {}).items())) for c in compilations))
        alike.setdefault(key, []).extend(group.ranks)
        first.setdefault(key, group)
    if len(alike) < 2:
        return ""
    rest_key = max(alike, key=lambda key: len(alike[key]))
    rest = first[rest_key].account["compilations"]

    def how(key: tuple[Any, ...]) -> str:
        if key[0] != rest_key[0]:
            return ""
        changed = [change for theirs, ours in zip(first[key].account["compilations"], rest)
                   for change in _shapes_changed(ours, theirs)]
        if changed:
            return " with other shapes (" + ", ".join(
                f"{name}: {new} against {old}" for name, old, new in changed[:2]) + ")"
        return " with inputs of other sizes"

    others = [(key, ranks) for key, ranks in alike.items() if key != rest_key]
    named = "; ".join(f"{_who(ranks)} compiled {_graphs(key[0])}{how(key)}" for key, ranks in others[:RANKS_NAMED])
    if len(others) > RANKS_NAMED:
        rest_of_them = [rank for _key, ranks in others[RANKS_NAMED:] for rank in ranks]
        named += f"; {_who(rest_of_them)} differ{'s' * (len(rest_of_them) == 1)} too"
    return f"ranks differ: {named}, {_who(alike[rest_key])} {_graphs(rest_key[0])}"


def _who(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {_ranks(ranks)}"


def _graphs(count: int) -> str:
    return f"{count} graph{'s' * (count != 1)}"


def _ranks(ranks: list[int]) -> str:
    """0-3, 5 for [0, 1, 2, 3, 5]."""
    parts, start = [], None
    ordered = sorted(ranks)
    for i, rank in enumerate(ordered):
        if start is None:
            start = rank
        if i + 1 == len(ordered) or ordered[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def _short(code: str, limit: int = 48) -> str:
    return code if len(code) <= limit else code[: limit - 1] + "…"


def _seconds(seconds: float) -> str:
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"


def _bytes(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


# --- the full report ------------------------------------------------------------------------

COLUMNS = ("ranks", "compiled", "compile time", "cached", "loaded", "load time", "executed", "execute time",
           "device→host", "CPU fallbacks")


def rows(record: RunRecord) -> list[list[str]]:
    """One row per group of ranks: the counts, as text."""
    table = []
    for group in groups(record):
        account = group.account
        fallbacks = ", ".join(f"{op} ×{count}" for op, count in account["fallbacks"].items()) or "none"
        table.append([
            _ranks(group.ranks) + (" (one process)" if group.shared else ""),
            str(account["compiles"]), _seconds(account["compile_seconds"]), str(account["cached"]),
            _loaded(account), _seconds(account.get("load_seconds", 0.0)), str(account["executions"]),
            _seconds(account["execute_seconds"]), str(account["transfers"]), fallbacks,
        ])
    return table


def _loaded(account: dict[str, Any]) -> str:
    """Graphs loaded from the persistent compilation cache, and those it held but could not load."""
    text = str(account.get("loaded", 0))
    return text + (f" ({account['load_failures']} not loadable)" if account.get("load_failures") else "")


def compilation_rows(record: RunRecord) -> list[list[str]]:
    """Each compilation (ranks with the same story once): ranks, where, code, cause, graph, inputs, shapes, memory, time."""
    table = []
    for group in groups(record):
        account = group.account
        for compilation in account["compilations"]:
            inputs = "" if compilation["inputs"] is None else str(compilation["inputs"])
            if compilation["input_bytes"] is not None:
                inputs += f" ({_analysis_bytes(compilation['input_bytes'])})"
            table.append([
                _ranks(group.ranks), _where(account, compilation), _short(compilation["code"]), compilation["cause"],
                compilation["hash"][:12], inputs, _shapes(compilation), memory_text(compilation.get("memory")),
                "" if compilation["seconds"] is None else _seconds(compilation["seconds"]),
            ])
    return table


COMPILATION_COLUMNS = ("ranks", "where", "code", "cause", "graph", "inputs", "shapes", "memory", "time")
# The post-compilation analysis's sizes, as the report names them.
MEMORY_PARTS = (("inputs", "in"), ("outputs", "out"), ("temporaries", "temp"), ("program", "program"))


def _shapes(compilation: dict[str, Any], limit: int = 4) -> str:
    """The tensors the cell named when it compiled: x f32[8,16], w f32[16,4], ... ("" where not known)."""
    named = list((compilation.get("shapes") or {}).items())
    text = ", ".join(f"{name} {shape}" for name, shape in named[:limit])
    return text + (f" +{len(named) - limit}" if len(named) > limit else "")


def memory_text(memory: dict[str, int] | None) -> str:
    """in 18.9 KB, out 1.0 KB, temp <1 KB, program <1 KB; "n/a" where the backend gave no figure.

    torch_xla prints GB with six decimals: 0 means less than about a kilobyte.
    """
    if not memory:
        return "n/a"
    return ", ".join(f"{label} {_analysis_bytes(memory[part])}" for part, label in MEMORY_PARTS if part in memory)


def _analysis_bytes(count: int) -> str:
    """A size from the post-compilation analysis, which gives GB with six decimals: 0 is under about a KB."""
    return _bytes(count) if count else "<1 KB"


def largest_graph(record: RunRecord) -> str:
    """The cell's largest compiled graph by its memory (inputs, outputs, temporaries): where, and its figures."""
    best: tuple[int, Group, dict[str, Any]] | None = None
    for group in groups(record):
        for compilation in group.account["compilations"]:
            memory = compilation.get("memory") or {}
            size = sum(memory.get(part, 0) for part in ("inputs", "outputs", "temporaries"))
            if memory and (best is None or size > best[0]):
                best = (size, group, compilation)
    if best is None:
        return ""
    _size, group, compilation = best
    return (f"largest graph: {_where(group.account, compilation)} on {_who(group.ranks)}, "
            f"{memory_text(compilation['memory'])}")


def report_text(record: RunRecord) -> str:
    lines = [f"What XLA did in run {record.run_id}:"]
    table = rows(record)
    if not table:
        return _nothing(record)
    lines += _text_table(COLUMNS, table)
    compilations = compilation_rows(record)
    if compilations:
        lines += ["", "Compilations:"] + _text_table(COMPILATION_COLUMNS, compilations)
        largest = largest_graph(record)
        lines += [largest] if largest else []
    line = summary(record)
    if line:
        lines += ["", line]
    lines += _notes(record)
    return "\n".join(lines)


def _text_table(columns: tuple[str, ...], table: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [list(columns)] + table) for i in range(len(columns))]
    return ["  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [list(columns)] + table]


def report_html(record: RunRecord) -> str:
    table = rows(record)
    if not table:
        return f'<div class="xla-report">{html.escape(_nothing(record))}</div>'

    def table_html(columns: tuple[str, ...], body: list[list[str]], kind: str) -> str:
        head = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
        cells = "".join(
            f'<tr class="xla-{kind}">' + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in body
        )
        return f'<table class="xla-{kind}s"><tr>{head}</tr>{cells}</table>'

    parts = [STYLE, '<div class="xla-report">', f"<h4>What XLA did in run {record.run_id}</h4>",
             table_html(COLUMNS, table, "ranks")]
    compilations = compilation_rows(record)
    if compilations:
        parts += ["<h4>Compilations</h4>", table_html(COMPILATION_COLUMNS, compilations, "compilation")]
        largest = largest_graph(record)
        if largest:
            parts.append(f'<div class="xla-note">{html.escape(largest)}</div>')
    line = summary(record)
    if line:
        parts.append(f'<div class="xla-summary">{html.escape(line)}</div>')
    parts += [f'<div class="xla-note">{html.escape(note)}</div>' for note in _notes(record)]
    parts.append("</div>")
    return "".join(parts)


STYLE = """<style>
.xla-report table { border-collapse: collapse; font-size: var(--jp-code-font-size, 13px); margin-bottom: 6px; }
.xla-report table th { text-align: left !important; font-weight: 600; padding: 2px 12px 2px 0; white-space: nowrap;
  border-bottom: 1px solid var(--jp-border-color2, #ccc); }
.xla-report table td { text-align: left !important; padding: 2px 12px 2px 0; vertical-align: top; white-space: nowrap;
  font-family: var(--jp-code-font-family, monospace); }
.xla-report table.xla-compilations td:nth-child(3), .xla-report table.xla-compilations td:nth-child(4) {
  white-space: normal; min-width: 12em; max-width: 22em; }
.xla-report h4 { margin: 6px 0 4px 0; }
.xla-report .xla-summary { color: #b45309; margin: 4px 0; }
.xla-report .xla-note { color: var(--jp-ui-font-color2, #666); font-size: 90%; }
</style>"""


def _nothing(record: RunRecord) -> str:
    if record.xla_report == "off":
        return f"run {record.run_id} collected no account of what XLA did (--xla-report off)"
    return f"run {record.run_id}: no rank sent an account of what XLA did (it did not run to its end)"


def _notes(record: RunRecord) -> list[str]:
    notes = []
    found = groups(record)
    if any(group.account.get("analysis") == "user" for group in found):
        notes.append("causes: not known, because PT_XLA_DEBUG_LEVEL / PT_XLA_DEBUG_FILE are set by you "
                     "(torch_xla's own output goes where you asked)")
    if any(group.account.get("cannot_load") for group in found):
        notes.append("loaded: this torch_xla cannot load what the compile cache holds here, so each graph it "
                     "held compiled again: XLA:CPU never can (there the cache only exercises the TPU's path), "
                     "and torch_xla 2.8 and 2.9 cannot on a TPU either (pytorch/xla#9094), where a kept pool "
                     "(%xla_pool start --keep) is how compiled graphs survive a kernel restart")
    if any(group.shared for group in found):
        notes.append("rank threads of one process share torch_xla's counters: their row counts them together")
    return notes


class Report:
    """The full report, shown as HTML in a notebook and text elsewhere."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record

    def _repr_html_(self) -> str:
        return report_html(self.record)

    def __repr__(self) -> str:
        return report_text(self.record)


def show(report: Report, text: bool = False) -> None:
    """The report as a table in a notebook, as text in a terminal (or with ``text``)."""
    from IPython import get_ipython

    if text or not in_notebook(get_ipython()):
        print(repr(report), flush=True)
    else:
        from IPython.display import display

        display(report)


def say(line: str) -> None:
    """One line under the cell: its own output in a notebook, so a progress bar's last ``\r`` line
    in the cell's stream cannot swallow it; printed in a terminal."""
    from IPython import get_ipython

    if in_notebook(get_ipython()):
        from IPython.display import display

        display({"text/plain": line}, raw=True)
    else:
        print(line, flush=True)


def after_cell(record: RunRecord) -> None:
    """Under the cell, however it ended: the summary line (auto) or the full report (full); nothing when off.

    A fault here must never cost the cell its own result or error: it is said in one line instead.
    """
    try:
        if record.xla_report == "full":
            if groups(record):
                show(Report(record))
        elif record.xla_report == "auto":
            line = summary(record)
            if line:
                say(line)
    except Exception as exc:  # a malformed account, a display that fails
        print(f"(xla_magic could not tell what XLA did: {type(exc).__name__}: {exc})", flush=True)


def rank_facts(state: Any) -> str:
    """A rank's account in a few words, for %xla_status."""
    account = state.xla
    if account is None:
        return "idle" if state.state == "done" else ""
    parts = [f"{account['compiles']} compiled ({_seconds(account['compile_seconds'])})"]
    if account.get("loaded"):
        parts.append(f"{account['loaded']} loaded ({_seconds(account['load_seconds'])})")
    if account["transfers"]:
        parts.append(f"{account['transfers']} syncs")
    fallbacks = sum(account["fallbacks"].values())
    if fallbacks:
        parts.append(f"{fallbacks} fallbacks")
    return ", ".join(parts)
