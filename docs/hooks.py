"""Build-time generation of the documentation's reference and benchmark sections (an MkDocs
hook, named in ``mkdocs.yml``).

A page holds a marker where generated content goes, and :func:`on_page_markdown` replaces it:

- ``<!-- generated: cli -->``: every ``graphtrim`` command from its argparse parser;
- ``<!-- generated: run-parameters -->``: the run-parameter table (``graphtrim.run_params``),
  from which the CLI, the DAGs, the Kubeflow pipeline and the config hash take their parameters;
- ``<!-- generated: helm-values -->``: the chart's values with their comments and schema types;
- ``<!-- generated: timeouts -->``: each task's default ``execution_timeout``;
- ``<!-- generated: passes -->``, ``rules``, ``variants``: the optimizer's passes and presets,
  every rewrite rule, and the variant table; ``tune-space``: the settings search's knobs;
- ``<!-- generated: faults -->``: the fault suite's outcome table (``make faults``);
- ``<!-- generated: layers -->``, ``package-map``: the import layers (from the test that enforces
  them) and the folder of each package; ``contributing-adding``: CONTRIBUTING.md's recipes;
- ``<!-- bench-results: NAME -->``: a benchmark's published results (``bench.pages``).

Nothing these sections show is typed by hand, so a flag, a parameter or a value added in code
appears on the site at the next build, and a page that names one that went away fails
``tests/test_docs.py``. Before the build, the package is linked under ``build/docs-tree`` as it
installs (``graphtrim/`` with ``airflow/`` and ``kubeflow/`` inside) for mkdocstrings, which maps
module names to folders one to one.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ and tests/ are read from the checkout
    sys.path.insert(0, str(ROOT))

# a marker alone on its line; what replaces it keeps its indent (inside an admonition, say)
MARKER = re.compile(r"^([ \t]*)<!--\s*(generated|bench-results):\s*([\w-]+)\s*-->[ \t]*$", re.M)


# ---------------------------------------------------------------- the command line


def commands(
    parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command and sub-command: ``(("pipeline", "run"), its parser, its one-line help)``,
    depth first, in the order ``--help`` lists them."""
    if parser is None:
        from graphtrim.cli import build_parser

        parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, helps.get(name, "")
                yield from commands(sub, (*path, name))


_SPECIAL = re.compile(r"([\\\[\]*_|])")


def _cell(text: str) -> str:
    """Free text (help, math, comments) as one table cell: one line, and Markdown's special
    characters escaped outside code spans, so ``x[i]*2`` or ``<name>`` show as written."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = _SPECIAL.sub(r"\\\1", parts[i]).replace("<", "&lt;")
    return "`".join(parts)


def _code(text: str) -> str:
    """Text as one inline code span in a table cell."""
    return "`" + " ".join(text.split()).replace("`", "'") + "`"


def _option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs != 0:
            names += " " + formatter._format_args(action, action.dest.upper())
    else:
        names = formatter._metavar_formatter(action, action.dest)(1)[0]
    help_text = formatter._expand_help(action) if action.help else ""
    if action.choices and action.metavar is not None:  # else the usage lists them
        help_text += " (choices: " + ", ".join(f"`{c}`" for c in action.choices) + ")"
    return f"| {_code(names)} | {_cell(help_text)} |"


def cli_reference() -> str:
    """The reference of every ``graphtrim`` command, from the parser itself."""
    from graphtrim.cli import build_parser

    root = build_parser()
    out = [
        "Generated from the parsers at build time. `graphtrim COMMAND --help` prints the same.",
        "",
        "```text",
        root.format_usage().strip(),
        "```",
        "",
    ]
    for path, sub, summary in commands(root):
        name = " ".join(("graphtrim", *path))
        out += [f"## `{name}`", ""]
        if summary:
            out += [_cell(summary[0].upper() + summary[1:]), ""]
        description = (sub.description or "").strip()
        if description and description != summary:
            out += [description, ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        rows = [
            _option_row(sub, a)
            for a in sub._actions
            if a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        if rows:
            out += ["| argument | meaning |", "|---|---|", *rows, ""]
        if sub.epilog:
            out += [sub.epilog.strip(), ""]
    return "\n".join(out)


# ---------------------------------------------------------------- run parameters


_SURFACE_NAMES = {"cli": "`graphtrim pipeline`", "dag": "DAGs", "kfp": "Kubeflow"}
_HASHED = {"yes": "yes", "when-set": "when set", "no": "no"}


def _default_text(param: Any) -> str:
    from graphtrim.run_params import REQUIRED, Names

    if param.default is REQUIRED:
        return f"required (CLI: `${param.env}`)" if param.env else "required"
    if isinstance(param.default, Names):
        return _code(", ".join(param.default.load()))
    return "none" if param.default is None else _code(repr(param.default))


def _choices_text(param: Any) -> str:
    from graphtrim.run_params import Names

    if param.choices is None:
        return ""
    if isinstance(param.choices, Names):
        return _code(", ".join(param.choices.load()))
    return _code(", ".join(param.choices))


def run_parameters() -> str:
    """The run-parameter table (``graphtrim.run_params``): each parameter, its type, default,
    choices, whether it enters the config hash, and the surfaces that take it."""
    from graphtrim.run_params import RUN_PARAMS, SURFACES

    out = [
        "| parameter | option | type | default | choices | config hash | taken by | meaning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in RUN_PARAMS:
        taken = ", ".join(_SURFACE_NAMES[s] for s in SURFACES if s in p.surfaces)
        option = f"`{p.flag}`" if "cli" in p.surfaces else ""
        out.append(
            f"| `{p.name}` | {option} | {p.type} | {_default_text(p)} | {_choices_text(p)} "
            f"| {_HASHED[p.hashed]} | {taken} | {_cell(p.help)} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------- Helm values


def _walk_values(lines: list[str]) -> Iterator[tuple[str, str, str]]:
    """``(dotted key, value as written, the comment above it)`` for every key of a values
    file written in block style (flow mappings such as ``{cpu: 1}`` stay one value)."""
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    key_line = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(?:\s+(.*))?$")
    for raw in lines:
        stripped = raw.strip()
        if not stripped:
            comment = []
            continue
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        m = key_line.match(raw.rstrip())
        if not m:
            comment = []
            continue
        indent, key, value = len(m.group(1)), m.group(2), (m.group(3) or "").strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([k for _, k in stack] + [key])
        yield dotted, value, " ".join(comment)
        comment = []
        if not value:
            stack.append((indent, key))


def _schema_type(schema: dict[str, Any], dotted: str) -> str:
    node: dict[str, Any] | None = schema
    for part in dotted.split("."):
        node = (node or {}).get("properties", {}).get(part)
        if node is None:
            return ""
    t = node.get("type", "")
    return " or ".join(t) if isinstance(t, list) else str(t)


def helm_values() -> str:
    """The chart's values: key, type (``values.schema.json``), default and the comment that
    ``values.yaml`` gives it. The gate policy's document is one value."""
    import json

    chart = ROOT / "helm" / "graphtrim"
    schema = json.loads((chart / "values.schema.json").read_text())
    lines = (chart / "values.yaml").read_text().splitlines()
    out = ["| value | type | default | meaning |", "|---|---|---|---|"]
    for dotted, value, comment in _walk_values(lines):
        if dotted.startswith("gatePolicy."):
            continue  # a policy document: shown whole below
        kind = _schema_type(schema, dotted)
        if not value and kind == "object":
            if comment:
                out.append(f"| `{dotted}` | object | | {_cell(comment)} |")
            continue
        shown = _code(value) if value else ""
        out.append(f"| `{dotted}` | {kind} | {shown} | {_cell(comment)} |")
    policy = _block(lines, "gatePolicy")
    out += [
        "",
        "`gatePolicy` is a gate policy document (see [Gates](../concepts/gates.md)); the "
        "chart's default:",
        "",
        "```yaml",
        *policy,
        "```",
    ]
    return "\n".join(out)


def _block(lines: list[str], key: str) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if lines[i] and not lines[i].startswith((" ", "#"))
        ),
        len(lines),
    )
    return [line for line in lines[start:end] if line.strip()]


# ---------------------------------------------------------------- passes, rules, variants


def passes() -> str:
    """Every pass of the optimizer (``graphtrim passes``) and the presets that run it."""
    from graphtrim.graph.presets import PASSES, PRESETS, all_rules

    counts: dict[str, int] = {}
    for pass_name, _ in all_rules():
        counts[pass_name] = counts.get(pass_name, 0) + 1
    out = ["| pass | results | presets | rules | what it does |", "|---|---|---|---:|---|"]
    for name, cls in PASSES.items():
        presets = ", ".join(p for p, names in PRESETS.items() if name in names) or "none"
        results = "exact" if cls.exact else "rounding"
        out.append(
            f"| `{name}` | {results} | {presets} | {counts.get(name, 0)} | {_cell(cls.summary)} |"
        )
    out += ["", f"{len(PASSES)} passes, {sum(counts.values())} rules."]
    return "\n".join(out)


def rules() -> str:
    """Every rewrite rule of every pass (``graphtrim passes --rules``)."""
    from graphtrim.graph.presets import all_rules

    out = ["| pass | rule | tried on | what it relies on |", "|---|---|---|---|"]
    for pass_name, rule in all_rules():
        ops = ", ".join(rule.ops) or "(graph)"
        out.append(f"| `{pass_name}` | `{rule.name}` | {ops} | {_cell(rule.math)} |")
    return "\n".join(out)


def variants() -> str:
    """The variant table (``graphtrim.quantize.kinds``) and the thresholds each is held to
    when a policy says nothing."""
    import json

    from graphtrim.quantize.kinds import KINDS

    out = [
        "| variant | what it is | needs calibration | built by default | promotion rank "
        "| built-in gates beyond the defaults |",
        "|---|---|---|---|---:|---|",
    ]
    for k in KINDS:
        gates = json.dumps(dict(k.gates), separators=(", ", ": ")) if k.gates else ""
        out.append(
            f"| `{k.name}` | {_cell(k.help)} | {'yes' if k.needs_calibration else ''} "
            f"| {'yes' if k.default else ''} "
            f"| {'never' if k.promotion is None else k.promotion} | {_code(gates) if gates else ''} |"
        )
    return "\n".join(out)


def tune_space() -> str:
    """The settings search's knobs per variant kind (``graphtrim.tune.space``)."""
    from graphtrim.tune.space import DEVICE_KINDS, FORBIDDEN, SPACE

    def shown(value: Any) -> str:
        if value is None:
            return "the kind's default"
        if isinstance(value, tuple):
            return "+".join(map(str, value))
        return (
            {True: "on", False: "off"}.get(value, str(value))
            if isinstance(value, bool)
            else str(value)
        )

    out = [
        "| kind | searched by default on | knob | values (the fixed recipe's first) | what it is |",
        "|---|---|---|---|---|",
    ]
    for kind, knobs in SPACE.items():
        devices = ", ".join(d for d, kinds in DEVICE_KINDS.items() if kind in kinds) or "named only"
        for i, knob in enumerate(knobs):
            values = ", ".join(shown(v) for v in knob.values)
            weights = " (re-checked from memory)" if knob.weights else ""
            first = (f"`{kind}`", devices) if i == 0 else ("", "")
            out.append(
                f"| {first[0]} | {first[1]} | `{knob.field}` | {_cell(values)} "
                f"| {_cell(knob.help)}{weights} |"
            )
    out += ["", "Never tried together:", ""]
    out += [
        f"- `{kind}`: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + f" ({why})"
        for kind, settings, why in FORBIDDEN
    ]
    return "\n".join(out)


# ---------------------------------------------------------------- layers and folders


def layers() -> str:
    """The layers of ``tests/test_layering.py`` (the test that enforces them) as a diagram,
    highest first: each imports only from the layers below it."""
    from tests.test_layering import LAYERS

    out = ["```mermaid", "flowchart TB"]
    for i, (name, prefixes) in enumerate(reversed(LAYERS)):
        modules = "<br/>".join(prefixes)
        out.append(f'    L{i}["<b>{name}</b><br/>{modules}"]')
    out += [f"    L{i} --> L{i + 1}" for i in range(len(LAYERS) - 1)]
    out.append("```")
    return "\n".join(out)


def package_map() -> str:
    """Every package of the distribution and the folder it lives in (``pyproject.toml``)."""
    from tests.package_tree import package_dirs

    out = ["| import name | folder |", "|---|---|"]
    for package, folder in package_dirs().items():
        out.append(f"| `{package}` | `{folder.relative_to(ROOT).as_posix()}/` |")
    return "\n".join(out)


def contributing(section: str) -> Callable[[], str]:
    """The sections of ``CONTRIBUTING.md`` whose heading starts with ``section``, one level
    down (the guide is written once, there; the site shows it)."""

    def render() -> str:
        text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
        parts = re.split(r"(?m)^(?=## )", text)
        picked = [p for p in parts if p.startswith(f"## {section}")]
        if not picked:
            raise KeyError(f"CONTRIBUTING.md has no section '## {section}...'")
        return "\n".join(p.rstrip() + "\n" for p in picked)

    return render


# ---------------------------------------------------------------- task timeouts


def timeouts() -> str:
    """Each task's default ``execution_timeout`` (``graphtrim.airflow.timeouts``)."""
    from graphtrim.airflow import timeouts as t

    out = ["| task | minutes |", "|---|---:|"]
    out += [f"| `{name}` | {minutes:g} |" for name, minutes in t.DEFAULT_MINUTES.items()]
    out.append(f"| any other stage | {t.UNLISTED_MINUTES:g} |")
    return "\n".join(out)


# ---------------------------------------------------------------- the hook


def faults() -> str:
    from tests.faults.table import render

    return render()


def _bench(name: str) -> str:
    from bench.pages import section

    return section(name)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "run-parameters": run_parameters,
    "helm-values": helm_values,
    "timeouts": timeouts,
    "passes": passes,
    "rules": rules,
    "variants": variants,
    "tune-space": tune_space,
    "layers": layers,
    "package-map": package_map,
    "contributing-adding": contributing("Adding"),
    "faults": faults,
}


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by what it names."""

    def replace(m: re.Match[str]) -> str:
        indent, kind, name = m.group(1), m.group(2), m.group(3)
        if kind == "bench-results":
            text = _bench(name)
        elif name in GENERATORS:
            text = GENERATORS[name]()
        else:
            raise KeyError(f"no generated section named {name!r}")
        return "\n".join(indent + line if line else line for line in text.splitlines())

    return MARKER.sub(replace, markdown)


def on_startup(command: str, dirty: bool) -> None:
    from tests.package_tree import link_tree

    link_tree(ROOT / "build" / "docs-tree")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)
