"""The magics: parse arguments, hand over to the session, show the result. Runs in the kernel."""

from __future__ import annotations

import argparse
import keyword
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from xla_magic.notebook import memory_view, profile_view, troubleshooting, status, xla_report
from xla_magic.notebook.options import (compile_cache_argument, device_count, hang_after_argument, keep_seconds,
                                     parse_argstring, rank_number, seconds, spmd_arguments, spmd_options,
                                     xla_report_argument)
from xla_magic.notebook.syntax_error import CellSyntaxError, syntax_error_in_cell
from xla_magic.runs.errors import RankError, RunInterrupted
from xla_magic.hosts.discovery import DEFAULT_TEMPLATE, parse_hosts
from xla_magic.cell.payload import transform
from xla_magic.cell.options import PoolOptions
from xla_magic.session import Session
from xla_magic.wire import kept as kept_names


INTERRUPTED = ("the last cell was interrupted, not failed, so no rank kept a frame to debug: %xla_stacks shows where "
               "each rank was (--locals with its values); to stop a rank at a line, put breakpoint() there and run "
               "the cell again")


def _raised_here(tb: Any) -> bool:
    """Whether an error was raised by this package in the kernel (a refused magic, a cell that does not
    compile): IPython's %debug would open our frames, not the user's."""
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").startswith("xla_magic."):
            return True
        tb = tb.tb_next
    return False


@magics_class
class XlaMagics(Magics):
    def __init__(self, shell: Any, session: Session) -> None:
        super().__init__(shell)
        self.session = session
        # IPython's own line %debug, which ours hands everything to but a failed %%xla_spawn cell (%%debug stays its own)
        self.ipython_debug = shell.find_line_magic("debug") if shell else None

    @magic_arguments()
    @argument(
        "-n", "--devices", type=device_count, default=None,
        help="number of devices, one rank each, or all driven by the one process with --spmd (default: every "
        "TPU device, or 8 in the CPU simulation)",
    )
    @argument(
        "-b", "--backend", default="auto", choices=("auto", "tpu", "cpu"),
        help="tpu: torch_xla's spawn on TPU devices; cpu: simulated devices on this "
        "machine's CPU; auto (default): tpu where a TPU is found",
    )
    @argument("-o", "--out", metavar="NAME",
              help="also store the list of results in this variable (with --bg: the run's handle)")
    @argument(
        "-t", "--timeout", type=seconds, default=None, metavar="SECONDS",
        help="stop the ranks (SIGINT, SIGTERM, SIGKILL) if the cell runs longer",
    )
    @argument(
        "--fresh", action="store_true",
        help="while a pool runs, run this cell in newly spawned ranks instead of the pool's",
    )
    @argument(
        "--bg", action="store_true",
        help="run the cell in the background, in the pool: the cell returns at once with the run's handle (-o NAME "
        "stores it) while the kernel runs other cells; its lines still come under this cell, and are kept on disk "
        "(%%xla_runs, %%xla_run show|wait|stop ID; see the docs' Long runs)",
    )
    @argument(
        "--after", action="store_true",
        help="while a background run holds the pool: wait for it to end, then run this cell (without it the cell is "
        "refused at once)",
    )
    @spmd_arguments
    @xla_report_argument
    @hang_after_argument
    @compile_cache_argument
    @argument(
        "--profile", action="store_true",
        help="record the cell on every rank with torch_xla's profiler and show a timeline of where each rank's time "
        "went (compiles, executions, transfers, your xp.Trace annotations); %%xla_profile shows it again",
    )
    @argument(
        "--metrics", choices=("mean", "ranks"), default="mean",
        help="what the chart of the values the cell log()s draws: the ranks' mean (default) or every rank's line",
    )
    @argument(
        "--metrics-dir", default=None, metavar="DIR",
        help="also write what the cell log()s as TensorBoard event files, in DIR/run-N/rank-R (for %%tensorboard "
        "--logdir DIR); needs the tensorboard package where the ranks run",
    )
    @cell_magic
    def xla_spawn(self, line: str, cell: str) -> Any:
        """Run this cell on every XLA device, one rank per device.

        Each rank sees the notebook names the cell reads (shipped with
        cloudpickle), plus ``rank``, ``world_size``, ``device`` (its XLA
        device) and ``strategy`` (Lightning XLAStrategy's collectives). Output
        is shown live, each line tagged ``[rank N]``. The cell's value is the
        list of every rank's last expression, indexed by rank. The kernel never
        starts an XLA runtime, so the next cell can spawn again.

        The cell is a notebook cell on every rank: it runs in the kernel's
        working directory with the kernel's ``sys.path``; line magics, ``!``
        commands and ``get_ipython()`` work (each rank has an IPython shell);
        ``display()`` and matplotlib figures appear in the cell, labelled
        with the rank. ``%pip`` and xla_magic's own magics are refused there.

        While a pool runs (``%xla_pool start``) the cell runs in the pool's
        ranks, whose namespaces persist between cells; ``--fresh`` spawns.

        With ``--spmd`` the cell runs once, in one process that drives every
        device with torch_xla's SPMD mode on: it sees ``device``, ``mesh`` (a
        ``torch_xla.distributed.spmd.Mesh``, also the global mesh),
        ``world_size`` (the device count) and ``show_sharding(tensor)``
        (draws which device holds which block). Output is tagged ``[spmd]``;
        the value is one value, XLA tensors (sharded or not) whole on the CPU.
        """
        args = parse_argstring(self.xla_spawn, line)
        if args.out is not None:
            _check_name(args.out, "--out takes a variable name")
        try:
            results = self.session.run_cell(
                cell, args.devices, args.backend, args.timeout, args.fresh,
                self.shell.user_ns, self.shell.user_ns_hidden, spmd=spmd_options(args), xla_report=args.xla_report, profile=args.profile,
                hang_after=args.hang_after, compile_cache=args.compile_cache, after=args.after,
                background=self.shell if args.bg else None, metrics=args.metrics, metrics_dir=args.metrics_dir,
            )
        except SyntaxError as exc:  # the cell's own mistake, found before anything ran: shown as a plain cell's
            shown = syntax_error_in_cell(exc.with_traceback(None), transform(cell), self.shell, sys._getframe())
            raise shown from shown.error
        if args.out:
            self.shell.user_ns[args.out] = results
        if args.bg:
            return results  # the run's handle
        # Like a cell ending in print(...): nothing worth showing.
        if not self.session.one_value and results is not None and all(value is None for value in results):
            return None
        return results

    @magic_arguments()
    @argument("--text", action="store_true", help="print the report as text, even in a notebook")
    @line_magic
    def xla_report(self, line: str) -> None:
        """Show what XLA did in the last %%xla_spawn cell, rank by rank.

        Compilations (how many, how long, the cell line that caused each and
        why: the cause from torch_xla's compilation analysis, the graph's
        hash, its inputs), executions, compilations served from the cache,
        device-to-host transfers and the ops that fell back to the CPU. A
        table in a notebook, text elsewhere. ``--xla-report full`` on
        ``%%xla_spawn`` or ``%xla_pool start`` shows it after every cell.
        """
        args = parse_argstring(self.xla_report, line)
        record = self.session.last_cell
        if record is None:
            raise UsageError("no %%xla_spawn cell has run yet: run one, then %xla_report shows what XLA did in it")
        xla_report.show(xla_report.Report(record), text=args.text)

    @magic_arguments()
    @argument("--text", action="store_true", help="print the summary as text, even in a notebook")
    @line_magic
    def xla_profile(self, line: str) -> None:
        """Show the last ``%%xla_spawn --profile`` cell's profile again: the timeline and its tables.

        One lane per rank, drawn from each rank's trace (torch_xla's profiler),
        with where the trace files are and how to open them in XProf or Perfetto.
        """
        args = parse_argstring(self.xla_profile, line)
        record = self.session.last_profiled
        if record is None:
            raise UsageError("no %%xla_spawn --profile cell has run yet: run one, then %xla_profile shows it again")
        profile_view.show(record, text=args.text)

    @magic_arguments()
    @argument("entry", nargs="?", help="the entry an error message names (%%xla_help ID says more.); none: list them")
    @line_magic
    def xla_help(self, line: str) -> None:
        """Show a troubleshooting entry here in the notebook: what an error means and what to do.

        An error message that has an entry ends with ``%xla_help ID says
        more.``; run that line to read the entry (the text of the
        documentation's Troubleshooting page). ``%xla_help`` alone lists every
        entry with its message.
        """
        args = parse_argstring(self.xla_help, line)
        known = troubleshooting.entries()
        if not known:
            raise UsageError("this installation has no troubleshooting page (xla_magic/troubleshooting.md): "
                             "reinstall xla_magic from its wheel, or read docs/troubleshooting.md in its repository")
        if args.entry is None:
            print("\n".join(f"%xla_help {entry.id:<32} {entry.message}" for entry in known.values()))
            return
        entry = known.get(args.entry.strip().lstrip("#"))
        if entry is None:
            raise UsageError(f"no troubleshooting entry {args.entry!r}: %xla_help alone lists them")
        display({"text/plain": entry.text(), "text/markdown": entry.markdown()}, raw=True)

    @magic_arguments()
    @argument("-r", "--rank", type=rank_number, default=None, help="only this rank's stack")
    @argument("--all", action="store_true", help="keep the library frames (and every thread of the rank) unfolded")
    @argument("--locals", action="store_true",
              help="under each cell frame its local names with short values (tensors as dtype and shape)")
    @line_magic
    def xla_stacks(self, line: str) -> None:
        """Show where every rank was when the last cell was stopped or stuck, and where a pool's ranks are now.

        The last stuck or stopped cell's stacks are those taken at the
        watchdog's line, the interrupt, the timeout or fail-fast. In a pool
        this also asks every rank where it is now, threads a cell left
        running included. Ranks with the same stack show as one block
        (``ranks 0-6``), the odd ones out first; ``--all`` keeps the library
        frames. See the docs' "Stuck cells".
        """
        args = parse_argstring(self.xla_stacks, line)
        for text in self.session.stacks(args.rank, args.all, args.locals):
            print(text)

    @magic_arguments()
    @argument("-r", "--rank", type=rank_number, default=None,
              help="this rank's holders (default: rank 0's, and every rank's totals)")
    @line_magic
    def xla_memory(self, line: str) -> None:
        """Show what holds a pool's device memory, named: variables, module parameters, gradients, optimizer state.

        Each rank's live XLA tensors by size (a notebook variable, a module's
        ``model.layers.3.weight``, ``opt.state[...].exp_avg``, or
        "unnamed" with the cell and sync line that made it), totals by kind,
        the device's used, limit and peak, and the largest compiled graph's
        own needs. Read without a sync or a compile, between cells or while
        one runs (across hosts: between cells). See the docs' "Device memory".
        """
        args = parse_argstring(self.xla_memory, line)
        for text in memory_view.report(self.session.current_pool(), self.session.history, args.rank):
            print(text)

    @magic_arguments()
    @argument("-r", "--rank", type=rank_number, default=None, help="this failed rank's frame (default: the first failure's)")
    @line_magic
    def xla_debug(self, line: str) -> None:
        """Open pdb in the frame where the last failed %%xla_spawn cell raised, on the rank that failed first.

        ``%debug`` does the same after such a cell. The rank's locals, ``up``
        and ``down`` through the cell's frames (at the cell's line numbers),
        ``p``, ``pp``, ``l``; ``q`` leaves. A pool's rank keeps the frames
        until the next cell; a one-shot cell's failed rank is kept for it
        until the next cell, or until the debugger is left. See the docs'
        "Debugging a rank".
        """
        args = parse_argstring(self.xla_debug, line)
        self.session.debug(args.rank)

    @line_magic
    def debug(self, line: str = "") -> Any:
        """IPython's %debug; after a failed %%xla_spawn cell, pdb in the failing rank's frame (see %xla_debug)."""
        error = getattr(sys, "last_value", None)
        if not line.strip():
            if isinstance(error, RankError):
                self.session.debug(None, error)
                return None
            if isinstance(error, RunInterrupted):  # IPython's would open our request's frame in the kernel
                raise UsageError(INTERRUPTED)
            if isinstance(error, (UsageError, CellSyntaxError)) and (
                    self.session.post_mortem is not None or _raised_here(getattr(sys, "last_traceback", None))):
                self.session.debug(None)  # a mistyped magic since (no traceback to debug): still the failed cell's
                return None
        if self.ipython_debug is None:
            raise UsageError("IPython's %debug is not there to hand this to")
        return self.ipython_debug(line)

    @magic_arguments()
    @argument("--text", action="store_true", help="print the facts as text, even in a notebook")
    @line_magic
    def xla_status(self, line: str) -> None:
        """Show devices, the kernel's XLA state, the launcher, the pool and the ranks.

        In a notebook this is a live ipywidgets panel: the ranks of the running
        (or last) cell with their state, elapsed time, lines, last line,
        device memory, the processes each keeps (a pool's), what XLA did in
        them (once the cell ended) and where each is (what its stack sampler
        last said, updated while a stuck cell runs), the recent runs with their XLA summary, and
        buttons to interrupt the run and stop the pool. Elsewhere it prints the
        same facts as text.
        """
        args = parse_argstring(self.xla_status, line)
        status.show_status(self.session, self.shell, text=args.text)

    @magic_arguments()
    @argument(
        "action", nargs="?", default="status",
        choices=("start", "stop", "restart", "push", "pull", "status", "attach", "list"),
        help="start, stop or restart the pool, push or pull names, attach to a kept pool, list kept pools, or "
        "(default) show its state",
    )
    @argument("names", nargs="*", help="push: the notebook names to send; pull: the one name to fetch; attach and "
              "stop: a kept pool's name")
    @argument(
        "-n", "--devices", type=device_count, default=None,
        help="start/restart: number of ranks (default: every TPU device, or 8 in the CPU simulation)",
    )
    @argument(
        "-b", "--backend", default=None, choices=("auto", "tpu", "cpu"),
        help="start/restart: tpu, cpu or auto (default: tpu where a TPU is found)",
    )
    @argument("-r", "--rank", type=rank_number, default=None, help="pull: take the value of this rank only")
    @argument(
        "--hosts", metavar="HOSTS",
        help="start: a pool across several hosts, one ipyparallel engine each: addresses separated by commas "
        "(the first holds the collectives' store), or 'slice' for this TPU slice's workers; --devices is per host",
    )
    @argument(
        "--launch", metavar="TEMPLATE",
        help="with --hosts: the command that runs the engine on a host, with {host} and {index} "
        f"(default: '{DEFAULT_TEMPLATE}'; e.g. 'ip netns exec ns{{index}}', "
        "'kubectl exec -i worker-{index} --')",
    )
    @argument(
        "--keep", nargs="?", const=kept_names.DEFAULT_NAME, default=None, metavar="NAME",
        help=f"start: a kept pool, named NAME (default {kept_names.DEFAULT_NAME}), whose ranks outlive this kernel "
        f"(a restart, a crash, a closed notebook): a new kernel's %%xla_pool attach NAME finds its names and compiled "
        f"graphs. %%xla_pool stop NAME ends it",
    )
    @argument(
        "--keep-idle", type=keep_seconds, default=None, metavar="SECONDS",
        help=f"with --keep: a kept pool with no kernel attached and no cell running ends itself after this long "
        f"(default {kept_names.DEFAULT_IDLE:g} s, two hours), freeing its devices",
    )
    @argument("--steal", action="store_true",
              help="attach: take a kept pool over from the kernel attached to it (that kernel's next pool cell is "
              "refused)")
    @spmd_arguments
    @xla_report_argument
    @hang_after_argument
    @compile_cache_argument
    @line_magic
    def xla_pool(self, line: str) -> None:
        """Keep ranks alive between %%xla_spawn cells: a persistent pool.

        ``%xla_pool start [--devices N] [--backend B]`` starts the ranks once;
        later ``%%xla_spawn`` cells run in them, and each rank keeps its own
        namespace, device and compiled graphs between cells (kernel variables a
        cell reads are still shipped, when they changed; large tensors and
        arrays go once through shared memory and stay there while they are
        the same object with the same bytes). ``%xla_pool push
        NAME...`` sends notebook values into every rank's namespace; ``%xla_pool
        pull NAME [--rank R]`` stores the ranks' values (a list by rank, or rank
        R's) in the notebook variable NAME. ``%xla_pool restart`` replaces the
        ranks, ``%xla_pool stop`` ends them, and ``%xla_pool`` shows the state.

        ``%xla_pool start --spmd [--mesh 4,2] [--axes data,model]`` keeps one
        SPMD process instead (see ``%%xla_spawn --spmd``): its namespace,
        sharded model and optimiser and compiled graphs stay between cells,
        and pull gives its one value. ``restart`` keeps an SPMD pool SPMD.

        ``%xla_pool start --hosts A,B [--devices N] [--launch TEMPLATE]``
        spans several hosts as one world: an ipyparallel engine on each host
        (started by the launch template, see ``--launch`` for its default) runs
        that host's launcher and N ranks; cells then see ``rank`` (global),
        ``world_size`` (every host), ``local_rank`` and ``host``, output is
        tagged ``[hH rN]``, and the value lists every global rank's result.
        The documentation's Several hosts page tells more.

        ``%xla_pool start --keep [NAME]`` keeps the pool when the kernel goes
        (restart, crash): ``%xla_pool attach NAME`` in a new kernel drives it
        again, ``%xla_pool list`` shows kept pools, ``%xla_pool stop NAME``
        ends one, and one with no kernel attached ends itself after
        ``--keep-idle`` seconds.
        """
        args = parse_argstring(self.xla_pool, line)
        _check_pool_arguments(args)
        if args.action in ("start", "restart"):
            options = PoolOptions(devices=args.devices, backend=args.backend,
                                  spmd=spmd_options(args), xla_report=args.xla_report,
                                  hosts=parse_hosts(args.hosts) if args.hosts is not None else None,
                                  template=_unquoted(args.launch) if args.launch is not None else None,
                                  hang_after=args.hang_after, compile_cache=args.compile_cache,
                                  keep=args.keep, keep_idle=args.keep_idle)
            if args.action == "start":
                self.session.start_pool(options)
            else:
                self.session.restart_pool(options)
        elif args.action == "stop" and args.names:
            self.session.stop_kept(args.names[0])
            print(f"kept pool {args.names[0]} stopped")
        elif args.action == "stop":
            print("pool stopped" if self.session.stop_pool() else "no pool is running")
        elif args.action == "attach":
            self.session.attach_pool(args.names[0] if args.names else kept_names.DEFAULT_NAME, args.steal)
        elif args.action == "list":
            print(self.session.list_kept())
        elif args.action == "push":
            self.session.push(args.names, self.shell.user_ns)
        elif args.action == "pull":
            self.shell.user_ns[args.names[0]] = self.session.pull(args.names[0], args.rank)
        else:
            print(self.session.describe_pool())


def _check_name(name: str, what: str) -> None:
    """A name code can use: an identifier, not a keyword (``for``, ``None``, ``True``...)."""
    if not name.isidentifier():
        raise UsageError(f"{what}, not {name!r}")
    if keyword.iskeyword(name):
        raise UsageError(f"{what}, not the keyword {name!r}, which no code could use as a name; pick another, like {name}_")


def _unquoted(text: str) -> str:
    """A value given in quotes, without them (IPython's argument split keeps them on Linux)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _check_pool_arguments(args: argparse.Namespace) -> None:
    if args.action in ("push", "pull"):
        if not args.names:
            raise UsageError(f"%xla_pool {args.action} needs a name, like %xla_pool {args.action} model")
        for name in args.names:
            _check_name(name, f"%xla_pool {args.action} takes variable names")
        if args.action == "pull" and len(args.names) > 1:
            raise UsageError("%xla_pool pull takes one name at a time, like %xla_pool pull loss --rank 0")
    elif args.action in ("attach", "stop") and args.names:
        if len(args.names) > 1:
            raise UsageError(f"%xla_pool {args.action} takes one kept pool's name, like %xla_pool {args.action} model")
    elif args.names:
        raise UsageError(f"%xla_pool {args.action} takes no names (only push and pull do, and attach and stop take "
                         f"a kept pool's)")
    if (args.keep is not None or args.keep_idle is not None) and args.action not in ("start", "restart"):
        raise UsageError("--keep and --keep-idle go with %xla_pool start (and restart) only; a kept pool is "
                         "attached with %xla_pool attach NAME")
    if args.keep_idle is not None and args.keep is None and args.action == "start":
        raise UsageError("--keep-idle is for a kept pool: add --keep NAME")
    if args.steal and args.action != "attach":
        raise UsageError("--steal goes with %xla_pool attach only")
    if (args.hosts is not None or args.launch is not None) and args.action not in ("start", "restart"):
        raise UsageError("--hosts and --launch go with %xla_pool start and restart only")
    if args.launch is not None and args.hosts is None and args.action == "start":
        raise UsageError("--launch says how to start an engine on each host: give the hosts too, like "
                         "%xla_pool start --hosts 10.0.0.2,10.0.0.3 --launch 'ssh {host}'")
    if args.xla_report is not None and args.action not in ("start", "restart"):
        raise UsageError("--xla-report goes with %xla_pool start and restart only (or with %%xla_spawn, for one cell)")
    if args.compile_cache is not None and args.action not in ("start", "restart"):
        raise UsageError("--compile-cache goes with %xla_pool start and restart only (or with %%xla_spawn, for "
                         "new ranks)")
    if args.rank is not None and args.action != "pull":
        raise UsageError("--rank goes with %xla_pool pull only")
    if (args.devices is not None or args.backend is not None) and args.action not in ("start", "restart"):
        raise UsageError("--devices and --backend go with %xla_pool start and restart only")
    if (args.spmd or args.mesh is not None or args.axes is not None) and args.action not in ("start", "restart"):
        raise UsageError("--spmd, --mesh and --axes go with %xla_pool start and restart only")
