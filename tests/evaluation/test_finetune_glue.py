"""tools/finetune_glue.py on a learnable synthetic SST-2 (label: does the marker word "excellent"
occur?) from a freshly initialised tiny BERT checkpoint: it reaches high dev accuracy, writes a
results file format_results_table reads and the GLUE server's test prediction file, and t=2
(reading the same data as a local `datasets` copy) gives the metrics and predictions of t=1 (with
d=2). Bad inputs fail with an error naming the file."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_2bw.arguments import ConfigError, build_parser
from megatron_2bw.checkpoint import save_checkpoint
from megatron_2bw.checkpoint.reshard import read_full_state
from megatron_2bw.config import CheckpointConfig, Config, DataConfig, ModelConfig, TrainingConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.evaluation.finetune import (ClassifierTrainer, GlueSettings, PretrainedBert,
                                              load_pretrained_encoder, load_task_data,
                                              write_test_predictions)
from megatron_2bw.evaluation.glue import format_results_table, get_task
from megatron_2bw.models.classification import build_classifier
from megatron_2bw.training.stage import build_stage
from tests.data.helpers import load_tool

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "finetune_glue.py"
WORDS = ("the a movie film plot actor scene story was is very quite rather long short slow fast "
         "dull bright music ending start and but it this").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MARKER = "excellent"

finetune_glue = load_tool("finetune_glue")


def sst2_rows(rng: random.Random, count: int) -> list[tuple[str, int]]:
    rows = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        label = int(rng.random() < 0.5)
        if label:
            words.insert(rng.randint(0, len(words)), MARKER)
        rows.append((" ".join(words), label))
    return rows


def write_tsv(path: Path, rows, header="sentence\tlabel") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header] + [f"{text}\t{label}" for text, label in rows]) + "\n")
    return path


def save_fresh_checkpoint(root: Path, model_type: str, vocab_file: Path, **model) -> Path:
    """A freshly initialised model saved by the checkpoint code (no pretraining needed)."""
    config = Config(
        model=ModelConfig(model_type=model_type, num_layers=2, hidden_size=32,
                          num_attention_heads=4, seq_length=16,
                          vocab_size=len(SPECIAL) + len(WORDS) + 1,
                          num_tokentypes=2 if model_type == "bert" else 0, hidden_dropout=0.0,
                          attention_dropout=0.0, **model),
        data=DataConfig(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(vocab_file)),
        training=TrainingConfig(global_batch_size=1), checkpoint=CheckpointConfig(save=str(root)))
    save_checkpoint(build_stage(config, ParallelLayout(1, 1, 1), torch.device("cpu"), None))
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    base = tmp_path_factory.mktemp("glue")
    vocab = base / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS + [MARKER]) + "\n")
    rng = random.Random(0)
    train, dev, test = sst2_rows(rng, 512), sst2_rows(rng, 128), sst2_rows(rng, 63)
    # test examples are identified by the file's own index column, here not their row numbers
    test_indices = rng.sample(range(1000), len(test))
    write_tsv(base / "SST-2" / "train.tsv", train)
    write_tsv(base / "SST-2" / "dev.tsv", dev)
    write_tsv(base / "SST-2" / "test.tsv", [(index, text) for index, (text, _) in
                                            zip(test_indices, test)], header="index\tsentence")
    hub = base / "sst2_hub"  # the hub's per-split JSON lines: validation = GLUE's dev
    hub.mkdir()
    for name, rows, indices in (("train", train, range(len(train))),
                                ("validation", dev, range(len(dev))),
                                ("test", [(text, -1) for text, _ in test], test_indices)):
        (hub / f"{name}.jsonl").write_text("".join(
            json.dumps({"sentence": text, "label": label, "idx": i}) + "\n"
            for i, (text, label) in zip(indices, rows)))
    return {"base": base, "vocab": vocab, "test_indices": test_indices,
            "test_labels": [label for _, label in test],
            "bert": save_fresh_checkpoint(base / "bert", "bert", vocab),
            "bert_no_pooler": save_fresh_checkpoint(base / "bert_no_pooler", "bert", vocab,
                                                    bert_binary_head=False),
            "gpt": save_fresh_checkpoint(base / "gpt", "gpt", vocab)}


def run_tool(nproc: int, args: list[str], log: Path) -> str:
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
               f"--nproc-per-node={nproc}", str(TOOL), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as output:
        process = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                 cwd=REPO, timeout=900)
    assert process.returncode == 0, log.read_text()[-4000:]
    return log.read_text()


def test_finetuning_learns_the_task_and_t2_matches_t1(workspace):
    """t=1 x d=2 (micro-batch 8) and t=2 x d=1 (micro-batch 16), also with --sequence-parallel,
    see the same global batches; both write the same test predictions."""
    base = workspace["base"]
    common = ["--task", "SST-2", "--load", str(workspace["bert"]), "--epochs", "3", "--lr", "1e-3",
              "--global-batch-size", "16", "--seed", "5"]
    run_tool(2, [*common, "--micro-batch-size", "8", "--data-dir", str(base / "SST-2"),
                 "--results", str(base / "t1.json"), "--test-predictions", str(base / "t1_test")],
             base / "t1.log")
    output = run_tool(2, [*common, "--micro-batch-size", "16", "--tensor-model-parallel-size", "2",
                          "--datasets-dir", str(base / "sst2_hub"), "--results",
                          str(base / "t2.json"), "--test-predictions", str(base / "t2_test")],
                      base / "t2.log")
    assert "world 2 = t 2 x d 1" in output
    assert f"wrote test predictions {base / 't2_test' / 'SST-2.tsv'}" in output
    run_tool(2, [*common, "--micro-batch-size", "16", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--data-dir", str(base / "SST-2"),
                 "--results", str(base / "t2sp.json")], base / "t2sp.log")
    t1, t2, t2sp = (json.loads((base / name).read_text())
                    for name in ("t1.json", "t2.json", "t2sp.json"))
    assert t1["task"] == "SST-2" and [e["epoch"] for e in t1["epochs"]] == [1, 2, 3]
    assert t1["epochs"][-1]["metrics"]["accuracy"] >= 0.95, t1
    for one, two, sequence_parallel in zip(t1["epochs"], t2["epochs"], t2sp["epochs"]):
        for other in (two, sequence_parallel):
            assert one["metrics"] == other["metrics"]
            assert abs(one["train_loss"] - other["train_loss"]) < 1e-4
    table = format_results_table([base / "t1.json"])
    assert table.splitlines()[1].split() == ["SST-2", "dev", "3", "accuracy",
                                             f"{t1['epochs'][-1]['metrics']['accuracy']:.4f}"]

    # one file in the server's format, rows in test-file order under the file's own indices
    assert os.listdir(base / "t1_test") == ["SST-2.tsv"]
    submission = (base / "t1_test" / "SST-2.tsv").read_text()
    assert submission == (base / "t2_test" / "SST-2.tsv").read_text()
    header, *rows = [line.split("\t") for line in submission.splitlines()]
    assert header == ["index", "prediction"]
    assert [int(index) for index, _ in rows] == workspace["test_indices"]
    assert {prediction for _, prediction in rows} == {"0", "1"}
    correct = [prediction == str(label) for (_, prediction), label
               in zip(rows, workspace["test_labels"])]
    assert sum(correct) >= 0.9 * len(correct)


def test_encoder_weights_come_from_the_checkpoint(workspace):
    for name, pooler_from_checkpoint in (("bert", True), ("bert_no_pooler", False)):
        root = str(workspace[name])
        saved = read_full_state(root, with_optimizer=False)
        model = build_classifier(saved.config.model, None, 1, num_classes=3, seed=99)
        fresh = load_pretrained_encoder(model, PretrainedBert(root, 0, saved.config))
        weights = dict(model.named_parameters())
        vocab = saved.config.model.vocab_size
        assert torch.equal(weights["encoder.transformer.layers.1.attention.qkv.weight"],
                           saved.model["transformer.layers.1.attention.qkv.weight"])
        assert torch.equal(weights["encoder.embedding.word_embeddings.weight"][:vocab],
                           saved.model["embedding.word_embeddings.weight"])
        assert ("pooler.weight" in fresh) != pooler_from_checkpoint
        if pooler_from_checkpoint:
            assert torch.equal(weights["pooler.weight"], saved.model["heads.pooler.weight"])
        assert {"classifier.weight", "classifier.bias"} <= set(fresh)
        assert weights["classifier.weight"].shape == (3, 32)
        assert not any(n.startswith(("heads.", "encoder.heads")) for n in weights)


def test_regression_head_for_sts_b():
    model = build_classifier(ModelConfig(model_type="bert", num_layers=1, hidden_size=16,
                                         num_attention_heads=2, seq_length=8, vocab_size=30,
                                         num_tokentypes=2), None, 1, num_classes=1, seed=1)
    batch = {"text": torch.randint(0, 30, (4, 8)), "types": torch.zeros(4, 8, dtype=torch.long),
             "padding_mask": torch.ones(4, 8, dtype=torch.long)}
    logits = model(batch)
    labels = torch.tensor([0.0, 1.5, 3.0, 5.0])
    assert logits.shape == (4, 1) and model.predictions(logits).shape == (4,)
    assert torch.allclose(model.loss(logits, labels), ((logits.squeeze(-1) - labels) ** 2).mean())


def write_unlabeled_pairs(path: Path, indices: list[int], rng: random.Random) -> None:
    """An MNLI test file or GLUE's diagnostic.tsv: random sentence pairs under these indices."""
    write_tsv(path, [(index, f"{text}\t{other}") for index, (text, _), (other, _)
                     in zip(indices, sst2_rows(rng, len(indices)), sst2_rows(rng, len(indices)))],
              "index\tsentence1\tsentence2")


def write_mnli_task(directory: Path, test_indices: dict[str, list[int]]) -> None:
    """Tiny MNLI files: two labeled rows per train/dev file, test files with the given indices."""
    header = "sentence1\tsentence2\tgold_label"
    rows = [("the movie", "a film", "entailment"), ("the plot", "music", "neutral")]
    for split in ("train", "dev_matched", "dev_mismatched"):
        write_tsv(directory / f"{split}.tsv", [(f"{a}\t{b}", label) for a, b, label in rows],
                  header)
    rng = random.Random(1)
    for split, indices in test_indices.items():
        write_unlabeled_pairs(directory / f"{split}.tsv", indices, rng)


def workspace_tokenizer(workspace):
    return build_tokenizer(DataConfig(tokenizer_type="BertWordPieceLowerCase",
                                      vocab_file=str(workspace["vocab"])))


def test_mnli_reads_both_dev_sets(workspace, tmp_path):
    write_mnli_task(tmp_path, {})
    data = load_task_data(get_task("MNLI"), GlueSettings("MNLI", data_dir=str(tmp_path)),
                          workspace_tokenizer(workspace), 16)
    assert list(data.dev) == ["dev_matched", "dev_mismatched"]
    assert data.train["label"].tolist() == [1, 2]  # contradiction, entailment, neutral
    assert data.test == {}  # test files are only read for --test-predictions


def test_mnli_test_predictions_are_the_argmax_of_the_logits(workspace, tmp_path):
    """Both MNLI test files and GLUE's diagnostic set (--diagnostic-data) get a submission file
    holding, under each example's own index, the label of the model's largest logit (micro-batches
    of 2 over 5, 3 and 6 examples)."""
    indices = {"MNLI-m.tsv": [31, 4, 17, 8, 0], "MNLI-mm.tsv": [12, 11, 205],
               "AX.tsv": [1103, 0, 7, 55, 2, 9]}
    write_mnli_task(tmp_path / "MNLI", {"test_matched": indices["MNLI-m.tsv"],
                                        "test_mismatched": indices["MNLI-mm.tsv"]})
    write_unlabeled_pairs(tmp_path / "diagnostic.tsv", indices["AX.tsv"], random.Random(2))
    task = get_task("MNLI")
    # the command line's settings: --diagnostic-data reaches GlueSettings
    args = build_parser("", finetune_glue.add_glue_args).parse_args(
        ["--task", "MNLI", "--data-dir", str(tmp_path / "MNLI"), "--test-predictions",
         str(tmp_path / "submission"), "--diagnostic-data", str(tmp_path / "diagnostic.tsv")])
    settings = finetune_glue.settings_from_args(args)
    data = load_task_data(task, settings, workspace_tokenizer(workspace), 16)
    assert list(data.test) == list(indices)
    model_config = read_full_state(str(workspace["bert"]), with_optimizer=False).config.model
    model = build_classifier(model_config, None, 1, num_classes=task.num_classes, seed=0).eval()

    def logits(name: str) -> torch.Tensor:
        features = data.test[name].features
        with torch.no_grad():
            return model({key: torch.from_numpy(features[key])
                          for key in ("text", "types", "padding_mask")})

    with torch.no_grad():  # a fresh model's logits barely vary: center them to vary the argmax
        model.classifier.bias -= logits("MNLI-m.tsv").mean(dim=0)
    expected = {name: [task.labels[i] for i in logits(name).argmax(dim=-1).tolist()]
                for name in indices}
    assert set(expected["MNLI-m.tsv"]) == set(expected["MNLI-mm.tsv"]) == set(task.labels)
    assert len(set(expected["AX.tsv"])) > 1
    config = Config(model=model_config,
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=2))
    trainer = ClassifierTrainer(config, ParallelLayout(1, 1, 1), torch.device("cpu"), model)

    paths = write_test_predictions(trainer, task, data.test, settings.test_predictions)

    assert paths == [str(tmp_path / "submission" / name) for name in indices]
    assert sorted(os.listdir(tmp_path / "submission")) == ["AX.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"]
    for path, name in zip(paths, indices):
        header, *rows = [line.split("\t") for line in Path(path).read_text().splitlines()]
        assert header == ["index", "prediction"]
        assert rows == [[str(index), label] for index, label in zip(indices[name], expected[name])]


@pytest.mark.parametrize("check", [True, False])
def test_a_nonfinite_gradient_stops_fine_tuning_unless_the_check_is_off(check):
    """--check-for-nan-in-loss-and-grad (the default) outside fp16: an infinite input gives a
    non-finite gradient norm, which stops fine-tuning naming the step; with the check off the step
    is skipped and the weights stay as they were."""
    model_config = ModelConfig(model_type="bert", num_layers=1, hidden_size=16,
                               num_attention_heads=2, seq_length=8, vocab_size=30,
                               num_tokentypes=2, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_classifier(model_config, None, 1, num_classes=2, seed=1)
    config = Config(model=model_config,
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=2,
                                            check_for_nan_in_loss_and_grad=check))
    trainer = ClassifierTrainer(config, ParallelLayout(1, 1, 1), torch.device("cpu"), model)
    with torch.no_grad():
        model.classifier.weight.fill_(float("inf"))
    before = {name: p.clone() for name, p in model.named_parameters()}
    features = {"text": np.zeros((2, 8), dtype=np.int64), "types": np.zeros((2, 8), dtype=np.int64),
                "padding_mask": np.ones((2, 8), dtype=np.int64), "label": np.array([0, 1])}
    if check:
        with pytest.raises(FloatingPointError, match="gradient norm of fine-tuning step 1 is nan"):
            trainer.step(features, np.arange(2), 0)
        return
    _, skipped = trainer.step(features, np.arange(2), 0)
    assert skipped
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


# -- bad input -----------------------------------------------------------------------------------

def main_args(workspace, data_dir, load=None, task="SST-2") -> list[str]:
    return ["--task", task, "--data-dir", str(data_dir), "--load",
            str(load or workspace["bert"]), "--micro-batch-size", "4"]


def test_missing_test_file_fails_before_training(workspace, tmp_path):
    write_tsv(tmp_path / "train.tsv", [("the movie", 1)])
    write_tsv(tmp_path / "dev.tsv", [("the movie", 1)])
    args = [*main_args(workspace, tmp_path), "--test-predictions", str(tmp_path / "out")]
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'test.tsv'}: no such file"):
        finetune_glue.main(args)
    assert not dist.is_initialized()  # failed while reading the data, before any training
    (tmp_path / "out").write_text("")
    with pytest.raises(ConfigError, match=f"--test-predictions names a directory for the "
                                          f"prediction files; {tmp_path / 'out'} is a file"):
        finetune_glue.main(args)


def test_bad_diagnostic_data_fails_before_training(workspace, tmp_path):
    write_mnli_task(tmp_path, {"test_matched": [0], "test_mismatched": [1]})
    args = [*main_args(workspace, tmp_path, task="MNLI"), "--test-predictions",
            str(tmp_path / "out"), "--diagnostic-data"]
    missing = tmp_path / "diagnostic" / "diagnostic.tsv"
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such file or directory"):
        finetune_glue.main([*args, str(missing)])
    # e.g. a training file given in its place: without an index column there is no submission
    write_tsv(tmp_path / "train_copy.tsv", [("the movie\ta film", "entailment")],
              "sentence1\tsentence2\tgold_label")
    with pytest.raises(ValueError, match=f"{tmp_path / 'train_copy.tsv'}: no column 'index'"):
        finetune_glue.main([*args, str(tmp_path / "train_copy.tsv")])
    assert not dist.is_initialized()  # failed while reading the data, before any training


def test_diagnostic_data_needs_mnli_and_test_predictions(workspace, tmp_path):
    diagnostic = ["--diagnostic-data", str(tmp_path / "diagnostic.tsv")]
    with pytest.raises(ConfigError, match=r"--diagnostic-data \(GLUE's diagnostic set AX\) is "
                                          r"predicted with the MNLI model: it needs --task MNLI, "
                                          r"not --task RTE"):
        finetune_glue.main([*main_args(workspace, tmp_path, task="RTE"), *diagnostic,
                            "--test-predictions", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="--diagnostic-data writes AX.tsv with the test "
                                          "predictions: it needs --test-predictions DIR"):
        finetune_glue.main([*main_args(workspace, tmp_path, task="mnli"), *diagnostic])


def test_missing_task_file_names_it(workspace, tmp_path):
    write_tsv(tmp_path / "train.tsv", [("the movie", 1)])
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'dev.tsv'}: no such file"):
        finetune_glue.main(main_args(workspace, tmp_path))


def test_missing_column_names_the_file(workspace, tmp_path):
    path = write_tsv(tmp_path / "train.tsv", [("the movie", 1)], header="text\tlabel")
    with pytest.raises(ValueError, match=f"{path}: no column 'sentence'"):
        finetune_glue.main(main_args(workspace, tmp_path))


def test_unknown_label_names_file_and_line(workspace, tmp_path):
    path = write_tsv(tmp_path / "train.tsv", [("the movie", 1), ("a film", "maybe")])
    with pytest.raises(ValueError, match=f"{path}:3: unknown SST-2 label 'maybe'"):
        finetune_glue.main(main_args(workspace, tmp_path))


def test_gpt_checkpoint_is_refused_naming_the_file(workspace):
    metadata = next(workspace["gpt"].glob("iter_*/metadata.json"))
    with pytest.raises(ConfigError, match=f"{metadata}: the checkpoint holds a 'gpt' model"):
        finetune_glue.main(main_args(workspace, workspace["base"] / "SST-2", workspace["gpt"]))


def test_pipeline_parallelism_is_refused(workspace):
    args = main_args(workspace, workspace["base"] / "SST-2")
    with pytest.raises(ConfigError, match="without pipeline parallelism"):
        finetune_glue.main([*args, "--pipeline-model-parallel-size", "2"])


def test_train_samples_is_refused(workspace):
    args = main_args(workspace, workspace["base"] / "SST-2")
    with pytest.raises(ConfigError, match="fine-tuning runs --epochs"):
        finetune_glue.main([*args, "--train-samples", "64"])


def test_command_line_error_is_one_line_with_exit_code_2(workspace, tmp_path):
    process = subprocess.run([sys.executable, str(TOOL), *main_args(workspace, tmp_path)],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        f"finetune_glue.py: error: {tmp_path / 'train.tsv'}: no such file; the SST-2 directory of "
        f"the GLUE distribution holds train.tsv, dev.tsv, test.tsv"]


def test_muon_finetuning_at_t2_orthogonalises_whole_matrices_like_t1(workspace):
    """--optimizer muon: t=2 gathers each matrix's update over the tensor-parallel group, so it
    trains as t=1 does (up to Newton-Schulz's bf16 rounding, which stays below 1e-6 here)."""
    base = workspace["base"]
    common = ["--task", "SST-2", "--load", str(workspace["bert"]), "--epochs", "1", "--lr", "2e-3",
              "--global-batch-size", "16", "--seed", "5", "--optimizer", "muon",
              "--data-dir", str(base / "SST-2")]
    run_tool(2, [*common, "--micro-batch-size", "8", "--results", str(base / "muon_t1.json")],
             base / "muon_t1.log")
    run_tool(2, [*common, "--micro-batch-size", "16", "--tensor-model-parallel-size", "2",
                 "--results", str(base / "muon_t2.json")], base / "muon_t2.log")
    t1, t2 = (json.loads((base / name).read_text())["epochs"][0]
              for name in ("muon_t1.json", "muon_t2.json"))
    # orthogonalising each shard by itself moves the epoch's mean loss by about 3e-5
    assert abs(t1["train_loss"] - t2["train_loss"]) < 1e-6
