"""What a ``graphtrim`` command imports: each command starts with the libraries it uses, not
those of the others. Checked in a fresh interpreter per command (as a user runs it), on
``sys.modules`` only, never on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

# libraries no graph command needs: orchestrators, registries, plotting, training, dataframes
HEAVY = {
    "airflow",
    "airflow_client",
    "boto3",
    "kfp",
    "matplotlib",
    "mlflow",
    "onnxscript",
    "pandas",
    "scipy",
    "torch",
}

_RUN = """
import json, sys
from graphtrim.cli.main import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
{after}
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""


def _run(argv: list[str], after: str = "") -> tuple[int, set[str], str]:
    """Run ``main(argv)`` in a fresh interpreter: exit code, every module it left in
    ``sys.modules``, its stdout before the last line."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN.format(argv=argv, after=after)],
        capture_output=True,
        text=True,
        check=True,
    )
    *printed, last = proc.stdout.strip().splitlines()
    doc = json.loads(last)
    return doc["code"], set(doc["modules"]), "\n".join(printed)


def _tops(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def _tiny_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        "tiny",
        [x],
        [y],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_top_level_help_imports_no_model_library_and_lists_the_adapters_commands():
    code, modules, out = _run(["--help"])
    assert code == 0
    loaded = _tops(modules)
    assert not (HEAVY | {"onnx", "onnx_ir", "numpy", "sympy", "onnxruntime"}) & loaded, sorted(
        loaded
    )
    # the commands of the entry point group are there all the same
    assert "kfp" in out and "trigger" in out


def test_optimize_help_imports_no_model_library():
    code, modules, out = _run(["optimize", "--help"])
    assert code == 0
    assert "--preset {" in out
    loaded = _tops(modules)
    # the choices of --preset and --target come from the modules' source
    assert not (HEAVY | {"onnx", "onnx_ir", "numpy", "sympy", "onnxruntime"}) & loaded, sorted(
        loaded
    )
    assert "graphtrim.graph.presets" not in modules
    # a command of the core leaves the adapters' commands unloaded
    assert "operators" not in loaded


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("graphtrim.graph.presets", "PRESETS"),
        ("graphtrim.graph.framework", "TARGETS"),
        ("graphtrim.quantize.config", "CALIBRATION_METHODS"),
    ],
)
def test_choices_read_from_the_source_are_the_modules_own(module, name):
    """The CLI reads these choices from the source without importing the module: the names
    must be the ones the module ends up with (read from the source, not just imported)."""
    import importlib

    from graphtrim.cli.argtypes import _source_literal

    assert _source_literal(module, name) == list(getattr(importlib.import_module(module), name))


def test_a_name_the_source_changes_after_its_literal_is_not_read_from_it(tmp_path, monkeypatch):
    from graphtrim.cli.argtypes import _source_literal, literal_names

    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "literal_ok": "A = {'x': 1, 'y': 2}\n",
        "literal_added": "A = {'x': 1}\nA['y'] = 2\n",
        "literal_updated": "A = {'x': 1}\nA.update(y=2)\n",
        "literal_rebound": "A = ('x',)\nA = A + ('y',)\n",
        "literal_computed": "A = tuple(n for n in 'xy')\n",
    }
    for mod, text in cases.items():
        (tmp_path / f"{mod}.py").write_text(text)
    assert _source_literal("literal_ok", "A") == ["x", "y"]
    for mod in ("literal_added", "literal_updated", "literal_rebound", "literal_computed"):
        assert _source_literal(mod, "A") is None, mod
        assert literal_names(mod, "A") == ["x", "y"], mod  # from the imported module


def test_optimize_imports_no_heavy_library_and_no_sympy(tmp_path):
    src = _tiny_model(tmp_path / "tiny.onnx")
    out = tmp_path / "out.onnx"
    code, modules, _ = _run(["optimize", str(src), "-o", str(out), "-q"])
    assert code == 0
    assert [n.op_type for n in onnx.load(out).graph.node] == ["Relu"]
    loaded = _tops(modules)
    assert "onnx_ir" in loaded  # the optimizer did run
    assert not HEAVY & loaded, sorted(HEAVY & loaded)
    # no verification asked for: onnxruntime is not needed; no symbolic arithmetic: nor sympy
    assert not {"onnxruntime", "sympy", "mpmath"} & loaded, sorted(loaded)
    assert "operators" not in loaded


# symbolic dim arithmetic in onnx_ir, printed as JSON: the same with and without the CLI first
_SYMBOLIC = """
import onnx_ir as ir, sympy
n = ir.SymbolicDim("N")
d = (n + 1) * 2 - ir.SymbolicDim("M")
results = [
    (n + 1).value,
    d.value,
    d.evaluate({"N": 3, "M": 5}),
    (ir.SymbolicDim("max(N, 2)") * 2).value,
    (ir.SymbolicDim("N") // 2).value,
    ir.SymbolicDim(sympy.Symbol("K") + 1).value,
    isinstance(d._expr, sympy.Expr),
    ir._core.sympy.Expr is sympy.Expr,
    type(sys.modules["sympy"]).__name__,
]
"""


@pytest.mark.parametrize("cli_first", [False, True])
def test_symbolic_dims_compute_as_with_sympy_imported_eagerly(tmp_path, cli_first):
    """After the CLI imported onnx_ir without sympy, symbolic dims compute exactly as in a
    plain ``import onnx_ir`` (sympy is imported on first use, the real package)."""
    src = _tiny_model(tmp_path / "tiny.onnx")
    argv = ["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "-q"] if cli_first else []
    prelude = (
        f"from graphtrim.cli.main import main\nassert main({argv!r}) == 0\n"
        "assert 'sympy' not in sys.modules\n"
        if cli_first
        else ""
    )
    code = f"import json, sys\n{prelude}{_SYMBOLIC}print(json.dumps(results))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == [
        "N + 1",
        "-M + 2*N + 2",
        3,
        "2*Max(2, N)",
        "floor(N/2)",
        "K + 1",
        True,
        True,
        "module",
    ]


def test_lazy_choices_check_values_and_show_in_help(capsys):
    from graphtrim.cli.main import build_parser
    from graphtrim.graph.framework import TARGETS
    from graphtrim.graph.presets import PRESETS

    parser = build_parser()
    args = parser.parse_args(["optimize", "a.onnx", "-o", "b.onnx", "--preset", "safe"])
    assert args.preset == "safe" and args.target == "portable"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["optimize", "a.onnx", "-o", "b.onnx", "--preset", "nope"])
    assert exc.value.code == 2
    expected = ", ".join(repr(p) for p in sorted(PRESETS))
    assert f"invalid choice: 'nope' (choose from {expected})" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["optimize", "--help"])
    shown = capsys.readouterr().out
    assert "{" + ",".join(sorted(PRESETS)) + "}" in shown
    assert "{" + ",".join(TARGETS) + "}" in shown


def test_a_quiet_command_called_as_a_function_gives_the_caller_its_state_back(monkeypatch):
    """``-q`` lowers loggers' levels, ignores warnings and sets MLflow's switches for its own
    run; ``main([...])`` called from Python restores them (a later caller's INFO logs reach it)."""
    import logging
    import warnings

    from graphtrim.cli.main import _process_state_restored
    from graphtrim.cli.pipeline_context import _quiet

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    named = logging.getLogger("graphtrim.triggers")
    before = (logging.getLogger().level, logging.getLogger("graphtrim").level, named.level)
    filters = list(warnings.filters)
    with _process_state_restored():
        _quiet()
        assert logging.getLogger("graphtrim").level == logging.WARNING
        assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
        assert warnings.filters != filters
    after = (logging.getLogger().level, logging.getLogger("graphtrim").level, named.level)
    assert after == before
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ
    assert warnings.filters == filters
