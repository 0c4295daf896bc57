"""The family interface (models/family.py): both families keep a verified prefix the same way (commit k of T
verified tokens = run only those k), and the looped family's stages compose to its forward. Tiny random
models (two layers, float32), one compiled program per family."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import training
from specdec_jax.models.qwen35.config import FULL_ATTENTION, LINEAR_ATTENTION
from specdec_jax.errors import InputError
from specdec_jax.results import Model
from specdec_jax.models.looped import model as looped
from specdec_jax.models.family import QWEN35, Family, LoopedFamily, family_for, looped_family

DEPTH = 3  # the looped family's recurrence depth


def qwen_config():
    """One GDN layer and one attention layer."""
    o = training.TrainOptions(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, linear_key_heads=1,
                              linear_value_heads=2, linear_head_dim=8, intermediate=64)
    return dataclasses.replace(training.qwen35_config(97, o), layer_types=(LINEAR_ATTENTION, FULL_ATTENTION))


def looped_config():
    """One prelude, one core and one coda layer (Huginn's sandwich blocks)."""
    return looped.LoopedConfig(vocab_size=97, n_embd=32, n_heads=2, num_key_value_heads=2, head_dim=16,
                               n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1,
                               intermediate_size=64, mean_recurrence=DEPTH)


def tiny_model(family: str) -> Model:
    key = jax.random.PRNGKey(0)
    if family == "qwen3_5":
        cfg = qwen_config()
        return Model(config=cfg, params=training.init_qwen35_params(cfg, key, std=0.2), dtype=jnp.float32)
    cfg = looped_config()
    return Model(config=cfg, params=looped.init_random_params(cfg, key, jnp.float32, std=0.2), dtype=jnp.float32)


@pytest.fixture(scope="module", params=["qwen3_5", "looped"])
def model(request) -> Model:
    return tiny_model(request.param)


def test_family_for_picks_each_family():
    assert family_for(qwen_config()) is QWEN35 and QWEN35.describe() == {}
    cfg = looped_config()
    fam = family_for(cfg)
    assert fam is looped_family(DEPTH)  # one object per setting: one compile per setting
    assert isinstance(fam, LoopedFamily) and fam.describe() == {"num_steps": DEPTH, "cache_mode": "full"}
    with pytest.raises(InputError, match="cache_mode"):
        family_for(cfg, cache_mode="zip")


@functools.partial(jax.jit, static_argnames=("family", "cfg", "k"))
def next_logits_three_ways(params, prompt, tokens, after, *, family, cfg, k: int):
    """Logits of `after` following prompt + the first k of `tokens`, reached three ways: running only those k
    tokens; verifying all of `tokens` and committing k; the exact path's decode shape with n_valid = k.
    Also the two kept states' lengths."""
    start = family.init_state(cfg, 1, 16, jnp.float32)
    _, start = family.forward(params, cfg, start, prompt)
    _, direct = family.forward(params, cfg, start, tokens[:, :k])
    _, verified, extras = family.verify(params, cfg, start, tokens)
    committed = family.commit(start, verified, extras, jnp.full((1,), k, jnp.int32))
    _, decoded = family.decode_forward(params, cfg, start, tokens, jnp.full((1,), k, jnp.int32))
    logits = [family.forward(params, cfg, s, after)[0] for s in (direct, committed, decoded)]
    return logits, (committed.length, decoded.length)


def test_commit_of_a_verified_prefix_equals_running_only_that_prefix(model):
    family = family_for(model.config)
    assert isinstance(family, Family) and family.state_dtype(model) == jnp.float32
    rng = np.random.default_rng(0)
    prompt, tokens, after = (jnp.asarray(rng.integers(0, model.vocab_size, (1, n)), jnp.int32) for n in (3, 5, 1))
    (want, committed, decoded), lengths = next_logits_three_ways(model.params, prompt, tokens, after, family=family,
                                                                 cfg=model.config, k=2)
    assert [int(n[0]) for n in lengths] == [3 + 2, 3 + 2]
    np.testing.assert_allclose(np.asarray(committed), np.asarray(want), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_looped_stages_compose_to_the_forward():
    """prelude, DEPTH core steps and the coda (no cache) give the logits of a full-sequence forward."""
    model = tiny_model("looped")
    family, params, cfg = looped_family(DEPTH), model.params, model.config
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)

    @jax.jit
    def by_stages(params, ids):
        cos, sin = looped.rope_tables(cfg, jnp.arange(ids.shape[1], dtype=jnp.int32)[None])
        e, _, _ = family.prelude(params, cfg, None, ids, cos, sin)
        x = looped.initial_state(cfg, e)
        for step in range(DEPTH):
            x, _, _ = family.core(params, cfg, None, x, e, step, cos, sin)
        return family.coda(params, cfg, None, x, cos, sin, "all")[0]

    want = jax.jit(lambda p, i: family.forward(p, cfg, None, i)[0])(params, ids)
    np.testing.assert_allclose(np.asarray(by_stages(params, ids)), np.asarray(want), rtol=1e-5, atol=1e-6)
