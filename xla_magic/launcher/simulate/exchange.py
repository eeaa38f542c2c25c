"""How simulated ranks meet: the private gloo group, checks, metric counters. Runs in a rank.

Every simulated collective is one ``exchange``: each rank contributes the
name of the call it reached and its value, and gets every rank's, by rank.
Values are combined on the CPU in rank order afterwards, so every rank
computes bit-identical results.

The group is ``ProcessGroupGloo`` on loopback, made from a ``FileStore`` in
the run's directory (across several hosts: on each host's address, from a
``TCPStore`` on host 0) and never registered with torch.distributed, so the
default group stays the user's to make.

Counters: a TPU run bumps torch_xla's metric counters (``xla::AllReduce``
...) in its C++ collectives, which the simulation does not reach, so
``bump`` does it; and the simulation's own device/host copies, which a TPU
run would not make, are left out of what ``torch_xla.debug.metrics`` reads.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.debug.metrics as met

from xla_magic.launcher import lifetime

# As long as torch.distributed waits by default: a rank may compute for long
# between two collectives.
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass
class Simulation:
    rank: int
    world_size: int
    store_dir: str
    group: Any = None  # the private gloo group, made on the first collective
    store: Any = None  # the FileStore of the run, under the group and the channels
    calls: int = 0  # collectives this rank has entered
    # The group's generation: a collective left half done on some rank (interrupted, or waiting for a rank
    # that never came) leaves gloo's operation counters out of step between the ranks, so every rank then
    # makes a new group, under a prefix of its own, before its next collective; the old one is kept (its
    # buffers may still be written into) and never used again.
    generation: int = 0
    group_calls: int = 0  # collectives made on this generation's group
    retired: list[Any] = field(default_factory=list)
    lock: Any = field(default_factory=threading.RLock)  # one collective at a time per rank, as a TPU issues them
    own_counts: dict[str, int] = field(default_factory=dict)  # counters our own copies bumped
    # Several hosts: the world's store (a TCPStore held by global rank 0) and this host's address.
    world: dict[str, Any] | None = None

    @property
    def local_rank(self) -> int:
        return self.rank - self.world["rank_offset"] if self.world else self.rank

    @property
    def local_size(self) -> int:
        return self.world["local_size"] if self.world else self.world_size


_active: Simulation | None = None


def activate(rank: int, world_size: int, store_dir: str, world: dict[str, Any] | None = None) -> Simulation:
    """``world`` (several hosts): host, rank_offset, local_size, address, store_address, store_port."""
    global _active
    _active = Simulation(rank, world_size, store_dir, world=world)
    return _active


def sim() -> Simulation:
    if _active is None:
        raise RuntimeError("the CPU simulation is not installed in this process")
    return _active


def exchange(call: str, value: Any) -> list[Any]:
    """Every rank's ``value``, by rank, after checking all made the same call.

    A rank that waits here for one that ended its cell without making this
    call is told so, instead of waiting for ever (see ``leave``); ranks that
    reached different collectives are told so, each rank's call named. Every
    rank sends the same shapes whatever its call, and a collective left half
    done moves every rank to a new group (``_renew_if_broken``): nothing of
    one collective is ever read as another's.
    """
    state = sim()
    if state.world_size == 1:
        return [value]
    with state.lock:
        seq = state.calls
        state.calls += 1
        _mark(state, f"in\t{seq}\t{call}")
        _renew_if_broken(state)
        if state.group is None:
            _wait_for_peers(state, seq, call)
        blobs = _all_gather_bytes(state, _group(state), pickle.dumps((call, value)), seq, call)
    gathered = [pickle.loads(blob) for blob in blobs]
    calls = [name for name, _ in gathered]
    if any(name != call for name in calls):
        raise _different_collectives(calls)
    return [value for _, value in gathered]


def _different_collectives(calls: list[str]) -> RuntimeError:
    """The refusal of ranks that reached different collectives, each rank's call named."""
    listing = ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(calls))
    return RuntimeError(
        f"the ranks reached different collectives ({listing}). Every rank must make the same "
        f"collective calls in the same order; on a TPU this hangs."
    )


def _broken_key(generation: int) -> str:
    return f"xla_magic/sim/broken/{generation}"


def _renew_if_broken(state: Simulation) -> None:
    """Where some rank left a collective of this generation's group half done, move to a new group."""
    if state.group is None and state.generation == 0 and state.group_calls == 0:
        return  # no group made yet: nothing to be out of step with
    store = file_store(state)
    while store.check([_broken_key(state.generation)]):
        if state.group is not None:
            state.retired.append(state.group)
        state.group = None
        state.generation += 1
        state.group_calls = 0


def _break(state: Simulation) -> None:
    """This rank leaves a collective of its group half done: every rank moves to a new group."""
    try:
        file_store(state).set(_broken_key(state.generation), b"1")
    except Exception:  # (the store gone: the run is ending)
        pass


def leave(closing: Callable[[], None]) -> Callable[[], None]:
    """``closing`` (the barrier ranks leave a cell through), first refusing to
    leave while another rank waits in a collective this rank never made."""

    def checked_closing() -> None:
        state = sim()
        if state.world_size > 1:
            _mark(state, f"end\t{state.calls}")
            delay = 0.0005
            while not _everyone_ended(state):
                time.sleep(delay)
                delay = min(2 * delay, 0.01)
        closing()

    return checked_closing


def closing_across_hosts(run_id: int) -> Callable[[], None]:
    """One-shot ranks of several hosts leave a cell through a barrier on the world's store.

    Global rank 0 holds that store (a TCPStore on host 0), so it leaves
    last, once every other rank said it is through.
    """

    def closing() -> None:
        state = sim()
        if state.world_size == 1:
            return
        store = file_store(state)
        arrived, everyone_in, through = (f"closing/{run_id}/{key}" for key in ("arrived", "open", "through"))
        if store.add(arrived, 1) == state.world_size:
            store.set(everyone_in, b"1")
        store.wait([everyone_in])
        if state.rank != 0:
            store.add(through, 1)
            return
        delay = 0.0005
        while store.add(through, 0) < state.world_size - 1:
            time.sleep(delay)
            delay = min(2 * delay, 0.01)

    return closing


def _everyone_ended(state: Simulation) -> bool:
    ended = True
    for peer, mark in _marks(state).items():
        fields = mark.split("\t")
        if fields[0] == "end":
            continue
        ended = False
        if fields[0] == "in" and int(fields[1]) >= state.calls:
            raise RuntimeError(
                f"rank {peer} waits in {fields[2]} (its collective #{int(fields[1]) + 1}), which rank "
                f"{state.rank} ended its cell without making. Every rank must make the same collective "
                f"calls; on a TPU this hangs."
            )
    return ended


def _check_peers(state: Simulation, seq: int, call: str) -> None:
    """Refuse to go on waiting in collective ``seq`` for a rank that has ended."""
    for peer, mark in _marks(state).items():
        fields = mark.split("\t")
        if fields[0] == "end" and int(fields[1]) <= seq:
            raise RuntimeError(
                f"rank {state.rank} waits in {call} (its collective #{seq + 1}), but rank {peer} ended "
                f"its cell without making it. Every rank must make the same collective calls; on a TPU "
                f"this hangs."
            )


def _wait_for_peers(state: Simulation, seq: int, call: str) -> None:
    # Making the gloo group blocks until every rank makes it; wait until each
    # has at least entered a collective, or refuse if one has ended.
    while True:
        _check_peers(state, seq, call)
        marks = _marks(state)
        if len(marks) == state.world_size - 1:
            return
        time.sleep(0.005)


def _mark_key(rank: int) -> str:
    return f"xla_magic/at/{rank}"


def _mark(state: Simulation, text: str) -> None:
    file_store(state).set(_mark_key(state.rank), text.encode())


def _marks(state: Simulation) -> dict[int, str]:
    """What each other rank last did: ``in <seq> <call>`` or ``end <calls>``."""
    store = file_store(state)
    marks = {}
    for peer in range(state.world_size):
        key = _mark_key(peer)
        if peer != state.rank and store.check([key]):
            marks[peer] = store.get(key).decode()
    return marks


def file_store(state: Simulation) -> Any:
    """The run's store: a file in the run's directory on one host; across hosts (no
    file is shared there) a TCPStore that global rank 0 holds on host 0's address."""
    if state.store is None:
        if state.world:
            address, port = state.world["store_address"], state.world["store_port"]
            state.store = dist.TCPStore(
                address, port, state.world_size, is_master=state.rank == 0, timeout=GROUP_TIMEOUT,
                wait_for_workers=False, master_listen_fd=_listener(address, port) if state.rank == 0 else None,
            )
        else:
            state.store = dist.FileStore(os.path.join(state.store_dir, "simulation"), state.world_size)
        state.store.set_timeout(GROUP_TIMEOUT)
    return state.store


def _listener(address: str, port: int) -> int:
    """A socket listening on ``address`` only, for the store's server, which owns it from then on.

    Given a port alone, TCPStore's server listens on every interface, and it has no authentication."""
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(socket.SOMAXCONN)
    return listener.detach()


def post(channel: int, blob: bytes) -> None:
    """Leave ``blob`` as the next message on ``channel`` (xm.send)."""
    store = file_store(sim())
    store.set(_next_key(store, "sent", channel), blob)


def take(channel: int) -> bytes:
    """Wait for the next message on ``channel`` and take it (xm.recv)."""
    store = file_store(sim())
    key = _next_key(store, "taken", channel)
    store.wait([key])
    blob = store.get(key)
    store.delete_key(key)
    return blob


def _next_key(store: Any, side: str, channel: int) -> str:
    # The n-th message sent on a channel, by any rank, is the n-th one taken.
    count = store.add(f"xla_magic/channel/{channel}/{side}", 1) - 1
    return f"xla_magic/channel/{channel}/{count}"


def _group(state: Simulation) -> Any:
    """The run's private gloo group, on loopback; made on first use, and again after a break
    (``generation``), each under a store prefix no other group of the run uses."""
    if state.group is None:
        if state.generation:
            _wait_for_renewal(state)
        store = dist.PrefixStore(f"xla_magic/sim/{state.generation}", file_store(state))
        options = dist.ProcessGroupGloo._Options()
        # Across hosts gloo binds to the host's own address; on one host, to loopback.
        device = (dist.ProcessGroupGloo.create_device(hostname=state.world["address"]) if state.world
                  else dist.ProcessGroupGloo.create_device(interface="lo"))
        options._devices = [device]
        options._timeout = GROUP_TIMEOUT
        # gloo prints "[Gloo] Rank N is connected to M peer ranks" on fd 1
        # whatever the log level; keep it out of the cell.
        with lifetime.silenced_stdout():
            state.group = dist.ProcessGroupGloo(store, state.rank, state.world_size, options)
    return state.group


def _wait_for_renewal(state: Simulation) -> None:
    """Before a new generation's group is made (which blocks, where no interrupt reaches, until every rank
    makes it): wait here, interruptibly, until every rank has come to make it."""
    store = file_store(state)
    keys = [f"xla_magic/sim/renewing/{state.generation}/{rank}" for rank in range(state.world_size)]
    store.set(keys[state.rank], b"1")
    delay = 0.0005
    while not store.check(keys):
        time.sleep(delay)
        delay = min(2 * delay, 0.01)


def _all_gather_bytes(state: Simulation, group: Any, blob: bytes, seq: int, call: str) -> list[bytes]:
    """Every rank's bytes, by rank: each rank's length and its collective's number on this group first (every
    rank sends the same shape there, whatever its call), then the bytes padded to the longest.

    Left half done (an interrupt, a rank that never came), the group is out of step between the ranks:
    ``_break`` moves every rank to a new one, and ranks that find their numbers differ say so."""
    done = False
    try:
        mine = torch.tensor([len(blob), state.group_calls], dtype=torch.int64)
        heads = [torch.empty_like(mine) for _ in range(group.size())]
        _wait(state, group.allgather([heads], [mine]), seq, call)
        state.group_calls += 1
        if any(int(head[1]) != state.group_calls - 1 for head in heads):
            raise RuntimeError(
                f"the simulated collectives are out of step between the ranks at {call} (collective numbers "
                f"{', '.join(f'rank {rank}: {int(head[1]) + 1}' for rank, head in enumerate(heads))}); they "
                f"start again in step at the next collective.")
        sizes = [int(head[0]) for head in heads]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        if blob:
            padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        everyone = [torch.empty_like(padded) for _ in sizes]
        group.allgather([everyone], [padded]).wait()  # every rank is in this exchange now
        state.group_calls += 1
        done = True
        return [bytes(t[:size].numpy()) for t, size in zip(everyone, sizes)]
    finally:
        if not done:
            _break(state)


def _wait(state: Simulation, work: Any, seq: int, call: str) -> None:
    """``work.wait()``, looking every 0.2 s for a rank that ended instead. Woken by the work's own completion,
    not by polling it: a poll that backs off wakes up to its last sleep late (it was up to 10 ms), and in a
    pool whose ranks take turns on few cores every rank a little late at a collective made it that much later."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _future: done.set())
    looked = time.monotonic()
    while not done.wait(0.05):  # in turns: an interrupt sent to a rank's thread lands between them
        if time.monotonic() - looked > 0.2:
            _check_peers(state, seq, call)
            looked = time.monotonic()
    work.wait()


# --- tensors in and out --------------------------------------------------------


def host_copies(call: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of XLA tensors, computed in one graph (as ``xm.save`` does)."""
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{call} takes tensors on the XLA device, not {type(tensor).__name__}.")
        if tensor.device.type != "xla":
            raise TypeError(
                f"{call} takes tensors on the XLA device, as on a TPU; got one on {tensor.device}. "
                f"Move it there first with .to(device)."
            )
    tensors = list(tensors)
    with own_transfers():
        torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
        return [tensor.detach().cpu() for tensor in tensors]


def to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    with own_transfers():
        return value.to(device)


def exchange_tensors(call: str, tensors: Sequence[torch.Tensor], group: list[int]) -> list[list[torch.Tensor]]:
    """The CPU copies of ``tensors`` from each rank of ``group``, in group order."""
    everyone = exchange(call, host_copies(call, tensors))
    members = [everyone[r] for r in group]
    require_same_shapes(call, group, members)
    return members


def group_of(call: str, groups: list[list[int]] | None, equal_sizes: bool = False) -> list[int]:
    """The ranks this rank combines with: its replica group, or everyone."""
    state = sim()
    if not groups:
        return list(range(state.world_size))
    named = sorted(r for group in groups for r in group)
    if named != list(range(state.world_size)):
        raise ValueError(
            f"{call}: groups={groups!r} must name every rank from 0 to {state.world_size - 1} "
            f"exactly once, as XLA replica groups must."
        )
    if equal_sizes and len({len(group) for group in groups}) > 1:
        raise ValueError(f"{call}: groups={groups!r} must all have the same number of ranks.")
    return next(list(group) for group in groups if state.rank in group)


def require_same_shapes(call: str, group: list[int], members: list[list[torch.Tensor]]) -> None:
    signatures = [[(tuple(t.shape), t.dtype) for t in tensors] for tensors in members]
    if all(signature == signatures[0] for signature in signatures):
        return
    listing = "; ".join(
        f"rank {rank}: " + ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in signature)
        for rank, signature in zip(group, signatures)
    )
    raise ValueError(
        f"{call} needs the same shapes and dtypes on every rank (XLA runs one compiled program on all "
        f"of them; a TPU fails or hangs here). Got {listing}."
    )


def rebind(target: torch.Tensor, value: torch.Tensor) -> None:
    """Make the XLA tensor ``target`` hold ``value``, shape included, as torch_xla's
    ``output=`` collectives do (outside autograd)."""
    with own_transfers(), torch.no_grad():
        if target.shape == value.shape and target.dtype == value.dtype:
            target.copy_(value)  # keeps a Parameter's identity and autograd state
        else:
            torch_xla._XLAC._replace_xla_tensor(target, value.to(target.device))


# --- metric counters -------------------------------------------------------------


def bump(counter: str, by: int = 1) -> None:
    """Bump a counter that torch_xla's C++ collective would have bumped on a TPU."""
    torch_xla._XLAC._xla_increment_counter(counter, by)


@contextlib.contextmanager
def own_transfers() -> Iterator[None]:
    """Count what the simulation's own copies bump, to leave it out of reads.

    Their device-to-host transfers too (under TRANSFERS): a cell's account
    of what XLA did (xla_account.py) counts only the user's.
    """
    before = {name: torch_xla._XLAC._xla_counter_value(name) for name in _op_counters()}
    before[TRANSFERS] = _transfers()
    try:
        yield
    finally:
        own = sim().own_counts
        for name in _op_counters():
            grown = (torch_xla._XLAC._xla_counter_value(name) or 0) - (before.get(name) or 0)
            if grown > 0:
                own[name] = own.get(name, 0) + grown
        own[TRANSFERS] = own.get(TRANSFERS, 0) + _transfers() - before[TRANSFERS]


TRANSFERS = "TransferFromDeviceTime"  # the metric whose samples count device-to-host transfers


def _transfers() -> int:
    data = torch_xla._XLAC._xla_metric_data(TRANSFERS)
    return int(data[0]) if data else 0


def _op_counters() -> list[str]:
    # Only the per-op counters: the graph a copy runs (ExecuteComputation, the
    # compile counters) is the user's, which a TPU runs as well.
    return [name for name in torch_xla._XLAC._xla_counter_names() if name.startswith(("xla::", "aten::"))]


def counter_names() -> list[str]:
    """met.counter_names, without counters only the simulation's own copies bumped."""
    return [name for name in torch_xla._XLAC._xla_counter_names() if counter_value(name)]


def counter_value(name: str) -> int | None:
    """met.counter_value, less what the simulation's own copies added."""
    value = torch_xla._XLAC._xla_counter_value(name)
    if value is None:
        return None
    value -= sim().own_counts.get(name, 0)
    return value if value > 0 else None


def clear_counters() -> None:
    sim().own_counts.clear()
    torch_xla._XLAC._clear_xla_counters()


def clear_all() -> None:
    clear_counters()
    met.clear_metrics()


METRICS_REPLACEMENTS = {
    "counter_names": counter_names,
    "counter_value": counter_value,
    "clear_counters": clear_counters,
    "clear_all": clear_all,
}
