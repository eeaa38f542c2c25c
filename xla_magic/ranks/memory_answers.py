"""What holds each device's memory, asked of a set of ranks: their MEMORY answers. Runs in the kernel and in each
host's engine.

Each rank's stack sampler answers protocol.MEMORY from a thread of its own
(launcher/stacks.py, launcher/memory.py), so the ranks answer between cells
and while a cell runs, without a sync or a compile. Between cells the
answers are read here; while a request runs, its own reader hands them over
(``take``, from runs/events.py). ``%xla_memory`` shows them (notebook/memory_view.py).
"""

from __future__ import annotations

import selectors
import threading
import time
from typing import Any

from xla_magic.wire import protocol

ANSWER_WAIT = 10.0  # seconds a rank gets to walk its names (a gc walk of a large process takes a while)

_answers: dict[int, dict[int, dict[str, Any]]] = {}  # probe -> rank -> answer, filled by a running request's reader
_lock = threading.Lock()
_probes = 0


def take(rank: int, fields: dict[str, Any]) -> None:
    """A MEMORY answer that a running request's reader met (runs/events.py): kept for the probe that asked."""
    with _lock:
        if fields.get("probe") in _answers:
            _answers[fields["probe"]][rank] = fields


def ask(pool: Any, ranks: list[int], full: int) -> dict[int, dict[str, Any]]:
    """Each of ``ranks``' answers (``unanswered`` where none came); rank ``full`` lists its holders, the others
    send their totals (without the walk over every object for unnamed tensors)."""
    global _probes
    conns = pool.ranks
    with _lock:
        _probes += 1
        probe = _probes
        _answers[probe] = {}
    running = pool.state == "running"  # its request reads the samplers' sockets: answers come through take()
    asked = []
    for rank in ranks:
        frame = protocol.encode(protocol.MEMORY, probe=probe, full=rank == full)
        sock = conns.samplers[rank].sock if rank < len(conns.samplers) else None
        if sock is None or sock.fileno() < 0:
            continue
        try:
            sock.send(frame)
        except OSError:
            continue
        asked.append(rank)
    deadline = time.monotonic() + ANSWER_WAIT
    try:
        if running:
            while time.monotonic() < deadline and len(_answers[probe]) < len(asked):
                time.sleep(0.02)  # (a polling loop: the request's reader fills the answers)
        else:
            _read(conns, asked, probe, deadline)
        with _lock:
            found = dict(_answers[probe])
    finally:
        with _lock:
            _answers.pop(probe, None)
    for rank in ranks:
        found.setdefault(rank, {"unanswered": "it did not answer (busy in native code that holds the GIL, or gone)"})
    return found


def _read(conns: Any, asked: list[int], probe: int, deadline: float) -> None:
    with selectors.DefaultSelector() as selector:
        for rank in asked:
            selector.register(conns.samplers[rank].sock, selectors.EVENT_READ, conns.samplers[rank])
        while len(_answers[probe]) < len(asked) and time.monotonic() < deadline:
            for key, _mask in selector.select(max(0.0, deadline - time.monotonic())):
                conn = key.data
                for event in conn.reader.feed(conn.receive() or b""):
                    if event.kind == protocol.MEMORY and event.fields.get("probe") == probe:
                        _answers[probe][conn.rank] = event.fields
