"""Data pipeline: tokenizers, Megatron indexed datasets, GPT/BERT samples, blending, sampling.

Nothing here touches torch.distributed: ranks and world sizes are plain integers handed in.
Names are imported on first use, so the preprocessing tools (which never need torch) start fast.
"""
import importlib

_EXPORTS = {
    "BERTDataset": "bert_dataset", "BertSampleSettings": "bert_dataset",
    "BertSpecialTokens": "bert_dataset", "BlendedDataset": "blended",
    "build_pretraining_datasets": "builder", "GPTDataset": "gpt_dataset",
    "IndexedDataset": "indexed", "IndexedDatasetBuilder": "indexed",
    "MockBERTDataset": "mock", "MockGPTDataset": "mock",
    "PretrainingSampler": "samplers", "build_data_iterator": "samplers",
    "Tokenizer": "tokenizers", "build_tokenizer": "tokenizers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
