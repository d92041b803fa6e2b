"""Hugging Face export/import: the exported transformers model computes our logits (GPT-2, Llama,
Qwen2 and Qwen3 layouts, BERT, zero-centred norm weights, a vocabulary that needed padding, a
t=2 x p=2 checkpoint), import then export gives back the same tensors, an imported Llama or Qwen
computes the transformers logits, a model we cannot reproduce is refused by name, and SentencePiece
tokenizers (Llama2Tokenizer's <s> too) come back from export. Models are built locally (no hub)."""
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import ByteLevelBPETokenizer

from megatron_2bw.checkpoint import saved_config
from megatron_2bw.checkpoint.huggingface import (ConversionError, export_to_hf, from_hf_config,
                                                 from_hf_weights, import_from_hf, join_rows,
                                                 split_rows, to_hf_weights)
from megatron_2bw.checkpoint.reshard import FullState, read_full_state
from megatron_2bw.config import Config, DataConfig, ModelConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.models.transformer import RotaryEmbedding
from tests.checkpoint.helpers import VOCAB, save_random_checkpoint, whole_model
from tests.data.helpers import load_tool

# Llama's layout: untied, no biases, 4 heads in 2 query groups, a rotary base other than the default
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             rotary_base=500.0, add_bias_linear=False, num_query_groups=2,
             untie_embeddings_and_output_weights=True)
# Qwen3's: Llama's with a norm over each head's queries and keys
QWEN3 = {**LLAMA, "qk_layernorm": True}
# --apply-layernorm-1p: the (random) stored norm weights are gain - 1
ZERO_CENTRED = {"apply_layernorm_1p": True}
# Llama 3.1's rotary scaling; with this base it keeps some frequencies and changes others
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _export(checkpoint, output):
    load_tool("export_to_hf").main(["--load", str(checkpoint), "--output", str(output)])


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("switches", [{}, ZERO_CENTRED], ids=["plain", "1p"])
def test_exported_bert_computes_our_logits(switches, tmp_path):
    state = save_random_checkpoint(tmp_path / "ckpt", "bert", t=2, p=2, **switches)
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


@pytest.mark.parametrize("switches,architecture", [
    ({}, "GPT2LMHeadModel"),
    (LLAMA, "LlamaForCausalLM"),
    ({**LLAMA, "untie_embeddings_and_output_weights": False}, "LlamaForCausalLM"),
    ({**LLAMA, "add_bias_linear": True}, "LlamaForCausalLM"),  # attention_bias and mlp_bias
    ({**LLAMA, "add_qkv_bias": True}, "Qwen2ForCausalLM"),  # biases on q, k and v only
    ({**LLAMA, "rope_scaling": True, "rotary_base": 500000.0}, "LlamaForCausalLM"),  # llama3 rope
    ({**QWEN3, **ZERO_CENTRED}, "Qwen3ForCausalLM"),  # q_norm and k_norm
    ({**QWEN3, "kv_channels": 16}, "Qwen3ForCausalLM"),  # heads wider than hidden / heads
    (ZERO_CENTRED, "GPT2LMHeadModel"),
    ({"openai_gelu": True}, "GPT2LMHeadModel"),  # GPT-2's own tanh GELU: gelu_new
], ids=["gpt2", "llama-untied", "llama-tied", "llama-biases", "qwen2", "llama-rope-scaling",
        "qwen3-1p", "qwen3-wide-heads", "gpt2-1p", "gpt2-tanh-gelu"])
def test_exported_gpt_computes_our_logits(switches, architecture, tmp_path):
    """GPT-2's layout, and Llama's: RMSNorm (random weights), SwiGLU, rotary positions and
    grouped-query attention; from a t=2 x p=2 checkpoint. Under --apply-layernorm-1p every norm
    (q_norm and k_norm too) goes out as its gain."""
    state = save_random_checkpoint(tmp_path / "ckpt", "gpt", t=2, p=2, **switches)
    _export(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(hf).__name__ == architecture and hf.config.architectures == [architecture]
    assert hf.config.vocab_size == VOCAB
    model = state.config.model
    assert hf.config.tie_word_embeddings == (not model.untie_embeddings_and_output_weights)
    if architecture == "GPT2LMHeadModel":
        assert hf.config.activation_function == ("gelu_new" if model.openai_gelu else "gelu")
    else:
        assert hf.config.num_key_value_heads == 2 and hf.config.num_attention_heads == 4
        assert hf.config.head_dim == model.head_dim == switches.get("kv_channels", 8)
        assert not torch.equal(hf.model.norm.weight, torch.ones(32))  # the norms' weights travelled
        assert torch.allclose(hf.model.rotary_emb.inv_freq,
                              RotaryEmbedding(model).inverse_frequencies("cpu"), rtol=1e-6)
    tokens = _tokens(1)
    with torch.no_grad():
        ours = whole_model(state).logits(tokens)
        theirs = hf.eval()(tokens).logits
    assert ours.shape == theirs.shape == (2, 16, VOCAB)
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("switches", [{**QWEN3, **ZERO_CENTRED}, ZERO_CENTRED],
                         ids=["qwen3-1p", "gpt2-1p"])
def test_a_zero_centred_export_imports_back_with_plain_gains(switches, tmp_path):
    """transformers has no zero-centred norms: a --apply-layernorm-1p model comes back from its
    export with the gains stored as they are (apply_layernorm_1p off), computing the same."""
    state = save_random_checkpoint(tmp_path / "ckpt", "gpt", t=1, p=1, **switches)
    _export(tmp_path / "ckpt", tmp_path / "hf")
    imported = import_from_hf(str(tmp_path / "hf"))
    model = imported.config.model
    assert not model.apply_layernorm_1p
    assert model.qk_layernorm == switches.get("qk_layernorm", False)
    assert torch.equal(imported.model["final_norm.weight"], state.model["final_norm.weight"] + 1)
    tokens = _tokens(4)
    with torch.no_grad():
        ours = whole_model(state).logits(tokens)
        theirs = whole_model(imported).logits(tokens)
    assert (ours - theirs).abs().max() < 1e-5
    # from_hf_weights is to_hf_weights' inverse for a zero-centred model too (up to rounding)
    back = from_hf_weights(state.config.model, to_hf_weights(state.config.model, state.model))
    for name, tensor in state.model.items():
        assert torch.allclose(back[name], tensor, rtol=0, atol=1e-6), name


def _llama_like_config(kind: str, **fields):
    """transformers' LlamaConfig, Qwen2Config or Qwen3Config (whose head_dim defaults to 128, not
    hidden_size / num_attention_heads)."""
    if kind == "qwen3":
        fields = {"head_dim": fields["hidden_size"] // fields["num_attention_heads"], **fields}
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config}[kind](**fields)


def _tiny_hf(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "gpt":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                         n_head=4, bos_token_id=100, eos_token_id=100,
                                         **{"activation_function": "gelu", **overrides})
        model = transformers.GPT2LMHeadModel(config)
    elif kind in ("llama", "qwen2", "qwen3"):  # 8 heads in 2 key/value groups
        config = _llama_like_config(
            kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-5, bos_token_id=100, eos_token_id=100, **{
                "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, **overrides})
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        config = transformers.MegatronBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, layer_norm_eps=1e-5, **overrides)
        model = transformers.MegatronBertForPreTraining(config)
    with torch.no_grad():  # norms and biases are 1 and 0 at init: randomise everything
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("kind,tied", [("gpt", True), ("gpt", False), ("bert", True),
                                       ("llama", True), ("llama", False), ("qwen2", False),
                                       ("qwen3", False)])
def test_import_then_export_gives_back_the_same_tensors(kind, tied, tmp_path):
    """An untied GPT-2 or Llama (tie_word_embeddings false) comes in with
    --untie-embeddings-and-output-weights and goes back out with its own lm_head; q, k, v of a
    grouped-query Llama come back out of the fused qkv, gate and up out of the fused fc1."""
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


@pytest.mark.parametrize("kind,field,name", [("gpt", "activation_function", "gelu_new"),
                                             ("bert", "hidden_act", "gelu_pytorch_tanh")])
def test_tanh_gelu_imports_as_openai_gelu_and_computes_the_transformers_logits(kind, field, name,
                                                                               tmp_path):
    """GPT-2's default activation, gelu_new, is Megatron-LM's --openai-gelu: a GPT-2 (or a BERT)
    with it imports and computes what transformers does. With the exact GELU instead, the
    logits would differ by more than the tolerance (checked)."""
    source = _tiny_hf(kind, **{field: name})
    source.save_pretrained(tmp_path / "source")
    imported = import_from_hf(str(tmp_path / "source"))
    assert imported.config.model.openai_gelu
    tokens = _tokens(2)
    with torch.no_grad():
        model = whole_model(imported)
        theirs = source.eval()(tokens)
        if kind == "gpt":
            difference = (model.logits(tokens) - theirs.logits).abs().max()
        else:
            types, padding = torch.zeros_like(tokens), torch.ones_like(tokens)
            hidden = model.encode(None, {"text": tokens, "types": types, "padding_mask": padding})
            lm_logits, _ = model.heads(hidden, model.head_weight(), None)
            difference = (lm_logits[..., :VOCAB] - theirs.prediction_logits).abs().max()
    assert difference < 1e-5


def test_another_activation_is_refused_by_name(tmp_path):
    _tiny_hf("gpt", activation_function="relu").save_pretrained(tmp_path / "source")
    with pytest.raises(ConversionError, match="activation_function = 'relu'"):
        load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "source"), "--save",
                                          str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_bert_with_an_untied_decoder_is_refused(tmp_path):
    _tiny_hf("bert", tie_word_embeddings=False).save_pretrained(tmp_path / "source")
    with pytest.raises(ConversionError, match="differs from the word embeddings .*"
                                              "megatron_2bw ties BERT's"):
        load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "source"), "--save",
                                          str(tmp_path / "ckpt")])


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {"tie_word_embeddings": False}), ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {"rope_parameters": LLAMA3_ROPE}), ("qwen3", {"tie_word_embeddings": False}),
    ("qwen3", {"head_dim": 16}), ("llama", {"head_dim": 4}),
], ids=["untied", "tied", "biases", "qwen2", "llama3-rope", "qwen3", "qwen3-wide-heads",
        "llama-narrow-heads"])
def test_imported_llama_computes_the_transformers_logits(kind, overrides, tmp_path):
    hf = _tiny_hf(kind, **overrides)
    hf.save_pretrained(tmp_path / "source")
    state = import_from_hf(str(tmp_path / "source"))
    model, rope = state.config.model, hf.config.rope_parameters
    assert (model.normalization, model.swiglu, model.position_embedding_type) == \
        ("RMSNorm", True, "rope")
    assert (model.num_query_groups, model.ffn_hidden_size) == (2, 96)
    assert model.rotary_base == rope["rope_theta"]
    assert model.rope_scaling == (rope["rope_type"] == "llama3")
    assert model.add_bias_linear == overrides.get("attention_bias", False)
    assert model.add_qkv_bias == (kind == "qwen2")
    assert model.qk_layernorm == (kind == "qwen3") and not model.apply_layernorm_1p
    # --kv-channels where the heads are not hidden / heads wide (Qwen2 has no head_dim)
    assert model.head_dim == getattr(hf.config, "head_dim", 8)
    assert model.kv_channels == overrides.get("head_dim")
    assert model.untie_embeddings_and_output_weights == (not hf.config.tie_word_embeddings)
    assert model.seq_length == model.max_position_embeddings == 16
    tokens = _tokens(3)
    with torch.no_grad():
        ours = whole_model(state).logits(tokens)
        theirs = hf.eval()(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5


def test_fused_rows_split_into_grouped_q_k_v_and_alternating_gate_up():
    groups, per_group, head_dim = 2, 2, 3
    # our qkv rows: (group, [its query heads, k, v], head_dim); label 100*group + 10*slot + dim
    qkv = torch.tensor([100 * g + 10 * j + d for g in range(groups) for j in range(per_group + 2)
                        for d in range(head_dim)], dtype=torch.float32)
    q, k, v = split_rows(qkv, groups, [per_group * head_dim, head_dim, head_dim])
    assert q.tolist() == [0, 1, 2, 10, 11, 12, 100, 101, 102, 110, 111, 112]
    assert k.tolist() == [20, 21, 22, 120, 121, 122]
    assert v.tolist() == [30, 31, 32, 130, 131, 132]
    assert torch.equal(join_rows([q, k, v], groups), qkv)
    fc1 = torch.arange(12.0).reshape(6, 2)  # rows: gate 0, up 0, gate 1, up 1, ...
    gate, up = split_rows(fc1, 3, [1, 1])
    assert gate[:, 0].tolist() == [0, 4, 8] and up[:, 0].tolist() == [2, 6, 10]
    assert torch.equal(join_rows([gate, up], 3), fc1)


@pytest.mark.parametrize("model_type,switches,fields", [
    ("gpt", {"normalization": "RMSNorm"},  # RMSNorm with GELU: neither GPT-2 nor Llama
     ["GPT2LMHeadModel needs normalization = 'LayerNorm'", "LlamaForCausalLM needs swiglu = True"]),
    ("gpt", {"num_query_groups": 2},  # grouped-query attention with learned positions
     ["GPT2LMHeadModel needs num_query_groups = 4 \\(the model has 2\\)",
      "position_embedding_type = 'rope'"]),
    ("gpt", {**LLAMA, "rotary_interleaved": True}, ["rotary_interleaved = False"]),
    ("gpt", {**LLAMA, "rotary_percent": 0.5}, ["rotary_percent = 1.0"]),
    ("gpt", {**LLAMA, "position_embedding_type": "none"}, ["position_embedding_type = 'rope'"]),
    ("gpt", {**LLAMA, "num_tokentypes": 2}, ["num_tokentypes = 2"]),
    ("bert", {"normalization": "RMSNorm"}, ["MegatronBertForPreTraining needs normalization"]),
    ("bert", {"add_bias_linear": False}, ["add_bias_linear = True"]),
    ("gpt", {"qk_layernorm": True},  # GPT-2's layout otherwise
     ["GPT2LMHeadModel needs qk_layernorm = False \\(the model has True\\)",
      "Qwen3ForCausalLM needs normalization = 'RMSNorm'"]),
    ("gpt", {**QWEN3, "add_qkv_bias": True},
     ["Qwen3ForCausalLM needs add_qkv_bias = False \\(the model has True\\)"]),
    ("gpt", {**QWEN3, "add_bias_linear": True}, ["Qwen3ForCausalLM needs add_bias_linear = False"]),
    ("bert", {"qk_layernorm": True}, ["MegatronBertForPreTraining needs qk_layernorm = False"]),
    ("gpt", {"kv_channels": 16}, ["GPT2LMHeadModel needs kv_channels = None \\(the model has 16\\)"]),
    ("gpt", {**LLAMA, "add_bias_linear": False, "add_qkv_bias": True, "kv_channels": 16},
     ["Qwen2ForCausalLM needs kv_channels = None"]),
])
def test_an_architecture_without_a_transformers_equivalent_is_refused_by_field(
        model_type, switches, fields, tmp_path):
    model = ModelConfig(model_type=model_type, hidden_size=32, num_attention_heads=4,
                        vocab_size=VOCAB, **switches)
    with pytest.raises(ConversionError) as refusal:
        export_to_hf(FullState(Config(model=model), {}), str(tmp_path / "hf"))
    for field in fields:
        assert refusal.match(field)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind,overrides,message", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
     "rope_parameters \\(rope_scaling\\) = .*'linear'"),
    ("llama", {"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 4096}},
     "rope_parameters\\['original_max_position_embeddings'\\] = 4096"),
    ("llama", {"attention_bias": True}, "mlp_bias = False"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "layer_types = .*'sliding_attention'"),
    ("qwen3", {"attention_bias": True}, "attention_bias = True"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "layer_types = .*'sliding_attention'"),
])
def test_a_llama_we_cannot_reproduce_is_refused_by_field(kind, overrides, message):
    with pytest.raises(ConversionError, match=message):
        from_hf_config(_llama_like_config(kind, hidden_size=64, num_attention_heads=8, **overrides))


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


@pytest.mark.parametrize("kind,imported_kind", [
    ("SentencePieceTokenizer", "SentencePieceTokenizer"),
    ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"),  # the same encoding
    ("Llama2Tokenizer", "Llama2Tokenizer"),  # <s> before each text
])
def test_a_sentencepiece_run_comes_back_from_export_with_its_own_tokenizer(
        kind, imported_kind, tmp_path):
    """Export copies the raw SentencePiece model; import must read it back as that model, not as
    the tokenizer transformers would guess from config.json (it splits text differently), and
    Llama2Tokenizer's as Llama2Tokenizer."""
    import sentencepiece

    lines = ["the king and the queen spoke of love and war in the night"] * 50
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                             model_prefix=str(tmp_path / "spm"), vocab_size=40,
                                             model_type="bpe", minloglevel=2)
    data = DataConfig(tokenizer_type=kind, tokenizer_model=str(tmp_path / "spm.model"))
    save_random_checkpoint(tmp_path / "ckpt", "gpt", t=1, p=1, vocab_size=40, data=data)
    _export(tmp_path / "ckpt", tmp_path / "hf")
    load_tool("import_from_hf").main(["--hf-path", str(tmp_path / "hf"), "--save",
                                      str(tmp_path / "back")])
    imported = saved_config(str(tmp_path / "back")).data
    assert imported.tokenizer_type == imported_kind
    text = "the queen spoke of war"
    ids = build_tokenizer(imported).tokenize(text)
    assert ids == build_tokenizer(data).tokenize(text)
    bos = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm.model")).bos_id()
    assert (ids[0] == bos) == (kind == "Llama2Tokenizer")
    # transformers' own loader reads the same ids from the export (its tokenizer.json)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    for text in ("the queen spoke of war", "  The King, 1601!\nünknown"):
        assert auto.encode(text) == build_tokenizer(data).tokenize(text)
    (tmp_path / "any_file").touch()  # the mode of the other files written (not safetensors' 0600)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == \
        (tmp_path / "any_file").stat().st_mode & 0o777
