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


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """Each test starts with Python's own SIGINT handler: the Ctrl-C tests (in-process, and subprocesses,
    which inherit an ignored SIGINT) failed in the full suite after an earlier test left SIGINT ignored
    (passing alone). Which test leaves it so is not yet found; this keeps the tests independent."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
