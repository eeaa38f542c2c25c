"""``%xla_runs``, ``%xla_run``, ``%xla_metrics``, ``%xla_checkpoints``: the runs, listed, acted on, what they logged and saved. Runs in the kernel."""

from __future__ import annotations

import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from xla_magic.notebook import checkpoints_view, metrics_view
from xla_magic.runs.background import first_line


@magics_class
class RunMagics(Magics):
    def __init__(self, shell: Any, session: Any) -> None:
        super().__init__(shell)
        self.session = session

    @magic_arguments()
    @argument("--clear", action="store_true",
              help="forget the runs that ended and remove their logs (a run still going stays)")
    @line_magic
    def xla_runs(self, line: str) -> None:
        """List this session's background runs (``%%xla_spawn --bg``): id, cell, state, time, last checkpoint, pool.

        Each run's output is kept on disk as it arrives (the last 50 runs'),
        so ``%xla_run show ID`` replays it, in order, and then follows it
        live; ``--clear`` forgets the runs that ended and removes their logs.
        """
        args = parse_argstring(self.xla_runs, line)
        runs = self.session.background
        if args.clear:
            gone = runs.clear()
            print(f"{gone} ended run{'s' if gone != 1 else ''} and {'their logs' if gone != 1 else 'its log'} removed"
                  + (f"; {len(runs.living())} still running" if runs.living() else ""))
            return
        if not runs.runs:
            print("no background run in this session: %%xla_spawn --bg starts one")
            return
        rows = [("id", "cell", "state", "time", "last checkpoint", "pool")]
        for run in sorted(runs.runs.values(), key=lambda run: run.id):
            rows.append((str(run.id), first_line(run.cell), run.state, f"{run.seconds:.1f} s",
                         checkpoints_view.run_text(run.record), run.pool_text))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5])

    @magic_arguments()
    @argument("action", choices=("show", "wait", "stop"),
              help="show: replay the run's output, then follow it live; wait: until it ends (its value, or its "
              "error); stop: as the stop button (a pool keeps its ranks)")
    @argument("id", nargs="?", help="the run's id, as %%xla_runs lists it (show: default the last run)")
    @line_magic
    def xla_run(self, line: str) -> Any:
        """Act on one background run: ``%xla_run show|wait|stop ID``.

        ``show`` replays every line the run showed so far, once and in
        order, from its log on disk, then follows it live until it ends (a
        browser closed meanwhile loses nothing); without an ID, the last run.
        ``wait`` waits for it to end and gives its value (its error is
        raised); ``stop`` stops it as the stop button would, and a pool keeps
        its ranks. An interrupt stops a show or a wait, never the run. A rank
        waiting for ``input()`` is asked in the cell that shows or waits.
        """
        args = parse_argstring(self.xla_run, line)
        if args.id is None and args.action != "show":
            raise UsageError(f"%xla_run {args.action} needs the run's id, like %xla_run {args.action} 3 "
                             f"(%xla_runs lists them)")
        run = self.session.background.get(args.id)
        if args.action == "show":
            run.show()
            return None
        if args.action == "stop":
            began = time.monotonic()
            run.stop()
            print(f"run {run.id} stopped in {time.monotonic() - began:.1f} s")
            return None
        return run.wait()

    @magic_arguments()
    @argument("run", nargs="?", type=int, default=None,
              help="the run whose values to return (its number, as %%xla_status lists it); default: the last cell's")
    @line_magic
    def xla_metrics(self, line: str) -> Any:
        """The values a %%xla_spawn cell's ranks logged with ``log(...)``: a pandas DataFrame, or a dict of lists.

        Columns: run, rank, step, name, value, time (the rank's clock when it
        logged). A dict of those lists where pandas is not installed.
        """
        args = parse_argstring(self.xla_metrics, line)
        if args.run is None:
            record = self.session.last_cell
            if record is None:
                raise UsageError("no %%xla_spawn cell has run yet: run one that calls log(...), then %xla_metrics")
        else:
            record = next((r for r in self.session.history if r.run_id == args.run), None)
            if record is None:
                kept = ", ".join(str(r.run_id) for r in self.session.history) or "none"
                raise UsageError(f"no run {args.run} is kept (the recent runs kept: {kept}); %xla_status lists them")
        return metrics_view.table([record])

    @magic_arguments()
    @argument("directory", nargs="?", default=None,
              help="the checkpoints' DIR, as the cell's checkpoints(DIR) names it (default: where the last run "
              "that completed one wrote)")
    @line_magic
    def xla_checkpoints(self, line: str) -> None:
        """List the checkpoints in DIR: step, time, size, complete or not, the run that wrote them.

        A cell's ``checkpoints(DIR, every=..., keep=...)`` writes them (see
        the docs' "Long runs"); ``ckpt.restore(...)`` takes the last complete
        one, and a partial one (a write cut short) is never loaded. Read from
        the manifests on disk, so a new session lists what an old one saved.
        """
        args = parse_argstring(self.xla_checkpoints, line)
        directory = args.directory or checkpoints_view.last_directory(self.session.history)
        if directory is None:
            raise UsageError("%xla_checkpoints DIR: name the directory a cell's checkpoints(DIR) writes to (no run "
                             "of this session has completed a checkpoint yet)")
        try:
            found = checkpoints_view.entries(directory)
        except ImportError as exc:
            raise UsageError(str(exc)) from None
        print(checkpoints_view.table(directory, found))
