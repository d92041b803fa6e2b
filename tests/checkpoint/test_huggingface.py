"""Hugging Face export/import: the exported transformers model computes our logits (GPT and BERT,
a vocabulary that needed padding, a t=2 x p=2 checkpoint), import then export gives back the same
tensors, and a model we cannot reproduce is refused by name. Models are built locally (no hub)."""
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import ByteLevelBPETokenizer

from megatron_2bw.checkpoint import saved_config
from megatron_2bw.checkpoint.huggingface import ConversionError, join_qkv, split_qkv
from megatron_2bw.checkpoint.reshard import read_full_state
from megatron_2bw.config import DataConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from tests.checkpoint.helpers import VOCAB, save_random_checkpoint, whole_model
from tests.data.helpers import load_tool


def _export(checkpoint, output):
    load_tool("export_to_hf").main(["--load", str(checkpoint), "--output", str(output)])


def test_exported_gpt_computes_our_logits(tmp_path):
    state = save_random_checkpoint(tmp_path / "ckpt", "gpt", t=2, p=2)
    _export(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.config.vocab_size == VOCAB and hf.config.activation_function == "gelu"
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = whole_model(state).logits(tokens)
        theirs = hf.eval()(tokens).logits
    assert ours.shape == theirs.shape == (2, 16, VOCAB)
    assert (ours - theirs).abs().max() < 1e-4


def test_exported_bert_computes_our_logits(tmp_path):
    state = save_random_checkpoint(tmp_path / "ckpt", "bert", t=2, p=2)
    _export(tmp_path / "ckpt", tmp_path / "hf")
    hf, info = transformers.MegatronBertForPreTraining.from_pretrained(
        tmp_path / "hf", local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=generator)
    types = torch.randint(0, 2, (2, 16), generator=generator)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 11:] = 0
    model = whole_model(state)
    with torch.no_grad():
        hidden = model.encode(None, {"text": tokens, "types": types, "padding_mask": padding})
        lm_logits, binary_logits = model.heads(hidden, model.head_weight(), None)
        theirs = hf.eval()(input_ids=tokens, token_type_ids=types, attention_mask=padding)
    assert (lm_logits[..., :VOCAB] - theirs.prediction_logits).abs().max() < 1e-4
    assert (binary_logits - theirs.seq_relationship_logits).abs().max() < 1e-4


def _tiny_hf(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "gpt":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                         n_head=4, bos_token_id=100, eos_token_id=100,
                                         **{"activation_function": "gelu", **overrides})
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.MegatronBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, layer_norm_eps=1e-5, **overrides)
        model = transformers.MegatronBertForPreTraining(config)
    with torch.no_grad():  # norms and biases are 1 and 0 at init: randomise everything
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("kind,tied", [("gpt", True), ("gpt", False), ("bert", True)])
def test_import_then_export_gives_back_the_same_tensors(kind, tied, tmp_path):
    """An untied GPT-2 (tie_word_embeddings false) comes in with
    --untie-embeddings-and-output-weights and goes back out with its own lm_head."""
    _tiny_hf(kind, tie_word_embeddings=tied).save_pretrained(tmp_path / "source")
    load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "source"), "--save",
                                      str(tmp_path / "ckpt"), "--tensor-model-parallel-size", "2",
                                      "--pipeline-model-parallel-size", "2"])
    config = read_full_state(str(tmp_path / "ckpt")).config
    assert config.parallel.tensor_parallel == 2
    assert config.model.untie_embeddings_and_output_weights == (not tied)
    _export(tmp_path / "ckpt", tmp_path / "exported")
    source = load_file(tmp_path / "source" / "model.safetensors")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert source.keys() == exported.keys()
    assert ("lm_head.weight" in source) == (not tied)  # save_pretrained leaves tied copies out
    for name, tensor in source.items():
        assert torch.equal(tensor, exported[name]), name


def test_gpt2_default_tanh_gelu_is_refused_by_name(tmp_path):
    _tiny_hf("gpt", activation_function="gelu_new").save_pretrained(tmp_path / "source")
    with pytest.raises(ConversionError, match="activation_function = 'gelu_new'"):
        load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "source"), "--save",
                                          str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_bert_with_an_untied_decoder_is_refused(tmp_path):
    _tiny_hf("bert", tie_word_embeddings=False).save_pretrained(tmp_path / "source")
    with pytest.raises(ConversionError, match="differs from the word embeddings .*"
                                              "megatron_2bw ties BERT's"):
        load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "source"), "--save",
                                          str(tmp_path / "ckpt")])


def test_qkv_rows_are_reordered_between_head_major_and_q_k_v_blocks():
    heads, head_dim = 2, 3
    # our rows: (head, q/k/v, head_dim); label each row by 100*head + 10*part + dim
    ours = torch.tensor([100 * h + 10 * j + d for h in range(heads) for j in range(3)
                         for d in range(head_dim)], dtype=torch.float32)
    q, k, v = split_qkv(ours, heads)
    assert q.tolist() == [0, 1, 2, 100, 101, 102]
    assert v.tolist() == [20, 21, 22, 120, 121, 122]
    assert torch.equal(join_qkv(q, k, v, heads), ours)


def test_the_model_directory_tokenizer_travels_through_import_and_export(tmp_path):
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the king and the queen spoke of love"] * 20, vocab_size=270,
                            special_tokens=["<|endoftext|>"])
    bpe.save(str(tmp_path / "tokenizer.json"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                     eos_token="<|endoftext|>")
    vocab = len(tokenizer)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=32, n_layer=1, n_head=4,
        activation_function="gelu")).save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "source"), "--save",
                                      str(tmp_path / "ckpt")])
    data = saved_config(str(tmp_path / "ckpt")).data
    assert data.tokenizer_type == "HuggingFaceTokenizer"
    assert build_tokenizer(data).tokenize("the queen") == tokenizer.encode("the queen")
    _export(tmp_path / "ckpt", tmp_path / "exported")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported", local_files_only=True)
    assert exported.encode("the king spoke") == tokenizer.encode("the king spoke")


def test_a_sentencepiece_run_comes_back_from_export_with_its_own_tokenizer(tmp_path):
    """Export copies the raw SentencePiece model; import must read it back as that model, not as
    the tokenizer transformers would guess from config.json (it splits text differently)."""
    import sentencepiece

    lines = ["the king and the queen spoke of love and war in the night"] * 50
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                             model_prefix=str(tmp_path / "spm"), vocab_size=40,
                                             model_type="bpe", minloglevel=2)
    data = DataConfig(tokenizer_type="SentencePieceTokenizer",
                      tokenizer_model=str(tmp_path / "spm.model"))
    save_random_checkpoint(tmp_path / "ckpt", "gpt", t=1, p=1, vocab_size=40, data=data)
    _export(tmp_path / "ckpt", tmp_path / "hf")
    load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "hf"), "--save",
                                      str(tmp_path / "back")])
    imported = saved_config(str(tmp_path / "back")).data
    assert imported.tokenizer_type == "SentencePieceTokenizer"
    text = "the queen spoke of war"
    assert build_tokenizer(imported).tokenize(text) == build_tokenizer(data).tokenize(text)
