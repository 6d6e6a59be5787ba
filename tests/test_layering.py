"""The layering rules, read from the source: the library's subpackages
import only the layers below them, no import closes a cycle (imports
inside functions included), the library reads passes only through the
pipeline and the typed results they publish, and no pass knows the
backend."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lowest first: a module may import its own layer and the layers before it.
# "foundation" is the package's top-level modules but __init__, build.py,
# tf2.py, keras_fit.py, step_args.py and the entry point; the package
# itself, build.py (the one path from a graph to a Runner) and tf2.py,
# keras_fit.py and step_args.py (TF2 programs on that path) sit
# above the runtime and layer-to-layer, and the tools above everything.
LAYERS = ["foundation", "graph", "comm", "planning", "pipeline", "transforms", "runtime",
          "l2l", "parallax_ng", "tools"]
MAX_LINES = 450


def sources():
    """{module name: path} of every module in parallax_ng and transforms."""
    out = {}
    for top in ("parallax_ng", "transforms"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


MODULES = sources()


def tree(name):
    with open(MODULES[name]) as f:
        return ast.parse(f.read())


def imports(name):
    """The library modules `name` imports, anywhere in it (a `from package
    import module` counts as the module)."""
    is_package = MODULES[name].endswith("__init__.py")
    out = set()
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1])
                source = base + ("." + node.module if node.module else "")
            else:
                source = node.module
            subs = {f"{source}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs or ({source} & MODULES.keys())
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & MODULES.keys()
    return out - {name}


def layer(name):
    parts = name.split(".")
    if parts[0] == "transforms":
        return "transforms"
    if name in ("parallax_ng", "parallax_ng.build", "parallax_ng.tf2", "parallax_ng.keras_fit",
                "parallax_ng.step_args"):
        return "parallax_ng"
    if name == "parallax_ng.__main__":
        return "tools"
    if len(parts) == 2 and not MODULES[name].endswith("__init__.py"):
        return "foundation"
    return parts[1]


def test_every_module_has_a_layer():
    assert {layer(m) for m in MODULES} <= set(LAYERS)


def test_a_module_imports_only_its_layer_and_the_layers_below():
    wrong = [f"{m} ({layer(m)}) imports {t} ({layer(t)})"
             for m in MODULES for t in imports(m)
             if LAYERS.index(layer(t)) > LAYERS.index(layer(m))]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = {m: imports(m) for m in MODULES}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_every_subpackage_says_what_it_holds_and_may_import():
    for name, path in MODULES.items():
        if path.endswith("__init__.py") and name.startswith("parallax_ng."):
            doc = ast.get_docstring(tree(name)) or ""
            assert "May import" in doc, name


def test_only_the_command_line_and_the_launcher_end_the_process():
    """No SystemExit or sys.exit below the tools: the library raises its
    errors, and a task's end is the launcher's or the CLI's to decide; or a
    signal's sender's: runtime/preemption.py ends a process that got
    SIGTERM, at a step boundary after its checkpoint."""
    found = []
    for name in MODULES:
        if layer(name) == "tools" or name == "parallax_ng.runtime.preemption":
            continue
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Name) and node.id == "SystemExit" or \
                    isinstance(node, ast.Attribute) and node.attr == "exit" and \
                    isinstance(node.value, ast.Name) and node.value.id == "sys":
                found.append(f"{name}:{node.lineno}")
    assert not found, found


def test_no_module_is_over_the_line_limit():
    long = {}
    for name, path in MODULES.items():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[name] = n
    assert not long, long


def test_the_library_imports_no_pass_module():
    for name in MODULES:
        if layer(name) in ("transforms", "parallax_ng", "tools"):
            continue
        for t in imports(name):
            assert layer(t) != "transforms", (name, t)
    # the build reads the passes only through `pipeline_for`
    for node in ast.walk(tree("parallax_ng.build")):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "transforms":
            assert node.attr == "pipeline_for", node.attr


def test_no_pass_branches_on_the_backend():
    for name in MODULES:
        if layer(name) != "transforms":
            continue
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Attribute):
                assert node.attr != "backend", name
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "horovod" not in node.value.lower(), name
