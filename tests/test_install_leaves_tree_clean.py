"""Installing from the checkout (make install's editable install, or pip install . which builds
in build/) leaves `git status` clean: what setuptools writes there is ignored."""
import subprocess

from tests.training.runs import ROOT

WRITTEN_BY_INSTALLS = ["build/lib/megatron_2bw/__init__.py", "build/bdist.linux-x86_64/x",
                       "megatron_2bw.egg-info/PKG-INFO", "dist/megatron_2bw-0.1.tar.gz"]


def test_what_installs_write_is_ignored_by_git():
    result = subprocess.run(["git", "check-ignore", "--no-index", "--verbose",
                             *WRITTEN_BY_INSTALLS], cwd=ROOT, capture_output=True, text=True)
    ignored = [line.split("\t")[-1] for line in result.stdout.splitlines()]
    assert ignored == WRITTEN_BY_INSTALLS, result.stdout + result.stderr
