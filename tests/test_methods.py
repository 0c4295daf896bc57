"""The method registry: generate(), supported_methods and the CLI find methods there, so a new drafter is one
class plus one registry entry."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax import methods
from specdec_jax.drafters.stateless import StatelessDrafter
from specdec_jax.errors import InputError

QWEN = "checkpoints/tiny-qwen35-code"


def test_registry_names_are_unique_per_family_and_complete():
    for family in ("qwen3_5", "looped"):
        names = methods.family_methods(family)
        assert len(names) == len(set(names)) and "ar" in names
    model = sj.load(QWEN, dtype="float32")  # it has the MTP head and the draft tables: everything is supported
    assert sj.supported_methods(model) == methods.family_methods("qwen3_5")
    for spec in methods.REGISTRY:
        assert spec.kind in (methods.AR, methods.CHAIN, methods.TREE, methods.LOOPED_SPEC)
        assert (spec.drafter is not None) == (spec.kind in (methods.CHAIN, methods.TREE)), spec.name


@dataclasses.dataclass(frozen=True)
class RepeatDrafter(StatelessDrafter):
    """Drafts the last token again, gamma times (a toy drafter that needs nothing but the history)."""

    name = "repeat"

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma, key, **_):
        last = jnp.take_along_axis(history, (hist_len - 1)[:, None], axis=1)  # [B, 1]
        return jnp.repeat(last, gamma, axis=1), None, drafter_state


def test_chain_default_gammas_keep_the_default_decode_rows():
    """The measured default draft lengths, each short enough that a default speculative run verifies at AR's
    default decode row count (so its exact output is default AR's)."""
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    chain = {s.name: s.default_gamma for s in methods.REGISTRY if s.kind == methods.CHAIN}
    assert chain["mtp"] == chain["mtp-shortlist"] == methods.MTP_GAMMA == 4
    assert chain["layer-skip"] == chain["partial-mlp"] == methods.SELF_DRAFT_GAMMA == 2
    assert chain["ngram"] == chain["ngram-table"] == 4
    for name, gamma in chain.items():
        assert choose_decode_rows(gamma, None, "qwen3_5") == choose_decode_rows(0, None, "qwen3_5"), name


def test_a_registered_drafter_runs_through_generate(monkeypatch):
    """One MethodSpec entry makes a new drafter a method: generate() runs it (greedy output equal to AR), its
    options are checked, and supported_methods lists it."""
    spec = methods.MethodSpec("repeat", "qwen3_5", methods.CHAIN, methods.CHAIN_OPTIONS,
                              drafter=lambda model, options: RepeatDrafter())
    monkeypatch.setattr(methods, "REGISTRY", methods.REGISTRY + (spec,))
    model = sj.load(QWEN, dtype="float32")
    ids = np.asarray([[1542, 12, 290, 1239, 11, 2023, 198, 220]])
    assert "repeat" in sj.supported_methods(model)
    out = sj.generate(model, ids, 12, method="repeat", gamma=3, eos_token_id=False)
    np.testing.assert_array_equal(out.tokens, sj.generate(model, ids, 12, eos_token_id=False).tokens)
    assert out.stats["method"] == "repeat" and out.stats["verify_steps"] >= 1
    with pytest.raises(InputError, match=r"generate\(method='repeat'\): unknown options \['depth'\]"):
        sj.generate(model, ids, 4, method="repeat", depth=2)


def test_a_method_the_checkpoint_cannot_run_names_what_it_needs(tmp_path):
    from tests import qwen_helpers as H
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=41), seed=3)
    H.save_reference(ref, str(tmp_path))
    model = sj.load(str(tmp_path), dtype="float32")  # no MTP head, no draft tables
    with pytest.raises(InputError, match=r"method 'mtp' is not supported for this qwen3_5 model: it needs the MTP "
                                         r"head .*; supported: ar, ngram, layer-skip"):
        sj.generate(model, np.asarray([[1, 2, 3]]), 4, method="mtp")
    with pytest.raises(InputError, match=r"method 'das-wave' is not supported for this qwen3_5 model; supported"):
        sj.generate(model, np.asarray([[1, 2, 3]]), 4, method="das-wave")
