"""Train from the composed config: ``python train.py parallel=ddp trainer.devices=2 optim=adamw``."""

import hydra
from omegaconf import DictConfig

import disttrain.config  # noqa: F401  (registers the typed schema with Hydra's ConfigStore)
from disttrain.cli import train_from_cli


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the metric a sweeper optimises."""
    return train_from_cli(cfg)


if __name__ == "__main__":
    main()
