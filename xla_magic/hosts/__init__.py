"""Several hosts: a multi-host slice driven as one world through ipyparallel engines. Runs in the kernel and in each host's engine.

Kernel side: ``hosts.pool`` (the cluster, its engines and the requests that
cross them), ``hosts.discovery`` (which hosts). Engine side: ``hosts.engine``
(the engine's process entry) and ``hosts.on_host`` (each host's own
single-host session). ``hosts.simulated`` makes hosts out of network
namespaces for tests. Nothing here imports torch_xla.
"""
