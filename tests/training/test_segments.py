"""Where the pipeline drains."""
from megatron_2bw.arguments import parse_config
from megatron_2bw.training.segments import segment_ends
from tests.training.runs import TINY


def test_the_pipeline_drains_at_the_profiled_windows_bounds():
    config = parse_config([*TINY, "--eval-interval", "100", "--train-iters", "8"])[0]
    assert segment_ends(config, 0) == [8]
    config.logging.profile, config.logging.profile_step_start = True, 2
    assert segment_ends(config, 0) == [2, 8]  # the default end, 12, is past the run
    config.logging.profile_step_end = 5
    assert segment_ends(config, 0) == [2, 5, 8]
    assert segment_ends(config, 3) == [5, 8]  # resumed inside the window
