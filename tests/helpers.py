"""What the test files share, written once: the pool magic, waits on events, the stop button, kernels.

Runs in the test process (the kernel side). Every wait here waits for an
event (a predicate over real state: a process table, files a rank wrote, a
listener's report, a kernel's output) with a generous deadline that only
bounds a failure; none of them is a guessed duration.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator

import nbformat
import psutil
from IPython.utils.capture import capture_output

# Colours and cursor moves (CSI sequences) as IPython, tqdm and the panel write them.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# How long a wait may take before it is a failure (a loaded 2-core machine is slow, never this slow).
WITHIN = 240.0
KERNEL_TIMEOUT = 240


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def pool_magic(ip, line: str) -> str:
    """Run ``%xla_pool LINE`` in the shell; what it printed."""
    with capture_output() as captured:
        ip.run_line_magic("xla_pool", line)
    return captured.stdout


def spawn_cell(ip, line: str, source: str) -> tuple:
    """Run a ``%%xla_spawn LINE`` cell in the shell: (value, stdout, stderr without colours, rich outputs)."""
    with capture_output() as captured:
        value = ip.run_cell_magic("xla_spawn", line, source)
    return value, captured.stdout, strip_ansi(captured.stderr), captured.outputs


def wait_for(ready: Callable[[], Any], within: float = WITHIN, every: float = 0.02) -> Any:
    """Poll ``ready()`` until it is truthy (its value) or ``within`` s passed (its last, falsy, value)."""
    deadline = time.monotonic() + within
    while not (value := ready()) and time.monotonic() < deadline:
        time.sleep(every)
    return value


# --- processes -------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie has ended: only its parent's wait is missing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], within: float = 60.0) -> list[int]:
    """Wait until every one of ``pids`` has ended; those still alive then (``[]`` when all went)."""
    pids = list(pids)
    wait_for(lambda: not any(alive(pid) for pid in pids), within, every=0.05)
    return [pid for pid in pids if alive(pid)]


def wait_zombie(pid: int, within: float = 30.0) -> bool:
    """``pid`` has exited and its parent has not reaped it yet (its SIGCHLD is sent)."""
    def zombie() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return wait_for(zombie, within, every=0.05)


def stopped(pid: int, within: float = WITHIN) -> bool:
    """Every thread of ``pid`` is stopped (SIGSTOP took hold: none can read a socket any more), as /proc says.

    kill() returns before that: a thread asleep in a read is only woken to stop, and one that finds data
    when it runs reads it first (a rank reads its requests in a thread of its own: protocol.Inbox).
    """
    def all_stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            states = [open(f"/proc/{pid}/task/{tid}/stat").read().rpartition(")")[2].split()[0] for tid in tasks]
        except FileNotFoundError:
            return False
        return all(state in ("T", "t") for state in states)
    return wait_for(all_stopped, within)


# A cell that starts a helper in a session of its own and a daemon (fork, setsid, fork again, the middle one
# exits, and the cell reaps it: the daemon is then the rank's own, as ranks are subreapers), and names the
# processes it now has: two a rank.
DETACHED = """
import os, subprocess, time, psutil
helper = subprocess.Popen(['sleep', '300'], start_new_session=True)
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
    os._exit(0)
os.waitpid(middle, 0)
sorted(p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE)
"""


# A cell in which each rank writes its own element of a shipped ``weights``, waits until every rank has
# written (a file each in ``marks``: the ranks overlap, by construction), then reads the first two: a private
# copy shows only the rank's own write.
WRITE_MEET_READ = (
    "import os, time\n"
    "weights[rank] = 1 + rank\n"
    "open(f'{marks}/{rank}', 'w').close()\n"
    "while len(os.listdir(marks)) < world_size:\n"
    "    time.sleep(0.01)\n"
    "weights[:2].tolist()"
)


# FSDPv2 as torch_xla's docs use it, in cell code: wrap ``module`` over ``mesh``'s "fsdp" axis, shard the
# input the same way, then step an ordinary optimizer STEPS times (``losses``, one a step). A test gives
# module, mesh, inputs, targets, STEPS and LR, and computes its reference with plain torch (reference_training).
FSDP_WRAP = """
model = FSDPv2(module, mesh=mesh)  # the docs pass it positionally; 2.9 takes it by keyword only
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
x, y = inputs.to(device), targets.to(device)
xs.mark_sharding(x, mesh, ("fsdp", None))
xs.mark_sharding(y, mesh, ("fsdp", None))
"""
FSDP_STEPS = """
losses = []
for step in range(STEPS):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
"""


def reference_training(module, inputs, targets, steps: int, lr: float) -> list[float]:
    """FSDP_STEPS's reference: ``module`` trained in place by plain torch on the CPU, whole batch; the losses."""
    import torch
    from torch import nn

    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(module(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# A cell with something to profile: three steps under xp.Trace("forward"), one of another shape (three graphs).
# Ends a cell that defines ``attempts`` (name -> a call every rank must see refused) and ``after`` (a good call,
# made once all were tried): its value is each rank's ``messages``, name -> "Type: message" of what the call
# raised (none for a call that did not raise), and "after" -> what the good call gave (the ranks are in step).
EACH_REFUSED = """
messages = {}
for name, attempt in attempts.items():
    try:
        attempt()
    except (ValueError, TypeError, RuntimeError) as exc:
        messages[name] = f"{type(exc).__name__}: {exc}"
messages["after"] = after()
messages
"""


def assert_refused(messages: dict[str, str], patterns: dict[str, str], rank: int) -> None:
    """Rank ``rank`` refused exactly the attempts in ``patterns``, each with a message its pattern matches."""
    assert messages.keys() == patterns.keys(), f"rank {rank} refused {sorted(messages)}, not {sorted(patterns)}"
    for name, pattern in patterns.items():
        assert re.search(pattern, messages[name]), f"rank {rank} {name}: {messages[name]}"


PROFILED = """
import torch, torch_xla
import torch_xla.debug.profiler as xp
w = torch.randn(16, 4, device=device)
for n in [8, 8, 5]:
    with xp.Trace("forward"):
        x = torch.randn(n, 16, device=device)
        y = (x @ w).relu().sum()
    torch_xla.sync()
y.item()
"""


# --- what the extension started


def extension_processes(ip) -> list[psutil.Process]:
    """Every live process this kernel started, except the launcher itself."""
    launcher = ip._xla_magic_session.host.launcher
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if launcher is not None and child.pid == launcher.pid:
                continue
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def assert_nothing_left(ip) -> None:
    assert wait_gone(p.pid for p in extension_processes(ip)) == []
    launcher = ip._xla_magic_session.host.launcher
    assert launcher is not None and launcher.alive(), "the launcher must survive faults"


# --- the stop button -------------------------------------------------------------------


_watchers: list[threading.Event] = []


def when(ready: Callable[[], Any], action: Callable[[], Any], within: float = WITHIN) -> threading.Event:
    """Run ``action`` in a thread once ``ready()``; the event is set only if it was.

    After ``within`` s ``action`` runs anyway, so a test whose event never
    comes fails on the event instead of hanging. A watcher still waiting when
    its test ends is stopped then (``stop_watching``, from conftest.py): it
    never acts in a later test.
    """
    happened, stopped = threading.Event(), threading.Event()
    _watchers.append(stopped)

    def watch() -> None:
        try:
            came = wait_for(lambda: stopped.is_set() or ready(), within)
        except Exception:  # a condition that cannot be read fails its test at once instead of hanging it
            traceback.print_exc()
            came = False
        if came and not stopped.is_set():
            happened.set()
        if not stopped.is_set():
            action()

    threading.Thread(target=watch, daemon=True).start()
    return happened


def stop_watching() -> None:
    """Stop every watcher ``when`` started (at the end of each test)."""
    for stopped in _watchers:
        stopped.set()
    _watchers.clear()


def press_stop() -> None:
    """The notebook's stop button, as a kernel gets it: SIGINT to this process."""
    os.kill(os.getpid(), signal.SIGINT)


def interrupt_when(ready: Callable[[], Any], within: float = WITHIN, then: Callable[[], Any] | None = None) -> threading.Event:
    """Press the stop button once ``ready()`` (see ``when``); ``then``, if given, is waited for next and
    answered with a second press."""

    def press() -> None:
        press_stop()
        if then is not None and wait_for(then, within):
            press_stop()

    return when(ready, press, within)


def main_thread_in(function: Callable[..., Any]) -> bool:
    """This process's main thread (the one running the cell, as a kernel's does) is now inside ``function``."""
    import sys

    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


def files_in(folder: str) -> int:
    return len(os.listdir(folder))


def emptied(folder: str) -> str:
    """``folder``, its files removed (for the next cell's marks)."""
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    return folder


def interrupt_once_written(folder: str, count: int, **kwargs: Any) -> threading.Event:
    """Press the stop button once ``count`` files are in ``folder`` (each rank writes one when it is in its loop)."""
    return interrupt_when(lambda: files_in(folder) >= count, **kwargs)


def shown(text: str) -> int:
    """How many times the running cell showed ``text`` so far (its output, under capture_output)."""
    import sys

    return getattr(sys.stdout, "getvalue", str)().count(text)


def interrupt_once_shown(text: str, times: int, **kwargs: Any) -> threading.Event:
    """Press the stop button once the running cell showed ``text`` ``times`` times (under capture_output)."""
    return interrupt_when(lambda: shown(text) >= times, **kwargs)


class Terminal(io.TextIOBase):
    """The terminal a person types at: what is typed depends on the prompt (the line the cell's output ends with),
    after ``before_each`` looked around; prompts can come in any order."""

    def __init__(self, answers: dict[str, list[str]], before_each=lambda: None) -> None:
        self.answers = {prompt: list(lines) for prompt, lines in answers.items()}
        self.before_each = before_each
        self.prompts: list[str] = []

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        self.before_each()
        prompt = sys.stdout.getvalue().rsplit("\n", 1)[-1]  # input() wrote it to the captured output
        self.prompts.append(prompt)
        left = self.answers.get(prompt, [])
        return left.pop(0) + "\n" if left else ""


class Listening:
    """A listener on the session's records, added for one block and removed after, whatever happened.

    ``with Listening(session, listener):`` removes only its own listener, so
    the status panel's and any other stay (the leak check in conftest.py).
    """

    def __init__(self, session, listener: Callable[[Any], None]) -> None:
        self.session = session
        self.listener = listener

    def __enter__(self) -> Callable[[Any], None]:
        self.session.listeners.append(self.listener)
        return self.listener

    def __exit__(self, *exc: object) -> None:
        if self.listener in self.session.listeners:
            self.session.listeners.remove(self.listener)


def stop_on_record(session, ready: Callable[[Any], bool]) -> tuple[Listening, threading.Event]:
    """Press the stop button (SIGINT to this process, as a kernel gets it) once ``ready(record)`` holds for a
    record of the session's: ``with`` the listening around the cell; the event says it was pressed."""
    sent = threading.Event()

    def listener(record) -> None:
        if not sent.is_set() and ready(record):
            sent.set()
            threading.Thread(target=press_stop, daemon=True).start()

    return Listening(session, listener), sent


def the_watchdog_spoke(record) -> bool:
    return record.hang is not None


def every_rank(record, state: str) -> bool:
    return bool(record.ranks) and all(s.state == state for s in record.ranks.values())


def on_every_rank_running(session, action: Callable[[], Any]) -> Listening:
    """A listener that runs ``action`` (in a thread, once) when every rank of a run is running.

    Use as ``with on_every_rank_running(session, action): ...``.
    """
    fired = threading.Event()

    def listener(record) -> None:
        if not fired.is_set() and every_rank(record, "running"):
            fired.set()
            threading.Thread(target=action, daemon=True).start()

    listening = Listening(session, listener)
    listening.fired = fired  # type: ignore[attr-defined]
    return listening


def stacks_with_a_thread_left(shell) -> tuple[list[str], int]:
    """Run a pool cell in ``shell`` that leaves a thread, 'napper', asleep at line 3 of the cell, then
    %xla_stacks: the lines it printed, and the index of the one that says where the pool's ranks are now."""
    leaves_a_thread = ("import threading, time\n"
                       "def nap():\n"
                       "    time.sleep(600)\n"
                       "threading.Thread(target=nap, name='napper', daemon=True).start()\n")
    with capture_output():
        shell.run_cell_magic("xla_spawn", "", leaves_a_thread)
    with capture_output() as captured:
        shell.run_line_magic("xla_stacks", "")
    lines = captured.stdout.splitlines()
    return lines, lines.index("Where the pool's ranks are now:")


# --- real kernels ----------------------------------------------------------------------


class Kernel:
    """A real kernel driven through jupyter_client, cell by cell."""

    def __init__(self, kernel_name: str = "python3") -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name=kernel_name, startup_timeout=60)
        self.prompts: list[tuple[str, bool]] = []  # what the kernel asked for (see run's answers)

    def run(self, code: str, timeout: float = KERNEL_TIMEOUT, on_output=None,
            answers: list[str] | None = None, on_prompt=None, allow_stdin: bool | None = None) -> tuple[dict, str]:
        """Run one cell; its reply's content and the text it showed (streams, errors, results), colours removed.

        With ``answers`` the kernel may ask for input (``allow_stdin``): each ``input_request`` is answered, as
        a frontend does, with the next answer, and its (prompt, password) appended to ``self.prompts``; or, with
        ``on_prompt``, by what ``on_prompt(self, prompt)`` does (answer, or interrupt the kernel).
        ``allow_stdin=False``: a frontend that sends no input (as nbclient).
        """
        chunks: list[str] = []
        left = list(answers or ())

        def stdin_hook(msg):
            content = msg["content"]
            self.prompts.append((content["prompt"], content["password"]))
            if on_prompt is not None:
                on_prompt(self, content["prompt"])
            else:
                self.client.input(left.pop(0) if left else "")

        def hook(msg):
            content = msg["content"]
            if msg["msg_type"] == "stream":
                chunks.append(content["text"])
            elif msg["msg_type"] == "error":
                chunks.append(f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"]))
            elif msg["msg_type"] == "execute_result":
                chunks.append(content["data"].get("text/plain", ""))
            if on_output is not None:
                on_output("".join(chunks))

        # stop_on_error=False: ipykernel 6 would otherwise abort the next request if it
        # arrives just after an expected error (Colab's stack).
        stdin = {"allow_stdin": True, "stdin_hook": stdin_hook} if answers is not None or on_prompt is not None else {}
        if allow_stdin is not None:
            stdin["allow_stdin"] = allow_stdin
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook, stop_on_error=False, **stdin)
        return reply["content"], strip_ansi("".join(chunks))

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def close(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        else:  # a test killed it: its connection file is still ours to remove
            self.manager.cleanup_resources()


@contextlib.contextmanager
def kernel_with_pool(devices: int = 2) -> Iterator[Kernel]:
    """A real kernel with the extension loaded and a pool of ``devices`` ranks on the cpu backend; closed after
    (the pool with it)."""
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        content, text = kernel.run(f"%xla_pool start --devices {devices} --backend cpu")
        assert content["status"] == "ok", text
        yield kernel
    finally:
        kernel.close()


def notebook(*cells: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(cell) for cell in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, path: str | None = None, timeout: float = KERNEL_TIMEOUT,
            allow_errors: bool = True, **env: str) -> nbformat.NotebookNode:
    """Run every cell of ``nb`` in a fresh kernel (in ``path``, with ``env`` added to its environment)."""
    from nbclient import NotebookClient

    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
        resources={"metadata": {"path": path or os.getcwd()}},
    )
    saved = dict(os.environ)  # the kernel inherits this process's environment (on every stack's nbclient)
    os.environ.update(env)
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def text_of(cell) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}\n" + "\n".join(output.traceback))
    return strip_ansi("".join(parts))


def cell_name_aside(traceback: str) -> str:
    """A shown traceback with its cell's name (In[N], or a file name) as CELL: the same for any cell."""
    return re.sub(r'In ?\[\d+\]|"[^"\n]*"', "CELL", traceback, count=1)


def shown_error(cell) -> str:
    """The traceback a front end shows for the cell's error, its cell's name left out."""
    (error,) = [output for output in cell.outputs if output.output_type == "error"]
    return cell_name_aside(strip_ansi("\n".join(error.traceback)))


def stream(cell, name: str) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == name)
