"""``parallel=auto`` under the settings that refuse layouts besides the compile settings
(``tests/test_plan_compile.py``) and an nf4 LoRA base (``tests/test_qlora.py``): a gradient codec (``comm``),
1-bit Adam and torchft's replica groups. The planner weighs only the layouts
``disttrain.config.layout_refusals.LayoutRefusals`` allows, the rule a run's own layout is checked by, so where only
refused layouts fit the error names the setting, not the layout auto chose. Config validation only: no rank
starts."""

from __future__ import annotations

import pytest

from disttrain.config.validation import validate
from disttrain.errors import ConfigError

GPT_ON_TWO_H100_IN_20_MB = ["parallel=auto", "mode=plan", "model=gpt", "model.flavour=micro", "data=pydocs",
                            "data.block_size=32", "model.n_layer=2", "model.tie_weights=false", "model.n_embd=256",
                            "trainer.devices=2", "batch.global_size=4", "plan.profile=h100_sxm",
                            "plan.memory_gb=0.02"]
"""A GPT of width 256 whose AdamW state outgrows 20 MB per rank unless tensor parallelism or a pipeline splits its
weights over the 2 ranks (ZeRO-3 gathers a whole layer and keeps more than 20 MB)."""


@pytest.mark.parametrize(("setting", "named"), [
    ("comm=powersgd", r"comm='powersgd' is invalid: none with parallel=auto on 2 rank\(s\) of h100_sxm with 20 MB "
                      r"per device: it refuses layouts without data-parallel ranks \(nothing to exchange\), and only "
                      r"those fit \(the best: tp=2 micro=4x1\)"),
    ("optim=onebit_adam", r"optim='onebit_adam' is invalid: another optimiser with parallel=auto on 2 rank\(s\) of "
                          r"h100_sxm with 20 MB per device: it refuses layouts other than DDP \(1-bit Adam exchanges "
                          r"its momentum over DDP's ranks\), and only those fit \(the best: tp=2 micro=4x1\)"),
    ("fault_tolerance.engine=torchft", r"fault_tolerance.engine='torchft' is invalid: restart with parallel=auto on 2 "
                                       r"rank\(s\) of h100_sxm with 20 MB per device: it refuses layouts of fewer "
                                       r"than 2 replicas \(replica groups are the replicas of parallel.dp_replicate\), "
                                       r"among them the best layout that fits \(tp=2 micro=4x1\); the others that fit "
                                       r"are refused by fault_tolerance.engine='torchft': pipelines \(pipeline stages "
                                       r"step by hand\)"),
])
def test_where_only_layouts_a_setting_refuses_fit_the_setting_is_named(make_config, setting, named) -> None:
    with pytest.raises(ConfigError, match=rf"^{named}$"):
        validate(make_config([*GPT_ON_TWO_H100_IN_20_MB, setting]))


def test_without_such_a_setting_the_same_plan_takes_tensor_parallelism(make_config) -> None:
    """The premise of the test above: nothing else refuses ``tp=2`` there."""
    assert validate(make_config(GPT_ON_TWO_H100_IN_20_MB)).layout.tp == 2
