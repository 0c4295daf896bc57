"""One error type per kind of bad input, each with a message that says what, where and what was expected."""


class SpecdecError(ValueError):
    """Base class: bad input detected before any compute."""


class CheckpointError(SpecdecError):
    """A checkpoint folder, its config.json or its tensors are not what the model needs."""


class InputError(SpecdecError):
    """Bad arguments to a public call (token ids, lengths, methods, options)."""
