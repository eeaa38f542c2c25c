"""Pools on this host, ranks kept between cells: what every pool answers (interface.py), what its ranks admit
(admission.py), a pool on this host (this_host.py) and a kept one that outlives its kernel (kept.py). Runs in the
kernel, and this_host.py in each host's engine too. The session chooses the kind, once, from ``%xla_pool start``'s
options; a pool across hosts is hosts/pool.py."""
