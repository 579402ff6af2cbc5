"""The one error type users see for bad input, and a setting's refusal of a parallel layout that becomes one."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A config value is wrong. The message is one line naming the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={spelled(value)} is invalid: {allowed}")

    def __reduce__(self) -> tuple[type, tuple[str, object, str]]:
        # rebuilt from its three parts, so it crosses process boundaries (a rank's error reaching the job)
        return type(self), (self.key, self.value, self.allowed)


@dataclass(frozen=True)
class Refusal:
    """A setting that refuses a parallel layout, said two ways: the ``ConfigError`` a run of that layout raises
    (``error``), and the few words with which ``parallel=auto`` reports the candidates it leaves out
    (``excludes``). A rule returns one (``disttrain.config.trainer_checks.compile_refusal``,
    ``disttrain.models.lora.base_layout_refusal``, gathered in ``disttrain.config.layout_refusals``); validation
    and the planner read the same value."""

    key: str
    """The refusing setting's key, e.g. ``trainer.compile_scope``."""
    value: object
    """Its value, e.g. ``model``."""
    instead: str
    """What the setting may be instead, e.g. ``blocks``: the error's message starts with it."""
    reason: str
    """The rest of the error's message: under which layout and why, and what runs the value."""
    excludes: str
    """The layouts the setting refuses and why, in a few words (``pipelines (stages are not compiled yet)``): one
    rule's text, the same for every layout it refuses."""

    @property
    def setting(self) -> str:
        """``key=value`` as a user writes it, e.g. ``trainer.compile_scope='model'``."""
        return f"{self.key}={spelled(self.value)}"

    def error(self) -> ConfigError:
        """The one-line error of a run whose own layout the setting refuses."""
        return ConfigError(self.key, self.value, f"{self.instead} {self.reason}")


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
