"""The magics' options: their types (device counts, seconds, ranks), the option groups shared between magics, and
IPython's argument parse with a hint for a misspelt option. Runs in the kernel."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument
from IPython.core.magic_arguments import parse_argstring as _parse_argstring

from xla_magic.cell import compile_cache
from xla_magic.notebook import xla_report
from xla_magic.runs.watch import HANG_AFTER
from xla_magic.cell.sharding import SpmdOptions


def parse_argstring(magic: Any, line: str) -> argparse.Namespace:
    """IPython's parse of a magic's arguments; an option unknown only by its case or an underscore, or misspelt
    (``--Compile-Cache``, ``--compile_cache``), gets the option it must be in the UsageError."""
    try:
        return _parse_argstring(magic, line)
    except UsageError as exc:
        hint = _option_hint(magic.parser, str(exc))
        if hint is None:
            raise
        raise UsageError(f"{exc}. {hint}") from exc


def _option_hint(parser: argparse.ArgumentParser, message: str) -> str | None:
    if not message.startswith("unrecognized arguments:"):
        return None
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    for word in message.partition(":")[2].split():
        if not word.startswith("-"):
            continue
        given = word.split("=")[0]
        written = "--" + given.lstrip("-").lower().replace("_", "-")
        if written in known:
            return f"Options are lower case, with dashes: {written}"
        close = difflib.get_close_matches(written, known, n=1)
        if close:
            return f"Did you mean {close[0]}?"
    return None


def _number(text: str, kind: type, takes: str, fits: Callable[[Any], bool], refused: str) -> Any:
    """An option's number: ``text`` as ``kind`` (int or float). Not one: "TAKES, not 'TEXT'"; one that ``fits``
    refuses: ``refused``, its ``{text}`` and ``{value}`` filled in."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{takes}, not {text!r}") from None
    if not fits(value):
        raise argparse.ArgumentTypeError(refused.format(text=text, value=value))
    return value


def device_count(text: str) -> int:
    return _number(text, int, "--devices takes a whole number of devices, like --devices 8", lambda n: n >= 1,
                   "--devices must be at least 1, not {value}")


def seconds(text: str) -> float:
    return _number(text, float, "--timeout takes seconds, like --timeout 60", lambda n: n > 0,
                   "--timeout must be more than 0 seconds, not {text}")


def rank_number(text: str) -> int:
    return _number(text, int, "--rank takes a rank's number, like --rank 1", lambda n: n >= 0,
                   "--rank takes a rank's number, 0 or more, not {value}")


def hang_seconds(text: str) -> float:
    return _number(text, float, "--hang-after takes seconds, like --hang-after 120", lambda n: n > 0,
                   f"--hang-after must be more than 0 seconds, not {{text}}; leave it out for the default "
                   f"({HANG_AFTER:g} s)")


def keep_seconds(text: str) -> float:
    return _number(text, float, "--keep-idle takes seconds, like --keep-idle 3600", lambda n: n > 0,
                   "--keep-idle must be more than 0 seconds, not {text}")


def hang_after_argument(function: Any) -> Any:
    """--hang-after, shared by %%xla_spawn and %xla_pool."""
    return argument(
        "--hang-after", type=hang_seconds, default=None, metavar="SECONDS",
        help=f"how long ranks may wait at different collectives (or all in one) with no progress before a line "
        f"under the cell says they hang (default {HANG_AFTER:g} s: a collective takes milliseconds once every rank "
        f"is in it, and ranks drift apart longer only when one compiles or evaluates alone; a compile, a device op "
        f"or a sleep on every rank is never called a hang). A rank waiting in a collective that ranks which "
        f"finished the cell never made is reported within seconds",
    )(function)


def spmd_arguments(function: Any) -> Any:
    """--spmd, --mesh and --axes, shared by %%xla_spawn and %xla_pool (as ipyparallel's exec_args)."""
    for decorator in reversed((
        argument(
            "--spmd", action="store_true",
            help="one process drives every device with torch_xla's SPMD on, and the cell sees a mesh; its "
            "value is one value, not a list by rank",
        ),
        argument(
            "--mesh", metavar="SIZES",
            help="with --spmd: the mesh's shape, sizes separated by commas, whose product is the device count, "
            "like 4,2 (default: one axis over every device)",
        ),
        argument(
            "--axes", metavar="NAMES",
            help="with --spmd: the mesh's axis names, like data,model (default: data for one axis, data,model "
            "for two)",
        ),
    )):
        function = decorator(function)
    return function


def xla_report_argument(function: Any) -> Any:
    """--xla-report, shared by %%xla_spawn and %xla_pool."""
    return argument(
        "--xla-report", choices=xla_report.MODES, default=None,
        help="what XLA did in each cell (compilations and their causes, syncs, CPU fallbacks): auto (default) "
        "shows one line under a cell when something deserves a look, full the whole report after every cell, "
        "off nothing (and the ranks do not count)",
    )(function)


def compile_cache_argument(function: Any) -> Any:
    """--compile-cache, shared by %%xla_spawn and %xla_pool."""
    return argument(
        "--compile-cache", type=compile_cache.option, default=None, metavar="DIR",
        help=f"where new ranks keep torch_xla's persistent compilation cache, so that a kernel restart or a new "
        f"pool loads the graphs it compiled before instead of compiling them again: DIR (each rank process uses "
        f"a folder of its own in it; a relative DIR is taken from the notebook's working directory), on (the "
        f"default directory), or off. Default: "
        f"${compile_cache.VARIABLE} if set, else on a TPU under ~/.cache/xla_magic/compile-cache where torch_xla "
        f"can load it (2.7 and earlier), and off where it cannot: XLA:CPU (the simulation) and a TPU with torch_xla "
        f"2.8 or 2.9 (pytorch/xla#9094; a kept pool keeps compiled graphs there); a directory or on turns it on",
    )(function)


def spmd_options(args: argparse.Namespace) -> SpmdOptions | None:
    """The SPMD options asked for, None without --spmd; --mesh or --axes alone is a UsageError."""
    if not args.spmd:
        if args.mesh is not None or args.axes is not None:
            given = "--mesh" if args.mesh is not None else "--axes"
            raise UsageError(
                f"{given} shapes the mesh of an SPMD cell: add --spmd (one process drives every device over "
                f"that mesh), or leave {given} out to run one rank per device"
            )
        return None
    return SpmdOptions(args.mesh, args.axes)
