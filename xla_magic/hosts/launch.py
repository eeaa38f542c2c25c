"""ipyparallel launchers for a pool across hosts. Runs in the kernel (their processes: see below).

Built on ipyparallel's own launchers (``ipyparallel.cluster.launcher``), as
its docs show for custom launchers:

- :class:`HostEngineSetLauncher`: one engine per host, each started by a
  launch command template (``ssh {host}`` by default; ``ip netns exec``,
  ``gcloud compute tpus tpu-vm ssh --worker={index} --command``, ``kubectl
  exec -i``...). The engine command is appended to the template's words.
  The controller's connection info (with the cluster's key) goes to the
  engine on its stdin, so it is on no command line and in no file on the
  host, and crosses ssh as it is.
- :class:`KernelControllerLauncher`: ipyparallel's controller, in one
  process (threads), which ends when the kernel ends (``hosts.controller``).
"""

from __future__ import annotations

import os
import sys
from subprocess import PIPE, STDOUT, Popen

import psutil
from ipyparallel.cluster.launcher import LocalControllerLauncher, LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Integer, List, Unicode, default

from xla_magic.hosts.discovery import DEFAULT_TEMPLATE, template_words


class HostEngineLauncher(LocalEngineLauncher):
    """One engine on one host, through the launch template."""

    host = Unicode()
    index = Integer()
    template = Unicode(DEFAULT_TEMPLATE)
    python = Unicode(sys.executable)

    def find_args(self) -> list[str]:
        engine = [self.python, "-m", "xla_magic.hosts.engine", "--host-index", str(self.index)]
        return template_words(self.template, self.host, self.index) + engine + self.engine_args

    def start(self) -> None:
        """As LocalProcessLauncher.start, but the connection info goes on stdin, not in the environment."""
        env = {**os.environ, **self.get_env()}
        connection = env.pop("IPP_CONNECTION_INFO")
        with open(self.output_file, "ab") as log:
            process = self._popen_process = Popen(
                self.args, stdout=log.fileno(), stderr=STDOUT, stdin=PIPE, env=env, cwd=self.work_dir,
                start_new_session=True,
            )
        assert process.stdin is not None
        try:
            process.stdin.write(connection.encode() + b"\n")
            process.stdin.close()
        except BrokenPipeError:
            pass  # the launch command failed at once: its exit is noticed as the engine's
        self.pid = process.pid
        self.process = psutil.Process(process.pid)
        self.notify_start(process.pid)
        self._start_waiting()


class HostEngineSetLauncher(LocalEngineSetLauncher):
    """One :class:`HostEngineLauncher` per host, in host order."""

    launcher_class = HostEngineLauncher
    hosts = List(Unicode())
    template = Unicode(DEFAULT_TEMPLATE)
    python = Unicode(sys.executable)

    def start(self, n: int) -> list:
        self.n = len(self.hosts)
        started = []
        for index, host in enumerate(self.hosts):
            engine = self.launchers[str(index)] = self.launcher_class(
                work_dir=self.work_dir, parent=self, log=self.log, profile_dir=self.profile_dir,
                cluster_id=self.cluster_id, environment=self.environment, identifier=str(index),
                output_file=os.path.join(self.profile_dir, "log", f"engine-{index}-{host}.log"),
                host=host, index=index, template=self.template, python=self.python,
            )
            engine.engine_args = list(self.engine_args)
            engine.on_stop(self._notice_engine_stopped)
            started.append(engine.start())
        self.notify_start(started)
        return started


class KernelControllerLauncher(LocalControllerLauncher):
    """ipyparallel's controller in one process (no scheduler subprocesses) that ends with the kernel."""

    @default("controller_cmd")
    def _controller_cmd(self) -> list[str]:
        return [sys.executable, "-m", "xla_magic.hosts.controller", "--parent-pid", str(os.getpid())]

