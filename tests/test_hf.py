"""Unchanged HF Accelerate and HF Trainer code in %%xla_spawn cells sees the rank it is in.

The cells are code as Accelerate's and transformers' docs write it, with no
import of ours, on ranks of the CPU simulation: process index, local
process index, world size, the main-process flags and the device are what a
single TPU host gives (Accelerate's at 8 ranks; the Trainer, which takes its
ranks from Accelerate's state, at 2: the same sharding, averaging, logging and
saving, for a quarter of the processes compiling its graphs). Every result is checked against one plain process:
Accelerate's against plain torch here (SGD over the same global batches),
the Trainer's against the same Trainer code run in a subprocess on the CPU
with torch_xla switched off (``USE_TORCH_XLA=0``, both libraries' own switch).
The kernel (this process) never imports either library: both import torch_xla.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import kernel_is_xla_free
from helpers import strip_ansi
from xla_magic.runs.errors import RankError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None,
    reason="needs accelerate and transformers (the test extra)",
)

RANKS = 8
TRAINER_RANKS = 2

ACCELERATE = """
import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) / 100
y = x.sum(1, keepdim=True) * 0.5
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for xb, yb in loader:
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
last_losses = accelerator.gather(loss.detach()[None])
accelerator.wait_for_everyone()
if accelerator.is_local_main_process:
    print("the local main process")
accelerator.save(accelerator.unwrap_model(model).state_dict(), path)
state = accelerator.state
{"process_index": accelerator.process_index, "local_process_index": accelerator.local_process_index,
 "num_processes": accelerator.num_processes, "is_main_process": accelerator.is_main_process,
 "is_local_main_process": accelerator.is_local_main_process, "device": str(accelerator.device),
 "distributed_type": str(state.distributed_type), "last_losses": last_losses.cpu(),
 "weight": accelerator.unwrap_model(model).weight.detach().cpu(), "bias": accelerator.unwrap_model(model).bias.detach().cpu()}
"""


def accelerate_reference(ranks: int) -> dict[str, torch.Tensor]:
    """What the cell computes, in one process: each step sees the ranks' batches together."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) / 100
    y = x.sum(1, keepdim=True) * 0.5
    steps = list(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4 * ranks))
    for step, (xb, yb) in enumerate(steps):
        if step == len(steps) - 1:  # each rank's loss on its own quarter of the last step
            with torch.no_grad():
                last_losses = torch.stack([torch.nn.functional.mse_loss(model(xs), ys)
                                           for xs, ys in zip(xb.split(4), yb.split(4))])
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"weight": model.weight.detach(), "bias": model.bias.detach(), "last_losses": last_losses}


def test_accelerate_code_runs_unchanged_at_8_ranks_as_one_process_computes(spawn, tmp_path):
    path = str(tmp_path / "model.pt")
    run = spawn(f"--devices {RANKS}", ACCELERATE, path=path)
    expected = accelerate_reference(RANKS)
    for rank, got in enumerate(run.value):
        assert got["process_index"] == got["local_process_index"] == rank
        assert got["num_processes"] == RANKS
        assert got["is_main_process"] is got["is_local_main_process"] is (rank == 0)
        assert got["device"] == "xla:0" and got["distributed_type"] == "DistributedType.XLA"
        assert torch.allclose(got["last_losses"], expected["last_losses"], atol=1e-6)
        assert torch.allclose(got["weight"], expected["weight"], atol=1e-6)
        assert torch.allclose(got["bias"], expected["bias"], atol=1e-6)
    assert [line for line in run.lines() if "the local main process" in line] == ["[rank 0] the local main process"]
    saved = torch.load(path)
    assert torch.allclose(saved["weight"], expected["weight"], atol=1e-6)
    assert kernel_is_xla_free()


TRAINER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
tokens = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))
train = [{"input_ids": row, "labels": row} for row in tokens]
evaluation = [{"input_ids": row, "labels": row} for row in tokens.flip(1)]
# One step per epoch that sees all 16 samples, so the order the sampler draws them in does not matter.
args = TrainingArguments(output_dir=out, per_device_train_batch_size=16 // world_size,
                         per_device_eval_batch_size=16 // world_size, num_train_epochs=2, learning_rate=1e-2,
                         lr_scheduler_type="constant",
                         logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0OPTIM)
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
trainer.train()
metrics = trainer.evaluate()
trainer.save_model(out)
{"process_index": args.process_index, "local_process_index": args.local_process_index,
 "world_size": args.world_size, "should_log": args.should_log, "should_save": args.should_save,
 "device": str(args.device), "eval_loss": metrics["eval_loss"],
 "weights": {name: p.detach().cpu() for name, p in trainer.model.named_parameters()}}
"""

# The same cell's code in one plain process: no torch_xla, the CPU device, one "rank".
REFERENCE = """
import ast, json, sys, torch
source, out = sys.argv[1], sys.argv[2]
tree = ast.parse(source)
last = ast.Expression(tree.body.pop().value)
names = {"world_size": 1, "out": out}
exec(compile(tree, "<reference>", "exec"), names)
result = eval(compile(last, "<reference>", "eval"), names)
torch.save(result.pop("weights"), out + "/weights.pt")
json.dump(result, open(out + "/result.json", "w"))
"""


def start_trainer_reference(source: str, out: str) -> subprocess.Popen:
    env = {**os.environ, "USE_TORCH_XLA": "0", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", REFERENCE, source, out], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def trainer_reference(process: subprocess.Popen, out: str) -> tuple[dict, dict[str, torch.Tensor]]:
    _, errors = process.communicate(timeout=600)
    assert process.returncode == 0, errors
    with open(os.path.join(out, "result.json")) as result:
        return json.load(result), torch.load(os.path.join(out, "weights.pt"))


# Two ranks compiling the Trainer's graphs on two cores: the bound only catches a hang (eight ranks took
# 165-200 s on a loaded machine); it is not a speed check.
@pytest.mark.timeout(900)
def test_hf_trainer_trains_evaluates_and_saves_across_ranks_as_one_process_does(spawn, tmp_path):
    from safetensors.torch import load_file  # imports torch only

    source = TRAINER.replace("OPTIM", ', optim="adamw_torch"')
    (tmp_path / "ranks").mkdir()
    (tmp_path / "one").mkdir()
    reference = start_trainer_reference(source, str(tmp_path / "one"))  # meanwhile
    try:
        run = spawn(f"--devices {TRAINER_RANKS}", source, out=str(tmp_path / "ranks"))
    finally:
        expected, expected_weights = trainer_reference(reference, str(tmp_path / "one"))
    assert expected["device"] == "cpu" and expected["world_size"] == 1
    assert len(run.value) == TRAINER_RANKS
    for rank, got in enumerate(run.value):
        assert got["process_index"] == got["local_process_index"] == rank
        assert got["world_size"] == TRAINER_RANKS
        assert got["should_log"] is got["should_save"] is (rank == 0)
        assert got["device"] == "xla:0"
        assert abs(got["eval_loss"] - expected["eval_loss"]) < 1e-4
        for name, weight in expected_weights.items():
            # Adam divides by the gradients' size: float noise in tiny gradients grows a little.
            assert torch.allclose(got["weights"][name], weight, atol=2e-4), name
    # The Trainer logs from the local main process only (PrinterCallback, with disable_tqdm).
    logged = [line for line in run.lines() if "'loss'" in line]
    assert len(logged) == 2 and all(line.startswith("[rank 0] {") for line in logged), logged
    saved = load_file(str(tmp_path / "ranks" / "model.safetensors"))
    for name, weight in expected_weights.items():
        assert torch.allclose(saved[name], weight, atol=2e-4), name
    assert kernel_is_xla_free()


def test_hf_trainers_default_fused_adamw_says_what_to_do(spawn, tmp_path):
    with pytest.raises(RankError) as info:
        spawn("--devices 1", TRAINER.replace("OPTIM", ""), out=str(tmp_path))  # at its first step
    text = strip_ansi("\n".join(info.value._render_traceback_()))
    assert "`fused=True` requires all the params to be floating point Tensors of supported devices" in text
    assert 'What to do: ' in text and 'optim="adamw_torch"' in text


def test_accelerate_sees_the_ranks_of_the_tpu_launch_path(spawn, monkeypatch):
    """Ranks as threads of one process, as on TPU v2/v3: torch_xla's own ordinals, per thread."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path, as CPU threads
    cell = ("from accelerate import Accelerator\n"
            "accelerator = Accelerator()\n"
            "(accelerator.process_index, accelerator.local_process_index, accelerator.num_processes,\n"
            " accelerator.is_local_main_process, str(accelerator.device) == str(device))")
    run = spawn("--devices 2 --backend tpu", cell)
    assert run.value == [(0, 0, 2, True, True), (1, 1, 2, False, True)]
