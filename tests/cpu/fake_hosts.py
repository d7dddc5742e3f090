"""Real fake machines: sysfs, DMI and /dev trees and a neuron-ls script laid out on disk."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path


def neuron_sysfs(root: Path, *, chips: int, arch_type: str = "Trn2",
                 device_name: str = "Trainium2", instance_type: str | None = None,
                 core_count: int = 8, dev_nodes: bool = True) -> None:
    base = root / "sys/devices/virtual/neuron_device"
    for i in range(chips):
        arch = base / f"neuron{i}" / "info" / "architecture"
        arch.mkdir(parents=True)
        (arch / "arch_type").write_text(arch_type + "\n")
        (arch / "device_name").write_text(device_name + "\n")
        if instance_type is not None:
            (arch / "instance_type").write_text(instance_type + "\n")
        cc = base / f"neuron{i}" / "core_count"
        cc.write_text(f"{core_count}\n")
        os.chmod(cc, 0o400)
    if dev_nodes:
        devdir = root / "dev"
        devdir.mkdir(exist_ok=True)
        for i in range(chips):
            (devdir / f"neuron{i}").write_text("")


def dev_nodes(root: Path, chips: int) -> None:
    devdir = root / "dev"
    devdir.mkdir(exist_ok=True)
    for i in range(chips):
        (devdir / f"neuron{i}").write_text("")


def dmi(root: Path, product: str, vendor: str = "Amazon EC2") -> None:
    d = root / "sys/devices/virtual/dmi/id"
    d.mkdir(parents=True)
    (d / "product_name").write_text(product + "\n")
    (d / "sys_vendor").write_text(vendor + "\n")


def neuron_ls(bindir: Path, *, output: str | bytes | None = None, chips: int = 16,
              nc: int = 4, memory: int = 103079215104, lnc: int | None = 2,
              sleep: float = 0) -> Path:
    """A neuron-ls executable printing `output` (bytes: written as they are), or a
    trn2-like JSON list."""
    bindir.mkdir(parents=True, exist_ok=True)
    if output is None:
        rows = []
        for i in range(chips):
            row = {"neuron_device": i, "bdf": f"{i:02x}:00.0", "nc_count": nc,
                   "memory_size": memory, "neuroncore_ids": list(range(i * nc, (i + 1) * nc)),
                   "neuron_processes": []}
            if lnc is not None:
                row["logical_neuroncore_config"] = lnc
            rows.append(row)
        output = json.dumps(rows)
    script = bindir / "neuron-ls"
    # A Python script named by absolute path, so it runs whatever PATH the test sets.
    say = (f"import sys\nsys.stdout.buffer.write({output!r})\n" if isinstance(output, bytes)
           else f"print({output!r})\n")
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep({sleep})\n{say}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bindir


def install_providers(root: Path, module: str, source: str, entry_points: dict[str, str]) -> Path:
    """Lay out a module and its dist-info with ``jax_remat_policy`` entry points under
    `root`, the way pip leaves an installed distribution; put `root` on sys.path to find
    them through importlib.metadata."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {module}:{attr}\n" for name, attr in entry_points.items())
    (info / "entry_points.txt").write_text(f"[jax_remat_policy]\n{lines}")
    return root
