"""specdec_jax: exact speculative decoding for Qwen3.5 hybrids and looped models in JAX.

Public API:
    load(path, dtype="bfloat16", mesh=None) -> Model   (path: a checkpoint folder, or "tiny-qwen" / "tiny-huginn"
        for the shipped ones; mesh: a jax.sharding.Mesh with an axis "tp")
    forward_logits(model, input_ids, **options) -> [B, T, vocab] float32
    generate(model, input_ids, max_new_tokens, method="ar", temperature=0.0, seed=0, **options)
        -> GenerateResult(tokens [B, max_new_tokens], stats)
    generate_text(model, prompt_or_prompts, max_new_tokens, **options) -> TextResult(text, tokens, stats)
    stream(model, input_ids, max_new_tokens, chunk_steps=16, **options) -> iterator of new tokens [B, k]
"""

from .api import forward_logits, generate, generate_text, load, stream, supported_methods
from .errors import CheckpointError, InputError, SpecdecError
from .results import GenerateResult, Model, TextResult

__all__ = ["load", "forward_logits", "generate", "generate_text", "stream", "supported_methods", "Model", "GenerateResult",
           "TextResult", "SpecdecError", "CheckpointError", "InputError"]
