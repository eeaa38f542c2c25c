"""``%xla_memory``: what holds each device's memory, named, asked of a pool's ranks. Runs in the kernel.

Each rank's stack sampler answers protocol.MEMORY from a thread of its own
(launcher/stacks.py, launcher/memory.py), so the ranks answer between cells
and while a cell runs, without a sync or a compile; ranks/memory_answers.py
asks them. This shows the answers. The largest compiled graph's own needs come
from the XLA accounts the kernel already holds (the cells' records).
XLA-free, like the rest of the kernel.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from xla_magic.ranks.memory_answers import ask

SHOWN = 20  # holders listed for the rank shown in full
KINDS = ("parameters", "gradients", "optimizer state", "other")
GRAPH_PARTS = (("inputs", "arguments"), ("outputs", "outputs"), ("temporaries", "temporaries"), ("program", "program"))

def human(size: float) -> str:
    """Bytes as XLA writes them: 196.00M, 1.50G, 512B."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f}{unit}"
    return f"{int(size)}B"


def largest_graph(history: list[Any], rank: int) -> tuple[Any, dict[str, Any]] | None:
    """The compiled graph with the largest needs among the cells the kernel remembers, on ``rank``: (record, compilation)."""
    best = None
    for record in history:
        state = record.ranks.get(rank)
        account = state.xla if state is not None else None
        for compilation in (account or {}).get("compilations", ()):
            size = sum((compilation.get("memory") or {}).values())
            if size and (best is None or size > best[0]):
                best = (size, record, compilation)
    return (best[1], best[2]) if best else None


def report(pool: Any, history: list[Any], rank: int | None) -> list[str]:
    """``%xla_memory``'s lines: one rank's holders in full (``rank``, or 0), every asked rank's totals."""
    if pool is None:
        raise UsageError("no pool is running: %xla_memory asks a pool's ranks what holds their device memory; "
                         "start one with %xla_pool start [--devices N]")
    across_hosts = not (hasattr(pool, "ranks") and hasattr(pool.ranks, "samplers"))  # asked through each host's engine
    size = pool.world_size
    if rank is not None and not 0 <= rank < size:
        raise UsageError(f"--rank must be between 0 and {size - 1} (the pool has {size} ranks)")
    if pool.state not in ("ready", "running"):
        raise UsageError(f"the pool is {pool.state}, so its ranks cannot answer: %xla_pool restart starts it anew")
    if across_hosts and pool.state == "running":
        raise UsageError("a pool across hosts answers %xla_memory between cells (its hosts' engines run the cell "
                         "now): ask again when the cell has finished")
    wanted = [rank] if rank is not None else list(range(1 if pool.one_value else size))
    shown = rank if rank is not None else wanted[0]
    if across_hosts:
        found = pool.memory_now(shown)
        answers = {asked: found.get(asked) or {"unanswered": "its host's pool did not answer"} for asked in wanted}
    else:
        answers = ask(pool, wanted, shown)
    lines = _rank_lines(shown, answers[shown], pool.label(shown))
    graph = largest_graph(history, shown)
    if graph is not None:
        record, compilation = graph
        memory = compilation["memory"]
        where = f"cell {record.run_id}" + (f", line {compilation['line']}: {compilation['code']}" if compilation.get("line") else "")
        lines.append(f"The largest compiled graph ({where}) needs: "
                     + ", ".join(f"{label} {human(memory[key])}" for key, label in GRAPH_PARTS if key in memory))
    if len(wanted) > 1:
        lines.append("Every rank:")
        for other in wanted:
            lines.append("  " + _one_line(pool.label(other), answers[other]))
    return lines


def _rank_lines(rank: int, answer: dict[str, Any], label: str) -> list[str]:
    if "unanswered" in answer or "unreadable" in answer:
        why = answer.get("unanswered") or f"its names changed while they were read ({answer['unreadable']}); ask again"
        return [f"Device memory of {label}: not read: {why}."]
    device = answer.get("device") or {}
    head = f"Device memory of {label}"
    if device:
        head += (f": {human(device.get('bytes_used', 0))} used of {human(device.get('bytes_limit', 0))}, "
                 f"peak {human(device.get('peak_bytes_used', 0))}")
    holders = answer.get("holders", [])
    lines = [head, f"{len(holders) if answer.get('count', 0) <= len(holders) else answer['count']} tensors "
                   f"(sizes as numel × element size, and laid out in a TPU's default tiles):"]
    for holder in holders[:SHOWN]:
        shape = f"{holder['dtype']}[{', '.join(map(str, holder['shape']))}]"
        pending = "  (not computed yet: no buffer)" if holder.get("pending") else ""
        made = f"  ({holder['made']})" if holder.get("made") else ""  # an unnamed tensor's cell and sync line
        # (a 64-bit type has no native TPU layout: its size there is the simulation's estimate)
        estimate = "  (on a TPU: an estimate)" if holder.get("estimate") else ""
        lines.append(f"  {human(holder['bytes']):>9} {human(holder['padded']):>9} on a TPU  {holder['name']}  "
                     f"{shape}  {holder['kind']}{pending}{made}{estimate}")
    if answer.get("count", 0) > SHOWN:
        lines.append(f"  ... and {answer['count'] - SHOWN} smaller")
    totals = answer.get("totals", {})
    lines.append("By kind (on a TPU): " + ", ".join(f"{kind} {human(totals.get(kind, 0))}" for kind in KINDS))
    return lines


def _one_line(label: str, answer: dict[str, Any]) -> str:
    if "unanswered" in answer or "unreadable" in answer:
        return f"{label}: not read ({answer.get('unanswered') or answer['unreadable']})"
    totals = answer.get("totals", {})
    device = answer.get("device") or {}
    used = f"{human(device['bytes_used'])} of {human(device['bytes_limit'])} used; " if "bytes_used" in device else ""
    return f"{label}: {used}" + ", ".join(f"{kind} {human(totals.get(kind, 0))}" for kind in KINDS)


# --- the line under the cell ----------------------------------------------------------------

NEAR_LIMIT = 0.8  # a cell whose peak passes this share of a device's limit says so even if XLA did nothing in it


def compact(size: float) -> str:
    """Bytes in binary units with one decimal, as the panel writes them: 928.0 KiB, 1.2 GiB, 512 B."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def cell_peaks(record: Any) -> dict[int, tuple[int, int]]:
    """Each rank's peak during the cell and its device's limit, from the samples its rank sent (rank.MemoryReporter)."""
    peaks = {}
    for rank, state in record.ranks.items():
        memory = state.memory or {}
        if "cell_peak_bytes" in memory:
            peaks[rank] = (memory["cell_peak_bytes"], memory.get("bytes_limit", 0))
    return peaks


def peak_finding(record: Any, always: bool = True) -> str | None:
    """The ranks' peak during the cell for the line under it: ``peak memory 928.0 KiB`` when they agree, else
    ``peak memory 512.0 KiB–928.0 KiB (most on rank 1)``, and the share of the limit of a rank that came within
    NEAR_LIMIT of it. None where no rank used device memory, or (``always`` False: a cell in which XLA did
    nothing) where none came near its limit."""
    peaks = {rank: figures for rank, figures in cell_peaks(record).items() if figures[0] > 0}
    if not peaks:
        return None
    nearest = max(sorted(peaks), key=lambda r: peaks[r][0] / peaks[r][1] if peaks[r][1] else 0.0)
    peak, limit = peaks[nearest]
    near = bool(limit) and peak >= NEAR_LIMIT * limit
    if not (always or near):
        return None
    low, high = compact(min(p for p, _l in peaks.values())), compact(max(p for p, _l in peaks.values()))
    said = []
    if low == high:
        text = f"peak memory {high}"
    else:
        text = f"peak memory {low}–{high}"
        said.append(f"most on rank {max(sorted(peaks), key=lambda r: peaks[r][0])}")
    if near:
        said.append(f"{peak * 100 // limit}% of rank {nearest}'s {compact(limit)}: %xla_memory names what holds it")
    return text + (f" ({'; '.join(said)})" if said else "")
