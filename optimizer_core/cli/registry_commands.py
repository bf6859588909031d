"""``graphtrim registry dedupe``: the registry's own upkeep."""

from __future__ import annotations

import argparse
import json
from typing import Any

from graphtrim.cli.argtypes import add_command_group
from graphtrim.cli.pipeline_context import add_tracking_uri, tracking_uri
from graphtrim.redact import masked_command


def add_parsers(sub: Any) -> None:
    rsub = add_command_group(
        sub,
        "registry",
        "registry_command",
        help="upkeep of a registered model's variant versions (dedupe)",
        description="Upkeep of the versions graphtrim registered in an MLflow registry.",
        metavar="COMMAND",
    )
    dd = rsub.add_parser(
        "dedupe",
        help="list (or archive) versions that copy another version's variant",
        description=(
            "List the versions of NAME whose files have the same sha256 as an older version "
            "of the same variant of the same source version: copies registered by runs whose "
            "config differed. With --apply each copy is archived: it gets the tags "
            "graphtrim.duplicate_of (the kept version, the oldest) and graphtrim.archived, "
            "and the gate-policy verdicts it carries are copied onto the kept version. A "
            "version an alias points to is never touched. Nothing is deleted."
        ),
    )
    dd.add_argument("name", help="registered model name")
    dd.add_argument(
        "--apply", action="store_true", help="archive the copies (default: list them only)"
    )
    dd.add_argument(
        "--why",
        default="graphtrim registry dedupe",
        help="reason, kept in each archived copy's graphtrim.archived tag",
    )
    dd.add_argument("--json", action="store_true", help="print the groups as JSON")
    add_tracking_uri(dd)
    dd.set_defaults(handler=cmd_dedupe)


@masked_command
def cmd_dedupe(args: argparse.Namespace) -> int:
    from graphtrim.integrations.lineage import archive_copies, copy_groups
    from graphtrim.integrations.registry import Registry

    registry = Registry(tracking_uri(args))
    groups = copy_groups(registry, args.name)
    archived = archive_copies(registry, args.name, groups, why=args.why) if args.apply else []
    if args.json:
        doc = {"groups": [g.to_json() for g in groups], "archived": archived}
        print(json.dumps(doc, indent=2))
        return 0
    if not groups:
        print(f"{args.name}: no copies (every variant's files are one version)")
        return 0
    for g in groups:
        line = f"{g.source} {g.variant} sha256 {g.sha256[:12]}: keep v{g.kept}"
        if g.copies:
            verb = "archived" if args.apply else "copies"
            line += f"; {verb} " + ", ".join(
                f"v{v}" for v in g.copies if not args.apply or v in archived
            )
        for version, aliases in sorted(g.protected.items(), key=lambda kv: int(kv[0])):
            line += f"; v{version} left as is (alias {', '.join(aliases)})"
        print(line)
    n = sum(len(g.copies) for g in groups)
    if args.apply:
        print(f"{len(archived)} cop{'y' if len(archived) == 1 else 'ies'} archived")
    else:
        print(f"{n} cop{'y' if n == 1 else 'ies'} to archive: run again with --apply")
    return 0
