"""Self-drafts: the target's own weights, run cheaper, draft for it (no second model, no extra training).

- `layer-skip`: the target with some layers left out (`skip_layers`).
- `residual-reuse`: as layer-skip, but each skipped layer's contribution to the residual stream is taken
  from the last position where it was computed: the drafter runs the whole model over the emitted tokens
  (its catch-up forward, below) and records those layers' residual deltas there.
- `partial-mlp`: every layer, with only the first `mlp_keep` fraction of each MLP's channels (dense
  SwiGLU, each expert and the shared expert of MoE models), as static slices made once per generation.

Option `shortlist_size` (any of the three; needs the checkpoint's token shortlist, draft_tables.safetensors):
drafts are chosen among the first N tokens of the shortlist, through an [N, D] head gathered once per
generation. At the Qwen3.5-9B shape the output head is 2 GB of the 12.4 GB a layer-skip draft reads
(vocabulary 248320), so a 32768-token shortlist cuts a draft's weight traffic by about 14%; the verifier
still decides, so the output is unchanged (a sampled draft's q is zero off the shortlist).

Each drafter keeps its own Qwen35State (conv, GDN and K/V state of the layers it runs) covering the prompt
and every emitted token up to and including the anchor, plus its logits for the token after the anchor.
A step:
- propose: draft 1 comes from the stored logits; drafts 2..gamma chain single-token forwards from a copy
  of the recurrent state (provisional K/V entries past the committed length are masked and overwritten
  later, as the target's are);
- update (after verification, in the same jitted step): one catch-up forward of the emitted tokens
  (accepted drafts + the target's token, padded to gamma + 1 rows) from the committed state with a traced
  count of valid rows: the state advances by exactly the emitted tokens (the rollback), and the last valid
  row's logits give the next step's first draft. layer-skip and partial-mlp catch up with the draft model
  (a step costs gamma draft forwards); residual-reuse with the whole model (its state is the target's, its
  first draft the target's own prediction, its deltas exact), then gamma - 1 skipping forwards.

The verifier computes nothing for a drafter: an extra output of the verification forward can change XLA's
fusion and so its bf16 rounding, and verification must be AR's arithmetic (the exact path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ..decoding.sampling import SamplingConfig, probabilities, select_token, shortlist_choice
from ..errors import InputError
from ..models.qwen35 import model as qwen35

SELF_DRAFT_METHODS = ("layer-skip", "residual-reuse", "partial-mlp")
# Three quarters of every MLP: at gamma 2 the projected speed at the 9B shape is 0.97x of AR at mlp_keep 0.75
# (acceptance 1.75 of 2 on the shipped checkpoint, step 13.9 ms) against 0.77x at 0.5 (1.03 of 2, 12.9 ms):
# benchmarks/results/selfdraft_projection_qwen35_9b.md (the shipped checkpoint's acceptance x the H200 step costs).
DEFAULT_MLP_KEEP = 0.75


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """The middle quarter of the stack (at least one layer, never the first or the last)."""
    n = max(1, num_layers // 4)
    start = max(1, (num_layers - n) // 2)
    return tuple(range(start, min(start + n, num_layers - 1))) or (num_layers // 2,)


def parse_skip_layers(value, num_layers: int) -> tuple[int, ...]:
    """skip_layers as a sorted tuple of distinct layer indices in [0, num_layers), not all of them."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"skip_layers must be a list of layer indices; got {value!r}")
    layers = list(value)
    if not layers:
        raise InputError("skip_layers is empty: name at least one layer to skip")
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) and not hasattr(i, "__index__"):
            raise InputError(f"skip_layers must hold integer layer indices; got {i!r} in {value!r}")
        if not 0 <= int(i) < num_layers:
            raise InputError(f"skip_layers: layer {int(i)} is out of range; the model has layers "
                             f"0..{num_layers - 1}")
    if len(set(map(int, layers))) != len(layers):
        raise InputError(f"skip_layers repeats a layer: {list(map(int, layers))}")
    if len(layers) == num_layers:
        raise InputError(f"skip_layers skips every one of the model's {num_layers} layers: a draft must run "
                         f"at least one")
    return tuple(sorted(int(i) for i in layers))


def parse_mlp_keep(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise InputError(f"mlp_keep must be a fraction in (0, 1] (the share of MLP channels the draft keeps); "
                         f"got {value!r}")
    return float(value)


def _kept(size: int, keep: float) -> int:
    return max(1, min(size, round(size * keep)))


def cut_config(cfg, keep: float):
    """The config of a partial-MLP draft: each MLP's (each expert's, the shared expert's) first channels."""
    if cfg.is_moe:
        return dataclasses.replace(cfg, moe_intermediate_size=_kept(cfg.moe_intermediate_size, keep),
                                   shared_expert_intermediate_size=_kept(cfg.shared_expert_intermediate_size, keep)
                                   if cfg.shared_expert_intermediate_size else 0)
    return dataclasses.replace(cfg, intermediate_size=_kept(cfg.intermediate_size, keep))


def _first_channels(gate_up, down, size: int, keep: int, axis: int):
    """Fused [gate; up] rows (along `axis`) and down-projection input columns cut to the first `keep`."""
    gate = lax.slice_in_dim(gate_up, 0, keep, axis=axis)
    up = lax.slice_in_dim(gate_up, size, size + keep, axis=axis)
    return jnp.concatenate([gate, up], axis=axis), down[..., :keep]


def partial_mlp_weights(params: dict, cfg, keep: float) -> list[dict]:
    """Per-layer MLP parameters of a partial-MLP draft (static slices; sizes from `cut_config`)."""
    cut = cut_config(cfg, keep)
    out = []
    for layer in params["layers"]:
        p = dict(layer["mlp"])
        if cfg.is_moe:
            p["experts_gate_up"], p["experts_down"] = _first_channels(
                p["experts_gate_up"], p["experts_down"], cfg.moe_intermediate_size, cut.moe_intermediate_size, 1)
            form = qwen35.moe_input_form(p)
            p = qwen35.unfuse_moe_inputs(p, cfg)
            if "shared_gate_up_proj" in p:
                p["shared_gate_up_proj"], p["shared_down_proj"] = _first_channels(
                    p["shared_gate_up_proj"], p["shared_down_proj"], cfg.shared_expert_intermediate_size,
                    cut.shared_expert_intermediate_size, 0)
            p = qwen35.to_moe_input_form(p, cfg, form)
        else:
            p["gate_up_proj"], p["down_proj"] = _first_channels(p["gate_up_proj"], p["down_proj"],
                                                                cfg.intermediate_size, cut.intermediate_size, 0)
        out.append(p)
    return out


@dataclasses.dataclass(frozen=True)
class SelfDrafter:
    """method: one of SELF_DRAFT_METHODS; skip_layers (layer-skip, residual-reuse); mlp_keep (partial-mlp)."""

    method: str
    skip_layers: tuple[int, ...] = ()
    mlp_keep: float = 1.0
    shortlist_size: int = 0  # 0: the full vocabulary
    # Drafts 2..gamma as straight-line code, not a loop nested in the step (MtpDrafter.unroll). H200: tiny layer-skip at
    # gamma 3 0.86x -> 0.91x of AR; 9B shape gamma 4 the same step (20.03 / 20.05 ms), compile 37 -> 58 s
    # (docs/LOG.md, 2026-12-02).
    unroll: bool = True
    deterministic = False

    @property
    def name(self) -> str:
        return self.method

    @property
    def carry_kind(self) -> str:
        """What a continuation may start from (`init`'s carry): the draft model's state, which its layers and MLP
        cut define (not the shortlist, which only projects its logits)."""
        return f"{self.method}:{self.skip_layers}:{self.mlp_keep}"

    @staticmethod
    def carried(state) -> dict:
        """The part of the state a continuation starts from (`init`'s carry)."""
        return {"model": state["model"]}

    # --------------------------------------------------------------------------------- helpers
    def _draft(self, params, cfg, dstate: dict):
        """(params, config) of the draft model."""
        if self.method != "partial-mlp":
            return params, cfg
        layers = [dict(layer, mlp=mlp) for layer, mlp in zip(params["layers"], dstate["mlp"])]
        return dict(params, layers=layers), cut_config(cfg, self.mlp_keep)

    def _forward(self, params, cfg, dstate: dict, model, ids, deltas=None, n_valid=None, logits_for="all",
                 prefill_lens=None):
        """Draft forward of ids [B, T] from `model`; deltas [B, T, n, D] stand in for residual-reuse's skipped
        layers. Returns (logits, model)."""
        p, c = self._draft(params, cfg, dstate)
        skip = () if self.method == "partial-mlp" else self.skip_layers
        logits, model, _ = qwen35.forward(p, c, model, ids, skip=skip, n_valid=n_valid, logits_for=logits_for,
                                          skip_deltas=deltas, head=dstate.get("head"), prefill_lens=prefill_lens)
        return logits, model

    def _catch_up(self, params, cfg, dstate: dict, model, ids, n_valid=None, logits_for="all", prefill_lens=None):
        """The forward that advances the committed state: (logits, model, the skipped layers' deltas or None).
        residual-reuse runs the whole model (recording the deltas); the others their draft model.
        prefill_lens: a padded prompt (`qwen35.forward`)."""
        if self.method != "residual-reuse":
            return (*self._forward(params, cfg, dstate, model, ids, n_valid=n_valid, logits_for=logits_for,
                                   prefill_lens=prefill_lens), None)
        logits, model, extras = qwen35.forward(params, cfg, model, ids, n_valid=n_valid, logits_for=logits_for,
                                               record=self.skip_layers, head=dstate.get("head"),
                                               prefill_lens=prefill_lens)
        return logits, model, extras["deltas"]  # [B, T, n, D]

    @staticmethod
    def _choose(params, state, logits, key, sampling: SamplingConfig):
        """(token ids [B], q over the full vocabulary or None when greedy) from draft logits [B, N]."""
        if "shortlist" in state:
            vocab = qwen35.lm_head_weight(params).shape[0]
            return shortlist_choice(logits, state["shortlist"], vocab, key, sampling)
        ids = select_token(logits, key, sampling).astype(jnp.int32)
        return ids, (None if sampling.greedy else probabilities(logits, sampling))

    # ------------------------------------------------------------------------------- interface
    def init(self, params, cfg, prompt, max_len, *, first_token, lens=None, carry=None, **_):
        """lens [B]: each row's prompt length in a padded prompt buffer (None: every row holds T tokens).
        carry: None, or the draft model's state after an earlier generation of these rows (a continuation), which
        holds each row's history through its pending token; prompt row b holds the tokens the target prefilled
        (that pending token first), and the draft model runs the rest and the first new token from there."""
        B, T = prompt.shape
        if carry is not None:
            return self._continue(params, cfg, prompt, max_len, first_token, lens, carry["model"])
        dstate = self._start(params, cfg)
        model = qwen35.init_state(cfg, B, max_len, params["embed"].dtype)
        ids = jnp.concatenate([prompt, first_token[:, None]], axis=1)  # [B, T + 1]: the anchor included
        if lens is None:
            logits, model, deltas = self._catch_up(params, cfg, dstate, model, ids, logits_for="last")
            last = deltas[:, -1] if deltas is not None else jnp.zeros((B, 0), params["embed"].dtype)
        else:
            ids = ids.at[jnp.arange(B), lens].set(first_token)  # the anchor after each row's prompt
            logits, model, deltas = self._catch_up(params, cfg, dstate, model, ids, logits_for="last",
                                                   prefill_lens=lens + 1)
            last = (jnp.take_along_axis(deltas, lens[:, None, None, None], axis=1)[:, 0] if deltas is not None
                    else jnp.zeros((B, 0), params["embed"].dtype))
        return dict(dstate, model=model, logits=logits[:, -1], delta=last)

    def _start(self, params, cfg) -> dict:
        """The state's parts a generation derives from the parameters (the partial MLP, the shortlist's head)."""
        dstate = {"mlp": partial_mlp_weights(params, cfg, self.mlp_keep) if self.method == "partial-mlp" else ()}
        if self.shortlist_size:
            ids = params["draft"]["shortlist"][: self.shortlist_size].astype(jnp.int32)  # [N]
            dstate.update(shortlist=ids, head=qwen35.lm_head_weight(params)[ids])  # [N, D], gathered once
        return dstate

    def _continue(self, params, cfg, prompt, max_len, first_token, lens, model):
        B, T = prompt.shape
        lens = jnp.full((B,), T, jnp.int32) if lens is None else lens
        dstate = self._start(params, cfg)
        model = qwen35.grow_state(model, max_len)
        ids = jnp.concatenate([prompt[:, 1:], first_token[:, None]], axis=1)  # [B, T]: the pending token is held
        ids = ids.at[jnp.arange(B), lens - 1].set(first_token)
        logits, model, deltas = self._catch_up(params, cfg, dstate, model, ids, logits_for="last", prefill_lens=lens)
        last = (jnp.take_along_axis(deltas, (lens - 1)[:, None, None, None], axis=1)[:, 0] if deltas is not None
                else jnp.zeros((B, 0), params["embed"].dtype))
        return dict(dstate, model=model, logits=logits[:, -1], delta=last)

    def propose(self, params, cfg, state, history, hist_len, gamma: int, key, *, sampling=SamplingConfig(), **_):
        keys = jax.random.split(key, gamma)
        d1, q1 = self._choose(params, state, state["logits"], keys[0], sampling)
        step_deltas = state["delta"][:, None] if self.method == "residual-reuse" else None  # [B, 1, n, D]

        def chain(carry, step_key):
            token, model = carry
            logits, model = self._forward(params, cfg, state, model, token[:, None], step_deltas)
            nxt, q = self._choose(params, state, logits[:, 0], step_key, sampling)
            return (nxt, model), (nxt, q)

        (_, scratch), (rest, q_rest) = lax.scan(chain, (d1, state["model"]), keys[1:], unroll=self.unroll)
        drafts = jnp.concatenate([d1[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)  # [B, gamma]
        q = None if sampling.greedy else jnp.concatenate([q1[:, None], jnp.moveaxis(q_rest, 0, 1)], axis=1)
        # Keep the provisional K/V writes (masked past the committed length) so the caches update in place;
        # the recurrent and conv states and the length stay the committed ones.
        model = state["model"].replace(keys=scratch.keys, values=scratch.values)
        return drafts, q, dict(state, model=model)

    def update(self, state, *, emitted, n_emitted, params, cfg, **_):
        logits, model, deltas = self._catch_up(params, cfg, state, state["model"], emitted, n_valid=n_emitted)
        last = jnp.maximum(n_emitted - 1, 0)  # the new anchor's row
        moved = n_emitted > 0
        pick = lambda x: jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
        out = dict(state, model=model, logits=jnp.where(moved[:, None], pick(logits), state["logits"]))
        if deltas is not None:
            out["delta"] = jnp.where(moved[:, None, None], pick(deltas), state["delta"])
        return out

