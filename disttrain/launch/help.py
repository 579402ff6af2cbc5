"""``python train.py --help``: the app's help, composed once.

Hydra's ``--help`` fills in every placeholder its help template may name before it reads the template; listing
the config groups for ``$APP_CONFIG_GROUPS`` and ``$HYDRA_CONFIG_GROUPS`` copies its whole config repository
once per group and option (about 140 copies, most of ``--help``'s time). The template in
``conf/train.yaml`` names neither list (``${config_groups:}`` draws the groups from ``conf/``), so this composes
the config once, as Hydra does, and fills in the one placeholder the template uses, ``$CONFIG``.
"""

from __future__ import annotations

import string

from omegaconf import OmegaConf, open_dict

HELP_FLAGS = ("--help", "-h")
"""Hydra's flags for the app's help."""


def help_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a command line that asks for the app's help and holds nothing else; None for any other
    (another Hydra flag beside it, such as ``--resolve`` or ``--config-name``, is left to Hydra)."""
    flags = [arg for arg in argv if arg.startswith("-")]
    if len(flags) != 1 or flags[0] not in HELP_FLAGS:
        return None
    return [arg for arg in argv if arg not in HELP_FLAGS]


def print_help(config_name: str, overrides: list[str]) -> bool:
    """Compose ``conf/<config_name>.yaml`` with ``overrides`` and print its ``hydra.help.template`` with the
    composed config (unresolved, without Hydra's own section) in place of ``$CONFIG``, as Hydra's help does;
    False, printing nothing, where the template names another of Hydra's placeholders (Hydra's help then runs).
    A mistake in ``overrides`` raises Hydra's own composition error."""
    from hydra import compose, initialize_config_dir

    from disttrain.config.schema import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    template = string.Template(cfg.hydra.help.template)
    if set(template.get_identifiers()) != {"CONFIG"}:
        return False
    with open_dict(cfg):
        del cfg["hydra"]
    print(template.substitute(CONFIG=OmegaConf.to_yaml(cfg)))
    return True
