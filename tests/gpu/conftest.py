"""Every test here runs on a CUDA device (`make gpu-check`); without one they are skipped, which
is all a machine without a GPU can honestly say about them."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(no_gpu)


@pytest.fixture
def device():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons against the CPU
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")
