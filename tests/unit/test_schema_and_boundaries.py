"""The schema comes only from migrations and matches the models; the layers import one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from api.admin import migrate
from api.db import make_engine
from api.models import Base
from tests.stack import create_pg_database, drop_pg_database

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'k.sqlite'}"
    else:
        name, url = create_pg_database()
        yield url
        drop_pg_database(name)


def test_migrations_build_exactly_the_models(database_url):
    migrate(database_url)
    engine = make_engine(database_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert diff == []
    assert {"api_keys", "files", "jobs", "job_events", "checkpoints", "idempotency_keys"} <= tables


def test_import_contracts_hold():
    out = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" not in out.stdout.lower().replace("0 broken", "")


def test_api_starts_without_torch_and_sdk_without_server():
    code = (
        "import sys, api.app; api.app.create_app(); import kiln.dataset; "
        "bad = [m for m in ('torch', 'engine', 'workers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    code = (
        "import sys, kiln, kiln.cli, kiln.dataset; "
        "bad = [m for m in ('fastapi', 'sqlalchemy', 'torch', 'api') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_our_packages_shadow_no_installed_distribution():
    """Our top-level names are importable beside every package installed with us: a folder named
    like another distribution's module (``kernels`` is Hugging Face's, which transformers needs)
    hides it from everything imported in the same process."""
    import importlib.metadata

    import tomllib

    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    taken = importlib.metadata.packages_distributions()
    clashes = {name: set(taken.get(name, ())) - {"kiln"} for name in ours}
    assert {name: others for name, others in clashes.items() if others} == {}
