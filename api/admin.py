"""Operator commands: ``kiln-admin migrate | create-key | revoke-key | list-keys``.

Exit status: 0 ok, 1 no such key (revoke-key), 2 error: a database that cannot be reached or has
no tables yet (run ``kiln-admin migrate`` first), said in one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sqlalchemy import inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from api.auth import create_key, revoke_key
from api.db import get_engine, session_scope
from api.models import ApiKey
from api.settings import get_settings

ROOT = Path(__file__).resolve().parent.parent
NO_TABLES = "the database has no tables yet: run kiln-admin migrate first"


def migrate(url: str | None = None) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url or get_settings().resolved_database_url())
    command.upgrade(cfg, "head")


class AdminError(Exception):
    """A problem the operator can fix, said in one line."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln-admin", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("migrate", help="create or upgrade the database schema")
    ck = sub.add_parser("create-key", help="create an API key and print it (shown once)")
    ck.add_argument("--owner", required=True, help="who the key's files and jobs belong to")
    ck.add_argument("--name", default="", help="a label for the key")
    rk = sub.add_parser("revoke-key", help="revoke an API key by its id (key_…)")
    rk.add_argument("key_id", help="the key's id (key_…), as list-keys prints it")
    sub.add_parser("list-keys", help="list every key: id, owner, prefix, state, name")
    return p


def _require_tables() -> None:
    if not inspect(get_engine()).has_table(ApiKey.__tablename__):
        raise AdminError(NO_TABLES)


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "migrate":
        migrate()
        print("database at head")
        return 0
    _require_tables()
    if args.cmd == "create-key":
        with session_scope() as s:
            key, secret = create_key(s, args.owner, args.name)
            print(secret)
            print(f"created {key.id} for owner {args.owner!r}", file=sys.stderr)
    elif args.cmd == "revoke-key":
        with session_scope() as s:
            if not revoke_key(s, args.key_id):
                print(f"no key {args.key_id}", file=sys.stderr)
                return 1
        print(f"revoked {args.key_id}")
    elif args.cmd == "list-keys":
        with session_scope() as s:
            for k in s.scalars(select(ApiKey).order_by(ApiKey.pk)):
                state = "revoked" if k.revoked_at else "active"
                print(f"{k.id}\t{k.owner}\t{k.prefix}…\t{state}\t{k.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except AdminError as e:
        print(f"error: {e}", file=sys.stderr)
    except SQLAlchemyError as e:  # unreachable, refused, or a schema older than this code
        url = make_url(get_settings().resolved_database_url()).render_as_string(hide_password=True)
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        print(f"error: the database {url}: {reason}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
