"""Suite-wide fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    """Loading a llama.cpp model gives the cores to llama.cpp (torch keeps one thread, process-wide):
    restore torch's threads after each module so later torch-heavy tests run at full speed."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
