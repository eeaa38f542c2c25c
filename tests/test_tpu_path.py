"""torch_xla's real multi-process TPU path, on a fake TPU host (fake_tpu_host.py): only the chips'
PCI ids, the slice's metadata and libtpu's device runtime are faked (tests/fake_tpu/fake_libtpu.py).

Root only (a mount namespace); skipped elsewhere with the reason.
"""

from __future__ import annotations

import os

import pytest

from fake_tpu_host import fake_tpu_host

SHOW = """
import os, torch, torch_xla.runtime as xr
(rank, xr.global_ordinal(), xr.world_size(), os.environ["TPU_VISIBLE_CHIPS"], os.getpid(),
 (torch.ones(2, device=device) * rank).cpu().tolist())
"""


def test_v5e_8_runs_one_process_per_chip_with_ordinals_0_to_7_and_results_in_order(ip, spawn):
    with fake_tpu_host(ip, "v5litepod-8"):
        run = spawn("--devices 8", SHOW)
    values = run.value
    assert [value[:4] for value in values] == [(r, r, 8, str(r)) for r in range(8)]
    assert len({value[4] for value in values}) == 8  # one process per chip
    assert os.getpid() not in {value[4] for value in values}
    assert [value[5] for value in values] == [[float(r)] * 2 for r in range(8)]
