"""A stand-in kernel for test_hosts_kernel_death: an IPython shell that starts a pool across hosts, says READY
with its pid and its controller's, then waits to be killed. Run as: python tests/hosts_kernel.py START_LINE"""

import sys

from IPython.testing.globalipapp import start_ipython

shell = start_ipython()
shell.run_line_magic("load_ext", "xla_magic")
shell.run_line_magic("xla_pool", sys.argv[1])
assert shell.run_cell_magic("xla_spawn", "", "rank") == list(range(4))
pool = shell._xla_magic_session.pool
print("READY", pool.cluster.controller.process.pid, flush=True)
sys.stdin.read()  # until killed
