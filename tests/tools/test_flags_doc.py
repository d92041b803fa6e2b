"""docs/flags.md is generated from the parser: it must match what tools/make_flags_doc.py writes
now (regenerate with `make flags-doc` after adding or changing a flag)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "make_flags_doc.py"


def test_docs_flags_md_is_current():
    run = subprocess.run([sys.executable, str(TOOL), "--check", str(REPO / "docs" / "flags.md")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_reference_lists_every_flag_with_its_status(tmp_path):
    from megatron_2bw.arguments import REFUSED_MEGATRON_FLAGS, build_parser

    output = tmp_path / "flags.md"
    subprocess.run([sys.executable, str(TOOL), "--output", str(output)], check=True, timeout=120)
    text = output.read_text()
    flags = {flag for action in build_parser()._actions for flag in action.option_strings
             if flag not in ("-h", "--help")}
    assert all(f"`{flag}`" in text for flag in flags)
    assert "| `--pipeline-model-parallel-size` | N | `1` | supported |" in text
    for flag, reason in REFUSED_MEGATRON_FLAGS.items():
        assert f"| `{flag}` |  | off | refused | {reason} |" in text
    # a stale file is reported, with the command that fixes it
    output.write_text(text.replace("`--num-layers`", "`--num-layer`"))
    stale = subprocess.run([sys.executable, str(TOOL), "--check", str(output)],
                           capture_output=True, text=True, timeout=120)
    assert stale.returncode == 1 and "make flags-doc" in stale.stderr
