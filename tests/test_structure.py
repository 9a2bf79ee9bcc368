"""The code's shape: data flows one way (prompts -> regenerate -> capture -> cache -> train -> export ->
evaluate -> results -> analysis -> paper), evaluation needs no Lightning, and nothing edits sys.path."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The stages in the order data flows through them: src/eaglelab/<folder>/ for each, then the modules at the top
# (the loop and the sweeps that run it, and the processes that run the loop). A module may import modules of its own
# folder and of folders listed before it, never one listed after.
STAGES = ["models", "core", "engine", "data", "train", "export", "evaluate", "results", "plan"]
NO_LIGHTNING = (
    "eaglelab.train.batches",
    "eaglelab.evaluate.held_out",
    "eaglelab.evaluate.drift",
    "eaglelab.export.eagle3",
    "eaglelab.evaluate.suites",
    "eaglelab.core.config",
    "eaglelab.models.drafter",
    "eaglelab.train.loss",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from eaglelab import variants`
    return found


def eaglelab_modules() -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / "src" / "eaglelab").rglob("*.py")}


def stage(module: str) -> int:
    """A module's place in the data flow: its folder's index in STAGES; the package and its top-level modules last."""
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES) else len(STAGES)


def test_every_folder_is_a_stage_in_the_data_flow():
    folders = {p.parent.name for p in (ROOT / "src" / "eaglelab").glob("*/__init__.py")}
    assert folders == set(STAGES), "a new folder of src/eaglelab/ takes its place in STAGES"


def test_no_module_reaches_back_up_the_data_flow():
    modules = eaglelab_modules()
    backwards = []
    for name, path in modules.items():
        for imported in imports(path):
            if imported in modules and imported != "eaglelab" and stage(imported) > stage(name):
                backwards.append(f"{name} imports {imported}")
    assert backwards == []


def test_no_import_circle():
    """Within a stage too: modules import each other one way (a circle hides which of them comes first)."""
    modules = eaglelab_modules()
    graph = {m: {i for i in imports(p) if i in modules and i != m and i != "eaglelab"} for m, p in modules.items()}
    done, on_path, circles = set(), [], []

    def visit(m):
        if m in on_path:
            circles.append(on_path[on_path.index(m) :] + [m])
            return
        if m in done:
            return
        on_path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert circles == []


def test_imports_inside_functions_are_of_optional_or_heavy_dependencies_only():
    """An eaglelab module imported inside a function hides an arrow of the map: each that stays says why."""
    allowed = {
        # `import eaglelab` registers the config resolvers (Hydra composes configs in processes that never train):
        # torch only when a run directory's time stamp is asked for
        ("eaglelab.core.resolvers", "eaglelab.core.ranks"),
        # Lightning (and W&B's logger) only when a run trains: evaluating a checkpoint never imports them
        ("eaglelab.pipeline", "eaglelab.train.fit"),
        ("eaglelab.pipeline", "eaglelab.results.tracking"),
    }
    modules = eaglelab_modules()
    inner = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.ImportFrom)
                        and sub.module
                        and sub.module.startswith("eaglelab")
                        and ((name, sub.module) not in allowed)
                    ):
                        inner.append(f"{name}:{sub.lineno} {sub.module}")
    assert inner == [], inner


def test_evaluation_needs_no_lightning():
    modules = eaglelab_modules()
    heavy = {
        name: sorted(
            i
            for i in imports(modules[name])
            if i.split(".")[0] in ("lightning", "pytorch_lightning")
            or i in ("eaglelab.train.ttt_module", "eaglelab.train.fit")
        )
        for name in NO_LIGHTNING
    }
    assert {k: v for k, v in heavy.items() if v} == {}


def test_no_sys_path_edits_outside_the_tests():
    """Everything imports as installed packages (eaglelab, analysis, benchmarks), from any directory."""
    files = [p for top in ("src", "analysis", "paper", "benchmarks", "scripts") for p in (ROOT / top).rglob("*.py")]
    edits = [
        str(p.relative_to(ROOT))
        for p in files
        if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()
    ]
    assert len(files) > 20 and edits == []


def test_the_data_stage_reads_in_short_steps():
    """The data stage's rooms (render -> entry -> engine jobs -> sink, and the stage around them) carry their
    settings in small objects (eaglelab.data.cache_entry: SetRequest, CaptureSettings, Entry): no function there needs a
    page or a long signature to follow (prepare_features was 197 lines and 23 parameters)."""
    rooms = ["stage", "render", "cache_entry", "shard_claims", "make_shards", "prepare_set"]
    long = []
    for room in rooms:
        tree = ast.parse((ROOT / "src" / "eaglelab" / "data" / f"{room}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                a = node.args
                is_method = bool(a.args) and a.args[0].arg == "self"
                params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - int(is_method)
                lines = node.end_lineno - node.lineno + 1
                if params > 6 or lines > 60:
                    long.append(f"{room}.{node.name}: {params} parameters, {lines} lines")
    assert long == [], long
