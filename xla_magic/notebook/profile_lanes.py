"""Each rank process's ``--profile`` lane for a cell's record, read from its digest or its files. Runs in the kernel.

The reading itself is the ranks' and the kernel's shared code (wire/trace.py);
this is the kernel's part: which profile facts a record holds, the compile
names the XLA report gives them, and a :class:`Reader` that reads traces
that came without a digest while the other ranks still run.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from xla_magic.runs.record import RunRecord
from xla_magic.wire.trace import Lane, lane


def compile_labels(account: dict[str, Any] | None) -> dict[str, str]:
    """Graph hash -> how the XLA report names the compile in a rank process's account: "line 6, x f32[5,16]"."""
    from xla_magic.notebook import xla_report

    labels = {}
    for compilation in account["compilations"] if account else ():
        if compilation["hash"]:
            where = xla_report._where(account, compilation)
            shapes = xla_report._shapes(compilation, limit=2)
            labels[compilation["hash"]] = where + (f", {shapes}" if shapes else "")
    return labels


def _labels_of(record: RunRecord, where: dict[str, Any]) -> dict[str, str]:
    """The compile names for a rank process's lane, from its own account (the one XLA event its ranks share)."""
    ranks = where.get("ranks") or ()
    state = record.ranks.get(ranks[0]) if ranks else None
    return compile_labels(state.xla if state is not None and record.xla_report != "off" else None)


def _profiles(record: RunRecord) -> list[dict[str, Any]]:
    """Where each rank process's profile is, once per process (rank threads of one process share one)."""
    seen: dict[int, dict[str, Any]] = {}
    for _rank, state in sorted(record.ranks.items()):
        if state.profile is not None:
            seen.setdefault(id(state.profile), state.profile)
    return list(seen.values())


def digests_to_come(record: RunRecord) -> bool:
    """Whether a rank process digests its trace after its reply (a pool's): reading the lanes then waits for it."""
    return any(where.get("digest_file") and not where.get("digest") for where in _profiles(record))


def lanes(record: RunRecord, reader: "Reader | None" = None) -> list[Lane]:
    """Each rank process's lane, by first rank; those ``reader`` already read are taken from it."""
    found = [reader.lane(record, where) if reader is not None else lane(where, _labels_of(record, where))
             for where in _profiles(record)]
    return sorted(found, key=lambda one: one.ranks[0] if one.ranks else -1)


class Reader:
    """The traces that came without their rank's digest, each read in a thread as soon as its rank says where it is.

    A session listener while a ``--profile`` cell runs (runner.py): the
    request tells listeners of each fact a rank sends, so a trace that the
    kernel must read itself (6-7 ms a rank: its rank sent no digest) is
    read while the slowest rank still runs (a digest still to come is waited for
    when the profile is drawn: profile_view.py). One thread reads them in turn
    (the JSON parser holds the GIL: more would not go faster). A lane with
    a digest is rebuilt at the cell's end instead (0.1-0.2 ms): a thread
    for it cost the kernel more than the rebuild itself.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._reading: dict[int, Future[Lane]] = {}  # by the id of a rank process's profile fact

    def notice(self, record: RunRecord) -> None:
        """Start reading each trace not yet being read (never raises: it runs as a listener)."""
        try:
            for where in _profiles(record):
                if id(where) not in self._reading and not where.get("digest") and not where.get("digest_file"):
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xla_magic-profile")
                    self._reading[id(where)] = self._pool.submit(lane, where, _labels_of(record, where))
        except Exception:  # a malformed fact: lanes() reads it again and says what is wrong
            pass

    def lane(self, record: RunRecord, where: dict[str, Any]) -> Lane:
        reading = self._reading.get(id(where))
        return reading.result() if reading is not None else lane(where, _labels_of(record, where))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
