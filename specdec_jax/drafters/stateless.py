"""The part of the drafter interface that drafters without state of their own share."""

from __future__ import annotations


class StatelessDrafter:
    """init and update of a drafter that keeps no state between steps (its proposals come from the history
    and the parameters alone); subclasses supply `name` and `propose`."""

    deterministic = True  # q is one-hot at the proposal

    def init(self, params, cfg, prompt, max_len, **_):
        return ()

    def update(self, drafter_state, **_):
        return drafter_state
