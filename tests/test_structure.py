"""The code's shape: data flows one way (prompts -> regenerate -> capture -> cache -> train -> export ->
evaluate -> results -> analysis -> paper), evaluation needs no Lightning, and nothing edits sys.path."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every eaglelab module's place in the data flow. A module may import only modules of its own rank or below;
# a new module must be placed here (the test says so).
RANK = {
    # 0: foundations every stage uses — errors, file writes, the variants table, the drafter (the method),
    # the typed configs, the vLLM engine runner, a run directory's identity
    "eaglelab": 0,
    "eaglelab.errors": 0,
    "eaglelab.io": 0,
    "eaglelab.preemption": 0,
    "eaglelab.variants": 0,
    "eaglelab.acceptance": 0,
    "eaglelab.drafter": 0,
    "eaglelab.draft_loss": 0,  # the TTT loss over the drafter's head (training computes it, the memory check sizes it)
    "eaglelab.config": 0,
    "eaglelab.vllm_engine": 0,
    "eaglelab.serving": 0,  # decode speed as served, in the engine process (vLLM's server and benchmark)
    "eaglelab.rundir": 0,
    "eaglelab.strict_device": 0,  # a test mode: tensor factories in eaglelab name their device
    "eaglelab.devices": 0,  # the process's CUDA device and an engine's share of it; a CPU step's freed memory kept
    "eaglelab.ranks": 0,  # who this process is in a trial, and starting the ranks nobody else started
    # 1: prompts
    "eaglelab.data": 1,
    "eaglelab.data.prompts": 1,
    "eaglelab.data.templates": 1,
    "eaglelab.data.long_context": 1,
    "eaglelab.data.chat_prompts": 1,
    "eaglelab.data.turns": 1,  # a conversation's rounds and its assistant turns' spans
    # 2: the target, regenerate, capture, cache, and the limits a run's sizes are checked against
    "eaglelab.targets": 2,
    "eaglelab.limits": 2,
    "eaglelab.data.regenerate": 2,
    "eaglelab.data.capture": 2,
    "eaglelab.data.store": 2,
    "eaglelab.data.render": 2,  # conversations -> ids in the target's template (the data stage's first step)
    "eaglelab.data.entry": 2,  # which cache entry a prompt set is read from or prepared into (its settings, its keys)
    "eaglelab.data.shards": 2,  # who makes which shard of an entry, and whether it fits on disk
    "eaglelab.data.jobs": 2,  # the engine jobs: regenerate and capture a claimed group of shards
    "eaglelab.data.prepare": 2,  # one prompt set: render -> entry -> engine jobs -> sink
    "eaglelab.data.vocab": 2,
    "eaglelab.data.self_chat": 2,  # prompts the target writes: they need the target
    "eaglelab.data.vllm_capture": 2,  # the capture engine's process (vLLM's hidden-states connector)
    "eaglelab.data.stage": 2,  # the data stage: sources -> prompts -> engine -> store
    "eaglelab.data.stream": 2,  # streamed states: the store, its readers, the supervised engine (features=stream)
    # 3: train
    "eaglelab.batches": 3,
    "eaglelab.training": 3,
    "eaglelab.trainer": 3,
    "eaglelab.streamed": 3,  # the trainers' side of a stream: its plan, positioned samplers, its life around fit
    # 4: export
    "eaglelab.export": 4,
    "eaglelab.speculators_format": 4,  # drafters in speculators' format (read and written beside vLLM's Eagle3 one)
    # 5: evaluate (and its per-run figures)
    "eaglelab.evaluate": 5,
    "eaglelab.drift": 5,
    "eaglelab.suites": 5,
    "eaglelab.plots": 5,
    "eaglelab.spread": 5,  # the evaluation's engine jobs dealt to a trial's ranks
    # 6: results (W&B)
    "eaglelab.tracking": 6,
    "eaglelab.summary": 6,  # what a run found, read from its results: the lines a run and a sweep end with
    # 7: the loop and the sweeps that run it
    "eaglelab.pipeline": 7,
    "eaglelab.sweeps": 7,
    "eaglelab.rank_helper": 7,  # a rank eaglelab.ranks started: it runs the loop
    "eaglelab.slurm_entry": 7,  # a Slurm job's interpreter, in front of submitit (imports nothing of eaglelab)
    "eaglelab.evaluation_job": 7,  # a trained trial's evaluation as a Slurm job of its own (it runs the loop)
}
NO_LIGHTNING = (
    "eaglelab.batches",
    "eaglelab.evaluate",
    "eaglelab.drift",
    "eaglelab.export",
    "eaglelab.suites",
    "eaglelab.config",
    "eaglelab.drafter",
    "eaglelab.draft_loss",
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


def test_every_module_has_a_place_in_the_data_flow():
    assert sorted(set(eaglelab_modules()) - set(RANK)) == [], "place the new module in RANK"


def test_no_module_reaches_back_up_the_data_flow():
    backwards = []
    for name, path in eaglelab_modules().items():
        for imported in imports(path):
            if imported in RANK and RANK[imported] > RANK[name]:
                backwards.append(f"{name} (rank {RANK[name]}) imports {imported} (rank {RANK[imported]})")
    assert backwards == []


def test_evaluation_needs_no_lightning():
    modules = eaglelab_modules()
    heavy = {
        name: sorted(
            i
            for i in imports(modules[name])
            if i.split(".")[0] in ("lightning", "pytorch_lightning") or i in ("eaglelab.training", "eaglelab.trainer")
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
    settings in small objects (eaglelab.data.entry: SetRequest, CaptureSettings, Entry): no function there needs a
    page or a long signature to follow (prepare_features was 197 lines and 23 parameters)."""
    rooms = ["stage", "render", "entry", "shards", "jobs", "prepare"]
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
