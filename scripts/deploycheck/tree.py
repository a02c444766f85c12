"""The copy of the repository being checked, and the linters run on it."""

import os
import shutil
import subprocess
import sys

import yaml

from .gateway import Facts
from .report import Report


def tool(name):
    """A tool on PATH, or in the virtualenv/pyenv bin folder this python runs from."""
    found = shutil.which(name)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else None


def run(command, cwd=None, timeout=120):
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        return done.returncode, (done.stdout + done.stderr).strip()
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout}s"


def last_lines(text, n=6):
    lines = [l for l in text.splitlines() if l.strip()]
    return " | ".join(lines[-n:])


def exit_zero(code, output):
    return code == 0


def run_linter(tree, where, what, command, installed_by, clean=exit_zero):
    """Runs a linter from the repository root (so that it names files as this script does): ok,
    or FAIL with the end of its output. install-deps installs every linter used here, so a
    missing one fails too: skipping would turn the check green without checking anything."""
    path = tool(command[0])
    if not path:
        tree.report.fail(
            f"{where}: {command[0]} is not installed ({installed_by}; scripts/install-deps does it)"
        )
        return
    code, output = run([path, *command[1:]], cwd=tree.root)
    tree.report.check(clean(code, output), f"{where}: {what}", f"{where}: {what}: {last_lines(output)}")


class Tree:
    """root: the repository's folder; report: where the lines go; facts: what the gateway accepts
    and exports (gateway.read_sources fills them); parsed: {path: [YAML documents]} (load_yaml).
    The unit tests pass a linter that only records its command, and a which that finds nothing,
    so that they need no tools."""

    def __init__(self, root, report=None, linter=run_linter, which=shutil.which):
        self.root = root
        self.report = report if report is not None else Report()
        self.facts = Facts()
        self.parsed = {}
        self.linter = linter
        self.which = which

    def path(self, name):
        return os.path.join(self.root, name)

    def rel(self, path):
        return os.path.relpath(path, self.root)

    def read(self, name, default=None):
        try:
            with open(self.path(name), encoding="utf-8") as f:
                return f.read()
        except OSError:
            return default

    def document(self, name, default=None):
        """The first YAML document of the file name (relative to the root), else default."""
        return (self.parsed.get(self.path(name)) or [default])[0]

    def lint(self, where, what, command, installed_by, clean=exit_zero):
        self.linter(self, where, what, command, installed_by, clean)

    def run(self, command, cwd=None, timeout=120):
        return run(command, cwd=cwd, timeout=timeout)


def yaml_files(tree):
    files = [tree.path("docker-compose.yml")]
    for folder, dirs, names in os.walk(tree.path("deploy")):
        dirs.sort()
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith((".yml", ".yaml"))]
    return files


def load_yaml(tree):
    """yamllint judges every YAML file (syntax, duplicate keys, truthy values...); then each one
    that parses is loaded into tree.parsed for the other checks, which report what they cannot
    read."""
    files = [p for p in yaml_files(tree) if os.path.exists(p)]
    tree.lint(
        "YAML",
        f"yamllint --strict, {len(files)} files",
        ["yamllint", "--strict", "-f", "parsable", "-c", ".yamllint", *map(tree.rel, files)],
        "apt-get install yamllint",
    )
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                tree.parsed[path] = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError:
            pass
    return tree.parsed
