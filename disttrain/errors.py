"""The one error type users see for bad input."""


class ConfigError(ValueError):
    """A config value is wrong. The message is one line naming the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={spelled(value)} is invalid: {allowed}")

    def __reduce__(self) -> tuple[type, tuple[str, object, str]]:
        # rebuilt from its three parts, so it crosses process boundaries (a rank's error reaching the job)
        return type(self), (self.key, self.value, self.allowed)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written; the one-line message says why (a full disk) and which checkpoint is the
    last good one. Here, not beside the other ways a run stops, because the checkpoint package raises it."""

    exit_code = 74
    """EX_IOERR: the job's exit status too (``disttrain.fault.config.SAVE_FAILED_EXIT``)."""


def spelled(value: object) -> str:
    """``value`` as a user writes it on the command line or in YAML: ``true``, ``null``, ``'name'``, ``[1, 2]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(spelled(item) for item in value) + "]"
    return repr(value)
