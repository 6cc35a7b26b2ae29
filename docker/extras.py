"""Print the requirements of Kiln's base layer and the named extras (pyproject.toml), one a line.

The images install these before the source is copied in, so the dependency layer is rebuilt only
when pyproject.toml or scripts/constraints.txt change, not on every code edit:
``python3 docker/extras.py server,engine > requirements.txt``.
"""

import sys

import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
lines = list(project["dependencies"])
for extra in extras:
    lines += project["optional-dependencies"][extra]
print("\n".join(dict.fromkeys(lines)))
