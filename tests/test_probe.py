"""Device discovery and placement: the real probe reading a /sys tree made in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
from IPython.core.error import UsageError

from xla_magic.ranks import probe

GOOGLE = probe.GOOGLE_PCI_VENDOR
INTEL = "0x8086"


def fake_sys(root: Path, devices: list[tuple[str, str]]) -> str:
    """A /sys with these (vendor, device) PCI functions under bus/pci/devices."""
    base = root / "bus" / "pci" / "devices"
    base.mkdir(parents=True)
    for slot, (vendor, device) in enumerate(devices):
        function = base / f"0000:00:{slot + 4:02x}.0"
        function.mkdir()
        (function / "vendor").write_text(vendor + "\n")
        (function / "device").write_text(device + "\n")
    return str(root)


@pytest.fixture(autouse=True)
def no_pjrt_device(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)


def test_v2_v3_chips_give_two_devices_each(tmp_path):
    root = fake_sys(tmp_path, [(GOOGLE, "0x0027")] * 4 + [(INTEL, "0x1234")])
    host = probe.find_tpu(root)
    assert host == probe.TpuHost("v2/v3", chips=4, devices_per_chip=2)
    assert host.devices == 8
    assert probe.place("auto", None, root) == probe.Placement("tpu", 8)
    assert probe.place("tpu", 1, root) == probe.Placement("tpu", 1)


def test_v4_chips_give_one_device_each(tmp_path):
    root = fake_sys(tmp_path, [(GOOGLE, "0x005e")] * 4)
    assert probe.find_tpu(root) == probe.TpuHost("v4", chips=4, devices_per_chip=1)
    assert probe.place("auto", None, root) == probe.Placement("tpu", 4)


def test_7x_chips_give_two_devices_each(tmp_path):
    root = fake_sys(tmp_path, [(GOOGLE, "0x0076")] * 4)  # torch_xla: one process per chip, two devices in it
    assert probe.find_tpu(root) == probe.TpuHost("v7x", chips=4, devices_per_chip=2)
    assert probe.place("auto", None, root) == probe.Placement("tpu", 8)


@pytest.mark.parametrize("generation_id, devices, refused, allowed", [
    ("0x0027", 4, 4, "1 or 8"),
    ("0x005e", 8, 8, "1 or 4"),
])
def test_counts_between_one_and_all_are_refused(tmp_path, generation_id, devices, refused, allowed):
    root = fake_sys(tmp_path, [(GOOGLE, generation_id)] * 4)
    with pytest.raises(probe.PlacementError, match=f"--devices can be {allowed}, not {refused}"):
        probe.place("tpu", devices, root)


def test_other_vendors_and_unknown_google_devices_are_not_tpus(tmp_path):
    root = fake_sys(tmp_path, [(INTEL, "0x0027"), (GOOGLE, "0xffff")])
    assert probe.find_tpu(root) is None
    assert probe.place("auto", None, root) == probe.Placement("cpu", 8)
    with pytest.raises(probe.PlacementError, match="no TPU was found"):
        probe.place("tpu", None, root)


def test_pjrt_device_tpu_without_visible_chips_runs_one_device_only(tmp_path, monkeypatch):
    root = fake_sys(tmp_path, [])
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert probe.auto_backend(root) == "tpu"
    assert probe.place("auto", None, root) == probe.Placement("tpu", 1)
    assert probe.place("tpu", 1, root) == probe.Placement("tpu", 1)
    with pytest.raises(probe.PlacementError, match="PJRT_DEVICE=TPU is set, but no TPU chip.*--devices 1"):
        probe.place("tpu", 2, root)


def test_pjrt_device_cpu_runs_the_tpu_path_as_threads(tmp_path, monkeypatch):
    root = fake_sys(tmp_path, [])
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert probe.place("tpu", None, root) == probe.Placement("tpu", 8, cpu_threads=True)
    with pytest.raises(probe.PlacementError, match="1 to 64 threads, not 65"):
        probe.place("tpu", 65, root)


@pytest.mark.parametrize("devices", [0, -3])
def test_place_refuses_fewer_than_one_device(tmp_path, devices):
    with pytest.raises(probe.PlacementError, match=f"at least 1, not {devices}"):
        probe.place("cpu", devices, fake_sys(tmp_path, []))


def test_the_magic_refuses_several_devices_it_cannot_count(spawn, monkeypatch):
    """This host has no TPU under /sys: the refusal comes before anything starts."""
    if probe.find_tpu() is not None:
        pytest.skip("this host has TPU chips")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(UsageError, match="no TPU chip shows under /sys/bus/pci") as info:
        spawn("--backend tpu --devices 2", "rank")
    assert type(info.value) is UsageError


def test_every_chip_torch_xla_counts_as_a_tpu_is_one_here(tmp_path):
    # torch_xla's own probe (torch_xla/_internal/tpu.py), read without importing torch_xla into this process:
    # a TPU it knows and this probe did not would run the CPU simulation there, with the compile cache off.
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch_xla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch_xla is not installed here")
    source = Path(next(iter(spec.submodule_search_locations)), "_internal", "tpu.py").read_text()
    assigned = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", "") == "_TPU_PCI_DEVICE_IDS")
    theirs = set(ast.literal_eval(assigned.value)) - {"0x0056"}  # "Testing only", no chip anyone runs on
    assert theirs and theirs <= set(probe.TPU_PCI_DEVICES), theirs - set(probe.TPU_PCI_DEVICES)
    for index, device in enumerate(sorted(theirs)):
        root = fake_sys(tmp_path / str(index), [(GOOGLE, device)] * 4)
        assert probe.place("auto", None, root).backend == "tpu", device
