"""Text generation from a trained GPT: sampling, the one-process model of any checkpoint, and
Megatron-LM's REST server."""
