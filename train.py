"""Train from the composed config: ``python train.py parallel=ddp trainer.devices=2 optim=adamw``."""

import hydra
from omegaconf import DictConfig

from disttrain.config import register
from disttrain.launch.cli import main_with_one_line_errors, train_from_cli

register()  # the typed schema and resolvers, before Hydra composes

CONFIG_NAME = "train"
"""The run's config, ``conf/train.yaml``."""


@hydra.main(version_base="1.3", config_path="conf", config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the metric a sweeper optimises."""
    return train_from_cli(cfg)


if __name__ == "__main__":
    main_with_one_line_errors(main, config_name=CONFIG_NAME)
