"""One host's part of a pool across several hosts. Runs in that host's ipyparallel engine (XLA-free).

The kernel calls these functions on every engine at once (``DirectView.apply``).
Each host runs this package's own single-host machinery, a
:class:`~xla_magic.session.Session` with its launcher and pool ranks, told
which part of the world it is (global rank offset, world size, the TCP
store on host 0). Its output goes to the engine's stdout, tagged ``[hH rN]``,
which ipyparallel streams to the kernel; every call answers with a plain
outcome dict, so that a failure, an interrupt or a timeout on this host
reaches the kernel as facts, not as a folded remote traceback.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
from typing import Any

from IPython.core.error import UsageError

from xla_magic.display import RankError, RunInterrupted
from xla_magic.session import Session

_session: Session | None = None


def identify() -> dict[str, Any]:
    """Which host this engine is (its index as the kernel gave it), and its pids."""
    return {"index": int(os.environ.get("XLA_MAGIC_HOST_INDEX", "-1")), "hostname": socket.gethostname(),
            "pid": os.getpid()}


def free_port(address: str) -> int:
    """A port free now on ``address`` (host 0's, for the world's TCP store)."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def ranks_here(devices: int | None, backend: str) -> dict[str, Any]:
    """How many ranks this host would run for ``--devices`` / ``--backend`` (its own devices decide)."""
    from xla_magic.session import plan

    return _outcome(lambda: {"ranks": plan(backend, devices, "%xla_pool start --hosts").ranks,
                             "backend": plan(backend, devices, "%xla_pool start --hosts").backend})


def start(world: dict[str, Any], devices: int, backend: str) -> dict[str, Any]:
    """Start this host's pool ranks as the ``world`` part the kernel says."""
    global _session
    stop()
    _session = Session()
    _session.world = world
    atexit.register(stop)
    return _outcome(lambda: _session.start_pool(devices, backend) and None)


def run_cell(source: str, names: bytes, timeout: float | None, kernel_place: dict[str, Any]) -> dict[str, Any]:
    """A cell in this host's pool; ``names`` are the kernel's values it reads, pickled once by the kernel.

    The cell runs in the kernel's place (``xla_magic.place``), not the engine's: its ranks get it when it
    changed since they last did, as on one host."""
    import cloudpickle

    session = _require()
    session.kernel_place = kernel_place
    return _outcome(lambda: session.run_cell(source, None, "auto", timeout, False, cloudpickle.loads(names), {}))


def push(names: bytes) -> dict[str, Any]:
    import cloudpickle

    def push_all() -> None:
        values = cloudpickle.loads(names)
        _require().push(list(values), values)

    return _outcome(push_all)


def pull(name: str) -> dict[str, Any]:
    return _outcome(lambda: _require().pull(name, None))


def status() -> dict[str, Any]:
    """The host's engine, launcher and ranks, for %xla_status."""
    session = _session
    facts: dict[str, Any] = {**identify(), "launcher": None, "pool": None,
                             "xla_free": "torch_xla" not in sys.modules and "_XLAC" not in sys.modules}
    if session is not None:
        if session.launcher is not None:
            facts["launcher"] = {"pid": session.launcher.pid, "alive": session.launcher.alive()}
        pool = session.current_pool()
        if pool is not None:
            facts["pool"] = {"state": pool.state, "problem": pool.problem, "pids": dict(pool.pids),
                             "describe": pool.describe()}
    return facts


def stop() -> None:
    """End this host's ranks and launcher, and remove their files."""
    global _session
    session, _session = _session, None
    if session is not None:
        session.close()


def _require() -> Session:
    if _session is None:
        raise RuntimeError("this host's pool was not started (the kernel starts it with %xla_pool start --hosts)")
    return _session


_running = False  # whether a call is in progress: only then does SIGINT (the kernel's interrupt) stop it


def _interrupt(signum: int, frame: Any) -> None:
    # A SIGINT meant for a call that has just ended must not hit what the engine does next.
    if _running:
        raise KeyboardInterrupt


def _outcome(call: Any) -> dict[str, Any]:
    """Run ``call``; what came of it, as plain data: ok (and the value), failed, interrupted or refused.

    ipykernel restores its own SIGINT handler (which ignores it) once the call returns."""
    global _running
    _running = True
    signal.signal(signal.SIGINT, _interrupt)
    try:
        value = call()
    except RankError as exc:
        failures = [dict(rank=f.rank, type=f.type, message=f.message, traceback=f.traceback, exit_code=f.exit_code)
                    for f in exc.failures]
        return {"outcome": "failed", "summary": exc.summary, "failures": failures, "results": exc.results,
                "broken": _broken()}
    except RunInterrupted as exc:
        return {"outcome": "interrupted", "message": str(exc), "results": exc.results, "broken": _broken()}
    except KeyboardInterrupt:
        return {"outcome": "interrupted", "message": "interrupted", "results": {}, "broken": _broken()}
    except UsageError as exc:
        return {"outcome": "refused", "message": str(exc), "broken": _broken()}
    finally:
        _running = False
        sys.stdout.flush()
        sys.stderr.flush()
    return {"outcome": "ok", "value": value}


def _broken() -> str | None:
    pool = _session.current_pool() if _session is not None else None
    return pool.problem if pool is not None and pool.state == "broken" else None
