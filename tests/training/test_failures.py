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


def test_a_bad_input_is_one_line_under_torchrun_and_every_rank_records_it(tmp_path, monkeypatch,
                                                                      capsys):
    from megatron_2bw.config import ConfigError
    from megatron_2bw.distributed.error_file import ERROR_FILE_VARIABLE

    def bad_flag():
        raise ConfigError("--data-path x: x.idx not found")
    exits = []
    monkeypatch.setattr(failures, "exit_process", exits.append)
    monkeypatch.setattr(failures, "FAILURE_CONTEXT", {})  # before the processes are up
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    monkeypatch.setenv(ERROR_FILE_VARIABLE, str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")
    waits = []
    monkeypatch.setattr(failures.time, "sleep", waits.append)
    failures.run_and_report(bad_flag)
    assert capsys.readouterr().err == "" and waits == [failures.RANK_0_GRACE_SECONDS]
    assert "--data-path x: x.idx not found" in (tmp_path / "error.json").read_text()
    monkeypatch.setenv("RANK", "0")
    failures.run_and_report(bad_flag)
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --data-path x: x.idx not found\n"
    monkeypatch.delenv(ERROR_FILE_VARIABLE)  # another launcher: no summary would name it
    monkeypatch.setenv("RANK", "1")
    failures.run_and_report(bad_flag)
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --data-path x: x.idx not found\n"
    assert exits == [2, 2, 2]


def test_under_torchrun_the_line_is_printed_once_and_the_summary_names_exit_code_2(tmp_path):
    """What docs/troubleshooting.md says a user sees: the line once, then torchrun's report of
    the failed worker (its Root Cause repeats the line with exitcode 2); torchrun exits 1."""
    import subprocess

    from tests.training.runs import MODEL, ROOT
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "pretrain_gpt.py", *MODEL, "--global-batch-size", "4", "--lr", "1e-3",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
         "--data-path", str(tmp_path / "missing")],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    line = (f"pretrain_gpt.py: error: --data-path {tmp_path}/missing: {tmp_path}/missing.idx not "
            f"found (a dataset prefix names PREFIX.bin and PREFIX.idx, as tools/preprocess_data.py "
            f"writes them)")
    # rank 0's (torchrun may stop it first on a loaded machine: then the summary's alone)
    printed = [text for text in output.splitlines() if text.startswith("pretrain_gpt.py: error:")]
    assert printed in ([line], []), output
    assert result.returncode == 1
    assert "Root Cause" in output and f"traceback : {line}" in output
    assert "exitcode  : 2" in output
