"""Training of the tiny shipped checkpoints (Qwen3.5 hybrid + MTP head, Huginn looped model).

One jitted train step (parameters and optimizer state donated), fp32 master weights cast to the
compute dtype (bf16) inside the loss, optax AdamW (decoupled weight decay on matrices only) after
global-norm clipping, linear warmup then cosine decay, data windows sampled on the host with a
seeded numpy generator. `scripts/train_tiny.py` is the command line around `run_training`.

Qwen3.5: loss = CE(next token) + mtp_weight * CE(token after next, from the MTP head fed with the
target's final-normed hidden state and the true next token); the MTP loss also trains the trunk.

Huginn (the recipe of Geiping et al. 2025): each step draws a recurrence count
p = Poisson(LogNormal(log(mean) - sigma^2/2, sigma = 0.5)) + 1, runs max(p - s, 0) recurrences
without gradient and the last min(p, s) with it (s = backprop depth; truncated backprop), from a
zero initial state.

The MTP head alone, the model fixed (`mtp_chain_loss`, `scripts/train_mtp_head.py`): the head chained
`depth` times from every position as a draft chain runs it, each depth trained toward the model's own
distribution for its token.

Modules: `recipe` (TrainOptions, model configs, parameter inits, losses, the recurrence draw),
`data` (training and held-out windows, held-out evaluation), `loop` (optimizer, schedule, train
step, `run_training`), `checkpoint` (checkpoint folder writing). Their public names are
re-exported here.
"""

from .checkpoint import MAX_CHECKPOINT_BYTES, folder_bytes, save_checkpoint, write_readme  # noqa: F401
from .data import eval_windows, evaluate_huginn, evaluate_mtp_chain, evaluate_qwen35, sample_windows  # noqa: F401
from .loop import learning_rate, make_optimizer, make_train_step, run_training  # noqa: F401
from .recipe import (ARCHS, DEFAULT_OUT, TrainOptions, cast, ce_rows, count_params, huginn_config,  # noqa: F401
                     huginn_config_dict, huginn_loss, init_huginn_params, init_qwen35_params, mtp_chain_loss,
                     mtp_chain_outputs, params_from_checkpoint, qwen35_config,
                     qwen35_config_json, qwen35_loss, qwen35_outputs, sample_recurrence)
