"""specdec_jax: exact speculative decoding for Qwen3.5 hybrids and looped models in JAX.

Public API:
    load(path, dtype="bfloat16", mesh=None) -> Model   (mesh: a jax.sharding.Mesh with an axis "tp")
    forward_logits(model, input_ids, **options) -> [B, T, vocab] float32
    generate(model, input_ids, max_new_tokens, method="ar", temperature=0.0, seed=0, **options)
        -> GenerateResult(tokens [B, max_new_tokens], stats)
"""

from .api import forward_logits, generate, load, supported_methods
from .errors import CheckpointError, InputError, SpecdecError
from .model import GenerateResult, Model

__all__ = ["load", "forward_logits", "generate", "supported_methods", "Model", "GenerateResult",
           "SpecdecError", "CheckpointError", "InputError"]
