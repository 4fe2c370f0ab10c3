"""How the C++ extensions are named and what they compile, without building them: a build's name covers every file
it compiles or includes, and every C++ file in conveyor_kernels/ belongs to exactly one extension."""

from __future__ import annotations

from pathlib import Path

from conveyor_kernels import cpu_kernels, lora, quantized_matmul
from conveyor_kernels.cpu_kernels import build_digest


def test_build_digest_changes_with_any_header_the_sources_include(tmp_path: Path) -> None:
    source, direct, nested, unrelated = (tmp_path / name for name in ("a.cpp", "a.h", "b.h", "c.h"))
    source.write_text('#include <vector>\n#include "a.h"\n')
    direct.write_text('  #  include "b.h"  // indented, spaced\n')
    nested.write_text("// the body\n")
    unrelated.write_text("// included by nothing\n")
    first = build_digest(source)

    nested.write_text("// the body, changed\n")
    second = build_digest(source)
    unrelated.write_text("// changed, still included by nothing\n")

    assert second != first
    assert build_digest(source) == second


def test_every_cpp_file_in_kernels_is_in_exactly_one_extension() -> None:
    extensions = [
        cpu_kernels._SOURCES, cpu_kernels._VECTOR_DECODE_SOURCES, quantized_matmul._SOURCES, [lora._CPU_SOURCE],
    ]
    listed = [source.name for sources in extensions for source in sources]
    on_disk = sorted(path.name for path in Path(cpu_kernels.__file__).parent.glob("*.cpp"))
    assert sorted(listed) == on_disk
