"""The kernels' build compiles every .cpp file in stepahead/kernels, each once, and the kernel map
(stepahead/kernels/README.md) has a row for each."""

from __future__ import annotations

from pathlib import Path

from stepahead.kernels import cpu_build

KERNELS_DIR = Path(cpu_build.__file__).parent


def test_the_build_compiles_every_cpp_file_present_once():
    names = [p.name for p in cpu_build.SOURCES]
    assert len(names) == len(set(names)), "a source listed twice"
    assert sorted(names) == sorted(p.name for p in KERNELS_DIR.glob("*.cpp"))
    assert all(p.parent == KERNELS_DIR and p.is_file() for p in cpu_build.SOURCES)


def test_the_kernel_map_has_a_row_for_every_cpp_file():
    rows = [line for line in (KERNELS_DIR / "README.md").read_text().splitlines() if line.startswith("| `")]
    missing = [p.name for p in cpu_build.SOURCES if not any(row.startswith(f"| `{p.name}`") for row in rows)]
    assert not missing, f"no row in stepahead/kernels/README.md for {missing}"
