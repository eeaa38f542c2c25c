"""Ranks kept between cells: what every pool answers (interface.py), its policy (policy.py), and the two kinds, on
this host (this_host.py) and across hosts (across_hosts.py). Runs in the kernel, and this_host.py in each host's
engine too. The session chooses the kind, once, from ``%xla_pool start``'s options."""
