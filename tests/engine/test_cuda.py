"""The CUDA checks of benchmarks/gpu_check.py under pytest, parametrised by device: skipped
where CUDA is unavailable. On the CPU: randomness does not depend on the device argument."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specdecode.core.probs import exponential_noise, sample
from specdecode.core.verify import Randomness

_spec = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_greedy_identity_on_device(device, dtype):
    gpu_check.check_greedy_identity(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_identity_with_trees_on_device(device):
    gpu_check.check_greedy_identity(device, torch.float32, tree=4)


@pytest.mark.parametrize("device", DEVICES)
def test_same_sample_as_on_the_cpu(device):
    gpu_check.check_same_sample_as_cpu(device)


@pytest.mark.parametrize("device", DEVICES)
def test_exactness_on_device(device):
    """Chi-square, false-failure probability 1e-3 (fixed seeds); the negative control must fail."""
    gpu_check.check_exactness(device)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_randomness_for_a_seed_does_not_depend_on_the_device_argument(device):
    """Drawn on the generator's device (the CPU) and then moved: the same numbers whatever
    device p lives on (here the explicit-device path with the CPU as target)."""
    plain = Randomness.draw(2, 3, torch.Generator().manual_seed(5))
    moved = Randomness.draw(2, 3, torch.Generator().manual_seed(5), device=device)
    assert moved.u.device.type == moved.v.device.type == "cpu"
    assert torch.equal(plain.u, moved.u) and torch.equal(plain.v, moved.v)
    a = exponential_noise((4, 9), torch.Generator().manual_seed(3), dtype=torch.float32)
    b = exponential_noise((4, 9), torch.Generator().manual_seed(3), dtype=torch.float32, device=device)
    assert torch.equal(a, b)
    probs = torch.softmax(torch.randn(3, 9, generator=torch.Generator().manual_seed(1)), -1).to(device)
    assert torch.equal(sample(probs, torch.Generator().manual_seed(8)),
                       sample(probs.cpu(), torch.Generator().manual_seed(8)))
