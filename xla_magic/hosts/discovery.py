"""Which hosts a pool spans, and the kernel's address toward them. Runs in the kernel (no XLA).

Hosts come from ``--hosts`` (addresses or names, comma-separated) or, on a
TPU VM of a multi-host slice, from the slice itself: the worker endpoints
torch_xla reads (``TPU_WORKER_HOSTNAMES``, else the metadata server's
``worker-network-endpoints`` attribute).
"""

from __future__ import annotations

import os
import shlex
import socket
import urllib.request

from IPython.core.error import UsageError

METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


def parse_hosts(text: str) -> list[str]:
    """``--hosts`` as a list; ``slice``: the TPU slice's own workers."""
    if text.strip() == "slice":
        return slice_hosts()
    hosts = [host.strip() for host in text.split(",") if host.strip()]
    if not hosts:
        raise UsageError("--hosts takes host addresses separated by commas, like --hosts 10.0.0.2,10.0.0.3, "
                         "or --hosts slice on a TPU VM of a multi-host slice")
    if len(set(hosts)) != len(hosts):
        raise UsageError(f"--hosts names a host twice ({text}); each host runs one engine: name each once")
    return hosts


def slice_hosts() -> list[str]:
    """The slice's workers, in worker order, as torch_xla finds them."""
    named = os.environ.get("TPU_WORKER_HOSTNAMES")
    if named:
        return [host.strip() for host in named.split(",") if host.strip()]
    try:
        request = urllib.request.Request(METADATA + "worker-network-endpoints", headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=2) as answer:
            endpoints = answer.read().decode()
    except OSError as exc:
        raise UsageError(
            f"--hosts slice: this is not a TPU VM of a multi-host slice (no TPU_WORKER_HOSTNAMES, and the "
            f"metadata server did not answer: {exc}); list the hosts instead, like --hosts 10.0.0.2,10.0.0.3"
        ) from None
    # Each endpoint is "uid:worker-id:ip" (torch_xla's _internal/tpu.py reads the last field).
    return [endpoint.split(":")[2] for endpoint in endpoints.split(",") if endpoint.count(":") >= 2]


def kernel_address(host: str) -> str:
    """This machine's address on the way to ``host``: where the controller listens.

    A UDP socket's connect only asks the routing table; nothing is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise UsageError(f"no route from this machine to host {host} ({exc}): check --hosts") from None


# The launch template's words live here, not beside the launchers, so that what the kernel checks before a
# start needs no ipyparallel (an extra: %load_ext must work without it).
DEFAULT_TEMPLATE = "ssh -T -o BatchMode=yes {host}"


def template_words(template: str, host: str, index: int) -> list[str]:
    """The launch command's words for one host (ValueError: a placeholder other than {host} and {index})."""
    try:
        return shlex.split(template.format(host=host, index=index))
    except (KeyError, IndexError) as exc:
        raise ValueError(f"the launch template may use {{host}} and {{index}} only, not {{{exc.args[0]}}}") from None
