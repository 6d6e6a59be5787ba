"""The layering rules: the library reads passes only through the pipeline
and the typed results they publish; no pass knows the backend."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(package):
    folder = os.path.join(ROOT, package)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                yield name, ast.parse(f.read())


def test_the_library_imports_no_pass_module():
    for name, tree in modules("parallax_ng"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("transforms"), (name, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name == "transforms" or not alias.name.startswith(
                        "transforms."), (name, alias.name)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "transforms":
                assert node.attr == "pipeline_for", (name, node.attr)


def test_no_pass_branches_on_the_backend():
    for name, tree in modules("transforms"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr != "backend", name
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "horovod" not in node.value.lower(), name
