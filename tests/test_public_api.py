"""The package's public names are the functions and classes, whatever has been imported."""

import importlib
import pkgutil
import types

import workflows


def test_every_public_name_is_the_object_not_a_submodule_of_the_same_name():
    # Importing a submodule sets the package's attribute of that name, which would shadow a
    # lazily imported function with the module (``from workflows import launch`` giving a
    # module): no public name may be a submodule's name.
    for module in pkgutil.iter_modules(workflows.__path__):
        importlib.import_module(f"workflows.{module.name}")
    for name in workflows.__all__:
        assert not isinstance(getattr(workflows, name), types.ModuleType), name
    assert callable(workflows.launch) and callable(workflows.predict)
