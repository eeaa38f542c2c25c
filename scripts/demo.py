"""The main job on the CPU simulation: one cell on 8 simulated devices.

Runs a real IPython shell exactly as a notebook would: %load_ext, a notebook
function, then a %%xla_spawn cell whose output is tagged by rank and whose
results come back as a list.
"""

from IPython.testing.globalipapp import start_ipython

CELLS = [
    "%load_ext xla_magic",
    "def describe(value):\n    return f'rank {rank} of {world_size} on {device}: {value}'",
    "%%xla_spawn --devices 8\n"
    "import torch\n"
    "x = torch.ones(3, device=device) * rank\n"
    "print('hello from', rank)\n"
    "print(describe(float(x.sum().cpu())))\n"
    "float(x.sum().cpu())",
]


def main() -> None:
    shell = start_ipython()
    for cell in CELLS:
        print(f"\nIn: {cell}")
        shell.run_cell(cell).raise_error()


if __name__ == "__main__":
    main()
