"""A tiny third-party environment package, written out by tests that install it: what a
user's own package looks like (pyproject.toml with the entry point, an options dataclass
checked by pearl_hpc's options_config, async reset/step)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = "pearl_test_envs"
ENTRY_POINT = "echo-word"  # the name run.env uses
IMPORT_PATH = f"{PACKAGE}.echo:make_echo"

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "pearl-test-envs"
version = "0.1.0"

[project.entry-points."pearl_hpc.environments"]
{ENTRY_POINT} = "{IMPORT_PATH}"

[tool.setuptools]
packages = ["{PACKAGE}"]
"""

ECHO = '''
"""Say a word: the task row's word (or one drawn from the seed); reward 1 when the
response contains it, else the share of its letters the response has."""
from dataclasses import dataclass
import random

from pearl_hpc.rollout.envs import EnvStep, options_config

WORDS = ("tool", "value", "answer", "result")


@dataclass(frozen=True)
class EchoConfig:
    max_turns: int = 2
    fail_on: str = ""  # a task id whose reset raises (to show a fault stays in its trajectory)


class EchoEnv:
    name = "echo-word"

    def __init__(self, config):
        self.config = config
        self.max_turns = config.max_turns
        self.word = ""
        self.turn = 0

    async def reset(self, seed, task=None):
        if task is not None and task["id"] == self.config.fail_on:
            raise RuntimeError(f"task {task['id']} is broken")
        self.word = task["word"] if task is not None else random.Random(seed).choice(WORDS)
        self.turn = 0
        return f"Say the word {self.word}."

    async def step(self, action):
        self.turn += 1
        letters = set(self.word)
        share = len(letters & set(action)) / len(letters)
        reward = (1.0 if self.word in action else share) / self.max_turns
        done = self.turn >= self.max_turns
        return EnvStep(None if done else f"Again: {self.word}", reward, done)


def make_echo(**options):
    return EchoEnv(options_config("echo-word", EchoConfig, options))
'''


def write_package(root: Path) -> Path:
    """The package's source tree under ``root``; returns its directory."""
    src = root / "pearl-test-envs"
    (src / PACKAGE).mkdir(parents=True, exist_ok=True)
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (src / PACKAGE / "__init__.py").write_text("")
    (src / PACKAGE / "echo.py").write_text(textwrap.dedent(ECHO))
    return src


def install_package(root: Path) -> Path:
    """pip-installs the package into ``root / "site"`` (not the interpreter's own
    site-packages); put that directory on PYTHONPATH / sys.path to use it."""
    src, site = write_package(root), root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(src),
        ],
        check=True,
    )
    return site
