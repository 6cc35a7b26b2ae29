"""Operator commands: ``kiln-admin migrate | create-key | revoke-key | list-keys``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sqlalchemy import select

from api.auth import create_key, revoke_key
from api.db import session_scope
from api.models import ApiKey
from api.settings import get_settings

ROOT = Path(__file__).resolve().parent.parent


def migrate(url: str | None = None) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url or get_settings().resolved_database_url())
    command.upgrade(cfg, "head")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kiln-admin", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("migrate", help="create or upgrade the database schema")
    ck = sub.add_parser("create-key", help="create an API key and print it (shown once)")
    ck.add_argument("--owner", required=True)
    ck.add_argument("--name", default="")
    rk = sub.add_parser("revoke-key", help="revoke an API key by its id (key_…)")
    rk.add_argument("key_id")
    sub.add_parser("list-keys")
    args = p.parse_args(argv)

    if args.cmd == "migrate":
        migrate()
        print("database at head")
    elif args.cmd == "create-key":
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


if __name__ == "__main__":
    sys.exit(main())
