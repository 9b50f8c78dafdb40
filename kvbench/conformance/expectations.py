"""Expected failures: checks an engine is known to fail, listed in a TOML file with a reason and a
reproduction each, so that a run can gate an engine upgrade.

``pytest suites/ --engine hf-cb --kvbench-expectations hf-cb`` (a bare name is the file shipped for
that engine kind, ``kvbench/conformance/expectations/hf-cb.toml``; anything else is a path) runs
every listed check as a *strict* xfail: the run passes while the finding stands (and prints it),
and a fixed bug fails the run with "now passes: remove it from the expectations file".

File format (``tomllib``)::

    [[expected_failure]]
    engine = "hf-cb"                      # adapter kind
    check = "recompute_preemption_equivalence"   # check id (kvbench.plugin.check_id); fnmatch patterns
                                                 # allowed, and a bare name matches every variant [..]
    reason = "why it fails (upstream behaviour)"
    reproduction = "the smallest command or snippet that shows it"
    versions = { transformers = ">=5.0,<5.26" }  # optional: only while these installed versions match

Every field is checked when the file is read; an error names the file, the entry and the field.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: the files shipped with kvbench, per engine kind
SHIPPED = Path(__file__).parent / "expectations"


class ExpectationsError(ValueError):
    """A malformed expectations file; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class Expectation:
    engine: str
    check: str
    reason: str
    reproduction: str
    versions: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def matches_check(self, check_id: str) -> bool:
        base = check_id.split("[", 1)[0]
        return fnmatch.fnmatchcase(check_id, self.check) or fnmatch.fnmatchcase(base, self.check)

    def applies(self, kind: str, check_id: str,
                version_of: Callable[[str], str | None] | None = None) -> bool:
        """True for engine ``kind`` and ``check_id`` when every version range holds for what is installed
        (a package that is not installed never satisfies a range)."""
        if kind != self.engine or not self.matches_check(check_id):
            return False
        from packaging.specifiers import SpecifierSet

        version_of = version_of or installed_version
        for package, spec in self.versions.items():
            version = version_of(package)
            if version is None or not SpecifierSet(spec).contains(version, prereleases=True):
                return False
        return True

    def describe(self) -> str:
        versions = "".join(f", {p} {s}" for p, s in self.versions.items())
        return f"{self.engine} / {self.check}{versions}: {self.reason} (reproduce: {self.reproduction})"


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


_FIELDS = {"engine", "check", "reason", "reproduction", "versions"}


def shipped_names() -> list[str]:
    """Engine kinds kvbench ships an expectations file for (``SHIPPED/<kind>.toml``)."""
    return sorted(p.stem for p in SHIPPED.glob("*.toml"))


def resolve(value: str | Path) -> Path:
    """The file ``--kvbench-expectations VALUE`` means: an existing file, or anything that looks like a
    path (a separator, a ``.toml`` ending), is taken as given; any other bare name is the file shipped
    for that engine kind, and an unknown one is an error listing the shipped names."""
    text = str(value)
    if isinstance(value, Path) or Path(text).is_file() or "/" in text or "\\" in text or text.endswith(".toml"):
        return Path(value)
    if text not in shipped_names():
        raise ExpectationsError(f"expectations {text!r}: not a shipped file (shipped: {', '.join(shipped_names())}) "
                                "and not a path (a path contains '/' or ends in .toml)")
    return SHIPPED / f"{text}.toml"


def load_expectations(path: str | Path) -> list[Expectation]:
    """Read and validate one expectations file (``path`` as :func:`resolve` reads it)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    path = resolve(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ExpectationsError(f"expectations file {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ExpectationsError(f"expectations file {path}: not valid TOML: {e}") from None
    unknown_top = sorted(set(data) - {"expected_failure"})
    if unknown_top:
        raise ExpectationsError(f"expectations file {path}: unknown key(s) {unknown_top}; "
                                "entries go in [[expected_failure]] tables")
    entries = data.get("expected_failure", [])
    if not isinstance(entries, list):
        raise ExpectationsError(f"expectations file {path}: expected_failure must be an array of tables")
    out = []
    for i, entry in enumerate(entries):
        where = f"expectations file {path}, expected_failure #{i + 1}"
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise ExpectationsError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
        for name in ("engine", "check", "reason", "reproduction"):
            if not isinstance(entry.get(name), str) or not entry[name].strip():
                raise ExpectationsError(f"{where}: field {name!r} must be a non-empty string, got {entry.get(name)!r}")
        versions = entry.get("versions", {})
        if not isinstance(versions, dict):
            raise ExpectationsError(f"{where}: field 'versions' must be a table of package = \"specifier\"")
        for package, spec in versions.items():
            try:
                SpecifierSet(spec)
            except (InvalidSpecifier, TypeError):
                raise ExpectationsError(f"{where}: versions.{package} = {spec!r} is not a version specifier "
                                        "such as \">=5.24,<5.26\"") from None
        out.append(Expectation(entry["engine"], entry["check"], entry["reason"].strip(),
                               entry["reproduction"].strip(), dict(versions), str(path)))
    return out


def matching(expectations: Sequence[Expectation], kind: str, check_id: str,
             version_of: Callable[[str], str | None] | None = None) -> Expectation | None:
    """The first expectation that applies, or None."""
    return next((e for e in expectations if e.applies(kind, check_id, version_of)), None)
