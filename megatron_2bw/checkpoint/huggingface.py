"""Hugging Face transformers <-> megatron_2bw weights: a GPT of GPT-2's layout as GPT2LMHeadModel,
one of Llama's (RMSNorm, SwiGLU, rotary positions) as LlamaForCausalLM, as Qwen2ForCausalLM when
only the qkv projection has biases, or as Qwen3ForCausalLM with --qk-layernorm and no biases; BERT
as MegatronBertForPreTraining (pre-LayerNorm BERT, the same layout as ours). Any other combination
of the architecture switches is refused by field.

Both directions work on unsharded state (reshard.FullState, true vocabulary). What differs:
- Our fused qkv rows are ordered (query group, [its query heads, k, v], head_dim), so a
  tensor-parallel shard holds whole groups; GPT-2's c_attn is [q_all | k_all | v_all],
  MegatronBert and Llama have separate query/key/value projections.
- Our SwiGLU fc1 rows alternate (gate, up) per unit; Llama has gate_proj and up_proj.
- GPT-2's c_attn, c_proj and c_fc are Conv1D layers: weights stored [in, out], ours [out, in].
- Under --apply-layernorm-1p our norms store gain - 1; transformers' hold the gain. Export adds 1;
  import always gives plain gains (apply_layernorm_1p off).
- Our activation is the exact (erf) GELU, transformers' "gelu", or under --openai-gelu its tanh
  approximation, transformers' "gelu_new" (GPT-2's own, its default), which import maps to
  --openai-gelu. A model using another function is refused rather than silently changed.
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
from megatron_2bw.data.tokenizers import SENTENCEPIECE_TYPES

EXACT_GELU = ("gelu", "gelu_python")  # transformers' names of erf GELU
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # ... and of its tanh approximation
SILU = ("silu", "swish")  # transformers' names of x * sigmoid(x)
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
# transformers' "llama3" rope type with the constants Megatron-LM's --use-rope-scaling fixes
# (models.transformer.llama3_scaled); the factor is --rope-scaling-factor
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# Written by export beside the model: the run's iteration and configuration (provenance) and the
# --tokenizer-type of the tokenizer files, which import reads back for a raw SentencePiece model.
PROVENANCE_FILE = "megatron_2bw.json"
# Files whose presence means a directory carries a transformers tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "tokenizer.model", "spiece.model")


class ConversionError(ValueError):
    """The model cannot be converted without changing what it computes; the message says why."""


# -- fused layouts -----------------------------------------------------------------------------------

def split_rows(fused: torch.Tensor, blocks: int, sizes: list[int]) -> list[torch.Tensor]:
    """Rows made of `blocks` blocks, each `sizes` rows of one part after another -> the parts, each
    with its rows of every block in order."""
    per_block = fused.reshape(blocks, sum(sizes), *fused.shape[1:])
    return [part.reshape(-1, *fused.shape[1:]).clone() for part in per_block.split(sizes, dim=1)]


def join_rows(parts: list[torch.Tensor], blocks: int) -> torch.Tensor:
    """The inverse of split_rows."""
    per_block = [part.reshape(blocks, -1, *part.shape[1:]) for part in parts]
    return torch.cat(per_block, dim=1).reshape(-1, *parts[0].shape[1:]).clone()


# -- name mappings -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    ours: str  # "{i}" stands for the global layer index
    theirs: str
    conv1d: bool = False  # GPT-2 Conv1D: weight stored transposed


def _linear(ours: str, theirs: str, conv1d: bool = False) -> list[Rule]:
    return [Rule(f"{ours}.weight", f"{theirs}.weight", conv1d), Rule(f"{ours}.bias", f"{theirs}.bias")]


GPT_RULES = [Rule(WORD_EMBEDDINGS, "transformer.wte.weight"),
             Rule("embedding.position_embeddings", "transformer.wpe.weight"),
             *_linear("final_norm", "transformer.ln_f")]
GPT_LAYER_RULES = [*_linear("transformer.layers.{i}.input_norm", "transformer.h.{i}.ln_1"),
                   *_linear("transformer.layers.{i}.attention.dense", "transformer.h.{i}.attn.c_proj", True),
                   *_linear("transformer.layers.{i}.post_attention_norm", "transformer.h.{i}.ln_2"),
                   *_linear("transformer.layers.{i}.mlp.fc1", "transformer.h.{i}.mlp.c_fc", True),
                   *_linear("transformer.layers.{i}.mlp.fc2", "transformer.h.{i}.mlp.c_proj", True)]
BERT_RULES = [Rule(WORD_EMBEDDINGS, "bert.embeddings.word_embeddings.weight"),
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
# Llama, Qwen2 and Qwen3 (the qkv projection and, with SwiGLU, fc1 are split in the layer loops
# below)
LLAMA_RULES = [Rule(WORD_EMBEDDINGS, "model.embed_tokens.weight"),
               Rule("final_norm.weight", "model.norm.weight")]
LLAMA_LAYER_RULES = [Rule("transformer.layers.{i}.input_norm.weight",
                          "model.layers.{i}.input_layernorm.weight"),
                     Rule("transformer.layers.{i}.post_attention_norm.weight",
                          "model.layers.{i}.post_attention_layernorm.weight"),
                     *_linear("transformer.layers.{i}.attention.dense", "model.layers.{i}.self_attn.o_proj"),
                     *_linear("transformer.layers.{i}.mlp.fc2", "model.layers.{i}.mlp.down_proj")]
QWEN3_LAYER_RULES = [Rule(f"transformer.layers.{{i}}.attention.{x}_norm.weight",
                         f"model.layers.{{i}}.self_attn.{x}_norm.weight") for x in "qk"]
LLAMA_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


# -- which transformers class ------------------------------------------------------------------------

def _unlike(fields: dict[str, tuple]) -> list[str]:
    """'field = wanted (the model has actual)' for each field whose (actual, wanted) differ."""
    return [f"{field} = {wanted!r} (the model has {actual!r})"
            for field, (actual, wanted) in fields.items() if actual != wanted]


def _unlike_gpt2(model: ModelConfig) -> list[str]:
    """What keeps `model` from GPT-2's (and MegatronBert's) layout."""
    return _unlike({"normalization": (model.normalization, "LayerNorm"),
                    "swiglu": (model.swiglu, False),
                    "position_embedding_type": (model.position_embedding_type, "learned_absolute"),
                    "add_bias_linear": (model.add_bias_linear, True),
                    "num_query_groups": (model.query_groups, model.num_attention_heads),
                    "qk_layernorm": (model.qk_layernorm, False),
                    **_no_head_size(model)})


def _no_head_size(model: ModelConfig) -> dict[str, tuple]:
    """For the classes whose heads are always hidden / heads wide (GPT-2, MegatronBert, Qwen2)."""
    head_size = model.kv_channels if model.attention_size != model.hidden_size else None
    return {"kv_channels": (head_size, None)}


def _unlike_llama(model: ModelConfig) -> list[str]:
    """What keeps `model` from Llama's layout (biases and query groups may be anything)."""
    return _unlike({"normalization": (model.normalization, "RMSNorm"),
                    "swiglu": (model.swiglu, True),
                    "position_embedding_type": (model.position_embedding_type, "rope"),
                    "rotary_percent": (model.rotary_percent, 1.0),  # Llama rotates every channel
                    "rotary_interleaved": (model.rotary_interleaved, False)})


def _unlike_qwen3(model: ModelConfig) -> list[str]:
    """What keeps `model` (with qk_layernorm) from Qwen3's layout: Llama's, without biases (Qwen3's
    MLP has none, and its attention_bias would put some on o_proj too)."""
    return _unlike_llama(model) + _unlike({"add_bias_linear": (model.add_bias_linear, False),
                                           "add_qkv_bias": (model.add_qkv_bias, False)})


def hf_architecture(model: ModelConfig) -> str:
    """The transformers class that computes what `model` computes, or a ConversionError naming
    every field that rules each candidate out. Llama's attention_bias and mlp_bias are both
    add_bias_linear; biases on the qkv projection only (add_qkv_bias) are Qwen2's layout; of the
    Llama-like classes only Qwen3 normalises queries and keys (qk_layernorm)."""
    gpt2 = _unlike_gpt2(model)
    if model.model_type == "bert":
        if gpt2:
            raise ConversionError(f"MegatronBertForPreTraining needs {'; '.join(gpt2)}")
        return "MegatronBertForPreTraining"
    if model.num_tokentypes:
        raise ConversionError(f"a GPT with token-type embeddings (num_tokentypes = "
                              f"{model.num_tokentypes}) has no transformers equivalent")
    if not gpt2:
        return "GPT2LMHeadModel"
    if model.qk_layernorm:
        candidate, unlike = "Qwen3ForCausalLM", _unlike_qwen3(model)
    else:
        qwen2 = model.add_qkv_bias and not model.add_bias_linear
        candidate = "Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"
        unlike = _unlike_llama(model) + (_unlike(_no_head_size(model)) if qwen2 else [])
    if unlike:
        raise ConversionError(f"this GPT has no transformers equivalent: GPT2LMHeadModel needs "
                              f"{'; '.join(gpt2)}. {candidate} needs {'; '.join(unlike)}")
    return candidate


# -- weights -----------------------------------------------------------------------------------------

def _rules(model: ModelConfig, architecture: str) -> list[Rule]:
    if architecture == "MegatronBertForPreTraining":
        fixed, per_layer = BERT_RULES + BERT_BINARY_RULES, BERT_LAYER_RULES
    else:
        fixed, per_layer = (GPT_RULES, GPT_LAYER_RULES) if architecture == "GPT2LMHeadModel" \
            else (LLAMA_RULES, LLAMA_LAYER_RULES)
        if architecture == "Qwen3ForCausalLM":
            per_layer = per_layer + QWEN3_LAYER_RULES
        if model.untie_embeddings_and_output_weights:
            fixed = fixed + [Rule("output_layer", "lm_head.weight")]
    if not model.add_bias_linear:
        per_layer = [r for r in per_layer if not r.ours.endswith(".bias")]
    return fixed + [Rule(r.ours.format(i=i), r.theirs.format(i=i), r.conv1d)
                    for i in range(model.num_layers) for r in per_layer]


def _qkv_names(architecture: str, i: int) -> tuple[str, list[str]]:
    ours = f"transformer.layers.{i}.attention.qkv"
    if architecture == "GPT2LMHeadModel":
        return ours, [f"transformer.h.{i}.attn.c_attn"]
    if architecture in LLAMA_CLASSES:
        return ours, [f"model.layers.{i}.self_attn.{x}_proj" for x in "qkv"]
    return ours, [f"bert.encoder.layer.{i}.attention.self.{x}" for x in ("query", "key", "value")]


@dataclass(frozen=True)
class Fused:
    """One of our fused projections and their separate ones: its rows are `blocks` blocks, each
    `sizes` rows of one part after another (GPT-2's c_attn fuses the parts again, one name)."""
    ours: str
    theirs: list[str]
    blocks: int
    sizes: list[int]
    parts: tuple[str, ...]  # "weight" and perhaps "bias"


def _fused(model: ModelConfig, architecture: str) -> list[Fused]:
    """Every layer's qkv projection and, with SwiGLU, fc1 (their gate_proj and up_proj)."""
    d, per_group = model.head_dim, model.num_attention_heads // model.query_groups
    qkv_parts = ("weight", "bias") if model.add_bias_linear or model.add_qkv_bias else ("weight",)
    linear_parts = ("weight", "bias") if model.add_bias_linear else ("weight",)
    fused = []
    for i in range(model.num_layers):
        fused.append(Fused(*_qkv_names(architecture, i), model.query_groups,
                           [per_group * d, d, d], qkv_parts))
        if model.swiglu:  # rows alternate gate, up
            fused.append(Fused(f"transformer.layers.{i}.mlp.fc1",
                               [f"model.layers.{i}.mlp.{x}_proj" for x in ("gate", "up")],
                               model.ffn_hidden_size, [1, 1], linear_parts))
    return fused


def _shift_norm_weights(model: ModelConfig, weights: dict[str, torch.Tensor],
                        offset: float) -> dict[str, torch.Tensor]:
    """`offset` added to every norm's weight under --apply-layernorm-1p, where ours hold gain - 1
    and transformers' the gain: +1 on the way out, -1 on the way in. Every norm of ours (layers',
    final, q/k, BERT's lm_norm) is named *norm, so one rule covers every architecture."""
    if not model.apply_layernorm_1p:
        return dict(weights)
    return {name: tensor + offset if name.endswith("norm.weight") else tensor
            for name, tensor in weights.items()}


def to_hf_weights(model: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our unsharded weights -> the transformers state dict (tied output weights left out, as
    save_pretrained does)."""
    architecture = hf_architecture(model)
    weights = _shift_norm_weights(model, weights, 1.0)
    if model.model_type == "bert":
        if model.num_tokentypes == 0:  # no token types: a zero table adds nothing
            weights["embedding.tokentype_embeddings"] = torch.zeros(2, model.hidden_size)
        if not model.bert_binary_head:  # MegatronBertForPreTraining always has them; unused
            h = model.hidden_size
            weights.update({"heads.pooler.weight": torch.zeros(h, h), "heads.pooler.bias": torch.zeros(h),
                            "heads.binary_head.weight": torch.zeros(2, h),
                            "heads.binary_head.bias": torch.zeros(2)})
    out = {}
    for rule in _rules(model, architecture):
        tensor = weights[rule.ours]
        out[rule.theirs] = (tensor.t() if rule.conv1d else tensor).contiguous().clone()
    for f in _fused(model, architecture):
        for part in f.parts:
            split = split_rows(weights[f"{f.ours}.{part}"], f.blocks, f.sizes)
            if architecture == "GPT2LMHeadModel":  # c_attn: [q_all | k_all | v_all], Conv1D
                joined = torch.cat(split)
                out[f"{f.theirs[0]}.{part}"] = (joined.t() if part == "weight" else joined).contiguous()
            else:
                for name, tensor in zip(f.theirs, split):
                    out[f"{name}.{part}"] = tensor
    return out


def from_hf_weights(model: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of to_hf_weights."""
    architecture = hf_architecture(model)
    out = {}
    for rule in _rules(model, architecture):
        tensor = hf[rule.theirs]
        out[rule.ours] = (tensor.t() if rule.conv1d else tensor).contiguous().clone()
    for f in _fused(model, architecture):
        for part in f.parts:
            if architecture == "GPT2LMHeadModel":
                c_attn = hf[f"{f.theirs[0]}.{part}"]
                split = (c_attn.t() if part == "weight" else c_attn).chunk(3)
            else:
                split = [hf[f"{name}.{part}"] for name in f.theirs]
            out[f"{f.ours}.{part}"] = join_rows(split, f.blocks)
    return _shift_norm_weights(model, out, -1.0)


# -- configurations ----------------------------------------------------------------------------------

def to_hf_config(model: ModelConfig, special_ids: dict[str, int | None]):
    import transformers

    architecture = hf_architecture(model)
    if architecture == "GPT2LMHeadModel":
        config = transformers.GPT2Config(
            vocab_size=model.vocab_size, n_positions=model.max_position_embeddings,
            n_embd=model.hidden_size, n_layer=model.num_layers, n_head=model.num_attention_heads,
            n_inner=model.ffn_hidden_size, activation_function=_gelu_name(model),
            resid_pdrop=model.hidden_dropout, embd_pdrop=model.hidden_dropout,
            attn_pdrop=model.attention_dropout, layer_norm_epsilon=model.layernorm_epsilon,
            initializer_range=model.init_method_std, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            tie_word_embeddings=not model.untie_embeddings_and_output_weights,
            bos_token_id=special_ids.get("eod"), eos_token_id=special_ids.get("eod"))
    elif architecture in LLAMA_CLASSES:
        config_class, biases = {
            "LlamaForCausalLM": (transformers.LlamaConfig, {"attention_bias": model.add_bias_linear,
                                                            "mlp_bias": model.add_bias_linear}),
            "Qwen2ForCausalLM": (transformers.Qwen2Config, {}),  # q, k and v always have biases
            "Qwen3ForCausalLM": (transformers.Qwen3Config, {"attention_bias": False}),
        }[architecture]
        config = config_class(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.query_groups, head_dim=model.head_dim,
            intermediate_size=model.ffn_hidden_size, hidden_act="silu",
            max_position_embeddings=model.max_position_embeddings,
            rope_parameters=_rope_parameters(model),
            rms_norm_eps=model.layernorm_epsilon, attention_dropout=model.attention_dropout,
            initializer_range=model.init_method_std,
            tie_word_embeddings=not model.untie_embeddings_and_output_weights,
            bos_token_id=special_ids.get("eod"), eos_token_id=special_ids.get("eod"), **biases)
    else:
        config = transformers.MegatronBertConfig(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            intermediate_size=model.ffn_hidden_size, hidden_act=_gelu_name(model),
            hidden_dropout_prob=model.hidden_dropout,
            attention_probs_dropout_prob=model.attention_dropout,
            max_position_embeddings=model.max_position_embeddings,
            type_vocab_size=model.num_tokentypes or 2, initializer_range=model.init_method_std,
            layer_norm_eps=model.layernorm_epsilon, pad_token_id=special_ids.get("pad"),
            tie_word_embeddings=True)
    config.architectures = [architecture]
    config.dtype = "float32"
    return config


def _gelu_name(model: ModelConfig) -> str:
    return TANH_GELU[0] if model.openai_gelu else EXACT_GELU[0]


def _gelu_of(field: str, name: str) -> dict:
    """ModelConfig's activation field for transformers' `name`, or a ConversionError."""
    _require(name in EXACT_GELU + TANH_GELU, field, name,
             'the exact erf GELU ("gelu") or its tanh approximation ("gelu_new")')
    return {"openai_gelu": name in TANH_GELU}


def _rope_parameters(model: ModelConfig) -> dict:
    if not model.rope_scaling:
        return {"rope_type": "default", "rope_theta": model.rotary_base}
    return {"rope_type": "llama3", "rope_theta": model.rotary_base,
            "factor": model.rope_scaling_factor, **LLAMA3_ROPE}


def _require(condition: bool, field: str, value, expected: str) -> None:
    if not condition:
        raise ConversionError(f"config.json has {field} = {value!r}; megatron_2bw computes "
                              f"{expected}, so importing would change the model's function")


def from_hf_config(config) -> ModelConfig:
    """A ModelConfig computing the same function as `config`, or a ConversionError naming the
    field that our model cannot reproduce."""
    if config.model_type == "gpt2":
        activation = _gelu_of("activation_function", config.activation_function)
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
            untie_embeddings_and_output_weights=not config.tie_word_embeddings, **activation)
    if config.model_type == "megatron-bert":
        activation = _gelu_of("hidden_act", config.hidden_act)
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
            bert_binary_head=True, num_tokentypes=config.type_vocab_size, **activation)
    if config.model_type in ("llama", "qwen2", "qwen3"):
        return _from_llama_config(config)
    raise ConversionError(f"config.json has model_type = {config.model_type!r}; supported are "
                          f"'gpt2' (GPT2LMHeadModel), 'llama' (LlamaForCausalLM), 'qwen2' "
                          f"(Qwen2ForCausalLM), 'qwen3' (Qwen3ForCausalLM) and 'megatron-bert' "
                          f"(MegatronBertForPreTraining)")


def _from_llama_config(config) -> ModelConfig:
    """LlamaForCausalLM, Qwen2ForCausalLM (Llama with biases on q, k and v only) and
    Qwen3ForCausalLM (Llama with RMSNorm over each head's queries and keys: --qk-layernorm)."""
    _require(config.hidden_act in SILU, "hidden_act", config.hidden_act,
             'SwiGLU, silu(gate) * up ("silu")')
    rope = config.rope_parameters  # transformers folds an older rope_theta and rope_scaling in
    _require(rope.get("rope_type", "default") in ("default", "llama3"),
             "rope_parameters (rope_scaling)", rope, 'rotary embeddings unscaled (rope_type '
             '"default") or scaled as Llama 3.1\'s ("llama3", --use-rope-scaling)')
    scaling = {}
    if rope.get("rope_type") == "llama3":
        for key, value in LLAMA3_ROPE.items():
            _require(rope.get(key) == value, f"rope_parameters[{key!r}]", rope.get(key),
                     f"--use-rope-scaling with Megatron-LM's fixed {key} = {value}")
        scaling = {"rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    head_dim = getattr(config, "head_dim", None)  # Qwen3's may differ from hidden / heads
    if head_dim == config.hidden_size // config.num_attention_heads:
        head_dim = None
    if config.model_type == "llama":
        _require(config.mlp_bias == config.attention_bias, "mlp_bias", config.mlp_bias,
                 f"biases in the MLP exactly when attention has them (attention_bias = "
                 f"{config.attention_bias}): --disable-bias-linear removes both")
        layout = {"add_bias_linear": config.attention_bias}
    else:
        _require(all(kind == "full_attention" for kind in config.layer_types), "layer_types",
                 config.layer_types, "full causal attention in every layer (no sliding window)")
        if config.model_type == "qwen2":
            layout = {"add_bias_linear": False, "add_qkv_bias": True}
        else:
            _require(not config.attention_bias, "attention_bias", config.attention_bias,
                     "Qwen3 without biases (false): biases on q, k, v and o_proj but not the MLP "
                     "are no combination of --add-qkv-bias and --disable-bias-linear")
            layout = {"add_bias_linear": False, "qk_layernorm": True}
    groups = config.num_key_value_heads
    return ModelConfig(
        model_type="gpt", num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.intermediate_size,
        seq_length=config.max_position_embeddings,
        max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size,
        hidden_dropout=0.0, attention_dropout=config.attention_dropout,
        init_method_std=config.initializer_range, layernorm_epsilon=config.rms_norm_eps,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        num_query_groups=None if groups == config.num_attention_heads else groups,
        kv_channels=head_dim, untie_embeddings_and_output_weights=not config.tie_word_embeddings, **scaling, **layout)


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
    if kind in SENTENCEPIECE_TYPES:
        shutil.copyfile(data.tokenizer_model, os.path.join(output, "tokenizer.model"))
        back = f"import_from_hf.py reads it back as {_raw_sentencepiece_type(kind)}"
        if sentencepiece_for_auto_tokenizer(data.tokenizer_model, kind == "Llama2Tokenizer",
                                            output):
            return (f"{data.tokenizer_model} copied as tokenizer.model and converted to "
                    f"tokenizer.json (AutoTokenizer loads it, encoding as SentencePiece does); "
                    f"{back}")
        bos = ", putting <s> before each text" if kind == "Llama2Tokenizer" else ""
        return (f"{data.tokenizer_model} copied as tokenizer.model, a raw SentencePiece model: "
                f"this transformers cannot convert it to encode alike, so load it with "
                f"sentencepiece.SentencePieceProcessor{bos}; {back}")
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


# encoded by the converted tokenizer and by SentencePiece, which must agree: words, case, spaces,
# digits, punctuation, a line break and letters a small vocabulary may lack
CONVERSION_PROBE = "The king spoke:  of love, 1601 and war!\nThou art ümlaut?"


def sentencepiece_for_auto_tokenizer(model_file: str, prepend_bos: bool, output: str) -> bool:
    """Write tokenizer.json and tokenizer_config.json for transformers.AutoTokenizer, converted
    from the SentencePiece model by transformers itself; False (nothing written) where this
    transformers cannot convert it or the conversion encodes CONVERSION_PROBE otherwise."""
    import sentencepiece
    import transformers

    processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    special = {f"{role}_token": processor.id_to_piece(index)
               for role, index in (("unk", processor.unk_id()), ("bos", processor.bos_id()),
                                   ("eos", processor.eos_id()), ("pad", processor.pad_id()))
               if index >= 0}
    expected = ([processor.bos_id()] if prepend_bos else []) + processor.encode(CONVERSION_PROBE)
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copyfile(model_file, os.path.join(scratch, "tokenizer.model"))
        with open(os.path.join(scratch, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": prepend_bos,
                       "add_eos_token": False, **special}, f)
        try:
            converted = transformers.AutoTokenizer.from_pretrained(scratch, local_files_only=True)
        except Exception:  # noqa: BLE001 - a transformers without this conversion
            return False
        if converted.encode(CONVERSION_PROBE) != expected:
            return False
        converted.save_pretrained(output)
    # the class every transformers knows (newer ones record their tokenizers backend's name)
    path = os.path.join(output, "tokenizer_config.json")
    with open(path) as f:
        settings = json.load(f)
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)
    return True


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
    hf_architecture(model)  # refuse before writing anything
    os.makedirs(output, exist_ok=True)
    weights = to_hf_weights(model, state.model)
    path = os.path.join(output, "model.safetensors")
    save_file({k: v.float().contiguous() for k, v in weights.items()}, path,
              metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())  # safetensors creates it 0600, unlike the other files
    data = data or state.config.data
    to_hf_config(model, special_token_ids(Config(model=model, data=data))).save_pretrained(output)
    notes = []
    if model.model_type == "bert" and not model.bert_binary_head:
        notes.append("the model has no binary head: bert.pooler and cls.seq_relationship are zeros")
    written = export_tokenizer(data, output)
    notes.append(f"tokenizer: {written}" if written else "no tokenizer files (the run used token "
                                                         "ids directly)")
    with open(os.path.join(output, PROVENANCE_FILE), "w") as f:
        json.dump({"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                   "tokenizer_type": data.tokenizer_type, "config": state.config.to_dict()},
                  f, indent=2)
    return notes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    architecture = hf_architecture(model_config)
    cls = getattr(transformers, architecture)
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
    embeddings = next(r.theirs for r in _rules(model_config, architecture)
                      if r.ours == WORD_EMBEDDINGS)
    output = "lm_head.weight" if model_config.model_type == "gpt" \
        else "cls.predictions.decoder.weight"
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


# A SentencePiece model with none of transformers' own tokenizer files, or one export wrote beside
# its conversion: it is imported as the SentencePiece model it is (with no tokenizer files,
# transformers would pick a tokenizer class from config.json's model_type and split text
# differently).
RAW_SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")
TRANSFORMERS_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _raw_sentencepiece_type(exported_type: str | None) -> str:
    """The --tokenizer-type a raw SentencePiece model comes back as: Llama2Tokenizer if export
    recorded one (it puts <s> before each text), else SentencePieceTokenizer (which
    GPTSentencePieceTokenizer is too)."""
    return "Llama2Tokenizer" if exported_type == "Llama2Tokenizer" else "SentencePieceTokenizer"


def _exported_tokenizer_type(path: str) -> str | None:
    """The --tokenizer-type export recorded in `path` (None: not written by export)."""
    provenance = os.path.join(path, PROVENANCE_FILE)
    if not os.path.isfile(provenance):
        return None
    with open(provenance) as f:
        return json.load(f).get("tokenizer_type")


def import_tokenizer(path: str, directory: str) -> DataConfig | None:
    """Copy the model directory's tokenizer (if any) to `directory`; the data flags that use it."""
    import transformers

    if not has_tokenizer_files(path):
        return None
    raw = [name for name in RAW_SENTENCEPIECE_FILES if os.path.isfile(os.path.join(path, name))]
    # the SentencePiece model itself where export wrote it (its tokenizer.json is a conversion)
    if raw and (_exported_tokenizer_type(path) in SENTENCEPIECE_TYPES
                or not any(os.path.isfile(os.path.join(path, name))
                           for name in TRANSFORMERS_TOKENIZER_FILES)):
        os.makedirs(directory, exist_ok=True)
        model = os.path.join(os.path.abspath(directory), "tokenizer.model")
        shutil.copyfile(os.path.join(path, raw[0]), model)
        return DataConfig(tokenizer_type=_raw_sentencepiece_type(_exported_tokenizer_type(path)),
                          tokenizer_model=model)
    transformers.AutoTokenizer.from_pretrained(path, local_files_only=True).save_pretrained(directory)
    return DataConfig(tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=os.path.abspath(directory))
