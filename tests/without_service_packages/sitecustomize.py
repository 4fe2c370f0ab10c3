"""On PYTHONPATH, makes this interpreter look like a lent GPU machine, which has torch, triton, transformers,
peft and pillow but none of the service's packages: importing one of them raises ImportError."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

# Top-level names of the service's packages (storage, database, settings, queue, web) and of the optional
# structured-output and embedding-reference libraries.
ABSENT = frozenset({
    "boto3", "botocore", "sqlalchemy", "alembic", "psycopg", "pydantic", "pydantic_settings", "redis", "celery",
    "kombu", "fastapi", "starlette", "uvicorn", "xgrammar", "llguidance", "outlines_core", "sentence_transformers",
})


class AbsentPackages(MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in ABSENT:
            raise ImportError(f"{name} is not installed on a lent GPU machine", name=name)
        return None


sys.meta_path.insert(0, AbsentPackages())
