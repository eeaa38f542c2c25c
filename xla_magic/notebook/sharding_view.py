"""The picture of how a tensor is sharded over the mesh, from what the SPMD process's ``describe_sharding``
sends. Runs in the kernel.

``ShardingView`` draws that description (plain data: no torch, no torch_xla
here): an HTML grid in a notebook, one block per cell, sized like the block
and coloured by the device holding it; box-drawing text elsewhere.

    display(ShardingView(description))   # or show(description)
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
    "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
)
_KEYS = ("shape", "dtype", "devices", "ranges", "grid")


def is_description(value: Any) -> bool:
    """Whether ``value`` looks like what ``describe_sharding`` returns (so it can be drawn)."""
    return isinstance(value, Mapping) and all(key in value for key in _KEYS)


@dataclass
class _Block:
    devices: list[int]
    ranges: list[tuple[int, int]]  # per dimension of the tensor


@dataclass
class _Panel:
    """One 2-D picture: rows and columns of blocks, under a title for the leading dimensions."""

    title: str
    rows: list[int]  # the size of each row of blocks
    columns: list[int]
    blocks: list[list[_Block]]


class ShardingView:
    """A picture of how a tensor is sharded: HTML in a notebook, text elsewhere.

    ``description`` is what ``describe_sharding`` returns in the SPMD process.
    """

    def __init__(self, description: Mapping[str, Any]) -> None:
        if not is_description(description):
            raise TypeError(
                "ShardingView takes the dict describe_sharding(tensor) returns, with the keys "
                + ", ".join(_KEYS)
            )
        self.description = dict(description)

    def _repr_html_(self) -> str:
        return render_html(self.description)

    def __repr__(self) -> str:
        return render_text(self.description)


def show(description: Mapping[str, Any]) -> None:
    """Display the picture of ``description`` in the running cell."""
    from IPython.display import display

    display(ShardingView(description))


def summary(description: Mapping[str, Any]) -> str:
    """One line: shape, dtype, mesh, which axes shard which dimension, bytes per device."""
    shape = description["shape"]
    parts = [f"{description['dtype']}[{', '.join(map(str, shape))}]"]
    mesh, names = description.get("mesh_shape"), description.get("axis_names")
    if mesh:
        labels = names or [str(i) for i in range(len(mesh))]
        parts.append("mesh " + " × ".join(f"{name}={size}" for name, size in zip(labels, mesh)))
    if description.get("replicated"):
        parts.append(f"replicated on all {description['devices']} devices")
    else:
        partition = description.get("partition")
        if partition is not None:
            sharded = [f"dim {dim} over {'×'.join(axes)}" for dim, axes in enumerate(partition) if axes]
            parts.append(", ".join(sharded))
        copies = {len(block.devices) for block in _all_blocks(description)}
        if copies != {1}:
            parts.append(f"each block on {_either(sorted(copies))} devices")
    per_device = _bytes_per_device(description)
    if per_device is not None:
        parts.append(f"{_bytes(per_device)} per device")
    return " · ".join(parts)


def render_text(description: Mapping[str, Any], width: int = 64) -> str:
    """Box-drawing text: a row of boxes per row of blocks, widths and heights in proportion."""
    lines = [summary(description)]
    for panel in _panels(description):
        if panel.title:
            lines.append(panel.title)
        # Many blocks across: bare device ids, so the picture stays a screen wide as long as it can.
        platform = description.get("platform", "") if len(panel.columns) <= 8 else ""
        labels = [[_device_label(block.devices, description["devices"], platform) for block in row] for row in panel.blocks]
        widths = _proportional(panel.columns, width, [max(len(label) for label in column) + 2 for column in zip(*labels)])
        heights = _proportional(panel.rows, max(2 * len(panel.rows), 4), [1] * len(panel.rows), ceiling=6)
        lines.extend(_boxes(panel, labels, widths, heights))
    return "\n".join(lines)


def render_html(description: Mapping[str, Any], width_px: int = 480) -> str:
    """A table per panel, each block a cell sized like the block and coloured by its first device."""
    platform = description.get("platform", "")
    out = [
        '<div class="xla-magic-sharding" style="font-family: sans-serif; font-size: 12px; margin: 4px 0">',
        f'<div style="margin-bottom: 4px">{html.escape(summary(description))}</div>',
    ]
    for panel in _panels(description):
        if panel.title:
            out.append(f'<div style="margin: 6px 0 2px">{html.escape(panel.title)}</div>')
        out.append(_html_table(panel, description, platform, width_px))
    out.append("</div>")
    return "\n".join(out)


def _html_table(panel: _Panel, description: Mapping[str, Any], platform: str, width_px: int) -> str:
    # Every block keeps room for its label, even one holding only padding.
    narrowest = min(12, 100 // len(panel.columns))
    columns = _proportional(panel.columns, 100, [narrowest] * len(panel.columns))
    heights = _proportional(panel.rows, 36 * len(panel.rows), [24] * len(panel.rows), ceiling=120)
    width_px = max(width_px, 48 * len(panel.columns))  # many blocks across: wider, not illegible
    out = [
        f'<table style="border-collapse: collapse; table-layout: fixed; width: {width_px}px; font-size: 12px">',
        "<colgroup>" + "".join(f'<col style="width: {share}%">' for share in columns) + "</colgroup>",
    ]
    for row, height in zip(panel.blocks, heights):
        out.append(f'<tr style="height: {height}px">')
        for block in row:
            label = html.escape(_device_label(block.devices, description["devices"], platform))
            where = html.escape(f"[{_where(block.ranges)}]")
            shown = "padding" if _shape_label(block.ranges) == "padding" else where
            colour = PALETTE[min(block.devices) % len(PALETTE)] if block.devices else "#ffffff"
            out.append(
                f'<td title="{html.escape(_device_list(block.devices, platform))}: {where}" '
                f'style="background: {colour}; color: #222; border: 2px solid #fff; text-align: center; '
                f'vertical-align: middle; padding: 2px; overflow: hidden; white-space: nowrap">'
                f"<b>{label}</b><br><small>{shown}</small></td>"
            )
        out.append("</tr>")
    out.append("</table>")
    return "\n".join(out)


def _panels(description: Mapping[str, Any]) -> list[_Panel]:
    """The blocks as 2-D pictures: rows over the next-to-last dimension, columns over the last.

    A 1-D tensor is one row of blocks, a scalar one block; a tensor of more
    dimensions gets one picture per block of its leading dimensions.
    """
    ranges = [[tuple(piece) for piece in dim] for dim in description["ranges"]]
    grid = description["grid"]
    dimensions = len(description["shape"])
    if dimensions == 0:
        return [_Panel("", [1], [1], [[_Block(list(grid), [])]])]
    if dimensions == 1:
        blocks = [[_Block(list(devices), [piece]) for devices, piece in zip(grid, ranges[0])]]
        return [_Panel("", [1], _sizes(ranges[0]), blocks)]
    panels = []
    for leading in _indices([len(dim) for dim in ranges[:-2]]):
        sub = grid
        for i in leading:
            sub = sub[i]
        prefix = [ranges[dim][i] for dim, i in enumerate(leading)]
        blocks = [
            [_Block(list(sub[r][c]), prefix + [ranges[-2][r], ranges[-1][c]]) for c in range(len(ranges[-1]))]
            for r in range(len(ranges[-2]))
        ]
        title = f"[{', '.join(f'{a}:{b}' for a, b in prefix)}, :, :]" if prefix else ""
        panels.append(_Panel(title, _sizes(ranges[-2]), _sizes(ranges[-1]), blocks))
    return panels


def _indices(counts: Sequence[int]) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = [()]
    for count in counts:
        found = [prefix + (i,) for prefix in found for i in range(count)]
    return found


def _sizes(pieces: Sequence[tuple[int, int]]) -> list[int]:
    return [stop - start for start, stop in pieces]


def _all_blocks(description: Mapping[str, Any]) -> list[_Block]:
    return [block for panel in _panels(description) for row in panel.blocks for block in row]


def _proportional(sizes: Sequence[int], total: int, minimum: Sequence[int], ceiling: int | None = None) -> list[int]:
    """Integer lengths in proportion to ``sizes``, each at least its ``minimum`` (and at most ``ceiling``)."""
    whole = sum(sizes) or 1
    lengths = [max(low, round(total * size / whole)) for size, low in zip(sizes, minimum)]
    return lengths if ceiling is None else [min(max(low, ceiling), length) for length, low in zip(lengths, minimum)]


def _boxes(panel: _Panel, labels: list[list[str]], widths: list[int], heights: list[int]) -> list[str]:
    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * width for width in widths) + right

    lines = [rule("┌", "┬", "┐")]
    for r, (row, height) in enumerate(zip(panel.blocks, heights)):
        texts = [[label, _shape_label(block.ranges)] for label, block in zip(labels[r], row)]
        for line in range(height):
            cells = []
            for (label, shape), width in zip(texts, widths):
                content = _vertical(line, height, label, shape)
                cells.append(content[:width].center(width))
            lines.append("│" + "│".join(cells) + "│")
        lines.append(rule("├", "┼", "┤") if r < len(panel.blocks) - 1 else rule("└", "┴", "┘"))
    return lines


def _vertical(line: int, height: int, label: str, shape: str) -> str:
    """What line ``line`` of a box ``height`` lines high shows: the label, then the block's shape, centred."""
    if height == 1:
        return label if line == 0 else ""
    top = (height - 2) // 2
    return label if line == top else shape if line == top + 1 else ""


def _device_label(devices: Sequence[int], total: int, platform: str) -> str:
    if not devices:
        return "none"
    if len(devices) == total and total > 1:
        return f"all {total}"
    return f"{platform} {_runs(devices)}".strip()


def _device_list(devices: Sequence[int], platform: str) -> str:
    if not devices:
        return "no device"
    noun = f"{platform} " if platform else "device "
    return f"{noun}{_runs(devices)}"


def _runs(devices: Sequence[int]) -> str:
    """0,1,2,3,6 as "0-3,6"."""
    parts: list[str] = []
    ordered = sorted(devices)
    start = previous = ordered[0]
    for device in ordered[1:] + [None]:
        if device is not None and device == previous + 1:
            previous = device
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if device is not None:
            start = previous = device
    return ",".join(parts)


def _where(ranges: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"{start}:{stop}" for start, stop in ranges)


def _shape_label(ranges: Sequence[tuple[int, int]]) -> str:
    if not ranges:
        return "scalar"
    sizes = [stop - start for start, stop in ranges]
    return "padding" if 0 in sizes else "×".join(map(str, sizes))


def _bytes_per_device(description: Mapping[str, Any]) -> int | None:
    itemsize = description.get("itemsize")
    if not isinstance(itemsize, int):
        return None
    largest = 0
    for block in _all_blocks(description):
        elements = 1
        for start, stop in block.ranges:
            elements *= stop - start
        largest = max(largest, elements)
    return largest * itemsize


def _bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "B" else f"{count:.3g} {unit}"
        count /= 1024
    return f"{count} B"


def _either(values: Sequence[int]) -> str:
    return " or ".join(map(str, values))
