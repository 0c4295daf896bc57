"""A mixture-of-experts layer's expert products (pallas_kernels/experts) and the MoE models built on them.

Every implementation (per-copy gather, XLA's sorted grouped product, the Pallas grouped kernel in interpret mode)
against a float64 numpy loop, on routings with ids outside [0, E) (copies that select no expert), groups longer than
a tile, and decode and prefill tiles; a row's output bit for bit alone and among rows that share its experts; the
padded sorted layout; a shared expert as one more tile of the kernel's launches. Then the model: padding rows of a
decode-shape forward select no expert (routed or, as a tile, shared), a row's logits are the same alone and in a
verification batch, greedy speculation (n-gram, MTP) equals AR on a random MoE in bfloat16, and with the shared
expert as a tile (qwen35 mlp.SHARED_EXPERT_TILE) the same, its layout saved as the checkpoint's tensors and its
greedy tokens transformers'. The GPU run is benchmarks/bench_moe.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from pallas_kernels import experts as X
from specdec_jax.models.qwen35 import mlp as qwen_mlp
from specdec_jax.models.qwen35 import model as qwen35

# the kernel's tiles at the test's small sizes: several column blocks and K steps per product
SMALL_BLOCKS = {"block_n": 16, "block_k": 16}


def _naive(x, ids, gate_up, down):
    """float64, one copy at a time; zero for ids outside [0, E)."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    N, k = ids.shape
    inter = down.shape[2]
    out = np.zeros((N, k, x.shape[1]))
    for n in range(N):
        for s in range(k):
            e = int(ids[n, s])
            if 0 <= e < gate_up.shape[0]:
                h = gate_up[e] @ x[n]
                out[n, s] = down[e] @ (h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:])
    return out


def _weights(rng, E, D, inter, dtype):
    gate_up = jnp.asarray(rng.standard_normal((E, 2 * inter, D)) * D ** -0.5, dtype)
    down = jnp.asarray(rng.standard_normal((E, D, inter)) * inter ** -0.5, dtype)
    return gate_up, down


CASES = {  # N tokens, k, E, D, I, decode_shape
    "decode, 9 rows": (9, 4, 16, 64, 32, True),
    "prefill, groups past a tile": (70, 2, 4, 32, 16, False),
}


# "pallas" runs decode shapes of at most block_m tokens on shared rows (X.SHARED_ROWS_DECODE); "pallas-layout" is
# the same kernel on the sorted layout, which larger decode forwards and prefill chunks take.
IMPLEMENTATIONS = (*X.IMPLEMENTATIONS, "pallas-layout")


def _implementation(monkeypatch, name: str) -> str:
    if name == "pallas-layout":
        monkeypatch.setattr(X, "SHARED_ROWS_DECODE", False)
        return "pallas"
    return name


@pytest.mark.parametrize("implementation,case", [(i, c) for i in IMPLEMENTATIONS for c in CASES
                                                 if i != "pallas-layout" or CASES[c][-1]])  # prefill: always layout
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_swiglu_matches_float64(monkeypatch, implementation, case, dtype):
    implementation = _implementation(monkeypatch, implementation)
    N, k, E, D, inter, decode_shape = CASES[case]
    rng = np.random.default_rng(N)
    x = jnp.asarray(rng.standard_normal((N, D)), dtype)
    gate_up, down = _weights(rng, E, D, inter, dtype)
    ids = rng.integers(0, E, (N, k)).astype(np.int32)
    ids[1] = -1  # a padding row: no expert
    ids[2, 0] = E  # out of range on the other side
    got = X.expert_swiglu(x, jnp.asarray(ids), gate_up, down, implementation=implementation,
                          decode_shape=decode_shape, blocks=SMALL_BLOCKS)
    assert got.shape == (N, k, D) and got.dtype == jnp.dtype(dtype)
    want = _naive(np.asarray(x, np.float32), ids, np.asarray(gate_up, np.float32), np.asarray(down, np.float32))
    assert np.all(np.asarray(got)[1] == 0) and np.all(np.asarray(got)[2, 0] == 0)
    tol = 1e-5 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("implementation", X.IMPLEMENTATIONS)
@pytest.mark.parametrize("decode_shape", [True, False])
def test_a_rows_output_does_not_depend_on_the_rows_sharing_its_experts(implementation, decode_shape):
    """Row 0 alone, then among 8 rows of which several pick its experts (and a padding row): the same bits. At decode
    shapes the kernel's two forms meet here: up to block_m rows on shared rows, 20 rows on the sorted layout."""
    rng = np.random.default_rng(3)
    E, D, inter = 8, 32, 16
    gate_up, down = _weights(rng, E, D, inter, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((20, D)), jnp.bfloat16)
    ids = np.asarray([[2, 5]] * 5 + [[5, 1], [0, 2], [-1, -1], [7, 3]] + [[2, 4], [6, 5]] * 5 + [[1, 2]], np.int32)
    run = lambda xs, ii: np.asarray(X.expert_swiglu(xs, jnp.asarray(ii), gate_up, down, implementation=implementation,
                                                    decode_shape=decode_shape, blocks=SMALL_BLOCKS))
    alone = run(x[:1], ids[:1])
    shared = run(x[:9], ids[:9])
    assert np.array_equal(alone[0], shared[0])
    assert np.array_equal(run(x[8::-1], ids[8::-1])[-1], shared[0])  # and wherever it sits among them
    assert np.array_equal(run(x, ids)[0], shared[0])  # and among more rows than a tile holds


def _naive_dense(x, gate_up, down, on):
    """float64: one expert [2I, D], [D, I] on every row where `on`."""
    return _naive(x, np.where(on, 0, -1)[:, None], np.asarray(gate_up)[None], np.asarray(down)[None])[:, 0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_shared_expert_as_a_tile_matches_float64(monkeypatch, implementation, dtype):
    """`shared`: the shared expert is copy k of each selected row (y [N, k + 1, D]); its rows where shared_selected is
    False (padding) come out zero, as do the routed copies that select none; the routed copies are unchanged."""
    implementation = _implementation(monkeypatch, implementation)
    N, k, E, D, inter, _ = CASES["decode, 9 rows"]
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((N, D)), dtype)
    gate_up, down = _weights(rng, E, D, inter, dtype)
    s_gate_up, s_down = (a[0] for a in _weights(rng, 1, D, inter, dtype))
    ids = rng.integers(0, E, (N, k)).astype(np.int32)
    ids[1] = -1
    on = np.ones(N, bool)
    on[1] = False  # a padding row: neither routed nor shared
    run = lambda **kw: X.expert_swiglu(x, jnp.asarray(ids), gate_up, down, implementation=implementation,
                                       decode_shape=True, blocks=SMALL_BLOCKS, **kw)
    got = run(shared=(s_gate_up, s_down), shared_selected=jnp.asarray(on))
    assert got.shape == (N, k + 1, D) and got.dtype == jnp.dtype(dtype)
    got = np.asarray(got, np.float32)
    f32 = lambda a: np.asarray(a, np.float32)
    want = _naive_dense(f32(x), f32(s_gate_up), f32(s_down), on)
    assert np.all(got[1] == 0)
    tol = 1e-5 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(got[:, k], want, atol=tol, rtol=tol)
    assert np.array_equal(got[:, :k], np.asarray(run(), np.float32))  # the routed copies' bits
    with pytest.raises(ValueError, match="not one expert"):
        run(shared=(s_gate_up[:, :-1], s_down))


def test_a_rows_shared_expert_tile_does_not_depend_on_the_rows_beside_it(monkeypatch):
    """The kernel with the shared expert as a tile: row 0 alone (shared rows), among 9 rows, at the end of them, and
    among 20 (the sorted layout, where the shared expert's copies fill two tiles): the same bits, routed and shared."""
    rng = np.random.default_rng(5)
    E, D, inter = 8, 32, 16
    gate_up, down = _weights(rng, E, D, inter, jnp.bfloat16)
    shared = tuple(a[0] for a in _weights(rng, 1, D, inter, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((20, D)), jnp.bfloat16)
    ids = np.asarray([[2, 5]] * 5 + [[5, 1], [0, 2], [-1, -1], [7, 3]] + [[2, 4], [6, 5]] * 5 + [[1, 2]], np.int32)
    on = ids[:, 0] >= 0

    def run(xs, ii, oo):
        return np.asarray(X.expert_swiglu(xs, jnp.asarray(ii), gate_up, down, implementation="pallas",
                                          decode_shape=True, blocks=SMALL_BLOCKS, shared=shared,
                                          shared_selected=jnp.asarray(oo)))
    alone = run(x[:1], ids[:1], on[:1])
    among = run(x[:9], ids[:9], on[:9])
    assert np.any(alone[0, 2] != 0) and np.all(among[7] == 0)
    assert np.array_equal(alone[0], among[0])
    assert np.array_equal(run(x[8::-1], ids[8::-1], on[8::-1])[-1], among[0])
    assert np.array_equal(run(x, ids, on)[0], among[0])
    monkeypatch.setattr(X, "SHARED_ROWS_DECODE", False)  # the sorted layout at one row too
    assert np.array_equal(run(x[:1], ids[:1], on[:1])[0], among[0])


def test_first_copy_tiles_give_each_selected_expert_one_tile():
    ids = np.asarray([[3, 1], [3, 0], [3, 1], [-1, -1], [3, 2]], np.int32)
    selected = ids >= 0
    copy_tile, tile_expert = (np.asarray(a) for a in X.first_copy_tiles(jnp.asarray(np.maximum(ids, 0)),
                                                                        jnp.asarray(selected), 4))
    used = tile_expert[tile_expert >= 0]
    assert sorted(used.tolist()) == [0, 1, 2, 3]  # the union of the experts, each once
    flat_ids, flat_sel = ids.reshape(-1), selected.reshape(-1)
    assert np.array_equal(tile_expert[copy_tile[flat_sel]], flat_ids[flat_sel])  # each copy in a tile of its expert
    assert np.all(copy_tile[~flat_sel] == ids.size)  # padding copies in none


@pytest.mark.parametrize("compare_max", [0, 256], ids=["sorted", "compared"])
def test_group_layout_reads_each_expert_once_per_tile(monkeypatch, compare_max):
    monkeypatch.setattr(X, "LAYOUT_COMPARE_MAX_COPIES", compare_max)
    ids = np.asarray([[3, 1], [3, 0], [3, 1], [-1, -1], [3, 2]], np.int32)  # expert 3: 4 copies; 1: 2; 0, 2: 1
    selected = ids >= 0
    block_m = 2
    lay = X.group_layout(jnp.asarray(np.maximum(ids, 0)), jnp.asarray(selected), 4, block_m)
    assert lay.rows == X.padded_rows(ids.size, 4, block_m) and lay.rows % block_m == 0
    dest = np.asarray(lay.dest).reshape(ids.shape)
    tile_expert = np.asarray(lay.tile_expert)
    assert np.all(dest[~selected] == lay.rows)  # padding copies land nowhere
    live = dest[selected]
    assert len(set(live.tolist())) == live.size  # one row per copy
    assert np.array_equal(tile_expert[live // block_m], ids[selected])  # each copy in a tile of its expert
    used = tile_expert[tile_expert >= 0]
    assert sorted(used.tolist()) == [0, 1, 2, 3, 3]  # ceil(copies / block_m) tiles per expert, no more
    assert np.all(tile_expert[len(used):] == -1)


@pytest.mark.parametrize("tokens,k,E,block_m", [(9, 8, 256, 16), (1, 8, 256, 16), (40, 2, 4, 8)])
def test_the_compared_layout_is_the_sorted_one(monkeypatch, tokens, k, E, block_m):
    """Decode-size routings (some copies selecting no expert, experts shared across rows): the compare-matrix layout
    gives the sort's destinations and tile experts, and its gathered rows are the scatter's."""
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(E, k, replace=False) if k <= E else rng.integers(0, E, k) for _ in range(tokens)])
    ids = jnp.asarray(np.where(rng.random(ids.shape) < 0.8, ids, -1).astype(np.int32))
    selected, clamped = ids >= 0, jnp.maximum(ids, 0)
    x = jnp.asarray(rng.standard_normal((tokens, 32)), jnp.float32)
    copy_token = jnp.arange(tokens * k, dtype=jnp.int32) // k
    out = {}
    for compare_max in (0, 256):
        monkeypatch.setattr(X, "LAYOUT_COMPARE_MAX_COPIES", compare_max)
        lay = X.group_layout(clamped, selected, E, block_m)
        out[compare_max] = (np.asarray(lay.dest), np.asarray(lay.tile_expert), np.asarray(X.gather_rows(x, copy_token,
                                                                                                         lay)))
    for a, b in zip(out[0], out[256]):
        assert np.array_equal(a, b)
    assert np.any(out[0][1] >= 0) and np.any(out[0][2] != 0)  # not vacuous: tiles in use, rows filled


def test_auto_off_the_gpu_and_bad_names():
    assert X.resolve("auto", 8, 16) == "gather" and X.resolve("auto", 32, 16) == "ragged"
    with pytest.raises(ValueError, match="implementation must be one of"):
        X.resolve("triton", 8, 16)


# ------------------------------------------------------------------------------------------------- the models


def random_moe_model(dtype="bfloat16", *, mtp: bool = False, seed: int = 0, shared_size: int = 24):
    """A random Qwen3.5 MoE: 8 experts (top 2, intermediate size 16), a shared expert (intermediate size
    `shared_size`; 16: a routed expert's shape, which the kernel can run as a tile), 2 layers (a GDN layer, then an
    attention layer: every kind of layer once, the suite's compile time); with `mtp`, an MTP layer (MoE too)."""
    from specdec_jax.loading import build_tree
    from specdec_jax.models.qwen35.config import qwen35_config_from_dict
    from specdec_jax.models.qwen35.mtp_head import leaf_shape
    from specdec_jax.results import Model
    cfg = qwen35_config_from_dict(dict(
        model_type="qwen3_5_moe_text", vocab_size=96, hidden_size=32, num_hidden_layers=2, full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=shared_size, mtp_num_hidden_layers=int(mtp), eos_token_id=None))
    keys = {"model.embed_tokens.weight"} | ({"mtp.layers.0.input_layernorm.weight"} if mtp else set())
    specs = qwen35.param_specs(cfg, keys, "random")
    rng = np.random.default_rng(seed)
    params = build_tree(specs, lambda leaf: jnp.asarray(rng.standard_normal(leaf_shape(leaf)) * 0.3, dtype))
    return Model(config=cfg, params=qwen35.moe_layout(params, cfg), dtype=jnp.dtype(dtype))  # the loader's layout


@pytest.mark.parametrize("impl", ["auto", "pallas", "pallas-tile"])
def test_padding_rows_select_no_expert_and_a_row_is_the_same_alone(monkeypatch, impl):
    """Decode-shape forwards of 5 rows: with 1 valid row the experts see id -1 for the 4 padding rows, and the valid
    row's logits are the same bits whatever tokens the padding rows hold and when the 4 rows are real (a
    verification, whose rows share its experts). With live_rows (the static bound an AR step or a verification
    passes) the kernel's products see only the first live_rows rows (XLA's paths, whose bits may follow the row
    count, keep all 5), and the valid rows' logits keep their bits. "pallas-tile": the shared expert as a tile of
    the kernel (SHARED_EXPERT_TILE, a model whose shared expert has a routed one's shape), which the padding rows do
    not select either."""
    tile = impl == "pallas-tile"
    if tile:
        monkeypatch.setattr(qwen_mlp, "SHARED_EXPERT_TILE", True)
        impl = "pallas"
    model = random_moe_model("float32", shared_size=16 if tile else 24)
    assert ("router_gate" in model.params["layers"][0]["mlp"]) == tile
    seen, seen_shared = [], []
    original = X.expert_swiglu

    def recording(x, ids, *args, **kwargs):
        jax.debug.callback(lambda a: seen.append(np.asarray(a)), ids)
        if kwargs.get("shared") is not None:
            jax.debug.callback(lambda a: seen_shared.append(np.asarray(a)), kwargs["shared_selected"])
        return original(x, ids, *args, **kwargs)

    monkeypatch.setattr(qwen_mlp.experts, "expert_swiglu", recording)
    tiles = dict(X.DECODE_BLOCKS, block_m=16, **SMALL_BLOCKS)  # tiles that divide the test's small experts
    monkeypatch.setattr(X, "DECODE_BLOCKS", tiles)
    cfg, params = model.config, model.params
    state = qwen35.init_state(cfg, 1, 32, jnp.float32)
    _, state = qwen35.forward_jit(params, cfg, state, jnp.asarray([[5, 9, 11, 3]], jnp.int32))
    step = jax.jit(lambda params, state, ids, n, live=None: qwen35.forward(
        params, cfg, state, ids, impl=impl, n_valid=n, live_rows=live)[0], static_argnums=4)
    logits = []
    for rows, n_valid, live in (([0, 0, 0, 0], 1, None), ([95, 40, 7, 60], 1, None), ([95, 40, 7, 60], 5, None),
                                ([95, 40, 7, 60], 1, 1), ([95, 40, 7, 60], 5, 3)):
        seen.clear()
        seen_shared.clear()
        out = step(params, state, jnp.asarray([[7] + rows], jnp.int32), jnp.asarray([n_valid], jnp.int32), live)
        jax.effects_barrier()
        logits.append(np.asarray(out[0, :min(n_valid, live or 5)]))
        assert len(seen) == len(cfg.layer_types) and len(seen_shared) == (len(seen) if tile else 0)
        for ids in seen:
            assert ids.shape == ((live or 5) if impl == "pallas" else 5, 2)
            assert np.all((ids[n_valid:] == -1)) and np.all(ids[:n_valid] >= 0)
        for on in seen_shared:
            assert on.shape == (live or 5,) and np.all(on[:n_valid]) and not np.any(on[n_valid:])
    for got in logits[1:]:
        assert np.array_equal(logits[0][:1], got[:1])
    assert np.array_equal(logits[2][:3], logits[4])  # a verification's first 3 rows, alone in the expert products


@pytest.mark.parametrize("rows", [1, 9, 70])
def test_the_compared_top_k_is_lax_top_k(monkeypatch, rows):
    """The router's top-k from compare ranks (decode shapes) gives lax.top_k's experts, order and values, ties
    included (the lower expert id first); past TOPK_COMPARE_MAX_ROWS rows it is lax.top_k."""
    monkeypatch.setattr(qwen_mlp, "TOPK_COMPARE_MAX_ROWS", 64)
    rng = np.random.default_rng(rows)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((rows, 16)), jnp.float32), axis=-1)
    probs = probs.at[:, 5].set(probs[:, 9]).at[:, 2].set(probs[:, 9])  # three-way ties in every row
    probs = probs.at[0].set(jnp.full((16,), 1 / 16))  # a row of equal probabilities
    want_v, want_i = jax.lax.top_k(probs, 4)
    got_v, got_i = jax.jit(qwen_mlp.top_k, static_argnums=1)(probs, 4)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_fused_moe_inputs_are_the_three_products():
    """One `router_shared` weight per layer (router, shared gate|up, shared expert gate stacked) gives the three
    products' logits (float32), saves to the same checkpoint tensors, and the partial-MLP draft cuts the same weights
    from either layout."""
    from specdec_jax.drafters.self_draft import partial_mlp_weights
    model = random_moe_model("float32", mtp=True)
    cfg, plain = model.config, qwen35.moe_layout(model.params, model.config, fused=False)
    fused = qwen35.moe_layout(plain, cfg, fused=True)
    assert all("router_shared" in layer["mlp"] and "router" not in layer["mlp"]
               for layer in fused["layers"] + fused["mtp"]["layers"])
    ids = jnp.asarray([[5, 9, 11, 3, 7, 2]], jnp.int32)
    run = jax.jit(lambda p: qwen35.forward(p, cfg, qwen35.init_state(cfg, 1, 16, jnp.float32), ids)[0])
    np.testing.assert_allclose(np.asarray(run(fused)), np.asarray(run(plain)), rtol=1e-5, atol=1e-5)
    saved_plain, saved_fused = qwen35.hf_tensors(plain, cfg), qwen35.hf_tensors(fused, cfg)
    assert saved_plain.keys() == saved_fused.keys()
    assert all(np.array_equal(saved_plain[k], saved_fused[k]) for k in saved_plain)
    for a, b in zip(partial_mlp_weights(plain, cfg, 0.5), partial_mlp_weights(fused, cfg, 0.5)):
        b = qwen35.unfuse_moe_inputs(b, cfg)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_greedy_speculation_on_a_moe_model_equals_ar_in_bfloat16():
    """n-gram and MTP (the MTP layer is MoE too) speculation against AR, bf16, a repetitive prompt (drafts hit)."""
    model = random_moe_model("bfloat16", mtp=True, seed=1)
    prompts = [np.asarray([5, 9, 11, 3, 5, 9, 11, 3, 5, 9], np.int32), np.asarray([7, 8, 7, 8, 7, 8, 7], np.int32)]
    ar = sj.generate(model, prompts, 24, eos_token_id=False)  # its default decode rows are gamma 4's
    for method in ("ngram", "mtp"):
        spec = sj.generate(model, prompts, 24, method=method, gamma=4, eos_token_id=False)
        assert spec.stats["decode_rows"] == ar.stats["decode_rows"]
        assert np.array_equal(spec.tokens, ar.tokens), method


def _small_decode_tiles(monkeypatch):
    """The kernel's decode tiles at the test models' sizes (D 32, I 16), so decode forwards can run it."""
    monkeypatch.setattr(X, "DECODE_BLOCKS", dict(X.DECODE_BLOCKS, block_m=16, **SMALL_BLOCKS))


def test_the_shared_expert_tile_layout_saves_the_checkpoints_tensors(monkeypatch):
    """Under SHARED_EXPERT_TILE the loader's layout holds each layer's router and shared expert gate as one
    `router_gate` weight and the shared expert as stored (the expert stacks the same arrays); it saves to the
    checkpoint's tensors, unfuses for the mesh, and the partial-MLP draft cuts the same weights from it. A decode
    forward with the shared expert as a kernel tile gives the three products' logits (float32). Where the shared
    expert's shape is not a routed one's, the switch leaves the layout alone; the switch is part of the compiled
    programs' key."""
    from specdec_jax.decoding import compiled
    from specdec_jax.drafters.self_draft import partial_mlp_weights
    monkeypatch.setattr(qwen_mlp, "SHARED_EXPERT_TILE", False)
    off = compiled._switches()
    monkeypatch.setattr(qwen_mlp, "SHARED_EXPERT_TILE", True)
    assert compiled._switches() != off
    model = random_moe_model("float32", mtp=True, shared_size=16)
    cfg, tiled = model.config, model.params
    plain = qwen35.moe_layout(tiled, cfg, fused=False)
    fused = qwen35.moe_layout(plain, cfg, fused=True, shared_tile=False)
    for layer, plain_layer in zip(tiled["layers"] + tiled["mtp"]["layers"], plain["layers"] + plain["mtp"]["layers"]):
        mlp = layer["mlp"]
        assert qwen35.moe_input_form(mlp) == "router_gate" and mlp["router_gate"].shape == (9, 32)
        assert "router" not in mlp and "shared_expert_gate" not in mlp and "router_shared" not in mlp
        assert mlp["experts_gate_up"] is plain_layer["mlp"]["experts_gate_up"]  # no copy of the stacks
    saved = qwen35.hf_tensors(tiled, cfg)
    saved_plain = qwen35.hf_tensors(plain, cfg)
    assert saved.keys() == saved_plain.keys()
    assert all(np.array_equal(saved[k], saved_plain[k]) for k in saved)
    for a, b in zip(partial_mlp_weights(plain, cfg, 0.5), partial_mlp_weights(tiled, cfg, 0.5)):
        assert qwen35.moe_input_form(b) == "router_gate"
        b = qwen35.unfuse_moe_inputs(b, cfg)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    _small_decode_tiles(monkeypatch)
    ids = jnp.asarray([[5, 9, 11, 3, 7, 2]], jnp.int32)
    run = jax.jit(lambda p: qwen35.forward(p, cfg, qwen35.init_state(cfg, 1, 16, jnp.float32), ids,
                                           impl="pallas")[0])
    want = np.asarray(run(fused))
    np.testing.assert_allclose(np.asarray(run(tiled)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(run(plain)), want, rtol=1e-5, atol=1e-5)  # the tile on the plain layout
    other = random_moe_model("float32")  # shared expert 24 wide, routed 16: no tile
    assert qwen35.moe_input_form(other.params["layers"][0]["mlp"]) == "router_shared"


def test_greedy_speculation_with_the_shared_expert_tile_equals_ar_in_bfloat16(monkeypatch):
    """The kernel (interpret mode) on every decode forward, the shared expert as its tile: speculation with AR's own
    continuation as drafts (each position kept with probability 0.7: accepted runs and rejections) and MTP equal AR
    in bfloat16."""
    from specdec_jax import methods
    from specdec_jax.bench.harness import register_reference_drafts
    monkeypatch.setattr(methods, "REGISTRY", methods.REGISTRY)  # the forced method leaves with the test
    monkeypatch.setattr(qwen_mlp, "SHARED_EXPERT_TILE", True)
    monkeypatch.setattr(qwen_mlp, "expert_implementation", lambda cfg, impl: "pallas")
    _small_decode_tiles(monkeypatch)
    model = random_moe_model("bfloat16", mtp=True, seed=1, shared_size=16)
    assert qwen35.moe_input_form(model.params["layers"][0]["mlp"]) == "router_gate"
    prompts = [np.asarray([5, 9, 11, 3, 5, 9, 11, 3, 5, 9], np.int32), np.asarray([7, 8, 7, 8, 7, 8, 7], np.int32)]
    ar = sj.generate(model, prompts, 24, eos_token_id=False)
    register_reference_drafts("forced", ar.tokens, [len(p) for p in prompts], p=0.7, seed=4)
    for method in ("forced", "mtp"):
        spec = sj.generate(model, prompts, 24, method=method, gamma=4, eos_token_id=False)
        assert spec.stats["decode_rows"] == ar.stats["decode_rows"]
        assert np.array_equal(spec.tokens, ar.tokens), method
        assert method != "forced" or 1.5 < spec.stats["tokens_per_step"] < 5  # accepted drafts and rejections


def test_the_shared_expert_tile_greedy_tokens_are_transformers(monkeypatch, tmp_path):
    """A transformers Qwen3.5 MoE whose shared expert has a routed expert's shape, saved and loaded under
    SHARED_EXPERT_TILE: its forward logits and its greedy tokens (every decode step on the kernel, the shared expert
    as its tile; float32) are transformers'."""
    from tests import qwen_helpers as H
    monkeypatch.setattr(qwen_mlp, "SHARED_EXPERT_TILE", True)
    monkeypatch.setattr(qwen_mlp, "expert_implementation", lambda cfg, impl: "pallas")
    _small_decode_tiles(monkeypatch)
    cfg = H.tiny_text_config(moe=True, ratio=1, layers=2, seed=3, shared_expert_intermediate_size=16,
                             full_attention_interval=2)  # a GDN layer, then an attention layer
    ref = H.build_reference(cfg, seed=3)
    H.save_reference(ref, str(tmp_path))
    model = sj.load(str(tmp_path), dtype="float32")
    assert qwen35.moe_input_form(model.params["layers"][0]["mlp"]) == "router_gate"
    ids = np.random.default_rng(2).integers(0, model.vocab_size, size=(1, 9))
    assert H.rel_err(sj.forward_logits(model, ids), H.reference_logits(ref, ids)) <= 1e-4
    ours = sj.generate(model, ids, 16, method="ar", eos_token_id=False)
    np.testing.assert_array_equal(ours.tokens, H.reference_greedy(ref, ids, 16))


def test_a_mesh_with_more_devices_than_experts_is_refused():
    """Experts are split whole over the mesh: 8 experts over 16 devices is one error naming the count (checked from
    the config, before any tensor is read: tests/test_tensor_parallel.py runs the refusals on a real mesh)."""
    from specdec_jax import sharding
    from specdec_jax.models.qwen35 import params as qwen_params
    cfg = random_moe_model("float32").config
    assert not any(p.startswith("num_experts") for p in sharding.split_problems(qwen_params.split_counts(cfg), 8))
    problems = sharding.split_problems(qwen_params.split_counts(cfg), 16)
    assert any(p.startswith("num_experts=8 is not a multiple of 16") for p in problems), problems


def test_the_kernel_lowers_to_triton_modules_that_verify(monkeypatch):
    """The GPU lowering, checked without a GPU: expert_swiglu at the 35B-A3B layer's shape (decode and prefill tiles)
    lowered for CUDA, every Triton module it builds run through MLIR's verifier (what the GPU plugin does before it
    compiles; a loop whose bounds lowered to unlike types failed there on an H100 and passes interpret mode).
    Also: the program around the kernels has no loop. Uses jax's private Pallas Triton lowering: it fails loudly if
    that moves."""
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax._src.pallas.triton import pallas_call_registration as registration
    import types
    verified = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        verified.append(result.module.operation.verify())
        return result

    lower = triton_lowering.lower_jaxpr_to_triton_module
    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    monkeypatch.setattr(registration, "gpu_info_lib", types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability="9.0")))  # an H100
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel, not its interpret mode
    monkeypatch.setattr(X, "LAYOUT_COMPARE_MAX_COPIES", 256)  # the compare layout for decode steps (its A/B pending)
    E, D, inter, k = 256, 2048, 512, 8
    weights = (jax.ShapeDtypeStruct((E, 2 * inter, D), jnp.bfloat16), jax.ShapeDtypeStruct((E, D, inter), jnp.bfloat16))
    for tokens, decode_shape in ((8, True), (20, True), (1024, False)):  # shared rows, then the layout twice
        x = jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((tokens, k), jnp.int32)
        fn = jax.jit(lambda x, i, g, d, s=decode_shape: X.expert_swiglu(x, i, g, d, implementation="pallas",
                                                                         decode_shape=s))
        text = fn.trace(x, ids, *weights).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text
        # No loop around the kernels: XLA's GPU runtime drives a while loop from the host, one round trip a step, and
        # here it would run in every MoE layer of every decode step (jnp.searchsorted's default method is one).
        assert "stablehlo.while" not in text, f"the {'decode' if decode_shape else 'prefill'} program has a loop"
        if decode_shape:  # a decode step's shared rows or compare layout: no sort, no scatter
            assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text
            # and with the shared expert as a tile (a second weight operand, a second K loop)
            shared = (jax.ShapeDtypeStruct((2 * inter, D), jnp.bfloat16), jax.ShapeDtypeStruct((D, inter), jnp.bfloat16))
            fn = jax.jit(lambda x, i, g, d, sg, sd: X.expert_swiglu(x, i, g, d, implementation="pallas",
                                                                     decode_shape=True, shared=(sg, sd)))
            text = fn.trace(x, ids, *weights, *shared).lower(lowering_platforms=("cuda",)).as_text()
            assert "xla.gpu.triton" in text and "stablehlo.while" not in text and "stablehlo.sort" not in text
    assert verified == [True] * 10  # two products (gate-up with SwiGLU, down) per program
