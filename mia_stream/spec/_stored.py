"""What a user registers by name on this machine (steering vectors, detector probes) has one set of rules: the
name and digest patterns, files replaced atomically, and the ``add NAME FILE | list | remove NAME`` command.
``spec/vectors.py`` and ``spec/probes.py`` keep their own formats and directories. Owns no state."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
DIGEST = re.compile(r"^[0-9a-f]{32}$")  # BLAKE2b-128 of the content, hex


def replace_atomically(path: Path, write: Callable) -> None:
    """Write ``path`` through ``write(binary file)`` into a temporary beside it, then rename it into place: a
    reader never sees a half-written file (the parents are made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def registry_main(argv: list[str], *, prog: str, description: str, add_help: str, list_help: str,
                  add: Callable[[str, str], Path], rows: Callable[[], Iterable[str]],
                  path_of: Callable[[str], Path], errors: tuple) -> int:
    """``PROG add NAME FILE | list | remove NAME``: ``add`` prints where ``add(name, file)`` stored it, ``list``
    prints ``rows()``, ``remove`` unlinks ``path_of(name)``; an error in ``errors`` is one line and exit 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help=add_help)
    a.add_argument("name")
    a.add_argument("file")
    sub.add_parser("list", help=list_help)
    rm = sub.add_parser("remove", help="unregister NAME")
    rm.add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "add":
            print(add(args.name, args.file))
        elif args.cmd == "list":
            for row in rows():
                print(row)
        else:
            path_of(args.name).unlink()
    except errors as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0
