"""A cell's source: whether it compiles, what it returns, which notebook names it reads. Runs in the kernel.

Runs in the kernel. A cell is IPython code: what is not plain Python
(``%time``, ``!ls``, ``x = !ls``) is turned into Python by IPython's own
input transformations, as IPython does for any cell, and the ranks run that
code in shells of their own (launcher/shell.py). Magics that would change the
whole environment from every rank at once (``%pip``) or that belong to the
kernel (``%xla_pool``) are refused. The cell is compiled here first, so a
syntax error never launches anything; the names the cell reads are then shipped (shipping.py)
with cloudpickle (notebook functions and classes by value, modules by
reference), and a value that cannot be pickled is reported by name before
any rank starts.
"""

from __future__ import annotations

import ast
import builtins
import io
import re
import tokenize
from typing import Any, Iterable, Mapping

from IPython.core.error import UsageError
from IPython.core.inputtransformer2 import TransformerManager

from xla_magic.wire import transport
from xla_magic.wire.help import see

# Names every rank provides itself; the kernel's values are never shipped.
RANK_NAMES = frozenset({"rank", "world_size", "device", "strategy"})


def compile_cell(source: str, filename: str) -> bool:
    """Compile the cell as a rank will; True when it ends in an expression.

    Raises SyntaxError (pointing into the cell) when it does not compile.
    """
    tree = ast.parse(source, filename=filename)
    body, last = split_last_expression(tree)
    compile(body, filename, "exec")
    if last is not None:
        compile(last, filename, "eval")
    return last is not None and not ends_with_semicolon(source)


def ends_with_semicolon(source: str) -> bool:
    """A trailing ``;`` hides the result, as in IPython (comments don't count)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    ignored = {tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER,
               tokenize.INDENT, tokenize.DEDENT}
    meaningful = [token for token in tokens if token.type not in ignored]
    return bool(meaningful) and meaningful[-1].string == ";"


def split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    """The cell without its final expression statement, and that expression."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        return ast.Module(tree.body[:-1], type_ignores=[]), last
    return tree, None


def names_read(source: str) -> set[str]:
    """The names the cell may read from the notebook, in any scope inside it.

    A name the cell binds before it ever reads it (``model = Net()`` as the
    first top-level statement that mentions ``model``) is left out: the cell
    makes its own, so the notebook's value, picklable or not, is not needed.
    """
    tree = ast.parse(source)
    loaded = _loads(tree)
    return loaded - _bound_before_read(tree.body)


def _loads(node: ast.AST) -> set[str]:
    return {
        child.id
        for child in ast.walk(node)
        if isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Load, ast.Del))
    }


_UNCONDITIONAL_BINDINGS = (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom,
                           ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _bound_before_read(statements: list[ast.stmt]) -> set[str]:
    bound: set[str] = set()
    seen: set[str] = set()
    for statement in statements:
        loads = _loads(statement)
        if isinstance(statement, _UNCONDITIONAL_BINDINGS):
            bound |= _targets(statement) - loads - seen
        seen |= loads | _targets(statement)
    return bound


def _targets(statement: ast.stmt) -> set[str]:
    """Names a top-level statement binds for certain."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    if isinstance(statement, ast.AnnAssign):
        return {statement.target.id} if statement.value is not None and isinstance(statement.target, ast.Name) else set()
    if isinstance(statement, ast.Assign):
        return {
            node.id
            for target in statement.targets
            for node in ast.walk(target)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
        }
    return set()


def select_names(
    wanted: Iterable[str], user_ns: Mapping[str, Any], hidden: Mapping[str, Any]
) -> dict[str, Any]:
    """The notebook values to ship: present, user-made, not provided per rank."""
    chosen = {}
    for name in sorted(wanted):
        if name in RANK_NAMES or name.startswith("__") or name not in user_ns:
            continue
        value = user_ns[name]
        if name in hidden and hidden[name] is value:
            continue  # IPython's own (In, Out, get_ipython, exit, ...)
        if hasattr(builtins, name) and getattr(builtins, name) is value:  # (a notebook's ``x = None`` travels)
            continue
        chosen[name] = value
    return chosen


def pickle_namespace(values: Mapping[str, Any], segments: transport.RunSegments | None = None) -> bytes:
    """cloudpickle the values together; name the first one that fails.

    With ``segments``, large tensors and arrays go to shared memory once,
    for every rank to map, instead of into the pickle.
    """
    try:
        return transport.dumps_namespace(dict(values), segments)
    except BaseException as whole_error:
        if segments is not None:
            segments.sweep()
        if not isinstance(whole_error, Exception):
            raise
        for name, value in values.items():
            try:
                transport.check_picklable(value)
            except Exception as exc:
                raise UsageError(
                    f"Cannot send notebook variable '{name}' ({type(value).__module__}."
                    f"{type(value).__qualname__}) to the ranks: {type(exc).__name__}: {exc}. "
                    f"Create it inside the %%xla_spawn cell instead, or rename it there "
                    f"if the cell does not need the notebook's value. " + see("cannot-send-variable")
                ) from exc
        raise UsageError(
            f"Cannot send the notebook variables {sorted(values)} to the ranks "
            f"together: {type(whole_error).__name__}: {whole_error}"
        ) from whole_error


_ANALYSED_CELLS_KEPT = 128
_analysed: dict[str, tuple[bool, frozenset[str], str]] = {}


def analyse(source: str, filename: str) -> tuple[bool, frozenset[str], str]:
    """(ends in an expression, names read, the code the ranks run) of a cell, computed once per source.

    The code is the cell itself when it is plain Python, else IPython's
    transformation of it. Raises SyntaxError, pointing into the cell, when it
    does not compile, and UsageError for a magic a rank must not run.
    """
    known = _analysed.get(source)
    if known is None:
        code = transform(source)
        has_result = compile_cell(code, filename)
        refuse_magics(code)
        known = (has_result, frozenset(names_read(code) | names_in_magics(code)), code)
        if len(_analysed) >= _ANALYSED_CELLS_KEPT:
            _analysed.pop(next(iter(_analysed)))
        _analysed[source] = known
    return known


# --- IPython syntax -------------------------------------------------------------

_transformer = TransformerManager()


def transform(source: str) -> str:
    """The cell as Python: itself when it compiles, else IPython's transformation of it.

    IPython drops a cell's leading blank lines; they are put back, so line
    numbers in tracebacks are the cell's own.
    """
    try:
        ast.parse(source)
        return source
    except SyntaxError:
        pass
    code = _transformer.transform_cell(source)
    dropped = len(source.splitlines()) - len(code.splitlines())
    blank = len(source) - len(source.lstrip("\n"))
    return "\n" * min(max(dropped, 0), blank) + code


# Magics that act on the whole Python environment: from every rank at once
# they would race each other, and the ranks could not import what they install.
_ENVIRONMENT_MAGICS = frozenset({"pip", "conda", "mamba", "micromamba", "uv"})
_MAGIC_CALLS = frozenset({"run_line_magic", "run_cell_magic"})


def magic_calls(code: str) -> list[tuple[str, ast.Call]]:
    """``(magic name, call)`` for each ``get_ipython().run_line_magic(...)`` / ``run_cell_magic(...)`` in the code."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MAGIC_CALLS and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value.lstrip("%"), node))
    return found


def refuse_magics(code: str) -> None:
    """UsageError, saying what to do instead, for a magic that must not run in a rank."""
    for name, _call in magic_calls(code):
        if name in _ENVIRONMENT_MAGICS:
            raise UsageError(
                f"%{name} cannot run inside %%xla_spawn: every rank would change the same environment at "
                f"once. Run %{name} in a cell of its own; ranks started after it (the next cell, or "
                f"%xla_pool restart for a pool) see what it installed."
            )
        if name.startswith("xla_"):
            raise UsageError(
                f"%{name} is a magic of the kernel, not of the ranks, so it cannot run inside a "
                f"%%xla_spawn cell. Put it in a cell of its own, before or after this one."
            )


# Magics whose argument is Python code run in the rank's namespace.
_CODE_MAGICS = frozenset({"time", "timeit", "prun", "capture"})
# What IPython expands in a magic's or shell command's line: $name, {expression}.
_EXPANDED = re.compile(r"\$(?P<name>[A-Za-z_]\w*)|\{(?P<expression>[^{}]+)\}")


def names_in_magics(code: str) -> set[str]:
    """The notebook names that magics and ``!`` commands read: in code they time, and in ``$x`` / ``{x}``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        texts = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        if node.func.attr in _MAGIC_CALLS and texts:
            magic, *arguments = texts
            if magic.lstrip("%") in _CODE_MAGICS:
                names |= _names_in_code(arguments[-1] if node.func.attr == "run_cell_magic" else arguments[0])
            texts = arguments[:1]  # a cell magic's body is not expanded
        elif node.func.attr not in ("system", "getoutput"):
            continue
        for text in texts:
            for match in _EXPANDED.finditer(text):
                names |= {match["name"]} if match["name"] else _names_in_code(match["expression"])
    return names


def _names_in_code(text: str) -> set[str]:
    """Names read by ``text`` as Python; a timing magic's options (``-n 10``) may come first."""
    words = text.split()
    for start in range(len(words) + 1):
        if start and not words[start - 1].startswith("-") and not words[start - 1].isdigit():
            break
        try:
            return names_read(transform(text.split(None, start)[-1] if start else text))
        except (SyntaxError, ValueError):
            continue
    return set()
