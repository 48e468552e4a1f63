"""Compression presets: one flag for a measured setting of every wire.

A preset is a layer of settings between the task's defaults and what the user gives (a config file, flags): any
setting given explicitly wins over the preset's. Each preset's cost and saving on the workload it was chosen on is
in the README and benchmarks/RESULTS.md ("A wire a slow link can carry").
"""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # the leanest setting measured within 1% of a bf16 wire's eval loss after a one-epoch fine-tune of a pretrained
    # tied Llama on 2 stages (the WAN workload, benchmarks/wan_frontier.py): every wire about 37x below bf16's at
    # about +0.5% eval loss, the export the same. Activations and their gradients as 16 coefficients a token in a
    # basis the sender estimates, at 4 bits; the tied embedding's rows as 2-bit changes against the copy both stages
    # loaded, its gradients as 16 coefficients a row at 2 bits; every group's scales as bfloat16
    "wan": {"compression": {"forward": "subspace", "forward_bits": 4, "backward": "subspace", "backward_bits": 4,
                            "subspace_rank": 16, "tie": "aqsgd", "tie_bits": 2, "tie_rank": 16,
                            "scale_dtype": "bfloat16"}},
}


def preset_layer(name: str | None) -> dict[str, Any]:
    """The settings preset `name` stands for (none: no layer); ValueError naming the known ones."""
    if name is None:
        return {}
    if name not in PRESETS:
        raise ValueError(f"compression_preset={name!r}: expected one of {', '.join(PRESETS)}")
    return {key: dict(value) if isinstance(value, dict) else value for key, value in PRESETS[name].items()}
