"""Debugging a rank of a pool across hosts as on one host: input(), breakpoint() and pdb, %debug / %xla_debug, an
interrupt at the prompt; the host's link to the kernel that carries the prompts. 2 simulated hosts (network
namespaces) x 2 ranks, one real IPython shell whose input is the terminal's (a scripted one on sys.stdin, as a
person typing: tests/helpers.py's Terminal)."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time

import psutil
import pytest
from IPython.utils.capture import capture_output

from helpers import Kernel, Listening, Terminal, pool_magic, press_stop
from tests.hosts_fixtures import hosts, pool, pool_of_the_module, start_line, wait_until_empty  # noqa: F401
from xla_magic.notebook import status
from xla_magic.runs.errors import DebuggerQuit, RankError, RunInterrupted
from xla_magic.hosts import link

HOSTS_TAG = 6  # this module's hosts' names and addresses (tests/hosts_fixtures.py)


def test_input_on_h1_r3_is_asked_with_the_kernels_input_tagged_with_its_global_rank(ip, pool, monkeypatch):
    terminal = Terminal({"[h1 r3] name: ": ["Ada"]})
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", "", "answer = None\n"
                                  "if rank == 3:\n"
                                  "    print('asking', flush=True)\n"
                                  "    print('name:', end=' ')\n"
                                  "    answer = input()\n"
                                  "answer")
    assert value == [None, None, None, "Ada"]
    assert terminal.prompts == ["[h1 r3] name: "]  # one prompt, after what the rank printed before it
    assert shown.stdout.index("[h1 r3] asking\n") < shown.stdout.index("[h1 r3] name: ")
    # The hosts linked when the pool started; nothing of the kernel's listens for them now.
    assert len(pool.links) == 2
    listening = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert [laddr for laddr in listening if laddr.ip == pool.address] == []


def test_breakpoint_on_h1_r2_p_and_c_while_the_panel_says_in_the_debugger(ip, pool, monkeypatch):
    session = ip._xla_magic_session
    seen: list[tuple[str, str]] = []

    def look() -> None:  # at the prompt, as a person looks at the panel
        record = session.history[-1]
        seen.append((record.ranks[2].where, status.ranks_html(record)))

    terminal = Terminal({"[h1 r2] (Pdb) ": ["p step", "p rank", "c"]}, before_each=look)
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", "--hang-after 0.5", "import torch_xla.core.xla_model as xm\n"
                                  "step = rank + 3\n"
                                  "if rank == 2:\n"
                                  "    breakpoint()\n"
                                  "    step += 10\n"
                                  "xm.rendezvous('after')\n"
                                  "step")
    assert value == [3, 4, 15, 6]
    assert "[h1 r2] -> step += 10\n" in shown.stdout
    assert "[h1 r2] 5\n" in shown.stdout and "[h1 r2] 2\n" in shown.stdout  # h1 r2's own step and rank
    assert terminal.prompts == ["[h1 r2] (Pdb) "] * 3
    assert [where for where, _ in seen] == ["in the debugger (line 5)"] * 3
    assert '<td class="xla-where">in the debugger (line 5)</td>' in seen[0][1]
    assert "xla_magic:" not in shown.stdout  # no hang line while the user is at the prompt
    assert session.history[-1].ranks[2].where != "in the debugger (line 5)"  # answered: it moved on


def test_pdb_quit_on_a_host_ends_the_cell_as_ipython_does_and_the_pool_keeps_its_names(ip, pool, monkeypatch):
    monkeypatch.setattr(sys, "stdin", Terminal({"[h0 r1] (Pdb) ": ["q"]}))
    with capture_output() as shown, pytest.raises(DebuggerQuit):  # a BdbQuit, which IPython takes silently
        ip.run_cell_magic("xla_spawn", "", "kept = rank * 7\nif rank == 1:\n    breakpoint()\n    kept = -1\nkept")
    assert "[h0 r1] the debugger was quit at line 4: the cell stopped there" in shown.stdout, shown.stdout
    assert "Traceback" not in shown.stdout
    with capture_output():
        assert ip.run_cell_magic("xla_spawn", "", "kept") == [0, 7, 14, 21]


def test_debug_after_a_cell_fails_on_h1_r2_opens_that_ranks_frame(ip, pool, monkeypatch):
    with capture_output() as failed:
        ip.run_cell("%%xla_spawn\n"
                    "scale = rank + 2\n"
                    "def lookup(table, key):\n"
                    "    found = table[key]\n"
                    "    return found\n"
                    "table = {'a': scale}\n"
                    "lookup(table, 'b' if rank == 2 else 'a')")
    assert isinstance(sys.last_value, RankError) and "KeyError: 'b'" in failed.stdout
    assert "%debug opens rank h1 r2's frame where it failed: the rank keeps it until the next cell." in failed.stdout
    terminal = Terminal({"[h1 r2] (Pdb) ": ["p key", "p table", "up", "p scale", "q"]})
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output() as shown:
        ip.run_cell("%debug")
    text = shown.stdout
    cell = re.search(r"%debug: rank h1 r2 of cell (\d+), in the frame where it failed \(KeyError: 'b'\)", text)
    assert cell is not None, text
    assert f'File "<xla_spawn cell {cell[1]}>", line 3, in lookup' in failed.stdout  # the cell the kernel numbered
    assert f"[h1 r2] > <xla_spawn cell {cell[1]}>(3)lookup()\n[h1 r2] -> found = table[key]\n" in text
    assert "[h1 r2] 'b'\n" in text and "[h1 r2] {'a': 4}\n" in text  # h1 r2's own key and table
    assert "[h1 r2] 4\n" in text  # up: its scale
    assert terminal.prompts == ["[h1 r2] (Pdb) "] * 5
    with capture_output() as refused:
        ip.run_cell("%xla_debug --rank 1")
    assert "only rank 2 did: %xla_debug --rank 2" in refused.stdout + refused.stderr
    with capture_output():
        assert ip.run_cell_magic("xla_spawn", "", "scale") == [2, 3, 4, 5]  # the pool went on


def press_ctrl_c() -> None:
    """A person's Ctrl-C at the kernel's prompt: SIGINT to this process, taken as KeyboardInterrupt here."""
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the signal's handler raises in this thread at its next bytecode
        time.sleep(0.01)


def test_an_interrupt_at_the_prompt_ends_the_cell_and_keeps_the_pool(ip, pool, monkeypatch):
    terminal = Terminal({"[h0 r1] wait? ": ["never typed"]}, before_each=press_ctrl_c)
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output(), pytest.raises(RunInterrupted) as stopped:
        ip.run_cell_magic("xla_spawn", "", "value = rank\nif rank == 1:\n    value = input('wait? ')\nvalue")
    assert terminal.prompts == []  # the interrupt came before the line was read
    assert "the pool keeps its ranks" in str(stopped.value), stopped.value
    assert "h0 r1: waiting for input (line 3)" in str(stopped.value), stopped.value
    with capture_output():
        assert ip.run_cell_magic("xla_spawn", "", "value") == [0, 1, 2, 3]
    assert pool.state == "ready"


def test_xla_stacks_locals_shows_each_hosts_ranks_values_where_they_wait_apart(ip, pool):
    """h1 r3 sleeps while the others wait at a rendezvous: --locals shows each one's own step under its cell frame."""
    session = ip._xla_magic_session
    pressed = threading.Event()

    def stop_once_in_place(record) -> None:
        if not pressed.is_set() and sum("in place" in s.last_line for s in record.ranks.values()) == 4:
            pressed.set()
            threading.Thread(target=press_stop, daemon=True).start()

    with Listening(session, stop_once_in_place), capture_output(), pytest.raises(RunInterrupted):
        ip.run_cell_magic("xla_spawn", "--timeout 240", "import time, torch, torch_xla.core.xla_model as xm\n"
                          "step = rank + 3\n"
                          "batch = torch.zeros(2, 5, device=device)\n"
                          "print('in place', flush=True)\n"
                          "if rank == 3:\n"
                          "    time.sleep(600)\n"
                          "xm.rendezvous('apart')\n")
    with capture_output() as shown:
        ip.run_line_magic("xla_stacks", "--locals")
    lines = shown.stdout.splitlines()

    def block(header: str) -> list[str]:
        start = next(i for i, line in enumerate(lines) if line.endswith(header))
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        return lines[start:end]

    sleeping = block("h1 r3: sleeping in time.sleep (line 6)")
    assert "        step = 6" in sleeping and "        batch = tensor(float32, [2, 5], xla:0)" in sleeping, sleeping
    for rank, label in ((0, "h0 r0"), (1, "h0 r1"), (2, "h1 r2")):
        waiting = block(f"{label}: waiting in xm.rendezvous('apart') (line 7)")
        assert f"        step = {rank + 3}" in waiting, waiting
    assert "0., 0." not in shown.stdout and "tensor([" not in shown.stdout  # never a tensor's values


def test_debug_after_a_fresh_cell_across_hosts_failed_says_to_run_it_in_the_pool(ip, pool):
    with capture_output() as failed:
        ip.run_cell("%%xla_spawn --fresh\nif rank == 2:\n    raise ValueError('h1 r2')")
    assert "ValueError: h1 r2" in failed.stdout and "%debug opens" not in failed.stdout, failed.stdout
    with capture_output() as refused:
        ip.run_cell("%debug")
    assert ("that cell ran in --fresh ranks across hosts, which end with it: run it in the pool across hosts to "
            "debug it") in refused.stdout + refused.stderr


def test_the_link_refuses_a_wrong_token_and_a_replayed_frame():
    key = os.urandom(32)  # the cluster's key, which the kernel and each engine hold
    listener = link.Listener("127.0.0.1", key)
    ticket = listener.ticket()
    assert listener.token.hex() not in str(ticket) and key.hex() not in str(ticket)  # what travels holds neither
    engine_said: dict[str, object] = {}

    def engines() -> None:
        try:
            link.connect(ticket, 0, os.urandom(32))  # another cluster's key: another token
        except link.LinkError as exc:
            engine_said["wrong"] = str(exc)
        engine_said["good"] = link.connect(ticket, 0, key)

    connecting = threading.Thread(target=engines)
    connecting.start()
    try:
        links = listener.accept(1, timeout=60)
    finally:
        connecting.join(60)
        listener.close()
    assert len(listener.refused) == 1 and "it does not hold the pool's token" in listener.refused[0]
    assert "closed the connection during the challenge" in str(engine_said["wrong"])
    kernel_end, engine_end = links[0], engine_said["good"]
    engine_end.send(link.ASK, id=1, prompt="[h0 r0] x? ")
    assert kernel_end.receive(30) == {"kind": link.ASK, "id": 1, "prompt": "[h0 r0] x? "}
    # What travelled, sent again by someone on the network: refused, and the link is lost.
    raw = socket.socket(fileno=os.dup(engine_end.sock.fileno()))
    frame_size = 4 + 8 + 32 + len(b'{"kind": "ask", "id": 1, "prompt": "[h0 r0] x? "}')
    engine_end.send(link.ASK, id=1, prompt="[h0 r0] x? ")
    replayed = kernel_end.sock.recv(frame_size, socket.MSG_PEEK | socket.MSG_WAITALL)
    raw.sendall(replayed)
    assert kernel_end.receive(30)["id"] == 1  # the frame as sent
    with pytest.raises(link.LinkError, match="replayed"):
        kernel_end.receive(30)
    raw.close()
    kernel_end.close()
    engine_end.close()
    with pytest.raises(ValueError):
        link.Listener("0.0.0.0", key)


def test_a_lost_link_is_a_lost_host_and_the_pool_says_it_is_broken(ip, pool):
    kernel_end = pool.links[1]
    kernel_end.sock.shutdown(socket.SHUT_RDWR)  # as a network that drops the connection: each end reads its end
    with capture_output(), pytest.raises(RankError) as failed:
        ip.run_cell_magic("xla_spawn", "", "if rank == 3:\n    input('anyone? ')\nrank")
    assert pool.state == "broken" and "the link of host h1" in pool.problem and "to the kernel was lost" in pool.problem
    assert "the pool is broken" in str(failed.value), failed.value
    with capture_output() as refused:
        ip.run_cell("%%xla_spawn\nrank")
    assert "the pool across hosts is broken" in refused.stdout + refused.stderr


def test_a_notebook_answers_ranks_on_both_hosts_in_its_input_box(ip, hosts, pool_of_the_module):
    # A real Jupyter kernel running the pool: each prompt is an input_request answered as a frontend answers it.
    pool_magic(ip, "stop")  # one pool on the module's hosts at a time: the kernel's now
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        content, text = kernel.run(f"%xla_pool {start_line(hosts)}")
        assert content["status"] == "ok" and "pool ready" in text, text
        typed = {"[h1 r3] name: ": "Ada", "[h0 r0] token? ": "s3cret"}
        content, text = kernel.run("%%xla_spawn\n"
                                   "import getpass\n"
                                   "answer = None\n"
                                   "if rank == 3:\n"
                                   "    answer = input('name: ')\n"
                                   "elif rank == 0:\n"
                                   "    answer = str(len(getpass.getpass('token? ')))\n"
                                   "answer", on_prompt=lambda k, prompt: k.client.input(typed[prompt]))
        assert content["status"] == "ok", text
        assert sorted(kernel.prompts) == [("[h0 r0] token? ", True), ("[h1 r3] name: ", False)]
        assert "['6', None, None, 'Ada']" in text and "s3cret" not in text
        kernel.prompts.clear()
        content, text = kernel.run("%%xla_spawn\nvalue = rank\nif rank == 2:\n    value = input('wait? ')\nvalue",
                                   on_prompt=lambda k, prompt: k.manager.interrupt_kernel())
        assert kernel.prompts == [("[h1 r2] wait? ", False)]
        assert content["status"] == "error" and content["ename"] == "RunInterrupted", text
        assert "the pool keeps its ranks" in text, text
        content, text = kernel.run("%%xla_spawn\nvalue")
        assert content["status"] == "ok" and "[0, 1, 2, 3]" in text, text
        content, text = kernel.run("%xla_pool stop")
        assert content["status"] == "ok", text
    finally:
        kernel.close()
    assert wait_until_empty(hosts) == {}
