"""The package's promises about its own structure."""

import ast
import pathlib
import subprocess
import sys

import neuron_remat

ORDER = ["device", "models", "graph", "_jax_compat", "moe", "memory_model", "_trace", "_regex",
         "policies", "stack", "audit", "planner", "fit", "multihost", "plugin", "cli"]
PACKAGE = pathlib.Path(neuron_remat.__file__).parent


def _layer_files(name: str) -> list[pathlib.Path]:
    """The files of layer `name`: its module, or every module of its package (a package's
    submodules are the layer)."""
    module, package = PACKAGE / f"{name}.py", PACKAGE / name
    files = [module] if module.is_file() else sorted(package.rglob("*.py"))
    assert files, f"layer {name} has no module {module.name} and no package {name}/"
    return files


def _imports(path: pathlib.Path) -> set[str]:
    """neuron_remat layers `path` imports, at any depth (lazy imports count too); an import
    inside a layer's own package names that layer."""
    here = path.relative_to(PACKAGE).parts[:-1]  # () for a top-level module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = here[:len(here) - (node.level - 1)]
            if base:
                found.add(base[0])
            elif node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("neuron_remat."):
            found.add(node.module.split(".")[1])
    return found


def test_flow_is_one_way():
    for i, name in enumerate(ORDER):
        right = set(ORDER[i + 1:]) | ({"adapters"} if i < ORDER.index("plugin") else set())
        for path in _layer_files(name):
            bad = _imports(path) & right
            assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}, to its right"
    for adapter in (PACKAGE / "adapters").glob("*.py"):
        assert "cli" not in _imports(adapter), adapter.name


def test_a_package_layer_is_checked_module_by_module():
    files = _layer_files("device")
    assert PACKAGE / "device" / "detection.py" in files and len(files) > 1
    # `from .facts import` inside device/ is the layer itself; `from .._format` leaves it.
    assert {"device", "_format"} <= _imports(PACKAGE / "device" / "spec.py")


def test_import_touches_no_hardware():
    code = ("import neuron_remat, neuron_remat.plugin, neuron_remat.adapters.flax, "
            "neuron_remat.adapters.equinox, neuron_remat.adapters.axlearn, "
            "neuron_remat.adapters.maxtext\n"
            "from jax._src import xla_bridge\n"
            "import sys\n"
            "print(xla_bridge.backends_are_initialized(), neuron_remat.device._CACHE, "
            "'flax' in sys.modules, 'equinox' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "{}", "False", "False"]


def test_runtime_requirements_are_jax_and_numpy_only():
    from importlib.metadata import requires

    runtime = [r for r in requires("neuron-remat") if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("=")[0].strip() for r in runtime) == ["jax", "numpy"]
    for req in requires("neuron-remat"):
        assert "neuronx" not in req and "libneuronxla" not in req
