"""The reference DPO repo's command line (Rafailov et al. 2023, ``train.py`` + ``config/*.yaml``)
on this engine: translate, print the equivalent ``scripts/pretrain_dpo.sh`` /
``scripts/pretrain_sft.sh`` command, run it.

    python -m dpo_megatron.frontends.dpo_repo model=pythia69 datasets=[hh] loss=sft \\
        exp_name=anthropic_dpo_pythia69 gradient_accumulation_steps=2 batch_size=64 \\
        eval_batch_size=32 trainer=FSDPTrainer sample_during_eval=false
    bash scripts/train_reference_style.sh ...        # the same
    python -m dpo_megatron.frontends.dpo_repo --dry-run ...   # print the translation only
    python -m dpo_megatron.frontends.dpo_repo --trl dpo_config.yaml [our k=v ...]  # TRL fields

Every key of the reference repo's ``config.yaml`` / ``loss`` / ``model`` groups is accepted
(:data:`REFERENCE_DEFAULTS`); an unknown key is an error listing them. Keys without an
equivalent here are named in the printed notes, never silently dropped. ``engine.<our key>=v``
passes one of our own keys through (``engine.data.shp_max_pairs_per_post=0``).

What is translated how (docs/COMING_FROM.md's "Key by key" table lists every key):
``batch_size`` is the global batch in pairs, ``gradient_accumulation_steps`` the micro-batches
per step, ``trainer`` a layout over the visible devices (:func:`layout_for`), ``eval_every`` and
``n_examples`` count examples (divided by ``batch_size`` into steps), ``n_epochs`` counts passes
over the pairs left after preprocessing (counted here, with the engine's own data pipeline),
``datasets`` names ``hh`` / ``shp`` / ``se`` (hub datasets) or local files and folders, read with
``data.reference_preprocessing`` (the reference repo's text prompts): their train split trains and
their test split (``data.eval_datasets``, ``data.eval_split=test``; a local folder's test files)
is the eval set that ``eval_every``, ``eval_batch_size``, ``n_eval_examples`` and
``do_first_eval`` act on, as there (:func:`eval_overrides`), and ``model.archive``
(a reference-repo ``policy.pt``) becomes an HF folder (``checkpointing.dpo_repo_archive``) that
is loaded as the policy and the reference. After a run, its final policy is written as
``<run dir>/LATEST/policy.pt``, as the reference trainer does, so the README's SFT line feeds its
DPO line.
"""

from __future__ import annotations

import datetime
import getpass
import importlib.util
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from dpo_megatron.frontends.common import ROOT, FrontendError, count_items
from dpo_megatron.utils.run_layout import RunLayout

BASE_CONFIG = os.path.join("configs", "reference_dpo.yaml")

REFERENCE_DEFAULTS: dict[str, Any] = {
    # config/config.yaml
    "seed": 0,
    "exp_name": None,
    "batch_size": 4,
    "eval_batch_size": 16,
    "debug": False,
    "fsdp_port": None,
    "datasets": ["hh"],
    "wandb.enabled": True,
    "wandb.entity": None,
    "wandb.project": "direct-preference-optimization",
    "local_dirs": ["/scr-ssd", "/scr", ".cache"],
    "local_run_dir": None,
    "sample_during_eval": True,
    "n_eval_model_samples": 16,
    "do_first_eval": True,
    "lr": 5e-7,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 10.0,
    "max_length": 512,
    "max_prompt_length": 256,
    "n_epochs": 1,
    "n_examples": None,
    "n_eval_examples": 256,
    "trainer": "BasicTrainer",
    "optimizer": "RMSprop",
    "warmup_steps": 150,
    "activation_checkpointing": False,
    "eval_every": 20_000,
    "minimum_log_interval_secs": 1.0,
    # config/model/*.yaml
    "model": "blank_model",
    "model.name_or_path": None,
    "model.tokenizer_name_or_path": None,
    "model.archive": None,
    "model.block_name": None,
    "model.policy_dtype": "float32",
    "model.fsdp_policy_mp": None,
    "model.reference_dtype": "float16",
    # config/loss/*.yaml
    "loss": "sft",
    "loss.beta": None,
    "loss.label_smoothing": 0.0,
    "loss.reference_free": False,
}
"""Every key the reference repo's Hydra config has, with its default there."""

REFERENCE_DATASETS: dict[str, tuple[str, str]] = {
    "hh": ("Anthropic/hh-rlhf", "hh"),
    "shp": ("stanfordnlp/SHP", "shp"),
    "se": ("HuggingFaceH4/stack-exchange-preferences", "se"),
}
"""``datasets=[name]`` -> (hub dataset, our row format); ``preference_datasets.get_dataset``."""

REFERENCE_MODELS: dict[str, str] = {
    # config/model/*.yaml of the reference repo (name_or_path)
    "gpt2-large": "gpt2-large",
    "gpt2-xl": "gpt2-xl",
    "gptj": "EleutherAI/gpt-j-6b",
    "llama7b": "huggyllama/llama-7b",
    "pythia28": "EleutherAI/pythia-2.8b",
    "pythia69": "EleutherAI/pythia-6.9b",
    # the smaller Pythia models, named the same way
    "pythia70m": "EleutherAI/pythia-70m",
    "pythia160m": "EleutherAI/pythia-160m",
    "pythia410m": "EleutherAI/pythia-410m",
    "pythia1b": "EleutherAI/pythia-1b",
    "pythia14": "EleutherAI/pythia-1.4b",
}
"""The reference repo's ``model=`` names -> the hub model they name. Used only for a name that
``models.presets.MODEL_PRESETS`` (the one preset table, which resolves local copies) does not
have yet: it then becomes ``model.hf_path=<hub name>``. A name moves into MODEL_PRESETS once its
architecture's facts are recorded there."""

TRAINERS = ("BasicTrainer", "FSDPTrainer", "TensorParallelTrainer")
LOSSES = ("sft", "dpo", "ipo")
OPTIMIZERS = ("RMSprop", "Adam", "AdamW", "SGD")
POLICY_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


# ----------------------------------------------------------------------------------------------
# parsing


def _value(text: str) -> Any:
    """A Hydra-style value: YAML (lists ``[hh,shp]``, ``true``, ``null``, ``20_000``), and
    numbers YAML 1.1 reads as strings (``5e-7``)."""
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def parse_args(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``key=value`` words -> (the reference config with them applied, our passthrough keys).

    Raises:
        FrontendError: a word without ``=``, or a key the reference repo does not have
            (the message lists the keys it has).
    """
    args = dict(REFERENCE_DEFAULTS)
    engine: list[str] = []
    for word in argv:
        key, sep, text = word.partition("=")
        key = key.lstrip("+")  # Hydra's +key= / ++key= add or force a key: the same here
        if not sep:
            raise FrontendError(f"expected key=value, got {word!r}")
        if key.startswith("engine."):
            engine.append(f"{key[len('engine.') :]}={text}")
            continue
        if key not in REFERENCE_DEFAULTS:
            import difflib

            close = difflib.get_close_matches(key, REFERENCE_DEFAULTS, n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise FrontendError(
                f"unknown key {key!r} of the reference DPO repo's command line.{hint} Known keys: "
                f"{', '.join(REFERENCE_DEFAULTS)} (and engine.<key of ours>=value)"
            )
        args[key] = _value(text)
    return args, engine


# ----------------------------------------------------------------------------------------------
# translation


@dataclass
class Layout:
    """``trainer=`` as our parallel layout."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    description: str = ""


def visible_devices() -> int:
    """Accelerators this launcher would use: ``CUDA_VISIBLE_DEVICES`` entries, else what torch
    counts; 1 (one CPU process) when there is none. The reference repo uses
    ``torch.cuda.device_count()`` the same way."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"]) or 1
    import torch

    return max(torch.cuda.device_count(), 1)


def layout_for(trainer: str, devices: int) -> Layout:
    """The reference repo's trainer class over ``devices`` accelerators, as a layout.

    - ``BasicTrainer``: one process, the model's layers spread over the devices
      (``device_map='balanced'``) and run one after the other: pipeline parallel over them.
    - ``FSDPTrainer``: one process per device, each a data-parallel replica, parameters,
      gradients and optimizer state sharded: data parallel with the optimizer state sharded
      (megatron-core's distributed optimizer, ZeRO-1; parameters stay whole).
    - ``TensorParallelTrainer``: every layer split over the devices (``tensor_parallel``):
      tensor parallel.

    Raises:
        FrontendError: an unknown trainer (lists the three).
    """
    if trainer == "BasicTrainer":
        return Layout(
            pipeline_model_parallel_size=devices,
            description=f"layers split over {devices} device(s), run in turn "
            f"(device_map='balanced') -> pipeline parallel {devices}",
        )
    if trainer == "FSDPTrainer":
        return Layout(
            data_parallel_size=devices,
            description=f"{devices} FSDP replica(s) -> data parallel {devices}, "
            f"optimizer state sharded (ZeRO-1; parameters are not sharded)",
        )
    if trainer == "TensorParallelTrainer":
        return Layout(
            tensor_model_parallel_size=devices,
            description=f"layers split over {devices} device(s) -> tensor parallel {devices}",
        )
    raise FrontendError(
        f"trainer={trainer}: unknown trainer; the reference repo has {', '.join(TRAINERS)}"
    )


@dataclass
class Translation:
    """A reference command in our terms."""

    script: str
    """``scripts/pretrain_sft.sh`` or ``scripts/pretrain_dpo.sh``."""
    overrides: list[str]
    """Our ``key=value`` overrides, on top of :data:`BASE_CONFIG`."""
    run_dir: str
    layout: Layout
    notes: list[str] = field(default_factory=list)
    """What differs from the reference repo, one line each (printed)."""
    archive: str | None = None
    """``model.archive``: converted to ``archive_dir`` before the run."""
    archive_dir: str | None = None
    base_model: str | None = None
    """The model the archive was trained from (its config.json), when known here."""
    eval_sets: list[str] = field(default_factory=list)
    """The datasets whose test split is the eval set (``data.eval_datasets``)."""
    epochs: int | None = None
    """``n_epochs`` when the step count still needs the number of pairs (see ``steps_for``)."""
    examples: int | None = None
    batch_size: int = 1
    sft: bool = False
    steps: int | None = None
    """The run's optimizer steps (``train.train_iters``), once known: counted by
    :func:`prepare`, or given as ``engine.train.train_iters``; None in a dry run that would
    need the pairs counted."""

    config: str = BASE_CONFIG

    def command(self) -> list[str]:
        return ["bash", self.script, "--config", self.config, *self.overrides]

    def run(self, dry_run: bool = False) -> int:
        """Print the notes and the command, then (unless ``dry_run``) run it from the
        repository root's scripts; returns its exit status (0 for a dry run)."""
        for note in self.notes:
            print(f"note: {note}")
        print("translated command:")
        print("  " + shlex.join(self.command()))
        sys.stdout.flush()
        if dry_run:
            return 0
        script, config = os.path.join(ROOT, self.script), os.path.join(ROOT, self.config)
        return subprocess.call(["bash", script, "--config", config, *self.overrides])


RUNS_ROOT = "runs"
"""Where a run goes when the command leaves ``local_dirs`` at the reference repo's default."""


def _local_run_dir(args: dict) -> str:
    """``local_run_dir`` as the reference repo makes it, ``<first existing local_dir (else the
    last)>/<user>/<exp_name>_<timestamp>``, except that with its default ``local_dirs``
    (``/scr-ssd``, ``/scr``, ``.cache``: the last, a hidden folder inside this clone, on any
    machine but Stanford's) the run goes to the visible ``runs/<user>/...`` beside the engine's
    other runs."""
    if args["local_run_dir"]:
        return str(args["local_run_dir"])
    dirs = list(args["local_dirs"] or [".cache"])
    root = next((d for d in dirs if os.path.exists(d)), dirs[-1])
    if dirs == REFERENCE_DEFAULTS["local_dirs"] and root == dirs[-1]:
        root = RUNS_ROOT
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    return os.path.join(root, getpass.getuser(), f"{args['exp_name']}_{stamp}")


def _model_overrides(args: dict, run_dir: str, t: Translation) -> list[str]:
    from dpo_megatron.models.config import MODEL_PRESETS

    out = []
    name = args["model"]
    if name != "blank_model" and name not in MODEL_PRESETS and name in REFERENCE_MODELS:
        if not args["model.name_or_path"]:
            out.append(f"model.hf_path={REFERENCE_MODELS[name]}")
        t.notes.append(
            f"model={name}: {REFERENCE_MODELS[name]} (not a preset of "
            f"models.presets.MODEL_PRESETS here: its hub name, read online)"
        )
    elif name != "blank_model":
        if name not in MODEL_PRESETS:
            raise FrontendError(
                f"model={name}: no such preset here (models.presets.MODEL_PRESETS has "
                f"{', '.join(sorted(MODEL_PRESETS)) or 'none'}); or give the model itself: "
                f"model=blank_model model.name_or_path=<HF folder or hub name>"
            )
        out.append(f"model={name}")
    path = args["model.name_or_path"]
    if path:
        out.append(f"model.hf_path={path}")
    elif name == "blank_model":
        raise FrontendError(
            "model=blank_model needs model.name_or_path=<HF folder or hub "
            "name> (the reference repo's '???')"
        )
    if args["model.tokenizer_name_or_path"]:
        out.append(f"data.tokenizer={args['model.tokenizer_name_or_path']}")
    dtype = str(args["model.policy_dtype"])
    if dtype not in POLICY_DTYPES:
        raise FrontendError(
            f"model.policy_dtype={dtype}: this engine trains in "
            f"{' or '.join(POLICY_DTYPES)} (float16 training needs loss "
            f"scaling, which is not wired); use bfloat16"
        )
    out.append(f"model.params_dtype={POLICY_DTYPES[dtype]}")
    if args["model.reference_dtype"] != dtype:
        t.notes.append(
            f"model.reference_dtype={args['model.reference_dtype']}: the reference "
            f"model runs in the policy's dtype here ({dtype})"
        )
    for key in ("model.block_name", "model.fsdp_policy_mp"):
        if args[key] is not None:
            t.notes.append(
                f"{key}={args[key]}: no equivalent (megatron-core layers are the "
                f"unit of sharding and recompute); ignored"
            )
    if args["activation_checkpointing"]:
        out += [
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ]
    if args["model.archive"]:
        t.archive = str(args["model.archive"])
        t.archive_dir = os.path.join(run_dir, "archive_hf")
        # The archive's folder replaces the base model's: the command names one model.hf_path
        # (a preset's folder is found from model=NAME, base_model_of).
        bases = [o.partition("=")[2] for o in out if o.startswith("model.hf_path=")]
        t.base_model = bases[-1] if bases else None
        out = [o for o in out if not o.startswith("model.hf_path=")]
        out.append(f"model.hf_path={t.archive_dir}")
    return out


EVAL_SPLIT = "test"
"""The split the reference trainer evaluates on (``get_batch_iterator(split='test')``)."""


def _data_overrides(args: dict, t: Translation) -> list[str]:
    """``datasets=[...]`` as our training and eval sources (the eval keys: :func:`eval_overrides`).

    A reference name reads its hub dataset's train split and, but for ``se`` (its hub copy has
    no test split), its test split as the eval set; a local folder trains on its train split
    and evaluates on its test split when it has one; a local file only trains.

    Raises:
        FrontendError: a name that is neither a reference dataset nor a local path.
    """
    from dpo_megatron.data.sources import local_split_names

    names = args["datasets"]
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not names:
        raise FrontendError(f"datasets={names}: expected a list such as datasets=[hh,shp]")
    paths, formats, kinds, evals, eval_formats, no_eval = [], [], [], [], [], []
    for name in names:
        name = str(name)
        if name in REFERENCE_DATASETS:
            path, fmt = REFERENCE_DATASETS[name]
            kind, has_test = fmt, fmt != "se"
        elif os.path.exists(name):
            path, fmt = os.path.abspath(name), "auto"
            kind, has_test = _local_format(name), EVAL_SPLIT in local_split_names(name)
        else:
            raise FrontendError(
                f"datasets: {name!r} is neither a dataset of the reference "
                f"repo ({', '.join(REFERENCE_DATASETS)}) nor a local file "
                f"or folder"
            )
        paths.append(path)
        formats.append(fmt)
        kinds.append(kind)
        if has_test:
            evals.append(path)
            eval_formats.append(fmt)
        else:
            no_eval.append(name)
    # the reference repo cuts HH prompts keeping their end, the others keeping their start
    hh = [k == "hh" for k in kinds]
    truncation = "keep_end" if all(hh) else "keep_start"
    if any(hh) and not all(hh):
        t.notes.append(
            "datasets mixes HH (prompts cut keeping the end) with others (keeping the "
            "start): one data.truncation_mode applies here, keep_start"
        )
    t.eval_sets = evals
    if evals:
        t.notes.append(
            f"datasets: the train split trains; the {EVAL_SPLIT} split of "
            f"{', '.join(evals)} is the eval set (data.eval_datasets, "
            f"data.eval_split={EVAL_SPLIT}), as the reference repo evaluates"
        )
    for name in no_eval:
        why = (
            "the reference repo evaluates on 1% of its train split, shuffled with seed 42; "
            "the hub copy has no test split"
            if name == "se"
            else "a file is read whole; a folder with train.jsonl and test.jsonl has both splits"
            if os.path.isfile(name)
            else f"the folder has no {EVAL_SPLIT} files, e.g. {EVAL_SPLIT}.jsonl"
        )
        t.notes.append(f"datasets: {name}: no {EVAL_SPLIT} split, no eval set from it ({why})")
    if not evals:
        t.notes.append(
            "no eval set: eval_every, eval_batch_size, n_eval_examples, "
            "do_first_eval and sample_during_eval have nothing to act on "
            "(engine.data.eval_fraction=F holds out part of the train split)"
        )
    if "shp" in kinds:
        t.notes.append(
            "datasets: SHP keeps at most data.shp_max_pairs_per_post=5 pairs per post "
            "(the SHP card's advice; the first ones in file order); the reference "
            "repo's get_shp keeps every pair with score ratio >= 2: "
            "engine.data.shp_max_pairs_per_post=0 for its exact set"
        )
    out = [f"data.datasets=[{','.join(paths)}]", f"data.formats=[{','.join(formats)}]"]
    if evals:
        out += [
            f"data.eval_datasets=[{','.join(evals)}]",
            f"data.eval_formats=[{','.join(eval_formats)}]",
            f"data.eval_split={EVAL_SPLIT}",
        ]
    return out + [
        f"data.truncation_mode={truncation}",
        f"data.max_length={args['max_length']}",
        f"data.max_prompt_length={args['max_prompt_length']}",
        f"data.seed={args['seed']}",
    ]


def eval_overrides(args: dict, batch_size: int) -> tuple[list[str], int, list[str]]:
    """The reference trainer's evaluation in our keys: (overrides, steps between evaluations,
    notes).

    It evaluates before a train batch whenever its example count (``batch_size`` per step) is a
    multiple of ``eval_every`` (at 0 only with ``do_first_eval``), i.e. every
    ``lcm(eval_every, batch_size) / batch_size`` steps, on the first ``n_eval_examples`` eval
    pairs in whole ``eval_batch_size`` batches: ``train.eval_interval``,
    ``train.eval_at_start``, ``train.eval_global_batch_size`` and ``train.eval_iters =
    ceil(n_eval_examples / eval_batch_size)`` batches.
    """
    every, eval_batch = int(args["eval_every"]), int(args["eval_batch_size"])
    steps = math.lcm(every, batch_size) // batch_size
    batches = math.ceil(int(args["n_eval_examples"]) / eval_batch)
    out = [
        f"train.eval_interval={steps}",
        f"train.eval_global_batch_size={eval_batch}",
        f"train.eval_iters={batches}",
        f"train.eval_at_start={'true' if args['do_first_eval'] else 'false'}",
    ]
    notes = [
        f"eval_every={every} examples -> every {steps} step(s) (its example count, "
        f"{batch_size} per step, a multiple of {every}: train.eval_interval, "
        f"checkpoint.save_interval), and after the last step",
        f"eval_batch_size={eval_batch}, n_eval_examples={args['n_eval_examples']} -> "
        f"train.eval_global_batch_size={eval_batch}, train.eval_iters={batches}: the first "
        f"{batches * eval_batch} eval pairs in file order, or all of them when the eval set "
        f"is smaller (the reference draws them from its shuffled test split)",
        f"do_first_eval={args['do_first_eval']} -> train.eval_at_start (step 0)",
    ]
    return out, steps, notes


def _local_format(path: str) -> str:
    """The format of a local data file or folder's first rows (for its truncation), or
    ``"auto"`` when it cannot be read."""
    try:
        from dpo_megatron.data.config import DataConfig
        from dpo_megatron.data.pipeline import check_sources

        return check_sources(DataConfig(path=path, reference_preprocessing=True))[0][1]
    except Exception:  # the launcher's pre-check reports a bad file with its own message
        return "auto"


def _loss_overrides(args: dict) -> list[str]:
    name = args["loss"]
    if name not in LOSSES:
        raise FrontendError(f"loss={name}: the reference repo's losses are {', '.join(LOSSES)}")
    if name == "sft":
        return ["loss=sft"]
    if args["loss.beta"] is None:
        raise FrontendError(
            f"loss={name} needs loss.beta (the reference repo's '???'), e.g. loss.beta=0.1"
        )
    if name == "ipo":  # its IPO is on summed log-probs (trainers.preference_loss)
        return ["loss=ipo", f"loss.beta={args['loss.beta']}", "loss.average_logps=false"]
    out = [
        "loss=sigmoid",
        f"loss.beta={args['loss.beta']}",
        f"loss.label_smoothing={args['loss.label_smoothing']}",
    ]
    if args["loss.reference_free"]:
        out.append("loss.reference_free=true")
    return out


def _optimizer_overrides(args: dict, t: Translation) -> list[str]:
    name = args["optimizer"]
    if name not in OPTIMIZERS:
        raise FrontendError(
            f"optimizer={name}: the reference repo takes a torch.optim "
            f"class; translated here: {', '.join(OPTIMIZERS)}"
        )
    if name == "RMSprop":
        t.notes.append(
            "optimizer=RMSprop: not available (megatron-core 0.16 offers Adam and SGD only); "
            "used instead: Adam with beta1=0, beta2=0.99, eps=1e-8, no weight decay, i.e. "
            "torch's RMSprop defaults (alpha=0.99, no momentum) plus Adam's bias correction of "
            "the second moment, which makes the first updates smaller than RMSprop's by "
            "sqrt(1 - 0.99^step): 10x smaller at step 1, 1.26x at step 100, 1.03x at step 300"
        )
        return [
            "train.optimizer=adam",
            "train.adam_beta1=0.0",
            "train.adam_beta2=0.99",
            "train.adam_eps=1e-08",
            "train.weight_decay=0.0",
        ]
    if name == "Adam":
        return [
            "train.optimizer=adam",
            "train.adam_beta1=0.9",
            "train.adam_beta2=0.999",
            "train.weight_decay=0.0",
        ]
    if name == "AdamW":  # torch.optim.AdamW's default weight decay
        return [
            "train.optimizer=adam",
            "train.adam_beta1=0.9",
            "train.adam_beta2=0.999",
            "train.weight_decay=0.01",
        ]
    t.notes.append("optimizer=SGD: megatron-core's SGD uses momentum 0.9 (torch.optim.SGD: 0)")
    return ["train.optimizer=sgd", "train.weight_decay=0.0"]


def translate(args: dict, engine: Sequence[str] = (), devices: int | None = None) -> Translation:
    """A parsed reference command (:func:`parse_args`) -> our script and overrides.

    Args:
        devices: accelerators to lay ``trainer`` over (default :func:`visible_devices`).

    Raises:
        FrontendError: a value the reference repo would reject too (missing ``exp_name``,
            ``loss.beta``, a batch that does not divide) or one with no translation.
    """
    if not args["exp_name"]:
        raise FrontendError(
            "exp_name is required (the reference repo's '???'), e.g. "
            "exp_name=anthropic_dpo_pythia69"
        )
    layout = layout_for(str(args["trainer"]), devices or visible_devices())
    run_dir = _local_run_dir(args)
    sft = args["loss"] == "sft"
    t = Translation(
        script="scripts/pretrain_sft.sh" if sft else "scripts/pretrain_dpo.sh",
        overrides=[],
        run_dir=run_dir,
        layout=layout,
        sft=sft,
    )

    batch, accum = int(args["batch_size"]), int(args["gradient_accumulation_steps"])
    dp = layout.data_parallel_size
    if batch % (accum * dp):
        raise FrontendError(
            f"batch_size={batch} must be divisible by "
            f"gradient_accumulation_steps={accum} x {dp} data-parallel "
            f"replica(s) (trainer={args['trainer']})"
        )
    micro = batch // (accum * dp)
    t.batch_size = batch
    evaluation, eval_steps, eval_notes = eval_overrides(args, batch)

    o = [f"run_dir={run_dir}"]
    o += _model_overrides(args, run_dir, t)
    o += _loss_overrides(args)
    o += _data_overrides(args, t)
    o += [
        f"parallel.tensor_model_parallel_size={layout.tensor_model_parallel_size}",
        f"parallel.pipeline_model_parallel_size={layout.pipeline_model_parallel_size}",
        f"parallel.data_parallel_size={layout.data_parallel_size}",
        f"train.global_batch_size={batch}",
        f"train.micro_batch_size={micro}",
        f"train.lr={args['lr']}",
        f"train.lr_warmup_iters={args['warmup_steps']}",
        f"train.clip_grad={args['max_grad_norm']}",
        f"train.seed={args['seed']}",
        *evaluation,
        f"train.sample_during_eval={'true' if args['sample_during_eval'] else 'false'}",
        f"train.eval_num_samples={args['n_eval_model_samples']}",
    ]
    o += _optimizer_overrides(args, t)
    if args["debug"]:
        o.append("checkpoint.save_interval=0")
        t.notes.append(
            "debug=true: wandb off and checkpoints only at the end (this engine "
            "always writes the final one)"
        )
    else:
        o.append(f"checkpoint.save_interval={eval_steps}")
    if args["wandb.enabled"] and not args["debug"]:
        if importlib.util.find_spec("wandb") is None:
            t.notes.append(
                "wandb.enabled=true but wandb is not installed: metrics go to "
                "TensorBoard and <run_dir>/metrics.jsonl only"
            )
        else:
            o += [
                f"logging.wandb_project={args['wandb.project']}",
                f"logging.wandb_run_name={args['exp_name']}",
            ]
            if args["wandb.entity"]:
                o.append(f"logging.wandb_entity={args['wandb.entity']}")

    if args["n_examples"] is not None:
        t.examples = int(args["n_examples"])
    if args["n_epochs"] is not None:
        t.epochs = int(args["n_epochs"])
    if t.examples is None and t.epochs is None:
        raise FrontendError("set n_epochs or n_examples (the reference repo needs one)")
    t.notes += [
        f"run_dir {run_dir}"
        + (
            " (local_run_dir)"
            if args["local_run_dir"]
            else f" (<local_dir>/<user>/<exp_name>_<time>; local_dirs at the "
            f"reference default -> {RUNS_ROOT}/, not the hidden .cache/)"
            if run_dir.startswith(RUNS_ROOT + os.sep)
            else " (<first existing local_dir>/<user>/<exp_name>_<time>)"
        ),
        f"trainer={args['trainer']}: {layout.description}",
        f"batch_size={batch} pairs per step = train.global_batch_size; "
        f"gradient_accumulation_steps={accum} -> train.micro_batch_size={micro} per replica",
        *(eval_notes if t.eval_sets else []),
        f"lr warm-up over {args['warmup_steps']} steps follows megatron-core's schedule "
        f"(lr * step / warmup; the reference's LambdaLR: lr * (step + 1) / (warmup + 1)), then "
        f"constant",
    ]
    if sft:
        t.notes.append(
            "loss=sft: per-token mean NLL of each completion (the reference sums the "
            "completion's log-probs), one example per pair's chosen (the reference: "
            "one per distinct prompt, its sft_target)"
        )
    for key in ("fsdp_port", "minimum_log_interval_secs"):
        if args[key] != REFERENCE_DEFAULTS[key]:
            t.notes.append(f"{key}={args[key]}: no equivalent here; ignored")
    moved = sorted({e.partition("=")[0] for e in engine if e.startswith("parallel.")})
    if moved:  # later overrides win: the layout is the one these keys make
        t.notes.append(
            f"{', '.join('engine.' + k for k in moved)} replace(s) the layout of "
            f"trainer={args['trainer']} above"
        )
    t.overrides = o + list(engine)
    return t


# ----------------------------------------------------------------------------------------------
# steps, archive, run


DRY_RUN_STEPS = "N"
"""``train.train_iters`` of a dry run whose step count needs the pairs counted (not done)."""


def steps_for(t: Translation, items: int | None) -> int:
    """Optimizer steps: the reference repo's iterator yields only full batches, drops an
    epoch's last partial batch, and stops after ``n_examples`` (whole batches, rounded up) or
    ``n_epochs``, whichever comes first.

    Raises:
        FrontendError: fewer items than one batch."""
    limits = []
    if t.examples is not None:
        limits.append(math.ceil(t.examples / t.batch_size))
    if t.epochs is not None:
        assert items is not None
        limits.append(t.epochs * (items // t.batch_size))
    steps = min(limits)
    if steps < 1:
        raise FrontendError(
            f"{items} training item(s) do not fill one batch_size="
            f"{t.batch_size} batch: nothing to train"
        )
    return steps


def base_model_of(overrides: Sequence[str]) -> str:
    """``model.hf_path`` the overrides give before the archive replaces it (preset or path)."""
    from dpo_megatron.config import config_from_mapping

    sections: dict = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model":
            sections["model"] = value
        elif key == "model.hf_path" and value:
            model = sections.setdefault("model", {})
            if isinstance(model, str):  # a preset, then its folder overridden
                sections["model"] = model = {}
            model["hf_path"] = value
    cfg = config_from_mapping(sections, check=False)
    return cfg.model.hf_path


def write_latest_archive(run_dir: str, steps: int, batch_size: int) -> str:
    """``<run_dir>/LATEST/policy.pt`` from the run's HF export, as the reference trainer saves
    it (``step_idx`` counts examples)."""
    from dpo_megatron.checkpointing.dpo_repo_archive import ARCHIVE_NAME, hf_folder_to_archive

    return hf_folder_to_archive(
        RunLayout(run_dir).hf_export,
        os.path.join(run_dir, "LATEST", ARCHIVE_NAME),
        step_idx=steps * batch_size,
    )


def prepare(argv: Sequence[str], devices: int | None = None, dry_run: bool = False) -> Translation:
    """Parse, translate, convert ``model.archive`` and count the steps: a Translation whose
    :meth:`Translation.command` is ready to run. ``dry_run``: only translate, reading no model,
    archive or data (offline, in seconds): the archive is not converted and a step count that
    needs the pairs counted is printed as ``train.train_iters=N`` with a note. An
    ``engine.train.train_iters`` is the step count as given: nothing is counted or appended."""
    args, engine = parse_args(argv)
    t = translate(args, engine, devices)
    pinned = _engine_steps(engine)
    if pinned is not None:  # the user's step count: neither counted nor overridden
        t.steps = pinned
        t.notes.append(
            f"engine.train.train_iters={pinned}: the step count given, not the one n_epochs / "
            f"n_examples make"
        )
    if dry_run:
        if t.archive:
            t.notes.append(
                f"model.archive={t.archive}: converted to {t.archive_dir} "
                f"(model.hf_path) when the command runs; --dry-run reads nothing"
            )
        if pinned is None and t.epochs is not None:
            t.notes.append(
                f"train.train_iters={DRY_RUN_STEPS}: n_epochs={t.epochs} x (pairs "
                f"left after preprocessing // batch_size={t.batch_size})"
                + (", at most n_examples" if t.examples is not None else "")
                + ", counted when the command runs; --dry-run reads no data"
            )
            t.overrides.append(f"train.train_iters={DRY_RUN_STEPS}")
        elif pinned is None:
            t.steps = steps_for(t, None)
            t.overrides.append(f"train.train_iters={t.steps}")
        return t
    if t.archive:
        from dpo_megatron.checkpointing.dpo_repo_archive import archive_to_hf_folder

        before = [o for o in t.overrides if o != f"model.hf_path={t.archive_dir}"]
        base = t.base_model or base_model_of(before)
        tokenizer = args["model.tokenizer_name_or_path"]
        archive_to_hf_folder(t.archive, base, t.archive_dir, tokenizer=tokenizer)
        t.notes.append(
            f"model.archive={t.archive}: weights over {base}'s config.json, written "
            f"to {t.archive_dir} (model.hf_path), policy and reference"
        )
    if pinned is not None:
        return t
    items = (
        count_items(t.overrides, BASE_CONFIG, "sft" if t.sft else "pairs")
        if t.epochs is not None
        else None
    )
    t.steps = steps_for(t, items)
    t.overrides.append(f"train.train_iters={t.steps}")
    return t


def _engine_steps(engine: Sequence[str]) -> int | None:
    """The last ``train.train_iters`` among the ``engine.`` overrides (None: not given).

    Raises:
        FrontendError: a value that is not a whole number of steps."""
    values = [e.partition("=")[2] for e in engine if e.partition("=")[0] == "train.train_iters"]
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        raise FrontendError(
            f"engine.train.train_iters={values[-1]}: expected a whole number of steps"
        ) from None


def prepare_trl_command(path: str, extra: Sequence[str], devices: int | None = None) -> Translation:
    """``--trl FILE.yaml [our key=value ...]``: a TRL DPOConfig YAML
    (:mod:`~dpo_megatron.frontends.trl`) as a Translation on ``configs/from_trl_base.yaml``."""
    from dpo_megatron.frontends.trl import TRL_BASE_CONFIG, prepare_trl

    overrides, notes = prepare_trl(path, extra, devices or visible_devices())
    run_dir = next(
        (o.partition("=")[2] for o in reversed(overrides) if o.startswith("run_dir=")), "runs/trl"
    )
    return Translation(
        script="scripts/pretrain_dpo.sh",
        overrides=overrides,
        run_dir=run_dir,
        layout=Layout(),
        notes=notes,
        config=TRL_BASE_CONFIG,
    )


if __name__ == "__main__":  # the dpo_repo command by its module name (it sits above this package)
    import runpy

    runpy.run_module("dpo_megatron.cli.dpo_repo", run_name="__main__", alter_sys=True)
