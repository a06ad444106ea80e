"""User-facing error types. The CLI turns each into a one-line message and a non-zero exit."""


class SoTError(Exception):
    """Base class for errors a user can act on."""


class ModelLoadError(SoTError):
    """The model path or name cannot be loaded as a decoder-only causal LM."""


class UnsupportedModelError(SoTError):
    """The model loads but cannot run through the engine (e.g. not decoder-only)."""


class PromptTooLongError(SoTError):
    """A prompt plus its generation budget does not fit the model's context."""


class DrafterCompatibilityError(SoTError):
    """A drafter checkpoint was trained for a different target model."""


class ConfigError(SoTError):
    """An invalid argument or option value."""
