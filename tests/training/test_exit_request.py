"""Stopping: Ctrl-C once stops at the next drain, again aborts."""
from megatron_2bw.config import Config
from megatron_2bw.training import exit_request
from megatron_2bw.training.exit_request import INTERRUPTED_EXIT_CODE


def test_ctrl_c_twice_within_the_window_is_one_interrupt_and_later_aborts(monkeypatch, capfd):
    """The terminal's Ctrl-C and torchrun's forwarded SIGINT arrive together: one interrupt (stop
    at the next drain); a press after SAME_INTERRUPT_S aborts at once, and so does the SIGTERM
    torchrun sends the workers on a second Ctrl-C of its own."""
    import signal
    found = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in the background
    installed, exits = {}, []
    monkeypatch.setattr(exit_request.signal, "signal",
                        lambda sig, handler: installed.update({sig: handler}))
    monkeypatch.setattr(exit_request.os, "_exit", lambda code: exits.append(code))
    clock = {"now": 100.0}
    request = exit_request.ExitRequest(Config(), 0.0, announce=True, clock=lambda: clock["now"])
    request.next_drain = 40
    assert installed[signal.SIGINT] == request._interrupt
    assert signal.SIGTERM not in installed  # without --exit-signal-handler, SIGTERM is left alone
    installed[signal.SIGINT](signal.SIGINT, None)
    clock["now"] += exit_request.SAME_INTERRUPT_S / 2
    installed[signal.SIGINT](signal.SIGINT, None)  # the same Ctrl-C, forwarded
    assert request.signalled and exits == []
    err = capfd.readouterr().err
    assert err.count("interrupted (Ctrl-C): stopping at iteration 40") == 1
    clock["now"] += exit_request.SAME_INTERRUPT_S
    installed[signal.SIGINT](signal.SIGINT, None)
    assert exits == [INTERRUPTED_EXIT_CODE]
    installed[signal.SIGTERM](signal.SIGTERM, None)  # torchrun's escalation
    assert exits == [INTERRUPTED_EXIT_CODE] * 2
    assert capfd.readouterr().err.count("aborting without a checkpoint") == 2
    with request:  # training ends: the handlers found at the start are back
        pass
    assert installed[signal.SIGINT] == found
