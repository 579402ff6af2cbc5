"""The shape of the package: no import cycles, and nothing outside the job side imports it.

Imports are read with ``ast`` from every module of ``disttrain``, those inside functions included: a deferred
import ties two modules as much as one at the top, it only hides the tie until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "disttrain"
JOB_SIDE = "disttrain.launch"
"""The job process's package (command line, job, fork server, supervisor): it may import any other package;
no other package may import it (a rank never reaches back into the process that started it)."""


def module_names() -> dict[str, Path]:
    """Every module of ``disttrain`` by its dotted name (a package by its ``__init__``)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``disttrain`` that module ``name`` imports, anywhere in its body."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import, from the package outwards
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # ``from package import module`` names a module, not the package
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph() -> nx.DiGraph:
    """``disttrain``'s modules and the imports between them."""
    modules = module_names()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in imports_of(name, path, modules))
    return graph


def test_no_module_takes_part_in_an_import_cycle():
    cycles = [sorted(part) for part in nx.strongly_connected_components(import_graph()) if len(part) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_the_packages_stand_in_layers():
    """No circle between ``disttrain``'s packages either: each imports only packages below it, so none runs back
    up into a package that depends on it."""
    packages = nx.DiGraph()
    for a, b in import_graph().edges:
        top_a, top_b = a.split(".")[:2], b.split(".")[:2]
        if top_a != top_b:
            packages.add_edge(".".join(top_a), ".".join(top_b), via=f"{a} -> {b}")
    circles = [sorted(part) for part in nx.strongly_connected_components(packages) if len(part) > 1]
    ties = [packages.edges[a, b]["via"] for part in circles for a in part for b in part if packages.has_edge(a, b)]
    assert not circles, f"packages in a circle: {circles}, tied by {ties}"


def test_nothing_outside_the_job_side_imports_it():
    def job_side(module: str) -> bool:
        return module == JOB_SIDE or module.startswith(JOB_SIDE + ".")

    upward = sorted((a, b) for a, b in import_graph().edges if job_side(b) and not job_side(a))
    assert not upward, f"imports into {JOB_SIDE} from outside it: {upward}"


def test_the_graph_sees_deferred_and_package_imports():
    """The walk finds an import inside a function and tells ``from package import module`` from a name."""
    graph = import_graph()
    assert graph.has_edge("disttrain.launch.cli", "disttrain.launch.job")  # deferred, inside train_from_cli
    assert graph.has_edge("disttrain.rank.run", "disttrain.rank.kinds")
    assert graph.has_edge("disttrain.rank.kinds", "disttrain.rank.kinds.federated")


SAFETENSORS_READER = "disttrain.safetensors_reader"
"""The one module that reads safetensors files; every other module reads through it."""
SAFETENSORS_READS = {"safe_open", "load_file", "load", "load_model"}
"""safetensors' functions that read a file (``safetensors`` and ``safetensors.torch``); its writers are free to use."""


def test_safetensors_files_are_read_in_one_module():
    """No module but the reader imports safetensors' readers (nor ``safetensors`` whole, whose readers it holds),
    so every read of a safetensors file refuses a bad one in the reader's one line (cut short by how many bytes, an
    index that is not JSON, a missing shard)."""
    modules = module_names()
    assert SAFETENSORS_READER in modules
    readers = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))) if name != SAFETENSORS_READER else ():
            whole = isinstance(node, ast.Import) and any(a.name.split(".")[0] == "safetensors" for a in node.names)
            reads = isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "safetensors" and any(
                alias.name in SAFETENSORS_READS for alias in node.names)
            if whole or reads:
                readers.append(f"{name}:{node.lineno}")
    assert not readers, f"safetensors read outside {SAFETENSORS_READER}: {readers}"


CONFIG_ERROR_WITHOUT_LIGHTNING = """
import sys
from hydra import compose, initialize_config_dir
from disttrain.config import register
from disttrain.config.validation import validate
from disttrain.errors import ConfigError
from disttrain.launch.cli import train_from_cli
from disttrain.launch.job import train

register()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    good = compose("train", overrides=["parallel=zero3", "trainer.devices=2", "model=gpt", "data=pydocs",
                                       f"run_dir={sys.argv[2]}"])
    bad = compose("train", overrides=["optim.lr=-1", f"run_dir={sys.argv[2]}"])
run = validate(good)
try:
    train(bad)
except ConfigError as err:
    print("error:", err)
print("lightning imported:", sorted({name.split(".")[0] for name in sys.modules} & {"lightning", "torchmetrics"}))
print("dynamo imported:", "torch._dynamo" in sys.modules)
print("DTensor imported:", "torch.distributed.tensor" in sys.modules)
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    hf = compose("train", overrides=["model=hf", "model.arch=qwen3", "+model.hidden_size=64",
                                     "+model.intermediate_size=128", "+model.num_hidden_layers=2",
                                     "+model.num_attention_heads=2", "+model.num_key_value_heads=1",
                                     "data=pydocs", f"run_dir={sys.argv[2]}"])
validate(hf)
print("torchao imported:", "torchao" in sys.modules)
"""


def test_the_job_process_validates_and_refuses_a_config_without_importing_lightning(tmp_path):
    """Importing Lightning takes seconds (torchmetrics imports transformers and scipy): the job process validates
    a run and prints a config error before it, and only a rank imports it. Nor does building the GPT on the meta
    device import ``torch._dynamo`` (1.7 s) for its normal fills (``disttrain.models.meta``), nor do the optimiser
    and clipping modules import DTensor (about 1 s) to ask whether a parameter is one (``optim.norms.is_dtensor``).
    Validating a ``model=hf`` run after it logs no optional library's import-time warning."""
    import subprocess
    import sys

    conf = ROOT.parent / "conf"
    done = subprocess.run([sys.executable, "-c", CONFIG_ERROR_WITHOUT_LIGHTNING, str(conf), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error: optim.lr=-1.0 is invalid: a positive number" in done.stdout
    assert "lightning imported: []" in done.stdout, done.stdout
    assert "dynamo imported: False" in done.stdout, done.stdout
    assert "DTensor imported: False" in done.stdout, done.stdout
    # transformers' model code imports torchao wherever it is installed, which logs a warning for each CUDA kernel
    # library a CPU torch cannot load and torch one per enum it registers: nothing the user can act on, held back by
    # ``disttrain.quiet_imports`` (the job's validation of a ``model=hf`` run is the first to import it)
    if "torchao imported: True" in done.stdout:
        noise = [line for line in done.stderr.splitlines() if "torchao" in line or "_pytree" in line]
        assert not noise, noise

