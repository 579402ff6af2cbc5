"""The task scores inside a run: a callback that scores ``eval.tasks`` at validations (every ``eval.every_n_steps``
steps), before training where the run scores its starting weights, and at the end of training, and logs them beside
the validation loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from disttrain.config.evaluation import EvalConfig

SAMPLES_FOLDER = "eval"
"""The run directory's folder of scored documents (``eval.write_samples``)."""


class TaskScores(pl.Callback):
    """Scores ``cfg.tasks`` with every rank of the run and logs them as ``eval/<task>/<metric>``.

    Lightning calls checkpoint callbacks after the others, so a validation's scores are in ``callback_metrics``
    when the checkpoint ranks the weights they describe (``checkpoint.monitor=eval/...``), and in the run's metrics
    (``results.json``) after fit.
    """

    def __init__(self, cfg: EvalConfig, tokenizer: str, run_dir: str, before_training: bool = False) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        """The run's ``data.tokenizer`` folder."""
        self.samples_dir = Path(run_dir) / SAMPLES_FOLDER
        self.before_training = before_training
        """Score the sanity validation's weights too (``trainer.validate_before_training``)."""
        self.scored: list[dict[str, Any]] = []
        """Each scoring of this process: its step and scores."""
        self._lm: Any = None
        self._manager: Any = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Score at a fit's validation whose step is a multiple of ``every_n_steps`` (the sanity validation where the
        starting weights are scored)."""
        if trainer.state.fn != TrainerFn.FITTING or (trainer.sanity_checking and not self.before_training):
            return
        every = self.cfg.every_n_steps
        if not trainer.sanity_checking and every and trainer.global_step % every:
            return
        self.score(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Score the final weights where the last step was not scored."""
        if not self.scored or self.scored[-1]["step"] != trainer.global_step:
            self.score(trainer, pl_module)

    def score(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Score the tasks on the weights of now (all ranks together), log and print them (rank 0), and keep them in
        ``callback_metrics``."""
        from disttrain.eval.scoring import score, write_samples

        step = trainer.global_step
        training = pl_module.training
        pl_module.eval()
        try:
            scores, samples = score(self._model(trainer, pl_module), self.cfg, self._tasks())
        finally:
            pl_module.train(training)
        trainer.callback_metrics.update({name: torch.tensor(value) for name, value in scores.items()})
        self.scored.append({"step": step, "scores": scores})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(scores, step=step)
            if samples:
                write_samples(self.samples_dir, step, samples)
            shown = {name: round(value, 4) for name, value in scores.items()}
            print(f"task scores at step {step}: {shown}", flush=True)
        return scores

    def _tasks(self) -> Any:
        if self._manager is None:
            from disttrain.config.evaluation import task_manager

            self._manager = task_manager(self.cfg)
        return self._manager

    def _model(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """The harness's model over the task's forward, built on first use (the network is laid out by then)."""
        if self._lm is None:
            from disttrain.eval.lm import ShardedLM, hf_model_of, load_tokenizer
            from disttrain.eval.scoring import quiet_harness

            hf_model = hf_model_of(pl_module.net)
            shares = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
            with quiet_harness():  # its warnings about a model passed as an object are what is meant here
                self._lm = ShardedLM(pl_module, hf_model, load_tokenizer(self.tokenizer, hf_model.config),
                                     self.cfg.batch_size, shares.get("rank", 0), shares.get("num_replicas", 1))
        return self._lm

    @property
    def result(self) -> dict[str, Any]:
        """The ``eval`` section of ``results.json``: the tasks and each scoring's step and scores."""
        return {"tasks": list(self.cfg.tasks), "scored": self.scored}
