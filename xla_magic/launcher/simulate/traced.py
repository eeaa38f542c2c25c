"""torch.distributed's ways into the simulated collectives. Runs in a rank.

- The XLA kernels of torch's functional collectives
  (``torch.ops._c10d_functional.*``): torch_xla implements them in C++,
  where a CPU device has only itself to talk to and silently returns its own
  value. Here they go through the simulation, bumping the counters torch_xla
  bumps (``xla::all_reduce`` ...). Dynamo turns ``dist.*`` calls in a
  compiled function into these ops.
- Compiled graphs: the openxla backend would trace a graph once into one
  XLA computation and replay it, but a simulated collective is a transfer
  between processes, not an XLA op. A graph that holds one is run op by op
  on every call instead, so its collectives run each time, with right values.
- ``init_method="xla://"``: torch_xla's handler opens a TCPStore on port
  12355 of every interface; the simulation's store is a file in the run's
  directory, so runs side by side never meet and nothing listens on a port.
"""

from __future__ import annotations

import importlib
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch_xla.core.xla_model as xm

from xla_magic.launcher.simulate import collectives, exchange

# torch.distributed.rendezvous is also the name of a function there.
dist_rendezvous = importlib.import_module("torch.distributed.rendezvous")

# torch's reduce op names, as torch_xla's C++ side maps them.
_REDUCE_OPS = {
    "sum": xm.REDUCE_SUM,
    "avg": None,
    "product": xm.REDUCE_MUL,
    "mul": xm.REDUCE_MUL,
    "min": xm.REDUCE_MIN,
    "max": xm.REDUCE_MAX,
    "band": xm.REDUCE_AND,
    "and": xm.REDUCE_AND,
    "bor": xm.REDUCE_OR,
    "or": xm.REDUCE_OR,
}

_library: Any = None
_original_extract: Callable[..., Any] | None = None


def install() -> None:
    """Called in each simulated rank; the launcher, which the tpu backend
    forks too, imports none of what this changes."""
    global _library, _original_extract
    import torch_xla.core.dynamo_bridge as bridge
    import torch_xla.distributed.xla_backend  # noqa: F401  registers "xla://" before its store is replaced

    if _library is None:
        _library = torch.library.Library("_c10d_functional", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name, kernel in _KERNELS.items():
                _library.impl(name, kernel, "XLA")
    if _original_extract is None:
        _original_extract = bridge.extract_compiled_graph
        bridge.extract_compiled_graph = _extract_compiled_graph(_original_extract)
    dist_rendezvous._rendezvous_handlers["xla"] = _xla_rendezvous


# --- functional collectives ---------------------------------------------------


def _reduce_type(op: str) -> str:
    reduce_type = _REDUCE_OPS.get(op.lower())
    if reduce_type is None:
        raise ValueError(f"Invalid string for AllReduceType: {op}")
    return reduce_type


def _everyone(size: int | None = None) -> list[int]:
    return list(range(exchange.sim().world_size if size is None else size))


def all_reduce(input: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    exchange.bump("xla::all_reduce")
    # xm.all_reduce and xm.all_gather come here too, and name themselves (torch_xla ignores the group name).
    call = group_name if group_name.startswith("xm.") else "dist.all_reduce"
    reduce_type = reduce_op if call.startswith("xm.") else _reduce_type(reduce_op)
    [value] = collectives.reduce_values(call, reduce_type, [input], 1.0, _everyone())
    return exchange.to_device(value, input.device)


def all_gather_into_tensor(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    exchange.bump("xla::all_gather_into_tensor")
    members = exchange.exchange_tensors("dist.all_gather_into_tensor", [input], _group(group_size))
    return exchange.to_device(torch.cat([m[0] for m in members], dim=0), input.device)


def reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    exchange.bump("xla::reduce_scatter_tensor")
    group = _group(group_size)
    [value] = collectives.reduce_values("dist.reduce_scatter_tensor", _reduce_type(reduce_op), [input], 1.0, group)
    width = value.size(0) // len(group)
    shard = value.narrow(0, group.index(exchange.sim().rank) * width, width).clone()
    return exchange.to_device(shard, input.device)


def all_to_all_single(
    input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str
) -> torch.Tensor:
    exchange.bump("xla::all_to_all_single")
    group = _everyone()
    width = input.size(0) // len(group)
    if any(size != width for size in list(output_split_sizes) + list(input_split_sizes)):
        raise RuntimeError("torch_xla does not support arbitrary split sizes for all_to_all")
    value = collectives.all_to_all_values("dist.all_to_all_single", input, 0, 0, group)
    result = exchange.to_device(value, input.device)
    return result.requires_grad_(input.requires_grad) if result.is_floating_point() else result


def _group(size: int) -> list[int]:
    group = _everyone(size)
    if size != exchange.sim().world_size:
        raise ValueError(f"a functional collective over {size} of {exchange.sim().world_size} ranks is not simulated; use the whole world.")
    return group


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "all_reduce": all_reduce,
    "all_gather_into_tensor": all_gather_into_tensor,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "all_to_all_single": all_to_all_single,
}


# --- compiled graphs -------------------------------------------------------------

def _extract_compiled_graph(original: Callable[..., Any]) -> Callable[..., Any]:
    def extract_compiled_graph(model: torch.fx.GraphModule, args: Any) -> Callable[..., Any]:
        if not _holds_collective(model):
            return original(model, args)

        def run_op_by_op(*call_args: Any) -> Any:
            return model(*call_args)

        return run_op_by_op

    return extract_compiled_graph


def _holds_collective(model: torch.fx.GraphModule) -> bool:
    for node in model.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            return True
    return False


# --- init_method="xla://" --------------------------------------------------------


def _xla_rendezvous(url: str, timeout: timedelta = dist.default_pg_timeout, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    state = exchange.sim()
    yield dist.PrefixStore("xla_magic/xla_init", exchange.file_store(state)), state.rank, state.world_size
