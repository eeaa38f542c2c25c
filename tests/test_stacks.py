"""What differs between the supported package stacks (scripts/stacks/), on whichever stack runs this.

`make test` runs this file on the current stack, and on Colab's pins
(IPython 7.34, ipykernel 6.17, ipywidgets 7.7) and Kaggle's torch 2.8 the
tests of what differs there (scripts/stacks/subset.txt says which).
It checks the two things that broke there: a notebook shell that is a
*subclass* of ipykernel's (as Colab's is) must get the notebook behaviour,
and importing torch_xla in the launcher must leave no helper processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from conftest import kernel_is_xla_free

HERE = Path(__file__).resolve().parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
TIMEOUT = 240


@pytest.fixture
def subclass_kernel(tmp_path, monkeypatch):
    """A real kernel (tests/subclass_kernel.py) found through a kernelspec in tmp_path."""
    spec = tmp_path / "kernels" / "subclass-shell"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(HERE / "subclass_kernel.py"), "-f", "{connection_file}"],
        "display_name": "Python 3 (ZMQInteractiveShell subclass)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    manager, client = start_new_kernel(kernel_name="subclass-shell", startup_timeout=60)
    try:
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def version(distribution: str) -> tuple[int, ...]:
    return tuple(int(part) for part in metadata.version(distribution).split(".")[:3] if part.isdigit())


def execute(client, code: str) -> tuple[dict, list[dict]]:
    """Run one cell; its reply and every iopub message it produced, in order."""
    messages: list[dict] = []
    reply = client.execute_interactive(code, timeout=TIMEOUT, output_hook=messages.append)
    return reply["content"], messages


def streams(messages: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def test_a_subclass_of_the_notebook_shell_gets_the_panel_and_live_lines(subclass_kernel):
    reply, messages = execute(subclass_kernel, "type(get_ipython()).__name__, type(get_ipython()).__mro__[1].__name__")
    assert reply["status"] == "ok"
    shown = [m["content"]["data"]["text/plain"] for m in messages if m["msg_type"] == "execute_result"]
    assert shown == ["('SubclassShell', 'ZMQInteractiveShell')"]
    assert execute(subclass_kernel, "%load_ext xla_magic")[0]["status"] == "ok"

    progress = (
        "%%xla_spawn --devices 2\nimport time\n"
        "for step in range(6):\n    print(f'\\rstep {step} of 6', end='', flush=True)\n    time.sleep(0.3)\n"
        "print()\nrank"
    )
    reply, messages = execute(subclass_kernel, progress)
    assert reply["status"] == "ok", reply
    areas = {
        m["content"]["transient"]["display_id"]: m["content"]["data"]["text/plain"]
        for m in messages if m["msg_type"] == "display_data" and m["content"].get("transient", {}).get("display_id")
    }
    assert sorted(text.split(" step")[0] for text in areas.values()) == ["[rank 0]", "[rank 1]"]
    updates = [m["content"] for m in messages if m["msg_type"] == "update_display_data"]
    assert {u["transient"]["display_id"] for u in updates} == set(areas)
    assert any("step 5 of 6" in u["data"]["text/plain"] for u in updates)
    for rank in range(2):
        assert f"[rank {rank}] step 5 of 6" in streams(messages)  # the settled line, once the line ends

    reply, messages = execute(subclass_kernel, "%xla_status")
    assert reply["status"] == "ok", reply
    bundles = [m["content"]["data"] for m in messages if m["msg_type"] == "display_data"]
    assert [WIDGET_VIEW in data for data in bundles] == [True], bundles
    assert "pip install ipywidgets" not in streams(messages)

    # The mid-cell Interrupt click needs ipykernel 7.4; below it the panel says so.
    reply, messages = execute(subclass_kernel, (
        "from xla_magic.notebook import status\npanel = status.status_panel(get_ipython()._xla_magic_session)\n"
        "print(panel.live_interrupt, status.LIVE_INTERRUPT_NEEDS in panel.message.value)"
    ))
    live = version("ipykernel") >= (7, 4)
    assert streams(messages).split() == [str(live), str(not live)]


def test_only_the_launcher_is_left_between_cells(ip, spawn):
    """torch 2.8's inductor compile workers (or any helper) must not live under the launcher."""
    seen = spawn("--devices 2", "import os\nrepr(os.environ.get('TORCH_WARM_POOL'))").value
    assert seen == [repr(os.environ.get("TORCH_WARM_POOL"))] * 2  # the switch the launcher uses stays its own
    launcher = psutil.Process(ip._xla_magic_session.host.launcher.pid)
    deadline = time.monotonic() + 20  # the run's supervisor exits just after the cell
    while launcher.children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p.pid} {' '.join(p.cmdline())[:200]}" for p in launcher.children(recursive=True)]
    assert left == []
    assert kernel_is_xla_free()


def test_the_launcher_reports_the_versions_this_stack_has(ip, spawn):
    spawn("--devices 1", "rank")
    info = ip._xla_magic_session.host.launcher.info
    assert info["torch_xla"] == metadata.version("torch_xla")
    assert info["torch"].split("+")[0] == metadata.version("torch")
    assert info["python"] == sys.executable or os.path.samefile(info["python"], sys.executable)


def test_the_compile_cache_default_on_a_tpu_follows_this_stack_s_torch_xla():
    # Kaggle's torch_xla 2.8 and Colab's 2.9 (and the current 2.9) cannot load their persistent cache on a TPU
    # (pytorch/xla#9094): there the default is off, read from the installed metadata, nothing imported.
    from xla_magic.cell import compile_cache

    installed = version("torch_xla")[:2]
    if installed not in ((2, 8), (2, 9)):
        pytest.skip(f"torch_xla {metadata.version('torch_xla')} is not one of the stacks' releases")
    assert compile_cache.installed_version() == metadata.version("torch_xla")
    default = compile_cache.resolve(None, environ={})
    assert default.job(on_cpu=False) is None and default.job(on_cpu=True) is None
    assert "pytorch/xla#9094" in default.describe(on_cpu=False)
