"""The root cause of a failed rank, written where torchrun looks for it.

torchrun (torch.distributed.elastic) gives every worker an error file (TORCHELASTIC_ERROR_FILE)
and, when the job fails, prints a summary of the first failure from it: the rank, its exit code
and the recorded message. Without the file the summary only says "To enable traceback see ...".
The rank records its one-line error (its traceback went to its own stderr already), so the
summary, the last thing torchrun prints, names the rank and the message."""
from __future__ import annotations

import json
import os
import time

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"


def record_failure(message: str) -> None:
    """Write `message` to this worker's error file in torch.distributed.elastic's format (no-op
    outside torchrun; never raises: the failure being reported matters more)."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message,  # shown as the summary's traceback
                                      "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
