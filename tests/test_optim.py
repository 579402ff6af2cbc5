"""Optimisers: paper-exact LAMB/LARS updates, parameter groups, config checks, schedules (one process)."""

from __future__ import annotations

import ast
import copy
import inspect
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from disttrain.errors import ConfigError
from disttrain.optim import (
    OPTIMIZERS,
    AdamWConfig,
    Lamb,
    LambConfig,
    Lars,
    LarsConfig,
    SchedulerConfig,
    SGDConfig,
    build_optimizer,
    build_scheduler,
    param_groups,
    torch_optims,
)
from disttrain.optim import lamb as lamb_module
from disttrain.optim import lars as lars_module
from disttrain.optim import muon as muon_module
from disttrain.optim import onebit_adam as onebit_adam_module
from disttrain.optim import scheduler as scheduler_module
from disttrain.optim import soap as soap_module

# ---------------------------------------------------------------------------------------------------
# A hand-checkable example: a 2x2 weight, a 2-vector bias and a 2x2 weight that starts at zero.
# ---------------------------------------------------------------------------------------------------

INIT = {
    "w": [[1.0, -2.0], [0.5, 3.0]],
    "b": [0.5, -1.0],
    "z": [[0.0, 0.0], [0.0, 0.0]],
}
GRADS = [  # one dict of gradients per step
    {"w": [[0.1, -0.2], [0.3, 0.4]], "b": [0.5, -0.25], "z": [[0.2, 0.0], [-0.1, 0.3]]},
    {"w": [[-0.3, 0.1], [0.2, -0.5]], "b": [0.1, 0.2], "z": [[0.0, 0.4], [0.1, -0.2]]},
    {"w": [[0.2, 0.2], [-0.1, 0.1]], "b": [-0.3, 0.05], "z": [[0.3, -0.1], [0.0, 0.1]]},
]


class Tiny(nn.Module):
    """The three parameters of the example, in float64."""

    def __init__(self) -> None:
        super().__init__()
        for name, value in INIT.items():
            self.register_parameter(name, nn.Parameter(torch.tensor(value, dtype=torch.float64)))


def run_optimizer(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """Apply the example's three steps of gradients; return the final parameters."""
    for grads in GRADS:
        for name, p in model.named_parameters():
            p.grad = torch.tensor(grads[name], dtype=torch.float64)
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def lamb_paper(lr, b1, b2, eps, wd, adapted, bias_correction=True, max_ratio=None):
    """LAMB, Algorithm 2 of You et al. (2019), transcribed per parameter; ``adapted``: names with decay
    and trust ratio (the others take the plain Adam step)."""
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in INIT.items()}
    m = {k: torch.zeros_like(v) for k, v in w.items()}
    v = {k: torch.zeros_like(x) for k, x in w.items()}
    for t, grads in enumerate(GRADS, start=1):
        for k in w:
            g = torch.tensor(grads[k], dtype=torch.float64)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat = m[k] / (1 - b1**t) if bias_correction else m[k]
            v_hat = v[k] / (1 - b2**t) if bias_correction else v[k]
            r = m_hat / (torch.sqrt(v_hat) + eps)
            if k in adapted:
                u = r + wd * w[k]
                w_norm = math.sqrt(sum(x * x for x in w[k].flatten().tolist()))
                u_norm = math.sqrt(sum(x * x for x in u.flatten().tolist()))
                ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                if max_ratio is not None:
                    ratio = min(ratio, max_ratio)
                w[k] = w[k] - lr * ratio * u
            else:
                w[k] = w[k] - lr * r
    return w


def lars_paper(lr, momentum, eta, wd, eps, adapted):
    """LARS, Algorithm 1 of You et al. (2017), transcribed per parameter; the parameters not in
    ``adapted`` take plain momentum SGD (local rate 1, no decay)."""
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in INIT.items()}
    buf = {k: torch.zeros_like(x) for k, x in w.items()}
    for grads in GRADS:
        for k in w:
            g = torch.tensor(grads[k], dtype=torch.float64)
            if k in adapted:
                w_norm = math.sqrt(sum(x * x for x in w[k].flatten().tolist()))
                g_norm = math.sqrt(sum(x * x for x in g.flatten().tolist()))
                local_lr = eta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
                buf[k] = momentum * buf[k] + lr * local_lr * (g + wd * w[k])
            else:
                buf[k] = momentum * buf[k] + lr * g
            w[k] = w[k] - buf[k]
    return w


@pytest.mark.parametrize(
    "exclude, bias_correction, max_ratio",
    [(True, True, None), (False, True, None), (True, False, None), (True, True, 0.5)],
)
def test_lamb_matches_paper(exclude, bias_correction, max_ratio):
    model = Tiny()
    cfg = LambConfig(lr=0.1, weight_decay=0.1, bias_correction=bias_correction, max_trust_ratio=max_ratio,
                     exclude_bias_and_norm=exclude)
    got = run_optimizer(build_optimizer(cfg, model), model)
    adapted = {"w", "z"} if exclude else {"w", "b", "z"}
    want = lamb_paper(0.1, 0.9, 0.999, 1e-6, 0.1, adapted, bias_correction, max_ratio)
    for k in INIT:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)


def test_lamb_first_step_by_hand():
    """Step 1 with bias correction: m_hat = g and v_hat = g^2, so r = g / (|g| + eps)."""
    model = Tiny()
    opt = Lamb(param_groups(model, 0.1, adapt=True), lr=0.1, eps=1e-6, weight_decay=0.1)
    for name, p in model.named_parameters():
        p.grad = torch.tensor(GRADS[0][name], dtype=torch.float64)
    opt.step()
    # Excluded bias: plain Adam step, no decay.
    assert model.b.tolist() == pytest.approx([0.5 - 0.1 * 0.5 / (0.5 + 1e-6), -1.0 + 0.1 * 0.25 / (0.25 + 1e-6)],
                                             abs=1e-15)
    # Zero weight: ||w|| = 0 gives ratio 1, and the decay term is 0.
    g = torch.tensor(GRADS[0]["z"], dtype=torch.float64)
    torch.testing.assert_close(model.z.detach(), -0.1 * g / (g.abs() + 1e-6), rtol=0, atol=1e-15)
    # Weight: u = r + 0.1 w, scaled to ||w|| (= sqrt(14.25)), times lr.
    w0 = torch.tensor(INIT["w"], dtype=torch.float64)
    gw = torch.tensor(GRADS[0]["w"], dtype=torch.float64)
    u = gw / (gw.abs() + 1e-6) + 0.1 * w0
    torch.testing.assert_close(model.w.detach(), w0 - 0.1 * math.sqrt(14.25) / u.norm() * u, rtol=0, atol=1e-15)


@pytest.mark.parametrize("exclude", [True, False])
def test_lars_matches_paper(exclude):
    model = Tiny()
    cfg = LarsConfig(lr=0.5, momentum=0.9, eta=0.01, weight_decay=0.05, exclude_bias_and_norm=exclude)
    got = run_optimizer(build_optimizer(cfg, model), model)
    adapted = {"w", "z"} if exclude else {"w", "b", "z"}
    want = lars_paper(0.5, 0.9, 0.01, 0.05, 1e-9, adapted)
    for k in INIT:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)


def test_lars_first_step_by_hand():
    """Step 1: v = lr * eta ||w|| / (||g|| + wd ||w||) * (g + wd w); excluded bias: v = lr g."""
    model = Tiny()
    opt = Lars(param_groups(model, 0.05, adapt=True), lr=0.5, eta=0.01, weight_decay=0.05, eps=0.0)
    for name, p in model.named_parameters():
        p.grad = torch.tensor(GRADS[0][name], dtype=torch.float64)
    opt.step()
    assert model.b.tolist() == pytest.approx([0.5 - 0.5 * 0.5, -1.0 + 0.5 * 0.25], abs=1e-15)
    w0 = torch.tensor(INIT["w"], dtype=torch.float64)
    gw = torch.tensor(GRADS[0]["w"], dtype=torch.float64)  # ||g|| = sqrt(0.30)
    local_lr = 0.01 * math.sqrt(14.25) / (math.sqrt(0.30) + 0.05 * math.sqrt(14.25))
    torch.testing.assert_close(model.w.detach(), w0 - 0.5 * local_lr * (gw + 0.05 * w0), rtol=0, atol=1e-15)
    # ||w|| = 0: local rate 1.
    torch.testing.assert_close(model.z.detach(), -0.5 * torch.tensor(GRADS[0]["z"], dtype=torch.float64))


@pytest.mark.parametrize("cls", [Lamb, Lars])
def test_state_dict_round_trip(cls):
    """Saved and reloaded state continues exactly like the uninterrupted optimiser."""
    a, b = Tiny(), Tiny()
    opt_a = cls(param_groups(a, 0.1, adapt=True), lr=0.1)
    opt_b = cls(param_groups(b, 0.1, adapt=True), lr=0.1)
    for name, p in a.named_parameters():
        p.grad = torch.tensor(GRADS[0][name], dtype=torch.float64)
    opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert all(isinstance(s["step"], torch.Tensor) for s in opt_b.state.values())
    for model, opt in ((a, opt_a), (b, opt_b)):
        for name, p in model.named_parameters():
            p.grad = torch.tensor(GRADS[1][name], dtype=torch.float64)
        opt.step()
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb)


# ---------------------------------------------------------------------------------------------------
# Parameter groups, config schemas and their validation.
# ---------------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


@pytest.mark.parametrize("cfg", [AdamWConfig(), SGDConfig(), LambConfig(), LarsConfig()], ids=lambda c: c.name)
def test_bias_and_norm_weights_get_no_decay(cfg):
    net = Net()
    opt = build_optimizer(cfg, net)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay_of == {
        id(net.emb.weight): cfg.weight_decay, id(net.lin.weight): cfg.weight_decay,
        id(net.lin.bias): 0.0, id(net.norm.weight): 0.0, id(net.norm.bias): 0.0,
    }
    if isinstance(opt, (Lamb, Lars)):
        adapt_of = {id(p): g["adapt"] for g in opt.param_groups for p in g["params"]}
        assert adapt_of[id(net.lin.weight)] and not adapt_of[id(net.lin.bias)]
    cfg.exclude_bias_and_norm = False
    groups = build_optimizer(cfg, net).param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == cfg.weight_decay and len(groups[0]["params"]) == 5


@pytest.mark.parametrize(
    "cfg, key",
    [
        (AdamWConfig(lr=-1), "optim.lr"),
        (AdamWConfig(lr=0), "optim.lr"),
        (AdamWConfig(betas=[0.9, 1.0]), "optim.betas"),
        (AdamWConfig(betas=[0.9]), "optim.betas"),
        (AdamWConfig(eps=0), "optim.eps"),
        (AdamWConfig(weight_decay=-0.1), "optim.weight_decay"),
        (SGDConfig(lr=-1), "optim.lr"),
        (SGDConfig(momentum=1.0), "optim.momentum"),
        (SGDConfig(momentum=-0.1), "optim.momentum"),
        (SGDConfig(momentum=0.0, nesterov=True), "optim.nesterov"),
        (SGDConfig(weight_decay=-1), "optim.weight_decay"),
        (LambConfig(lr=-1), "optim.lr"),
        (LambConfig(betas=[-0.1, 0.999]), "optim.betas"),
        (LambConfig(weight_decay=-1), "optim.weight_decay"),
        (LambConfig(max_trust_ratio=0), "optim.max_trust_ratio"),
        (LarsConfig(lr=0), "optim.lr"),
        (LarsConfig(momentum=1.5), "optim.momentum"),
        (LarsConfig(eta=0), "optim.eta"),
        (LarsConfig(weight_decay=-1), "optim.weight_decay"),
        (SchedulerConfig(name="linear"), "scheduler.name"),
        (SchedulerConfig(warmup_steps=-1), "scheduler.warmup_steps"),
        (SchedulerConfig(warmup_steps=10, warmup_fraction=0.1), "scheduler.warmup_fraction"),
        (SchedulerConfig(warmup_fraction=1.5), "scheduler.warmup_fraction"),
        (SchedulerConfig(min_lr_ratio=2.0), "scheduler.min_lr_ratio"),
    ],
)
def test_validation_names_the_key(cfg, key):
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.key == key and str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)


def test_defaults_validate_and_unknown_name():
    for cfg in (AdamWConfig(), SGDConfig(), LambConfig(), LarsConfig(), SchedulerConfig()):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"^optim.name='adam' is invalid"):
        OPTIMIZERS.get("adam")
    assert OPTIMIZERS.names() == ["adamw", "lamb", "lars", "muon", "onebit_adam", "sgd", "soap"]


@pytest.mark.parametrize("module", [torch_optims, lamb_module, lars_module, muon_module, onebit_adam_module,
                                    scheduler_module, soap_module])
def test_schemas_are_documented_omegaconf_dataclasses(module):
    """Every schema: first field ``name``, a docstring under every field, OmegaConf-compatible types."""
    tree = ast.parse(inspect.getsource(module))
    schemas = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")]
    assert schemas
    for node in schemas:
        body = node.body
        fields = [i for i, s in enumerate(body) if isinstance(s, ast.AnnAssign)]
        assert body[fields[0]].target.id == "name", node.name
        for i in fields:
            doc = body[i + 1]
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), (node.name, i)
            assert isinstance(doc.value.value, str) and doc.value.value, (node.name, body[i].target.id)
        schema = getattr(module, node.name)
        assert OmegaConf.to_object(OmegaConf.structured(schema)) == schema()


def test_registered_schemas_merge_from_yaml():
    node = OmegaConf.merge(OmegaConf.structured(LambConfig), OmegaConf.create({"lr": 0.002, "betas": [0.8, 0.9]}))
    cfg = OmegaConf.to_object(node)
    assert isinstance(cfg, LambConfig) and cfg.betas == [0.8, 0.9] and cfg.lr == 0.002


# ---------------------------------------------------------------------------------------------------
# Learning-rate schedule.
# ---------------------------------------------------------------------------------------------------


def lrs(cfg: SchedulerConfig, total: int, steps: int) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(cfg, opt, total)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_schedule_with_warmup():
    got = lrs(SchedulerConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1), total=14, steps=16)
    # Warm-up: 2 * (s + 1) / 4; then 0.1 + 0.9 * (1 + cos(pi * (s - 4) / 10)) / 2, times 2, flat after.
    assert got[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert got[4] == pytest.approx(2.0)
    assert got[9] == pytest.approx(2 * (0.1 + 0.9 * 0.5))  # halfway through the decay
    assert got[6] == pytest.approx(2 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.2))))
    assert got[14] == pytest.approx(0.2) and got[15] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(got[4:], got[5:], strict=False))


def test_warmup_fraction_and_constant():
    got = lrs(SchedulerConfig(name="constant", warmup_fraction=0.2), total=10, steps=6)
    assert got == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    assert lrs(SchedulerConfig(name="cosine"), total=4, steps=1) == pytest.approx([2.0])
    with pytest.raises(ConfigError, match="scheduler.warmup_steps"):
        lrs(SchedulerConfig(warmup_steps=20), total=10, steps=1)


def test_the_fused_kernel_is_taken_only_where_torch_runs_it(monkeypatch):
    from disttrain.optim import groups as groups_module
    from disttrain.optim.groups import kernel_options

    plain = [{"params": [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))]}]
    assert kernel_options(plain) == {"fused": True}
    assert kernel_options([{"params": [nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)]}]) == {}

    class FakeDTensor(nn.Parameter):  # stands in for a DTensor: only the type is looked at
        pass

    monkeypatch.setattr(groups_module, "is_dtensor", lambda t: isinstance(t, FakeDTensor))
    sharded = [{"params": [FakeDTensor(torch.zeros(2, 2))]}]
    mixed = [{"params": [FakeDTensor(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))]}]
    assert kernel_options(sharded) == {"fused": True}  # AdamW's fused op has a DTensor rule
    assert kernel_options(mixed) == {}  # one fused call cannot take both kinds


def test_built_optimisers_are_fused_on_a_cpu():
    from disttrain.optim import AdamWConfig, build_optimizer

    model = nn.Linear(3, 2)
    assert build_optimizer(AdamWConfig(), model).defaults["fused"] is True


def test_the_fused_kernel_can_be_switched_off_from_the_command_line(make_config):
    from disttrain.config.validation import validate
    from disttrain.optim import build_optimizer

    optim = validate(make_config(["optim.fused=false"])).train.optim
    assert optim.fused is False
    assert not build_optimizer(optim, nn.Linear(3, 2)).defaults["fused"]
