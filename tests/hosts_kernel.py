"""A stand-in kernel for test_hosts_kernel_death: an IPython shell that starts a pool across hosts, says READY
with its controller's pid and PROFILE with the cluster's directory (its engines' logs), then waits to be killed;
with BUSY, inside a cell whose every rank prints 'spinning' and spins. Run as:
python tests/hosts_kernel.py START_LINE [BUSY]"""

import sys

from IPython.testing.globalipapp import start_ipython

shell = start_ipython()
shell.run_line_magic("load_ext", "xla_magic")
shell.run_line_magic("xla_pool", sys.argv[1])
assert shell.run_cell_magic("xla_spawn", "", "rank") == list(range(4))
pool = shell._xla_magic_session.hosts
print("READY", pool.cluster.controller.process.pid, flush=True)
print("PROFILE", pool.cluster.profile_dir, flush=True)
if sys.argv[2:] == ["BUSY"]:
    shell.run_cell_magic("xla_spawn", "", "print('spinning', flush=True)\nwhile True:\n    spin = 1\n")
sys.stdin.read()  # until killed
