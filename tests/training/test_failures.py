"""A failure before or during training: one line, the process ended with the right code."""
import sys

from megatron_2bw.training import failures
from megatron_2bw.training.exit_request import INTERRUPTED_EXIT_CODE


def test_ctrl_c_before_training_ends_the_process_with_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt
    exits = []
    monkeypatch.setattr(failures, "exit_process", exits.append)
    monkeypatch.setattr(failures, "FAILURE_CONTEXT", {})
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    monkeypatch.delenv("RANK", raising=False)
    failures.run_and_report(interrupted)
    assert exits == [INTERRUPTED_EXIT_CODE]
    assert capsys.readouterr().err == "pretrain_gpt.py: interrupted\n"  # no traceback
    monkeypatch.setenv("RANK", "1")
    failures.run_and_report(interrupted)
    assert capsys.readouterr().err == ""  # one line for the job: rank 0's
