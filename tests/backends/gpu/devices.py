"""The device parameter of the KV/MoE/RL device-path tests: "cpu" stands in for the device (the staging
code runs through the same copies) and runs everywhere; "cuda" is marked gpu and skips without CUDA."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
