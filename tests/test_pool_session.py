"""A pool is a session: what its cells start works in the next cell and ends with the pool.

Through a real Jupyter kernel, in a pool of real rank processes: a
DataLoader's persistent workers, a multiprocessing.Pool, torch.compile's
compile workers and a loopback HTTP server started in one cell serve the
next; %xla_status names them per rank; after %xla_pool stop none is left.
Also here: what raises in a rank outside the cell's code is that rank's
error, never a bare exit code.
"""

from __future__ import annotations

import ast
import ctypes
import os
import re
import signal

import psutil
import pytest

from helpers import DETACHED, Kernel, pool_magic, strip_ansi, wait_gone, wait_zombie

from xla_magic.runs.errors import RankError

# A server in a process of its own: it says its port, then answers every GET with its pid.
SERVER = """
import http.server, os
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = str(os.getpid()).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(('127.0.0.1', 0), Hello)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

CELL_A = """%%xla_spawn
import os, subprocess, sys, multiprocessing, torch
from torch.utils.data import DataLoader, Dataset

class Numbers(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return i * (rank + 1), os.getpid()

loader = DataLoader(Numbers(), batch_size=4, num_workers=2, persistent_workers=True)

def epoch():
    batches = list(loader)
    return int(sum(values.sum() for values, _ in batches)), sorted({int(p) for _, pids in batches for p in pids})

workers = multiprocessing.Pool(2)
double = torch.compile(lambda x: x * 2 + 1)
server = subprocess.Popen([sys.executable, '-c', SERVER], stdout=subprocess.PIPE, text=True)
port = int(server.stdout.readline())
{'epoch': epoch(), 'pool': workers.map(abs, [-1, -2, -3]), 'compiled': double(torch.arange(3.0)).tolist()}
"""

CELL_B = """%%xla_spawn
import urllib.request, psutil
answer = int(urllib.request.urlopen(f'http://127.0.0.1:{port}/', timeout=120).read())
triple = torch.compile(lambda x: x * 3)
{'epoch': epoch(), 'pool': workers.map(abs, [-4, -5]), 'compiled': double(torch.arange(3.0)).tolist(),
 'compiled_again': triple(torch.arange(3.0)).tolist(), 'server': answer == server.pid,
 'kept': [p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]}
"""


def last_value(text: str) -> list:
    """The gathered list a cell's last line printed (the execute_result)."""
    return ast.literal_eval(text[text.rindex("[{"):])


def test_what_a_pool_cell_starts_serves_the_next_cell_and_ends_with_the_pool():
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        kernel.run(f"SERVER = {SERVER!r}")
        reply, text = kernel.run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        reply, text = kernel.run(CELL_A)
        assert reply["status"] == "ok", text
        first = last_value(text)
        reply, text = kernel.run(CELL_B)
        assert reply["status"] == "ok", text
        second = last_value(text)
        for rank in (0, 1):
            a, b = first[rank], second[rank]
            assert a["epoch"][0] == b["epoch"][0] == sum(range(16)) * (rank + 1)
            assert len(a["epoch"][1]) == 2 and a["epoch"][1] == b["epoch"][1]  # the same two workers
            assert a["pool"] == [1, 2, 3] and b["pool"] == [4, 5]
            assert a["compiled"] == b["compiled"] == [1.0, 3.0, 5.0] and b["compiled_again"] == [0.0, 3.0, 6.0]
            assert b["server"]
            assert set(a["epoch"][1]) <= set(b["kept"])
        kept = {pid for rank in (0, 1) for pid in second[rank]["kept"]}
        assert len(kept) >= 2 * (2 + 2 + 1)  # per rank: loader workers, pool workers, the server
        reply, text = kernel.run("%xla_status --text")
        reply, panel = kernel.run("from xla_magic.notebook import status\n"
                                  "print(status.status_panel(get_ipython()._xla_magic_session).ranks.value)")
        for rank in (0, 1):
            row = next(line for line in text.splitlines() if re.match(rf"\s+{rank}\s+done", line))
            count = len(second[rank]["kept"])
            shown = re.search(r" (\d+): ((?:\d+ )+)", row)  # how many, then the first pids
            assert shown and int(shown[1]) == count, row
            assert {int(pid) for pid in shown[2].split()} <= set(second[rank]["kept"]), row
            assert re.search(rf'data-rank="{rank}".*?class="xla-processes" data-count="{count}"', panel), panel
        reply, text = kernel.run("%xla_pool stop")
        assert reply["status"] == "ok" and "pool stopped" in text, text
        assert wait_gone(kept) == []
    finally:
        kernel.close()


# --- no silent deaths --------------------------------------------------------------


# A SIGCHLD handler that raises, as torch's DataLoader's does when one of its workers dies.
RAISING_HANDLER = (
    "import signal, subprocess\n"
    "def complain(signum, frame):\n"
    "    raise RuntimeError('a worker of this rank exited unexpectedly')\n"
    "signal.signal(signal.SIGCHLD, complain)\n"
    "subprocess.Popen(['sleep', '300']).pid\n"
)


def test_a_signal_handler_raising_between_cells_is_the_ranks_error_and_the_pool_lives_on(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        child = spawn("", RAISING_HANDLER).value[1]
        os.kill(child, signal.SIGKILL)  # rank 1 is idle: its handler raises while it waits for a request
        assert wait_zombie(child)
        with pytest.raises(RankError) as info:
            spawn("", "rank")
        text = strip_ansi("\n".join(info.value._render_traceback_()))
        assert "rank(s) 1 failed" in text and "exit code" not in text
        assert "a worker of this rank exited unexpectedly" in text and "in complain" in text  # its traceback
        assert "between requests" in text and "signal.signal(signal.SIGCHLD, complain)" not in text
        assert "while it served the cell starting 'import signal, subprocess'" in text
        assert spawn("", "rank").value == [0, 1]  # the pool lives on
    finally:
        pool_magic(ip, "stop")


# The same handler, made to raise at a chosen moment: rank 1's events socket is wrapped so that, once, a call
# of METHOD that WHEN lets through is made, the socket is put back, and rank 1's child is killed (and waited
# for as a zombie, so SIGCHLD is sent). The wrapper only chooses the moment; the signal and the raise are real.
RAISING_AFTER = RAISING_HANDLER.replace("subprocess.Popen(['sleep', '300']).pid\n", """
import gc, os, sys
from xla_magic.launcher import serve
if rank == 1:
    server = next(o for o in gc.get_objects() if isinstance(o, serve.RankServer))
    child = subprocess.Popen(['sleep', '300'])
    class KillAfter:
        def __init__(self, sock):
            self.sock = sock
        def __getattr__(self, name):
            return getattr(self.sock, name)
        def METHOD(self, *args):
            result = self.sock.METHOD(*args)
            if WHEN:
                server.channel.sock = self.sock
                os.kill(child.pid, signal.SIGKILL)
                os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            return result
    server.channel.sock = KillAfter(server.channel.sock)
rank
""")
# The narrowest window a loaded machine opens after a cell: just after the rank's reply and DONE went out (not
# an event during the cell), before the rank returned to waiting.
RAISING_JUST_AFTER_THE_REPLY = RAISING_AFTER.replace("METHOD", "sendall").replace(
    "WHEN", "sys._getframe(1).f_code.co_name == 'finish'")


def test_a_signal_handler_raising_just_after_the_reply_went_out_is_told_with_the_next_cell(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        assert spawn("", RAISING_JUST_AFTER_THE_REPLY).value == [0, 1]
        with pytest.raises(RankError) as info:  # lost before the fix: its reply went to a request already done
            spawn("", "rank")
        text = strip_ansi("\n".join(info.value._render_traceback_()))
        assert "rank(s) 1 failed" in text and "a worker of this rank exited unexpectedly" in text
        assert "between requests" in text
        assert spawn("", "rank").value == [0, 1]
    finally:
        pool_magic(ip, "stop")


# The window before a cell: between a request's bytes leaving the socket and the rank keeping them.
# A rank's events channel reads with recvmsg (socket.recv_fds: a LEND's descriptors come with its bytes).
RAISING_JUST_AS_A_REQUEST_IS_READ = RAISING_AFTER.replace("METHOD", "recvmsg").replace("WHEN", "True")


def test_a_signal_handler_raising_just_as_a_request_is_read_loses_no_request(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        assert spawn("", RAISING_JUST_AS_A_REQUEST_IS_READ).value == [0, 1]
        # The next read is the next cell's request, or (where the rank was already waiting in a read) the one
        # after: one of the two is answered with the handler's error, the other runs, and neither is lost
        # (lost before the fix: its cell waited for its --timeout).
        answers = []
        for _ in range(2):
            try:
                answers.append(spawn("--timeout 120", "rank").value)
            except RankError as error:
                answers.append(strip_ansi("\n".join(error._render_traceback_())))
        errors = [answer for answer in answers if isinstance(answer, str)]
        assert len(errors) == 1 and [0, 1] in answers, answers
        assert "rank(s) 1 failed" in errors[0] and "a worker of this rank exited unexpectedly" in errors[0]
        assert "between requests" in errors[0] and "timed out" not in errors[0]
        assert spawn("", "rank").value == [0, 1]
    finally:
        pool_magic(ip, "stop")


def test_a_one_shot_cell_ends_a_persistent_dataloaders_workers_without_a_word_from_torch(spawn):
    cell = (
        "import os, torch\n"
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)\n"
        "total = int(sum(batch.sum() for batch in loader))\n"
        "(total, [w.pid for w in loader._iterator._workers])"
    )
    run = spawn("--devices 2", cell)
    assert [total for total, _ in run.value] == [28, 28]
    assert "exited unexpectedly" not in run.stderr
    assert wait_gone({pid for _, pids in run.value for pid in pids}) == []
    assert spawn("--devices 2", "rank").value == [0, 1]


THREAD_CELL = """
import multiprocessing, os, time
from torch.utils.data import DataLoader
if 'loader' not in globals():
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                        worker_init_fn=lambda _: None)
    sleeper = multiprocessing.Process(target=time.sleep, args=(300,))  # not a daemon: exit would join it
    sleeper.start()
batches = list(loader)
(int(sum(b.sum() for b in batches)), sorted(w.pid for w in loader._iterator._workers), sleeper.pid)
"""


def test_on_the_tpu_launch_path_a_pool_keeps_what_its_rank_threads_start_and_its_stop_ends_it(ip, spawn, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path: xmp.spawn's rank threads on the CPU
    pool_magic(ip, "start --devices 2 --backend tpu")
    try:
        first = spawn("", THREAD_CELL).value
        second = spawn("", THREAD_CELL).value
        assert first == second and [total for total, _, _ in first] == [28, 28]
        pids = {pid for _, workers, sleeper in first for pid in [*workers, sleeper]}
        assert len(pids) == 6 and all(psutil.pid_exists(pid) for pid in pids)
    finally:
        pool_magic(ip, "stop")
    assert wait_gone(pids) == []


DETACHING = "%%xla_spawn\n" + DETACHED


def orphans_come_here(on: bool) -> None:
    """Make this process a child subreaper, or stop it being one.

    Orphans then come here instead of to the machine's init, which on some
    hosts (sandboxes, CI runners) ends them itself and so would hide a leak.
    """
    ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def test_what_a_pool_keeps_ends_with_a_killed_kernel_however_it_detached():
    orphans_come_here(True)
    kernel = Kernel()
    kept: set[int] = set()
    try:
        kernel.run("%load_ext xla_magic")
        reply, text = kernel.run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        reply, text = kernel.run(DETACHING)
        assert reply["status"] == "ok", text
        kept = {pid for per_rank in ast.literal_eval(text[text.rindex("[["):]) for pid in per_rank}
        assert len(kept) == 4 and all(psutil.pid_exists(pid) for pid in kept)
        os.kill(kernel.pid, signal.SIGKILL)
        assert wait_gone(kept) == []
    finally:
        kernel.close()
        orphans_come_here(False)
        for pid in kept:  # what a failure left, now our children
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
