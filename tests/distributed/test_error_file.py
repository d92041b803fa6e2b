"""The one-line error a failed rank records for torchrun, in torch.distributed.elastic's format
(torchrun's summary reads it: tests/functional/test_faults.py)."""
import json

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron_2bw.distributed.error_file import ERROR_FILE_VARIABLE, record_failure


def test_torchrun_reads_the_recorded_line_as_the_failures_message(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_VARIABLE, str(path))
    record_failure("FAILED: rank 1 (tp=0/1, dp=0/1, pp=1/2), stage 1: RuntimeError: boom")
    failure = ProcessFailure(local_rank=1, pid=42, exitcode=1, error_file=str(path))
    assert failure.message["message"].startswith("FAILED: rank 1")
    assert json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"] == \
        "FAILED: rank 1 (tp=0/1, dp=0/1, pp=1/2), stage 1: RuntimeError: boom"


def test_outside_torchrun_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(ERROR_FILE_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    record_failure("anything")
    assert list(tmp_path.iterdir()) == []
