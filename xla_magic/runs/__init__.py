"""Runs that outlive their cell: background runs, their handles and their logs on disk. Runs in the kernel.

``log.py`` is the run's log (its format, its writer, and a reader that can
follow a log live from any process); ``background.py`` runs a cell in a
thread of the kernel and routes what it shows under the cell that started
it, through the log; ``magics.py`` holds ``%xla_runs`` and ``%xla_run``.
"""
