"""Expected failures: checks an engine is known to fail, listed in a TOML file with a reason and a
reproduction each, so that a run can gate an engine upgrade.

``pytest suites/ --engine hf-cb --kvbench-expectations hf-cb`` (a bare name is the file shipped for
that engine kind, ``kvbench/conformance/expectations/hf-cb.toml``; anything else is a path) runs
every listed check as a *strict*, *pinned* xfail: a failure whose message matches the entry's
``match`` is the expected one (the run passes and prints the finding); a failure that does not
match is a failure like any other, naming the entry it did not match (a new bug in a listed check is
never swallowed); and a listed check that passes, or now skips, fails the run with "the expectation is
stale". An entry excuses one assertion: a check that states its assertions with
:func:`kvbench.conformance.verdict.claim` goes on past the expected failure, and fails on any other.

File format (``tomllib``)::

    [[expected_failure]]
    engine = "hf-cb"                      # adapter kind, or engine family (EngineAdapter.family(): "vllm")
    check = "recompute_preemption_equivalence"   # check id (kvbench.plugin.check_id); fnmatch patterns
                                                 # allowed, and a bare name matches every variant [..]
    match = "prefix-cache hit on resume did not happen"   # regex searched in the failure's message
                                                          # ("AssertionError: ..." as pytest's E line)
    reason = "why it fails (upstream behaviour)"
    reproduction = "the smallest command or snippet that shows it"
    versions = { transformers = ">=5.0,<5.26" }  # optional: only while these versions match
                                                 # (EngineAdapter.engine_version: what the engine runs);
                                                 # outside the range, a failure the entry matches is
                                                 # "still reproduces on <version>", not a new failure
    needs = "greedy_reaches_eos"                 # optional: a precondition the finding needs of the checkpoint
                                                 # or workload (kvbench.conformance.preconditions.PRECONDITIONS);
                                                 # where the check records that it did not hold, the entry is
                                                 # "not exercised": neither stale nor excusing a failure

Every field is checked when the file is read; an error names the file, the entry and the field.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.conformance.preconditions import PRECONDITIONS

#: the files shipped with kvbench, per engine kind
SHIPPED = Path(__file__).parent / "expectations"


class ExpectationsError(ValueError):
    """A malformed expectations file; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class Expectation:
    """One expected failure. ``match`` pins its cause: a regex searched in the failure's message; an
    empty one (only possible when built in code: files must give one) pins nothing, so no failure is
    the expected one."""

    engine: str
    check: str
    reason: str
    reproduction: str
    versions: dict[str, str] = field(default_factory=dict)
    source: str = ""
    match: str = ""
    #: a precondition the finding needs (a key of kvbench.conformance.preconditions.PRECONDITIONS), or ""
    needs: str = ""

    def matches_check(self, check_id: str) -> bool:
        base = check_id.split("[", 1)[0]
        # an exact id first: a variant's id has brackets, which fnmatch would read as a character class
        return self.check in (check_id, base) or fnmatch.fnmatchcase(check_id, self.check) \
            or fnmatch.fnmatchcase(base, self.check)

    def applies(self, kind: str, check_id: str,
                version_of: Callable[[str], str | None] | None = None, family: str | None = None) -> bool:
        """True for engine ``kind`` (or ``family``) and ``check_id`` when every version range holds for the
        version ``version_of`` gives (default: what is installed here; a package it does not know never
        satisfies a range)."""
        return self.names(kind, check_id, family) and not self.versions_outside(version_of)

    def names(self, kind: str, check_id: str, family: str | None = None) -> bool:
        """Whether this entry is about engine ``kind`` (or ``family``) and ``check_id``, whatever the versions."""
        return self.engine in (kind, family) and self.matches_check(check_id)

    def versions_outside(self, version_of: Callable[[str], str | None] | None = None) -> dict[str, str | None]:
        """``{package: version}`` for each version range the engine's version does not satisfy (None: the
        version is not known); empty when the entry's ranges all hold."""
        from packaging.specifiers import SpecifierSet

        version_of = version_of or installed_version
        outside: dict[str, str | None] = {}
        for package, spec in self.versions.items():
            version = version_of(package)
            if version is None or not SpecifierSet(spec).contains(version, prereleases=True):
                outside[package] = version
        return outside

    def matches_failure(self, message: str) -> bool:
        """Whether a failure with this message is the expected one (``match`` found in it)."""
        return bool(self.match) and re.search(self.match, message) is not None

    def describe(self) -> str:
        versions = "".join(f", {p} {s}" for p, s in self.versions.items())
        needs = f", needs {self.needs}" if self.needs else ""
        return f"{self.engine} / {self.check}{versions}{needs}: {self.reason} (reproduce: {self.reproduction})"


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


_FIELDS = {"engine", "check", "match", "reason", "reproduction", "versions", "needs"}


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
        for name in ("engine", "check", "match", "reason", "reproduction"):
            if not isinstance(entry.get(name), str) or not entry[name].strip():
                hint = (" (a regex found in the expected failure's message: an entry pins what its failure looks "
                        "like, so that another failure of the same check is not swallowed)") if name == "match" else ""
                raise ExpectationsError(f"{where}: field {name!r} must be a non-empty string, got "
                                        f"{entry.get(name)!r}{hint}")
        try:
            re.compile(entry["match"])
        except re.error as e:
            raise ExpectationsError(f"{where}: field 'match' = {entry['match']!r} is not a valid regex: {e}") from None
        versions = entry.get("versions", {})
        if not isinstance(versions, dict):
            raise ExpectationsError(f"{where}: field 'versions' must be a table of package = \"specifier\"")
        for package, spec in versions.items():
            try:
                SpecifierSet(spec)
            except (InvalidSpecifier, TypeError):
                raise ExpectationsError(f"{where}: versions.{package} = {spec!r} is not a version specifier "
                                        "such as \">=5.24,<5.26\"") from None
        needs = entry.get("needs", "")
        if "needs" in entry and (not isinstance(needs, str) or needs not in PRECONDITIONS):
            raise ExpectationsError(f"{where}: field 'needs' = {needs!r} is not a known precondition (known: "
                                    f"{', '.join(sorted(PRECONDITIONS))}; see kvbench/conformance/preconditions.py)")
        out.append(Expectation(entry["engine"], entry["check"], entry["reason"].strip(),
                               entry["reproduction"].strip(), dict(versions), str(path), entry["match"], needs))
    return out


def matching(expectations: Sequence[Expectation], kind: str, check_id: str,
             version_of: Callable[[str], str | None] | None = None, family: str | None = None) -> Expectation | None:
    """The first expectation that applies, or None."""
    return next((e for e in expectations if e.applies(kind, check_id, version_of, family)), None)


def out_of_range(expectations: Sequence[Expectation], kind: str, check_id: str,
                 version_of: Callable[[str], str | None] | None = None,
                 family: str | None = None) -> tuple[Expectation, dict[str, str]] | None:
    """The first entry about this engine and check whose version range the engine's release is outside of,
    with the known versions it is outside on (``{package: version}``), or None. A failure it matches is the
    same finding on a newer (or older) release, "still reproduces on 5.25", told apart from a new failure;
    an unknown version is no release to speak of, so it never counts."""
    for expectation in expectations:
        if not expectation.names(kind, check_id, family):
            continue
        outside = expectation.versions_outside(version_of)
        if outside and all(v is not None for v in outside.values()):
            return expectation, {p: str(v) for p, v in outside.items()}
    return None
