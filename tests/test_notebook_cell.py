"""A %%xla_spawn cell is a notebook cell: the kernel's directory and sys.path, IPython syntax, display from ranks.

Through the real IPython shell (the ``ip`` fixture), on every placement: a
one-shot cell on the cpu backend, the tpu launch path (ranks as threads of
one process, PJRT_DEVICE=CPU), the SPMD process, and a pool. What a rank
displays reaches the kernel shell's display_pub, where capture_output()
keeps each mime bundle. tests/test_notebook_kernel.py does the same through
real Jupyter kernels.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from xla_magic.cell import place
from xla_magic.notebook.syntax_error import CellSyntaxError
from xla_magic.runs.errors import RankError

PLACEMENTS = {
    "cpu": "--devices 2",
    "tpu-threads": "--devices 2 --backend tpu",
    "spmd": "--devices 2 --spmd",
}


@pytest.fixture(autouse=True)
def tpu_path_on_cpu(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path runs its ranks as threads here


@pytest.fixture
def kernel_place(ip, tmp_path, monkeypatch):
    """A notebook's directory (data.csv) and a code directory on sys.path (mymodel.py), as a user sets them up."""
    home = tmp_path / "notebook"
    code = tmp_path / "my-code"
    home.mkdir()
    code.mkdir()
    (home / "data.csv").write_text("a,b\n1,2\n")
    (code / "mymodel.py").write_text("def f(x):\n    return x + 100\n")
    monkeypatch.chdir(home)
    monkeypatch.setattr(sys, "path", sys.path + [str(code)])
    yield home
    sys.modules.pop("mymodel", None)
    for name in ("mymodel", "helper"):
        ip.user_ns.pop(name, None)


def run(ip, line: str, cell: str):
    """Run a %%xla_spawn cell; its value and everything it showed (stdout, and display data by mime type)."""
    with capture_output() as captured:
        value = ip.run_cell_magic("xla_spawn", line, cell)
    return value, captured


def values(value, line: str) -> list:
    """A cell's value as a list by rank (an SPMD cell's one value is its only entry)."""
    return [value] if "--spmd" in line else value


@pytest.mark.parametrize("line", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_cells_run_in_the_kernels_directory_with_its_path_and_modules(ip, kernel_place, line):
    ip.run_cell("import mymodel\ndef helper(x):\n    return mymodel.f(x)")
    value, _ = run(ip, line, "import os, mymodel\n(os.getcwd(), open('data.csv').readline().strip(), helper(rank), mymodel.f(1))")
    for rank, got in enumerate(values(value, line)):
        assert got == (str(kernel_place), "a,b", 100 + rank, 101)


def test_a_pool_follows_the_kernels_directory_and_keeps_its_own_chdir_until_it_changes(ip, kernel_place, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ip.run_line_magic("xla_pool", "start --devices 2")
    try:
        assert run(ip, "", "import os\nos.getcwd()")[0] == [str(kernel_place)] * 2
        assert run(ip, "", f"os.chdir({str(tmp_path)!r})\nos.getcwd()")[0] == [str(tmp_path)] * 2
        assert run(ip, "", "os.getcwd()")[0] == [str(tmp_path)] * 2  # the cell's own chdir stays
        os.chdir(elsewhere)  # the kernel moves: so do the ranks, at the next cell
        assert run(ip, "", "os.getcwd()")[0] == [str(elsewhere)] * 2
        sys.path.append(str(elsewhere))
        (elsewhere / "later.py").write_text("VALUE = 7\n")
        assert run(ip, "", "import later\nlater.VALUE")[0] == [7, 7]
    finally:
        ip.run_line_magic("xla_pool", "stop")
        sys.modules.pop("later", None)


def test_a_pool_follows_the_kernels_environment_and_keeps_a_cells_own_until_it_changes(ip, monkeypatch):
    read = "import os\n(os.environ.get('XLA_MAGIC_TRY'), os.environ.get('XLA_MAGIC_OWN'))"
    monkeypatch.delenv("XLA_MAGIC_TRY", raising=False)
    ip.run_line_magic("xla_pool", "start --devices 2")
    try:
        assert run(ip, "", read)[0] == [(None, None)] * 2
        os.environ["XLA_MAGIC_TRY"] = "1"  # set after the ranks started: it reaches them at the next cell
        assert run(ip, "", read)[0] == [("1", None)] * 2
        assert run(ip, "", f"os.environ['XLA_MAGIC_OWN'] = str(rank)\n{read}")[0] == [("1", "0"), ("1", "1")]
        assert run(ip, "", read)[0] == [("1", "0"), ("1", "1")]  # a cell's own variable stays
        os.environ["XLA_MAGIC_TRY"] = "2"
        assert run(ip, "", read)[0] == [("2", "0"), ("2", "1")]
        del os.environ["XLA_MAGIC_TRY"]  # undone in the kernel: undone in the ranks
        assert run(ip, "", read)[0] == [(None, "0"), (None, "1")]
    finally:
        ip.run_line_magic("xla_pool", "stop")
        os.environ.pop("XLA_MAGIC_TRY", None)


def test_a_directory_the_ranks_cannot_enter_is_an_error_naming_it(ip, kernel_place, monkeypatch):
    # As on another host: the kernel's directory is not there for the ranks.
    missing = str(kernel_place / "only-on-the-kernels-host")
    monkeypatch.setattr(place, "current", lambda environment=None: {"cwd": missing, "path": ()})
    with pytest.raises(RankError) as info:
        run(ip, "--devices 2", "1")
    message = "\n".join(info.value._render_traceback_())
    assert missing in message and "%cd" in message
    assert "xla_magic/launcher" not in message  # our frames are no part of the user's error


def test_a_notebook_function_whose_module_the_ranks_cannot_import_is_an_error_naming_it(ip, kernel_place, monkeypatch):
    ip.run_cell("import mymodel\ndef helper(x):\n    return mymodel.f(x)")
    monkeypatch.setattr(place, "current", lambda environment=None: {"cwd": str(kernel_place), "path": ()})  # the path stays behind
    with pytest.raises(RankError) as info:
        run(ip, "--devices 2", "helper(rank)")
    message = "\n".join(info.value._render_traceback_())
    assert "need the module 'mymodel'" in message and "sys.path" in message
    assert "xla_magic/launcher" not in message


def test_the_user_path_leaves_out_the_interpreters_own_directories():
    import sysconfig

    stdlib, purelib = sysconfig.get_path("stdlib"), sysconfig.get_path("purelib")
    assert place.user_path(("", "/my/code", stdlib, purelib, os.path.join(purelib, "pkg"))) == ("", "/my/code")


SHELL_CELL = """
%matplotlib inline
%env XLA_MAGIC_TEST_VAR=from-env
%time y = scale * rank
%timeit -n 1 -r 1 scale + rank
!echo shell says $word {rank}
listing = !ls $home
import os
%cd $sub
where = os.getcwd()
(y, listing, where, os.environ["XLA_MAGIC_TEST_VAR"], get_ipython().user_ns is globals(),
 type(get_ipython()).__name__)
"""


@pytest.mark.parametrize("line", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_magics_and_shell_commands_run_in_every_rank(ip, kernel_place, line):
    (kernel_place / "sub").mkdir()
    # Rank threads (the tpu launch path) share one process, so one working directory: absolute paths here.
    ip.user_ns.update(scale=3, word="hello", home=str(kernel_place), sub=str(kernel_place / "sub"))
    value, captured = run(ip, line, SHELL_CELL)
    for rank, got in enumerate(values(value, line)):
        assert got == (3 * rank, ["data.csv", "sub"], str(kernel_place / "sub"), "from-env", True, "RankShell")
    tag = "[spmd]" if "--spmd" in line else "[rank 0]"
    assert f"{tag} CPU times:" in captured.stdout and f"{tag} Wall time:" in captured.stdout
    assert f"{tag} shell says hello 0" in captured.stdout
    assert "loop" in captured.stdout  # %timeit's report
    assert os.getcwd() == str(kernel_place)  # %cd moved the ranks, not the kernel


def test_each_rank_thread_has_its_own_shell_on_the_tpu_launch_path(ip, kernel_place):
    cell = "import IPython\nshell = IPython.get_ipython()\n(shell.user_ns['rank'], shell.user_ns is globals(), id(get_ipython()))"
    value, _ = run(ip, "--devices 3 --backend tpu", cell)
    assert [got[:2] for got in value] == [(0, True), (1, True), (2, True)]
    assert len({got[2] for got in value}) == 3


@pytest.mark.parametrize("cell, refused", [
    ("%pip install requests", "%pip cannot run inside %%xla_spawn"),
    ("x = 1\n%conda install numpy", "%conda cannot run inside %%xla_spawn"),
    ("%%xla_spawn\nprint(1)", "%xla_spawn is a magic of the kernel"),
    ("print(1)\n%%xla_spawn --devices 2", "%xla_spawn is a magic of the kernel"),
    ("%xla_pool start", "%xla_pool is a magic of the kernel"),
])
def test_magics_that_do_not_belong_in_ranks_are_refused_before_launch(ip, cell, refused):
    session = ip._xla_magic_session
    before = len(session.history)
    with pytest.raises(UsageError, match=re.escape(refused)) as info:
        ip.run_cell_magic("xla_spawn", "--devices 2", cell)
    assert "in a cell of its own" in str(info.value)
    assert len(session.history) == before


def test_a_syntax_error_among_magics_is_refused_with_the_cells_line(ip):
    session = ip._xla_magic_session
    before = len(session.history)
    with pytest.raises(CellSyntaxError) as info:
        ip.run_cell_magic("xla_spawn", "--devices 2", "%time y = 1\nx = (1,\nprint(x")
    assert info.value.error.filename.startswith("<xla_spawn cell")
    assert len(session.history) == before


def test_a_rank_error_after_magics_shows_the_cells_own_lines(ip):
    from xla_magic.runs.errors import RankError

    with pytest.raises(RankError) as info:
        run(ip, "--devices 2", "\n%time y = 1\nraise ValueError(f'bad {rank}')")
    rendered = "\n".join(info.value._render_traceback_())
    assert "raise ValueError(f'bad {rank}')" in rendered and "line 3" in rendered


class Card:
    """A rich object as a notebook user writes one."""

    def __init__(self, title):
        self.title = title

    def _repr_html_(self):
        return f"<h3>{self.title}</h3>"

    def _repr_png_(self):
        return b"\x89PNG\r\n\x1a\n-a-tiny-picture"


def mime(captured, kind: str) -> list:
    return [output.data[kind] for output in captured.outputs if kind in output.data]


@pytest.mark.parametrize("line", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_what_a_rank_displays_arrives_as_display_data_in_order_with_its_lines(ip, line):
    ip.user_ns["Card"] = Card
    cell = ("from IPython.display import HTML, display\nprint('before')\ndisplay(HTML(f'<b>rank {rank}</b>'))\n"
            "print('between')\ndisplay(Card(f'card {rank}'))\nprint('after')")
    _, captured = run(ip, line, cell)
    html = mime(captured, "text/html")
    ranks = 1 if "--spmd" in line else 2
    assert sorted(html) == sorted([f"<b>rank {r}</b>" for r in range(ranks)] + [f"<h3>card {r}</h3>" for r in range(ranks)])
    assert mime(captured, "image/png")  # the _repr_png_ travelled too
    tag = "[spmd]" if "--spmd" in line else "[rank 0]"
    rank0 = [text for text in captured.stdout.splitlines() if text.startswith(tag)]
    assert rank0 == [f"{tag} before", tag, f"{tag} between", tag, f"{tag} after"]


def test_a_terminal_prints_the_text_form_of_what_ranks_display(ip):
    with capture_output(display=False) as terminal:  # the terminal shell's own display_pub prints
        ip.run_cell_magic("xla_spawn", "--devices 1", "from IPython.display import HTML\ndisplay(HTML('<b>x</b>'))")
    assert terminal.stdout.splitlines() == ["[rank 0]", "<IPython.core.display.HTML object>"]


def test_display_handles_update_each_ranks_own_display(ip):
    cell = ("from IPython.display import display, update_display\nh = display('first', display_id=True)\n"
            "h.update(f'second {rank}')\ndisplay('x', display_id='fixed')\nupdate_display(f'y {rank}', display_id='fixed')")
    _, captured = run(ip, "--devices 2", cell)
    shown = [(output.data["text/plain"], (output.transient or {}).get("display_id"), output.update)
             for output in captured.outputs]
    for rank in range(2):
        mine = [entry for entry in shown if f"-rank{rank}-" in (entry[1] or "")]
        handle = mine[0][1]
        assert mine == [("'first'", handle, False), (f"'second {rank}'", handle, True),
                        ("'x'", f"xla_magic-rank{rank}-fixed", False), (f"'y {rank}'", f"xla_magic-rank{rank}-fixed", True)]
    assert captured.stdout.count("[rank 1]\n") == 2  # a label for each new display, none for updates


def test_matplotlib_figures_reach_the_kernel_as_images(ip):
    cell = ("import matplotlib.pyplot as plt\nplt.plot([0, rank, 1])\nplt.show()\nprint('shown')\n"
            "plt.figure()\nplt.plot([1, 2])\nprint('left open')")
    _, captured = run(ip, "--devices 2", cell)
    images = mime(captured, "image/png")
    assert len(images) == 4  # plt.show() on each rank, and each rank's open figure at the end of the cell
    assert all(image for image in images)
    rank0 = [text for text in captured.stdout.splitlines() if text.startswith("[rank 0]")]
    assert rank0 == ["[rank 0]", "[rank 0] shown", "[rank 0] left open", "[rank 0]"]


def test_a_users_mplbackend_is_kept(ip, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "agg")
    value, captured = run(ip, "--devices 1", "import matplotlib\nmatplotlib.get_backend()")
    assert value == ["agg"]


def test_a_rich_progress_bar_prints_its_final_state_not_cursor_moves(ip, monkeypatch):
    """A notebook kernel sets FORCE_COLOR: rich would redraw with cursor moves; ranks make it print once."""
    pytest.importorskip("rich")
    monkeypatch.setenv("FORCE_COLOR", "1")
    cell = ("from rich.progress import Progress\n"
            "with Progress() as bars:\n"
            "    for name in ('train', 'check'):\n"
            "        task = bars.add_task(f'{name} {rank}', total=3)\n"
            "        for _ in range(3):\n"
            "            bars.advance(task)\n")
    _, captured = run(ip, "--devices 2", cell)
    assert "\x1b[1A" not in captured.stdout and "\r" not in captured.stdout  # no cursor up, no rewrites
    for rank in range(2):
        for name in ("train", "check"):
            assert re.search(rf"\[rank {rank}\] .*{name} {rank}.*100%", captured.stdout), captured.stdout
    monkeypatch.setenv("TTY_INTERACTIVE", "1")  # the user's own setting wins
    value, _ = run(ip, "--devices 1", "import os\nos.environ['TTY_INTERACTIVE']")
    assert value == ["1"]


def test_a_ranks_widget_is_shown_as_text_with_a_note(ip):
    pytest.importorskip("ipywidgets")
    cell = "import ipywidgets\ndisplay(ipywidgets.IntSlider(value=rank))\nprint('done')"
    _, captured = run(ip, "--devices 2", cell)
    assert "[rank 1] (an ipywidgets widget, shown as text" in captured.stdout
    assert "[rank 1] done" in captured.stdout
    assert not [output for output in captured.outputs if "application/vnd.jupyter.widget-view+json" in output.data]


def test_autoreload_works_in_a_pool(ip, kernel_place, tmp_path):
    module = tmp_path / "my-code" / "mymodel.py"
    ip.run_line_magic("xla_pool", "start --devices 2")
    try:
        assert run(ip, "", "%load_ext autoreload\n%autoreload 2\nimport mymodel\nmymodel.f(0)")[0] == [100, 100]
        module.write_text("def f(x):\n    return x + 200\n")
        os.utime(module, (os.stat(module).st_atime, os.stat(module).st_mtime + 5))
        assert run(ip, "", "mymodel.f(0)")[0] == [200, 200]
    finally:
        ip.run_line_magic("xla_pool", "stop")
