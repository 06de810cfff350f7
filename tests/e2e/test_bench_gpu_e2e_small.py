"""bench_gpu_e2e.py's CPU check (`--small`) runs to the end and prints every figure.

The bench starts two `kiln worker` nodes (max batch 1 and 4) and the hand-written worker on the
CPU, with the shrunk models, and runs both pipelines at 64x64 (about a minute on 2 cores). The
printed table is checked here column by column: every row (pipeline x max batch) has a number in
every column; `n/a` only in the GPU busy columns, which have nothing to sample on a CPU. The goals
section has a line per row. `check_report` is also run on a canned report with a column removed,
a cell emptied and a goals line missing, so the checker itself is shown to fail.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ("sd3-medium", "flux-dev")
MAX_BATCHES = (1, 4)
# The table's columns in order, and what each cell must hold.
NAME, INT, FLOAT, PERCENT, GPU = "name", "int", "float", "percent", "gpu"
COLUMNS = {
    "pipeline": NAME,
    "size": INT,
    "steps": INT,
    "max_batch": INT,
    "kiln_img/s": FLOAT,
    "base_img/s": FLOAT,
    "ratio": FLOAT,
    "kiln_gpu_busy": GPU,
    "base_gpu_busy": GPU,
    "kiln_fwd_busy": PERCENT,
    "base_fwd_busy": PERCENT,
    "kiln_overhead_ms": FLOAT,
    "kiln_peak_MiB": INT,
    "base_peak_MiB": INT,
}
POSITIVE = {"size", "steps", "kiln_img/s", "base_img/s", "ratio", "kiln_peak_MiB", "base_peak_MiB"}
GOAL_LINE = re.compile(
    r"^  (?P<pipeline>\S+) (?P<size>\d+)² max-batch (?P<batch>\d+): GPU busy n/a \(no GPU\); "
    r"ratio (?P<ratio>\d+\.\d\d)x \(.+\)$"
)


def cell_value(column: str, cell: str) -> float | None:
    """The number in `cell`; None for a pipeline's name or a GPU busy `n/a`; else AssertionError."""
    kind = COLUMNS[column]
    if kind == NAME:
        assert cell in PIPELINES, f"{column}: {cell!r} is not one of {PIPELINES}"
        return None
    if kind == GPU and cell == "n/a":
        return None
    if kind in (PERCENT, GPU):
        assert re.fullmatch(r"\d+\.\d%", cell), f"{column}: {cell!r} is not a percentage"
        value = float(cell[:-1])
        assert 0.0 < value <= 100.0, f"{column}: {cell} out of (0, 100]"
        return value
    pattern = r"\d+" if kind == INT else r"-?\d+\.\d+"
    assert re.fullmatch(pattern, cell), f"{column}: {cell!r} is not a {kind}"
    value = float(cell)
    assert math.isfinite(value), f"{column}: {cell}"
    if column in POSITIVE:
        assert value > 0, f"{column}: {cell} is not positive"
    return value


def check_report(output: str) -> list[dict[str, str]]:
    """Every figure of the report in `output`; the table's rows, as cells by column name."""
    lines = output.splitlines()
    headers = [n for n, line in enumerate(lines) if line.split()[:1] == ["pipeline"]]
    assert len(headers) == 1, f"one table header expected, found {len(headers)}"
    header = lines[headers[0]].split()
    assert header == list(COLUMNS), f"columns {header}, expected {list(COLUMNS)}"
    rows: list[dict[str, str]] = []
    for line in lines[headers[0] + 1 :]:
        if not line.strip():
            break
        cells = line.split()
        assert len(cells) == len(header), f"{len(cells)} cells for {len(header)} columns: {line}"
        rows.append(dict(zip(header, cells, strict=True)))
    expected = {(pipeline, str(batch)) for pipeline in PIPELINES for batch in MAX_BATCHES}
    found = [(row["pipeline"], row["max_batch"]) for row in rows]
    assert sorted(found) == sorted(expected), f"rows {found}, expected {sorted(expected)}"
    for row in rows:
        values = {column: cell_value(column, cell) for column, cell in row.items()}
        kiln, base, ratio = values["kiln_img/s"], values["base_img/s"], values["ratio"]
        assert kiln is not None
        assert base is not None
        assert ratio is not None
        assert abs(kiln / base - ratio) <= 0.01 + 1e-9, f"ratio {ratio} != {kiln} / {base}"

    assert "goals" in lines, "no goals section"
    goals = lines[lines.index("goals") + 1 :]
    for row in rows:
        matches = [
            match
            for line in goals
            if (match := GOAL_LINE.match(line))
            and (match["pipeline"], match["size"], match["batch"])
            == (row["pipeline"], row["size"], row["max_batch"])
        ]
        assert len(matches) == 1, f"goals: no single line for {row['pipeline']} {row['max_batch']}"
        assert matches[0]["ratio"] == row["ratio"], f"goals ratio {matches[0]['ratio']}"
    assert re.search(r"^\(total \d+ s\)$", output, re.MULTILINE), "no total time"
    return rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_gpu_e2e_small_prints_every_figure(redis_url: str) -> None:
    env = {**os.environ, "KILN_TEST_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    answer = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.bench_gpu_e2e", "--small"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    shown = f"stdout:\n{answer.stdout[-6000:]}\nstderr:\n{answer.stderr[-6000:]}"
    assert answer.returncode == 0, shown
    rows = check_report(answer.stdout)
    assert {row["size"] for row in rows} == {"64"}, shown
    assert {row["steps"] for row in rows} == {"2"}, shown


# A report as the bench printed it on this machine (2 cores, no GPU).
REPORT = """\
# torch 2.13.0+cpu, CPU (no GPU); 2 steps, 4 jobs a round per side, 1 rounds, ...

  pipeline  size  steps  max_batch  kiln_img/s  base_img/s  ratio  kiln_gpu_busy  base_gpu_busy  \
kiln_fwd_busy  base_fwd_busy  kiln_overhead_ms  kiln_peak_MiB  base_peak_MiB
sd3-medium    64      2          1      21.819      21.957   0.99            n/a            n/a  \
        84.0%          79.5%              11.6            483            523
sd3-medium    64      2          4      19.301      21.957   0.88            n/a            n/a  \
        83.8%          79.5%              10.1            539            523
  flux-dev    64      2          1      21.934      18.798   1.17            n/a            n/a  \
        88.9%          83.0%               7.6            483            532
  flux-dev    64      2          4      25.795      18.798   1.37            n/a            n/a  \
        83.4%          83.0%               7.1            509            532

goals
  sd3-medium 64² max-batch 1: GPU busy n/a (no GPU); ratio 0.99x (no ratio goal at this size)
  sd3-medium 64² max-batch 4: GPU busy n/a (no GPU); ratio 0.88x (no ratio goal at this size)
  flux-dev 64² max-batch 1: GPU busy n/a (no GPU); ratio 1.17x (no ratio goal at this size)
  flux-dev 64² max-batch 4: GPU busy n/a (no GPU); ratio 1.37x (no ratio goal at this size)

(total 47 s)
"""


def drop_column(report: str, index: int) -> str:
    """`report` with the table's `index`-th column removed from the header and every row."""
    out = []
    for line in report.splitlines():
        cells = line.split()
        if len(cells) == len(COLUMNS):
            line = "  ".join(cells[:index] + cells[index + 1 :])
        out.append(line)
    return "\n".join(out) + "\n"


def test_check_report_accepts_a_full_report() -> None:
    assert len(check_report(REPORT)) == len(PIPELINES) * len(MAX_BATCHES)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (drop_column(REPORT, list(COLUMNS).index("kiln_fwd_busy")), "columns"),
        (drop_column(REPORT, list(COLUMNS).index("base_peak_MiB")), "columns"),
        (REPORT.replace("  10.1  ", "   n/a  "), "kiln_overhead_ms"),
        (REPORT.replace("84.0%", "  n/a"), "kiln_fwd_busy"),
        (REPORT.replace("25.795", "   nan"), "kiln_img/s"),
        (REPORT.replace("0.88", "0.50"), "ratio"),
        (REPORT.replace("  flux-dev 64² max-batch 4:", "  flux-dev 64² max-batch 8:"), "goals"),
        (REPORT.replace("goals\n", ""), "no goals section"),
        (REPORT.replace("(total 47 s)", ""), "no total time"),
        ("\n".join(line for line in REPORT.splitlines() if "539" not in line), "rows"),
    ],
)
def test_check_report_fails_on_a_missing_figure(broken: str, message: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_report(broken)
