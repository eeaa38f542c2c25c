"""checkpoints(DIR) in a cell: a run that outlives its machine resumes bitwise; never a half checkpoint.

Real kernels, real rank processes, real signals, a real full disk (a small
tmpfs). Every wait waits for a file a rank wrote or a process's end.
"""

from __future__ import annotations

import importlib.util
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
        # What the runs saved, listed from the manifests: the old kernel's steps and the new one's.
        content, text = fresh.run("%xla_checkpoints")
        assert content["status"] == "ok", text
        listed = [line.split()[:1] + line.split()[-2:-1] for line in text.splitlines()[2:]]
        assert [step for step, _ in listed] == ["0", "10", "20", "30", "40", "50"], text
        assert f"{directory}: 6 checkpoints; restore() takes step 50" in text, text
        # The uninterrupted run, in the background: %xla_runs shows its last checkpoint.
        uninterrupted = str(tmp_path / "uninterrupted")
        fresh.run(_names(D=uninterrupted, HOLD=-1, OUT=reference, **common))
        content, text = fresh.run("%%xla_spawn --bg -o background\n" + TRAIN)
        assert content["status"] == "ok", text
        content, text = fresh.run("background.wait()")
        assert content["status"] == "ok" and "[(0, None), (0, None)]" in text, text
        content, text = fresh.run("%xla_runs")
        assert f"step 50 ({os.path.join(uninterrupted, 'step-00000050')})" in text, text
    _same_weights(resumed, reference)


def test_a_notebook_value_of_none_travels_to_the_ranks_like_any_other():
    # Found here: a cell's KEEP = None never reached the ranks (the builtins check took None for a builtin's).
    from xla_magic.cell.payload import select_names

    assert select_names({"KEEP", "print"}, {"KEEP": None, "print": print}, {}) == {"KEEP": None}


# --- one-shot cells on the shell: each cell's ranks are new processes, as a new session's are -----------------

SMALL = """
import os, time
import torch, torch_xla
torch.manual_seed(0)
model = torch.nn.Linear(4, 3).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = checkpoints(D, every=EVERY, keep=KEEP)
start = ckpt.restore(model=model, opt=opt)
for step in range(start, STEPS):
    loss = model(torch.ones(2, 4, device=device)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    torch_xla.sync()
    if step == MARK_AT:
        with open(os.path.join(MARKS, f"rank-{rank}"), "w") as mark:
            mark.write(str(os.getpid()))
    ckpt.save(step, model=model, opt=opt, extra=EXTRA(step))
    time.sleep(PAUSE)
(start, model.weight.sum().item())
"""


# A saved value whose pickling on a rank's writing thread says so in a file, then waits for GO (or forever): a
# notebook class, so that it travels by value.
STALL = """
class Stall:
    def __init__(self, marks, go):
        self.marks, self.go = marks, go
    def __reduce__(self):
        import os, threading, time
        if threading.current_thread().name != "xla_magic-checkpoints":  # shipped to the ranks, not yet saved
            return (Stall, (self.marks, self.go))
        open(os.path.join(self.marks, "writing"), "w").close()
        while self.go is None or not os.path.exists(self.go):
            time.sleep(0.02)
        return (int, (0,))
"""


def _stall(ip, marks: str, go: str | None):
    ip.run_cell(STALL)
    return ip.user_ns["Stall"](marks, go)


def _small(ip, directory: str, marks: str, devices: int = 2, **names):
    defaults = dict(D=directory, MARKS=marks, EVERY=10, KEEP=None, STEPS=30, MARK_AT=-1, PAUSE=0.0,
                    EXTRA=lambda step: None)
    ip.user_ns.update(defaults, **names)
    return spawn_cell(ip, f"--devices {devices} --backend cpu", SMALL)


def _pids(marks: str, ranks: int) -> list[int]:
    def read() -> list[int] | None:
        try:
            return [int(open(os.path.join(marks, f"rank-{rank}")).read()) for rank in range(ranks)]
        except (OSError, ValueError):
            return None
    return wait_for(read)


def test_a_write_killed_midway_leaves_the_previous_checkpoint_to_restore(ip, tmp_path):
    directory, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    stall = _stall(ip, marks, None)
    killed = when(lambda: os.path.exists(os.path.join(marks, "writing")) and _pids(marks, 2),
                  lambda: [os.kill(pid, signal.SIGKILL) for pid in _pids(marks, 2)])
    with pytest.raises(RankError, match="SIGKILL"):
        _small(ip, directory, marks, MARK_AT=0, EXTRA=lambda step: stall if step == 20 else None, PAUSE=0.01)
    assert killed.is_set()
    assert "step-00000020" not in os.listdir(directory)
    assert any(name.startswith(".partial-step-00000020") for name in os.listdir(directory))
    value, out, err, _ = _small(ip, directory, marks, STEPS=12)
    assert [start for start, _ in value] == [11, 11]
    assert "restored step 10" in err and "skipped step 20 (partial: its writing never completed)" in err, err


def test_keep_removes_older_checkpoints_only_once_a_newer_one_is_complete(ip, tmp_path):
    directory, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    go = str(tmp_path / "go")
    stall = _stall(ip, marks, go)
    seen: list[list[str]] = []

    def look_then_go() -> None:
        seen.append([name for name in _steps(directory) if name.startswith("step-")])
        open(go, "w").close()

    when(lambda: os.path.exists(os.path.join(marks, "writing")), look_then_go)
    _small(ip, directory, marks, devices=1, EVERY=2, KEEP=2, STEPS=11,
           EXTRA=lambda step: stall if step == 8 else None)
    assert seen == [["step-00000004", "step-00000006"]]  # step 8 is being written: the two before it stay
    assert [name for name in _steps(directory)] == ["step-00000008", "step-00000010"]


def test_sigterm_saves_at_the_ranks_next_step_and_ends_the_run_saying_where(ip, tmp_path):
    directory, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    when(lambda: _pids(marks, 2), lambda: [os.kill(pid, signal.SIGTERM) for pid in _pids(marks, 2)])
    with pytest.raises(RankError) as raised:
        _small(ip, directory, marks, EVERY=100_000, STEPS=100_000, MARK_AT=3, PAUSE=0.005)
    message = str(raised.value)
    assert "preempted (SIGTERM)" in message, message
    saved = max(name for name in _steps(directory) if name.startswith("step-"))  # (and step 0, due at every=N)
    step = int(saved.split("-")[1])
    assert step > 3 and f"saving step {step} to {os.path.join(directory, saved)}" in message, message
    manifest = json.load(open(os.path.join(directory, saved, "manifest.json")))
    assert set(manifest["files"]) == {"replicated.pt", "rank-0.pt", "rank-1.pt"}
    value, _, err, _ = _small(ip, directory, marks, EVERY=100_000, STEPS=0)
    assert [start for start, _ in value] == [step + 1, step + 1], err


@pytest.fixture
def small_disk(tmp_path):
    """A 384 KiB tmpfs: a disk that fills up (needs root, as the test machines run)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield str(disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_lets_the_run_go_on_said_once_with_no_partial_left_to_load(ip, tmp_path, small_disk):
    directory, marks = os.path.join(small_disk, "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    ip.user_ns["torch"] = torch
    # From step 10 on, each checkpoint carries 800 KB more than the disk holds.
    value, out, err, _ = _small(ip, directory, marks, EVERY=5, STEPS=25,
                                EXTRA=lambda step: torch.zeros(200_000) if step >= 10 else None)
    assert len(value) == 2  # the run went on to its end
    assert err.count("could not be written") == 1 and "No space left on device" in err, err
    assert [name for name in _steps(directory) if name.startswith("step-")] == ["step-00000000", "step-00000005"]
    value, _, err, _ = _small(ip, directory, marks, EVERY=5, STEPS=0)
    assert [start for start, _ in value] == [6, 6], err


MISMATCH = """
import torch, torch_xla
ckpt = checkpoints(D, every=1)
model = torch.nn.Linear(4, 3).to(device)
ckpt.save(0, model=model, opt=torch.optim.Adam(model.parameters()))
ckpt.flush()
other = torch.nn.Sequential(torch.nn.Linear(4, 5)).to(device)
wider = torch.nn.Linear(4, 5).to(device)
before = wider.weight.cpu().clone()
said = []
for targets in ({"model": other}, {"model": wider}, {"modle": model}):
    try:
        ckpt.restore(**targets)
    except ValueError as exc:
        said.append(f"{type(exc).__name__}: {exc}")
(said, torch.equal(before, wider.weight.cpu()))
"""


def test_a_restore_into_another_shape_names_the_first_mismatch_and_changes_nothing(ip, tmp_path):
    ip.user_ns["D"] = str(tmp_path / "ckpt")
    value, _, err, _ = spawn_cell(ip, "--devices 1 --backend cpu", MISMATCH)
    (said, unchanged), = value
    assert said == [
        "Mismatch: restore: model.0.weight is not in the checkpoint (model shape (5, 4))",
        "Mismatch: restore: model.weight has the shape (3, 4) in the checkpoint and (5, 4) in the model",
        "Mismatch: restore: modle is not in the checkpoint (it holds model, opt)",
    ], err
    assert unchanged


WORLD = """
import torch, torch_xla
ckpt = checkpoints(D, every=1)
model = torch.nn.Linear(4, 3).to(device)
if SAVE:
    torch.manual_seed(5)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4))
    ckpt.save(7, model=model, lr=0.25)
else:
    ckpt.restore(model=model)
(model.weight.cpu(), ckpt.values)
"""


def test_a_checkpoint_of_another_world_size_restores_the_replicated_state_and_says_the_random_one_was_not(
        ip, tmp_path):
    ip.user_ns.update(D=str(tmp_path / "ckpt"), SAVE=True)
    saved, _, _, _ = spawn_cell(ip, "--devices 2 --backend cpu", WORLD)
    ip.user_ns["SAVE"] = False
    restored, _, err, _ = spawn_cell(ip, "--devices 1 --backend cpu", WORLD)
    assert torch.equal(restored[0][0], saved[0][0]) and restored[0][1] == {"lr": 0.25}
    assert "its random state was not restored: it was saved by 2 ranks and this run has 1" in err, err


CADENCE = """
import time
import torch, torch_xla
by_time = checkpoints(D + "/by-time", every="1s")
once = checkpoints(D + "/once", before="2s")
x = torch.zeros(3, device=device)
for step in range(STEPS):
    x += 1
    torch_xla.sync()
    by_time.save(step, x=x)
    once.save(step, x=x)
    time.sleep(0.02 * (rank + 1))  # the ranks go at different paces; the collectives of a real loop would not
by_time.flush(); once.flush()
[name for name in os.listdir(D + "/by-time")]
"""


def test_a_time_cadence_and_before_are_agreed_once_by_every_rank_as_steps(ip, tmp_path):
    ip.user_ns.update(D=str(tmp_path / "ckpt"), STEPS=200)
    value, _, err, _ = spawn_cell(ip, "--devices 2 --backend cpu", "import os\n" + CADENCE)
    for sub in ("by-time", "once"):
        entries = [name for name in _steps(os.path.join(tmp_path, "ckpt", sub))]
        assert entries and all(name.startswith("step-") for name in entries), (sub, entries, err)
        for name in entries:
            manifest = json.load(open(os.path.join(tmp_path, "ckpt", sub, name, "manifest.json")))
            assert {"rank-0.pt", "rank-1.pt"} <= set(manifest["files"])
    assert len(_steps(os.path.join(tmp_path, "ckpt", "once"))) == 1
    assert len(_steps(os.path.join(tmp_path, "ckpt", "by-time"))) >= 2, err


def test_a_directory_that_cannot_take_checkpoints_is_refused_at_checkpoints_naming_why(ip, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for directory, reason in ((str(blocker / "ckpt"), "Not a directory"), ("gs://bucket/ckpt", "pip install")):
        ip.user_ns["D"] = directory
        with pytest.raises(RankError, match=reason):
            spawn_cell(ip, "--devices 1 --backend cpu", "checkpoints(D, every=10)")
    from xla_magic import checkpoints

    with pytest.raises(RuntimeError, match="inside a %%xla_spawn cell"):
        checkpoints(str(tmp_path), every=10)


# --- the frameworks' own checkpoints, resumed by new ranks, unchanged -----------------------------------------

LIGHTNING = """
from lightning.pytorch.callbacks import ModelCheckpoint
model = Regression()
saving = ModelCheckpoint(dirpath=ROOT + "/checkpoints", save_last=True, every_n_epochs=1)
trainer = L.Trainer(accelerator="tpu", devices="auto", max_epochs=EPOCHS, default_root_dir=ROOT,
                    callbacks=[saving], QUIET)
trainer.fit(model, loader(world_size), ckpt_path="last")
dict(params=params(model), seen=len(model.seen), epoch=trainer.current_epoch)
"""


def test_lightning_resumes_from_its_last_checkpoint_in_new_ranks_unchanged(spawn, tmp_path):
    if importlib.util.find_spec("lightning") is None:  # (not imported here: the kernel side never imports it)
        pytest.skip("needs lightning (the test extra)")
    from test_lightning import MODEL, QUIET, SAMPLES, assert_params_match_reference

    cell = MODEL.replace("{package}", "lightning") + LIGHTNING.replace("QUIET", QUIET)
    first = spawn("--devices 2 --backend cpu", cell, ROOT=str(tmp_path), EPOCHS=2)
    assert [got["epoch"] for got in first.value] == [2, 2]
    assert os.path.exists(tmp_path / "checkpoints" / "last.ckpt")
    resumed = spawn("--devices 2 --backend cpu", cell, ROOT=str(tmp_path), EPOCHS=4)
    assert [got["seen"] for got in resumed.value] == [SAMPLES, SAMPLES]  # two epochs of a half each: 3 and 4 only
    assert_params_match_reference([got["params"] for got in resumed.value], epochs=4)


HF_TRAINER = """
import torch
from transformers import Trainer, TrainingArguments

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
train = [{"x": x[i], "labels": y[i]} for i in range(16)]
args = TrainingArguments(output_dir=out, per_device_train_batch_size=16 // world_size, max_steps=STEPS,
                         learning_rate=0.1, lr_scheduler_type="constant", optim="sgd", save_strategy="steps",
                         save_steps=1, report_to=[], disable_tqdm=True, seed=0, logging_steps=1)
trainer = Trainer(model=Tiny(), args=args, train_dataset=train)
trainer.train(resume_from_checkpoint=RESUME)
(trainer.state.global_step, {n: p.detach().cpu() for n, p in trainer.model.named_parameters()})
"""


def test_the_hf_trainer_resumes_from_its_checkpoint_in_new_ranks_unchanged(spawn, tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (the test extra)")
    out, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
    spawn("--devices 2 --backend cpu", HF_TRAINER, out=out, STEPS=2, RESUME=False)
    assert os.path.isdir(os.path.join(out, "checkpoint-2"))
    resumed = spawn("--devices 2 --backend cpu", HF_TRAINER, out=out, STEPS=4, RESUME=True)
    reference = spawn("--devices 2 --backend cpu", HF_TRAINER, out=straight, STEPS=4, RESUME=False)
    assert [step for step, _ in resumed.value] == [4, 4]
    for name, weight in reference.value[0][1].items():
        assert torch.allclose(resumed.value[0][1][name], weight, atol=1e-6), name


SPMD = """
import torch, torch_xla
import torch_xla.distributed.spmd as xs
torch.manual_seed(SEED)
model = torch.nn.Linear(16, 8).to(device)
xs.mark_sharding(model.weight, mesh, ("data", None))
ckpt = checkpoints(D, every=1)
start = ckpt.restore(model=model)
if not start:
    ckpt.save(3, model=model)
(start, model.weight.cpu(), torch_xla._XLAC._get_xla_sharding_spec(model.weight))
"""


def test_an_spmd_process_saves_its_sharded_state_whole_and_restores_it_in_place_sharded(spawn, tmp_path):
    saved = spawn("--spmd --devices 4", SPMD, D=str(tmp_path / "ckpt"), SEED=0).value
    restored = spawn("--spmd --devices 4", SPMD, D=str(tmp_path / "ckpt"), SEED=1).value
    assert saved[0] == 0 and restored[0] == 4
    assert torch.equal(saved[1], restored[1])
    assert restored[2] == saved[2] and "devices=[4,1]" in restored[2], restored[2]
