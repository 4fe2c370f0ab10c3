"""The README's table of settings, generated from `jobs.settings.Settings` so that the two cannot drift.

`python -m jobs.settings_doc` rewrites the table between its markers in README.md; a test fails whenever the
README's table differs from the one this module makes.
"""

from __future__ import annotations

from pathlib import Path

from jobs.settings import ENGINE_ENV_PREFIX, ENV_PREFIX, S3_ENV_PREFIX, S3Settings, Settings

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- settings table: generated from jobs/settings.py by `python -m jobs.settings_doc`, do not edit -->"
END = "<!-- end of the settings table -->"
HEADER = ["| variable | default | meaning |", "|---|---|---|"]
CREDENTIALS_ROW = "| `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` | boto3's chain | S3 credentials (any source boto3 reads) |"
ENGINE_ROW = (
    f"| `{ENGINE_ENV_PREFIX}<OPTION>` | engine defaults | any engine option from the table above, "
    f"e.g. `{ENGINE_ENV_PREFIX}MAX_NUM_SEQS=128` |"
)


def settings_table() -> str:
    rows = list(HEADER)
    for name in Settings.model_fields:
        if name == "s3":
            rows += _rows(S3Settings, S3_ENV_PREFIX)
            rows.append(CREDENTIALS_ROW)
        elif name == "engine_options":
            rows.append(ENGINE_ROW)
        else:
            rows += _rows(Settings, ENV_PREFIX, only=name)
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    """The README with its table (between the markers) replaced by the generated one."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + settings_table() + "\n" + readme[end:]


def _rows(model: type[Settings] | type[S3Settings], prefix: str, only: str | None = None) -> list[str]:
    fields = Settings.model_fields if model is Settings else S3Settings.__pydantic_fields__
    return [
        f"| `{prefix}{name.upper()}` | {_shown(field.get_default(call_default_factory=True))} | {field.description} |"
        for name, field in fields.items()
        if only in (None, name)
    ]


def _shown(default: object) -> str:
    if default is None:
        return "unset"
    if default == "":
        return "empty"
    if isinstance(default, str):
        return f"`{default}`"
    return str(default)


if __name__ == "__main__":
    README.write_text(readme_with_table(README.read_text()))
