"""Hugging Face transformers <-> megatron_2bw weights: GPT as GPT2LMHeadModel, BERT as
MegatronBertForPreTraining (pre-LayerNorm BERT, the same layout as ours).

Both directions work on unsharded state (reshard.FullState, true vocabulary). What differs:
- Our fused qkv rows are ordered (head, q/k/v, head_dim), so a tensor-parallel shard holds whole
  heads; GPT-2's c_attn is [q_all | k_all | v_all] and MegatronBert has separate query/key/value.
- GPT-2's c_attn, c_proj and c_fc are Conv1D layers: weights stored [in, out], ours [out, in].
- Our activation is the exact (erf) GELU, transformers' "gelu". A model using another function
  ("gelu_new", GPT-2's tanh approximation, by default) is refused rather than silently changed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

from megatron_2bw.checkpoint.reshard import FullState
from megatron_2bw.config import Config, DataConfig, ModelConfig

EXACT_GELU = ("gelu", "gelu_python")  # transformers' names of erf GELU
# Files whose presence means a directory carries a transformers tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "tokenizer.model", "spiece.model")


class ConversionError(ValueError):
    """The model cannot be converted without changing what it computes; the message says why."""


# -- qkv layouts -------------------------------------------------------------------------------------

def split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our rows (head, q/k/v, head_dim) -> q, k, v, each with rows (head, head_dim)."""
    per_head = qkv.reshape(heads, 3, -1, *qkv.shape[1:])
    return tuple(per_head[:, j].reshape(-1, *qkv.shape[1:]).clone() for j in range(3))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *q.shape[1:]).clone()


# -- name mappings -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    ours: str  # "{i}" stands for the global layer index
    theirs: str
    conv1d: bool = False  # GPT-2 Conv1D: weight stored transposed


def _linear(ours: str, theirs: str, conv1d: bool = False) -> list[Rule]:
    return [Rule(f"{ours}.weight", f"{theirs}.weight", conv1d), Rule(f"{ours}.bias", f"{theirs}.bias")]


GPT_RULES = [Rule("embedding.word_embeddings.weight", "transformer.wte.weight"),
             Rule("embedding.position_embeddings", "transformer.wpe.weight"),
             *_linear("final_norm", "transformer.ln_f")]
GPT_LAYER_RULES = [*_linear("transformer.layers.{i}.input_norm", "transformer.h.{i}.ln_1"),
                   *_linear("transformer.layers.{i}.attention.dense", "transformer.h.{i}.attn.c_proj", True),
                   *_linear("transformer.layers.{i}.post_attention_norm", "transformer.h.{i}.ln_2"),
                   *_linear("transformer.layers.{i}.mlp.fc1", "transformer.h.{i}.mlp.c_fc", True),
                   *_linear("transformer.layers.{i}.mlp.fc2", "transformer.h.{i}.mlp.c_proj", True)]
BERT_RULES = [Rule("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
              Rule("embedding.position_embeddings", "bert.embeddings.position_embeddings.weight"),
              Rule("embedding.tokentype_embeddings", "bert.embeddings.token_type_embeddings.weight"),
              *_linear("heads.final_norm", "bert.encoder.ln"),
              *_linear("heads.lm_transform", "cls.predictions.transform.dense"),
              *_linear("heads.lm_norm", "cls.predictions.transform.LayerNorm"),
              Rule("heads.lm_bias", "cls.predictions.bias")]
BERT_BINARY_RULES = [*_linear("heads.pooler", "bert.pooler.dense"),
                     *_linear("heads.binary_head", "cls.seq_relationship")]
BERT_LAYER_RULES = [*_linear("transformer.layers.{i}.input_norm", "bert.encoder.layer.{i}.attention.ln"),
                    *_linear("transformer.layers.{i}.attention.dense",
                             "bert.encoder.layer.{i}.attention.output.dense"),
                    *_linear("transformer.layers.{i}.post_attention_norm", "bert.encoder.layer.{i}.ln"),
                    *_linear("transformer.layers.{i}.mlp.fc1", "bert.encoder.layer.{i}.intermediate.dense"),
                    *_linear("transformer.layers.{i}.mlp.fc2", "bert.encoder.layer.{i}.output.dense")]


def _rules(model: ModelConfig) -> list[Rule]:
    if model.model_type == "gpt":
        fixed, per_layer = GPT_RULES, GPT_LAYER_RULES
        if model.untie_embeddings_and_output_weights:
            fixed = fixed + [Rule("output_layer", "lm_head.weight")]
    else:
        fixed, per_layer = BERT_RULES + BERT_BINARY_RULES, BERT_LAYER_RULES
    return fixed + [Rule(r.ours.format(i=i), r.theirs.format(i=i), r.conv1d)
                    for i in range(model.num_layers) for r in per_layer]


def _qkv_names(model: ModelConfig, i: int) -> tuple[str, list[str]]:
    ours = f"transformer.layers.{i}.attention.qkv"
    if model.model_type == "gpt":
        return ours, [f"transformer.h.{i}.attn.c_attn"]
    return ours, [f"bert.encoder.layer.{i}.attention.self.{x}" for x in ("query", "key", "value")]


def to_hf_weights(model: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our unsharded weights -> the transformers state dict (tied output weights left out, as
    save_pretrained does)."""
    weights = dict(weights)
    if model.model_type == "bert":
        if model.num_tokentypes == 0:  # no token types: a zero table adds nothing
            weights["embedding.tokentype_embeddings"] = torch.zeros(2, model.hidden_size)
        if not model.bert_binary_head:  # MegatronBertForPreTraining always has them; unused
            h = model.hidden_size
            weights.update({"heads.pooler.weight": torch.zeros(h, h), "heads.pooler.bias": torch.zeros(h),
                            "heads.binary_head.weight": torch.zeros(2, h),
                            "heads.binary_head.bias": torch.zeros(2)})
    out = {}
    for rule in _rules(model):
        tensor = weights[rule.ours]
        out[rule.theirs] = (tensor.t() if rule.conv1d else tensor).contiguous().clone()
    for i in range(model.num_layers):
        ours, theirs = _qkv_names(model, i)
        for part in ("weight", "bias"):
            q, k, v = split_qkv(weights[f"{ours}.{part}"], model.num_attention_heads)
            if model.model_type == "gpt":
                joined = torch.cat([q, k, v])
                out[f"{theirs[0]}.{part}"] = (joined.t() if part == "weight" else joined).contiguous()
            else:
                for name, tensor in zip(theirs, (q, k, v)):
                    out[f"{name}.{part}"] = tensor
    return out


def from_hf_weights(model: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of to_hf_weights."""
    out = {}
    for rule in _rules(model):
        tensor = hf[rule.theirs]
        out[rule.ours] = (tensor.t() if rule.conv1d else tensor).contiguous().clone()
    for i in range(model.num_layers):
        ours, theirs = _qkv_names(model, i)
        for part in ("weight", "bias"):
            if model.model_type == "gpt":
                fused = hf[f"{theirs[0]}.{part}"]
                q, k, v = (fused.t() if part == "weight" else fused).chunk(3)
            else:
                q, k, v = (hf[f"{name}.{part}"] for name in theirs)
            out[f"{ours}.{part}"] = join_qkv(q, k, v, model.num_attention_heads)
    return out


# -- configurations ----------------------------------------------------------------------------------

def to_hf_config(model: ModelConfig, special_ids: dict[str, int | None]):
    import transformers

    if model.model_type == "gpt":
        if model.num_tokentypes:
            raise ConversionError("a GPT with token-type embeddings has no GPT2LMHeadModel equivalent")
        config = transformers.GPT2Config(
            vocab_size=model.vocab_size, n_positions=model.max_position_embeddings,
            n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_attention_heads,
            n_inner=model.ffn_hidden_size, activation_function="gelu",
            resid_pdrop=model.hidden_dropout, embd_pdrop=model.hidden_dropout,
            attn_pdrop=model.attention_dropout, layer_norm_epsilon=model.layernorm_epsilon,
            initializer_range=model.init_method_std, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            tie_word_embeddings=not model.untie_embeddings_and_output_weights,
            bos_token_id=special_ids.get("eod"), eos_token_id=special_ids.get("eod"))
        config.architectures = ["GPT2LMHeadModel"]
    else:
        config = transformers.MegatronBertConfig(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            intermediate_size=model.ffn_hidden_size, hidden_act="gelu",
            hidden_dropout_prob=model.hidden_dropout,
            attention_probs_dropout_prob=model.attention_dropout,
            max_position_embeddings=model.max_position_embeddings,
            type_vocab_size=model.num_tokentypes or 2, initializer_range=model.init_method_std,
            layer_norm_eps=model.layernorm_epsilon, pad_token_id=special_ids.get("pad"),
            tie_word_embeddings=True)
        config.architectures = ["MegatronBertForPreTraining"]
    config.dtype = "float32"
    return config


def _require(condition: bool, field: str, value, expected: str) -> None:
    if not condition:
        raise ConversionError(f"config.json has {field} = {value!r}; megatron_2bw computes "
                              f"{expected}, so importing would change the model's function")


def from_hf_config(config) -> ModelConfig:
    """A ModelConfig computing the same function as `config`, or a ConversionError naming the
    field that our model cannot reproduce."""
    if config.model_type == "gpt2":
        _require(config.activation_function in EXACT_GELU, "activation_function",
                 config.activation_function, 'the exact erf GELU ("gelu")')
        _require(config.scale_attn_weights, "scale_attn_weights", config.scale_attn_weights,
                 "attention scaled by 1/sqrt(head_dim) (true)")
        _require(not config.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx",
                 config.scale_attn_by_inverse_layer_idx, "no per-layer attention scaling (false)")
        _require(not config.add_cross_attention, "add_cross_attention", config.add_cross_attention,
                 "no cross-attention (false)")
        if config.embd_pdrop != config.resid_pdrop:
            print(f" note: embd_pdrop {config.embd_pdrop} differs from resid_pdrop "
                  f"{config.resid_pdrop}; training uses --hidden-dropout {config.resid_pdrop} for "
                  f"both (dropout does not change the evaluated function)", flush=True)
        return ModelConfig(
            model_type="gpt", num_layers=config.n_layer, hidden_size=config.n_embd,
            num_attention_heads=config.n_head, ffn_hidden_size=config.n_inner or 4 * config.n_embd,
            seq_length=config.n_positions, max_position_embeddings=config.n_positions,
            vocab_size=config.vocab_size, hidden_dropout=config.resid_pdrop,
            attention_dropout=config.attn_pdrop, init_method_std=config.initializer_range,
            layernorm_epsilon=config.layer_norm_epsilon,
            untie_embeddings_and_output_weights=not config.tie_word_embeddings)
    if config.model_type == "megatron-bert":
        _require(config.hidden_act in EXACT_GELU, "hidden_act", config.hidden_act,
                 'the exact erf GELU ("gelu")')
        _require(not config.is_decoder, "is_decoder", config.is_decoder, "a bidirectional encoder")
        _require(getattr(config, "position_embedding_type", "absolute") == "absolute",
                 "position_embedding_type", getattr(config, "position_embedding_type", None),
                 "learned absolute positions")
        return ModelConfig(
            model_type="bert", num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            ffn_hidden_size=config.intermediate_size, seq_length=config.max_position_embeddings,
            max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size,
            hidden_dropout=config.hidden_dropout_prob,
            attention_dropout=config.attention_probs_dropout_prob,
            init_method_std=config.initializer_range, layernorm_epsilon=config.layer_norm_eps,
            bert_binary_head=True, num_tokentypes=config.type_vocab_size)
    raise ConversionError(f"config.json has model_type = {config.model_type!r}; supported are "
                          f"'gpt2' (GPT2LMHeadModel) and 'megatron-bert' (MegatronBertForPreTraining)")


# -- tokenizers --------------------------------------------------------------------------------------

def export_tokenizer(data: DataConfig, output: str) -> str | None:
    """Write the run's tokenizer as transformers files; returns what was written (None: the run
    had no tokenizer files, e.g. --mock-data)."""
    import transformers

    kind = data.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        transformers.AutoTokenizer.from_pretrained(data.tokenizer_model, local_files_only=True) \
            .save_pretrained(output)
        return f"the HuggingFaceTokenizer of {data.tokenizer_model}"
    if kind == "SentencePieceTokenizer":
        shutil.copyfile(data.tokenizer_model, os.path.join(output, "tokenizer.model"))
        return (f"{data.tokenizer_model} copied as tokenizer.model, a raw SentencePiece model: "
                f"load it with sentencepiece.SentencePieceProcessor (AutoTokenizer would guess "
                f"another class from config.json); import_from_hf.py reads it back as "
                f"SentencePieceTokenizer")
    if kind == "GPT2BPETokenizer":
        from tokenizers import ByteLevelBPETokenizer

        rust = ByteLevelBPETokenizer(data.vocab_file, data.merge_file)
        special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from tokenizers import BertWordPieceTokenizer

        lowercase = kind == "BertWordPieceLowerCase"
        rust = BertWordPieceTokenizer(data.vocab_file, lowercase=lowercase, strip_accents=lowercase)
        special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]",
                   "pad_token": "[PAD]", "unk_token": "[UNK]"}
    else:  # NullTokenizer, mock data: token ids are the text
        return None
    vocabulary = rust.get_vocab()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "tokenizer.json")
        rust.save(path)
        transformers.PreTrainedTokenizerFast(
            tokenizer_file=path, **{k: v for k, v in special.items() if v in vocabulary}
        ).save_pretrained(output)
    return f"the {kind} tokenizer as tokenizer.json"


def has_tokenizer_files(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES)


# -- whole models ------------------------------------------------------------------------------------

def special_token_ids(config: Config) -> dict[str, int | None]:
    """eod/pad ids of the run's tokenizer (None when it has none or cannot be built here)."""
    from megatron_2bw.data.tokenizers import build_tokenizer

    try:
        tokenizer = build_tokenizer(config.data, config.model.vocab_size)
    except (ValueError, FileNotFoundError, OSError):
        return {}
    return {role: getattr(tokenizer, role) if tokenizer.has(role) else None
            for role in ("eod", "pad")}


def export_to_hf(state: FullState, output: str, data: DataConfig | None = None) -> list[str]:
    """Write `output`/config.json, model.safetensors and the tokenizer files; returns notes."""
    from safetensors.torch import save_file

    model = state.config.model
    os.makedirs(output, exist_ok=True)
    weights = to_hf_weights(model, state.model)
    save_file({k: v.float().contiguous() for k, v in weights.items()},
              os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    data = data or state.config.data
    to_hf_config(model, special_token_ids(Config(model=model, data=data))).save_pretrained(output)
    notes = []
    if model.model_type == "bert" and not model.bert_binary_head:
        notes.append("the model has no binary head: bert.pooler and cls.seq_relationship are zeros")
    written = export_tokenizer(data, output)
    notes.append(f"tokenizer: {written}" if written else "no tokenizer files (the run used token "
                                                         "ids directly)")
    with open(os.path.join(output, "megatron_2bw.json"), "w") as f:  # provenance
        json.dump({"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                   "config": state.config.to_dict()}, f, indent=2)
    return notes


def _tied(model, first: str, second: str) -> bool:
    a, b = model.get_parameter(first), model.get_parameter(second)
    return a is b or torch.equal(a, b)


def import_from_hf(path: str) -> FullState:
    """Load a transformers model directory (offline) as an unsharded state at iteration 0."""
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--hf-path {path}: no config.json (expected a directory written "
                                f"by save_pretrained)")
    hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    model_config = from_hf_config(hf_config)
    cls = (transformers.GPT2LMHeadModel if model_config.model_type == "gpt"
           else transformers.MegatronBertForPreTraining)
    hf_model, info = cls.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                         dtype=torch.float32)
    if info["missing_keys"]:
        raise ConversionError(f"{path} lacks weights of {cls.__name__}: "
                              f"{sorted(info['missing_keys'])[:4]} (a base model without heads?)")
    # old GPT-2 files carry the causal-mask buffers; any other extra weight would be dropped
    unexpected = [k for k in info["unexpected_keys"] if not k.endswith((".attn.bias", ".masked_bias"))]
    if unexpected:
        raise ConversionError(f"{path} holds weights {cls.__name__} does not use: "
                              f"{sorted(unexpected)[:4]}")
    output, embeddings = ("lm_head.weight", "transformer.wte.weight") \
        if model_config.model_type == "gpt" else \
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")
    if not model_config.untie_embeddings_and_output_weights and \
            not _tied(hf_model, output, embeddings):
        raise ConversionError(f"{path}: the output layer {output} differs from the word embeddings "
                              f"(tie_word_embeddings = {hf_config.tie_word_embeddings}); "
                              + ("megatron_2bw ties BERT's" if model_config.model_type == "bert"
                                 else "a tied config needs them equal"))
    if model_config.model_type == "bert" and not _tied(hf_model, "cls.predictions.decoder.bias",
                                                       "cls.predictions.bias"):
        raise ConversionError(f"{path}: cls.predictions.decoder.bias differs from "
                              f"cls.predictions.bias; megatron_2bw has one output bias")
    weights = from_hf_weights(model_config, {k: v.detach() for k, v in hf_model.state_dict().items()})
    return FullState(Config(model=model_config), weights)


# A SentencePiece model with none of transformers' own tokenizer files (what export_tokenizer
# writes for a SentencePiece run): transformers would pick a tokenizer class from config.json's
# model_type and split text differently, so it is imported as the SentencePiece model it is.
RAW_SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")
TRANSFORMERS_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def import_tokenizer(path: str, directory: str) -> DataConfig | None:
    """Copy the model directory's tokenizer (if any) to `directory`; the data flags that use it."""
    import transformers

    if not has_tokenizer_files(path):
        return None
    raw = [name for name in RAW_SENTENCEPIECE_FILES if os.path.isfile(os.path.join(path, name))]
    if raw and not any(os.path.isfile(os.path.join(path, name))
                       for name in TRANSFORMERS_TOKENIZER_FILES):
        os.makedirs(directory, exist_ok=True)
        model = os.path.join(os.path.abspath(directory), "tokenizer.model")
        shutil.copyfile(os.path.join(path, raw[0]), model)
        return DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
    transformers.AutoTokenizer.from_pretrained(path, local_files_only=True).save_pretrained(directory)
    return DataConfig(tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=os.path.abspath(directory))
