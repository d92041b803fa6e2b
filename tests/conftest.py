import os
import sys

import torch

# The tests run from a checkout without an install: this process imports the package from the
# repository root, and so do the tools and entry points it starts as subprocesses.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPO_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
torch.set_num_threads(1)
