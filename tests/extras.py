"""What a test needs beyond ``pip install -e '.[test]'``: the extras' modules (pyproject.toml's
[project.optional-dependencies]). A test that needs one skips where it is missing, naming the
extra that installs it; it never fails with an ImportError.

At module level, ``optuna = pytest.importorskip("optuna", reason=missing_reason("optuna"))``;
on one test, ``@needs_extra("mlflow")`` and the import inside the test.
tests/test_dependencies.py holds every test module to it.
"""

import importlib.util

import pytest

# The module of each extra that a test imports, and the extra that installs it.
EXTRA_OF = {
    "optuna": "sweep",
    "mlflow": "mlflow",
    "timm": "timm",
    "ipykernel": "notebook",
    "mkdocs": "docs",
}


def missing_reason(module: str) -> str:
    top = module.split(".")[0]
    extra = EXTRA_OF[top]
    return f"{top} is not installed (the {extra} extra): pip install 'dask-train[{extra}]'"


def installed(module: str) -> bool:
    """Whether the extra's module can be imported; finds it without importing it."""
    return importlib.util.find_spec(module.split(".")[0]) is not None


def needs_extra(*modules: str) -> pytest.MarkDecorator:
    """Skip the test where one of ``modules`` (each an extra's) is not installed."""
    missing = [module for module in modules if not installed(module)]
    return pytest.mark.skipif(
        bool(missing), reason=missing_reason(missing[0]) if missing else "all installed"
    )
