"""Tests for scripts/assets.py: checksums, atomic writes, caching, and (slow) the real assets."""

import hashlib
import json
import re
from pathlib import Path

import pytest

from dpo_megatron.utils.cache import CACHE_ENV, cache_root
from dpo_megatron.utils.files import _umask, atomic_dir
from tests.scripts import load_script

assets = load_script("assets")
AssetError, FileCheck = assets.AssetError, assets.FileCheck


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_root_from_env(tmp_cache, monkeypatch):
    assert cache_root() == tmp_cache
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root() == Path.home() / ".cache" / "dpo_megatron"


def test_verify_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    good = FileCheck("f.bin", 3, hashlib.sha256(b"abc").hexdigest())
    assert (
        assets.sha256_file(path)
        == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
    assets.verify_file(path, good)
    with pytest.raises(AssetError, match=r"f.bin: .* has 3 bytes, expected 4"):
        assets.verify_file(path, FileCheck("f.bin", 4, good.sha256))
    with pytest.raises(AssetError, match="has sha256 ba7816bf.*expected 0000"):
        assets.verify_file(path, FileCheck("f.bin", 3, "0" * 64))
    with pytest.raises(AssetError, match="does not exist"):
        assets.verify_file(tmp_path / "missing", good)


def test_atomic_dir_renames_on_success_and_cleans_on_error(tmp_path):
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        (Path(tmp) / "a.txt").write_text("1")
        assert not final.exists()
    assert (final / "a.txt").read_text() == "1"
    assert final.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not mkdtemp's private 0o700
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(final) as tmp:
            (Path(tmp) / "a.txt").write_text("2")
            raise RuntimeError("boom")
    assert (final / "a.txt").read_text() == "1"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left behind


def test_manifest_validity(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"hello")
    assert not assets._manifest_valid(folder)
    assets._write_manifest(folder, "test")
    manifest = json.loads((folder / assets.MANIFEST).read_text())
    assert manifest["files"] == {
        "x.bin": {"size": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}
    }
    assert assets._manifest_valid(folder, full=True)
    (folder / "x.bin").write_bytes(b"jello")  # same size, different content
    assert assets._manifest_valid(folder)
    assert not assets._manifest_valid(folder, full=True)
    (folder / "x.bin").write_bytes(b"hi")
    assert not assets._manifest_valid(folder)


def test_pip_failure_is_a_clear_error():
    with pytest.raises(AssetError, match="testing pip: .*failed with exit code"):
        assets._run_pip(["--no-such-option-xyz"], "testing pip")


def test_package_dir_finds_installed_package():
    folder = assets.package_dir(assets.SMOLLM2_MODULE, assets.SMOLLM2_PACKAGE)
    assert (folder / assets.SMOLLM2_GGUF.name).is_file()


def test_sentencepiece_model_cached_and_repaired(tmp_cache, monkeypatch):
    """Read from the downloaded mistral-common wheel; pip never installs anything (an
    install made transformers take its Mistral-format branch for Mistral-family folders)."""
    pip_calls = []
    run_pip = assets._run_pip
    monkeypatch.setattr(
        assets, "_run_pip", lambda args, what: (pip_calls.append(args[0]), run_pip(args, what))
    )
    path = assets.ensure_sentencepiece_model()
    assert path == tmp_cache / "mistral-sentencepiece" / "tokenizer.model"
    assert path.stat().st_size == 493_443
    assert assets.sha256_file(path) == assets.MISTRAL_SP_MODEL.sha256
    mtime = path.stat().st_mtime_ns
    assert assets.ensure_sentencepiece_model() == path
    assert path.stat().st_mtime_ns == mtime  # valid cache: no work
    path.write_bytes(b"corrupt")
    assert assets.ensure_sentencepiece_model() == path
    assert assets.sha256_file(path) == assets.MISTRAL_SP_MODEL.sha256
    assert pip_calls == ["download", "download"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokenizer.model"]  # no wheel left

    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert (sp.vocab_size(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (32000, 0, 1, 2)


def test_cli_rejects_unknown_asset(capsys):
    with pytest.raises(SystemExit):
        assets.main(["nope"])
    assert "unknown asset(s) ['nope']" in capsys.readouterr().err


@pytest.mark.slow
def test_llamafactory_demo_files():
    """Real download (pip, ~25 s the first time; cached in the default cache afterwards)."""
    dpo = assets.ensure_dpo_en_demo()
    alpaca = assets.ensure_alpaca_en_demo()
    assert dpo.parent == alpaca.parent
    rows = json.loads(dpo.read_text())
    assert len(rows) == 300
    assert set(rows[0]) == {"conversations", "chosen", "rejected"}
    assert len(json.loads(alpaca.read_text())) == 999


@pytest.mark.slow
def test_smollm2_export():
    """Real export (~30-60 s the first time; cached afterwards); checks the folder and tokenizer."""
    folder = assets.ensure_smollm2()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (
        576,
        30,
        3,
    )
    assert config["tie_word_embeddings"] is True
    digest, numel = assets.tensors_sha256(folder / "model.safetensors")
    assert (digest, numel) == (assets.SMOLLM2_TENSORS_SHA256, 134_515_008)

    from transformers import AutoTokenizer

    assert (
        json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "GPT2Tokenizer"
    )
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok("Hello")["input_ids"] == [19556]  # no BOS
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_setup_removes_a_partial_mistral_common(tmp_path):
    """What scripts/setup.sh runs first: in a fresh venv holding mistral-common installed
    ``--no-deps`` (as earlier set-ups left it), the package is uninstalled with one line
    saying why; a second run finds nothing to do."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", assets.MISTRAL_COMMON_PACKAGE],
        check=True,
        capture_output=True,
    )
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    probe = "import importlib.util; print(importlib.util.find_spec('mistral_common') is not None)"

    def run(*args):
        return subprocess.run([python, *args], env=env, capture_output=True, text=True)

    assert run("-c", probe).stdout == "True\n"
    first = run(str(root / "scripts" / "assets.py"), "--remove-partial-mistral-common")
    assert first.returncode == 0, first.stderr
    assert re.fullmatch(
        rf"removed mistral-common from {re.escape(str(venv))}: installed without "
        r"its dependencies \(no \w+\), it made transformers fail on every "
        r"Mistral-family tokenizer\n",
        first.stdout,
    ), first.stdout
    assert run("-c", probe).stdout == "False\n"
    second = run(str(root / "scripts" / "assets.py"), "--remove-partial-mistral-common")
    assert (second.returncode, second.stdout) == (0, "")


def test_the_runtime_looks_up_where_the_builders_write(tmp_cache):
    from dpo_megatron.utils.cache import ASSET_PATHS, asset_path

    assert sorted(ASSET_PATHS) == sorted(assets.ASSETS)
    built = {
        "smollm2": assets.smollm2_dir(),
        "dpo_en_demo": assets.llamafactory_dir() / assets.DPO_EN_DEMO.name,
        "dpo_zh_demo": assets.llamafactory_dir() / assets.DPO_ZH_DEMO.name,
        "alpaca_en_demo": assets.llamafactory_dir() / assets.ALPACA_EN_DEMO.name,
        "kto_en_demo": assets.llamafactory_dir() / assets.KTO_EN_DEMO.name,
        "sentencepiece": tmp_cache / "mistral-sentencepiece" / "tokenizer.model",
        "word_count_prompts": assets.ensure_word_count_prompts(),
    }
    assert {name: tmp_cache / rel for name, rel in ASSET_PATHS.items()} == built
    with pytest.raises(
        FileNotFoundError, match=r"build it with `python scripts/assets.py smollm2`"
    ):
        asset_path("smollm2")
    built["smollm2"].mkdir(parents=True)
    assert asset_path("smollm2") == built["smollm2"]
    with pytest.raises(ValueError, match="unknown asset 'nope'; known: "):
        asset_path("nope")


def test_the_judge_prompts_are_made_here_and_remade_when_they_differ(tmp_cache):
    from dpo_megatron.online.judges import word_count_prompts

    path = assets.ensure_word_count_prompts()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == word_count_prompts(600, seed=0)
    stamp = path.stat().st_mtime_ns
    assert assets.ensure_word_count_prompts() == path and path.stat().st_mtime_ns == stamp
    path.write_text('{"prompt": "edited"}\n')
    assets.ensure_word_count_prompts()
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
