"""Import a Hugging Face transformers model directory (GPT2LMHeadModel, LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM or MegatronBertForPreTraining, read offline) as a megatron_2bw
checkpoint of any layout, to continue pretraining or fine-tune it.

    python tools/import_from_hf.py --hf-path hf/gpt2 --save checkpoints/gpt2 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    torchrun --nproc-per-node 4 pretrain_gpt.py --load checkpoints/gpt2 --finetune ...

The imported model computes exactly what the transformers model computes, or the import is
refused with the config field that differs (e.g. GPT-2's default activation_function "gelu_new",
a tanh approximation of GELU, while megatron_2bw uses the exact GELU). The directory's tokenizer,
if any, is copied to SAVE/tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model
SAVE/tokenizer); a raw SentencePiece tokenizer.model, as export_to_hf.py writes it, comes in as
--tokenizer-type SentencePieceTokenizer, or Llama2Tokenizer when the export was of one.
--virtual-pipeline-model-parallel-size (or --num-layers-per-virtual-pipeline-stage) writes that
many model chunks per pipeline rank, for --pipeline-schedule interleaved.
"""
from __future__ import annotations

import os
import sys

from megatron_2bw.arguments import ConfigError, build_parser
from megatron_2bw.checkpoint.huggingface import import_from_hf, import_tokenizer
from megatron_2bw.checkpoint.reshard import write_full_state
from megatron_2bw.checkpoint.tool_config import config_with_base
from megatron_2bw.data.cli import exit_on_user_error


def add_arguments(parser) -> None:
    group = parser.add_argument_group("import")
    group.add_argument("--hf-path", type=str, default=None,
                       help="local directory written by transformers' save_pretrained")


def main(argv=None) -> str:
    # --help: the first paragraph, which names the transformers classes
    args = build_parser(__doc__.split("\n\n")[0], add_arguments).parse_args(argv)
    if not args.hf_path or not args.save:
        raise ConfigError("--hf-path DIR and --save CHECKPOINT_DIR are both required")
    state = import_from_hf(args.hf_path)
    tokenizer = import_tokenizer(args.hf_path, os.path.join(args.save, "tokenizer"))
    if tokenizer is not None:
        state.config.data = tokenizer
    state.config = config_with_base(args, state.config, f"the model in {args.hf_path}")
    par = state.config.parallel
    chunks = par.model_chunks  # the virtual-stage flags: the interleaved schedule's chunks
    write_full_state(state, args.save, par.tensor_parallel, par.pipeline_parallel, par.layer_split,
                     chunks=chunks)
    print(f" imported {args.hf_path} ({state.config.model.model_type}, "
          f"{sum(t.numel() for t in state.model.values()) / 1e6:.2f} M parameters) to {args.save} "
          f"as t={par.tensor_parallel} x p={par.pipeline_parallel}"
          + ("" if chunks == 1 else f" x {chunks} model chunks per rank")
          + ("" if tokenizer is None else f"; tokenizer in {tokenizer.tokenizer_model}"), flush=True)
    return args.save


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
