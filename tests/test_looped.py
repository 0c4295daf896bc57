"""Looped models (Huginn-0125, Raven-Llama, Raven-OLMo-2) against the official PyTorch outputs.

Fixtures (tests/fixtures/looped/*) hold tiny random checkpoints in the official formats and the
outputs of the official code (fp32, zero initial state). Everything here runs on CPU in fp32.
"""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.errors import CheckpointError, InputError
from specdec_jax.decoding import looped_ar
from specdec_jax.models.looped import model as looped

FIXTURES = Path(__file__).parent / "fixtures" / "looped"
NAMES = ("huginn_tiny", "raven_llama_tiny")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def copy_cache(cache):
    """forward_jit donates its cache; tests that reuse one pass a copy."""
    return jax.tree.map(jnp.copy, cache)


@pytest.fixture(scope="module")
def models():
    return {name: looped.load_looped(FIXTURES / name, "float32") for name in NAMES}


@pytest.fixture(scope="module")
def refs():
    return {name: dict(np.load(FIXTURES / name / "reference.npz")) for name in NAMES}


def write_checkpoint(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def edited_fixture(tmp_path: Path, name: str, edit) -> Path:
    """A copy of a fixture whose tensors dict went through `edit` (in place)."""
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    edit(tensors)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    return write_checkpoint(tmp_path / name, config, tensors)


# ------------------------------------------------------------------------- official numerics

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_forward_logits_match_official(models, refs, name, r):
    logits, extras = looped.forward_logits(models[name], refs[name]["input_ids"], r, return_extras=True)
    assert logits.shape == refs[name][f"logits_r{r}"].shape and logits.dtype == jnp.float32
    assert rel(logits, refs[name][f"logits_r{r}"]) < 1e-4
    assert rel(extras["latents"], refs[name][f"latents_r{r}"]) < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_cached_greedy_generation_matches_official(models, refs, name):
    prompt, expected = refs[name]["greedy_prompt"], refs[name]["greedy_r8"]
    n_new = expected.shape[1] - prompt.shape[1]  # Huginn 10, Raven 12
    result = looped_ar.generate(models[name], prompt, n_new, 8)
    np.testing.assert_array_equal(result.tokens, expected[:, prompt.shape[1]:])
    stats = result.stats
    for key in ("new_tokens", "seconds", "tokens_per_second", "prefill_seconds", "decode_seconds",
                "compile_seconds"):
        assert key in stats
    assert stats["new_tokens"] == n_new and stats["num_steps"] == 8
    if name == "huginn_tiny":  # the official self-speculative generate agrees with greedy
        np.testing.assert_array_equal(refs[name]["spec_d2_la4_r8"], expected)


# ------------------------------------------------------------------------------- KV cache

@pytest.mark.parametrize("name,r", [("huginn_tiny", 1), ("huginn_tiny", 8), ("raven_llama_tiny", 4)])
def test_cached_chunks_equal_full_recomputation(models, refs, name, r):
    model, ids = models[name], refs[name]["input_ids"]
    full = np.asarray(looped.forward_logits(model, ids, r))  # [2, 20, V]
    cache = looped.init_cache(model.config, 2, 24, r, "full", jnp.float32)
    pieces = []
    for lo, hi in ((0, 12), (12, 13), (13, 20)):  # prefill, then T = 1 and 7
        logits, cache, _ = looped.forward_jit(model.params, model.config, cache, jnp.asarray(ids[:, lo:hi]), r)
        pieces.append(np.asarray(logits))
    assert rel(np.concatenate(pieces, axis=1), full) < 1e-5
    np.testing.assert_array_equal(cache.length, [20, 20])


def test_padded_prefill_chunks_write_only_their_valid_rows(models, refs):
    """The looped family's padded prefill (`forward(prefill_lens=...)`, what the buckets run): a 12-token prompt in
    8-token chunks, row 1 ending 3 rows into its second chunk, whose 8 rows from slot 8 run past the 14-slot cache.
    Each row's last-valid logits and its cache up to its length agree with an unpadded forward of its own tokens
    (fp32), length advances by the valid rows only, and no slot at or past a row's length is written (a
    dynamic_update_slice running past the end would have been moved back over valid slots)."""
    from specdec_jax.models.family import looped_family
    model, ids = models["huginn_tiny"], refs["huginn_tiny"]["input_ids"][:, :12]
    cfg, family = model.config, looped_family(4)
    lens = np.asarray([12, 11], np.int32)
    prefill = jax.jit(family.prefill_forward, static_argnums=1)
    cache = family.init_state(cfg, 2, 14, jnp.float32)
    for start in (0, 8):
        piece = np.zeros((2, 8), np.int32)
        piece[:, : min(8, 12 - start)] = ids[:, start:start + 8]
        valid = np.clip(lens - start, 0, 8).astype(np.int32)
        logits, cache = prefill(model.params, cfg, cache, jnp.asarray(piece), jnp.asarray(valid))
    np.testing.assert_array_equal(cache.length, lens)
    for b, n in enumerate(lens):
        alone = family.init_state(cfg, 1, 14, jnp.float32)
        want, alone = jax.jit(family.forward, static_argnums=1)(model.params, cfg, alone, jnp.asarray(ids[b:b + 1, :n]))
        assert rel(logits[b, 0], want[0, -1]) < 1e-5
        for name in ("prelude_k", "core_v", "coda_k"):
            got, ref = np.asarray(getattr(cache, name)), np.asarray(getattr(alone, name))
            assert rel(got[..., b, :n, :, :], ref[..., 0, :n, :, :]) < 1e-5, name
            assert not np.any(got[..., b, n:, :, :]), name  # nothing past the row's length


def test_per_sequence_lengths_mask_stale_slots(models, refs):
    """Row 1 rewinds to 9 tokens (entries 9..11 stay in the cache as stale data) and continues."""
    model, ids = models["huginn_tiny"], refs["huginn_tiny"]["input_ids"]
    cache = looped.init_cache(model.config, 2, 20, 4, "full", jnp.float32)
    _, cache, _ = looped.forward_jit(model.params, model.config, cache, jnp.asarray(ids[:, :12]), 4)
    cache = cache.replace(length=jnp.asarray([12, 9], jnp.int32))
    step = np.stack([ids[0, 12:15], ids[1, 9:12]])
    logits, cache, _ = looped.forward_jit(model.params, model.config, cache, jnp.asarray(step), 4)
    full = np.asarray(looped.forward_logits(model, ids, 4))
    assert rel(logits[0], full[0, 12:15]) < 1e-5
    assert rel(logits[1], full[1, 9:12]) < 1e-5
    np.testing.assert_array_equal(cache.length, [15, 12])


def test_exit_depths_equal_separate_forwards(models, refs):
    model, ids = models["huginn_tiny"], refs["huginn_tiny"]["input_ids"]
    logits, extras = looped.forward_logits(model, ids, 8, exit_depths=(1, 4), return_extras=True)
    assert rel(logits, refs["huginn_tiny"]["logits_r8"]) < 1e-4
    for d in (1, 4):
        assert rel(extras["exit_logits"][d], looped.forward_logits(model, ids, d)) < 1e-5


def test_unrolled_recurrence_computes_the_rolled_one(models, refs, monkeypatch):
    """looped.RECURRENCE_UNROLL changes how the depth loop is compiled, not what it computes: forward (with an
    early exit, two scans) and the exact path's decode_forward, traced anew under each setting."""
    model, ids = models["huginn_tiny"], jnp.asarray(refs["huginn_tiny"]["input_ids"])
    cfg, r = model.config, 5

    def traced_under(unroll):  # a new function each time (jit caches traces by function): the setting is read
        monkeypatch.setattr(looped, "RECURRENCE_UNROLL", unroll)  # read while tracing

        def run(params, ids):
            logits, _, extras = looped.forward(params, cfg, None, ids, num_steps=r, exit_depths=(2,))
            cache = looped.init_cache(cfg, 2, 24, r, "full", jnp.float32)
            _, cache, _ = looped.forward(params, cfg, cache, ids[:, :12], num_steps=r)
            decoded, _ = looped.decode_forward(params, cfg, cache, ids[:, 12:16], jnp.asarray([4, 2], jnp.int32),
                                               num_steps=r)
            return logits, extras["exit_logits"][2], decoded

        lowered = jax.jit(run).lower(model.params, ids)
        loops = lowered.as_text().count("stablehlo.while")
        return loops, [np.asarray(x) for x in lowered.compile()(model.params, ids)]

    loops, rolled = traced_under("1")
    assert loops == 4  # forward's two scans (to the exit, then on), the prefill's one, decode_forward's one
    for unroll in ("2", "full"):  # 2 does not divide the scans' lengths (2 and 3 after the exit, 5)
        loops, outputs = traced_under(unroll)
        assert (loops == 0) == (unroll == "full")
        for got, want in zip(outputs, rolled):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="RECURRENCE_UNROLL"):
        traced_under("0")


@pytest.fixture(scope="module")
def prefix_cache(models, refs):
    """Huginn cache after a 10-token prefix at depth R = 4, and the next 3 tokens."""
    model, ids = models["huginn_tiny"], refs["huginn_tiny"]["input_ids"]
    cache = looped.init_cache(model.config, 2, 16, 4, "full", jnp.float32)
    _, cache, _ = looped.forward_jit(model.params, model.config, cache, jnp.asarray(ids[:, :10]), 4)
    return cache, jnp.asarray(ids[:, 10:13])


def _run(model, cache, new_ids, **kw):
    logits, cache, _ = looped.forward_jit(model.params, model.config, copy_cache(cache), new_ids, 4, **kw)
    return np.asarray(logits), cache


def _slots_from(cache_array, schedule):
    """Hand-built core cache whose step slot s holds the original slot schedule[s]."""
    return jnp.stack([cache_array[int(s)] for s in schedule])


def test_read_step_deep_kv_equals_hand_built_cache(models, prefix_cache):
    model, (cache, new_ids) = models["huginn_tiny"], prefix_cache
    R = 4
    deep, _ = _run(model, cache, new_ids, read_step_k=R - 1, read_step_v=R - 1)
    hand = cache.replace(core_k=_slots_from(cache.core_k, [R - 1] * R), core_v=_slots_from(cache.core_v, [R - 1] * R))
    expected, _ = _run(model, hand, new_ids)
    assert rel(deep, expected) < 1e-6
    aligned, _ = _run(model, cache, new_ids)
    assert rel(aligned, deep) > 1e-3  # the read depth matters for this model

    # Mature-V: K aligned, V from full depth.
    mature_v, _ = _run(model, cache, new_ids, read_step_v=R - 1)
    hand_v = cache.replace(core_v=_slots_from(cache.core_v, [R - 1] * R))
    assert rel(mature_v, _run(model, hand_v, new_ids)[0]) < 1e-6

    # An arbitrary per-step schedule, given as a device array (traced inside jit).
    schedule = [3, 3, 1, 0]
    sched, _ = _run(model, cache, new_ids, read_step_k=jnp.asarray(schedule), read_step_v=jnp.asarray(schedule))
    hand_s = cache.replace(core_k=_slots_from(cache.core_k, schedule), core_v=_slots_from(cache.core_v, schedule))
    assert rel(sched, _run(model, hand_s, new_ids)[0]) < 1e-6


def test_new_kv_written_to_own_step_slot(models, prefix_cache):
    """Whatever depth the prefix is read from, step s writes its new K/V into slot s only."""
    model, (cache, new_ids) = models["huginn_tiny"], prefix_cache
    _, new_cache = _run(model, cache, new_ids, read_step_k=3, read_step_v=3)
    np.testing.assert_array_equal(new_cache.core_k[:, :, :, :10], cache.core_k[:, :, :, :10])  # prefix untouched
    slots = np.asarray(new_cache.core_k[:, :, :, 10:13])  # [R, L, B, 3, NKV, hd]
    assert not np.allclose(slots[0], slots[3])
    np.testing.assert_array_equal(new_cache.length, [13, 13])


def test_compressed_cache_reads_latest_depth(models, refs, prefix_cache):
    """Compressed mode = every step reads the prefix at its deepest depth (R - 1): a different model."""
    model, ids = models["huginn_tiny"], refs["huginn_tiny"]["input_ids"]
    cache, new_ids = prefix_cache
    small = looped.init_cache(model.config, 2, 16, 4, "compressed", jnp.float32)
    prefill, small, _ = looped.forward_jit(model.params, model.config, small, jnp.asarray(ids[:, :10]), 4)
    assert rel(prefill, refs["huginn_tiny"]["logits_r4"][:, :10]) < 1e-5  # no prefix yet: exact
    compressed, small, _ = looped.forward_jit(model.params, model.config, small, new_ids, 4)
    deep, _ = _run(model, cache, new_ids, read_step_k=3, read_step_v=3)
    assert rel(compressed, deep) < 1e-6


def test_cache_shapes_and_bytes():
    cfg = looped.LoopedConfig(vocab_size=65536, n_embd=5280, n_heads=55, num_key_value_heads=55, head_dim=96,
                              n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
                              intermediate_size=17920)
    per_slot = 2 * 1 * 4096 * 55 * 96 * 2  # K and V, batch 1, 4096 tokens, bf16
    full = looped.cache_bytes(cfg, 1, 4096, 32, "full", jnp.bfloat16)
    small = looped.cache_bytes(cfg, 1, 4096, 32, "compressed", jnp.bfloat16)
    assert full == (2 + 32 * 4 + 2) * per_slot + 4
    assert small == (2 + 4 + 2) * per_slot + 4
    tiny = looped.LoopedConfig(vocab_size=64, n_embd=32, n_heads=4, num_key_value_heads=2, head_dim=8,
                               n_layers_in_prelude=1, n_layers_in_recurrent_block=3, n_layers_in_coda=2,
                               intermediate_size=64)
    for mode, slots in (("full", 5), ("compressed", 1)):
        cache = looped.init_cache(tiny, 2, 7, 5, mode, jnp.float32)
        assert cache.core_k.shape == (slots, 3, 2, 7, 2, 8) and cache.prelude_v.shape == (1, 2, 7, 2, 8)
        assert cache.coda_k.shape == (2, 2, 7, 2, 8) and cache.step_slots == slots and cache.max_len == 7
        nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
        assert nbytes == looped.cache_bytes(tiny, 2, 7, 5, mode, jnp.float32)
    with pytest.raises(InputError, match="cache mode"):
        looped.init_cache(tiny, 1, 8, 2, "sliding")


# ----------------------------------------------------------------------- initial state, modes

def test_random_initial_state_matches_official_scaling(models):
    cfg = models["huginn_tiny"].config
    e = jnp.ones((4, 64, cfg.n_embd), jnp.float32)
    np.testing.assert_array_equal(looped.initial_state(cfg, e), 0.0)
    x = np.asarray(looped.initial_state(cfg, e, jax.random.PRNGKey(0)))
    bound = 3 * cfg.init_std * cfg.embed_scale  # truncated at 3 std, then times the embedding scale
    assert np.abs(x).max() <= bound * (1 + 1e-6)
    # std of a standard normal truncated at +-3 is 0.98658
    assert abs(x.std() / (cfg.init_std * cfg.embed_scale) - 0.98658) < 0.02
    np.testing.assert_array_equal(x, looped.initial_state(cfg, e, jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(looped.initial_state(cfg, e, jax.random.PRNGKey(0), scale=0.0), 0.0)


def test_random_initial_state_changes_output(models, refs):
    model, ids = models["huginn_tiny"], jnp.asarray(refs["huginn_tiny"]["input_ids"])
    zero = looped.forward_logits(model, ids, 2)
    rand, _, _ = looped.forward_jit(model.params, model.config, None, ids, 2, init_key=jax.random.PRNGKey(1))
    assert rel(rand, zero) > 1e-3 and np.isfinite(np.asarray(rand)).all()


# ------------------------------------------------------------------------------ OLMo-2 retrofit

def olmo2_checkpoint(folder: Path, initial_state_mode: str = "random") -> Path:
    """Tiny Raven-OLMo-2 in the retrofit converter's format (head_dim decoupled from n_embd)."""
    D, H, KV, hd, F, V = 48, 4, 2, 16, 80, 96
    config = {"model_type": "huginn_raven", "n_embd": D, "n_heads": H, "num_key_value_heads": KV, "head_dim": hd,
              "n_layers": 4, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1,
              "vocab_size": V, "padded_vocab_size": V, "intermediate_size": F, "tie_embeddings": False,
              "qk_bias": False, "norm_eps": 1e-5, "rope_base": 10000.0, "rope_theta": 10000.0,
              "mean_recurrence": 4, "block_class_name": "SandwichBlock", "initial_state_mode": initial_state_mode,
              "init_values": {"std": math.sqrt(2 / (5 * D)), "embed_scale": 1.0}, "max_position_embeddings": 64}
    rng = np.random.default_rng(0)
    tensors = {"transformer.wte.weight": rng.normal(0, 1, (V, D)), "lm_head.weight": rng.normal(0, D ** -0.5, (V, D)),
               "transformer.adapter.weight": rng.normal(0, (2 * D) ** -0.5, (D, 2 * D)),
               "transformer.ln_f.weight": 1 + 0.1 * rng.normal(size=D)}
    for stack, n in (("prelude", 1), ("core_block", 2), ("coda", 1)):
        for i in range(n):
            p = f"transformer.{stack}.{i}."
            tensors.update({
                p + "attn.Wqkv.weight": rng.normal(0, D ** -0.5, ((H + 2 * KV) * hd, D)),
                p + "attn.proj.weight": rng.normal(0, (H * hd) ** -0.5, (D, H * hd)),
                p + "attn.q_norm.weight": 1 + 0.1 * rng.normal(size=H * hd),
                p + "attn.k_norm.weight": 1 + 0.1 * rng.normal(size=KV * hd),
                p + "mlp.fc.weight": rng.normal(0, D ** -0.5, (2 * F, D)),
                p + "mlp.proj.weight": rng.normal(0, F ** -0.5, (D, F)),
                p + "norm_1.weight": 1 + 0.1 * rng.normal(size=D),
                p + "norm_2.weight": 1 + 0.1 * rng.normal(size=D)})
    return write_checkpoint(folder, config, {k: v.astype(np.float32) for k, v in tensors.items()})


def test_olmo2_variant_loads_and_caches(tmp_path):
    model = looped.load_looped(olmo2_checkpoint(tmp_path / "olmo"), "float32")
    cfg = model.config
    assert cfg.variant == "raven_olmo2" and cfg.q_dim == 64 != cfg.n_embd and cfg.family == "looped"
    assert set(looped.official_tensors(model.params, cfg)) == set(looped.expected_shapes(cfg))
    ids = np.random.default_rng(1).integers(0, 96, (2, 11))
    full = np.asarray(looped.forward_logits(model, ids, 3))
    assert full.shape == (2, 11, 96) and np.isfinite(full).all()
    cache = looped.init_cache(cfg, 2, 11, 3, "full", jnp.float32)
    a, cache, _ = looped.forward_jit(model.params, cfg, cache, jnp.asarray(ids[:, :8]), 3)
    b, cache, _ = looped.forward_jit(model.params, cfg, cache, jnp.asarray(ids[:, 8:]), 3)
    assert rel(np.concatenate([a, b], axis=1), full) < 1e-5
    result = looped_ar.generate(model, ids[:1, :5], 4, 3)
    assert result.tokens.shape == (1, 4)


def test_skip_adapter_mode_bypasses_adapter_at_step_zero(tmp_path):
    model = looped.load_looped(olmo2_checkpoint(tmp_path / "olmo", "skip-adapter"), "float32")
    zeroed = dict(model.params, adapter=jnp.zeros_like(model.params["adapter"]))
    ids = jnp.asarray(np.arange(6)[None])

    def logits(params, r):
        return looped.forward_jit(params, model.config, None, ids, r)[0]

    assert rel(logits(zeroed, 1), logits(model.params, 1)) == 0.0
    assert rel(logits(zeroed, 2), logits(model.params, 2)) > 1e-3


# ------------------------------------------------------------------------------- generation

def test_generate_eos_and_sampling(models, refs):
    model, prompt = models["huginn_tiny"], refs["huginn_tiny"]["greedy_prompt"]
    greedy = refs["huginn_tiny"]["greedy_r8"][0, 10:]  # 460 267 267 ...
    result = looped_ar.generate(model, prompt, 10, 8, eos_token_id=int(greedy[1]))
    np.testing.assert_array_equal(result.tokens[0], [greedy[0]] + [greedy[1]] * 9)
    assert result.stats["new_tokens"] == 2  # the loop stopped once every row hit EOS
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    a = looped_ar.generate(model, prompt, 6, 2, sampling=sampling, seed=3).tokens
    b = looped_ar.generate(model, prompt, 6, 2, sampling=sampling, seed=3).tokens
    np.testing.assert_array_equal(a, b)
    assert a.shape == (1, 6) and ((a >= 0) & (a < model.vocab_size)).all()


# ----------------------------------------------------------------------------------- bad input

def test_bad_inputs_raise_before_compute(models):
    model = models["huginn_tiny"]
    import specdec_jax
    with pytest.raises(InputError, match=r"unknown options \['gamma'\]; accepted: \['cache_mode', 'decode_rows', 'exact', 'num_steps'\]"):
        specdec_jax.generate(model, [[1, 2, 3]], 3, method="ar", num_steps=2, gamma=2)
    with pytest.raises(InputError, match=r"exceeds the model's context length \(max_position_embeddings=256\)"):
        looped_ar.generate(model, [[1, 2, 3]], 254, 2)
    with pytest.raises(InputError, match="exceeds the model's context length"):
        specdec_jax.generate(model, [[1, 2, 3]], 240, method="das-wave", num_steps=2, gamma=16)
    with pytest.raises(InputError, match="num_steps"):
        looped.forward_logits(model, [[1, 2, 3]], 0)
    with pytest.raises(InputError, match="num_steps"):
        looped_ar.generate(model, [[1, 2, 3]], 4, 0)
    with pytest.raises(InputError, match="empty"):
        looped.forward_logits(model, np.zeros((1, 0), np.int32), 2)
    with pytest.raises(InputError, match="outside the vocabulary"):
        looped_ar.generate(model, [[1, 512]], 4, 2)
    with pytest.raises(InputError, match="2-D"):
        looped.forward_logits(model, [1, 2, 3], 2)
    with pytest.raises(InputError, match="max_len"):
        looped_ar.generate(model, [[1, 2, 3]], 8, 2, max_len=10)
    cache = looped.init_cache(model.config, 1, 8, 2, "full", jnp.float32)
    with pytest.raises(InputError, match="step slots"):
        looped.forward(model.params, model.config, cache, jnp.ones((1, 2), jnp.int32), num_steps=4)
    with pytest.raises(InputError, match="read_step_k"):
        looped.forward(model.params, model.config, cache, jnp.ones((1, 2), jnp.int32), num_steps=2, read_step_k=5)
    with pytest.raises(InputError, match="exit_depths"):
        looped.forward(model.params, model.config, None, jnp.ones((1, 2), jnp.int32), num_steps=2, exit_depths=(3,))


def test_unknown_variant_is_named(tmp_path):
    def drop_norm_2(tensors):
        for k in [k for k in tensors if k.endswith("norm_2.weight")]:
            del tensors[k]

    folder = edited_fixture(tmp_path, "raven_llama_tiny", drop_norm_2)
    with pytest.raises(CheckpointError, match=r"unknown looped variant.*\['norm_1'\].*supported: huginn"):
        looped.load_looped(folder, "float32")
    config = json.loads((FIXTURES / "huginn_tiny" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="unknown looped variant 'mamba'"):
        looped.looped_config_from_dict(dict(config, variant="mamba"))
    with pytest.raises(CheckpointError, match="block_class_name"):
        looped.looped_config_from_dict(dict(config, block_class_name="TransformerPreNormBlock"))


def test_missing_tensor_names_key_and_file(tmp_path):
    key = "transformer.core_block.1.mlp.proj.weight"
    folder = edited_fixture(tmp_path, "huginn_tiny", lambda t: t.pop(key))
    with pytest.raises(CheckpointError) as err:
        looped.load_looped(folder, "float32")
    assert key in str(err.value) and str(folder / "model.safetensors") in str(err.value)


def test_wrong_shape_names_key_expected_and_got(tmp_path):
    key = "transformer.adapter.weight"

    def shrink(tensors):
        tensors[key] = tensors[key][:, :128].copy()

    folder = edited_fixture(tmp_path, "raven_llama_tiny", shrink)
    with pytest.raises(CheckpointError) as err:
        looped.load_looped(folder, "float32")
    message = str(err.value)
    assert key in message and "(128, 256)" in message and "(128, 128)" in message


def test_extra_layers_are_rejected(tmp_path):
    def extra_layer(tensors):
        for k in [k for k in tensors if k.startswith("transformer.coda.1.")]:
            tensors[k.replace("coda.1.", "coda.2.")] = tensors[k]

    folder = edited_fixture(tmp_path, "huginn_tiny", extra_layer)
    with pytest.raises(CheckpointError, match="transformer.coda.2"):
        looped.load_looped(folder, "float32")


def test_config_parsing(models):
    huginn, raven = models["huginn_tiny"].config, models["raven_llama_tiny"].config
    assert huginn.variant == "huginn" and huginn.tie_embeddings and huginn.qk_bias
    assert huginn.embed_scale == pytest.approx(math.sqrt(128)) and huginn.rope_base == 50000
    assert raven.variant == "raven_llama" and not raven.tie_embeddings and raven.num_key_value_heads == 2
    assert raven.rope_theta == 500000 and raven.rope_scaling_dict["rope_type"] == "llama3"
    assert raven.embed_scale == 1.0 and hash(raven) != hash(huginn) and looped.LoopedConfig.family == "looped"
    assert "lm_head" not in models["huginn_tiny"].params and "lm_head" in models["raven_llama_tiny"].params


@pytest.mark.parametrize("name, config_edit", [
    # Huginn's official code hard-codes embed_scale = sqrt(n_embd) and ignores initial_state_mode.
    ("huginn_tiny", {"init_values": {"std": 0.05, "embed_scale": 1.0}, "initial_state_mode": "embed-init"}),
    # The Llama retrofit's official code ignores initial_state_mode too (only OLMo-2's reads it).
    ("raven_llama_tiny", {"initial_state_mode": "skip-adapter"}),
])
def test_config_fields_the_official_code_ignores_are_ignored(tmp_path, refs, name, config_edit):
    config = json.loads((FIXTURES / name / "config.json").read_text())
    init_std = config_edit.get("init_values", {}).get("std")
    for key, value in config_edit.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    model = looped.load_looped(write_checkpoint(tmp_path / name, config, tensors), "float32")
    assert model.config.initial_state_mode == "random"
    if init_std is not None:  # read (it scales the random initial state), unlike the embedding scale
        assert model.config.init_std == init_std and model.config.embed_scale == pytest.approx(math.sqrt(128))
    for r in (1, 4):
        logits = looped.forward_logits(model, refs[name]["input_ids"], r)
        assert rel(logits, refs[name][f"logits_r{r}"]) < 1e-4


def test_adapter_bias_from_config_bias(tmp_path, refs):
    """Official `bias: true` gives the adapter (and nothing else) a bias, `transformer.adapter.bias`."""
    name = "huginn_tiny"
    config = {**json.loads((FIXTURES / name / "config.json").read_text()), "bias": True}
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    with pytest.raises(CheckpointError, match="transformer.adapter.bias"):
        looped.load_looped(write_checkpoint(tmp_path / "missing", config, tensors), "float32")
    ids = refs[name]["input_ids"]
    zero = looped.load_looped(write_checkpoint(
        tmp_path / "zero", config, {**tensors, "transformer.adapter.bias": np.zeros(128, np.float32)}), "float32")
    assert zero.config.adapter_bias and rel(looped.forward_logits(zero, ids, 4), refs[name]["logits_r4"]) < 1e-4
    bias = np.random.default_rng(0).normal(size=128).astype(np.float32)
    model = looped.load_looped(write_checkpoint(
        tmp_path / "bias", config, {**tensors, "transformer.adapter.bias": bias}), "float32")
    assert rel(looped.forward_logits(model, ids, 4), refs[name]["logits_r4"]) > 1e-2  # the bias is applied
    x, e = (jax.random.normal(jax.random.key(i), (1, 3, 128)) for i in (1, 2))
    expected = jnp.concatenate([x, e], -1) @ model.params["adapter"].T + bias
    np.testing.assert_allclose(looped.inject(model.params, model.config, x, e, False), expected, rtol=1e-5, atol=1e-5)
    assert "transformer.adapter.bias" in looped.official_tensors(model.params, model.config)


def test_missing_config_fields_take_ravenconfig_defaults():
    config = json.loads((FIXTURES / "huginn_tiny" / "config.json").read_text())
    for key in ("qk_bias", "tie_embeddings", "tie_word_embeddings"):
        config.pop(key, None)
    cfg = looped.looped_config_from_dict(config)
    assert cfg.qk_bias and cfg.tie_embeddings  # RavenConfig(qk_bias=True, tie_embeddings=True)
    # RavenConfig.attribute_map: the official minimal config.json spells n_heads num_attention_heads.
    config["num_attention_heads"], config["hidden_size"] = config.pop("n_heads"), config.pop("n_embd")
    assert looped.looped_config_from_dict(config) == cfg
    del config["num_attention_heads"]
    with pytest.raises(CheckpointError, match=r"'n_heads' \(or 'num_attention_heads'\) is missing"):
        looped.looped_config_from_dict(config)


def test_public_api_dispatches_to_looped(refs):
    import specdec_jax
    model = specdec_jax.load(FIXTURES / "huginn_tiny", "float32")
    assert model.family == "looped" and model.config.variant == "huginn"
    ref = refs["huginn_tiny"]
    assert rel(specdec_jax.forward_logits(model, ref["input_ids"], num_steps=4), ref["logits_r4"]) < 1e-4
    result = specdec_jax.generate(model, ref["greedy_prompt"], 10, num_steps=8)
    np.testing.assert_array_equal(result.tokens, ref["greedy_r8"][:, 10:])
