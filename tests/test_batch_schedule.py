"""The global batch of every iteration under Megatron-LM's --rampup-batch-size, on hand-computed
cases, and the flags' checks."""
import pytest

from megatron_2bw.arguments import ConfigError, parse_config
from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.batch_schedule import BatchSchedule, Phase, batch_schedule, parse_step_schedule
from megatron_2bw.config import OptimizerConfig, TrainingConfig
from megatron_2bw.optim.lr_schedule import learning_rate, schedule_position

# 4 -> 16 by 4 over 24 samples: 3 increments of 8 samples; an iteration starting after c samples
# has the batch 4 + 4 * int(c / 8): c = 0, 4 -> 4; c = 8 -> 8; c = 16 -> 12; c = 28 -> 16
RAMP = BatchSchedule(16, (4, 4, 24))


def test_without_a_ramp_every_batch_is_the_global_batch():
    fixed = BatchSchedule(16, None)
    assert [fixed.global_batch(i) for i in (0, 1, 1000)] == [16, 16, 16]
    assert fixed.consumed(5) == 80 and fixed.changes() == []


def test_megatron_ramp_by_hand():
    assert [RAMP.global_batch(i) for i in range(7)] == [4, 4, 8, 12, 16, 16, 16]
    assert [RAMP.consumed(i) for i in range(7)] == [0, 4, 8, 16, 28, 44, 60]
    assert RAMP.phases == [Phase(0, 0, 4), Phase(2, 8, 8), Phase(3, 16, 12), Phase(4, 28, 16)]
    assert RAMP.changes() == [2, 3, 4]


def test_train_samples_count_the_ramp_iteration_by_iteration():
    # Megatron's update_train_iters: 4 ramp iterations consume 28 samples (the loop stops once more
    # than 24 are consumed), then (60 - 28) // 16 = 2 whole batches
    assert RAMP.iterations_for_samples(60) == 6
    assert RAMP.iterations_for_samples(75) == 6  # a partial last batch is dropped
    # a --train-samples inside the ramp: Megatron takes whole batches off the ramp's count (floor)
    assert RAMP.iterations_for_samples(8) == 2


def test_gpt3_175b_ramp():
    """Megatron-LM's GPT-3 175B script: 16 -> 1536 by 16 over 5,859,375 samples."""
    ramp = BatchSchedule(1536, (16, 16, 5859375))
    sizes = [phase.global_batch_size for phase in ramp.phases]
    assert sizes == list(range(16, 1537, 16))  # 96 phases, each batch a multiple of 16
    last = ramp.phases[-1]
    assert 5859375 - 1520 < last.consumed_before <= 5859375 + 1520
    iterations = ramp.iterations_for_samples(146484375)
    assert ramp.consumed(iterations) <= 146484375 < ramp.consumed(iterations) + 1536


def test_step_schedule_by_hand():
    """Megatron-LM's --step-batch-size-schedule: the batch of the last threshold reached; an
    iteration that overshoots a threshold can skip an entry."""
    steps = BatchSchedule(16, steps=((0, 4), (4, 8), (12, 16)))
    assert [steps.global_batch(i) for i in range(4)] == [4, 8, 16, 16]
    assert [steps.consumed(i) for i in range(4)] == [0, 4, 12, 28]
    assert steps.iterations_for_samples(40) == 3  # whole batches: 28 consumed, 44 would pass 40
    skipping = BatchSchedule(32, steps=((0, 8), (10, 16), (12, 32)))
    assert skipping.phases == [Phase(0, 0, 8), Phase(2, 16, 32)]


def test_step_schedule_strings_in_tokens():
    # 16 tokens a sample: 0, 128 and 192 tokens are 0, 8 and 12 samples
    assert parse_step_schedule("0:4 128:8, 0.192K:16", 16) == [[0, 4], [8, 8], [12, 16]]
    assert parse_step_schedule("0:768 250B:1536", 4096) == [[0, 768], [61035156, 1536]]


@pytest.mark.parametrize("text,expected", [
    ("64:8", "the first entry must have threshold 0"),
    ("0:4 128:8 64:16", "thresholds must increase"),
    ("0:4 x:8", "'x:8': 'x' is not a number"),
    ("0-4", "'0-4' is not THRESHOLD:BATCH_SIZE"),
    ("0:0", "every batch size must be positive"),
])
def test_step_schedule_errors_name_the_entry(text, expected):
    with pytest.raises(ValueError, match=expected):
        parse_step_schedule(text, 16)


def test_the_schedules_advance_by_samples():
    """The learning rate of the step that finishes iteration i depends on the samples consumed by
    then: a warm-up of 16 samples ends after the ramp's third iteration (4 + 4 + 8 samples), not
    the first (16 at the final batch)."""
    train = TrainingConfig(global_batch_size=16, train_samples=160, rampup_batch_size=[4, 4, 24])
    opt = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_samples=16, lr_decay_style="constant")
    assert [schedule_position(i, train) for i in range(4)] == [0.25, 0.5, 1.0, 1.75]
    assert [learning_rate(i, opt, train) for i in range(4)] == [0.25, 0.5, 1.0, 1.0]
    without = TrainingConfig(global_batch_size=16, train_samples=160)
    assert schedule_position(2, without) == 3


FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
         "16", "--micro-batch-size", "2", "--mock-data", "--vocab-size", "64",
         "--global-batch-size", "16", "--train-samples", "60"]


def test_step_schedule_flag_sets_the_global_batch_and_counts_iterations():
    base = FLAGS[:FLAGS.index("--global-batch-size")] + ["--train-samples", "60"]
    config, _ = parse_config([*base, "--step-batch-size-schedule", "0:4 128:8 192:16"])
    assert config.training.step_batch_size_schedule == [[0, 4], [8, 8], [12, 16]]
    assert config.training.global_batch_size == 16  # the last batch
    validate_for_world(config, 2)
    assert config.training.train_iters == 5  # batches 4, 4, 8, then (60 - 16) // 16
    for extra, expected in [
        (["--global-batch-size", "32"], "--global-batch-size 32 differs from the last batch of "
                                        "--step-batch-size-schedule, 16"),
        (["--rampup-batch-size", "4", "4", "24"], "give --rampup-batch-size or "
                                                  "--step-batch-size-schedule, not both"),
        (["--step-batch-size-schedule", "0:4 x:8"], "--step-batch-size-schedule: '0:4 x:8'|"
                                                    "--step-batch-size-schedule: 'x:8'")]:
        with pytest.raises(ConfigError, match=expected):
            parse_config([*base, "--step-batch-size-schedule", "0:4 128:8 192:16", *extra])
    config, _ = parse_config([*base, "--step-batch-size-schedule", "0:4 128:8 192:16"])
    with pytest.raises(ConfigError, match="batch 4 is not divisible by --micro-batch-size 2 x "
                                          "data-parallel size 4"):
        validate_for_world(config, 4)


def test_flags_fill_the_ramp_and_count_iterations():
    config, _ = parse_config([*FLAGS, "--rampup-batch-size", "4", "4", "24"])
    assert config.training.rampup_batch_size == [4, 4, 24]
    validate_for_world(config, 2)  # d = 2: every batch a whole number of 2 x 2 samples
    assert config.training.train_iters == 6


# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh: model and training blocks (its
# data paths replaced by mock data); it combines the ramp with --train-iters
MEGATRON_GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16",
    "5859375", "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
    "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000",
    "--eval-interval", "1000", "--eval-iters", "10", "--mock-data", "--vocab-size", "50257"]


def test_megatron_gpt3_175b_script_runs_its_ramp_over_its_iterations():
    config, _ = parse_config(MEGATRON_GPT3_175B)
    validate_for_world(config, 8 * 16)  # one replica: the ramp's first batch is m = 16 = p
    train = config.training
    assert train.rampup_batch_size == [16, 16, 5859375] and train.train_iters == 500000
    schedule = batch_schedule(train)
    assert schedule.global_batch(0) == 16 and schedule.global_batch(499999) == 1536
    # the learning rate follows samples: the warm-up (0.1% of 430000 iterations of 1536) ends
    # later in iterations than at the full batch
    opt = config.optimizer
    assert learning_rate(429, opt, train) < opt.lr
    with pytest.raises(ConfigError, match="raise the ramp START to >= 32"):
        validate_for_world(parse_config(MEGATRON_GPT3_175B)[0], 8 * 16 * 2)


@pytest.mark.parametrize("world,extra,expected", [
    (4, [], "START 4 and INCREMENT 4 must be divisible by --micro-batch-size 2 x data-parallel "
            "size 4"),
    # the first batch, 4 samples, is a single microbatch of 4: too few for 1F1B on 2 stages
    (2, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "4"],
     "m = global/\\(micro\\*d\\) = 1 < p = 2; raise the ramp START to >= 8"),
])
def test_world_checks_name_the_ramp(world, extra, expected):
    config, _ = parse_config([*FLAGS, "--rampup-batch-size", "4", "4", "24", *extra])
    with pytest.raises(ConfigError, match=expected):
        validate_for_world(config, world)


@pytest.mark.parametrize("extra,expected", [
    (["--train-samples", "60"], "ramps up to --global-batch-size: give it"),
    (["--global-batch-size", "18", "--train-samples", "60"],
     "--global-batch-size 18 must be START plus a whole number of INCREMENTs"),
])
def test_ramp_flags_are_checked(extra, expected):
    base = FLAGS[:FLAGS.index("--global-batch-size")]
    with pytest.raises(ConfigError, match=expected):
        parse_config([*base, "--rampup-batch-size", "4", "4", "24", *extra])
