"""One request followed to its end: on this host's ranks (request.py, with what each event means in events.py,
the stop's escalation in stopping.py and its words in wording.py) or on every host's (across_hosts.py), and the
watchdog that reads where the ranks are (watch.py). Runs in the kernel, and in each host's engine."""
