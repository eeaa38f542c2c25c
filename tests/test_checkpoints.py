"""checkpoints(DIR) in a cell: a run that outlives its machine resumes bitwise; never a half checkpoint.

Real kernels, real rank processes, real signals, a real full disk (a small
tmpfs). Every wait waits for a file a rank wrote or a process's end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest
import torch

from helpers import Kernel, kernel_with_pool, spawn_cell, pool_magic, wait_for, wait_gone, when
from xla_magic.runs.errors import RankError

# A deterministic data-parallel training cell: every generator a cell may draw from is used (torch's CPU one for
# the data, XLA's for the dropout and the noise, NumPy's and Python's for a scale), so a resumed run equals an
# uninterrupted one only if every one of them was restored.
TRAIN = """
import os, random, time
import numpy as np
import torch, torch_xla
import torch_xla.core.xla_model as xm
torch.manual_seed(1234 + rank); np.random.seed(rank); random.seed(rank); xm.set_rng_state(77 + rank, device)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
with torch.no_grad():
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
model = model.to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)
ckpt = checkpoints(D, every=EVERY, keep=KEEP)
start = ckpt.restore(model=model, opt=opt, sched=sched)
for step in range(start, STEPS):
    x = (torch.randn(16, 8) * float(np.random.rand() + random.random())).to(device)
    noise = torch.randn(16, 4, device=device)
    loss = (model(x) - noise).pow(2).mean()
    opt.zero_grad(); loss.backward(); xm.optimizer_step(opt); sched.step()
    torch_xla.sync()
    ckpt.save(step, model=model, opt=opt, sched=sched, epoch=step // 10)
    if step == HOLD:  # the run waits here to be killed
        open(os.path.join(MARKS, f"held-{rank}"), "w").close()
        while True:
            time.sleep(0.05)
if rank == 0 and OUT:
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, OUT)
(start, ckpt.values.get("epoch"))
"""


def _names(**values) -> str:
    return "\n".join(f"{name} = {value!r}" for name, value in values.items())


def _complete(directory: str, step: int) -> bool:
    return os.path.exists(os.path.join(directory, f"step-{step:08d}", "manifest.json"))


def _steps(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if not name.startswith(".board"))


def _same_weights(a: str, b: str) -> None:
    first, second = torch.load(a), torch.load(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_a_run_killed_with_its_machine_resumes_in_a_new_kernel_and_ends_bitwise_as_one_never_stopped(tmp_path):
    directory, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    common = dict(EVERY=10, KEEP=None, STEPS=60, MARKS=marks)
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        content, text = kernel.run("%xla_pool start --devices 2 --backend cpu")
        assert content["status"] == "ok", text
        kernel.run(_names(D=directory, HOLD=45, OUT="", **common))
        msg_id = kernel.client.execute("%%xla_spawn\n" + TRAIN)
        assert wait_for(lambda: _complete(directory, 40) and len(os.listdir(marks)) == 2), os.listdir(marks)
        # The machine's end: the kernel and every process under it, at once.
        victims = [kernel.pid] + [child.pid for child in psutil.Process(kernel.pid).children(recursive=True)]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        assert wait_gone(victims) == []
        del msg_id
    finally:
        kernel.close()
    assert [name for name in _steps(directory) if name.startswith("step-")] == \
        ["step-00000000", "step-00000010", "step-00000020", "step-00000030", "step-00000040"]

    with kernel_with_pool(2) as fresh:
        resumed, reference = str(tmp_path / "resumed.pt"), str(tmp_path / "reference.pt")
        fresh.run(_names(D=directory, HOLD=-1, OUT=resumed, **common))
        content, text = fresh.run("%%xla_spawn\n" + TRAIN)
        assert content["status"] == "ok", text
        assert "[(41, 4), (41, 4)]" in text, text
        assert "restored step 40" in text, text
        fresh.run(_names(D=str(tmp_path / "uninterrupted"), HOLD=-1, OUT=reference, **common))
        content, text = fresh.run("%%xla_spawn\n" + TRAIN)
        assert content["status"] == "ok", text
        assert "[(0, None), (0, None)]" in text, text
    _same_weights(resumed, reference)


def test_a_notebook_value_of_none_travels_to_the_ranks_like_any_other():
    # Found here: a cell's KEEP = None never reached the ranks (the builtins check took None for a builtin's).
    from xla_magic.cell.payload import select_names

    assert select_names({"KEEP", "print"}, {"KEEP": None, "print": print}, {}) == {"KEEP": None}
