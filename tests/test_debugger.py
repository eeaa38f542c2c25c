"""Debugging a rank from the notebook: input(), getpass, breakpoint(), pdb, %debug, through a real Jupyter kernel.

The kernel is asked for input as a frontend asks it (``allow_stdin``, each
``input_request`` answered on the stdin channel, see helpers.Kernel.run);
what pdb prints on a rank is checked against the values that rank holds.
The tpu launch path's rank threads and the watchdog at the prompt are
checked through the real shell, whose input is the terminal's (here a
scripted one on sys.stdin, as a person typing).
"""

from __future__ import annotations

import re
import sys
import time

import pytest
from IPython.utils.capture import capture_output

from helpers import Kernel, Terminal, alive, kernel_with_pool, wait_for, wait_gone
from xla_magic.runs import stacks
from xla_magic.runs.errors import RankError


@pytest.fixture(scope="module")
def kernel():
    """A real kernel with a 2-rank pool for the module; one-shot cells in it run with --fresh."""
    with kernel_with_pool() as k:
        yield k


def asked(kernel: Kernel, code: str, answers: list[str]) -> str:
    """Run ``code``, answering each prompt in turn; what the cell showed. Every prompt was answered."""
    kernel.prompts.clear()
    _content, text = kernel.run(code, answers=answers)
    assert len(kernel.prompts) == len(answers), (kernel.prompts, text)
    return text


def test_input_and_getpass_on_pool_ranks_ask_in_the_notebook_tagged_with_the_rank(kernel):
    typed = {"[rank 0] name: ": "Ada", "[rank 1] token? ": "s3cret"}
    kernel.prompts.clear()
    content, text = kernel.run(
        "%%xla_spawn\n"
        "import getpass\n"
        "if rank == 0:\n"
        "    print('name:', end=' ')\n"
        "    answer = input()\n"
        "else:\n"
        "    answer = str(len(getpass.getpass('token? ')))\n"
        "answer",
        on_prompt=lambda k, prompt: k.client.input(typed[prompt]))
    assert content["status"] == "ok", text
    assert sorted(kernel.prompts) == [("[rank 0] name: ", False), ("[rank 1] token? ", True)]
    assert "['Ada', '6']" in text and "s3cret" not in text


def test_input_without_stdin_in_the_frontend_is_an_eof_error_that_says_why(kernel):
    content, text = kernel.run("%%xla_spawn\nif rank == 1:\n    input('x? ')\nrank", allow_stdin=False)
    assert content["status"] == "error"
    assert ("[rank 1] EOFError: this frontend sends no input to the kernel (allow_stdin is off, as in nbconvert "
            "and nbclient runs), so nothing can answer input() on rank 1") in text
    cell = re.search(r'File "<xla_spawn cell (\d+)>", line 2', text)[1]
    text = asked(kernel, "%debug", ["p rank", "q"])  # at the cell's line that called input(), as in a plain cell
    assert f"[rank 1] > <xla_spawn cell {cell}>(2)<module>()\n[rank 1] -> input('x? ')\n[rank 1] 1\n" in text, text
    assert "debugger.py" not in text
    content, text = kernel.run("%%xla_spawn\nrank")
    assert content["status"] == "ok" and "[0, 1]" in text  # the pool goes on


def test_breakpoint_stops_one_rank_under_the_cell_at_cell_lines_and_c_continues(kernel):
    text = asked(kernel, "%%xla_spawn\n"
                 "step = rank + 3\n"
                 "data = {'rank': rank, 'steps': [step] * 2}\n"
                 "if rank == 0:\n"
                 "    breakpoint()\n"
                 "step += 10\n"
                 "step", ["p step", "pp data", "l", "c"])
    assert re.search(r"\[rank 0\] > <xla_spawn cell \d+>\(5\)<module>\(\)\n\[rank 0\] -> step \+= 10\n", text), text
    assert "[rank 0] 3\n" in text and "[rank 0] {'rank': 0, 'steps': [3, 3]}\n" in text
    assert "[rank 0]   4  \t    breakpoint()\n[rank 0]   5  ->\tstep += 10\n" in text  # l: the cell's own lines
    assert kernel.prompts == [("[rank 0] (Pdb) ", False)] * 4
    assert "[13, 14]" in text


def test_pdb_quit_ends_the_cell_as_ipython_does_and_the_pool_keeps_its_names(kernel):
    kernel.prompts.clear()
    content, text = kernel.run("%%xla_spawn\n"
                               "kept = rank * 7\n"
                               "import pdb\n"
                               "if rank == 1:\n"
                               "    pdb.set_trace()\n"
                               "    kept = -1\n"
                               "kept", answers=["q"])
    assert kernel.prompts == [("[rank 1] (Pdb) ", False)]
    assert re.search(r"\[rank 1\] the debugger was quit at line 5: the cell stopped there", text), text
    assert "Traceback" not in text and "bdb" not in text.lower().replace("(pdb)", "")
    content, text = kernel.run("%%xla_spawn\nkept")
    assert content["status"] == "ok" and "[0, 7]" in text


def test_torch_distributed_breakpoint_opens_pdb_on_its_rank_only(kernel, tmp_path):
    kernel.run(f"store = {str(tmp_path / 'store')!r}")
    text = asked(kernel, "%%xla_spawn\n"
                 "import torch.distributed as dist\n"
                 "dist.init_process_group('gloo', init_method='file://' + store, rank=rank, world_size=world_size)\n"
                 "step = rank + 3\n"
                 "dist.breakpoint(0)\n"
                 "dist.destroy_process_group()\n"
                 "step", ["up", "p step", "c"])
    assert "[rank 0] Type 'up' to get to the frame that called dist.breakpoint(rank=0)" in text
    assert re.search(r"\[rank 0\] > <xla_spawn cell \d+>\(4\)<module>\(\)\n\[rank 0\] -> dist.breakpoint\(0\)\n"
                     r"\[rank 0\] 3\n", text), text
    assert kernel.prompts == [("[rank 0] (Pdb) ", False)] * 3 and "[3, 4]" in text


def test_debug_after_a_failed_pool_cell_opens_the_failing_ranks_frame(kernel):
    content, failed = kernel.run("%%xla_spawn\n"
                                 "scale = rank + 2\n"
                                 "def lookup(table, key):\n"
                                 "    found = table[key]\n"
                                 "    return found\n"
                                 "table = {'a': scale}\n"
                                 "lookup(table, 'b' if rank == 1 else 'a')")
    assert "KeyError: 'b'" in failed
    assert "%debug opens rank 1's frame where it failed: the rank keeps it until the next cell." in failed
    text = asked(kernel, "%debug", ["p key", "p table", "up", "p scale", "down", "l", "q"])
    cell = re.search(r"%debug: rank 1 of cell (\d+), in the frame where it failed \(KeyError: 'b'\)", text)
    assert cell is not None, text
    assert f"[rank 1] > <xla_spawn cell {cell[1]}>(3)lookup()\n[rank 1] -> found = table[key]\n" in text
    assert "[rank 1] 'b'\n[rank 1] {'a': 3}\n" in text  # rank 1's own key and table
    assert f"[rank 1] > <xla_spawn cell {cell[1]}>(6)<module>()\n" in text and "[rank 1] 3\n" in text  # up: scale
    assert "[rank 1]   3  ->\t    found = table[key]\n" in text
    assert "request.py" not in text and kernel.prompts == [("[rank 1] (Pdb) ", False)] * 7
    content, text = kernel.run("%xla_debug --rank 0")
    assert f"rank 0 of cell {cell[1]} kept no frames to debug; only rank 1 did: %xla_debug --rank 1" in text
    assert "[rank 1] 3\n" in asked(kernel, "%debug", ["p scale", "q"])  # a mistyped magic since: still rank 1's


def test_several_failed_ranks_debug_opens_the_first_failure_and_xla_debug_another(kernel, tmp_path):
    # Rank 0 fails only once the kernel has recorded rank 1's failure (a listener on the session there writes
    # the file it waits for), so rank 1's is the first failure whatever the machine's load.
    content, _ = kernel.run(f"failed_first = {str(tmp_path / 'failed')!r}\n"
                            "import pathlib\n"
                            "def _tell_rank_1_failed(record):\n"
                            "    state = record.ranks.get(1)\n"
                            "    if state is not None and state.state == 'failed':\n"
                            "        pathlib.Path(failed_first).touch()\n"
                            "get_ipython()._xla_magic_session.listeners.append(_tell_rank_1_failed)")
    assert content["status"] == "ok"
    try:
        content, failed = kernel.run("%%xla_spawn\n"
                                     "import os, time\n"
                                     "if rank == 0:\n"
                                     "    deadline = time.monotonic() + 60\n"
                                     "    while not os.path.exists(failed_first) and time.monotonic() < deadline:\n"
                                     "        time.sleep(0.001)\n"
                                     "raise ValueError(f'rank {rank} fails')")
    finally:
        kernel.run("get_ipython()._xla_magic_session.listeners.remove(_tell_rank_1_failed)")
    assert "%debug opens rank 1's frame where it failed; %xla_debug --rank R opens another's (0)" in failed
    assert "[rank 1] 1\n" in asked(kernel, "%debug", ["p rank", "q"])
    text = asked(kernel, "%xla_debug --rank 0", ["p rank", "q"])
    assert "%debug: rank 0 of cell" in text and "(ValueError: rank 0 fails)" in text and "[rank 0] 0\n" in text
    kernel.run("%%xla_spawn\nrank")
    content, text = kernel.run("%debug")  # the traceback IPython holds is the failed cell's, whose frames are gone
    assert re.search(r"cell \d+'s ranks no longer hold its frames \(another cell ran since\): run the cell again, "
                     r"and %debug once it fails", text), text


def test_interrupt_at_the_prompt_ends_the_cell_and_keeps_the_pool(kernel):
    kernel.prompts.clear()
    content, text = kernel.run("%%xla_spawn\nvalue = rank\nif rank == 0:\n    value = input('wait? ')\nvalue",
                               on_prompt=lambda k, prompt: k.manager.interrupt_kernel())
    assert kernel.prompts == [("[rank 0] wait? ", False)]
    assert content["status"] == "error" and content["ename"] == "RunInterrupted"
    assert "the pool keeps its ranks" in text and "rank 0: waiting for input (line 3)" in text
    kernel.prompts.clear()
    content, text = kernel.run("%debug", answers=["q"])  # not IPython's debugger in the kernel's own frames
    assert kernel.prompts == [] and "request.py" not in text
    assert ("the last cell was interrupted, not failed, so no rank kept a frame to debug: %xla_stacks shows where "
            "each rank was (--locals with its values); to stop a rank at a line, put breakpoint() there") in text
    content, text = kernel.run("%%xla_spawn\nvalue")
    assert content["status"] == "ok" and "[0, 1]" in text


def test_interrupt_at_the_debuggers_prompt_stops_the_rank_and_does_not_fail_it(kernel):
    kernel.prompts.clear()
    content, text = kernel.run("%%xla_spawn\nvalue = rank\nif rank == 0:\n    breakpoint()\n    value = -1\nvalue",
                               on_prompt=lambda k, prompt: k.manager.interrupt_kernel())
    assert kernel.prompts == [("[rank 0] (Pdb) ", False)]
    assert content["status"] == "error" and content["ename"] == "RunInterrupted", text
    assert "rank 0: in the debugger (line 4)" in text and "BdbQuit" not in text, text
    content, text = kernel.run("[(s.state, s.where) for s in get_ipython()._xla_magic_session.history[-1].ranks.values()]")
    assert text.startswith("[('killed', 'in the debugger (line 4)'), ("), text  # stopped, not failed
    content, text = kernel.run("%%xla_spawn\nvalue")
    assert content["status"] == "ok" and "[0, 1]" in text


def test_debug_and_xla_debug_with_nothing_to_open_say_why_and_what_to_do(kernel):
    content, failed = kernel.run("%%xla_spawn\nvalue = rank\nif rank == 1:\n    raise ValueError('one')")
    cell = re.search(r'File "<xla_spawn cell (\d+)>"', failed)[1]
    for line, said in (("--rank abc", "--rank takes a rank's number, like --rank 1, not 'abc'"),
                       ("--rank -1", "--rank takes a rank's number, 0 or more, not -1"),
                       ("--rank 2", f"cell {cell} ran on ranks 0-1, so it has no rank 2; %xla_debug --rank 1 opens "
                                    f"the frame of a rank that failed")):
        content, text = kernel.run(f"%xla_debug {line}")
        assert content["status"] == "error" and content["ename"] == "UsageError" and said in text, text
    kernel.run("%%xla_spawn\nvalue")  # a cell that works: the failed one's frames are let go
    kernel.prompts.clear()
    for magic in ("%xla_debug", "%debug"):  # %debug after the refused magic: not IPython's debugger in our code
        content, text = kernel.run(magic, answers=["q"])
        assert (f"cell {cell}'s ranks no longer hold its frames (another cell ran since): run the cell again, and "
                f"%debug once it fails") in text, text
    assert kernel.prompts == []
    content, failed = kernel.run("%%xla_spawn\nraise ValueError(rank)")
    cell = re.search(r'File "<xla_spawn cell (\d+)>"', failed)[1]
    content, text = kernel.run("%xla_pool restart")
    assert content["status"] == "ok", text
    content, text = kernel.run("%debug", answers=["q"])
    assert f"cell {cell}'s ranks no longer hold its frames (new ranks started since)" in text, text
    assert kernel.prompts == []


def test_debug_after_the_pool_was_stopped_says_so(pool, ip):
    with capture_output() as failed:
        ip.run_cell("%%xla_spawn\nraise ValueError(rank)")
        ip.run_line_magic("xla_pool", "stop")
    cell = re.search(r'File "<xla_spawn cell (\d+)>"', failed.stdout)[1]
    with capture_output() as refused:
        ip.run_cell("%debug")
    assert (f"cell {cell}'s ranks no longer hold its frames (the pool was stopped): run the cell again, and %debug "
            f"once it fails") in refused.stdout + refused.stderr


def test_debug_after_a_failed_one_shot_cell_keeps_its_process_until_the_debugger_is_left(kernel):
    content, failed = kernel.run("%%xla_spawn --fresh --devices 2 --backend cpu\n"
                                 "import os\n"
                                 "pid = os.getpid()\n"
                                 "print('pid', pid)\n"
                                 "if rank == 1:\n"
                                 "    raise ValueError(f'bad {pid}')")
    pid = int(re.search(r"\[rank 1\] pid (\d+)", failed)[1])
    assert ("%debug opens rank 1's frame where it failed: its process is kept for it until the next cell, or "
            "until you leave the debugger.") in failed
    assert alive(pid)
    text = asked(kernel, "%debug", ["p pid", "q"])
    assert f"[rank 1] {pid}\n" in text
    assert wait_gone([pid]) == []  # left the debugger: the process goes


def answering(kernel: Kernel, code: str, typed: dict[str, list[str]]) -> tuple[dict, str]:
    """Run ``code``, answering each prompt with the next line typed for it (prompts may come in any order)."""
    left = {prompt: list(lines) for prompt, lines in typed.items()}
    kernel.prompts.clear()
    content, text = kernel.run(code, on_prompt=lambda k, prompt: k.client.input(left[prompt].pop(0)))
    assert all(not lines for lines in left.values()), (left, text)
    return content, text


def test_a_one_shot_cell_asks_and_stops_at_breakpoint_as_a_pool_cell_does(kernel):
    content, text = answering(kernel, "%%xla_spawn --fresh --devices 2 --backend cpu\n"
                              "step = rank + 3\n"
                              "name = input('who? ') if rank == 1 else None\n"
                              "if rank == 0:\n"
                              "    breakpoint()\n"
                              "    step += 10\n"
                              "(name, step)", {"[rank 1] who? ": ["Lin"], "[rank 0] (Pdb) ": ["p step", "c"]})
    assert content["status"] == "ok", text
    assert "[rank 0] -> step += 10\n" in text and "[rank 0] 3\n" in text
    assert "[(None, 13), ('Lin', 4)]" in text


def test_interrupt_at_a_one_shot_cells_prompt_ends_its_ranks(kernel):
    kernel.prompts.clear()
    content, text = kernel.run("%%xla_spawn --fresh --devices 2 --backend cpu\n"
                               "value = input('wait? ') if rank == 0 else rank\n"
                               "value", on_prompt=lambda k, prompt: k.manager.interrupt_kernel())
    assert kernel.prompts == [("[rank 0] wait? ", False)]
    assert content["status"] == "error" and content["ename"] == "RunInterrupted", text
    assert "rank 0: waiting for input (line 1)" in text
    content, text = kernel.run("[state.pid for state in get_ipython()._xla_magic_session.history[-1].ranks.values()]")
    pids = [int(pid) for pid in re.findall(r"\d+", text)]
    assert len(pids) == 2 and wait_gone(pids) == []


def test_the_spmd_process_asks_and_stops_at_breakpoint(kernel):
    content, text = answering(kernel, "%%xla_spawn --fresh --spmd --devices 2 --backend cpu\n"
                              "word = input('word? ')\n"
                              "breakpoint()\n"
                              "twice = word * 2\n"
                              "twice", {"[spmd] word? ": ["ab"],
                                         "[spmd] (Pdb) ": ["p word", "p len(mesh.device_ids)", "c"]})
    assert content["status"] == "ok", text
    assert "[spmd] -> twice = word * 2\n" in text
    assert "[spmd] 'ab'\n" in text and "[spmd] 2\n" in text and "'abab'" in text


def test_a_parked_one_shot_rank_is_gone_before_the_next_cell_starts(kernel):
    content, failed = kernel.run("%%xla_spawn --fresh --devices 2 --backend cpu\n"
                                 "import os\n"
                                 "print('pid', os.getpid())\n"
                                 "assert rank == 0")
    pid = int(re.search(r"\[rank 1\] pid (\d+)", failed)[1])
    assert alive(pid)
    kernel.run(f"parked = {pid}")
    content, text = kernel.run("%%xla_spawn --fresh --devices 1 --backend cpu\n"
                               "import os\nos.path.exists(f'/proc/{parked}')")
    assert "[False]" in text, text  # on a TPU the chips are free for the cell's ranks


def test_debug_opens_the_spmd_process_frame_after_its_one_shot_cell_failed(kernel):
    content, failed = kernel.run("%%xla_spawn --fresh --spmd --devices 2 --backend cpu\n"
                                 "import torch\n"
                                 "t = torch.arange(6.0).reshape(2, 3).to(device)\n"
                                 "raise RuntimeError('spmd fails')")
    assert "%debug opens the SPMD process's frame where it failed" in failed
    text = asked(kernel, "%debug", ["p tuple(t.shape)", "p t.sum().item()", "q"])
    assert "%debug: the SPMD process of cell" in text
    assert "[spmd] (2, 3)\n" in text and "[spmd] 15.0\n" in text  # (XLA may warn between, as it compiles the sum)


# --- through the real shell: the tpu launch path's rank threads, and the watchdog at the prompt ----------


@pytest.fixture
def thread_pool(ip, monkeypatch):
    """A 2-rank pool on the tpu launch path: xmp.spawn's rank threads on the CPU."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with capture_output():
        ip.run_line_magic("xla_pool", "start --devices 2 --backend tpu")
    try:
        yield ip
    finally:
        with capture_output():
            ip.run_line_magic("xla_pool", "stop")


def test_tpu_launch_path_rank_threads_ask_and_debug_through_the_terminal(thread_pool, monkeypatch):
    ip = thread_pool
    terminal = Terminal({"[rank 0] who? ": ["Lin"], "[rank 1] (Pdb) ": ["p step", "c"]})
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output() as captured:
        value = ip.run_cell_magic("xla_spawn", "", "import threading\n"
                                  "step = rank + 3\n"
                                  "name = input('who? ') if rank == 0 else None\n"
                                  "if rank == 1:\n"
                                  "    breakpoint()\n"
                                  "(name, step, threading.current_thread().name != 'MainThread')")
    assert value == [("Lin", 3, True), (None, 4, True)]
    assert "[rank 0] who? " in captured.stdout and "[rank 1] (Pdb) " in captured.stdout
    assert "[rank 1] 4\n" in captured.stdout
    assert sorted(terminal.prompts) == ["[rank 0] who? ", "[rank 1] (Pdb) ", "[rank 1] (Pdb) "]
    with capture_output() as failed:  # a rank thread that failed keeps its frame too, in the pool
        ip.run_cell("%%xla_spawn\nif rank == 1:\n    raise ValueError(f'step {step}')")
    assert "%debug opens rank 1's frame where it failed: the rank keeps it until the next cell." in failed.stdout
    terminal = Terminal({"[rank 1] (Pdb) ": ["p step", "p threading.current_thread().name", "q"]})
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output() as shown:
        ip.run_cell("%debug")
    assert "[rank 1] -> raise ValueError(f'step {step}')\n[rank 1] (Pdb) [rank 1] 4\n" in shown.stdout, shown.stdout
    assert "[rank 1] 'MainThread'" not in shown.stdout and terminal.prompts == ["[rank 1] (Pdb) "] * 3
    with capture_output() as failed:  # a one-shot cell's rank threads end with it, and %debug says what to do
        ip.run_cell("%%xla_spawn --fresh --devices 2 --backend tpu\nraise ValueError(rank)")
    assert "ValueError: 1" in failed.stdout and "%debug opens" not in failed.stdout
    with capture_output() as refused:
        ip.run_cell("%debug")
    assert ("that cell's ranks were threads of one process (the tpu launch path), which ends with its cell: run it "
            "in a pool (%xla_pool start), where a failed rank keeps its frames for %debug") in refused.stdout + refused.stderr


def test_the_watchdog_and_the_panel_know_a_rank_is_in_the_debugger(pool, ip, monkeypatch):
    session = ip._xla_magic_session
    seen: list[tuple[str, list[str]]] = []

    def look() -> None:  # at the prompt, as a person would look at the panel and ask %xla_stacks
        where = session.history[-1].ranks[0].where
        seen.append((where, session.stacks(None, False)))

    monkeypatch.setattr(sys, "stdin", Terminal({"[rank 0] (Pdb) ": ["c"]}, before_each=look))
    with capture_output() as captured:
        value = ip.run_cell_magic("xla_spawn", "--hang-after 0.5",
                                  "import torch_xla.core.xla_model as xm\n"
                                  "if rank == 0:\n"
                                  "    breakpoint()\n"
                                  "    print('continued')\n"
                                  "xm.rendezvous('after')\n"
                                  "rank")
    assert value == [0, 1]
    (where, lines), = seen
    assert where == "in the debugger (line 4)"
    now = lines[lines.index("Where the pool's ranks are now:") + 1:]
    assert "rank 0: in the debugger (line 4)" in now
    assert "rank 1: waiting in xm.rendezvous('after') (line 5)" in now
    assert "xla_magic:" not in captured.stdout  # no hang line while the user is at the prompt
    answers = {0: {"phase": "debugger", "frames": [], "doing": {"kind": "python", "call": None, "line": 4}},
               1: {"phase": "cell", "frames": [], "doing": {"kind": "collective", "call": "xm.rendezvous('after')",
                                                            "line": 5}}}
    assert stacks.hang(answers, {0: 600.0, 1: 600.0}, hang_after=0.5, confirm=0.5) is None


def test_time_at_the_prompt_is_not_the_cells_and_a_timeout_after_c_is_a_timeout(pool, ip, monkeypatch):
    """--timeout counts the cell's time, not the person's at its prompt; a timeout once pdb continued stops the
    cell as a timeout (pdb's `c` does not take the rank's SIGINT for itself)."""
    timeout = 2.0
    started: list[float] = []

    def past_the_timeout() -> None:  # the person at the prompt for longer than the cell may run
        assert wait_for(lambda: time.monotonic() - started[0] > 2 * timeout, within=60)

    monkeypatch.setattr(sys, "stdin", Terminal({"[rank 0] (Pdb) ": ["p step", "c"]}, before_each=past_the_timeout))
    started.append(time.monotonic())
    with capture_output():
        value = ip.run_cell_magic("xla_spawn", f"--timeout {timeout:g}",
                                  "step = rank + 3\nif rank == 0:\n    breakpoint()\n    step += 10\nstep")
    assert value == [13, 4] and time.monotonic() - started[0] > 2 * timeout
    monkeypatch.setattr(sys, "stdin", Terminal({"[rank 0] (Pdb) ": ["c"]}))
    with capture_output() as shown, pytest.raises(RankError) as stopped:
        ip.run_cell_magic("xla_spawn", f"--timeout {timeout:g}",
                          "import time\nif rank == 0:\n    breakpoint()\n    time.sleep(600)\ntime.sleep(600)")
    assert str(stopped.value).startswith(f"timed out after {timeout:g} s (--timeout)"), stopped.value
    assert "rank 0: sleeping in time.sleep (line 4)" in stopped.value.where, stopped.value.where
    assert "Program interrupted" not in shown.stdout and "the debugger was quit" not in shown.stdout, shown.stdout
    with capture_output():
        assert ip.run_cell_magic("xla_spawn", "", "step") == [13, 4]  # the pool goes on
