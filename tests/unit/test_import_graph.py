"""The package's import graph has no cycle, counting imports inside functions too: a cycle
hidden in a function body still means two modules that cannot be understood apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "launcher" / "rlbatch"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the rlbatch modules it imports (anywhere in its body)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a list of modules (first == last), or [] if there is none."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_megatron_is_imported_only_by_the_engine():
    """megatron-core's names stay behind rlbatch.engine (and the one module that reduces across
    ranks, which reads megatron's process groups; megatron's own inference engine is
    engine/dynamic_inference.py): the rest speaks rlbatch's own terms."""
    allowed = ("rlbatch/engine/", "rlbatch/distributed.py")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "megatron" or n.startswith("megatron.") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def _imports_of(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield node.lineno, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, [node.module]


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        # the engine runs the model's forwards: it knows token ids, not samples, rollouts,
        # loops, environments or evaluations
        (
            "engine",
            ("rlbatch.grpo", "rlbatch.rollout", "rlbatch.train", "rlbatch.env", "rlbatch.eval"),
        ),
        # config is the ground floor: it never reaches up into the engine
        ("config", ("rlbatch.engine",)),
        # a rollout consumes the rollout protocol (requests, policy snapshots, the prompt
        # schedule): it never reaches up into the training loop
        ("rollout", ("rlbatch.train",)),
    ],
)
def test_layers_import_only_downwards(layer, forbidden):
    offenders = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for lineno, names in _imports_of(path):
            if any(n == f or n.startswith(f + ".") for n in names for f in forbidden):
                offenders.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{lineno}")
    assert offenders == []


def test_the_layer_rule_catches_an_upward_import(tmp_path):
    """The rule reads imports inside function bodies too (where the engine's lazy imports live)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rlbatch.rollout.sampling import sample_tokens\n")
    assert list(_imports_of(module)) == [(2, ["rlbatch.rollout.sampling"])]


def test_generation_code_lives_in_the_rollout_package():
    """Rollout backends, sampling and the decode loops are one package; the engine keeps the
    model's forwards (the KV-cache decoder included) and nothing that makes samples. The package
    shows its parts: the engines, the rollout servers, the agent endpoint."""
    rollout = {p.relative_to(PACKAGE / "rollout").with_suffix("").as_posix() for p in (PACKAGE / "rollout").rglob("*.py")}  # fmt: skip
    assert {"engines/builtin", "engines/megatron_dynamic", "engines/vllm_engine"} <= rollout
    assert {"servers/backend", "servers/sync", "servers/transfer", "agent/endpoint"} <= rollout
    assert not any(p.startswith("server_") for p in rollout)  # one subpackage, not a prefix
    assert {
        "protocol",
        "sampling",
        "weights",
    } <= rollout
    assert {"multiturn", "partial", "streaming", "generation", "generation_worker"} <= rollout
    for old in (
        "grpo/rollout",
        "grpo/sampling",
        "grpo/partial",
        "grpo/multiturn",
        "train/generation",
        "train/streaming",
        "engine/dynamic_rollout",
    ):
        assert not (PACKAGE / f"{old}.py").exists(), old
