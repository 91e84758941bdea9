"""The documentation cannot drift from the tree: the README's layout map names exactly the
package's top-level modules and packages, in the order of their import floors; every relative
link (and the section it points at) and every repository path named in README.md, docs/*.md and
the package READMEs exists; the README stays a short map that starts with the fresh-machine
commands and links every topic page."""

import configparser
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dpo_megatron"
DOC_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PAGES = sorted([*DOC_PAGES, *PACKAGE.glob("*/README.md")])


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _layout_map() -> list[str]:
    """The entries under ``dpo_megatron/`` in the README's layout block, in order."""
    section = _read(ROOT / "README.md").split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1).splitlines()
    start = block.index("dpo_megatron/")
    entries = []
    for line in block[start + 1 :]:
        if not line.startswith("  "):
            break
        match = re.match(r"  (\S+?)(/|\.py)\s", line + " ")
        if match:
            entries.append(match.group(1))
    return entries


def _top_level() -> set[str]:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    return modules | packages


def _floors() -> dict[str, int]:
    """Top-level name -> its floor in .importlinter's layers contract (0 is the top)."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    layers = parser["importlinter:contract:layers"]["layers"].strip().splitlines()
    return {
        name.strip().removeprefix("dpo_megatron."): floor
        for floor, layer in enumerate(layers)
        for name in layer.split("|")
    }


def test_the_layout_map_names_every_top_level_module_and_package_once_by_floor():
    """A module or package added, renamed or removed under dpo_megatron/ must be drawn in the
    README's layout map, once, on its import floor (the map runs top floor first)."""
    entries = _layout_map()
    assert len(entries) == len(set(entries)), entries
    assert set(entries) == _top_level(), (
        f"missing from the map: {sorted(_top_level() - set(entries))}; "
        f"not in the package: {sorted(set(entries) - _top_level())}"
    )
    floors = _floors()
    order = [floors[name] for name in entries]
    assert order == sorted(order), list(zip(entries, order))


_NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def test_the_layout_prose_says_which_entries_share_a_floor_as_importlinter_does():
    """The sentence under the map ("The first six entries share the top floor and `online/`
    shares one with `planning/`") names the top floor's size and every other shared floor: a
    module moved to or from a floor fails here until the sentence says so."""
    section = _read(ROOT / "README.md").split("\n## Layout\n", 1)[1].split("```", 1)[0]
    prose = " ".join(section.split())
    count = re.search(r"The first (\w+) entries share the top floor", prose).group(1)
    floors = _floors()
    assert _NUMBERS[count] == sum(1 for floor in floors.values() if floor == 0)
    named = re.findall(r"`(\w+)(?:/|\.py)` shares? one with `(\w+)(?:/|\.py)`", prose)
    assert all(floors[a] == floors[b] for a, b in named), named
    shared = {
        floor
        for floor in set(floors.values()) - {0}
        if sum(1 for f in floors.values() if f == floor) > 1
    }
    assert shared == {floors[a] for a, _ in named}, (named, shared)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", text, re.M)
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_its_section_exist(page):
    """A link to a file that moved, or to a section whose heading changed, fails here."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such section")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


_TOP = {"dpo_megatron", "scripts", "configs", "tests", "docs", ".ci"}


def _named_paths(text: str) -> set[str]:
    """Repository paths a page names: in code spans and in code blocks, e.g.
    ``dpo_megatron/models/presets.py::MODEL_PRESETS``, ``data/unpaired.py`` (a package's
    module), ``scripts/pretrain_dpo.sh``. Placeholders (``configs/MY.yaml``, ``<run_dir>/...``)
    and globs are not paths."""
    words = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        words += block.split()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", text):
        words += span.split()
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    paths = set()
    for word in words:
        word = word.split("::")[0].rstrip(".,;:)'\"").lstrip("('\"")
        parts = word.split("/")
        if len(parts) < 2 or parts[0] not in _TOP | packages | {"conversion", "architectures"}:
            continue
        if re.search(r"[<>{}*$~|]", word) or any(
            re.fullmatch(r"[A-Z][A-Z_]+(\.\w+)?", part) for part in parts
        ):
            continue
        paths.add(word)
    return paths


def _exists(path: str) -> bool:
    """At the repository root, under dpo_megatron/, or (a path relative to a package, e.g.
    ``architectures/gpt_oss.py``) as the end of a path under dpo_megatron/."""
    if (ROOT / path).exists() or (PACKAGE / path).exists():
        return True
    return any(str(p).endswith("/" + path.rstrip("/")) for p in PACKAGE.rglob("*"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    """A file or folder named on a page (a module, a script, a config, a test) that is renamed
    or removed fails here."""
    missing = sorted(path for path in _named_paths(_read(page)) if not _exists(path))
    assert not missing, f"{page.relative_to(ROOT)} names {missing}"


def test_the_readme_is_a_short_map_that_starts_with_the_fresh_machine_commands():
    """The README stays under 300 lines; its first section and first commands set up a fresh
    machine and run the main job, then the tests; it links every topic page of docs/."""
    readme = _read(ROOT / "README.md")
    assert len(readme.splitlines()) <= 300
    assert re.findall(r"^## (.*)$", readme, re.M)[0] == "On a fresh machine"
    first, second = re.findall(r"```bash\n(.*?)```", readme, re.S)[:2]
    assert first.strip() == "bash scripts/setup.sh && scripts/pretrain_dpo.sh"
    assert second.strip().startswith("bash scripts/setup.sh && .venv/bin/python -m pytest")
    linked = set(re.findall(r"\]\(docs/([^)#]+)", readme))
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_data_md_names_every_reason_a_row_is_dropped_for():
    """Each ``Filtered("reason")`` the data path raises (a row dropped and counted, not an error)
    is named in DATA.md's Bad rows section: a new drop reason fails here until the page has it."""
    raised = {
        reason
        for module in (PACKAGE / "data").glob("*.py")
        for reason in re.findall(r'Filtered\("(\w+)"\)', _read(module))
    }
    assert {"empty_completion", "empty_prompt", "identical", "prompt_too_long"} <= raised
    section = _read(ROOT / "docs" / "DATA.md").split("## Bad rows", 1)[1].split("\n## ", 1)[0]
    assert sorted(r for r in raised if f"`{r}`" not in section) == []


def test_step_md_counts_the_architectures_the_bf16_test_trains():
    """STEP.md's count of the architectures ``test_bf16_architectures.py`` trains is the number
    it trains (``FAMILIES``): a new family fails here until the page counts it."""
    from tests.models.conversion_helpers import FAMILIES
    from tests.training.test_bf16_architectures import ARCHITECTURES

    assert ARCHITECTURES == FAMILIES
    assert f"trains all {len(FAMILIES)} architectures" in _read(ROOT / "docs" / "STEP.md")


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if p.name != "BENCHMARKS.md"],  # it records the commands as they were run
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_a_documented_engine_command_runs_under_the_launcher_not_bare_torchrun(page):
    """A page's command for several ranks of an entry point (``-m dpo_megatron.generate``, ...)
    or a converter starts ``python -m dpo_megatron.launch``: under bare ``torchrun`` a mistake
    the ranks report in one line (a world size that does not fit the layout) is followed by
    torchrun's failure block and traceback."""
    bare = re.findall(
        r"\.venv/bin/torchrun [^`\n]*(?:-m dpo_megatron\.\w+|scripts/convert_\w+\.py)", _read(page)
    )
    assert not bare, f"{page.relative_to(ROOT)}: use python -m dpo_megatron.launch in {bare}"


def test_the_presets_table_names_every_model_preset():
    """HF_CONVERSION.md's Presets table, the page the other pages send ``model=NAME`` readers to,
    names exactly ``MODEL_PRESETS``: a preset added or renamed fails here until the table has
    it."""
    from dpo_megatron.models.presets import MODEL_PRESETS

    section = _read(ROOT / "docs" / "HF_CONVERSION.md").split("\n## Presets\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    named = {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}
    assert named == set(MODEL_PRESETS), (
        f"not in the table: {sorted(set(MODEL_PRESETS) - named)}; "
        f"not a preset: {sorted(named - set(MODEL_PRESETS))}"
    )


def test_running_md_lists_every_section_of_the_config_tree():
    """RUNNING.md's Configuration table has one row per field of ``DPOConfig``, with its class:
    a section added to the tree (or a class renamed) fails here until the table has it."""
    import dataclasses

    from dpo_megatron.config import DPOConfig

    section = _read(ROOT / "docs" / "RUNNING.md").split("\n## Configuration\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    cells = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    rows = {re.match(r"`(\w+)", c[1].strip()).group(1): c[2].strip() for c in cells}
    fields = {f.name: str(f.type) for f in dataclasses.fields(DPOConfig)}
    assert set(rows) == set(fields), (
        sorted(set(fields) - set(rows)),
        sorted(set(rows) - set(fields)),
    )
    classes = {
        name: cls.strip("`") for name, cls in rows.items() if re.fullmatch(r"`[A-Z]\w+`", cls)
    }
    assert classes == {name: fields[name] for name in classes}


def _frontend_keys(name: str) -> set[str]:
    if name == "trl":
        from dpo_megatron.frontends.trl import known_fields

        return set(known_fields())
    from dpo_megatron.frontends.dpo_repo import REFERENCE_DEFAULTS

    return set(REFERENCE_DEFAULTS)


@pytest.mark.parametrize("frontend, table", [("trl", "Field by field"), ("dpo_repo", "Key by key")])
def test_coming_from_md_names_every_key_the_translators_read(frontend, table):
    """COMING_FROM.md's tables have a row for each key a front door translates or accepts
    (``frontends.trl.known_fields``, ``frontends.dpo_repo.REFERENCE_DEFAULTS``): a key added
    there fails here until its table says what it becomes."""
    section = _read(ROOT / "docs" / "COMING_FROM.md").split(f"### {table}\n", 1)[1]
    section = section.split("\n#", 1)[0]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    named = {name for cell in first_cells for name in re.findall(r"`([\w.]+)", cell)}
    assert sorted(_frontend_keys(frontend) - named) == []


_NOT_KEYS = {"py", "json", "jsonl", "log", "yaml", "md", "pt", "txt", "csv", "parquet", "arrow"}


def _config_keys() -> set[str]:
    """Every dotted key of the config tree, every ``loss.`` key some loss or modifier takes,
    and the reference DPO repo's keys (COMING_FROM.md names them as that repo spells them)."""
    import dataclasses

    import dpo_megatron.losses  # noqa: F401  (registers the losses)
    from dpo_megatron.config import DPOConfig
    from dpo_megatron.frontends.dpo_repo import REFERENCE_DEFAULTS
    from dpo_megatron.losses.registry import LOSSES

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            yield prefix + f.name
            if dataclasses.is_dataclass(value):
                yield from walk(value, f"{prefix}{f.name}.")

    keys = set(walk(DPOConfig(), ""))
    modifiers = {"name", "weights", "sft_weight", "use_weighting", "ld_alpha", "reference_free"}
    keys |= {f"loss.{p}" for p in modifiers.union(*(spec.params for spec in LOSSES.values()))}
    return keys | set(REFERENCE_DEFAULTS)


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_every_config_key_a_page_names_exists(page):
    """A ``section.key`` in a page's inline code (``loss.beta``, ``train.train_iters=2``,
    ``data.max_length``) is a key of the config tree or of a registered loss: a key renamed or
    removed fails here. File names (``train.py``), calls (``model.cuda()``), globs and
    truncated words and modules (``data.batch``) are not keys."""
    keys = _config_keys()
    sections = {key.split(".")[0] for key in keys if "." in key}
    text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
    unknown = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for match in re.finditer(r"(?<![\w./$-])([a-z_]+(?:\.[a-z_0-9]+)+)(\(|\*|\.\.\.)?", span):
            key, after = match.groups()
            parts = key.split(".")
            module = PACKAGE.joinpath(*parts[:2])
            if after or parts[0] not in sections or parts[-1] in _NOT_KEYS:
                continue
            if module.with_suffix(".py").exists() or module.is_dir():  # data.batch: a module
                continue
            if key not in keys and not any(k.startswith(key + ".") for k in keys):
                unknown.add(key)
    assert not unknown, f"{page.relative_to(ROOT)} names {sorted(unknown)}"


def test_the_readme_counts_the_losses_and_model_types_the_registries_hold():
    """The README's "**23 losses**" is ``len(LOSSES)`` and its "**13 Hugging Face model
    types**" is ``len(ARCHITECTURES)``: a loss or an architecture added fails here until the
    count follows."""
    import dpo_megatron.losses  # noqa: F401  (registers the losses)
    from dpo_megatron.losses.registry import LOSSES
    from dpo_megatron.models.conversion.architectures import ARCHITECTURES

    readme = _read(ROOT / "README.md")
    assert f"**{len(LOSSES)} losses**" in readme
    assert f"**{len(ARCHITECTURES)} Hugging Face model types**" in readme
