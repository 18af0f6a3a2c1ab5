"""The public API is ``workflows.__all__``: those names, imported from ``workflows``, are what
users are shown; every other module and name is internal and may change.

The docs' API reference lists the same names (tests/test_docs.py checks both directions).
"""

import importlib
import json
import pkgutil
import re
import types
from pathlib import Path

import workflows

REPO = Path(__file__).parents[1]

# Internal names the docs import on purpose, and why each may be shown. Anything else a page
# or a notebook imports from a submodule of workflows, or from workers, is a user relying on
# what may change: import it from ``workflows`` (making it public) or add it here with a reason.
SHOWN_INTERNALS = {
    # notebooks/train_on_dask.ipynb walks through what train() does by itself, step by step:
    "workflows.observe.monitoring.serve_training_page": "the notebook opens the Training page that "
    "dask-train run serves by itself",
    "workflows.data.preprocess.prepare_store": "the notebook preprocesses as a step of its own, as "
    "train() does before it trains",
    "workflows.runs.progress.EpochProgress": "the notebook's tqdm bar, the on_event handler "
    "dask-train run uses",
    "workers.data.open_store": "the notebook reads a few validation images back to show "
    "predictions; predict() is the public way to score a store",
    "workers.models.build_model": "the notebook rebuilds the trained model on the client to "
    "show predictions; predict() is the public way",
    # docs/guides/parallelism.md explains how a traced model is cut and planned:
    "workers.stage_cuts.cut_points": "the guide shows where a traced model may be cut; "
    "pipeline.split_points is the public way to cut it",
    "workers.stage_cuts.trace_stages": "the guide shows the cut stages equal the model; "
    "pipeline.split_points is the public way to cut it",
    "workflows.runs.planner.plan": "the guide calls the planner with build=; dask-train plan is "
    "the public way",
    "workflows.runs.resolved_run.resolve_run": "the planner is given the run as train() "
    "resolves it; dask-train plan is the public way",
    # docs/guides/reliability.md says how a measurement was taken:
    "workflows.cli.main": "the dask-train entry point, run with python -c to time a SIGTERM",
}

# ``from workflows.x import a, b`` or ``from workers.x import (a, b)``, in code or in prose.
IMPORT = re.compile(r"\bfrom ((?:workflows|workers)(?:\.\w+)*) import (\([^)]*\)|[\w, ]+)")


def test_every_public_name_is_the_object_not_a_submodule_of_the_same_name():
    # Importing a submodule sets the package's attribute of that name, which would shadow a
    # lazily imported function with the module (``from workflows import launch`` giving a
    # module): no public name may be a submodule's name.
    for module in pkgutil.iter_modules(workflows.__path__):
        importlib.import_module(f"workflows.{module.name}")
    for name in workflows.__all__:
        assert not isinstance(getattr(workflows, name), types.ModuleType), name
    assert callable(workflows.launch) and callable(workflows.predict)


def test_every_public_name_and_only_those_import_from_workflows():
    # __all__ is what the package says it exports and _HOMES what it can import: a name in
    # one and not the other is a public name that fails to import, or an unlisted export.
    assert sorted(workflows._HOMES) == sorted(workflows.__all__)
    assert list(workflows.__all__) == sorted(workflows.__all__)
    for name in workflows.__all__:
        assert getattr(workflows, name).__name__ == name, name


def _shown_sources() -> dict[str, str]:
    """What users read, by file: README.md and docs/ whole, the notebooks' code cells."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    shown = {str(page.relative_to(REPO)): page.read_text() for page in pages}
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        code = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
        shown[str(notebook.relative_to(REPO))] = "\n".join(code)
    return shown


def _imported_names(source: str) -> list[tuple[str, str]]:
    """Each ``(module, name)`` that ``source`` imports from workflows or workers."""
    found = []
    for module, names in IMPORT.findall(source):
        for imported in names.strip("()").split(","):
            if imported.split():  # "name" or "name as alias"
                found.append((module, imported.split()[0]))
    return found


def test_the_docs_and_notebooks_import_public_names_only():
    public = set(workflows.__all__)
    internal, shown = [], set()
    for where, source in _shown_sources().items():
        for module, name in _imported_names(source):
            if module == "workflows" and name in public:
                continue
            if f"{module}.{name}" in SHOWN_INTERNALS:
                shown.add(f"{module}.{name}")
                continue
            internal.append(f"{where}: from {module} import {name}")
    assert internal == [], "import these from workflows, or list them in SHOWN_INTERNALS"
    # An entry no page uses any more would let the next one in unexplained.
    assert sorted(set(SHOWN_INTERNALS) - shown) == []


def test_the_import_scan_finds_what_it_should():
    source = """
from workflows import launch, train
from workflows.jobs.launcher import (
    LaunchConfig,
    ProcessGroup as Group,
)
python -c "from workers.data import open_store; print(1)"
"""
    assert _imported_names(source) == [
        ("workflows", "launch"),
        ("workflows", "train"),
        ("workflows.jobs.launcher", "LaunchConfig"),
        ("workflows.jobs.launcher", "ProcessGroup"),
        ("workers.data", "open_store"),
    ]


def test_public_results_hold_public_types_only():
    # A field of a public result whose type is internal (LaunchResult.outcomes held
    # workers.rank_context.RankOutcome) hands users a type that may change under them.
    import dataclasses
    import typing

    public = {getattr(workflows, name) for name in workflows.__all__}
    # Known, and left to the issue that closes it (issue 61 names the leaks to close).
    known = {"TrainResult.store": "the store train() built: StoreManifest, not yet public"}
    leaks = []
    for name in workflows.__all__:
        result = getattr(workflows, name)
        if not (isinstance(result, type) and dataclasses.is_dataclass(result)):
            continue
        module = vars(importlib.import_module(result.__module__))
        for field in dataclasses.fields(result):
            if field.name.startswith("_"):
                continue
            try:
                named = [typing.get_type_hints(result, module)[field.name]]
            except NameError:  # a third-party type imported for type checkers only (optuna)
                named = []
            while named:
                hint = named.pop()
                named += typing.get_args(hint)
                home = getattr(hint, "__module__", "")
                internal = home.startswith(("workflows", "workers")) and hint not in public
                if isinstance(hint, type) and internal and f"{name}.{field.name}" not in known:
                    leaks.append(f"{name}.{field.name}: {home}.{hint.__qualname__}")
    assert not leaks, leaks
