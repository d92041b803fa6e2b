"""Export a checkpoint as a Hugging Face transformers model directory: GPT as GPT2LMHeadModel, or with
Llama's switches (RMSNorm, SwiGLU, rotary positions) as LlamaForCausalLM (Qwen2ForCausalLM with
--add-qkv-bias, Qwen3ForCausalLM with --qk-layernorm and --disable-bias-linear), BERT as
MegatronBertForPreTraining (config.json, model.safetensors and the run's tokenizer files). A model
none of them computes is refused, naming the fields.

    python tools/export_to_hf.py --load checkpoints/gpt --output hf/gpt
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('hf/gpt')"

Any tensor/pipeline layout exports; the vocabulary padding is removed, and under
--apply-layernorm-1p the norms' weights are written as the gains transformers expects (weight + 1).
--iteration N picks an iteration other than the latest; the pretraining flags (e.g. --vocab-file)
override what the checkpoint recorded.
"""
from __future__ import annotations

import sys

from megatron_2bw.arguments import ConfigError, build_parser
from megatron_2bw.checkpoint.huggingface import export_to_hf
from megatron_2bw.checkpoint.reshard import read_full_state
from megatron_2bw.checkpoint.tool_config import config_with_base
from megatron_2bw.data.cli import exit_on_user_error


def add_arguments(parser) -> None:
    group = parser.add_argument_group("export")
    group.add_argument("--output", type=str, default=None, help="directory to write")
    group.add_argument("--iteration", type=int, default=None,
                       help="iteration to export (default: the latest)")


def main(argv=None) -> str:
    # --help: the first paragraph, which names the transformers classes
    args = build_parser(__doc__.split("\n\n")[0], add_arguments).parse_args(argv)
    if not args.load or not args.output:
        raise ConfigError("--load CHECKPOINT_DIR and --output DIR are both required")
    state = read_full_state(args.load, args.iteration, with_optimizer=False)
    config = config_with_base(args, state.config, f"checkpoint {args.load}", checkpoint=args.load)
    for note in export_to_hf(state, args.output, config.data):
        print(f" {note}", flush=True)
    print(f" exported {args.load} (iteration {state.iteration}) to {args.output}", flush=True)
    return args.output


if __name__ == "__main__":
    with exit_on_user_error(sys.argv[0]):
        main()
