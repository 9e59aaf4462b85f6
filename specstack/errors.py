"""User-facing errors: each names what was wrong and what to do about it.

The CLI prints these without a traceback; anything else is a bug.
"""


class SpecstackError(Exception):
    """Base class for errors caused by input, configuration or environment."""


class ModelLoadError(SpecstackError):
    """A model file is missing, not GGUF, corrupt, or could not be loaded."""


class VocabMismatchError(SpecstackError):
    """Draft and target vocabularies differ, so draft token ids mean other things."""


class ContextOverflowError(SpecstackError):
    """The prompt (plus at least one new token) does not fit in the context."""


class KVPoolFullError(ContextOverflowError):
    """The KV pool the slots share (-kvu) has no free cells for a call: nothing was placed.  The engine keeps
    steps within the pool, so this is a guard, never the way a generation ends."""


class InvalidParameterError(SpecstackError, ValueError):
    """A generation or configuration parameter is out of range."""


class UnsupportedModelError(SpecstackError):
    """The model cannot do what was asked (e.g. rollback on a recurrent model)."""
