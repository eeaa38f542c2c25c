"""A run followed to its end, in the foreground or the background. Runs in the kernel and in each host's engine.

``runner.py`` sends a cell (or a push, a pull, a pool's start) to a set of
ranks and ``request.py`` follows it (events.py, watch.py, stopping.py,
wording.py), writing what happens to its record (record.py, history.py)
and to the sink it was given (sink.py): the notebook's, a background run's
log (background.py, routing.py, log.py), or a host's relay. The errors a
run raises are errors.py's.
"""
