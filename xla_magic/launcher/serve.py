"""The one serving loop of every rank. Runs in a rank (process or thread).

Every rank, one-shot or in a pool, on every backend, lives the same life:
set up (device, peers, in-cell names), say it is ready, then answer
requests from the kernel on its events socket: run a cell, take pushed
values, send a value back. Only the policy differs (:class:`Serving`, as
its job names it), as with ``max_tasks_per_child`` in CPython's
concurrent.futures.process: a one-shot rank is handed its one request
through fork, with its job, answers it and leaves; a pool rank then waits
for more until the kernel closes the socket.

Each request carries a ``seq`` that the rank's RESULT / ERROR / DONE echo,
so the kernel can ignore replies to a request it gave up on. A set-up that
fails is reported under the seq of the request waiting for it: the first
request's, or 0 (a pool's start).

A rank's namespace, its device and everything torch_xla caches (compiled graphs) live as long as the rank.
Interrupts (interrupt.py): SIGINT stops the cell of the request being answered and nothing else; SIGTERM, in a
cell with checkpoints, saves (checkpoints.py). Output goes through capture.py. Results and pulled values travel
with large tensors and arrays in shared memory, under the prefix the request names. A cell can have the kernel
display something (``show_sharding`` in SPMD, or anything its IPython shell displays: shell.py): a DISPLAY
event, answered by SHOWN once shown; what it logs goes as METRICS (metrics.py). It runs in the kernel's
directory and sys.path (place.py).
"""

from __future__ import annotations

import bdb
import builtins
import contextlib
import os
import threading
import time
import traceback
import types
from typing import Any, Callable, Iterator, NamedTuple

from xla_magic.wire import protocol, transport
from xla_magic.launcher import (capture, checkpoints, compile_cache, debugger, displays, interrupt, lifetime, memory,
                                metrics, place, profiling, rank as rank_module, shell, shipped, stacks, xla_account,
                                xla_analysis)

_COMPILED_CELLS_KEPT = 64
DISPLAY_WAIT = 10.0  # how long a cell waits for the kernel to show what it displays
START_SEQ = 0  # the seq of a pool's start: every rank's ready answers it


class Serving(NamedTuple):
    """How a job's ranks serve: its ``policy``, which the kernel decided (xla_magic/ranks/policy.py), and its request."""

    policy: str  # protocol.ONE_SHOT: answer ``first`` and leave; protocol.POOL: serve until the socket closes
    first: bytes | None = None  # a one-shot rank's one request, which came with its job

    @classmethod
    def of(cls, job: dict[str, Any]) -> Serving:
        """The job's policy and request; ValueError unless a one-shot job has its request and a pool's none."""
        policy, first = job.get("policy"), job.get("first")
        if policy not in (protocol.ONE_SHOT, protocol.POOL) or (policy == protocol.ONE_SHOT) != (first is not None):
            raise ValueError(f"a job is one-shot with its request or a pool without one, not {policy!r} "
                             f"{'with' if first is not None else 'without'} a request")
        return cls(policy, first)

    @property
    def one_shot(self) -> bool:
        """Ends what each request started (a pool keeps it: see lifetime.py), and leaves after its one request."""
        return self.policy == protocol.ONE_SHOT


# --- compiled cells -------------------------------------------------------------


class CompiledCells:
    """Cell source -> code, so a cell run again skips parsing and compiling."""

    def __init__(self, kept: int = _COMPILED_CELLS_KEPT) -> None:
        self._kept = kept
        self._cells: dict[str, tuple[str, types.CodeType, types.CodeType | None]] = {}

    def get(
        self, source: str, filename: str, code: str | None = None
    ) -> tuple[str, types.CodeType, types.CodeType | None]:
        """(filename the code was compiled under, body, last expression or None).

        ``code`` is the cell as Python when it has IPython syntax; tracebacks show the cell's own lines.
        """
        cell = self._cells.get(source)
        if cell is None:
            rank_module.register_source(source, filename)
            cell = (filename, *rank_module.compile_cell(code or source, filename))
            if len(self._cells) >= self._kept:
                self._cells.pop(next(iter(self._cells)))
            self._cells[source] = cell
        return cell


# --- answering requests ------------------------------------------------------------


class RankServer:
    """One rank's state and its answers to the kernel's requests."""

    def __init__(
        self,
        rank: int,
        channel: protocol.Channel,
        streams: capture.RankStreams,
        rank_names: dict[str, Any],
        closing: Callable[[], None] | None = None,
        serving: Serving = Serving(protocol.POOL),
    ) -> None:
        self.rank = rank
        self.channel = channel
        self.inbox = protocol.Inbox(channel)  # what the kernel sends: read by a thread, so no signal handler loses it
        self.streams = streams
        self.rank_names = rank_names
        self.closing = closing  # a one-shot rank's rendezvous after its cell, else None
        self.serving = serving
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, **rank_names}
        self.shipped = shipped.ShippedValues()
        self.cells = CompiledCells()
        self.device = rank_names.get("device")
        self.reports_memory = rank_module.device_memory(self.device) is not None  # a TPU's runtime, the simulation
        self.memory = rank_module.MemoryReporter(channel, self.device) if self.reports_memory else None
        self._done_memory: dict[str, int] | None = None  # the cell's last memory sample, for its DONE
        self.children = lifetime.ChildWatch()
        self.children.note_existing()  # what set-up started is not the first request's to end
        displays.set_display(self.display)
        self.metrics = metrics.Logger(rank, channel, self.namespace)  # log() in its cells (metrics.py)
        self.home = shell.Home(self.namespace)  # its IPython shell, made on first use
        shell.enter(self.home)
        self.console = debugger.Console(self)  # input(), getpass, stdin and pdb ask at the kernel's prompt
        debugger.enter(self.console)
        self.post_mortem: types.TracebackType | None = None  # the last failed cell's, for %debug, until the next request
        self.thread = threading.current_thread() is not threading.main_thread()  # a rank thread (the tpu launch path)
        self._filename = "<xla_pool>"
        self._serving = ""  # the cell being served, or the last one, for errors outside it
        self._idle_failure: BaseException | None = None  # raised between requests, told with the next
        self.phase = "idle"  # what its stack sampler reports the rank is at: idle, cell, closing (stacks.py)
        self.seq: Any = START_SEQ  # the request being answered, or the last one
        self._answered: Any = None  # the last request whose DONE went out
        self.results = rank_module.ResultSegments(rank)
        self._xla_frame = b""  # the cell's account of what XLA did (XLA), sent with its reply
        self._profile_frame = b""  # the cell's profile (PROFILE), sent after its account (the kernel names compiles by it)
        self._accountant: xla_account.Accountant | None = None  # this process's, once a cell asked for an account
        self._after_reply: list[Callable[[], None]] = []  # what waits until the reply went (a profile's digest)
        self._handlers: dict[str, Callable[[dict[str, Any]], bytes | None]] = {
            protocol.CELL: self.run_cell,
            protocol.PUSH: self.push,
            protocol.PULL: self.pull,
            protocol.DEBUG: self.debug,
        }

    def serve(self) -> None:
        """Answer requests until the kernel closes the socket.

        A signal handler of the cell's (torch's SIGCHLD) may raise anywhere
        in this loop (see failed_outside). A request stays first in the inbox
        until it is answered, and one whose DONE went out is not answered
        again: so a raise never loses a request, nor answers one twice.
        """
        while True:
            try:
                request = self.inbox.first()
                if request.kind in (protocol.CLOSED, protocol.BROKEN, protocol.STOP):
                    return
                if request.kind == protocol.LEND:  # for the next request's results
                    self.results.lend(request.fields, self.channel)
                elif request.kind == protocol.DIGEST:  # every rank answered: read the profile's trace now
                    profiling.digest_now()
                # SHOWN or INPUT_REPLY here answers a display or a question that an interrupt stopped waiting for
                elif request.kind not in (protocol.SHOWN, protocol.INPUT_REPLY) and \
                        request.fields.get("seq") != self._answered:
                    self.answer(request)
                self.inbox.take(request)
            except OSError:
                return  # the kernel is gone
            except Exception as exc:  # a signal handler of the cell's raised between requests
                self.failed_outside(exc)

    def answer(self, request: protocol.Event) -> bool:
        """Answer one request (interrupts stop its cell only); True when it succeeded."""
        try:
            with interrupt.Request():
                return self._answer(request)
        except KeyboardInterrupt:
            return False  # arrived just as the request ended: it is answered

    def _answer(self, request: protocol.Event) -> bool:
        kind, fields = request
        seq = fields.get("seq")
        started = time.monotonic()
        self.seq = seq
        self.children.note_existing()  # a one-shot request ends only what it started
        if self._idle_failure is not None:  # told now, as this request's answer, rather than never
            failure, self._idle_failure = self._idle_failure, None
            self.finish(seq, self.outside_error_frame(seq, failure, "between requests"), started)
            return False
        if kind == protocol.CELL:
            self._serving = fields.get("source", "")
        if kind != protocol.DEBUG:
            self.post_mortem = None  # kept until the next request, and no longer
        ok = False
        try:
            handler = self._handlers.get(kind)
            if handler is None:
                raise ValueError(f"a rank does not know the request {kind!r}")
            reply = handler(fields)
            ok = True
        except BaseException as exc:  # the user's code may raise anything at all
            if kind == protocol.CELL and debugger.keeps(exc):
                self.post_mortem = debugger.from_cell(exc.__traceback__)
                if self.parks:
                    debugger.park()  # before the reply: the kernel stops the others once it has it
            reply = self.error_frame(seq, exc, with_traceback=kind == protocol.CELL)
        try:
            self.finish(seq, reply, started)
        except OSError:
            raise  # the kernel is gone
        except Exception as exc:  # ours, or a signal handler of the cell's, raising after the cell
            self.failed_outside(exc, started)
            return False
        return ok

    def failed_outside(self, exc: BaseException, started: float | None = None) -> None:
        """Something raised in this rank outside the cell's code: it is the rank's error, never a silent death.

        Signal handlers run wherever the rank is (torch's SIGCHLD handler
        raises when a DataLoader worker dies). While a request waits for its
        answer, this is the answer; once it is answered, the next request is
        answered with it instead of running.
        """
        if self._answered == self.seq:
            self._idle_failure = exc
        else:
            self.finish(self.seq, self.outside_error_frame(self.seq, exc, "after its cell"),
                        started if started is not None else time.monotonic())

    def finish(self, seq: Any, reply: bytes | None, started: float) -> None:
        """End what a one-shot request started, flush the rank's output, then send the reply and DONE in one write.

        The output sockets are written before DONE is, so by the time the
        kernel reads DONE every byte of the request's output is there to read.
        DONE carries the processes the rank keeps (a pool's: what its cells started).
        """
        if self.serving.one_shot:
            self.children.end_new()
        self.results.release()  # before the reply: the kernel takes back what was lent once it has it
        self.flush_output()
        memory, self._done_memory = self._done_memory, None
        done = protocol.encode(protocol.DONE, seq=seq, seconds=time.monotonic() - started,
                               processes=self.children.kept(), memory=memory)
        xla, self._xla_frame = self._xla_frame, b""
        profile, self._profile_frame = self._profile_frame, b""
        frames = (reply or b"") + xla + profile + done
        with self.channel.lock:
            # Answered from here on: a signal handler that raises once the bytes go (sendall runs the
            # handlers after it sent, and so does any call after it) is told with the next request,
            # never as a reply to this one, which the kernel has closed.
            self._answered = seq
            self.channel.sock.sendall(frames)
        after, self._after_reply = self._after_reply, []
        for job in after:  # (profiling.digest_later: never raises)
            job()
        self.shipped.let_go()
        xla_account.settle()  # the next cell's start read, off its path

    def display(self, what: str, data: Any) -> None:
        """Have the kernel display ``data`` (its view for ``what``) in the running cell, after the output so far.

        Waits (up to DISPLAY_WAIT) until the kernel says it is shown, so the
        cell's next lines come after it: output and events travel on
        different sockets, read in whatever order they arrive.
        """
        self.flush_output()
        self.channel.send(protocol.DISPLAY, what=what, data=data)
        shown = self.inbox.first(DISPLAY_WAIT)  # the kernel sends nothing else while a cell runs
        if shown is not None and shown.kind == protocol.SHOWN:
            self.inbox.take(shown)

    def flush_output(self) -> None:
        self.streams.flush()
        lifetime.flush_c_stdio()

    @property
    def parks(self) -> bool:
        """A one-shot rank stays for %debug after its cell failed, where it owns its process (see debugger.park)."""
        return self.serving.one_shot and not self.thread

    def sampled_phase(self) -> str:
        """What the stack sampler says the rank is at: at the kernel's prompt (debugger, input), or its phase."""
        asking = self.console.asking
        return asking[0] if asking is not None else self.phase

    # -- requests --------------------------------------------------------

    def run_cell(self, fields: dict[str, Any]) -> bytes:
        seq = fields["seq"]
        if "place" in fields:  # before loading names: a shipped function may import the user's module
            place.apply(fields["place"])
        try:
            plain, objects = self.shipped.values_for(fields)
        except ModuleNotFoundError as exc:  # a notebook value pickled with a module by its name
            raise place.PlaceError(
                f"the notebook's values that this cell reads need the module {exc.name!r}, which this rank "
                f"cannot import: put its directory on the kernel's sys.path (the ranks follow it), or "
                f"import it inside the cell"
            ) from None
        self.namespace.update(plain)
        if objects:
            rank_module.bind_rank_names(objects, self.rank_names)
            self.namespace.update(objects)
        self.namespace.update(self.rank_names)  # a cell may have rebound ``rank``
        self._filename, body, last = self.cells.get(fields["source"], fields["filename"], fields.get("code"))
        if (reporter := self.memory) is not None:
            reporter.start()
        try:
            self.phase = "cell"
            with self._accounted(fields), self.metrics.cell(fields), checkpoints.cell(fields, self.namespace), \
                    self._profiled(fields), interrupt.Cell():  # (account, logged values: read outside the trace)
                value = self.home.run(fields["source"], body, last)
            self.phase = "closing"  # the cell is over; a one-shot rank waits for the others at its end
            if self.closing is not None:
                self.closing()
        finally:
            self.phase = "idle"
            memory.mark(self._filename)  # the tensors the cell made since its last sync: made in this cell
            if reporter is not None:
                self._done_memory = reporter.stop()
        if not fields["has_result"]:
            return protocol.encode(protocol.RESULT, seq=seq, value=None, empty=True)
        return self._result_frame(fields, value)

    @contextlib.contextmanager
    def _profiled(self, fields: dict[str, Any]) -> Iterator[None]:
        """The cell in torch_xla's profiler when the kernel asked for it (--profile; see profiling.py)."""
        directory = fields.get("profile")
        if not directory:
            yield
            return
        profiler = profiling.profiler()
        profiler.begin(self.rank, directory)
        try:
            yield
        finally:
            # A pool's rank digests its trace after its reply; a one-shot rank's process ends with its reply.
            where = profiler.end(digest_now=self.serving.one_shot)
            if where is not None:
                self._profile_frame += protocol.encode(protocol.PROFILE, seq=fields["seq"], profile=where)
                if where.get("digest_file"):
                    self._after_reply.append(lambda: profiling.digest_later(where))

    @contextlib.contextmanager
    def _accounted(self, fields: dict[str, Any]) -> Iterator[None]:
        """What XLA did during the cell, unless the kernel asked for no report (see xla_account.py)."""
        if not fields.get("xla_report", True):
            xla_analysis.forget_analysis()
            yield
            return
        # Counting must never cost the cell: a fault in it (another torch_xla's API) only loses the account.
        accountant = self._accountant
        try:
            if accountant is None:
                accountant = self._accountant = xla_account.accountant()
            accountant.begin(self.rank, self._filename, fields.get("run_id"))
        except Exception:
            accountant = None
        try:
            yield
        finally:
            if accountant is not None:
                try:
                    account = accountant.end(self._filename)
                except Exception:
                    account = None
                if account is not None:
                    self._xla_frame += protocol.encode(protocol.XLA, seq=fields["seq"], account=account)

    def debug(self, fields: dict[str, Any]) -> None:
        """%debug: pdb's post-mortem in the last failed cell's frames, until the user leaves it."""
        if self.post_mortem is None:
            raise RuntimeError("this rank holds no failed cell to debug: it keeps one until its next request")
        with interrupt.Cell():  # an interrupt leaves the debugger as it stops a cell
            debugger.post_mortem(self.post_mortem)

    def push(self, fields: dict[str, Any]) -> None:
        values = transport.load_namespace(fields["values"])[0]
        rank_module.bind_rank_names(values, self.rank_names)
        self.namespace.update(values)
        return None

    def pull(self, fields: dict[str, Any]) -> bytes:
        name = fields["name"]
        if name not in self.namespace or name.startswith("__"):
            raise NameError(f"name {name!r} is not defined in the pool's ranks")
        return self._result_frame(fields, self.namespace[name])

    # -- replies -----------------------------------------------------------

    def _result_frame(self, fields: dict[str, Any], value: Any) -> bytes:
        """RESULT (large tensors and arrays in shared memory), or the ERROR saying why not."""
        kind, reply = rank_module.result_event(value, self.results.writer(fields.get("results_to")))
        return protocol.encode(kind, seq=fields["seq"], **reply)

    def outside_error_frame(self, seq: Any, exc: BaseException, when: str) -> bytes:
        """An ERROR for what raised in this rank outside the user's code, with the cell it was serving."""
        cell = self._serving.strip().splitlines()
        serving = f"the cell starting {cell[0][:80]!r}" if cell else "no cell yet"
        goes_on = "" if self.serving.one_shot else "; the pool's rank goes on serving"
        where = f"(raised in the rank {when}, outside the cell's code, while it served {serving}{goes_on})"
        return protocol.encode(
            protocol.ERROR,
            seq=seq,
            type=type(exc).__name__,
            message=f"{rank_module.exception_message(exc)} {where}",
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + where + "\n",
        )

    def error_frame(self, seq: Any, exc: BaseException, with_traceback: bool) -> bytes:
        """An ERROR; the traceback only for a cell's error (from its first frame on)."""
        self.flush_output()
        if isinstance(exc, bdb.BdbQuit):  # the user quit pdb in the cell: no traceback, as IPython shows none
            return protocol.encode(protocol.ERROR, seq=seq, type="BdbQuit", message=debugger.quit_message(self.console),
                                   traceback="")
        return protocol.encode(
            protocol.ERROR,
            seq=seq,
            type=type(exc).__name__,
            message=rank_module.exception_message(exc),
            traceback=rank_module.format_error(exc, self._filename) + memory.explain(exc, self.namespace, self.rank)
            if with_traceback and not isinstance(exc, place.PlaceError) else "",  # a device OOM: what held it
            post_mortem=self.post_mortem is not None and with_traceback and (self.parks or not self.serving.one_shot),
        )


# --- a rank's whole life -------------------------------------------------------------


def serve(
    rank: int,
    sockets: rank_module.RankSockets,
    setup: Callable[[], dict[str, Any]],
    serving: Serving,
    closing: Callable[[], None] | None = None,
) -> bool:
    """Set up once, then answer requests; False when the rank could not start or its request failed.

    A one-shot rank answers the request that came with its job and leaves;
    ``closing`` is the rendezvous its cell ends with. A pool's rank serves
    until the kernel closes its socket.
    """
    streams = capture.RankStreams(rank, sockets.out, sockets.err)
    capture.attach(streams)
    channel = protocol.Channel(sockets.events, takes_fds=True)
    served: list[RankServer] = []  # the server, once set up: its phase is what the sampler reports
    if os.environ.get(stacks.OFF_SWITCH) != "0":  # off only to measure what it costs (benchmarks/bench_stacks.py)
        stacks.Sampler(rank, sockets.stacks, threading.get_ident(), lambda: served[0].sampled_phase() if served
                       else "setup", lambda: served[0].namespace if served else {})
    thread = threading.current_thread() is not threading.main_thread()
    if not thread:
        interrupt.install_handler()  # rank threads' processes inherited it from the supervisor
        lifetime.become_subreaper()  # what a request starts stays ours to end (see lifetime.ChildWatch)
    request = _decode(serving.first) if serving.first is not None else None
    xla_analysis.claim_analysis()  # before the runtime first compiles: torch_xla reads it once
    waiting_seq = request.fields.get("seq") if request is not None else START_SEQ
    started = time.monotonic()
    server: RankServer | None = None
    try:
        # One stretch for set-up and a one-shot rank's request: an interrupt
        # during set-up means its cell does not run.
        with interrupt.Request():
            try:
                rank_names = setup()
                server = RankServer(rank, channel, streams, rank_names, closing if serving.one_shot else None,
                                    serving)
                served.append(server)
            except BaseException as exc:  # anything from the runtime's start
                streams.flush()
                channel.send(protocol.ERROR, seq=waiting_seq, type=type(exc).__name__,
                             message=rank_module.exception_message(exc),
                             traceback=rank_module.format_error(exc, "<xla_magic rank start>"))
                channel.send(protocol.DONE, seq=waiting_seq, seconds=time.monotonic() - started)
                return False
            channel.send(protocol.STATUS, state="ready", pid=os.getpid(), thread=thread,
                         ordinal=rank_names.get("rank"),  # the global rank (torch_xla's ordinal on a TPU)
                         memory=rank_module.device_memory(server.device) if server.reports_memory else None,
                         compile_cache=compile_cache.reported())
            if request is not None:
                answered = server._answer(request)
                if answered or server.post_mortem is None or not server.parks:
                    return answered
            else:
                server.finish(START_SEQ, None, started)
        server.serve()  # a pool's requests; a one-shot rank kept for %debug: DEBUG, until the kernel lets it go
        if request is not None:
            return False
        # The pool's end: what its cells started ends now, before this process's
        # exit could wait on a child (multiprocessing joins its own at exit).
        server.children.end_all()
        return True
    except KeyboardInterrupt:
        return False  # arrived just as the request ended: it is answered
    except Exception as exc:  # never a bare exit code: say what broke the loop, and where
        if server is not None:
            try:
                frame = server.outside_error_frame(server.seq, exc, "in its serving loop")
                done = protocol.encode(protocol.DONE, seq=server.seq, seconds=time.monotonic() - started)
                with channel.lock:
                    channel.sock.sendall(frame + done)
            except Exception:
                pass  # the kernel is gone; the exit code is all that is left to say it
        return False
    finally:
        if server is not None:
            server.shipped.close()
            server.flush_output()
        if not thread:
            xla_analysis.release_analysis()
        capture.flush_all()


def _decode(frame: bytes) -> protocol.Event:
    events = protocol.FrameReader().feed(frame)
    if len(events) != 1:
        return protocol.Event(protocol.BROKEN, {"reason": "the job's request is not one frame"})
    return events[0]
