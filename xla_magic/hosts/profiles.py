"""``--profile`` on several hosts: each host's trace files, brought to the kernel. Runs in an engine and in the kernel.

Each host records its ranks as on one host (its runner names a folder in
its own private directory, on its own /tmp; launcher/profiling.py). Once
its cell ends, however it ended, the host's engine reads each rank
process's files (:func:`collect`) and sends them with its reply, as its
output lines travel with the cell; the kernel writes them into its own
session directory, ``profile-<run>-*/h<H>r<R>/`` with the paths the
profiler gave them under its folder (:func:`store`), so ``xprof --logdir``
and the timeline read the kernel's copies. Each lane names both. A trace a
host cannot send (its engine lost, a file over ``SEND_LIMIT``, a profiler
that wrote none) is "n/a" for those ranks; it never fails the cell.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, TypedDict

from xla_magic.ranks.naming import Numbering
from xla_magic.runs.record import RankState, RunRecord
from xla_magic.wire import trace

SEND_LIMIT = 64 << 20  # bytes of one trace file a host sends; a larger one stays on the host, named
FILES = ("trace", "xplane", "lines")  # the keys of a rank process's files in its profile (protocol.PROFILE)


class SentTrace(TypedDict):
    """One rank process's profile, as a host sends it (engine -> kernel)."""

    where: dict[str, Any]  # the rank's PROFILE fields, local ranks, the host's paths
    files: dict[str, bytes]  # by key in FILES: the file's bytes, for each one sent
    unsent: str  # why the trace is not among them ("" when it is)
    accounts: dict[int, Any]  # its ranks' XLA accounts, by local rank: the timeline names compiles as the report does


def collect(record: RunRecord | None) -> list[SentTrace]:
    """This host's profiled run's files, one entry per rank process (host side)."""
    if record is None or not record.profile:
        return []
    sent: list[SentTrace] = []
    seen: set[int] = set()
    for state in record.ranks.values():
        where = state.profile
        if where is None or id(where) in seen:
            continue
        seen.add(id(where))
        where = dict(where)
        if where.get("digest_file"):  # a pool's rank digests once it replied: it travels digested, as one-shot's do
            where["digest"] = trace.wait_digest(where)
            del where["digest_file"]
        files: dict[str, bytes] = {}
        left: list[str] = []
        for key in FILES:
            path = where.get(key) or ""
            try:
                size = os.path.getsize(path) if path else -1
                if size > SEND_LIMIT:
                    left.append(f"{path} ({size / 2**20:.0f} MiB, over the {SEND_LIMIT >> 20} MiB a host sends)")
                elif size >= 0:
                    with open(path, "rb") as file:
                        files[key] = file.read()
            except OSError as exc:
                left.append(f"{path} ({type(exc).__name__}: {exc.strerror or exc})")
        unsent = "" if "trace" in files else (
            f"the profiler did not run: {where['error']}" if where.get("error")
            else f"not sent: {'; '.join(left)}" if left else "the profiler wrote no trace.json.gz")
        accounts = {rank: record.ranks[rank].xla for rank in where.get("ranks", ()) if rank in record.ranks}
        sent.append(SentTrace(where=where, files=files, unsent=unsent, accounts=accounts))
    return sent


def store(record: RunRecord, outcomes: dict[int, Any], hosts: list[str], numbering: Numbering, folder: str) -> None:
    """Every host's sent traces into ``folder`` (kernel side), as each global rank's profile in ``record``.

    ``outcomes``: each host's reply by host index (``HostOutcome``, with its ``profile``: the SentTrace list);
    ``numbering``: which global rank each host's local rank is (ranks/naming.py)."""
    record.profile = folder
    for index, host in enumerate(hosts):
        outcome = outcomes.get(index) or {"outcome": "lost", "message": "did not answer"}
        given: set[int] = set()
        for item in outcome.get("profile") or ():
            where = _place(item, index, numbering, folder)
            for local, rank in zip(item["where"].get("ranks", ()), where["ranks"]):
                given.add(rank)
                state = record.ranks.setdefault(rank, RankState(state="done"))
                state.profile = where
                state.xla = state.xla or (item.get("accounts") or {}).get(local)
        missing = [rank for rank in numbering.ranks_of(index) if rank not in given]
        if missing:  # the host sent nothing for them: its engine lost, or its cell stopped before they ended
            why = (f"host h{index} sent no trace: {outcome.get('message') or outcome['outcome']}"
                   if outcome["outcome"] == "lost" else f"host h{index} sent no trace for them (stopped before "
                                                        f"their cell ended)")
            where = {"ranks": missing, "host": host, "host_index": index, "error": "", "unsent": why}
            for rank in missing:
                record.ranks.setdefault(rank, RankState(state="failed")).profile = where


def _place(item: SentTrace, index: int, numbering: Numbering, folder: str) -> dict[str, Any]:
    """One sent trace, written under ``folder/h<H>r<R>/``; its profile with the kernel's paths and the host's."""
    where = dict(item["where"])
    ranks = [numbering.rank(index, local) for local in where.get("ranks", ())]
    host_folder = where.get("folder") or ""
    where.update(ranks=ranks, host_index=index, on_host=f"{where.get('host', '?')}:{host_folder}",
                 unsent=item["unsent"])
    here = os.path.join(folder, f"h{index}r{ranks[0] if ranks else 'x'}")
    if isinstance(where.get("digest"), dict):  # the rank's own reading of its trace: its rows are by local rank too
        where["digest"] = dict(where["digest"], lines={numbering.rank(index, int(rank)): spans for rank, spans
                                                       in where["digest"].get("lines", {}).items()})
    for key in FILES:
        path, data = where.get(key) or "", item["files"].get(key)
        where[key] = ""
        if data is None or not path:
            continue
        if key == "lines":  # its rows are by local rank: the kernel's copy numbers them as the world does
            data = _global_lines(data, lambda local: numbering.rank(index, local))
        relative = os.path.relpath(path, host_folder) if host_folder else os.path.basename(path)
        target = os.path.join(here, relative if not relative.startswith("..") else os.path.basename(path))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as file:
            file.write(data)
        where[key] = target
    where["folder"] = here
    return where


def _global_lines(data: bytes, number: Callable[[int], int]) -> bytes:
    try:
        sampled = json.loads(data)
        sampled["ranks"] = {str(number(int(rank))): spans for rank, spans in sampled["ranks"].items()}
        return json.dumps(sampled).encode()
    except (ValueError, KeyError, TypeError):
        return data
