"""A model the package has never seen, named by ``model._target_``, trains under every preset it qualifies
for, at parity with one process (the families and tolerances of ``test_parity``); so does ``model=llama``.

The decoder of ``tests/user_models.py`` declares its plan by methods (``Decoder``) or not at all
(``PlainDecoder``, whose plan is then given in config); a preset it does not qualify for is one line.
"""

from __future__ import annotations

import pytest

from disttrain.config import validate
from disttrain.errors import ConfigError
from tests.conftest import compose_config
from tests.test_parity import CLIP, FAMILIES, STEPS, check_against, run_summary
from tests.user_models import PLAN, UNITS

TEXT = ["data=pydocs", "data.block_size=32", "batch.global_size=8", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=2", "trainer.run_test=false", "scheduler.warmup_fraction=0.1", "logger=csv",
        "callbacks=none", f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
        "trainer.check_val_every_n_epoch=null", "optim=sgd", "optim.momentum=0", "optim.nesterov=false",
        "optim.lr=0.5", *FAMILIES["sgd+clip"]]
DECODER = ["model=custom", "model._target_=tests.user_models.Decoder", *TEXT]
PLAIN = ["model=custom", "model._target_=tests.user_models.PlainDecoder", *TEXT]
LLAMA = ["model=llama", "model.flavour=micro", *TEXT]
PIPE = ["parallel=pipeline"]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}
DECODER_LAYOUTS = {
    "ddp": (DECODER, ["parallel=ddp"], 2),
    "zero3": (DECODER, ["parallel=zero3"], 2),
    "tp": (DECODER, ["parallel=tp"], 2),
    "tp+sp": (DECODER, ["parallel=tp", "parallel.sequence_parallel=true"], 2),
    "tp plan in config": (PLAIN, ["parallel=tp", "parallel.sequence_parallel=true"], 2),
    "units in config": (PLAIN, [*PIPE, f"parallel.pipeline_units=[{','.join(UNITS)}]"], 2),
    **{f"pp-{name}": (DECODER, [*PIPE, f"parallel.pipeline.schedule={name}",
                                f"parallel.pipeline.stages_per_rank={spr}"], 2) for name, spr in SCHEDULES.items()},
    "dp_shard2xtp2": (DECODER, ["parallel=hybrid", "parallel.tp=2"], 4),
}
LLAMA_LAYOUTS = {
    "tp+sp": ["parallel=tp", "parallel.sequence_parallel=true"],
    "pp-1f1b": PIPE,
    "dp_shard2xtp2": ["parallel=hybrid", "parallel.tp=2"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    return {name: run_summary(tmp_path_factory.mktemp(name), base)
            for name, base in (("decoder", DECODER), ("llama", LLAMA))}


@pytest.mark.parametrize("layout", list(DECODER_LAYOUTS))
def test_user_model_matches_one_process(tmp_path, references, layout):
    base, overrides, ranks = DECODER_LAYOUTS[layout]
    # a plan whose keys hold dots and stars is easier to set on the composed config than on a command line
    updates = {"parallel.tp_plan": PLAN} if layout == "tp plan in config" else None
    got = run_summary(tmp_path / "run", [*base, *overrides, f"trainer.devices={ranks}"], updates)
    check_against(references["decoder"], got, clipped=True)


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_matches_one_process(tmp_path, references, layout):
    ranks = 4 if "xtp2" in layout else 2
    got = run_summary(tmp_path / "run", [*LLAMA, *LLAMA_LAYOUTS[layout], f"trainer.devices={ranks}"])
    check_against(references["llama"], got, clipped=True)


def test_third_party_factory_trains_sharded_as_replicated(tmp_path):
    # a BatchNorm model normalises each rank's micro-batch, so data parallelism (not one process) is the
    # reference: ZeRO-3 must equal DDP, and the exported weights give the logged validation loss
    base = ["model=custom", "model._target_=tests.user_models.small_resnet", "+model.in_channels=1",
            *[o for o in TEXT if not o.startswith(("data.", "data="))], "trainer.devices=2"]
    ddp = run_summary(tmp_path / "ddp", [*base, "parallel=ddp"])
    zero3 = run_summary(tmp_path / "zero3", [*base, "parallel=zero3"])
    assert min(ddp["norms"]) > CLIP
    check_against(ddp, zero3, clipped=True)


@pytest.mark.parametrize(("overrides", "message"), [
    ([*PLAIN, "parallel=tp", "trainer.devices=2"],
     "parallel.tp=2 is invalid: 1 for model tests.user_models.PlainDecoder: it declares no tp_plan()"),
    ([*PLAIN, *PIPE, "trainer.devices=2"],
     "parallel.pp=2 is invalid: 1 for model tests.user_models.PlainDecoder: it declares no pipeline_units()"),
    ([*DECODER, "parallel=tp", "trainer.devices=4"], "model.heads=2 is invalid: divisible by parallel.tp=4"),
    ([*LLAMA, "parallel=tp", "trainer.devices=4"], "model.n_kv_head=2 is invalid: divisible by parallel.tp=4"),
    ([*PLAIN, *PIPE, "trainer.devices=2", "parallel.pipeline_units=[embed,layer,head]"],
     "parallel.pipeline_units='layer' is invalid: names of submodules of PlainDecoder"),
    ([*DECODER, "+model.depth=1", *PIPE, "trainer.devices=2", "parallel.pipeline.stages_per_rank=3",
      "parallel.pipeline.schedule=interleaved_1f1b"], "6 stages for a model of 4 pipeline units"),
    (["model=custom", "data=pydocs"], "model._target_='???' is invalid: a value is required"),
])
def test_a_preset_the_model_does_not_qualify_for_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(overrides, tmp_path / "run"))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_model_that_cannot_be_built_on_meta_is_checked_on_the_cpu(tmp_path):
    run = validate(compose_config(["model=custom", "model._target_=tests.user_models.ReadsItsWeights",
                                   "parallel=ddp", "trainer.devices=2"], tmp_path / "run"))
    assert run.model.target == "tests.user_models.ReadsItsWeights"
