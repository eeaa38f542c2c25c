"""A pool across hosts behaves as one host does, and keeps what must stay private private: the cluster's
key reaches no cell, nothing listens on every interface, every line of output reaches the kernel, and the
kernel's place travels. 2 simulated hosts (network namespaces) x 2 ranks, one real IPython shell."""

from __future__ import annotations

import glob
import json
import os
import tempfile
import threading
import time
import uuid
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from tests.hosts_fixtures import RANKS_PER_HOST, listeners
from tests.hosts_fixtures import hosts, kernel_place, pool, pool_of_the_module  # noqa: F401 (fixtures)

WORLD = 2 * RANKS_PER_HOST


HOSTS_TAG = 3  # this module's hosts' names and addresses (tests/hosts_fixtures.py)


def hosts_pool(ip):
    """The kernel's pool across hosts (its cluster: the controller's connection files)."""
    return ip._xla_magic_session.pool


def cell(ip, source: str, line: str = "") -> tuple[Any, str, str]:
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", line, source)
    return value, shown.stdout, shown.stderr


def root(hosts, index: int) -> str:
    """Host ``index``'s file system as its processes see it (its own /tmp and /dev/shm)."""
    return f"/proc/{hosts.hosts()[index]['pid']}/root"


class Held:
    """A cell run on a thread whose every rank, once past ``ready_after``, leaves a mark in its host's /tmp
    and waits there until released: what the ranks hold open at that moment can be looked at from outside."""

    def __init__(self, ip, hosts, ready_after: str, then: str = "rank") -> None:
        self.ip, self.hosts, self.tag = ip, hosts, uuid.uuid4().hex[:8]
        self.source = (f"{ready_after}\nimport os as _os, time as _time\n"
                       f"open(f'/tmp/held-{self.tag}-{{rank}}', 'w').close()\n"
                       f"while not _os.path.exists('/tmp/release-{self.tag}'):\n    _time.sleep(0.05)\n{then}\n")
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result["value"], self.result["out"], _ = cell(self.ip, self.source)
        except BaseException as exc:  # noqa: BLE001 - the test's thread re-raises it
            self.result["error"] = exc

    def __enter__(self) -> Held:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self._all_held():
            assert self.thread.is_alive() and time.monotonic() < deadline, f"the ranks never held: {self.result}"
            time.sleep(0.05)
        return self

    def _all_held(self) -> bool:
        held = [glob.glob(f"{root(self.hosts, index)}/tmp/held-{self.tag}-*") for index in range(2)]
        return sum(len(marks) for marks in held) == WORLD

    def __exit__(self, *exc: Any) -> None:
        for index in range(2):
            open(f"{root(self.hosts, index)}/tmp/release-{self.tag}", "w").close()
        self.thread.join(120)
        if "error" in self.result:
            raise self.result["error"]


# --- no secret reaches a cell ------------------------------------------------------------


def cluster_key(pool) -> str:
    security = os.path.join(pool.cluster.profile_dir, "security")
    engine_file = next(name for name in os.listdir(security) if name.endswith("-engine.json"))
    with open(os.path.join(security, engine_file)) as info:
        key = json.load(info)["key"]
    assert len(key) >= 16
    return key


def test_the_cluster_key_is_in_no_process_environment_command_line_or_file_on_any_host(ip, pool, hosts):
    key = cluster_key(pool).encode()
    started = time.time()
    # While a cell runs, with a child process of its own (which inherits the rank's environment).
    child = "import subprocess\n_child = subprocess.Popen(['sleep', '300'])"
    with Held(ip, hosts, child, then="_child.kill()\n_child.wait()\nrank"):
        for index, address in enumerate(hosts.addresses()):
            pids = hosts.processes(address)
            commands = {pid: _read(f"/proc/{pid}/cmdline") for pid in pids}
            assert any(b"xla_magic.hosts.engine" in c for c in commands.values())  # engine, launcher, ranks
            assert sum(c.startswith(b"sleep\0") for c in commands.values()) == RANKS_PER_HOST
            for pid in pids:
                assert key not in _read(f"/proc/{pid}/environ"), f"key in the environment of {commands[pid]}"
                assert key not in commands[pid], f"key on the command line {commands[pid]}"
                assert b"IPP_CONNECTION_INFO" not in _read(f"/proc/{pid}/environ"), commands[pid]
            host = root(hosts, index)
            for top in (f"{host}/tmp", f"{host}/dev/shm"):
                assert not _files_holding(key, top), f"key in a file under host h{index}'s {top}"
    # Home is shared by the simulated hosts (and with the kernel, which keeps its files in its own /tmp).
    assert not _files_holding(key, os.path.expanduser("~"), newer_than=started)


def test_a_cell_sees_no_connection_info_in_its_environment_nor_in_env(ip, pool):
    key = cluster_key(pool)
    value, _, _ = cell(ip, "import os\nshown = !env\n(dict(os.environ), list(shown))")
    for environment, shown in value:
        assert "IPP_CONNECTION_INFO" not in environment and len(shown) > 5
        assert not any(key in text for text in [*environment.values(), *shown])


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _files_holding(key: bytes, top: str, newer_than: float = 0.0) -> list[str]:
    found = []
    for directory, _, names in os.walk(top):
        for name in names:
            path = os.path.join(directory, name)
            try:
                if not os.path.isfile(path) or os.path.islink(path) or os.path.getmtime(path) < newer_than:
                    continue
            except OSError:
                continue
            if key in _read(path):
                found.append(path)
    return found


# --- listeners only where they must be -----------------------------------------------------


def test_no_port_on_any_host_listens_on_every_interface_while_a_collective_runs(ip, pool, hosts):
    collective = ("import torch, torch_xla.core.xla_model as xm\n"
                  "xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device))  # the store and gloo are up")
    with Held(ip, hosts, collective):
        found = {index: listeners(hosts, index) for index in range(2)}
    for index, rows in found.items():
        addresses = {address.rpartition(":")[0] for address, _ in rows}
        # Host 0: the world's store (a rank's); every host: gloo's pairs (each rank's); loopback: ipyparallel's
        # engine and nanny, which only the host's own processes reach.
        assert addresses <= {hosts.address(index), "127.0.0.1"}, rows
        ranks = {process for address, process in rows if address.startswith(hosts.address(index) + ":")}
        assert len(ranks) >= RANKS_PER_HOST, rows  # the listeners were up when sampled
    assert len(found[0]) > len(found[1])  # host 0 also holds the store


# --- every line reaches the kernel -------------------------------------------------------------


LINES = 3000


def test_every_line_of_every_rank_reaches_the_kernel_in_order_and_the_fold_names_logs_it_can_open(ip, pool, hosts):
    _, out, err = cell(ip, f"import sys\nfor i in range({LINES}):\n    print(f'line {{i}} of {{rank}}')\n"
                           "print('the end', file=sys.stderr)")
    lines = out.splitlines()
    for r in range(WORLD):
        tag = f"[h{r // RANKS_PER_HOST} r{r}] "
        shown = [line[len(tag):] for line in lines if line.startswith(tag) and " of " in line]
        assert shown == [f"line {i} of {r}" for i in range(len(shown))] and 0 < len(shown) < LINES
        notice = next(line for line in lines if line.startswith(tag + "... more stdout"))
        path = notice.rpartition(" goes to ")[2]
        assert os.path.basename(path) == f"h{r // RANKS_PER_HOST}r{r}.stdout.log"
        assert path.startswith(tempfile.gettempdir())  # the kernel's own /tmp (no host's), which the notebook opens
        assert f"(complete log: {path})" in lines
        with open(path) as log:
            assert log.read().splitlines() == [f"line {i} of {r}" for i in range(LINES)]
        assert f"\x1b[31m[h{r // RANKS_PER_HOST} r{r}]\x1b[0m the end" in err  # stderr: tagged in red
    for index in range(2):  # nothing was kept on the hosts
        assert not glob.glob(f"{root(hosts, index)}/tmp/**/*.std*.log", recursive=True)


# --- the kernel's place on every host ---------------------------------------------------------------


PLACE = "import os, sys\n(os.getcwd(), os.environ.get('XLA_MAGIC_TEST_PLACE'), '{path}' in sys.path)"


def test_the_kernel_s_directory_path_and_environment_reach_every_host_as_on_one_host(ip, pool, kernel_place):
    import sys

    os.chdir(kernel_place)
    sys.path.insert(0, kernel_place)
    os.environ["XLA_MAGIC_TEST_PLACE"] = "kernel's"
    value, _, _ = cell(ip, "import placed_module\n" + PLACE.format(path=kernel_place) + " + (placed_module.WHERE,)")
    assert value == [(kernel_place, "kernel's", True, "the kernel put me on the path")] * WORLD
    # A cell's own change lasts until the kernel's changes.
    cell(ip, "os.chdir('/')\nos.environ['XLA_MAGIC_TEST_PLACE'] = 'the cell s'")
    assert cell(ip, PLACE.format(path=kernel_place))[0] == [("/", "the cell s", True)] * WORLD
    other = os.path.join(kernel_place, "other")
    ip.run_line_magic("cd", other)
    os.environ["XLA_MAGIC_TEST_PLACE"] = "kernel's again"
    assert cell(ip, PLACE.format(path=kernel_place))[0] == [(other, "kernel's again", True)] * WORLD
    sys.path.remove(kernel_place)
    del os.environ["XLA_MAGIC_TEST_PLACE"]
    assert cell(ip, PLACE.format(path=kernel_place))[0] == [(other, None, False)] * WORLD


def test_a_directory_the_hosts_lack_is_an_error_naming_each_host(ip, pool, hosts, kernel_place):
    from xla_magic.runs.errors import RankError

    only_here = f"/tmp/xla_magic-place-{uuid.uuid4().hex[:8]}"  # the kernel's /tmp: no host has it
    os.makedirs(only_here)
    try:
        ip.run_line_magic("cd", only_here)
        with pytest.raises(RankError) as raised:
            cell(ip, "rank")
    finally:
        os.rmdir(only_here)
    shown = "\n".join(raised.value.render_lines())
    assert all(f"h{r // RANKS_PER_HOST} r{r}" in shown for r in range(WORLD))  # every rank, by its host
    for index in range(2):
        assert f"h{index}" in raised.value.summary
        assert f"{only_here} cannot be used here (on {hosts.hostname(index)})" in shown
    ip.run_line_magic("cd", kernel_place)
    assert cell(ip, "import os\nos.getcwd()")[0] == [kernel_place] * WORLD  # the pool goes on


# --- --profile on every host ------------------------------------------------------------------------

PROFILED = """import torch, torch_xla
a = torch.ones(32, 32, device=device) * (rank + 1)
b = a * 2
y = (a @ b).sum(); torch_xla.sync(); y.item(); seen(4)
seen(5)
"""


def test_a_profiled_cell_records_every_rank_on_every_host_and_brings_its_files_to_the_kernel(ip, pool, hosts):
    from test_profile import check_lines, file_events, seen

    from xla_magic.notebook import profile_view

    ip.user_ns["seen"] = seen
    _, out, _ = cell(ip, PROFILED, line="--profile")
    session = ip._xla_magic_session
    record = session.last_profiled
    assert record.profile.startswith(tempfile.gettempdir()) and os.path.isdir(record.profile)
    found = profile_view.lanes(record)
    assert [one.ranks for one in found] == [[r] for r in range(WORLD)]
    for one in found:
        [r] = one.ranks
        h, where = r // RANKS_PER_HOST, one.where
        assert not one.problem, one.problem
        # The kernel's copy, in its session directory, under h<H>r<R>; and the host's own, on the host's /tmp.
        mine = os.path.join(record.profile, f"h{h}r{r}")
        hostname, _, folder = where["on_host"].partition(":")
        assert hostname == hosts.hostname(h) and not os.path.exists(folder)  # not the kernel's /tmp
        for key in ("trace", "xplane", "lines"):
            assert where[key].startswith(mine + os.sep) and os.path.isfile(where[key])
            on_the_host = os.path.join(folder, os.path.relpath(where[key], mine))
            with open(root(hosts, h) + on_the_host, "rb") as theirs, open(where[key], "rb") as copy:
                if key != "lines":  # the lines' copy numbers its rows by global rank
                    assert copy.read() == theirs.read()
        assert f"{where['trace']}, {where['xplane']} (copied from the host's {where['on_host']})" in out
        # The lane's compiles are the copied trace's own, and its lines are this rank's, in order.
        compiles = [e for e in file_events(where["trace"]) if e["name"] == "XLAGraphExecutor::Compile"]
        drawn = [e for e in one.events if e.kind == "compile"]
        assert len(drawn) == len(compiles) >= 1
        assert all(e.label.startswith("line 4") for e in drawn), [e.label for e in drawn]  # as the XLA report names it
        assert list(one.lines) == [r]
        check_lines(one, r)
        assert f"  h{h} r{r}: " in out and f"h{h} r{r} lines (sampled every" in out
    page = profile_view.page(record)
    assert all(f">h{r // RANKS_PER_HOST} r{r}<" in page and f">h{r // RANKS_PER_HOST} r{r} lines<" in page
               for r in range(WORLD))

    # A host whose traces cannot be had: n/a for its ranks, and the cell still gives its values.
    broken = ("import os, shutil\nfrom xla_magic.launcher import profiling\n"
              "if host == 1:  # the profiler's folder becomes a file: it cannot write its trace\n"
              "    folder = profiling.profiler().folder\n    shutil.rmtree(folder)\n    open(folder, 'w').close()\n"
              "rank")
    value, out, _ = cell(ip, broken, line="--profile")
    assert value == list(range(WORLD))
    record = session.last_profiled
    found = profile_view.lanes(record)
    assert [one.ranks for one in found] == [[r] for r in range(WORLD)]
    assert [bool(one.problem) for one in found] == [False] * RANKS_PER_HOST + [True] * RANKS_PER_HOST
    for one in found[RANKS_PER_HOST:]:
        assert one.problem.startswith("n/a: the profiler did not run: ") and one.where["trace"] == ""
        assert f"h1 r{one.ranks[0]}: " in out and "n/a: the profiler did not run" in out
        assert f"(its folder on the host's {one.where['on_host']})" in out and one.where["on_host"].startswith(
            hosts.hostname(1) + ":")


def test_a_fresh_profiled_cell_on_every_host_brings_every_rank_s_trace(ip, pool, hosts):
    from test_profile import file_events

    from xla_magic.notebook import profile_view

    value, _, _ = cell(ip, "import torch, torch_xla\ny = (torch.ones(8, device=device) + rank).sum()\ntorch_xla.sync()\n"
                           "y.item()", line="--fresh --profile")
    assert value == [8.0 * (r + 1) for r in range(WORLD)]
    record = ip._xla_magic_session.last_profiled
    found = profile_view.lanes(record)
    assert [one.ranks for one in found] == [[r] for r in range(WORLD)]
    for one in found:
        [r] = one.ranks
        assert not one.problem, one.problem
        assert one.where["trace"].startswith(os.path.join(record.profile, f"h{r // RANKS_PER_HOST}r{r}") + os.sep)
        compiles = [e for e in file_events(one.where["trace"]) if e["name"] == "XLAGraphExecutor::Compile"]
        assert len([e for e in one.events if e.kind == "compile"]) == len(compiles) >= 1
