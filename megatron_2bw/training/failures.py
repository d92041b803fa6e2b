"""A failing rank ends the whole job loudly: its layout coordinates, stage and last schedule
actions, then a non-zero exit the launcher acts on; bad flags get one line and exit code 2."""
from __future__ import annotations

import os
import sys
import time
import traceback

from megatron_2bw.config import ConfigError
from megatron_2bw.distributed.error_file import ERROR_FILE_VARIABLE, record_failure
from megatron_2bw.distributed.launch import exit_process
from megatron_2bw.training.exit_request import INTERRUPTED_EXIT_CODE

FAILURE_CONTEXT: dict = {}
# a bad input's other ranks wait this long before exiting, so that rank 0 prints the job's line
# before torchrun, which stops the remaining ranks when the first one exits, stops it
RANK_0_GRACE_SECONDS = 2.0


def run_and_report(main) -> None:
    """Run `main()`; on any failure print the rank's layout coordinates, stage and last schedule
    actions, then end this process at once (non-zero) so the launcher stops the whole job."""
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before training began (or in a tool): one line, no trace
        if _global_rank() == 0:
            print(f"{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr, flush=True)
        exit_process(INTERRUPTED_EXIT_CODE)
    except ConfigError as error:
        # every rank checks the same flags: rank 0 prints the line, once for the job; under
        # torchrun the others leave it in their error file (a rank that alone fails is then
        # named by torchrun's summary), elsewhere they print it too, so that none fails silently
        name = os.path.basename(sys.argv[0])
        under_torchrun = bool(os.environ.get(ERROR_FILE_VARIABLE))
        if _global_rank() == 0 or not under_torchrun:
            print(f"{name}: error: {error}", file=sys.stderr, flush=True)
        record_failure(f"{name}: error: {error}")
        if under_torchrun and _global_rank() != 0:
            time.sleep(RANK_0_GRACE_SECONDS)  # torchrun stops every rank once one exits
        exit_process(2)
    except BaseException as error:  # noqa: BLE001 - every failure must end the job loudly
        if isinstance(error, SystemExit) and not error.code:  # --help, a requested exit
            exit_process(0)
        layout = FAILURE_CONTEXT.get("layout")
        stage = FAILURE_CONTEXT.get("stage")
        where = layout.describe() if layout else f"rank {os.environ.get('RANK', '?')}"
        if layout is not None:
            where += f", stage {layout.stage}"
        history = stage.executor.describe_history() if stage else "(not started)"
        traceback.print_exc()
        failure = f"FAILED: {where}: {type(error).__name__}: {error}"
        print(f"{failure}\n  last schedule actions: {history}", file=sys.stderr, flush=True)
        record_failure(failure)
        exit_process(1)
    else:
        exit_process(0)


def _global_rank() -> int:
    """This process's rank in the job: the layout's once started, the launcher's before."""
    layout = FAILURE_CONTEXT.get("layout")
    return layout.rank if layout is not None else int(os.environ.get("RANK", "0"))
