"""Validate docker/compose.yaml (scripts/containers.sh lint): the file against the Compose
Specification's JSON schema (docker/compose-spec.json, from github.com/compose-spec/compose-spec,
schema/compose-spec.json at 170098ba, Apache-2.0), then the stack as `podman-compose config`
resolved it (read from stdin) against what this deployment promises: the services it needs, a
health check on every long-running one, the migrations before the API and the workers, named
volumes only, no store volume shared between the API and a worker, only the API's port published.

    podman-compose -f docker/compose.yaml config | python docker/check_compose.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
NEEDED = {"postgres", "redis", "s3", "migrate", "api", "worker", "webhooks"}
ONE_SHOT = {"migrate"}
AFTER_MIGRATE = {"api", "worker", "webhooks"}


def schema_errors(doc: dict) -> list[str]:
    schema = json.loads((HERE / "compose-spec.json").read_text())
    try:
        import jsonschema_rs
    except ImportError:
        import jsonschema  # type: ignore[import-untyped]

        v = jsonschema.Draft7Validator(schema)
        return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in v.iter_errors(doc)]
    validator = jsonschema_rs.validator_for(schema)
    return [f"{'/'.join(map(str, e.instance_path))}: {e.message}" for e in validator.iter_errors(doc)]


def stack_errors(cfg: dict) -> list[str]:
    errors = []
    services = cfg.get("services", {})
    missing = NEEDED - services.keys()
    if missing:
        errors.append(f"services missing: {sorted(missing)}")
    declared = set((cfg.get("volumes") or {}).keys())
    mounts: dict[str, set[str]] = {}
    for name, svc in services.items():
        if name not in ONE_SHOT and "healthcheck" not in svc:
            errors.append(f"{name}: no healthcheck")
        for v in svc.get("volumes", []):
            source = v.split(":", 1)[0] if isinstance(v, str) else v.get("source", "")
            if source.startswith((".", "/")):
                errors.append(f"{name}: bind mount {source}; named volumes only")
            elif source not in declared:
                errors.append(f"{name}: volume {source} not declared")
            mounts.setdefault(source, set()).add(name)
        if name != "api" and svc.get("ports"):
            errors.append(f"{name}: publishes {svc['ports']}; only the API is reached from outside")
        if name in AFTER_MIGRATE:
            cond = (svc.get("depends_on") or {}).get("migrate", {}).get("condition")
            if cond != "service_completed_successfully":
                errors.append(f"{name}: must start after migrate completed successfully (got {cond})")
    for source, users in mounts.items():
        if "api" in users and users & {"worker", "inference"}:
            errors.append(f"volume {source} shared by {sorted(users)}: the store is S3, each its own cache")
    env = services.get("api", {}).get("environment", {})
    for key in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORE_URL"):
        if not env.get(key):
            errors.append(f"api: {key} not set")
    return errors


def main() -> int:
    raw = yaml.safe_load((HERE / "compose.yaml").read_text())
    errors = [f"schema: {e}" for e in schema_errors(raw)]
    resolved = sys.stdin.read()
    if resolved.strip():
        errors += stack_errors(yaml.safe_load(resolved))
    for e in errors:
        print(f"docker/compose.yaml: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
