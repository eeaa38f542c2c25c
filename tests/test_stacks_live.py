"""Where every rank is: real hangs on the CPU simulation, through the real shell and a real kernel.

Each test puts its ranks somewhere known (a line each rank printed says it
is there), then checks the reported line and function against that place:
the watchdog's line under a pool cell that can only hang, and where every
rank was when a cell is interrupted. Interrupts go once every rank has said
it is in place, never after a guessed delay.
"""

from __future__ import annotations

import re
import time
from typing import Callable

import pytest
from IPython.utils.capture import capture_output

from helpers import (KERNEL_TIMEOUT, Kernel, Listening, stacks_with_a_thread_left, stop_on_record, strip_ansi,
                     the_watchdog_spoke)
from xla_magic.runs import stacks
from xla_magic.notebook import status
from xla_magic.runs.errors import RunInterrupted
from xla_magic.runs.record import RunRecord

HANG_AFTER = 2.0
DEADLINE = 240.0  # bounds a failure only


def printed(mark: str, ranks: int = 2) -> Callable[[RunRecord], bool]:
    return lambda record: sum(mark in state.last_line for state in record.ranks.values()) == ranks


def interrupted(ip, line: str, cell: str, ready: Callable[[RunRecord], bool]) -> tuple[RunInterrupted, str]:
    """Run the cell, interrupt it once ``ready``; the error and what the cell showed."""
    listening, sent = stop_on_record(ip._xla_magic_session, ready)
    with listening, capture_output() as captured, pytest.raises(RunInterrupted) as caught:
        ip.run_cell_magic("xla_spawn", line, cell)
    assert sent.is_set()
    return caught.value, captured.stdout


def block(error: BaseException, who: str) -> list[str]:
    """The lines of ``who``'s block in the error's "where each rank was" (its header first)."""
    lines = error._render_traceback_()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{who}: "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return lines[start:end]


def test_one_shot_interrupt_says_rank_0_waits_in_all_reduce_while_rank_1_loops(ip):
    cell = (
        "import torch, torch_xla.core.xla_model as xm\n"
        "print('in place', flush=True)\n"
        "if rank == 0:\n"
        "    y = xm.all_reduce('sum', torch.ones(2, device=device))\n"
        "else:\n"
        "    n = 0\n"
        "    while True:\n"
        "        n += 1\n"
    )
    error, _ = interrupted(ip, "--devices 2", cell, printed("in place"))
    assert str(error).startswith("interrupted; the ranks were stopped")
    assert block(error, "rank 0")[:2] == [
        "rank 0: waiting in xm.all_reduce (line 4)",
        "    line 4: y = xm.all_reduce('sum', torch.ones(2, device=device))",
    ]
    rank_1 = block(error, "rank 1")
    assert re.fullmatch(r"rank 1: running Python \(line [78]\)", rank_1[0]), rank_1
    assert rank_1[1] in ("    line 7: while True:", "    line 8: n += 1")
    record = ip._xla_magic_session.history[-1]
    assert record.stacks_when == "when interrupted" and record.hang is None


def test_a_rank_in_a_c_call_that_holds_the_gil_is_named(ip):
    cell = (
        "import re, time\n"
        "print('in place', flush=True)\n"
        "if rank == 1:\n"
        "    re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
        "time.sleep(600)\n"
    )
    # Once in the C call it stays there: interrupt when the watchdog found it not answering.
    error, _ = interrupted(ip, f"--devices 2 --hang-after {HANG_AFTER:g}", cell,
                           lambda record: record.ranks[1].where.startswith("did not answer"))
    rank_1 = block(error, "rank 1")
    assert rank_1[0] == "rank 1: did not answer: busy in native code that holds the GIL"
    if stacks.pyspy_installed():  # read from outside: the C call, then the cell's line it was called from
        assert rank_1[1] == "    py-spy dump, native frames included:"
        assert re.fullmatch(r"\s+match \(re/__init__\.py:\d+\)", rank_1[-2]), rank_1
        assert re.fullmatch(r"\s+<module> \(<xla_spawn cell \d+>:4\)", rank_1[-1]), rank_1
    assert block(error, "rank 0")[:2] == ["rank 0: sleeping in time.sleep (line 5)", "    line 5: time.sleep(600)"]


def test_a_rank_in_a_c_call_beside_one_waiting_in_a_collective_names_both(ip):
    """Rank 0 waits in a rendezvous past --hang-after while rank 1 holds the GIL in a C call: the watchdog's
    line names both, each where it is."""
    cell = (
        "import re, torch_xla.core.xla_model as xm\n"
        "print('in place', flush=True)\n"
        "if rank == 1:\n"
        "    re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
        "xm.rendezvous('late')\n"
    )
    # --timeout bounds a failure only: without the line, the cell ends timed out rather than interrupted
    error, shown = interrupted(ip, f"--devices 2 --hang-after {HANG_AFTER:g} --timeout {DEADLINE:g}", cell,
                               the_watchdog_spoke)
    said = (r"xla_magic: likely a hang: rank 0 has waited \d+ s in xm.rendezvous\('late'\) \(line 5\); rank 1 has "
            r"not answered for \d+ s: busy in native code that holds the GIL\. ")
    line = ip._xla_magic_session.history[-1].hang
    assert re.match(said, line), line
    assert re.search(f"^{said}", shown, re.MULTILINE), shown  # printed under the cell, in a terminal
    assert block(error, "rank 0")[0] == "rank 0: waiting in xm.rendezvous('late') (line 5)"
    assert block(error, "rank 1")[0] == "rank 1: did not answer: busy in native code that holds the GIL"


def test_tpu_launch_path_rank_threads_each_say_where_they_are(ip, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    cell = (
        "import time\n"
        "print('in place', flush=True)\n"
        "if rank == 0:\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "while True:\n"
        "    sum(range(1000))\n"
    )
    error, _ = interrupted(ip, "--backend tpu --devices 2", cell, printed("in place"))
    assert block(error, "rank 0")[:2] == ["rank 0: sleeping in time.sleep (line 5)", "    line 5: time.sleep(0.05)"]
    rank_1 = block(error, "rank 1")
    assert rank_1[0] in ("rank 1: running Python (line 6)", "rank 1: running Python (line 7)"), rank_1


def test_spmd_process_says_where_it_is(ip):
    cell = "import time\nprint('in place', flush=True)\ntime.sleep(600)\n"
    error, _ = interrupted(ip, "--spmd --devices 2", cell, printed("in place", ranks=1))
    assert block(error, "the SPMD process") == ["the SPMD process: sleeping in time.sleep (line 3)",
                                                "    line 3: time.sleep(600)"]


# --- in a pool (each its own: a running pool would take the one-shot cells above, and a thread a cell
# leaves running would show in the next test's stacks) --------------------------------------------


@pytest.fixture
def pool(ip):
    ip.run_line_magic("xla_pool", f"start --devices 2 --hang-after {HANG_AFTER:g}")
    try:
        yield ip
    finally:
        ip.run_line_magic("xla_pool", "stop")


def test_pool_rendezvous_only_rank_0_makes_is_named_a_hang_then_the_pool_goes_on(pool):
    cell = "import torch_xla.core.xla_model as xm\nif rank == 0:\n    xm.rendezvous('save')\nprint('done', flush=True)\n"
    error, shown = interrupted(pool, "", cell, the_watchdog_spoke)
    watchdog = [line for line in shown.splitlines() if line.startswith("xla_magic:")]
    assert len(watchdog) == 1, shown
    assert re.fullmatch(
        r"xla_magic: rank 0 has waited \d+ s in xm.rendezvous\('save'\) \(line 3\); rank 1 finished the cell\. "
        r"A collective that only some ranks make never completes; interrupt to stop\.", watchdog[0]), watchdog
    assert block(error, "rank 0")[:2] == ["rank 0: waiting in xm.rendezvous('save') (line 3)",
                                          "    line 3: xm.rendezvous('save')"]
    assert block(error, "rank 1") == ["rank 1: finished the cell"]
    with capture_output():
        assert pool.run_cell_magic("xla_spawn", "", "rank") == [0, 1]


def test_pool_gloo_collective_the_other_rank_skips_while_it_sleeps(pool):
    """Rank 0 blocks in gloo's wait (native code, GIL released); rank 1 sleeps: no hang is certain, so no line."""
    cell = (
        "import time, torch, torch_xla.core.xla_model as xm\n"
        "xm.all_reduce(xm.REDUCE_SUM, [torch.ones(2, device=device)])\n"
        "print('in place', flush=True)\n"
        "if rank == 0:\n"
        "    xm.all_reduce(xm.REDUCE_SUM, [torch.ones(2, device=device)])\n"
        "else:\n"
        "    time.sleep(600)\n"
    )
    seen: dict[int, str] = {}

    def ready(record: RunRecord) -> bool:
        seen.update({rank: state.where for rank, state in record.ranks.items() if state.where})
        return printed("in place")(record) and seen.get(0, "").startswith("waiting") and 1 in seen

    error, shown = interrupted(pool, "", cell, ready)
    assert "xla_magic:" not in shown
    assert seen == {0: "waiting in xm.all_reduce (line 5)", 1: "sleeping in time.sleep (line 7)"}
    assert block(error, "rank 0")[:2] == ["rank 0: waiting in xm.all_reduce (line 5)",
                                          "    line 5: xm.all_reduce(xm.REDUCE_SUM, [torch.ones(2, device=device)])"]
    assert block(error, "rank 1") == ["rank 1: sleeping in time.sleep (line 7)", "    line 7: time.sleep(600)"]
    panel = status.ranks_html(pool._xla_magic_session.history[-1])  # %xla_status's "where" column
    assert '<td class="xla-where">waiting in xm.all_reduce (line 5)</td>' in panel
    assert '<td class="xla-where">sleeping in time.sleep (line 7)</td>' in panel


def test_pool_sleep_on_every_rank_is_only_slow(pool):
    """Every rank sleeping outside any collective, past the hang delay, is never called a hang."""
    cell = "import time\nprint('in place', flush=True)\ntime.sleep(600)\n"
    first: list[float] = []

    def ready(record: RunRecord) -> bool:
        if not first and all(state.where == "sleeping in time.sleep (line 3)" for state in record.ranks.values()):
            first.append(time.monotonic())
        # The claim is "no line after the hang delay": wait out three of them.
        return bool(first) and time.monotonic() - first[0] > 3 * HANG_AFTER

    error, shown = interrupted(pool, "", cell, ready)
    assert "xla_magic:" not in shown
    assert pool._xla_magic_session.history[-1].hang is None
    assert block(error, "ranks 0, 1") == ["ranks 0, 1: sleeping in time.sleep (line 3)", "    line 3: time.sleep(600)"]


def test_xla_stacks_shows_the_stopped_cell_then_where_the_pool_is_now_with_a_thread_left_running(pool):
    test_pool_sleep_on_every_rank_is_only_slow(pool)  # the cell stopped last, in this test's own pool
    lines, now = stacks_with_a_thread_left(pool)
    assert lines[0].startswith("Where each rank was when interrupted (cell ")  # the sleep test's, stopped last
    assert "ranks 0, 1: sleeping in time.sleep (line 3)" in lines[:now]
    assert lines[now + 1:] == ["ranks 0, 1: idle (no cell running)",
                               "  thread 'napper': sleeping in time.sleep (line 3)",
                               "    line 3 in nap: time.sleep(600)"]
    with capture_output() as captured:
        pool.run_line_magic("xla_stacks", "--rank 1 --all")
    assert "rank 1: idle (no cell running)" in captured.stdout
    assert re.search(r"xla_magic/launcher/serve\.py:\d+ in serve", captured.stdout)  # --all: library frames too


def test_a_rank_waiting_while_another_runs_python_elsewhere_is_worded_as_a_wait(pool, tmp_path):
    """Rank 0 in a rendezvous past --hang-after while rank 1 loops: a wait, named as one; rank 1 then comes."""
    go = tmp_path / "go"
    cell = (
        "import os, torch_xla.core.xla_model as xm\n"
        f"go = {str(go)!r}\n"
        "if rank == 1:\n"
        "    n = 0\n"
        "    while not os.path.exists(go):\n"
        "        n += 1\n"
        "xm.rendezvous('late')\n"
        "rank\n"
    )

    def release(record: RunRecord) -> None:
        if record.hang and not go.exists():
            go.touch()  # the line was said: let rank 1 reach the rendezvous

    with Listening(pool._xla_magic_session, release), capture_output() as captured:
        value = pool.run_cell_magic("xla_spawn", f"--hang-after {HANG_AFTER:g}", cell)
    assert value == [0, 1]
    said = (r"xla_magic: rank 0 has waited \d+ s in xm.rendezvous\('late'\) \(line 7\); rank 1 is running Python at "
            r"line [56], not in it\. A wait while a rank works elsewhere, not a hang \(yet\)\.")
    line = pool._xla_magic_session.history[-1].hang
    assert re.fullmatch(said, line), line
    assert re.search(f"^{said}$", captured.stdout, re.MULTILINE), captured.stdout  # printed once, in a terminal


def test_xla_stacks_locals_shows_why_ranks_wait_apart_with_short_values(pool):
    """Under each cell frame its names: rank 0's step 3 and rank 1's step 4; a tensor as dtype and shape only."""
    cell = (
        "import time, torch, torch_xla.core.xla_model as xm\n"
        "step = rank + 3\n"
        "batch = torch.zeros(4, 8, device=device)\n"
        "note = 'x' * 500\n"
        "def train(step):\n"
        "    inner = step * 2\n"
        "    if rank == 0:\n"
        "        time.sleep(600)\n"
        "    xm.rendezvous('apart')\n"
        "print('in place', flush=True)\n"
        "train(step)\n"
    )
    interrupted(pool, "", cell, lambda record: printed("in place")(record) and record.ranks[1].where.startswith(
        "waiting in xm.rendezvous"))
    with capture_output() as captured:
        pool.run_line_magic("xla_stacks", "--locals")
    lines = captured.stdout.splitlines()
    rank_0 = lines[lines.index("rank 0: sleeping in time.sleep (line 8)"):]
    rank_0 = rank_0[:next(i for i, line in enumerate(rank_0[1:], 1) if not line.startswith(" "))]
    rank_1 = lines[lines.index("rank 1: waiting in xm.rendezvous('apart') (line 9)"):]
    rank_1 = rank_1[:next(i for i, line in enumerate(rank_1[1:], 1) if not line.startswith(" "))]
    for block_, step in ((rank_0, 3), (rank_1, 4)):
        outer = block_.index("    line 11: train(step)")
        inner = next(i for i, line in enumerate(block_) if line.startswith("    line ") and " in train: " in line)
        assert f"        step = {step}" in block_[outer:inner] and f"        step = {step}" in block_[inner:]
        assert f"        inner = {2 * step}" in block_[inner:]
        assert "        batch = tensor(float32, [4, 8], xla:0)" in block_[outer:inner]
        noted = next(line for line in block_[outer:inner] if line.startswith("        note = "))
        assert noted.startswith("        note = 'xxx") and noted.endswith("...") and len(noted) < 90
    assert "0., 0." not in captured.stdout and "tensor([" not in captured.stdout  # never a tensor's values
    with capture_output() as captured:
        pool.run_line_magic("xla_stacks", "")
    assert "step = " not in captured.stdout  # only with --locals


# --- through a real Jupyter kernel ------------------------------------------------------------


def test_a_real_kernel_shows_the_watchdog_line_as_one_display_then_the_stop_says_where(tmp_path):
    """In a notebook the line is display data, shown once and updated in place; the stop button's error says where."""
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        reply, text = kernel.run(f"%xla_pool start --devices 2 --hang-after {HANG_AFTER:g}")
        assert reply["status"] == "ok", text
        displays: list[dict] = []
        chunks: list[str] = []

        def hook(msg: dict) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind in ("display_data", "update_display_data") and "xla_magic:" in content["data"].get("text/plain", ""):
                displays.append(msg)
                if len(displays) == 1:
                    kernel.manager.interrupt_kernel()  # the stop button, once the line is there
            elif kind == "error":
                chunks.append("\n".join(content["traceback"]))

        cell = ("%%xla_spawn\nimport torch_xla.core.xla_model as xm\nif rank == 0:\n    xm.rendezvous('save')\n"
                "print('done', flush=True)\n")
        reply = kernel.client.execute_interactive(cell, timeout=KERNEL_TIMEOUT, output_hook=hook, stop_on_error=False)
        assert displays, "no watchdog line"
        first = displays[0]
        assert first["msg_type"] == "display_data" and first["content"]["transient"].get("display_id")
        assert all(m["msg_type"] == "update_display_data" for m in displays[1:])  # one line, updated
        assert re.fullmatch(r"xla_magic: rank 0 has waited \d+ s in xm.rendezvous\('save'\) \(line 3\); rank 1 "
                            r"finished the cell\. .*", first["content"]["data"]["text/plain"])
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "RunInterrupted"
        error = strip_ansi("\n".join(chunks))
        assert "rank 0: waiting in xm.rendezvous('save') (line 3)\n    line 3: xm.rendezvous('save')" in error
        assert "rank 1: finished the cell" in error
    finally:
        kernel.close()


# --- the watchdog's rule, on the places the sampler reports -------------------------------------


def at(kind: str, call: str, line: int) -> dict:
    return {"phase": "cell", "frames": [], "doing": {"kind": kind, "call": call, "line": line}}


@pytest.mark.parametrize("where, said", [
    pytest.param({0: at("sync", "torch_xla.sync", 4), 1: at("sync", "torch_xla.sync", 4)}, None,
                 id="a-long-compile-on-every-rank-is-only-slow"),
    pytest.param({0: at("sleep", "time.sleep", 2), 1: at("sleep", "time.sleep", 2)}, None, id="every-rank-sleeping"),
    pytest.param({0: at("collective", "xm.all_reduce", 3), 1: at("python", None, 6)},
                 r"xla_magic: rank 0 has waited 9 s in xm.all_reduce \(line 3\); rank 1 is running Python at line 6, "
                 r"not in it\. A wait while a rank works elsewhere, not a hang \(yet\)\.$",
                 id="a-rank-still-running-python-is-a-wait-not-a-hang"),
    pytest.param({0: at("collective", "xm.all_reduce", 3), 1: {"unanswered": stacks.GIL_BUSY}},
                 r"xla_magic: likely a hang: rank 0 has waited 9 s in xm.all_reduce \(line 3\); rank 1 has not answered "
                 r"for 9 s: busy in native code that holds the GIL\. ", id="a-rank-not-answering-and-one-waiting-both-named"),
    pytest.param({0: at("collective", "xm.all_reduce", 3), 1: dict(at("python", None, 4), phase="debugger")}, None,
                 id="a-rank-in-the-debugger-is-never-a-hang"),
    pytest.param({0: at("collective", "xm.all_reduce", 3), 1: dict(at("python", None, 4), phase="input")}, None,
                 id="a-rank-waiting-for-input-is-never-a-hang"),
    pytest.param({0: at("collective", "xm.all_reduce", 3), 1: at("collective", "xm.rendezvous('x')", 5)},
                 r"xla_magic: rank 0 has waited 9 s in xm.all_reduce \(line 3\); rank 1 has waited 9 s in "
                 r"xm.rendezvous\('x'\) \(line 5\)\. Ranks waiting at different collectives", id="different-collectives"),
    pytest.param({0: at("collective", "xm.all_reduce", 3), 1: at("collective", "xm.all_reduce", 3)},
                 r"xla_magic: likely a hang: ranks 0, 1 have waited 9 s in xm.all_reduce \(line 3\), with no progress",
                 id="every-rank-in-one-collective-is-likely"),
    pytest.param({0: at("sync", "torch_xla.sync", 4), 1: {"phase": "finished"}},
                 r"xla_magic: likely a hang: rank 0 has waited 9 s in torch_xla.sync \(line 4\); rank 1 finished",
                 id="a-sync-some-ranks-finished-without-is-likely"),
])
def test_the_watchdog_speaks_only_where_it_must_be_a_hang(where, said):
    line = stacks.hang(where, {0: 9.0, 1: 9.0}, hang_after=HANG_AFTER, confirm=0.5)
    if said is None:
        assert line is None
    else:
        assert line is not None and re.match(said, line), line
    assert stacks.hang(where, {0: 1.0, 1: 1.0}, hang_after=HANG_AFTER, confirm=0.5) is None  # not yet
