"""The serving loop of a pool rank. Runs in a rank (process or thread) for the pool's life.

A pool's ranks are started once by the launcher (a job of kind ``pool``) and
then wait on their events socket for requests from the kernel: run a cell,
take pushed values, send a value back. A rank's namespace, its device and
everything torch_xla caches (compiled graphs) live as long as the rank, so a
model built in one cell is used in the next without travelling anywhere.

Each request carries a ``seq`` that the rank's RESULT / ERROR / DONE echo, so
the kernel can ignore replies to a request it gave up on. The rank leaves its
loop when the kernel closes the socket.

Interrupts: the kernel sends SIGINT to the rank's process. Only ranks that are
running a cell are interrupted (a KeyboardInterrupt in the cell, reported as
an error, and the rank waits for the next request); an idle rank ignores it.
Ranks that are threads (the tpu launch path) get the KeyboardInterrupt as an
asynchronous exception from the process's main thread, so a thread blocked in
native code only notices it once that call returns.

Output: a rank that owns its process (the cpu backend) writes through C-level
text buffers instead of the per-thread router of capture.py, so a print costs
what it costs in plain Python. Lines go out one by one while they are sparse
(a line before a crash is already out of the process); when they come in a
burst, a pump thread sends what is buffered every few milliseconds.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import io
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import types
from typing import Any, Callable

from xla_magic import protocol, transport
from xla_magic.launcher import capture, rank as rank_module

# Results of these exact types are pickled with plain pickle (no cloudpickle
# Pickler to build): the common case of a cell that returns a number.
_PLAIN_RESULTS = frozenset({int, float, bool, str, bytes, complex, type(None)})
_COMPILED_CELLS_KEPT = 64
BURST_SECONDS = 0.002  # lines closer together than this are a burst
PUMP_SECONDS = 0.003  # during a burst, how often the buffered output is sent

# --- interrupts -------------------------------------------------------------

# What each rank thread of this process is doing: answering a request (BUSY),
# running a cell (IN_CELL), or answering one that was interrupted before its
# cell began (INTERRUPTED: the cell will not run). Idle ranks are absent.
BUSY, IN_CELL, INTERRUPTED = "busy", "in cell", "interrupted"
_activity: dict[int, str] = {}
_activity_lock = threading.RLock()  # re-entered when the handler runs on a rank's own thread


def install_interrupt_handler() -> None:
    """Let SIGINT interrupt the requests that this process's ranks are answering.

    Call from the main thread. Forked children inherit the handler, which is
    how the tpu launch path's rank processes get it.
    """
    signal.signal(signal.SIGINT, _on_interrupt)


def _on_interrupt(signum: int, frame: Any) -> None:
    me = threading.get_ident()
    interrupt_me = False
    with _activity_lock:
        for ident, doing in list(_activity.items()):
            if doing == BUSY:
                _activity[ident] = INTERRUPTED
            elif doing == IN_CELL and ident == me:
                interrupt_me = True
            elif doing == IN_CELL:
                _set_async_exception(ident, KeyboardInterrupt)
    if interrupt_me:
        raise KeyboardInterrupt


def _set_async_exception(ident: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in thread ``ident`` at its next bytecode; None clears a pending one."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc)


class _Request:
    """The stretch of answering a request: SIGINT then stops its cell, if any."""

    def __enter__(self) -> None:
        with _activity_lock:
            _activity[threading.get_ident()] = BUSY

    def __exit__(self, *exc_info: Any) -> None:
        with _activity_lock:
            _activity.pop(threading.get_ident(), None)


class _Cell:
    """The stretch of a request during which SIGINT raises KeyboardInterrupt in the cell."""

    def __enter__(self) -> None:
        me = threading.get_ident()
        with _activity_lock:
            if _activity.get(me) == INTERRUPTED:
                raise KeyboardInterrupt  # the interrupt came while the cell was being prepared
            _activity[me] = IN_CELL

    def __exit__(self, *exc_info: Any) -> None:
        me = threading.get_ident()
        with _activity_lock:
            _activity[me] = BUSY
            if me != threading.main_thread().ident:
                _set_async_exception(me, None)  # one that was sent as the cell ended


# --- the rank's side of shipping ----------------------------------------------


class ShippedValues:
    """The kernel values this rank holds, so unchanged ones need not travel again.

    Plain values (numbers, strings, modules) are kept as objects: they cannot
    have been changed in place. Other values are kept as their pickle and
    loaded afresh for every cell, as if they had been shipped again: a cell
    that mutates one does not change what the next cell sees. Large tensors
    and arrays in that pickle are segments the kernel holds for the pool
    (``held``): the rank opens each one once, while its name exists, and
    keeps the descriptor, so every load maps a fresh copy-on-write view of
    it long after the kernel unlinked the name.
    """

    def __init__(self) -> None:
        self.plain: dict[str, Any] = {}
        self.objects_blob: bytes | None = None
        self.segments: dict[str, int] = {}  # held segment -> its open descriptor
        self.unopened: dict[str, str] = {}  # held segment -> why it could not be opened

    def values_for(self, fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(plain values, freshly loaded objects) that this cell reads."""
        self.hold(fields.get("held", ()))
        if fields.get("plain"):
            self.plain.update(transport.load_namespace(fields["plain"])[0])
        plain = {name: self.plain[name] for name in fields.get("plain_names", ())}
        objects: dict[str, Any] = {}
        if fields.get("object_names"):
            if fields.get("objects") is not None:
                self.objects_blob = fields["objects"]
            if self.objects_blob is not None:
                objects = _HeldLoader(self.objects_blob, self).load()
        return plain, objects

    def hold(self, names: tuple[str, ...]) -> None:
        """Keep exactly the segments ``names``: open the new ones, close the dropped ones."""
        kept = set(names)
        for name in [name for name in self.segments if name not in kept]:
            os.close(self.segments.pop(name))
        self.unopened = {name: why for name, why in self.unopened.items() if name in kept}
        for name in names:
            if name not in self.segments and name not in self.unopened:
                try:
                    self.segments[name] = transport.open_segment(name)
                except (OSError, ValueError) as exc:
                    self.unopened[name] = str(exc)

    def view(self, kind: str, name: str, args: tuple) -> Any:
        """A fresh copy-on-write view of a held segment, as the tensor or array it holds."""
        if name not in self.segments:
            why = self.unopened.get(name, "the kernel did not say to keep it")
            raise RuntimeError(
                f"a large value shipped to this rank is not in its shared memory ({why}); "
                f"%xla_pool restart starts ranks that receive every value again"
            )
        return transport.view_on(transport.map_private_fd(self.segments[name]), kind, args)

    def close(self) -> None:
        self.hold(())


class _HeldLoader(pickle.Unpickler):
    """Loads the shipped objects, each held segment as a fresh view (see transport.held_segment)."""

    def __init__(self, data: bytes, shipped: ShippedValues) -> None:
        super().__init__(io.BytesIO(data))
        self._view = shipped.view

    def find_class(self, module: str, name: str) -> Any:
        if module == transport.__name__ and name == transport.held_segment.__name__:
            return self._view
        return super().find_class(module, name)


# --- compiled cells -------------------------------------------------------------


class CompiledCells:
    """Cell source -> code, so a cell run again skips parsing and compiling."""

    def __init__(self, kept: int = _COMPILED_CELLS_KEPT) -> None:
        self._kept = kept
        self._cells: dict[str, tuple[str, types.CodeType, types.CodeType | None]] = {}

    def get(self, source: str, filename: str) -> tuple[str, types.CodeType, types.CodeType | None]:
        """(filename the code was compiled under, body, last expression or None)."""
        cell = self._cells.get(source)
        if cell is None:
            cell = self._compile(source, filename)
            if len(self._cells) >= self._kept:
                self._cells.pop(next(iter(self._cells)))
            self._cells[source] = cell
        return cell

    @staticmethod
    def _compile(source: str, filename: str) -> tuple[str, types.CodeType, types.CodeType | None]:
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        tree = ast.parse(source, filename=filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        return filename, compile(tree, filename, "exec"), last


# --- output of a rank that owns its process -------------------------------------------


class _SocketWriter(io.RawIOBase):
    """The raw layer under a fast stream: the rank's socket, noticing bursts."""

    def __init__(self, sock: Any, fd: int, pump: "OutputPump") -> None:
        super().__init__()
        self._sock = sock
        self._fd = fd
        self._pump = pump
        self._last = 0.0
        self.sent = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd  # fd 1 or 2, which point at the same socket

    def isatty(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        size = len(data)
        try:
            self._sock.sendall(data)
        except OSError:
            pass  # the kernel is gone; this rank is about to be ended too
        self.sent += size
        now = time.monotonic()
        if now - self._last < BURST_SECONDS:
            self._pump.burst()
        self._last = now
        return size


class OutputPump:
    """``sys.stdout`` / ``sys.stderr`` of a one-rank process, and their pump.

    The streams are line-buffered until lines come in a burst; then the pump
    turns line buffering off and sends what is buffered every PUMP_SECONDS,
    until a round finds nothing to send.
    """

    def __init__(self, streams: capture.RankStreams) -> None:
        self._wake = threading.Event()
        self._writers = [_SocketWriter(streams.out.sock, 1, self), _SocketWriter(streams.err.sock, 2, self)]
        self.streams = [
            io.TextIOWrapper(io.BufferedWriter(writer, 1 << 16), encoding="utf-8", errors="replace",
                             line_buffering=True)
            for writer in self._writers
        ]
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self.streams
        threading.Thread(target=self._run, name="xla_magic-pool-output", daemon=True).start()

    def burst(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def flush(self) -> None:
        for stream in self.streams:
            try:
                stream.flush()
            except ValueError:  # a cell closed it; nothing more can come through it
                pass

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._line_buffering(False)
            while True:
                time.sleep(PUMP_SECONDS)
                before = sum(writer.sent for writer in self._writers)
                self.flush()
                if sum(writer.sent for writer in self._writers) == before:
                    break
            self._line_buffering(True)
            self._wake.clear()

    def _line_buffering(self, on: bool) -> None:
        for stream in self.streams:
            try:
                stream.reconfigure(line_buffering=on)
            except ValueError:
                pass


# --- the serving loop -------------------------------------------------------------


_libc: Any = None


def _flush_c_stdio() -> None:
    """fflush(NULL), with libc looked up once (it runs at every cell's end)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)
        _libc.fflush(None)
    except (OSError, AttributeError):
        pass


class PoolRank:
    """One rank's persistent state and its answers to the kernel's requests."""

    def __init__(
        self,
        rank: int,
        channel: protocol.Channel,
        streams: capture.RankStreams,
        rank_names: dict[str, Any],
        own_output: OutputPump | None = None,
    ) -> None:
        self.rank = rank
        self.channel = channel
        self.streams = streams
        self.own_output = own_output
        self.rank_names = rank_names
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, **rank_names}
        self.shipped = ShippedValues()
        self.cells = CompiledCells()
        self.device = rank_names.get("device")
        self.reports_memory = rank_module.device_memory(self.device) is not None
        self._filename = "<xla_pool>"

    def serve(self) -> None:
        """Answer requests until the kernel closes the socket."""
        handlers: dict[str, Callable[[dict[str, Any]], bytes | None]] = {
            protocol.CELL: self.run_cell,
            protocol.PUSH: self.push,
            protocol.PULL: self.pull,
        }
        while True:
            try:
                kind, fields = self.channel.recv()
            except OSError:
                return
            if kind in (protocol.CLOSED, protocol.BROKEN, protocol.STOP):
                return
            try:
                with _Request():
                    self.answer(handlers.get(kind), kind, fields)
            except KeyboardInterrupt:
                pass  # arrived just as a cell ended: the request is answered
            except OSError:
                return  # the kernel is gone

    def answer(self, handler: Callable[[dict[str, Any]], bytes | None] | None, kind: str, fields: dict[str, Any]) -> None:
        seq = fields.get("seq")
        started = time.monotonic()
        try:
            if handler is None:
                raise ValueError(f"a pool rank does not know the request {kind!r}")
            reply = handler(fields)
        except BaseException as exc:  # the user's code may raise anything at all
            reply = self._error_frame(seq, exc, with_traceback=kind == protocol.CELL)
        self.finish(seq, reply, started)

    def finish(self, seq: Any, reply: bytes | None, started: float) -> None:
        """Flush the rank's output, then send the reply and DONE in one write.

        The output sockets are written before DONE is, so by the time the
        kernel reads DONE every byte of the cell's output is there to read.
        """
        self.flush_output()
        done = protocol.encode(protocol.DONE, seq=seq, seconds=time.monotonic() - started)
        with self.channel.lock:
            self.channel.sock.sendall(reply + done if reply else done)

    def flush_output(self) -> None:
        if self.own_output is not None:
            self.own_output.flush()
        self.streams.flush()
        _flush_c_stdio()

    # -- requests --------------------------------------------------------

    def run_cell(self, fields: dict[str, Any]) -> bytes:
        seq = fields["seq"]
        plain, objects = self.shipped.values_for(fields)
        self.namespace.update(plain)
        if objects:
            rank_module.bind_rank_names(objects, self.rank_names)
            self.namespace.update(objects)
        self.namespace.update(self.rank_names)  # a cell may have rebound ``rank``
        self._filename, body, last = self.cells.get(fields["source"], fields["filename"])
        memory = rank_module.MemoryReporter(self.channel, self.device) if self.reports_memory else None
        if memory is not None:
            memory.start()
        try:
            with _Cell():
                exec(body, self.namespace)
                value = eval(last, self.namespace) if last is not None else None
        finally:
            if memory is not None:
                memory.stop()
        if not fields["has_result"]:
            return protocol.encode(protocol.RESULT, seq=seq, value=None, empty=True)
        return self._result_frame(seq, value)

    def push(self, fields: dict[str, Any]) -> None:
        values = transport.load_namespace(fields["values"])[0]
        rank_module.bind_rank_names(values, self.rank_names)
        self.namespace.update(values)
        return None

    def pull(self, fields: dict[str, Any]) -> bytes:
        name = fields["name"]
        if name not in self.namespace or name.startswith("__"):
            raise NameError(f"name {name!r} is not defined in the pool's ranks")
        return self._result_frame(fields["seq"], self.namespace[name])

    # -- replies -----------------------------------------------------------

    def _result_frame(self, seq: Any, value: Any) -> bytes:
        try:
            if type(value) in _PLAIN_RESULTS:
                data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            else:
                data = rank_module.dump_result(value)
        except Exception as exc:
            return protocol.encode(
                protocol.ERROR,
                seq=seq,
                type=type(exc).__name__,
                message=(
                    f"the value ({type(value).__module__}.{type(value).__qualname__}) could not be "
                    f"sent back: {exc}. Return something picklable, such as a tensor, a number or "
                    f"a dict of them."
                ),
                traceback="",
            )
        return protocol.encode(protocol.RESULT, seq=seq, value=data, empty=False)

    def _error_frame(self, seq: Any, exc: BaseException, with_traceback: bool) -> bytes:
        """An ERROR; the traceback only for a cell's error (from its first frame on)."""
        self.flush_output()
        return protocol.encode(
            protocol.ERROR,
            seq=seq,
            type=type(exc).__name__,
            message=str(exc),
            traceback=rank_module.format_error(exc, self._filename) if with_traceback else "",
        )


def serve(rank: int, sockets: rank_module.RankSockets, setup: Callable[[], dict[str, Any]]) -> bool:
    """The whole life of a pool rank: set up once, then answer requests.

    Says ready with STATUS (its pid) and DONE under ``seq`` 0, or ERROR and
    DONE when ``setup`` fails. False when it could not start.
    """
    streams = capture.RankStreams(rank, sockets.out, sockets.err)
    capture.attach(streams)
    channel = protocol.Channel(sockets.events)
    own_output = None
    if threading.current_thread() is threading.main_thread():
        # The only rank of its process: interrupts and output need no routing.
        install_interrupt_handler()
        own_output = OutputPump(streams)
    started = time.monotonic()
    try:
        rank_names = setup()
        server = PoolRank(rank, channel, streams, rank_names, own_output)
    except BaseException as exc:  # anything from the runtime's start
        if own_output is not None:
            own_output.flush()
        streams.flush()
        channel.send(protocol.ERROR, seq=0, type=type(exc).__name__, message=str(exc),
                     traceback=rank_module.format_error(exc, "<xla_pool start>"))
        channel.send(protocol.DONE, seq=0, seconds=time.monotonic() - started)
        return False
    channel.send(protocol.STATUS, seq=0, state="ready", pid=os.getpid(),
                 memory=rank_module.device_memory(server.device) if server.reports_memory else None)
    server.finish(0, None, started)
    try:
        server.serve()
    finally:
        server.shipped.close()
        server.flush_output()
    return True
