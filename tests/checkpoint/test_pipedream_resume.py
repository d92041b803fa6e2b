"""PipeDream at p = 4 (one microbatch per update, dropout on) resumes bit-exactly: every stashed
weight version (stage s holds p - s), the optimizer state and every loss equal straight
training's."""
import torch

from megatron_2bw.training.loop import pretrain
from tests.checkpoint.helpers import config_from_flags, logged_losses, pretrain_flags
from tests.distributed_helpers import run_ranks

N = 4  # iterations before the interruption (and after it): enough for stage 0's 4 versions


def _flags(*extra: str) -> list[str]:
    return pretrain_flags(1, 4, 2 * N, "--num-layers", "4", "--global-batch-size", "2",
                          "--pipeline-schedule", "pipedream",
                          "--untie-embeddings-and-output-weights", *extra)


def _state(stage) -> dict:
    v = stage.versions
    state = {f"master:{n}": m.detach().clone() for n, m in zip(v.names, v.master)}
    for version, copy in v.versions.items():
        state.update({f"v{version}:{n}": leaf.detach().clone() for n, leaf in zip(v.names, copy)})
    for i, per_param in enumerate(stage.optimizer.state.values()):
        state.update({f"optimizer:{i}:{key}": value.clone() for key, value in per_param.items()
                      if torch.is_tensor(value)})
    return state


def _scenario(rank: int, world: int, root: str) -> dict:
    ckpt = f"{root}/checkpoints"
    straight = pretrain(config_from_flags(_flags("--log-file", f"{root}/straight.jsonl")))
    pretrain(config_from_flags(_flags("--log-file", f"{root}/first.jsonl", "--save", ckpt,
                                      "--exit-interval", str(N))))
    resumed = pretrain(config_from_flags(_flags("--log-file", f"{root}/second.jsonl", "--save",
                                                ckpt, "--load", ckpt)))
    return {"stage": straight.layout.stage, "straight": _state(straight),
            "resumed": _state(resumed), "versions": sorted(resumed.versions.versions)}


def test_pipedream_resumes_bit_exactly_with_every_stashed_version(tmp_path):
    torch.set_num_threads(1)
    ranks = run_ranks(4, _scenario, str(tmp_path), timeout=300)
    first, second = (logged_losses(tmp_path / f"{name}.jsonl") for name in ("first", "second"))
    assert [i for i, _ in second] == list(range(N + 1, 2 * N + 1))
    assert first + second == logged_losses(tmp_path / "straight.jsonl")
    for rank in ranks:
        s = rank["stage"]
        assert rank["versions"] == list(range(2 * N - (4 - 1 - s), 2 * N + 1))  # p - s versions
        assert rank["straight"].keys() == rank["resumed"].keys()
        assert any(k.startswith("optimizer:") for k in rank["straight"])
        for name, tensor in rank["straight"].items():
            assert torch.equal(tensor, rank["resumed"][name]), (s, name)
