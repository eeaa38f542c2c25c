"""What ``checkpoints`` costs a training loop: the saving step, a save that is not due, a cadence. Rank side, one process.

Runs as a script (``python benchmarks/bench_checkpoints.py``, prints a table)
or under benchmarks/run.py (``main()`` returns the rows). It runs the rank's
own code (xla_magic/launcher/checkpoints.py) in one process with one XLA CPU
device (PJRT_DEVICE=CPU), as a rank of the CPU simulation runs it, with no
kernel: what is measured is the rank's side, which is all a step pays.

- The saving step: ``ckpt.save(step, model=..., opt=...)`` when due (it
  returns once the state is on the host; the writing thread writes later)
  against ``.cpu()`` of the same tensors, side by side in alternating
  rounds, each after the writing thread finished the last save. The state
  is about 200 MB: an MLP of four 2048x2048 layers (67 MB) and its Adam
  moments. The issue's target: at most 1.2x.
- A save that is not due, per call, against an empty function called with
  the same arguments. The issue's target: under 5 us.
- A cadence on that state: a 40-step training run with one save in its
  middle against the same run without, alternating; the difference is what
  one save costs the run (the copy, and the writing thread's share of the
  CPU while later steps run), shown as a share of a 10-minute cadence.
  The issue's target: under 1 %.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import timeit

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROUNDS = 7
CADENCE_ROUNDS = 3
STEPS = 40
WIDTH, LAYERS, BATCH = 2048, 4, 16


def _setup():
    import torch
    import torch_xla

    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH).to(device)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()

    step()
    step()  # compiled, and Adam's moments made
    return torch, torch_xla, model, opt, step


def _tensors(model, opt) -> list:
    found = list(model.state_dict().values())
    for state in opt.state.values():
        found += [value for value in state.values() if hasattr(value, "device") and value.device.type == "xla"]
    return found


def main() -> list[tuple]:
    from xla_magic.launcher import checkpoints

    torch, torch_xla, model, opt, step = _setup()
    megabytes = sum(t.numel() * t.element_size() for t in _tensors(model, opt)) / 1e6
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("XLA_MAGIC_BENCH_DIR")) as folder:
        ckpt = checkpoints.checkpoints(os.path.join(folder, "ckpt"), every=1, keep=1)
        saving, copying = [], []
        for round_ in range(ROUNDS):
            for which in ((0, 1) if round_ % 2 else (1, 0)):
                step()
                ckpt.flush()
                started = time.perf_counter()
                if which:
                    ckpt.save(round_ + 1, model=model, opt=opt)
                else:
                    [tensor.cpu() for tensor in _tensors(model, opt)]
                (saving if which else copying).append(time.perf_counter() - started)
        ckpt.flush()
        ratios = [s / c for s, c in zip(saving, copying)]
        rows.append(("checkpoints: the step that saves (state to the host)", statistics.median(saving),
                     statistics.median(copying), "s",
                     f"ckpt.save of {megabytes:.0f} MB (MLP {LAYERS}x{WIDTH}^2 + Adam) against .cpu() of the same "
                     f"tensors, {ROUNDS} alternating rounds, median; median ratio {statistics.median(ratios):.2f} "
                     f"(target <= 1.2)"))

        idle = checkpoints.checkpoints(os.path.join(folder, "idle"), every=10**9)
        idle.save(0, model=model, opt=opt)  # step 0 is due: the calls timed below are not
        idle.flush()

        def empty(step, **state):
            return None

        calls = 200_000
        not_due = min(timeit.repeat(lambda: idle.save(7, model=model, opt=opt), number=calls, repeat=5)) / calls
        baseline = min(timeit.repeat(lambda: empty(7, model=model, opt=opt), number=calls, repeat=5)) / calls
        rows.append(("checkpoints: a save that is not due", not_due * 1e6, baseline * 1e6, "us",
                     f"ckpt.save(step, model=, opt=) not due, best of 5 x {calls:,} calls, against an empty "
                     f"function with the same arguments (target < 5 us)"))

        def run(saves: bool) -> float:
            runner = checkpoints.checkpoints(os.path.join(folder, "cadence"), every=STEPS // 2, keep=1) \
                if saves else None
            started, cpu = time.perf_counter(), time.process_time()
            for index in range(1, STEPS + 1):
                step()
                if runner is not None:
                    runner.save(index, model=model, opt=opt)
            spent = time.perf_counter() - started, time.process_time() - cpu
            if runner is not None:  # its write went on while the later steps ran; what is left of it is not theirs
                runner.flush()
                spent = spent[0], time.process_time() - cpu
            return spent

        with_save, without = [], []
        for round_ in range(CADENCE_ROUNDS):
            for saves in ((True, False) if round_ % 2 else (False, True)):
                (with_save if saves else without).append(run(saves))
        extra = statistics.median(w[0] - wo[0] for w, wo in zip(with_save, without))
        # The process's CPU seconds: what one save costs at most where the step has every core (the copy and
        # the writing thread's serialising, hashing and writing), steadier than the wall time on a loaded machine.
        extra_cpu = statistics.median(w[1] - wo[1] for w, wo in zip(with_save, without))
        rows.append(("checkpoints: one save's cost to a run, as a share of a 10-minute cadence",
                     100 * max(extra, extra_cpu, 0.0) / 600, None, "%",
                     f"{STEPS}-step runs of that model with one save against none, {CADENCE_ROUNDS} alternating "
                     f"rounds: a save adds {extra:.2f} s of wall time and {extra_cpu:.2f} CPU s (medians) to a run "
                     f"of {statistics.median(w[0] for w in without):.1f} s; the larger, /600 s (target < 1 %)"))
    return rows


if __name__ == "__main__":
    for row in main():
        print(row)
