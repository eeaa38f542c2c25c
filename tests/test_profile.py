"""--profile: real traces of real cells on the CPU simulation, the timeline checked against the trace files' own events."""

from __future__ import annotations

import gc
import os
import re

import pytest
from IPython.utils.capture import capture_output

from helpers import PROFILED
from xla_magic.notebook import profile_lanes, profile_view
from xla_magic.wire import trace



def file_events(path: str) -> list[dict]:
    return trace.complete_events(trace.read_trace(path)["traceEvents"])


def test_a_profiled_pool_cell_draws_each_rank_s_trace(ip, pool, spawn):
    session = ip._xla_magic_session
    plain = spawn("", "z = 1")
    assert session.last_cell.profile == "" and all(s.profile is None for s in session.last_cell.ranks.values())
    assert "Profile of run" not in plain.stdout  # off: nothing asked, nothing recorded

    listening = list(session.listeners)
    run = spawn("--profile", PROFILED)
    record = session.last_profiled
    assert record is session.last_cell and os.path.isdir(record.profile)
    assert "Profile of run" in run.stdout and "Top device ops" in run.stdout
    assert gc.isenabled()  # drawing a profile leaves Python's cycle collector as it was
    # What was shown, the traces read while the cell ran, is what reading them now tells; the reader left no listener.
    assert profile_view.text(record) in run.stdout
    assert session.listeners == listening
    found = profile_lanes.lanes(record)
    assert [one.ranks for one in found] == [[0], [1]]
    # Each rank process replied first, then read its own trace into the digest file its reply named; the files
    # read here tell the same.
    for one in found:
        assert not one.where.get("digest") and os.path.dirname(one.where["digest_file"]) == one.where["folder"]
        assert trace.wait_digest(one.where)["version"] == trace.DIGEST_VERSION
        files_only = {key: value for key, value in one.where.items() if key not in ("digest", "digest_file")}
        here = trace.lane(files_only, profile_lanes.compile_labels(record.ranks[one.ranks[0]].xla))
        assert (here.events, here.runs, here.ops, here.lines, here.span) == (
            one.events, one.runs, one.ops, one.lines, one.span)
        assert here.lines and any(event.label for event in here.events if event.kind == "compile")
    for one in found:
        where = one.where
        assert not one.problem, one.problem
        assert where["trace"].startswith(os.path.join(record.profile, f"rank{one.ranks[0]}"))
        assert os.path.isfile(where["trace"]) and os.path.isfile(where["xplane"])
        events = file_events(where["trace"])
        # Compiles: the trace's own, as many as the rank's XLA account counted, in the same order of hashes.
        compiles = [e for e in events if e["name"] == "XLAGraphExecutor::Compile"]
        drawn = [e for e in one.events if e.kind == "compile"]
        account = record.ranks[one.ranks[0]].xla
        assert len(drawn) == len(compiles) == account["compiles"] == 3
        assert [e["args"]["graph_hash"] for e in compiles] == [c["hash"] for c in account["compilations"]]
        assert all(event.label.startswith("line 9") for event in drawn), [e.label for e in drawn]
        # The user's annotations, in the cell's order, and each before the compile of its step.
        annotations = [e for e in events if e["name"] == "forward"]
        assert [e.name for e in one.events if e.kind == "annotation"] == ["forward"] * len(annotations) == ["forward"] * 3
        starts = [e.start for e in one.events if e.kind in ("annotation", "compile")]
        assert starts == sorted(starts)
        assert [e.kind for e in one.events if e.kind in ("annotation", "compile")] == ["annotation", "compile"] * 3
        assert any(e.kind == "device→host" for e in one.events)  # y.item()
        # Every event of the files is in one of the lane's runs, of its kind; the device ops' table counts them all.
        every = trace.every_event(where)
        counted: dict[str, int] = {}
        for run in one.runs:
            counted[run.kind] = counted.get(run.kind, 0) + run.count
        assert counted == {kind: sum(e.kind == kind for e in every) for kind in {e.kind for e in every}}
        assert sum(count for count, _total in one.ops.values()) == counted["device op"] > 0
        assert len(one.runs) < len(every)  # the trace's tiny device ops and waits, fewer runs
    page = profile_view.page(record)
    # Each run (so each event) is in one mark, of its kind; runs that touch at the widest zoom share one (one
    # rect each), and the marks drawn from the runs are those drawn from every event; each sampled line is a
    # rect of its own.
    drawn = [profile_view.marks(one, profile_view.scale(found)) for one in found]
    for one, its in zip(found, drawn):
        assert sorted(id(r) for m in its for r in m.runs) == sorted(id(r) for r in one.runs)
        assert all(r.kind == m.kind for m in its for r in m.runs)
        assert len(its) <= len(one.runs)
        scale = profile_view.scale(found)
        alone = [trace.Run(e.kind, e.start, e.start, e.start + e.duration, e.start + e.duration, 1,
                                   e.duration, {e.name: 1}, e) for e in trace.every_event(one.where)]
        by_event = profile_view.marks(trace.Lane(one.ranks, one.where, runs=alone, span=one.span), scale)
        assert [(m.kind, m.left, round(m.right, 6), m.count) for m in its] == [
            (m.kind, m.left, round(m.right, 6), m.count) for m in by_event]
        # the picture's rows, made in one pass, are each row's kinds' marks
        assert profile_view.rows_of_marks(one, profile_view.scale(found)) == [
            profile_view.marks(one, profile_view.scale(found), kinds) for _name, kinds in profile_view.ROWS]
    assert page.count("<rect") == sum(len(its) + sum(map(len, one.lines.values())) for one, its in zip(found, drawn))
    assert page.count('class="xla-compile"') == sum(e.kind == "compile" for one in found for e in one.events)
    assert ">rank 0<" in page and ">rank 1<" in page and "xprof --logdir " + record.profile in page

    # the panel marks the profiled run; %xla_profile shows it again
    from test_widget import history_rows

    from xla_magic.notebook import status

    panel = status.status_panel(session)
    panel.redraw()
    rows = {row["cells"][0]: row for row in history_rows(panel)}
    assert "profiled" in rows[str(record.run_id)]["cells"][1]
    assert "profiled" not in rows[str(record.run_id - 1)]["cells"][1]
    with capture_output() as shown:
        ip.run_line_magic("xla_status", "--text")
    assert re.search(rf"\n\s+{record.run_id}\s.*\[profiled: %xla_profile\]", shown.stdout), shown.stdout
    gc.disable()  # a user who turned the collector off keeps it off
    try:
        with capture_output() as shown:
            ip.run_line_magic("xla_profile", "")
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert f"Profile of run {record.run_id} (2 traces)" in shown.stdout


def test_a_profiled_spmd_cell_has_one_lane(ip, spawn):
    spawn("--spmd --devices 2 --profile", LINES, seen=seen)
    record = ip._xla_magic_session.last_profiled
    [one] = profile_lanes.lanes(record)
    assert one.ranks == [0] and not one.problem
    compiles = [e for e in file_events(one.where["trace"]) if e["name"] == "XLAGraphExecutor::Compile"]
    assert len([e for e in one.events if e.kind == "compile"]) == len(compiles) >= 1
    assert list(one.lines) == [0]  # one process, one cell thread
    check_lines(one, 0)


def test_xla_profile_before_any_profile_is_a_usage_error(ip):
    from IPython.core.error import UsageError

    session = ip._xla_magic_session
    last, session.runs.last_profiled = session.last_profiled, None
    try:
        with pytest.raises(UsageError, match="no %%xla_spawn --profile cell"):
            ip.run_line_magic("xla_profile", "")
    finally:
        session.runs.last_profiled = last


def test_rank_threads_of_one_process_share_one_trace(ip, spawn, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    spawn("--devices 2 --backend tpu --profile", LINES, seen=seen)
    record = ip._xla_magic_session.last_profiled
    [one] = profile_lanes.lanes(record)  # the profiler is one per process: the first thread in starts it, the last stops it
    assert one.ranks == [0, 1] and not one.problem, one.problem
    assert record.ranks[0].profile is record.ranks[1].profile
    assert len(profile_view.trace_files(record.profile)) == 1
    assert sorted(one.lines) == [0, 1]  # each rank thread's own cell frames, in a row of its own
    for rank in (0, 1):
        check_lines(one, rank)


@pytest.mark.parametrize("content, problem", [
    (b"not gzip at all", "could not be read"),
    (None, "wrote no trace.json.gz"),
])
def test_a_trace_that_cannot_be_read_is_said_not_raised(tmp_path, content, problem):
    from xla_magic.runs.record import RankState, RunRecord

    path = tmp_path / "vm.trace.json.gz"
    if content is not None:
        path.write_bytes(content)
    record = RunRecord(run_id=7, cell="x = 1", backend="cpu", devices=1, ranks={0: RankState(state="done")},
                       profile=str(tmp_path))
    record.take("profile", {"ranks": [0], "host": "h", "trace": str(path) if content is not None else "",
                            "xplane": "", "error": ""})
    [one] = profile_lanes.lanes(record)
    assert problem in one.problem
    assert problem in profile_view.text(record) and problem in profile_view.page(record)


def test_a_failing_cell_still_shows_the_profile_of_the_rank_that_failed(ip, spawn):
    from xla_magic.runs.errors import RankError

    with capture_output() as shown, pytest.raises(RankError):
        ip.run_cell_magic("xla_spawn", "--devices 2 --profile",
                          "import torch, torch_xla\ny = (torch.ones(4, device=device) * 2).sum()\ntorch_xla.sync()\n"
                          "if rank == 1:\n    raise ValueError('boom')\nwhile True:\n    torch_xla.sync()")
    record = ip._xla_magic_session.last_profiled
    assert record.ranks[1].state == "failed" and record.ranks[1].profile is not None
    assert "Profile of run" in shown.stdout and "rank 1 on " in shown.stdout
    if record.ranks[0].profile is None:  # stopped by fail-fast before its cell ended
        assert f"no trace from rank 0: 0 {record.ranks[0].state}" in shown.stdout


# --- the cell's Python, by line (sampled beside the trace) ------------------------------------

LINES = """import torch, torch_xla
a = torch.ones(64, 64, device=device)
b = a * 2
y = (a @ b).sum(); torch_xla.sync(); y.item(); seen(4)
seen(5)
"""


def _seen():
    def seen(line: int) -> None:
        """In a rank: wait until its line sampler has seen this thread at cell line ``line`` (an event, not a time).

        Defined here, not in the cell, so that the cell's innermost line is the one that calls it; nested, so
        that it travels by value (an engine on another host cannot import this module)."""
        import threading
        import time

        from xla_magic.launcher import profiling

        sampler, me = profiling.profiler().lines, threading.get_ident()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with sampler.lock:
                spans = sampler.spans[sampler.threads[me]]
                if spans and spans[-1][0] == line:
                    return
            time.sleep(0.001)  # polling the sampler's spans
        raise AssertionError(f"the line sampler never saw line {line}")

    return seen


seen = _seen()


def check_lines(one, rank: int) -> None:
    """Rank ``rank``'s row of lines: lines 4 then 5, once each, and the trace's compile inside line 4's time."""
    marks = one.lines[rank]
    numbers = [int(event.name.split()[-1]) for event in marks]
    assert [n for n in numbers if n in (4, 5)] == [4, 5], numbers
    assert numbers == sorted(numbers), numbers  # the cell's lines in the order they ran
    line4, line5 = (next(e for e in marks if e.name == f"line {n}") for n in (4, 5))
    assert line4.label.startswith("y = (a @ b).sum()") and line5.label == "seen(5)"
    assert all(a.start + a.duration <= b.start for a, b in zip(marks, marks[1:]))  # spans, one after the other
    # The lines are on the trace's clock: the compile line 4 caused begins before line 4's span ends,
    # and ends before line 5's span begins.
    compiles = [e for e in one.events if e.kind == "compile"]
    assert compiles
    assert compiles[-1].start < line4.start + line4.duration
    assert compiles[-1].start + compiles[-1].duration <= line5.start


def test_a_profiled_cell_shows_its_lines_in_the_order_they_ran(ip, pool, spawn):
    run = spawn("--profile", LINES, seen=seen)
    record = ip._xla_magic_session.last_profiled
    found = profile_lanes.lanes(record)
    assert [one.ranks for one in found] == [[0], [1]]
    for one in found:
        assert os.path.isfile(one.where["lines"]) and os.path.dirname(one.where["lines"]) == one.where["folder"]
        assert list(one.lines) == one.ranks and one.period_ms > 0
        check_lines(one, one.ranks[0])
    assert f"r0 lines (sampled every {found[0].period_ms:g} ms): " in run.stdout
    assert "sampled every" in profile_view.page(record) and ">r1 lines<" in profile_view.page(record)
    # The ranks' cells ran in their processes' main threads: a timer signal sampled them (no thread of ours
    # taking the GIL), and once the cell ended it was gone, SIGALRM's handler as before.
    after = ("import signal, threading\nfrom xla_magic.launcher import profiling\n"
             "(profiling.profiler().sampler.thread is None, signal.getsignal(signal.SIGALRM) == signal.SIG_DFL,"
             " signal.getitimer(signal.ITIMER_REAL))")
    assert spawn("", after).value == [(True, True, (0.0, 0.0))] * 2


def test_a_rank_that_uses_sigalrm_itself_keeps_it_and_still_gets_its_lines(ip, pool, spawn):
    spawn("", "import signal\nrang = []\nsignal.signal(signal.SIGALRM, lambda *_: rang.append(1))")
    spawn("--profile", LINES, seen=seen)
    for one in profile_lanes.lanes(ip._xla_magic_session.last_profiled):
        check_lines(one, one.ranks[0])  # sampled by a thread instead
    told = "from xla_magic.launcher import profiling\n(rang, signal.getsignal(signal.SIGALRM).__name__, " \
           "profiling.profiler().sampler.thread is not None)"
    assert spawn("", told).value == [([], "<lambda>", True)] * 2


# --- a pool's reply does not wait for its profile ----------------------------------------------------

def gated_cell(gate: str) -> str:
    """A --profile cell whose ranks' digests, after their replies, wait until the test creates ``gate`` (this
    cell's only): so the cell's end, and what shows before the digests came, are seen for sure."""
    return ("import os, time, torch, torch_xla\nfrom xla_magic.launcher import profiling\n"
            "real = getattr(profiling, 'real_digest', profiling._digest)\nprofiling.real_digest = real\n"
            f"def gated(where, real=real, gate={gate!r}):\n"
            "    while not os.path.exists(gate):\n        time.sleep(0.01)  # polling the test's gate file\n"
            "    profiling._digest = real  # the next cells digest as ever\n"
            "    return real(where)\n"
            "profiling._digest = gated\n"
            "y = (torch.ones(4, device=device) * 2).sum(); torch_xla.sync(); y.item()")


def test_a_pool_cell_returns_before_its_ranks_digest_and_its_text_follows(ip, pool, tmp_path):
    gate = str(tmp_path / "gate")
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", "--profile", gated_cell(gate))
        assert value == [8.0, 8.0]  # the cell returned, every rank's digest still to come
        record = ip._xla_magic_session.last_profiled
        assert profile_lanes.digests_to_come(record)
        assert not any(os.path.exists(where["digest_file"]) for where in profile_lanes._profiles(record))
        assert "Profile of run" not in shown.stdout
        open(gate, "w").close()
        profile_view.wait_drawn()
    assert profile_view.text(record) in shown.stdout
    assert all(one.lines and not one.problem for one in profile_lanes.lanes(record))


def test_in_a_notebook_the_picture_is_filled_in_by_display_id_once_the_digests_came(tmp_path):
    import time

    from helpers import KERNEL_TIMEOUT, Kernel

    gate = str(tmp_path / "gate")
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        reply, text = kernel.run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        client, seen = kernel.client, []
        reply = client.execute_interactive("%%xla_spawn --profile\n" + gated_cell(gate), timeout=KERNEL_TIMEOUT,
                                           output_hook=seen.append)
        assert reply["content"]["status"] == "ok"
        cell = reply["parent_header"]["msg_id"]
        # The cell ended with the placeholder shown under it, its display id named, the digests not yet come.
        [placeholder] = [m for m in seen if m["msg_type"] == "display_data"
                         and "reading each rank's trace" in m["content"]["data"]["text/plain"]]
        display_id = placeholder["content"]["transient"]["display_id"]
        assert not any(m["msg_type"] == "update_display_data" for m in seen)
        open(gate, "w").close()
        deadline = time.monotonic() + KERNEL_TIMEOUT
        update = None
        while update is None and time.monotonic() < deadline:
            message = client.get_iopub_msg(timeout=KERNEL_TIMEOUT)
            if message["msg_type"] == "update_display_data":
                update = message
        assert update is not None, "no update of the profile's display came"
        # The update goes to the cell that ran, under the placeholder's id, with the picture and the text.
        assert update["parent_header"]["msg_id"] == cell
        assert update["content"]["transient"]["display_id"] == display_id
        data = update["content"]["data"]
        assert '<svg class="xla-timeline"' in data["text/html"] and ">r1 lines<" in data["text/html"]
        assert data["text/plain"].startswith("Profile of run ") and "(2 traces)" in data["text/plain"]
        # %xla_profile shows the same profile again, complete.
        again: list = []
        client.execute_interactive("%xla_profile", timeout=KERNEL_TIMEOUT, output_hook=again.append)
        [shown] = [m for m in again if m["msg_type"] == "display_data"]
        assert shown["content"]["data"]["text/plain"] == data["text/plain"]
        kernel.run("%xla_pool stop")
    finally:
        kernel.close()


NESTED_ALARM = '''
import linecache, signal, threading, time
from xla_magic.launcher import profiling

real_getline, raised = linecache.getline, []


def getline(*args):  # a second alarm comes while the first one's sample reads its line's text
    if not raised:
        raised.append(True)
        signal.raise_signal(signal.SIGALRM)
    return real_getline(*args)


linecache.getline = getline
source = "total = 0\\nfor i in range(300000):\\n    total += i\\nfor i in range(300000):\\n    total -= i\\n"
linecache.cache["<xla_spawn cell 1>"] = (len(source), None, source.splitlines(True), "<xla_spawn cell 1>")
sampler = profiling.LineSampler()
sampler.start(time.time_ns() // 1000, period=1)
sampler.add(0, threading.get_ident())
exec(compile(source, "<xla_spawn cell 1>", "exec"), {})
sampler.remove(threading.get_ident())
spans = sampler.stop()["ranks"]["0"]
print(bool(raised), bool(spans), [span for span in spans if span[3] is None])
'''


def test_an_alarm_during_a_sample_leaves_no_line_open():
    """Python runs a signal's handler inside a handler too: on a loaded machine the next alarm can come while a
    sample is taken. Here it comes, for real, while the first sample reads its line's text; every span the
    sampler writes must still have its end (an open one failed the profile's drawing with a TypeError)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NESTED_ALARM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True True []", done.stdout  # the alarm came; lines; none left open


# --- the ranks read their traces once the kernel is done with the cell ----------------------------------------

def stamped_cell(path: str) -> str:
    """A --profile cell whose ranks, when they begin reading their traces, write the time (CLOCK_MONOTONIC, one
    clock for every process of the machine) into ``path.<rank>``."""
    return ("import time, torch, torch_xla\nfrom xla_magic.launcher import profiling\n"
            "real = getattr(profiling, 'real_digest', profiling._digest)\nprofiling.real_digest = real\n"
            f"def stamped(where, real=real, path={path!r}, rank=rank):\n"
            "    with open(f'{path}.{rank}', 'w') as file:\n        file.write(repr(time.monotonic()))\n"
            "    profiling._digest = real  # the next cells digest as ever\n"
            "    return real(where)\n"
            "profiling._digest = stamped\n"
            "y = (torch.ones(4, device=device) * 2).sum(); torch_xla.sync(); y.item()")


def test_the_ranks_read_their_traces_only_once_the_kernel_is_done_with_the_cell(tmp_path):
    """Their reading would take the cores from the kernel's own end of the cell (its result shown, its reply
    sent): the kernel tells them after it sent its idle status (profile_drawer.after_this_cell)."""
    from helpers import KERNEL_TIMEOUT, Kernel

    kernel = Kernel()
    try:
        # after_this_cell runs its function after the cell's idle status went: what it prints comes after it.
        kernel.run("from xla_magic.runs.profile_drawer import after_this_cell")
        client, seen = kernel.client, []
        reply = client.execute_interactive("after_this_cell(lambda: print('after the cell', flush=True))",
                                           timeout=KERNEL_TIMEOUT, output_hook=seen.append)
        cell = reply["parent_header"]["msg_id"]
        assert not any(m["msg_type"] == "stream" for m in seen)  # nothing printed while the cell ran
        idle = next(m for m in seen if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                    and m["parent_header"].get("msg_id") == cell)
        printed = client.get_iopub_msg(timeout=KERNEL_TIMEOUT)
        assert printed["msg_type"] == "stream" and printed["content"]["text"] == "after the cell\n", printed
        assert printed["header"]["date"] >= idle["header"]["date"]

        # A pool's ranks begin reading their traces after the kernel's post_run_cell of the cell.
        kernel.run("%load_ext xla_magic")
        reply, text = kernel.run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        kernel.run("import time\nposts = []\n"
                   "get_ipython().events.register('post_run_cell', lambda result: posts.append(time.monotonic()))")
        stamps = str(tmp_path / "reading")
        reply, text = kernel.run("%%xla_spawn --profile\n" + stamped_cell(stamps))
        assert reply["status"] == "ok", text
        reply, text = kernel.run("from xla_magic.notebook import profile_view\nprofile_view.wait_drawn()\nprint(repr(posts[-1]))")
        assert reply["status"] == "ok", text
        cell_over = float(text.strip().splitlines()[-1])
        for rank in range(2):
            with open(f"{stamps}.{rank}") as file:
                assert float(file.read()) > cell_over, rank
        # The files' paths came with the digests.
        reply, text = kernel.run("import os\nrecord = get_ipython()._xla_magic_session.last_profiled\n"
                                 "print(sorted(all(os.path.isfile(r.profile[key]) for key in ('trace', 'xplane', "
                                 "'lines')) for r in record.ranks.values()))")
        assert text.strip().endswith("[True, True]"), text
        kernel.run("%xla_pool stop")
    finally:
        kernel.close()


def test_a_rank_gone_before_it_read_its_trace_still_has_its_lane_drawn(ip, pool, tmp_path):
    """Its trace, which the kernel now finds and reads itself; its sampled lines, which it never wrote, are none."""
    import signal

    gate = str(tmp_path / "gate")
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "--profile", gated_cell(gate))
        record = ip._xla_magic_session.last_profiled
        gone = record.ranks[1].profile
        os.kill(gone["pid"], signal.SIGKILL)
        open(gate, "w").close()
        profile_view.wait_drawn()
    lanes = {one.ranks[0]: one for one in profile_lanes.lanes(record)}
    assert "Profile of run" in shown.stdout and not lanes[0].problem and not lanes[1].problem, shown.stdout
    assert os.path.isfile(gone["trace"]) and gone["lines"] == "" and not lanes[1].lines
    assert any(event.kind == "compile" for event in lanes[1].events)
    assert lanes[0].lines and os.path.isfile(record.ranks[0].profile["lines"])
