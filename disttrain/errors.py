"""The one error type users see for bad input."""


class ConfigError(ValueError):
    """A config value is wrong. The message is one line naming the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is invalid: {allowed}")

    def __reduce__(self) -> tuple[type, tuple[str, object, str]]:
        # rebuilt from its three parts, so it crosses process boundaries (a rank's error reaching the job)
        return type(self), (self.key, self.value, self.allowed)
