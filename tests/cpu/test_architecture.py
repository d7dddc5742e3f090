"""The package's promises about its own structure."""

import ast
import pathlib
import subprocess
import sys

import neuron_remat

ORDER = ["device", "models", "graph", "_jax_compat", "_analytic", "moe", "memory_model", "_jaxpr", "_trace",
         "_regex",
         "policies", "_maxtext_keys", "stack", "_audit", "_plan", "planner", "_compile", "_step", "_belief", "_search", "_mix", "_fit",
         "multihost", "plugin", "cli"]
PACKAGE = pathlib.Path(neuron_remat.__file__).parent


def _layer_files(name: str) -> list[pathlib.Path]:
    """The files of layer `name`: a module, or every module of a package (one layer)."""
    if (PACKAGE / name).is_dir():
        return sorted((PACKAGE / name).rglob("*.py"))
    return [PACKAGE / f"{name}.py"]


def _imports(path: pathlib.Path) -> set[str]:
    """The neuron_remat layers (top-level modules or packages) `path` imports, at any depth
    (lazy imports count too), relative imports resolved from `path`'s own package."""
    package = ("neuron_remat", *path.relative_to(PACKAGE).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = package[:len(package) - node.level + 1]
            assert base and base[0] == "neuron_remat", f"{path}: import above the package"
            mods = [(*base, *node.module.split("."))] if node.module else \
                [(*base, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [tuple((node.module or "").split("."))]
        elif isinstance(node, ast.Import):
            mods = [tuple(a.name.split(".")) for a in node.names]
        else:
            continue
        found.update(m[1] for m in mods if len(m) > 1 and m[0] == "neuron_remat")
    return found


def test_flow_is_one_way():
    assert (PACKAGE / "models").is_dir()  # a package is one layer, between device and graph
    assert ORDER.index("device") < ORDER.index("models") < ORDER.index("graph")
    for i, name in enumerate(ORDER):
        right = set(ORDER[i + 1:]) | ({"adapters"} if i < ORDER.index("plugin") else set())
        files = _layer_files(name)
        assert files and all(f.exists() for f in files), name
        for path in files:
            bad = _imports(path) & right
            assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}, to its right"
    for adapter in (PACKAGE / "adapters").glob("*.py"):
        assert "cli" not in _imports(adapter), adapter.name


def test_the_import_check_sees_package_layers():
    # The check above must see through a package: a submodule's `from ..graph import x`
    # is an import of the graph layer, `from .config import y` one of its own package.
    sub = PACKAGE / "models" / "config.py"
    assert "device" in _imports(PACKAGE / "models" / "tags.py")
    assert _imports(sub) <= {"models", "device"}, _imports(sub)
    assert "models" in _imports(PACKAGE / "graph.py")


FIXTURES = pathlib.Path(__file__).resolve().parent  # tests/cpu: reference.py, zoo.py, ...


def _all_imports(path: pathlib.Path) -> set[str]:
    """Every module name `path` imports, absolute or relative (its first component)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add((node.module or "").split(".")[0])
            elif node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
    return found


def test_test_fixtures_stay_out_of_the_package():
    fixtures = {p.stem for p in FIXTURES.glob("*.py")
                if not p.name.startswith(("test_", "conftest"))}
    assert {"reference", "reference_moe", "small_layer", "zoo"} <= fixtures
    for path in PACKAGE.rglob("*.py"):
        bad = _all_imports(path) & (fixtures | {"tests"})
        assert not bad, f"{path.relative_to(PACKAGE)} imports test fixtures {sorted(bad)}"
    assert not list(PACKAGE.rglob("reference*.py")), "a reference layer in the package"
    # What an install ships: find_packages of setup.cfg, and no module named reference*.
    code = ("import importlib.util, neuron_remat\n"
            "print([n for n in ('neuron_remat.reference', 'neuron_remat.reference_moe', "
            "'neuron_remat.testing') if importlib.util.find_spec(n) is not None])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent).stdout.split()
    assert out == ["[]"]


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


def test_one_analytic_builder():
    # Dense, MoE and MLA layers are all built by `_analytic`: the modules that plan with
    # described layers construct no graph values or ops of their own.
    for name in ("memory_model", "moe"):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        built = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name) and node.func.id in ("Op", "Value")}
        assert not built, f"{name}.py builds {sorted(built)} itself"
    tree = ast.parse((PACKAGE / "_analytic.py").read_text())
    assert {"Op", "Value"} <= {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
                               and isinstance(n.func, ast.Name)}
