"""On PYTHONPATH, makes this interpreter look like a lent GPU machine, which has torch, triton, transformers,
peft and pillow but none of the service's packages nor the test-only ones: they are not found, as if not
installed (`importlib.util.find_spec` gives None, importing raises ModuleNotFoundError, and their distributions,
pytest plugins included, are not listed)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec, PathFinder
from importlib.metadata import Distribution, DistributionFinder

# Top-level names of the service's packages (storage, database, settings, queue, web), of the optional
# structured-output libraries, and of the test and benchmark extras; distribution names compare normalised.
ABSENT = frozenset({
    "boto3", "botocore", "sqlalchemy", "alembic", "psycopg", "psycopg_binary", "pydantic", "pydantic_settings",
    "redis", "celery", "kombu", "fastapi", "starlette", "uvicorn", "xgrammar", "llguidance", "outlines_core",
    "sentence_transformers", "hypothesis", "_hypothesis_pytestplugin", "schemathesis", "gguf", "matplotlib",
})


class InstalledPackagesButAbsent(PathFinder):
    """The installed packages' finder, blind to the ABSENT ones."""

    @classmethod
    def find_spec(cls, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname.partition(".")[0] in ABSENT:
            return None
        return super().find_spec(fullname, path, target)

    @classmethod
    def find_distributions(
        cls, context: DistributionFinder.Context = DistributionFinder.Context()
    ) -> Iterator[Distribution]:
        for distribution in super().find_distributions(context):
            if (distribution.metadata["Name"] or "").lower().replace("-", "_") not in ABSENT:
                yield distribution


sys.meta_path[:] = [InstalledPackagesButAbsent if finder is PathFinder else finder for finder in sys.meta_path]
