"""torch_xla's compilation analysis, written to a private file per process and parsed. Runs in a rank.

``claim_analysis`` points the analysis (``PT_XLA_DEBUG_LEVEL=1``) at a
private file per process before the runtime first compiles (torch_xla
reads the variables once); a user who set the variables keeps torch_xla's
own output. ``parse_analysis`` turns its blocks into one dict per
compilation: cause, graph hash, inputs, the Python frames that triggered
it, and the post-compilation analysis's sizes (memory). The account of a
cell (xla_account.py) reads what the file gained during the cell.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from typing import Any

# Set by a user, these give torch_xla's own debug output: then we set nothing.
DEBUG_VARIABLES = ("PT_XLA_DEBUG", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE")
# Frames the analysis keeps per compilation (torch_xla's default is 8): a sync deep in a library still reaches the cell.
ANALYSIS_FRAMES = 32
_FRAME = re.compile(r"^\s*(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")
# The post-compilation analysis's sizes (GB with six decimals: about 1 KB apart), by our name for each.
MEMORY = {"Graph input size": "inputs", "Graph output size": "outputs", "Aliased Input size": "aliased",
          "Intermediate tensor size": "temporaries", "Compiled program size": "program"}
_SIZE = re.compile(r"Post Compilation Analysis: (?P<name>[A-Za-z ]+ size): (?P<gb>[0-9.]+) GB")


# --- the analysis file --------------------------------------------------------------

_claim_lock = threading.Lock()
_claimed_pid: int | None = None
_analysis_file: str | None = None  # the path torch_xla and we open it by: through /proc, the file has no name
_analysis_fd: int | None = None  # what keeps the nameless file alive, for as long as this process lives
_user_debug: bool | None = None  # decided once, before we set anything; inherited by forks


def claim_analysis() -> str | None:
    """Have this process's compilation analysis written to a private file; its path.

    Call in each rank process before it compiles anything. None when the
    user set torch_xla's debug variables themselves (their output stays
    theirs, as without xla_magic).
    """
    global _claimed_pid, _analysis_file, _analysis_fd, _user_debug
    with _claim_lock:
        if _claimed_pid == os.getpid():
            return _analysis_file
        if _user_debug is None:
            _user_debug = any(os.environ.get(name) for name in DEBUG_VARIABLES)
        _claimed_pid = os.getpid()
        _analysis_file = None
        if _user_debug:
            return None
        descriptor, path = tempfile.mkstemp(prefix=f"xla_magic-analysis-{os.getpid()}-", suffix=".txt")
        by_descriptor = f"/proc/{os.getpid()}/fd/{descriptor}"
        if os.path.exists(by_descriptor):  # Linux: nameless, so a rank killed by SIGKILL leaves nothing in /tmp
            os.unlink(path)
            path, _analysis_fd = by_descriptor, descriptor
        else:
            os.close(descriptor)
        os.environ.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=path, PT_XLA_DEBUG_MAX_FRAME=str(ANALYSIS_FRAMES))
        _analysis_file = path
        return path


def release_analysis() -> None:
    """Let go of this process's analysis file (at the rank's end)."""
    global _analysis_file, _analysis_fd
    with _claim_lock:
        if _analysis_file is not None and _claimed_pid == os.getpid():
            try:
                if _analysis_fd is not None:
                    os.close(_analysis_fd)
                else:
                    os.unlink(_analysis_file)
            except OSError:
                pass
            _analysis_file = _analysis_fd = None


ANALYSIS_KEPT = 1 << 20  # bytes of analysis kept while no account reads it (--xla-report off)


_unread_cells = 0


def forget_analysis() -> None:
    """Keep the analysis file small while cells ask for no account: what compiled then is nobody's.

    Looks every hundredth such cell, so a cell with the report off costs nothing measurable.
    """
    global _unread_cells
    _unread_cells += 1
    path = _analysis_file
    if _unread_cells % 100:
        return
    try:
        if path is not None and os.stat(path).st_size > ANALYSIS_KEPT:
            os.truncate(path, 0)
    except OSError:
        pass


def read_analysis(path: str | None) -> str:
    """What the analysis wrote since the last read; the file is emptied for the next."""
    if path is None:
        return ""
    try:
        with open(path, "r+", errors="replace") as file:
            text = file.read()
            if text:
                file.truncate(0)
            return text
    except OSError:
        return ""


def parse_analysis(text: str) -> list[dict[str, Any]]:
    """torch_xla's compilation analysis blocks, as one dict per compilation.

    Keys: ``cause``, ``hash``, ``inputs`` (count), ``input_bytes`` (from the
    post-compilation analysis; GB with six decimals, so about 1 KB apart),
    ``memory`` (the post-compilation analysis's sizes in bytes: inputs,
    outputs, aliased, temporaries, program; empty where it printed none),
    ``frames`` ([(function, file, line)], innermost first).
    """
    compilations: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    expecting_cause = in_frames = False
    for raw in text.splitlines():
        if raw.startswith("Post Compilation Analysis: "):
            size = _SIZE.match(raw)
            name = MEMORY.get(size["name"]) if size else None
            if name and compilations and name not in compilations[-1]["memory"]:
                compilations[-1]["memory"][name] = int(float(size["gb"]) * (1 << 30))
                if name == "inputs":
                    compilations[-1]["input_bytes"] = compilations[-1]["memory"][name]
            continue
        prefix, _, body = raw.partition("Compilation Analysis: ")
        if not _ or prefix:  # not ours, or the "Unexpected Execution" kind
            continue
        content = body.strip()
        if content.startswith("=") or content.startswith("-"):
            in_frames = False
            continue
        if content == "Compilation Cause":
            current = {"cause": "", "hash": "", "inputs": None, "input_bytes": None, "memory": {}, "frames": []}
            compilations.append(current)
            expecting_cause, in_frames = True, False
        elif current is None:
            continue
        elif expecting_cause:
            current["cause"], expecting_cause = content, False
        elif content.startswith("Graph Hash:"):
            current["hash"] = content.partition(":")[2].strip()
        elif content.startswith("Number of Graph Inputs:"):
            current["inputs"] = int(content.partition(":")[2])
        elif content.startswith("Python Frame Triggered Execution"):
            in_frames = True
        elif in_frames:
            frame = _FRAME.match(body)
            if frame:
                current["frames"].append((frame["function"], frame["file"], int(frame["line"])))
    return compilations
