"""Model versions as immutable, content-addressed manifests.

A manifest pins everything that decides what a model version answers: the bytes of its weights,
tokenizer, chat template and configs (one SHA-256 per file), its default sampling, its limits and
the engine options it needs, plus the size of its pools. Its `version` is computed from all of
that, never typed in: two manifests that point at different bytes (or sample differently) can
never share a version, and a manifest edited after the fact no longer validates. A `label`
("v2", "canary") is for people; the version is for machines.

    pdserve models manifest DIR --name NAME [--label L] [-o FILE]   write one
    pdserve models validate FILE...                                 recompute and check
    pdserve models diff A B                                         what differs, field by field
    pdserve models list FILE...                                     one line each

The checkpoint's path is recorded (`source`) but is not part of the version: the same files
copied elsewhere are the same version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import Field, FieldSerializationInfo, field_serializer, field_validator

from cluster.config import AppConfig, PoolOptions, ServingEngineOptions, Strict
from cluster.config.common import as_written, overlay
from cluster.config.models import SamplingDefaults, VersionOptions, check_name
from cluster.engine.model.identity import WEIGHT_SUFFIXES, file_sha256

# The files that decide a model's behaviour. Anything else in a checkpoint directory (a README,
# a licence, a .cache) neither changes the version nor needs to be present.
VERSIONED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json")
VERSIONED_SUFFIXES = WEIGHT_SUFFIXES
VERSION_HEX = 16  # 64 bits of SHA-256: a collision between two real versions is not a concern


class ManifestError(ValueError):
    """A manifest that does not hold: its files changed, its version does not match, bad fields."""


def versioned_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    if not root.is_dir():
        raise ManifestError(f"model directory {model_dir} does not exist")
    files = sorted(p for p in root.iterdir()
                   if p.is_file() and (p.name in VERSIONED_FILES or p.suffix in VERSIONED_SUFFIXES))
    if not any(p.name == "config.json" for p in files):
        raise ManifestError(f"no config.json in model directory {model_dir}")
    if not any(p.suffix in VERSIONED_SUFFIXES for p in files):
        raise ManifestError(f"no weights ({', '.join(VERSIONED_SUFFIXES)}) in model directory {model_dir}")
    return files


def hash_files(model_dir: str | Path) -> dict[str, str]:
    """{file name: sha256} of every versioned file (a 540 MB checkpoint: about a second)."""
    return {p.name: file_sha256(p) for p in versioned_files(model_dir)}


class ModelManifest(Strict):
    name: str = Field(description="The model id clients ask for (`model` in a request)")
    label: str | None = Field(None, description="A name for people (v2, canary); not part of the version")
    version: str = Field(description="sha256 of everything below (first 16 hex digits): computed, never chosen")
    source: str = Field(description="Where the files were hashed (not part of the version)")
    files: dict[str, str] = Field(description="Versioned file name -> sha256")
    sampling: SamplingDefaults = SamplingDefaults()
    max_model_len: int | None = Field(None, ge=1, description="None: the engine's (or the checkpoint's) limit")
    engine: ServingEngineOptions | None = Field(None, description="Engine options this version needs (laid over "
                                                "the app's key by key)")
    prefill: PoolOptions | None = Field(None, description="Its prefill pool's keys (the rest: the app's)")
    decode: PoolOptions | None = Field(None, description="Its decode pool's keys (the rest: the app's)")

    @field_serializer("engine", "prefill", "decode")
    def _as_written(self, section, info: FieldSerializationInfo):
        """The keys it was given: laid over the app's sections at deploy, the rest the app's."""
        return as_written(section, info)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name("name", v)

    @field_validator("label")
    @classmethod
    def _label(cls, v: str | None) -> str | None:
        return v if v is None else check_name("label", v)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def content(self) -> dict:
        """What the version is computed from: everything but the version, the label and the path."""
        return self.model_dump(mode="json", exclude={"version", "label", "source"})

    def computed_version(self) -> str:
        return compute_version(self.content())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelManifest":
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ManifestError(f"{path}: {e}") from e
        if not isinstance(raw, dict):
            raise ManifestError(f"{path}: a manifest is a mapping, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValueError as e:
            raise ManifestError(f"{path}: {e}") from e


def compute_version(content: dict) -> str:
    blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:VERSION_HEX]


def build_manifest(model_dir: str | Path, name: str, label: str | None = None, **fields) -> ModelManifest:
    """Hash the checkpoint's files and compute the version of `name` with these settings
    (sampling, max_model_len, engine, prefill, decode)."""
    draft = ModelManifest(name=name, label=label, version="", source=str(Path(model_dir).resolve()),
                          files=hash_files(model_dir), **fields)
    return draft.model_copy(update={"version": draft.computed_version()})


def check(manifest: ModelManifest, files: bool = True) -> list[str]:
    """What does not hold, one line each (empty: valid). `files`: also re-hash the checkpoint at
    `source` and compare every file (a missing, extra or changed file is named)."""
    problems = []
    if manifest.version != (want := manifest.computed_version()):
        problems.append(f"version {manifest.version} does not match its content ({want}): edited after it was built?")
    if files:
        try:
            actual = hash_files(manifest.source)
        except ManifestError as e:
            return problems + [str(e)]
        for name in sorted(manifest.files.keys() | actual.keys()):
            if name not in actual:
                problems.append(f"file {name}: in the manifest, missing from {manifest.source}")
            elif name not in manifest.files:
                problems.append(f"file {name}: in {manifest.source}, not in the manifest")
            elif actual[name] != manifest.files[name]:
                problems.append(f"file {name}: sha256 {actual[name][:12]}... != the manifest's {manifest.files[name][:12]}...")
    return problems


def check_set(manifests: list[ModelManifest]) -> list[str]:
    """Across manifests: one version per (name, label), never a label reused for other content."""
    problems, seen = [], {}
    for m in manifests:
        if m.label is None:
            continue
        other = seen.setdefault((m.name, m.label), m)
        if other.version != m.version:
            problems.append(f"{m.name} label {m.label!r} names two versions: {other.version} and {m.version}")
    return problems


def diff(a: ModelManifest, b: ModelManifest) -> list[str]:
    """Every difference between two manifests, one `path: a -> b` line each, in field order."""
    return _diff(a.model_dump(mode="json"), b.model_dump(mode="json"), "")


def _diff(a, b, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in b:
                out.append(f"{sub}: {_short(a[key])} -> (absent)")
            elif key not in a:
                out.append(f"{sub}: (absent) -> {_short(b[key])}")
            else:
                out += _diff(a[key], b[key], sub)
        return out
    return [] if a == b else [f"{path}: {_short(a)} -> {_short(b)}"]


def _short(v) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 80 else s[:77] + "..."


def resolve_manifests(config: AppConfig) -> AppConfig:
    """`config` with every version given by a manifest replaced by what the manifest pins (its
    checkpoint, engine with its max_model_len, pools and sampling defaults), after re-hashing the
    checkpoint: a version whose files changed is refused here, before anything deploys. The
    version's own keys are laid over the manifest's key by key (cluster.config.common.overlay),
    and both over the app's when the version is served (AppConfig.served_versions)."""
    if not any(v.manifest is not None for m in config.models.values() for v in m.versions.values()):
        return config
    models = {}
    for name, m in config.models.items():
        versions = {}
        for label, v in m.versions.items():
            if v.manifest is not None:
                where = f"models.{name}.versions.{label}"
                man = ModelManifest.from_file(v.manifest)
                if man.name != name:
                    raise ManifestError(f"{where}: manifest {v.manifest} is for model {man.name!r}")
                if problems := check(man):
                    raise ManifestError(f"{where}: manifest {v.manifest} does not hold: " + "; ".join(problems))
                engine = man.engine
                if man.max_model_len is not None:
                    engine = overlay(engine, ServingEngineOptions(max_model_len=man.max_model_len))
                v = VersionOptions(model=man.source, weight=v.weight, engine=overlay(engine, v.engine),
                                   prefill=overlay(man.prefill, v.prefill), decode=overlay(man.decode, v.decode),
                                   sampling=overlay(man.sampling, v.sampling))
            versions[label] = v
        models[name] = m.model_copy(update={"versions": versions})
    return config.model_copy(update={"models": models})
