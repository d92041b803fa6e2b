import signal
import subprocess
import sys
import time

HANGS = '''
import ctypes


def test_finishes():
    pass


def test_holds_the_gil_in_c():
    # PyDLL keeps the GIL across the call: no Python signal handler could run
    ctypes.PyDLL(None).sleep(600)


def test_after_the_hang():
    pass
'''


def _pytest(tmp_path, *options):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "tests.hang_timeout",
                             "-p", "no:cacheprovider", *options, "test_hangs.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - start


def test_the_suite_has_a_per_test_limit(pytestconfig):
    assert 0 < float(pytestconfig.getini("test_timeout")) <= 900


def test_a_test_hung_in_c_ends_the_run_with_its_stack(tmp_path):
    result, seconds = _pytest(tmp_path, "-o", "test_timeout=3")
    assert result.returncode == -signal.SIGALRM, result.stdout + result.stderr
    assert "test_finishes PASSED" in result.stdout
    assert ", line 11 in test_holds_the_gil_in_c" in result.stderr  # the hung test's own frame
    assert "test_after_the_hang" not in result.stdout + result.stderr
    assert seconds < 120


def test_the_limit_must_be_a_number(tmp_path):
    result, _ = _pytest(tmp_path, "-o", "test_timeout=ten")
    assert result.returncode != 0
    assert "test_timeout: expected a number of seconds, got 'ten'" in result.stderr
