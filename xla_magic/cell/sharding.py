"""``--spmd``'s options: the mesh and its axes, checked against the device count before anything starts.
Runs in the kernel and in each host's engine.

``SpmdOptions`` holds the options as typed; ``mesh_layout`` checks ``--mesh`` and ``--axes``. The picture of a
sharded tensor is the notebook's (notebook/sharding_view.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from IPython.core.error import UsageError

# The names torch_xla's SPMD guide gives a 1-D and a 2-D mesh.
DEFAULT_AXES = {1: ("data",), 2: ("data", "model")}


# --- --mesh and --axes -------------------------------------------------------


@dataclass(frozen=True)
class SpmdOptions:
    """``--spmd`` and its ``--mesh`` / ``--axes`` as typed (None: the defaults)."""

    mesh: str | None = None
    axes: str | None = None

    def layout(self, devices: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh shape and axis names over ``devices``, or the UsageError that says why not."""
        return mesh_layout(self.mesh, self.axes, devices)

    def options(self) -> str:
        """The options again, as typed: ``--mesh 4,2 --axes data,model``."""
        given = [("--mesh", self.mesh), ("--axes", self.axes)]
        return " ".join(f"{option} {value}" for option, value in given if value is not None)


def mesh_layout(mesh: str | None, axes: str | None, devices: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh shape and axis names that ``--mesh`` and ``--axes`` ask for.

    No ``--mesh``: 1-D over all ``devices``. No ``--axes``: ``data`` for a
    1-D mesh, ``data,model`` for a 2-D one; a larger mesh needs them.
    """
    shape = (devices,) if mesh is None else parse_mesh(mesh, devices)
    if axes is None:
        if len(shape) not in DEFAULT_AXES:
            raise UsageError(
                f"--mesh {mesh} has {len(shape)} axes; name them with --axes, as in --axes {_example_axes(len(shape))}"
            )
        return shape, DEFAULT_AXES[len(shape)]
    names = parse_axes(axes)
    if len(names) != len(shape):
        given = f"--mesh {mesh}" if mesh is not None else f"the default mesh ({devices} devices in a row)"
        hint = (
            f"give --mesh too, as in --mesh {_layouts(devices, len(names))[0]}"
            if mesh is None
            else f"give one name per axis, as in --axes {_example_axes(len(shape))}"
        )
        raise UsageError(
            f"--axes {axes} names {_count(len(names), 'axis', 'axes')} but {given} has "
            f"{_count(len(shape), 'axis', 'axes')}; {hint}."
        )
    return shape, names


def parse_mesh(text: str, devices: int) -> tuple[int, ...]:
    """``"4,2"`` as ``(4, 2)``, whose product must be ``devices``."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdecimal():
            raise UsageError(
                f"--mesh {text}: {part or 'an empty size'} is not a number of devices; give the size of "
                f"each axis, separated by commas, as in --mesh {_example_mesh(devices)}"
            )
        sizes.append(int(part))
    if 0 in sizes:
        raise UsageError(f"--mesh {text}: every axis needs at least 1 device, as in --mesh {_example_mesh(devices)}")
    product = 1
    for size in sizes:
        product *= size
    if product != devices:
        options = _layouts(devices, len(sizes))
        raise UsageError(
            f"--mesh {text} holds {product} devices but the cell runs on {devices} devices; give sizes whose product "
            f"is {devices}, such as " + " or ".join(f"--mesh {option}" for option in options)
        )
    return tuple(sizes)


def parse_axes(text: str) -> tuple[str, ...]:
    """``"data,model"`` as ``("data", "model")``: distinct names, one per mesh axis."""
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if not name.isidentifier():
            raise UsageError(
                f"--axes {text}: {repr(name) if name else 'an empty name'} is not an axis name; "
                f"name each axis with a word, separated by commas, as in --axes data,model"
            )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(
            f"--axes {text} names {' and '.join(repeated)} more than once; each axis needs a name of its own"
        )
    return names


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _layouts(devices: int, dimensions: int) -> list[str]:
    """Up to three meshes of ``dimensions`` axes (or fewer, when none fits) over ``devices``."""
    shapes: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...], left: int) -> None:
        if len(prefix) == dimensions - 1:
            shapes.append(prefix + (left,))
            return
        for size in range(1, left + 1):
            if left % size == 0:
                grow(prefix + (size,), left // size)

    grow((), devices)
    useful = [shape for shape in shapes if 1 not in shape] or shapes
    useful.sort(key=lambda shape: (max(shape) - min(shape), [-size for size in shape]))
    return [",".join(map(str, shape)) for shape in useful[:3]]


def _example_axes(dimensions: int) -> str:
    return ",".join(DEFAULT_AXES.get(dimensions) or [f"axis{i}" for i in range(dimensions)])


def _example_mesh(devices: int) -> str:
    layouts = _layouts(devices, 2)
    return layouts[0] if layouts else str(devices)


# --- the picture -------------------------------------------------------------

# ColorBrewer's Set3: twelve light colours, distinct side by side, dark text readable on all.
