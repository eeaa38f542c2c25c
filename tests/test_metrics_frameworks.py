"""What Lightning's self.log, the HF Trainer and Accelerate's accelerator.log log reaches the cell's chart, unchanged.

Unchanged framework code in a 2-rank pool of the CPU simulation, in the
shared terminal IPython (so the chart is its text line). What each rank
logged is read back with ``%xla_metrics`` and checked against what the
framework itself kept (Lightning's ``callback_metrics``, the Trainer's
``log_history``), so the framework's own logging is shown to go on.
"""

from __future__ import annotations

import importlib.util

import pytest

needs = {name: importlib.util.find_spec(name) is None for name in ("lightning", "transformers", "accelerate")}

LIGHTNING = """
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
trainer = L.Trainer(accelerator="tpu", devices="auto", max_epochs=3, enable_model_summary=False, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, log_every_n_steps=1)
trainer.fit(Model(), DataLoader(data, batch_size=8))
float(trainer.callback_metrics["train_loss"])
"""

HF = """
import torch
from transformers import Trainer, TrainingArguments

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

g = torch.Generator().manual_seed(1)
rows = [{"x": x, "labels": y} for x, y in zip(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))]
args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=2, learning_rate=0.1,
                         optim="sgd", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
trainer = Trainer(model=Regression(), args=args, train_dataset=rows)
trainer.train()
[(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
"""

ACCELERATE = """
import torch
from accelerate import Accelerator

accelerator = Accelerator()
for step in range(5):
    accelerator.log({"score": torch.tensor(step + rank, dtype=torch.float32, device=accelerator.device),
                     "note": "not a number", "lr": 0.5}, step=step)
"""


def logged(ip, name: str) -> dict[int, list[tuple[int, float]]]:
    table = ip.run_line_magic("xla_metrics", "")
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for rank, step, what, value in zip(table["rank"], table["step"], table["name"], table["value"]):
        if what == name:
            by_rank.setdefault(rank, []).append((step, value))
    return by_rank


@pytest.mark.skipif(needs["lightning"], reason="needs lightning (the test extra)")
def test_lightnings_self_log_reaches_the_chart_and_lightning_keeps_it_too(ip, pool, spawn):
    run = spawn("", LIGHTNING)
    by_rank = logged(ip, "train_loss")
    assert sorted(by_rank) == [0, 1]
    # 32 samples, 2 ranks, batches of 8: 2 steps an epoch, 3 epochs; each rank's own loss, at the trainer's step
    assert [step for step, _ in by_rank[0]] == [step for step, _ in by_rank[1]] == [0, 1, 2, 3, 4, 5]
    assert by_rank[0] != by_rank[1]
    last = [by_rank[rank][-1][1] for rank in (0, 1)]
    assert run.value == pytest.approx(last)  # what Lightning itself kept (its callback_metrics), rank by rank
    assert f"train_loss {sum(last) / 2:.4g} (step 5)" in run.stdout.splitlines()


@pytest.mark.skipif(needs["transformers"], reason="needs transformers (the test extra)")
def test_the_hf_trainers_logs_reach_the_chart_as_the_trainer_keeps_them(ip, pool, spawn, tmp_path):
    run = spawn("", HF, out=str(tmp_path))
    by_rank = logged(ip, "loss")
    assert sorted(by_rank) == [0, 1]
    for rank in (0, 1):  # what the Trainer logged (the ranks' mean loss) is what each rank fed the chart
        assert [(step, round(value, 4)) for step, value in by_rank[rank]] == \
            [(step, round(value, 4)) for step, value in run.value[rank]]
    assert len(by_rank[0]) == 4  # 32 samples, 2 ranks, batches of 8, 2 epochs
    assert sorted(logged(ip, "learning_rate")) == [0, 1]


@pytest.mark.skipif(needs["accelerate"], reason="needs accelerate (the test extra)")
def test_accelerators_log_reaches_the_chart_from_every_rank(ip, pool, spawn):
    run = spawn("", ACCELERATE)
    assert logged(ip, "score") == {0: [(s, float(s)) for s in range(5)], 1: [(s, float(s + 1)) for s in range(5)]}
    assert logged(ip, "note") == {}  # not a number: left to Accelerate's trackers
    lines = run.stdout.splitlines()
    assert "lr 0.5 (step 4) · score 4.5 (step 4)" in lines or "score 4.5 (step 4) · lr 0.5 (step 4)" in lines
