"""Where each rank is, told: stacks grouped by rank, and whether they can only be a hang. Runs in the kernel.

Reads the ranks' answers to protocol.STACKS (launcher/stacks.py: each
frame as (file, line, function, code, is a cell line), innermost first,
and what the innermost call is doing). Ranks with the same stack collapse
into one block (``ranks 0-6``), the odd ones out first; the cell's frames
show at their cell line numbers, a run of library frames folds to one line
unless ``everything`` is asked for. XLA-free, like the rest of the kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Callable

GIL_BUSY = "busy in native code that holds the GIL"
PROMPTS = ("debugger", "input")  # a rank's phase while it waits at the kernel's prompt (launcher/debugger.py)
CELL_FRAME = "<xla_spawn cell"
PYSPY_TIMEOUT = 10.0


def listed(ranks: list[int]) -> str:
    """0, 1, 2, 5 -> ``0-2, 5``."""
    ranks = sorted(ranks)
    parts: list[str] = []
    start = prev = None
    for rank in ranks + [None]:
        if rank is not None and prev is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}" if prev > start + 1 else f"{start}, {prev}")
        start = prev = rank
    return ", ".join(parts)


def who(ranks: list[int], one_value: bool = False, label: Callable[[int], str] | None = None) -> str:
    """``rank 3``, ``ranks 0-6``, ``the SPMD process``; on several hosts each rank's own tag."""
    if one_value:
        return "the SPMD process"
    if label is not None and not label(ranks[0]).startswith("rank"):
        return ", ".join(label(rank) for rank in sorted(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {listed(ranks)}"


def point(answer: dict[str, Any]) -> tuple[str, str, int | None]:
    """(kind, call, cell line) of where a rank is: two ranks at one point wait for the same thing."""
    if answer.get("unanswered"):
        return ("unanswered", "", None)
    if answer.get("phase") in ("closing", "idle", "finished", "failed"):
        return ("finished", "", None)
    doing = answer.get("doing") or {}
    if answer.get("phase") in PROMPTS:  # at the kernel's prompt: the user's, never a hang
        return ("prompt", answer["phase"], doing.get("line"))
    return (doing.get("kind", "python"), doing.get("call") or "", doing.get("line"))


def summary(answer: dict[str, Any]) -> str:
    """What a rank is doing, in a few words: ``waiting in xm.all_reduce (line 3)``."""
    if answer.get("unanswered"):
        return f"did not answer: {answer['unanswered']}"
    phase = answer.get("phase")
    if phase in ("closing", "finished"):
        return "finished the cell"
    if phase == "idle":
        return "idle (no cell running)" if answer.get("between_cells") else "finished the cell"
    if phase == "failed":
        return "failed (its error is above)"
    if phase == "setup":
        return "starting (setting up its device)"
    kind, call, line = point(answer)
    at = f"line {line}" if line is not None else "outside the cell's lines"
    if kind == "prompt":
        if call == "debugger":
            return f"in the debugger ({at if line is not None else 'post-mortem'})"
        return f"waiting for input ({at})"
    if kind == "collective":
        return f"waiting in {call} ({at})"
    if kind == "sync":
        return f"in {call} ({at}): compiling or running on the device"
    if kind == "transfer":
        return f"copying to the host in {call} ({at}): waits for the device"
    if kind == "sleep":
        return f"sleeping in {call} ({at})"
    return f"running Python ({at}{', in ' + call if call else ''})"


def short_file(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "/xla_magic/" in path:
        return "xla_magic/" + path.rsplit("/xla_magic/", 1)[1]
    return path


def frame_lines(frames: list[Any], everything: bool = False,
                locals_: dict[int, list[tuple[str, str]]] | None = None) -> list[str]:
    """A stack as lines, outermost first: cell lines with their code, library runs folded (unless ``everything``).

    ``locals_``: by frame index (innermost 0), the names shown under that cell line.
    """
    frames = [tuple(frame) for frame in frames]
    indexes = list(reversed(range(len(frames))))
    outer = list(reversed(frames))
    if not everything:
        first_cell = next((i for i, frame in enumerate(outer) if frame[4]), None)
        if first_cell is None:
            return []
        outer, indexes = outer[first_cell:], indexes[first_cell:]
    lines: list[str] = []
    run: list[tuple] = []

    def fold() -> None:
        if not run:
            return
        names = " > ".join(frame[2] for frame in run[:3]) + (" > ..." if len(run) > 3 else "")
        where = short_file(run[-1][0])
        count = f"{len(run)} library frames" if len(run) > 1 else "library frame"
        lines.append(f"    {names}  ({count}, innermost {where}:{run[-1][1]} in {run[-1][2]})")
        run.clear()

    for index, (file, line, function, code, is_cell) in zip(indexes, outer):
        if is_cell:
            fold()
            inside = "" if function == "<module>" else f" in {function}"
            lines.append(f"    line {line}{inside}: {code}")
            if locals_ is not None:
                lines.extend(f"        {name} = {value}" for name, value in locals_.get(index, ()))
        elif everything:
            lines.append(f"    {short_file(file)}:{line} in {function}" + (f": {code}" if code else ""))
        else:
            run.append((file, line, function, code, is_cell))
    fold()
    return lines


def block_lines(answer: dict[str, Any], everything: bool = False, with_locals: bool = False) -> list[str]:
    """A rank's stack and the threads its cells left running, without the rank's name."""
    lines = [summary(answer)]
    if answer.get("pyspy"):
        lines.append("    py-spy dump, native frames included:")
        lines.extend(f"      {line}" for line in answer["pyspy"].rstrip().splitlines())
    lines.extend(frame_lines(answer.get("frames", ()), everything, answer.get("locals", {}) if with_locals else None))
    for thread in answer.get("threads", ()):
        lines.append(f"  thread {thread['name']!r}: {summary({'phase': 'cell', 'doing': thread.get('doing')})}")
        lines.extend(frame_lines(thread.get("frames", ()), everything))
    return lines


def render(where: dict[int, dict[str, Any]], ranks: list[int] | None = None, everything: bool = False,
           one_value: bool = False, label: Callable[[int], str] | None = None, with_locals: bool = False) -> list[str]:
    """Every rank's block; ranks with identical blocks in one, the odd ones first."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(where if ranks is None else [r for r in ranks if r in where]):
        groups.setdefault(tuple(block_lines(where[rank], everything, with_locals)), []).append(rank)
    lines: list[str] = []
    for body, members in sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0])):
        lines.append(f"{who(members, one_value, label)}: {body[0]}")
        lines.extend(body[1:])
    return lines


def hang(where: dict[int, dict[str, Any]], waited: dict[int, float], hang_after: float, confirm: float,
         one_value: bool = False, label: Callable[[int], str] | None = None) -> str | None:
    """The watchdog's line, where the ranks' places can only be a hang; None while they may still move.

    ``waited``: how long each rank has been where it is. Some ranks finished
    while others wait in a collective (seen there for ``confirm`` s): it never
    completes. Ranks at different collectives or sync points for ``hang_after``:
    they never meet. Every rank in the same collective for ``hang_after``: a
    likely hang. A compile, a device op or a sleep on every rank is never one.
    """
    points = {rank: point(answer) for rank, answer in where.items()}
    if any(spot[0] == "prompt" for spot in points.values()):
        return None  # a rank waits for its user (pdb, input()): the others wait for it, as they would on a TPU
    finished = sorted(rank for rank, at in points.items() if at[0] == "finished")
    waiting = {rank: at for rank, at in points.items() if at[0] in ("collective", "sync", "transfer")}
    others = [rank for rank in points if rank not in finished and rank not in waiting]

    def name(ranks: list[int]) -> str:
        return who(ranks, one_value, label)

    def at(spot: tuple[str, str, int | None]) -> str:
        return f"{spot[1]} (line {spot[2]})" if spot[2] is not None else spot[1]

    by_point: dict[tuple, list[int]] = {}
    for rank, spot in waiting.items():
        by_point.setdefault(spot, []).append(rank)

    def waits(ranks: list[int], spot: tuple) -> str:
        seconds = min(waited.get(rank, 0.0) for rank in ranks)
        verb = "has" if len(ranks) == 1 else "have"
        return f"{name(ranks)} {verb} waited {seconds:.0f} s in {at(spot)}"

    ended = f"{name(finished)} finished the cell" if finished else ""
    if finished and waiting:
        stuck = {spot: ranks for spot, ranks in by_point.items()
                 if spot[0] == "collective" and min(waited.get(r, 0.0) for r in ranks) >= confirm}
        if stuck:
            said = "; ".join(waits(ranks, spot) for spot, ranks in stuck.items())
            return (f"xla_magic: {said}; {ended}. A collective that only some ranks make never completes; "
                    f"interrupt to stop.")
        slow = {spot: ranks for spot, ranks in by_point.items() if min(waited.get(r, 0.0) for r in ranks) >= hang_after}
        if slow:
            said = "; ".join(waits(ranks, spot) for spot, ranks in slow.items())
            return (f"xla_magic: likely a hang: {said}; {ended}. On a TPU a sync that holds a collective the "
                    f"finished ranks skipped never completes; interrupt to stop.")
        return None
    if others and not finished:
        return _wait_elsewhere(points, others, by_point, waited, hang_after, name, waits)
    if others or not waiting or finished:
        return None  # a rank runs Python or sleeps: it may yet reach the others
    if min(waited.get(rank, 0.0) for rank in waiting) < hang_after:
        return None
    said = "; ".join(waits(ranks, spot) for spot, ranks in sorted(by_point.items(), key=lambda i: min(i[1])))
    kinds = {spot[0] for spot in by_point}
    if len(by_point) > 1 and "collective" in kinds:
        collectives = [spot for spot in by_point if spot[0] == "collective"]
        certain = len(collectives) == len(by_point)
        return (f"xla_magic: {'' if certain else 'likely a hang: '}{said}. Ranks waiting at different collectives "
                f"or sync points never meet; interrupt to stop.")
    if len(by_point) == 1 and kinds == {"collective"}:
        return (f"xla_magic: likely a hang: {said}, with no progress. A collective takes far less when every "
                f"rank is in it; interrupt to stop (the error shows where each rank was), or raise --hang-after.")
    return None  # every rank compiling, running on the device or copying: only slow


def _wait_elsewhere(points: dict[int, tuple], others: list[int], by_point: dict[tuple, list[int]],
                    waited: dict[int, float], hang_after: float, name: Callable[[list[int]], str],
                    waits: Callable[[list[int], tuple], str]) -> str | None:
    """Ranks in a collective past ``hang_after`` while others are elsewhere: a wait while they run, named as one;
    with a rank that does not answer (native code holding the GIL), both, as a likely hang."""
    long = {spot: ranks for spot, ranks in by_point.items()
            if spot[0] == "collective" and min(waited.get(rank, 0.0) for rank in ranks) >= hang_after}
    if not long:
        return None
    said = "; ".join(waits(ranks, spot) for spot, ranks in sorted(long.items(), key=lambda item: min(item[1])))
    silent = sorted(rank for rank in others if points[rank][0] == "unanswered")
    running = sorted(rank for rank in others if rank not in silent)
    parts = [said]
    for rank in running:
        kind, call, line = points[rank]
        at = f"at line {line}" if line is not None else "outside the cell's lines"
        doing = f"is sleeping in {call}" if kind == "sleep" else "is running Python"
        parts.append(f"{name([rank])} {doing} {at}, not in it")
    if silent:
        seconds = min(waited.get(rank, 0.0) for rank in silent)
        verb = "has" if len(silent) == 1 else "have"
        parts.append(f"{name(silent)} {verb} not answered for {seconds:.0f} s: {GIL_BUSY}")
        return (f"xla_magic: likely a hang: {'; '.join(parts)}. Native code that never returns keeps its rank from "
                f"the collective; interrupt to stop (the error shows where each rank was).")
    return f"xla_magic: {'; '.join(parts)}. A wait while a rank works elsewhere, not a hang (yet)."


def pyspy_dump(pid: int) -> str | None:
    """py-spy's reading of a process from outside, native frames included; None without py-spy."""
    tool = shutil.which("py-spy") or _beside_python("py-spy")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PYSPY_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy could not read process {pid}: {exc})"
    if done.returncode != 0:
        return f"(py-spy could not read process {pid}: {(done.stderr or done.stdout).strip()})"
    return _gil_holder(done.stdout) or None


def _gil_holder(dump: str) -> str:
    """py-spy's section of the thread that holds the GIL, from its innermost frame to the cell's outermost line."""
    sections: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            sections.append([line])
        elif sections and line.strip():
            sections[-1].append(line.strip())
    if not sections:
        return dump.strip()
    section = next((s for s in sections if "+gil" in s[0]), sections[0])
    cell = [i for i, line in enumerate(section) if CELL_FRAME in line]
    return "\n".join(section[: cell[-1] + 1] if cell else section)


def pyspy_installed() -> bool:
    return (shutil.which("py-spy") or _beside_python("py-spy")) is not None


def _beside_python(name: str) -> str | None:
    import sys

    candidate = os.path.join(os.path.dirname(sys.executable), name)
    return candidate if os.access(candidate, os.X_OK) else None
