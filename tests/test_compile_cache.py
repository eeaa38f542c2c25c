"""torch_xla's persistent compilation cache, one directory per rank, on the simulation with the cache forced on.

Real ranks, real torch_xla: a cell's compilations land as files in each
rank's own directory; a new pool in a new Jupyter kernel opens the same
directories, and torch_xla's own counters show it found each graph there
(XLA:CPU then cannot load it, and compiles: the TPU's path, exercised
without its speed-up). A read-only directory and a full disk (tmpfs
mounts, as root) never fail a cell: it runs without the cache, which one
line says, once, and no warning reaches the cell; so does a variable that
names no usable place. Off by default on the simulation, and on a TPU by
torch_xla's version (its metadata, as a distribution directory the test
writes); a bad option is a usage error that says what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from IPython.core.error import UsageError

from helpers import Kernel, pool_magic, spawn_cell, strip_ansi
from xla_magic.cell import compile_cache

CELL = "import torch\nx = torch.ones(4, device=device) * 3 + rank\nx.sum().item()"
# What torch_xla writes when it cannot use the cache (XLA:CPU's load failure, a failed write), and ours.
WARNINGS = ("Failed to deserialize", "W torch_xla", "Warning", "warning")


def cache_files(root) -> dict[str, list[str]]:
    """Each leaf directory under ``root`` (a rank's) with the files torch_xla wrote there."""
    found = {}
    for folder, dirs, names in os.walk(root):
        if not dirs:
            found[os.path.relpath(folder, root)] = sorted(names)
    return found


def test_each_rank_writes_its_own_directory_and_the_pool_keeps_it(ip, tmp_path):
    root = tmp_path / "cache"
    started = pool_magic(ip, f"start --devices 2 --backend cpu --compile-cache {root}")
    try:
        assert "compile cache" not in started, started
        value, out, err, _ = spawn_cell(ip, "", CELL)
        assert value == [12.0, 16.0]
        assert err == "" and "compile cache" not in out, (out, err)
        found = cache_files(root)
        leaves = sorted(path.rpartition(os.sep)[2] for path in found)
        assert leaves == ["rank-0-of-2", "rank-1-of-2"], found
        # keyed by torch_xla's version, the platform's and the device kind, then the rank's place in the world
        assert all(path.startswith("torch_xla-") and f"{os.sep}cpu{os.sep}" in path for path in found), found
        assert all(names and not any(name.startswith(".") for name in names) for names in found.values()), found

        with pytest.raises(UsageError, match="opened their compilation cache when they started"):
            ip.run_cell_magic("xla_spawn", "--compile-cache off", CELL)
        status = strip_ansi(pool_magic(ip, "") + _status(ip))
        assert f"Cache:    {root}: " in status and "2 folder(s)" in status, status
        assert f"rm -r {root}" in status and "--compile-cache off" in status, status
        pool_magic(ip, "restart")  # new ranks, the same cache
        assert f"Cache:    {root}: " in _status(ip)
        pool_magic(ip, "restart --compile-cache off")
        assert "Cache:    off (--compile-cache off)" in _status(ip)
    finally:
        pool_magic(ip, "stop")


def _status(ip) -> str:
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        ip.run_line_magic("xla_status", "--text")
    return captured.stdout


def test_a_new_pool_in_a_new_kernel_reads_the_same_directories(ip, tmp_path):
    root = tmp_path / "cache"
    value, out, err, _ = spawn_cell(ip, f"--devices 2 --backend cpu --compile-cache {root}", CELL)
    assert value == [12.0, 16.0] and err == "", err
    written = cache_files(root)
    assert len(written) == 2 and all(written.values()), written

    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        # The variable, set in the notebook after the extension loaded, is read when the pool starts.
        reply, text = kernel.run(f"import os\nos.environ['XLA_MAGIC_COMPILE_CACHE'] = {str(root)!r}\n"
                                 "%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        reply, text = kernel.run("%%xla_spawn\n" + CELL)
        assert reply["status"] == "ok", text
        assert text.strip() == "[12.0, 16.0]", text  # no warning reached the cell
        # torch_xla's own attempt, in its counters: each rank found its graph in its directory, and XLA:CPU
        # could not load it (so it compiled again); the report says why.
        reply, text = kernel.run("%xla_report --text")
        assert "0 (1 not loadable)" in text and "cannot load what the compile cache holds here" in text, text
        reply, text = kernel.run("%xla_pool stop")
        assert reply["status"] == "ok", text
    finally:
        kernel.close()
    assert cache_files(root).keys() == written.keys()


def test_the_spmd_process_and_the_tpu_path_s_rank_threads_open_one_directory_each_process(spawn, tmp_path,
                                                                                         monkeypatch):
    spmd = spawn(f"--spmd --devices 2 --compile-cache {tmp_path / 'spmd'}", "import torch\n"
                 "(torch.ones(4, device=device) * 3).sum().item()")
    assert spmd.value == 12.0 and "compile cache" not in spmd.stdout, spmd.stdout
    assert "Failed to deserialize" not in spmd.stderr, spmd.stderr  # (XLA's own GSPMD notice stays)
    assert [path.rpartition(os.sep)[2] for path in cache_files(tmp_path / "spmd")] == ["spmd-2"]
    # The tpu launch path on CPU: two rank threads of one process share its cache, opened once, before either compiles.
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    threads = spawn(f"--devices 2 --backend tpu --compile-cache {tmp_path / 'threads'}", CELL)
    assert threads.value == [12.0, 16.0] and threads.stderr == "", threads.stderr
    found = cache_files(tmp_path / "threads")
    assert [path.rpartition(os.sep)[2] for path in found] == ["process-0-of-1-world-2"], found
    assert len(next(iter(found.values()))) == 2  # each thread's graph (x * rank differs)


@pytest.fixture
def mounted(tmp_path):
    """``mount(options)``: a fresh tmpfs mounted with ``options`` (root only), unmounted after the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounts = []

    def mount(options: str):
        path = tmp_path / f"mount{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounts:
            subprocess.run(["umount", str(path)], check=True)


def test_an_unwritable_directory_does_not_fail_the_cell_and_is_said_once(ip, mounted):
    read_only = mounted("ro,size=1m")
    line = f"--devices 2 --backend cpu --compile-cache {read_only}"
    value, out, err, _ = spawn_cell(ip, line, CELL)
    assert value == [12.0, 16.0]
    said = [text for text in out.splitlines() if "compile cache" in text]
    assert len(said) == 1 and f"every rank: {read_only} is not writable" in said[0], out
    assert not any(warning in out + err for warning in WARNINGS), (out, err)
    value, out, err, _ = spawn_cell(ip, line, CELL)  # said once a session
    assert value == [12.0, 16.0] and "compile cache" not in out and err == "", (out, err)


def test_a_full_disk_does_not_fail_the_cell(ip, mounted):
    full = mounted("size=256k")
    with open(full / "filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError:
            pass
    started = pool_magic(ip, f"start --devices 2 --backend cpu --compile-cache {full}")
    try:
        said = [text for text in started.splitlines() if "compile cache" in text]
        assert len(said) == 1 and f"every rank: {full} is on a full disk" in said[0], started
        value, out, err, _ = spawn_cell(ip, "", CELL)
        assert value == [12.0, 16.0]
        assert "compile cache" not in out and not any(warning in out + err for warning in WARNINGS), (out, err)
        assert "not used by the pool" in _status(ip)
    finally:
        pool_magic(ip, "stop")


def test_off_by_default_on_the_simulation_and_bad_values_say_what_to_do(ip, tmp_path, monkeypatch):
    assert "Cache:    off on XLA:CPU" in _status(ip)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        ip.run_cell_magic("xla_spawn", f"--devices 2 --backend cpu --compile-cache {a_file}", CELL)
    with pytest.raises(UsageError, match="--compile-cache goes with %xla_pool start and restart only"):
        ip.run_line_magic("xla_pool", "stop --compile-cache off")
    monkeypatch.setenv("XLA_MAGIC_COMPILE_CACHE", "off")
    assert "Cache:    off (XLA_MAGIC_COMPILE_CACHE off)" in _status(ip)


def test_a_variable_that_names_no_usable_place_runs_the_cells_without_the_cache_said_once(ip, tmp_path,
                                                                                         monkeypatch):
    # The variable may be set for the whole machine, long before the cell: the cell runs, and one line says why
    # there is no cache and what to set (the option, typed in the cell, is refused instead: above).
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("XLA_MAGIC_COMPILE_CACHE", str(a_file))
    line = "--devices 2 --backend cpu"
    value, out, err, _ = spawn_cell(ip, line, CELL)
    assert value == [12.0, 16.0] and err == "", err
    said = [text for text in out.splitlines() if "compile cache" in text]
    assert len(said) == 1 and "not used, the cells run without it" in said[0], out
    assert f"XLA_MAGIC_COMPILE_CACHE {a_file}: " in said[0] and "is a file" in said[0], said
    value, out, err, _ = spawn_cell(ip, line, CELL)  # said once a session
    assert value == [12.0, 16.0] and "compile cache" not in out and err == "", (out, err)
    assert "Cache:    off (XLA_MAGIC_COMPILE_CACHE " in _status(ip)
    assert os.listdir(tmp_path) == ["a-file"]


def _torch_xla_installed_as(tmp_path, monkeypatch, version: str) -> None:
    """The kernel's metadata lookup finds torch_xla ``version`` first on sys.path: a distribution's metadata
    directory as pip writes it, nothing else (the ranks keep the real torch_xla)."""
    found = tmp_path / "site"
    info = found / f"torch_xla-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_xla\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(found))


@pytest.mark.parametrize("version, on", [
    ("2.5.1", True), ("2.7.0", True), ("2.7.1+cpu", True),  # their TPU client loads its cache
    ("2.8.0", False), ("2.8.0+libtpu", False), ("2.9.0", False), ("2.9.0rc2", False),  # pytorch/xla#9094
])
def test_the_default_on_a_tpu_follows_what_the_installed_torch_xla_can_load(tmp_path, monkeypatch, version, on):
    _torch_xla_installed_as(tmp_path, monkeypatch, version)
    assert compile_cache.installed_version() == version
    default = compile_cache.resolve(None, environ={})
    assert (default.job(on_cpu=False) is not None) is on, default.describe(on_cpu=False)
    assert default.job(on_cpu=True) is None  # XLA:CPU never loads it
    described = default.describe(on_cpu=False)
    if on:
        assert described == compile_cache.default_root()
    else:
        assert f"off: torch_xla {version} cannot load its compile cache on a TPU (pytorch/xla#9094)" in described
        assert "%xla_pool start --keep" in described and "--compile-cache DIR forces it on" in described
    # Given, it is on whatever the version: the option, or the variable
    given = compile_cache.resolve(None, environ={"XLA_MAGIC_COMPILE_CACHE": str(tmp_path / "cache")})
    assert given.job(on_cpu=False) == given.job(on_cpu=True) == {"root": str(tmp_path / "cache")}
    assert compile_cache.resolve(compile_cache.option("on"), environ={}).job(on_cpu=False) is not None


@pytest.mark.parametrize("given, said", [
    ("''", "--compile-cache is empty: it takes a directory, on or off, like --compile-cache ~/xla-cache"),
    ("' '", "--compile-cache is empty"),
    ("=", "--compile-cache is empty"),
    ("false", "--compile-cache false: did you mean off?"),
    ("None", "--compile-cache None: did you mean off?"),
    ("yes", "--compile-cache yes: did you mean on?"),
    ("~no-such-user-here/cache", "there is no user 'no-such-user-here' on this machine"),
    ("a-file", "is a file, not a directory"),
    ("'a-file'", "is a file, not a directory"),
    ("a-file/cache", "a-file is a file, so no directory can be made under it"),
])
def test_a_value_that_cannot_be_a_cache_directory_says_what_to_give(ip, tmp_path, monkeypatch, given, said):
    # Nothing is launched and nothing is made: the notebook's directory stays as it was.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    option = f"--compile-cache={given[1:]}" if given.startswith("=") else f"--compile-cache {given}"
    with pytest.raises(UsageError) as raised:
        ip.run_cell_magic("xla_spawn", f"--devices 2 --backend cpu {option}", CELL)
    assert type(raised.value) is UsageError and said in str(raised.value), raised.value
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


@pytest.mark.parametrize("written", ["--Compile-Cache", "--COMPILE-CACHE", "--compile_cache"])
def test_an_option_written_in_another_case_names_the_one_meant(ip, written):
    with pytest.raises(UsageError, match="Options are lower case, with dashes: --compile-cache") as raised:
        ip.run_line_magic("xla_pool", f"start {written} off")
    assert type(raised.value) is UsageError and str(raised.value).startswith("unrecognized arguments:")
    with pytest.raises(UsageError, match=r"Did you mean --compile-cache\?"):
        ip.run_cell_magic("xla_spawn", "--compile-cahce off", CELL)


def test_the_variable_set_empty_or_to_a_word_says_what_to_give(ip, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_MAGIC_COMPILE_CACHE", "")
    assert "XLA_MAGIC_COMPILE_CACHE is empty: " in _status(ip) and "or unset it" in _status(ip)
    monkeypatch.setenv("XLA_MAGIC_COMPILE_CACHE", "0")
    assert "XLA_MAGIC_COMPILE_CACHE 0: did you mean off" in _status(ip)
    told: set[str] = set()
    setting = compile_cache.resolve(None)
    said = compile_cache.setting_line(setting, told)
    assert said and "not used, the cells run without it: XLA_MAGIC_COMPILE_CACHE 0: did you mean off" in said
    assert compile_cache.setting_line(setting, told) is None and setting.job(on_cpu=False) is None
    # A relative directory is the notebook's: it is resolved there, once, and said in full.
    monkeypatch.setenv("XLA_MAGIC_COMPILE_CACHE", "cache-here")
    assert f"Cache:    {tmp_path / 'cache-here'}" in _status(ip)
    assert os.listdir(tmp_path) == []


def test_ranks_that_can_load_nothing_the_cache_holds_are_said_once_where_that_is_news(ip, tmp_path):
    # New rank processes find each graph in their folders and cannot load it: XLA:CPU never can, and neither
    # can a TPU's with torch_xla 2.7 to 2.9 (pytorch/xla#9094), whose warning per graph is the same line.
    line = f"--devices 2 --backend cpu --compile-cache {tmp_path / 'cache'}"
    spawn_cell(ip, line, CELL)
    value, out, err, _ = spawn_cell(ip, line, CELL)
    assert value == [12.0, 16.0] and err == "" and "compile cache" not in out, (out, err)  # not on XLA:CPU
    accounts = [state.xla for state in ip._xla_magic_session.last_cell.ranks.values()]
    assert [(account["loaded"], account["load_failures"], account["cannot_load"]) for account in accounts] == \
        [(0, 1, True)] * 2, accounts
    # Where the ranks are not on XLA:CPU (a TPU), the same accounts are said once a session, with what to do.
    told: set[str] = set()
    said = compile_cache.unloadable_line(accounts, on_cpu=False, told=told)
    assert said and "pytorch/xla#9094" in said and "--compile-cache off" in said, said
    assert compile_cache.unloadable_line(accounts, on_cpu=False, told=told) is None
    assert compile_cache.unloadable_line(accounts, on_cpu=True, told=set()) is None
    loaded_once = [dict(account, cannot_load=False) for account in accounts]  # what a process that loaded some says
    assert compile_cache.unloadable_line(loaded_once, on_cpu=False, told=set()) is None
