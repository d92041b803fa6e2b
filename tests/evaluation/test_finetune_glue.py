"""tools/finetune_glue.py on a learnable synthetic SST-2 (label: does the marker word "excellent"
occur?) from a freshly initialised tiny BERT checkpoint: it reaches high dev accuracy, writes a
results file format_results_table reads, and t=2 (reading the same data as a local `datasets` copy)
gives the metrics of t=1 (with d=2). Bad inputs fail with an error naming the file."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_2bw.arguments import ConfigError
from megatron_2bw.checkpoint import save_checkpoint
from megatron_2bw.checkpoint.reshard import read_full_state
from megatron_2bw.config import CheckpointConfig, Config, DataConfig, ModelConfig, TrainingConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.evaluation.finetune import (GlueSettings, PretrainedBert, load_pretrained_encoder,
                                              load_task_data)
from megatron_2bw.evaluation.glue import format_results_table, get_task
from megatron_2bw.models.classification import build_classifier
from megatron_2bw.training import build_stage
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
    train, dev = sst2_rows(rng, 512), sst2_rows(rng, 128)
    write_tsv(base / "SST-2" / "train.tsv", train)
    write_tsv(base / "SST-2" / "dev.tsv", dev)
    hub = base / "sst2_hub"  # the hub's per-split JSON lines: validation = GLUE's dev
    hub.mkdir()
    for name, rows in (("train", train), ("validation", dev)):
        (hub / f"{name}.jsonl").write_text("".join(
            json.dumps({"sentence": text, "label": label, "idx": i}) + "\n"
            for i, (text, label) in enumerate(rows)))
    return {"base": base, "vocab": vocab,
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
                                 cwd=REPO, timeout=240)
    assert process.returncode == 0, log.read_text()[-4000:]
    return log.read_text()


def test_finetuning_learns_the_task_and_t2_matches_t1(workspace):
    """t=1 x d=2 (micro-batch 8) and t=2 x d=1 (micro-batch 16), also with --sequence-parallel,
    see the same global batches."""
    base = workspace["base"]
    common = ["--task", "SST-2", "--load", str(workspace["bert"]), "--epochs", "3", "--lr", "1e-3",
              "--global-batch-size", "16", "--seed", "5"]
    run_tool(2, [*common, "--micro-batch-size", "8", "--data-dir", str(base / "SST-2"),
                 "--results", str(base / "t1.json")], base / "t1.log")
    output = run_tool(2, [*common, "--micro-batch-size", "16", "--tensor-model-parallel-size", "2",
                          "--datasets-dir", str(base / "sst2_hub"),
                          "--results", str(base / "t2.json")], base / "t2.log")
    assert "world 2 = t 2 x d 1" in output
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


def test_mnli_reads_both_dev_sets(workspace, tmp_path):
    header = "sentence1\tsentence2\tgold_label"
    rows = [("the movie", "a film", "entailment"), ("the plot", "music", "neutral")]
    for split in ("train", "dev_matched", "dev_mismatched"):
        write_tsv(tmp_path / f"{split}.tsv", [(f"{a}\t{b}", label) for a, b, label in rows], header)
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="BertWordPieceLowerCase",
                                           vocab_file=str(workspace["vocab"])))
    data = load_task_data(get_task("MNLI"), GlueSettings("MNLI", data_dir=str(tmp_path)),
                          tokenizer, 16)
    assert list(data.dev) == ["dev_matched", "dev_mismatched"]
    assert data.train["label"].tolist() == [1, 2]  # contradiction, entailment, neutral


# -- bad input -----------------------------------------------------------------------------------

def main_args(workspace, data_dir, load=None) -> list[str]:
    return ["--task", "SST-2", "--data-dir", str(data_dir), "--load",
            str(load or workspace["bert"]), "--micro-batch-size", "4"]


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
