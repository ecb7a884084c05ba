"""The subpackages form floors: each imports only floors below its own, never a peer or a floor above.

Modules sit in the floor of their subpackage (`jaxrl_llm.rollout.sources` -> `rollout`); the
top-level modules (`errors`, `storage`, ...) are floors of their own. Every import counts, lazy and
TYPE_CHECKING ones included (tests/test_import_cycles.py builds the graph). Changing the order below
is a design decision: say why in the commit.
"""
from __future__ import annotations

from test_import_cycles import import_cycles, import_graph

# Bottom to top. Names on one floor are peers: they must not import each other.
FLOORS: list[tuple[str, ...]] = [
    ("errors", "shapes", "arrays", "storage", "sandbox", "cache_dirs"),  # leaves: jax / numpy / stdlib only
    ("platform",),     # chips, compile targets, lowering
    ("rewards",),      # rule scorers and reward managers: plain Python that users customise
    ("sharding",),     # meshes, partition rules, device moves
    ("models",),       # the decoder: configs, params, forward, LoRA, MoE
    ("losses", "hf"),  # log-prob heads, estimators, KL, losses | HF folders, GGUF, tokenizers
    ("checkpoint",),   # orbax stores
    ("sampler",),      # the paged engine and the static sampler
    ("data",),         # datasets, prompts, loaders
    ("batching", "agents", "bookkeeping"),  # micro-batches and packing | tools, envs | logging, guards
    ("config",),       # the config tree resolved into a frozen RunSpec
    ("rollout",),      # sampled, scored batches: sources, pipeline, partial, multi-turn
    ("roles",),        # actor, critic, reference, teacher, draft, judge, reward model
    ("planning",),     # memory plan, roofline: compiles the roles' programs
    ("entry",),        # what the entry points share: bad-input lines, --config.a.b=v flags
    ("sft",),          # supervised fine-tuning: the policy role with a cross-entropy update (and RL's SFT warm-up)
    ("dpo", "evaluation"),  # preference optimisation on the SFT run | offline generation and scoring
    ("trainer",),      # the Trainer: build a run, the RL step, the loop
    ("api",),          # the notebook API (`import jaxrl_llm as jrl`)
    ("(package)",),    # jaxrl_llm/__init__.py
]


def floor_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package)"


def subpackage_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importer floor, imported floor) -> the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = floor_of(module), floor_of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


def wrong_way(edges: dict[tuple[str, str], list[str]], floors: list[tuple[str, ...]]) -> list[str]:
    level = {name: i for i, names in enumerate(floors) for name in names}
    bad = []
    for (a, b), why in sorted(edges.items()):
        if a not in level or b not in level:
            bad.append(f"{a} -> {b}: a subpackage with no floor in tests/test_layering.py ({why[0]})")
        elif level[b] >= level[a]:
            bad.append(f"{a} -> {b} ({'a peer' if level[a] == level[b] else 'a floor above'}): {', '.join(why[:3])}")
    return bad


def test_checker_sees_a_backward_and_a_peer_arrow():
    floors = [("a",), ("b", "c"), ("d",)]
    edges = {("b", "a"): ["x"], ("d", "c"): ["y"], ("a", "d"): ["z"], ("b", "c"): ["w"]}
    assert [line.split(" (")[0] for line in wrong_way(edges, floors)] == ["a -> d", "b -> c"]
    assert import_cycles({"jaxrl_llm.a.x": {"jaxrl_llm.b.y"}, "jaxrl_llm.b.y": {"jaxrl_llm.a.x"}})


def test_every_subpackage_has_a_floor():
    named = {name for names in FLOORS for name in names}
    present = {floor_of(m) for m in import_graph()}
    assert present <= named, f"give these a floor: {sorted(present - named)}"


def test_imports_only_point_down():
    bad = wrong_way(subpackage_edges(import_graph()), FLOORS)
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_subpackage_cycle():
    graph = import_graph()
    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folded.setdefault(f"jaxrl_llm.{floor_of(module)}", set()).update(
            f"jaxrl_llm.{floor_of(t)}" for t in targets if floor_of(t) != floor_of(module))
    assert not import_cycles(folded)
