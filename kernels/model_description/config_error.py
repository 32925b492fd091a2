"""The one error a model description raises."""


class ConfigError(ValueError):
    """A model's config.json is unreadable or describes an unsupported model."""
