"""What a rank displays, shown in the running cell. Runs in the kernel.

A rank asks with a DISPLAY event (launcher/serve.py) naming what it shows:

- ``mime``: anything the rank's IPython shell displayed (``display()``, rich
  reprs, pandas tables, matplotlib figures): a mime bundle with its
  metadata, display id and update flag. It is published here as real display
  data through the kernel shell's display_pub, so a notebook renders it
  (image/png, text/html, ...) and a terminal prints its text/plain form.
  A label line (``[rank 0]``, ``[spmd]``) comes first; updates of an
  existing display change it in place and need none. Each rank's display
  ids map to ids of their own in the kernel, so eight ranks updating
  "progress" update eight displays.
- a view of the kernel's (``sharding``: which device holds which block).
"""

from __future__ import annotations

from typing import Any, Callable

from xla_magic.notebook import sharding_view

# What a rank may ask the kernel to draw (protocol.DISPLAY's ``what``), and the view that draws it.
VIEWS: dict[str, Callable[[Any], Any]] = {"sharding": sharding_view.ShardingView}
MIME = "mime"


def show(label: str, what: Any, data: Any) -> None:
    """Display what a rank labelled ``label`` (``rank 0``, ``spmd``) asked for; say so when it cannot be shown."""
    try:
        if what == MIME:
            _publish(label, data)
            return
        view = VIEWS.get(what)
        if view is None:
            print(f"[{label}] (nothing to show for {what!r})")
            return
        from IPython.display import display

        display(view(data))
    except Exception as exc:  # a bad description must not end the request
        print(f"[{label}] could not show {what}: {type(exc).__name__}: {exc}")


def _publish(label: str, bundle: dict[str, Any]) -> None:
    from IPython.display import publish_display_data

    data = bundle["data"]
    if not isinstance(data, dict) or not data:
        raise ValueError("an empty display")
    transient = dict(bundle.get("transient") or {})
    if "display_id" in transient:
        transient["display_id"] = kernel_display_id(label, transient["display_id"])
    update = bool(bundle.get("update")) and "display_id" in transient
    if not update:
        note = bundle.get("note")
        print(f"[{label}] ({note})" if note else f"[{label}]", flush=True)
    publish_display_data(data, bundle.get("metadata") or {}, transient=transient or None, update=update)


def kernel_display_id(label: str, display_id: str) -> str:
    """The kernel's display id for a rank's: one per rank, the same in every cell (handles outlive a cell)."""
    return f"xla_magic-{label.replace(' ', '')}-{display_id}"
