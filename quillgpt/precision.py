"""The precisions a run can use and the torch dtypes behind them: one table for training, evaluation and sampling."""

from __future__ import annotations

from contextlib import nullcontext

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# sample.py's --dtype also takes int8: weight-only int8 matmuls whose activations run in bf16
SAMPLING_DTYPES = {**PRECISIONS, "int8": torch.bfloat16}


def autocast(device_type: str, precision: str):
    """The autocast context a forward pass runs under: none for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type, dtype=PRECISIONS[precision])
