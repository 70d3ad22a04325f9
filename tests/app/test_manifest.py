"""Model manifests: the version is the content (files, sampling, limits), never the path or label;
validate names what changed; diff lists every difference; the CLI's exit codes."""

from __future__ import annotations

import shutil

import pytest
import yaml

from cluster.app.cli import main
from cluster.manifest import ManifestError, ModelManifest, build_manifest, check, check_set, diff


@pytest.fixture
def ckpt(tiny_model, tmp_path):
    """A private copy of the tiny checkpoint (tests change its bytes), with a file that is not versioned."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_model, d)
    (d / "README.md").write_text("not part of the version\n")
    return d


def _weights(d):
    return next(p for p in d.iterdir() if p.suffix == ".safetensors")


def test_version_is_the_content_not_the_path_or_label(ckpt, tmp_path):
    a = build_manifest(ckpt, "tiny", "v1")
    copy = tmp_path / "elsewhere"
    shutil.copytree(ckpt, copy)
    (copy / "README.md").write_text("edited: still not part of the version\n")
    b = build_manifest(copy, "tiny", "canary")
    assert a.version == b.version and len(a.version) == 16
    assert a.source != b.source
    assert sorted(a.files) == sorted(p.name for p in ckpt.iterdir() if p.name != "README.md")

    w = _weights(copy)
    data = bytearray(w.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    w.write_bytes(bytes(data))
    c = build_manifest(copy, "tiny", "v1")
    assert c.version != a.version
    changed = [line.split(":")[0] for line in diff(a, c)]
    assert changed == ["version", "source", f"files.{w.name}"]
    assert diff(a, c)[2] == f'files.{w.name}: "{a.files[w.name]}" -> "{c.files[w.name]}"'


def test_sampling_and_limits_are_part_of_the_version(ckpt):
    base = build_manifest(ckpt, "tiny")
    hot = build_manifest(ckpt, "tiny", sampling={"temperature": 0.7})
    short = build_manifest(ckpt, "tiny", max_model_len=256)
    assert len({base.version, hot.version, short.version}) == 3
    assert [line.split(":")[0] for line in diff(base, hot)] == ["version", "sampling.temperature"]
    assert diff(base, base) == []


def test_validate_names_the_changed_missing_and_extra_file(ckpt):
    m = build_manifest(ckpt, "tiny")
    assert check(m) == []
    w = _weights(ckpt)
    w.write_bytes(w.read_bytes()[:-4])
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    (ckpt / "vocab.json").write_text("{}")
    problems = check(m)
    assert [p.split(":")[0] for p in problems] == sorted(
        [f"file {w.name}", "file vocab.json"] + (["file generation_config.json"] if "generation_config.json" in m.files else []))
    assert any("missing from" in p for p in problems) == ("generation_config.json" in m.files)
    assert "in the manifest, missing" not in problems[[p.split(":")[0] for p in problems].index("file vocab.json")]


def test_an_edited_manifest_no_longer_validates(ckpt, tmp_path):
    m = build_manifest(ckpt, "tiny", "v1")
    path = tmp_path / "m.yaml"
    raw = yaml.safe_load(m.to_yaml())
    raw["sampling"]["temperature"] = 0.2  # a hand edit that keeps the version string
    path.write_text(yaml.safe_dump(raw))
    edited = ModelManifest.from_file(path)
    assert edited.sampling.temperature == 0.2
    assert check(edited, files=False) == [
        f"version {m.version} does not match its content ({edited.computed_version()}): edited after it was built?"]


def test_a_label_names_one_version(ckpt):
    a = build_manifest(ckpt, "tiny", "stable")
    b = build_manifest(ckpt, "tiny", "stable", sampling={"top_k": 5})
    assert check_set([a, a]) == []
    assert check_set([a, b]) == [f"tiny label 'stable' names two versions: {a.version} and {b.version}"]


@pytest.mark.parametrize("bad, field", [({"name": "has space"}, "name"), ({"name": ""}, "name"),
                                        ({"label": "x" * 65}, "label"), ({"max_model_len": 0}, "max_model_len"),
                                        ({"sampling": {"top_p": 0}}, "top_p"), ({"extra": 1}, "extra")])
def test_bad_fields_are_refused_by_name(ckpt, tmp_path, bad, field):
    raw = build_manifest(ckpt, "tiny").model_dump(mode="json") | bad
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ManifestError, match=field):
        ModelManifest.from_file(path)


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ManifestError, match="no weights"):
        build_manifest(tmp_path, "x")


def test_cli_manifest_validate_diff_list(ckpt, tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert main(["models", "manifest", str(ckpt), "--name", "tiny", "--label", "v1", "-o", str(a)]) == 0
    assert main(["models", "manifest", str(ckpt), "--name", "tiny", "--label", "v2", "--temperature", "0.5",
                 "-o", str(b)]) == 0
    ma, mb = ModelManifest.from_file(a), ModelManifest.from_file(b)
    capsys.readouterr()
    assert main(["models", "validate", str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{a}: {ma.ref} ok", f"{b}: {mb.ref} ok"]
    assert main(["models", "diff", str(a), str(b)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        'label: "v1" -> "v2"', f'version: "{ma.version}" -> "{mb.version}"', "sampling.temperature: null -> 0.5"]
    assert main(["models", "diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out == "identical\n"
    assert main(["models", "list", str(a)]) == 0
    assert capsys.readouterr().out.split()[:3] == ["tiny", "v1", ma.version]

    w = _weights(ckpt)
    w.write_bytes(w.read_bytes()[::-1])
    assert main(["models", "validate", str(a)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{a}: {ma.ref} INVALID" and out[1].startswith(f"  file {w.name}: sha256 ")
    assert main(["models", "validate", "--no-files", str(a)]) == 0
    assert main(["models", "validate", str(tmp_path / "absent.yaml")]) == 2
