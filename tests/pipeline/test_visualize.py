import importlib.util
from pathlib import Path

import matplotlib.colors as mcolors
import pytest
from matplotlib.figure import Figure

from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.visualize import (IDLE_COLOUR, ScheduleShape, bubble_fraction,
                                             draw_timeline, makespan, timed_schedule,
                                             version_colour)

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "visualize_schedule.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_tool():
    spec = importlib.util.spec_from_file_location("visualize_schedule", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.mark.parametrize("schedule", ["flush", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8)])
def test_flushed_schedules_have_the_textbook_bubble(schedule, p, m):
    timed = timed_schedule(ScheduleShape(schedule, p, m, 1))
    assert makespan(timed) == (m + p - 1) * 3.0
    assert bubble_fraction(timed) == pytest.approx((p - 1) / (m + p - 1))


def test_2bw_bubble_shrinks_with_batches_and_beats_flush():
    few, many = (bubble_fraction(timed_schedule(ScheduleShape("2bw", 4, 4, n))) for n in (3, 30))
    flush = bubble_fraction(timed_schedule(ScheduleShape("flush", 4, 4, 30)))
    assert many < few < flush
    assert many < 0.05  # only fill and drain remain
    assert flush == pytest.approx(3 / 7)


def test_boxes_are_the_action_lists_coloured_by_version():
    shape = ScheduleShape("2bw", 3, 3, 3)
    timed = timed_schedule(shape)
    fig = Figure()
    ax = fig.subplots()
    draw_timeline(ax, timed, "t")
    actions = S.build_schedule("2bw", 3, 3, 3)
    computes = [a for row in actions for a in row if a.kind in S.COMPUTE_KINDS]
    labels = [t.get_text() for t in ax.texts if not t.get_text().startswith("v")]
    assert sorted(labels) == sorted(str(a.microbatch) for a in computes)
    solid = [patch for patch in ax.patches if patch.get_hatch() is None]
    hatched = [patch for patch in ax.patches if patch.get_hatch() == "///"]
    assert len(hatched) == sum(a.kind == S.BACKWARD for a in computes)
    assert len(solid) == sum(a.kind == S.FORWARD for a in computes) + shape.stages  # + idle rows
    used = {a.version for a in computes}
    assert used == {0, 1}  # 2bw: batches 0 and 1 share v0, batch 2 uses v1
    expected = {mcolors.to_rgb(version_colour(v)) for v in used} | {mcolors.to_rgb(IDLE_COLOUR)}
    assert {tuple(patch.get_facecolor()[:3]) for patch in solid} == expected
    step_labels = [t.get_text() for t in ax.texts if t.get_text().startswith("v")]
    assert step_labels.count("v1") == shape.stages  # the deferred step, once per stage


def test_cli_writes_png_and_text(tmp_path, capsys):
    output = tmp_path / "schedule.png"
    tool.main(["--schedule", "2bw", "--pipeline-stages", "4", "--microbatches", "4", "--batches",
               "3", "--output", str(output), "--text"])
    assert output.read_bytes()[:8] == PNG_SIGNATURE
    printed = capsys.readouterr().out
    assert S.render(S.build_schedule("2bw", 4, 4, 3)) in printed
    compare = tmp_path / "compare.png"
    tool.main(["--compare", "2bw,flush,gpipe", "--pipeline-stages", "2", "--microbatches", "2",
               "--output", str(compare)])
    assert compare.read_bytes()[:8] == PNG_SIGNATURE
    assert compare.stat().st_size > output.stat().st_size / 2


@pytest.mark.parametrize("argv,message", [
    (["--compare", "2bw,no-such-schedule", "--text"], "--compare expects"),
    (["--pipeline-stages", "4", "--microbatches", "2", "--text"], "m=2 < p=4"),
    (["--batches", "0", "--text"], "--batches must be a positive integer"),
    (["--output", "/no/such/dir/x.png"], "does not exist"),
    ([], "nothing to do"),
    (["--pipeline-stages", "1000", "--microbatches", "1000", "--text"],
     "--pipeline-stages 1000 x --microbatches 1000 x --batches 3 make 6,000,000 boxes to draw, "
     "more than 20,000: a schedule's pattern shows at a few stages and batches"),
    (["--compare", "2bw,interleaved", "--pipeline-stages", "40", "--microbatches", "40",
      "--batches", "4", "--text"], "make 25,600 boxes to draw"),  # two chunks per stage
])
def test_cli_bad_input_is_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("visualize_schedule.py: error: ") and message in err
    assert "\n" not in err
