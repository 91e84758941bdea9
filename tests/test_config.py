"""The config tree: YAML + dotted overrides, typed, unknown keys rejected with the valid ones."""

import re

import pytest

from dpo_megatron.cli import command
from dpo_megatron.config import load_config, world_size_for


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "parallel:\n  tensor_model_parallel_size: 2\ntrain:\n  lr: 0.5\n"
        "data:\n  tokenizer: tok\n  path: d.json\n"
    )
    cfg = load_config(
        str(f), ["loss.beta=0.3", "train.lr=0.25", "parallel.pipeline_model_parallel_size=2"]
    )
    assert cfg.train.lr == 0.25  # the command line wins over the file
    assert cfg.loss == {"name": "sigmoid", "beta": 0.3}
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert world_size_for(cfg) == 4


def test_world_size_fits_the_expert_layout():
    """DP unset: the fewest ranks on which both TP x PP and expert TP x EP x PP fit."""
    base = ["data.tokenizer=t", "data.path=d.json"]
    ep2 = ["parallel.expert_model_parallel_size=2"]
    assert world_size_for(load_config(None, base + ep2)) == 2
    tp2pp2 = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]
    assert (
        world_size_for(
            load_config(None, base + tp2pp2 + ep2 + ["parallel.expert_tensor_parallel_size=1"])
        )
        == 4
    )
    assert world_size_for(load_config(None, base + tp2pp2 + ep2)) == 8  # expert TP 2 x EP 2 x PP 2
    assert world_size_for(load_config(None, base + ep2 + ["parallel.data_parallel_size=4"])) == 4


def test_unknown_key_lists_valid_keys_of_its_section():
    with pytest.raises(ValueError) as e:
        load_config(None, ["data.tokenizer=t", "data.path=d.json", "train.learning_rate=1"])
    assert "train.learning_rate" in str(e.value)
    assert "train.lr" in str(e.value) and "train.global_batch_size" in str(e.value)


def test_wrong_type_names_the_key():
    with pytest.raises(ValueError, match="train.train_iters"):
        load_config(None, ["data.tokenizer=t", "data.path=d.json", "train.train_iters=ten"])


def test_batch_sizes_must_divide():
    with pytest.raises(ValueError, match="global_batch_size"):
        load_config(
            None,
            [
                "data.tokenizer=t",
                "data.path=d.json",
                "train.global_batch_size=6",
                "train.micro_batch_size=4",
                "parallel.data_parallel_size=1",
            ],
        )


def test_missing_file_and_bad_override():
    with pytest.raises(ValueError, match="does not exist"):
        load_config("/nonexistent.yaml")
    with pytest.raises(SystemExit):
        parse_args(["--config", "x.yaml", "train.lr"])


def parse_args(argv):
    """A command's ``--config`` and overrides (``cli.command``), as (file, overrides)."""
    args = command.parse(command.parser("A command.", "python -m a.command"), argv)
    return args.config, args.overrides


def test_shipped_configs_load():
    for name in ("configs/dpo_smollm2_cpu.yaml", "configs/tiny_cpu.yaml"):
        # Interpolations (${asset:...}) resolve lazily: check structure with assets stubbed.
        from omegaconf import OmegaConf

        raw = OmegaConf.load(name)
        assert "loss" in raw and "train" in raw


def test_naming_a_loss_starts_its_section_afresh(tmp_path):
    """loss.name on the command line drops the file's loss parameters (simpo keeps beta 2.0)."""
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  tokenizer: tok\n  path: d.json\nloss:\n  name: sigmoid\n  beta: 0.1\n")
    assert load_config(str(f), ["loss.name=simpo"]).loss == {"name": "simpo"}
    assert load_config(str(f), ["loss.beta=0.3"]).loss == {"name": "sigmoid", "beta": 0.3}
    assert load_config(str(f), ["loss.name=sft"]).loss == {"name": "sft"}


def test_early_errors_for_sorting_losses_and_data_format():
    base = ["data.tokenizer=t", "data.path=d.json"]
    with pytest.raises(ValueError, match="micro_batch_size >= 2"):
        load_config(None, base + ["loss.name=aot"])
    with pytest.raises(ValueError, match="known formats"):
        load_config(None, base + ["data.format=nope"])
    with pytest.raises(ValueError, match="Did you mean train.lr"):
        load_config(None, base + ["train.lrr=1"])


@pytest.mark.parametrize("key", ["packing.enabled", "packing.share_prompt"])
def test_packing_an_sft_loss_is_refused_by_the_config_not_on_the_ranks(key):
    """Packing lays out preference pairs: asking for it with an SFT loss is a config error (the
    pre-check's one line), not the batch builder's ValueError raised on every rank as a
    traceback after the data is read."""
    with pytest.raises(
        ValueError, match=re.escape(f"{key}=true packs preference pairs; loss.name=sft")
    ):
        load_config(None, BASE + ["loss.name=sft", f"{key}=true"])
    assert load_config(None, BASE + ["loss.name=sft", f"{key}=false"]).loss == {"name": "sft"}


# ---------------------------------------------------------------------------------------------
# Ranges, shorthands, parsing, the fast pre-check

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from dpo_megatron.cli.check import main  # noqa: E402
from dpo_megatron.config import list_keys  # noqa: E402

BASE = ["data.tokenizer=t", "data.path=d.json"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.log_interval=0", "train.log_interval=0 must be >= 1"),
        ("train.seq_length_multiple=0", "train.seq_length_multiple=0 must be >= 1"),
        ("parallel.data_parallel_size=0", "parallel.data_parallel_size=0 must be >= 1"),
        ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps=0 must be >= 1"),
        ("train.train_iters=0", "train.train_iters=0 must be >= 1"),
        ("train.train_iters=-5", "train.train_iters=-5 must be >= 1"),
        ("checkpoint.save_interval=-1", "checkpoint.save_interval=-1 must be >= 0"),
        ("train.clip_grad=-1", "train.clip_grad=-1.0 must be >= 0"),
        ("train.lr=-0.001", "train.lr=-0.001 must be >= 0"),
        ("train.adam_beta2=1.0", "train.adam_beta2=1.0 must be >= 0 and < 1"),
        ("train.lr_decay_style=step", "train.lr_decay_style='step'; expected one of constant"),
        (
            "parallel.tensor_model_parallel_size=0",
            "parallel.tensor_model_parallel_size=0 must be >= 1",
        ),
        ("parallel.distributed_timeout_minutes=0", "must be >= 1"),
        ("model.num_layers=0", "model.num_layers=0 must be >= 1"),
        ("model.norm_epsilon=0", "model.norm_epsilon=0.0 must be > 0"),
        (
            "model.local_attention=flash",
            "model.local_attention='flash'; expected one of auto, sdpa, flex, megatron",
        ),
        ("checkpoint.keep_last_n=-1", "checkpoint.keep_last_n=-1 must be >= 0"),
        ("checkpoint.export_dtype=fp8", "checkpoint.export_dtype='fp8'"),
        ("packing.row_length=-8", "packing.row_length=-8 must be >= 0"),
        (
            "packing.share_prompt=true",
            "packing.share_prompt=true lays pairs out in packed rows: set packing.enabled=true too",
        ),
        ("data.max_prompt_length=1", "data.max_prompt_length=1 must be >= 2"),
        ("data.se_max_pairs_per_question=0", "must be >= 1"),
        (
            "data.shp_max_pairs_per_post=-1",
            "data.shp_max_pairs_per_post=-1 must be >= 0: 0: no cap",
        ),
        ("train.eval_global_batch_size=-1", "train.eval_global_batch_size=-1 must be >= 0"),
        (
            "data.eval_datasets=[e.json]",
            "data.eval_datasets and data.eval_fraction=0.1 are both set",
        ),
        ("data.eval_formats=[hh]", "data.eval_formats has 1 entries for 0 data.eval_datasets"),
        (
            "model.recompute_modules=[layernorm]",
            "model.recompute_modules=['layernorm'] needs "
            "model.recompute_granularity=selective, got None",
        ),
        (
            "model.recompute_modules=[moe_act]",
            "model.recompute_modules: 'moe_act' is not one of core_attn, layernorm, mlp, moe",
        ),
    ],
)
def test_every_field_is_range_checked_before_launch(override, message):
    """Each of these values is refused before launch with its message: 0 intervals /
    sizes (a ZeroDivisionError later), max_nonfinite_steps=0 (it would stop a healthy run), a
    negative lr (found only after the model is built), and the others that would run."""
    extra = ["data.eval_fraction=0.1"] if override.startswith("data.eval_datasets") else []
    # share_prompt alone now turns packing on with it (auto): refused only with packing off
    extra += ["packing.enabled=false"] if override.startswith("packing.share_prompt") else []
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, BASE + extra + [override])


def test_pre_check_reads_the_eval_files(tmp_path):
    """The launchers' pre-check (``python -m dpo_megatron.config``) reads data.eval_datasets as it
    reads the training data: a bad eval row stops it, naming file, line and field."""
    good = {"prompt": "Hi", "chosen": " yes", "rejected": " no"}
    (tmp_path / "train.jsonl").write_text(json.dumps(good) + "\n")
    (tmp_path / "eval.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps(good | {"prompt": 1}) + "\n"
    )
    with pytest.raises(SystemExit) as e:
        main(
            [
                "data.tokenizer=t",
                f"data.path={tmp_path / 'train.jsonl'}",
                f"data.eval_datasets=[{tmp_path / 'eval.jsonl'}]",
            ]
        )
    assert str(e.value) == (
        f"error: {tmp_path / 'eval.jsonl'}: line 2: field 'prompt': expected a "
        f"string, got int; set data.on_error=skip to drop and count them"
    )


def test_yaml_that_is_a_list_or_does_not_parse_is_a_config_error(tmp_path, capsys):
    """A YAML file that is a list, or does not parse, is one config error naming the file (not
    a raw omegaconf / yaml traceback)."""
    listed = tmp_path / "list.yaml"
    listed.write_text("- train\n- lr\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1\n")
    with pytest.raises(ValueError, match="list.yaml must be a mapping of sections"):
        load_config(str(listed))
    with pytest.raises(ValueError, match=r"broken.yaml is not valid YAML: .*line 3, column 1"):
        load_config(str(broken))
    with pytest.raises(SystemExit) as e:
        main(["--config", str(broken)])
    assert str(e.value).startswith("config error: ")


def test_config_anywhere_on_the_command_line(tmp_path):
    """``--config F`` may come anywhere, after ``k=v`` overrides too."""
    assert parse_args(["train.lr=0.1", "--config", "c.yaml", "loss.beta=1"]) == (
        ["c.yaml"],
        ["train.lr=0.1", "loss.beta=1"],
    )


def test_loss_shorthand_trains_that_loss():
    """``loss=ipo loss.beta=0.1`` is IPO at beta 0.1 (the shorthand is not lost to a sigmoid
    section), and ``loss=ipo`` alone is IPO at its defaults."""
    assert load_config(None, BASE + ["loss=ipo", "loss.beta=0.1"]).loss == {
        "name": "ipo",
        "beta": 0.1,
    }
    assert load_config(None, BASE + ["loss=ipo"]).loss == {"name": "ipo"}
    assert load_config(None, BASE + ["loss=dpo"]).loss == {"name": "sigmoid"}
    assert load_config(None, BASE + ["loss.name=dpo", "loss.beta=0.2"]).loss == {
        "name": "sigmoid",
        "beta": 0.2,
    }
    with pytest.raises(ValueError, match="loss= needs a loss name"):
        load_config(None, BASE + ["loss="])
    with pytest.raises(ValueError, match="unknown loss.name 'dpoo'.*aliases: dpo \\(= sigmoid\\)"):
        load_config(None, BASE + ["loss=dpoo"])


def test_section_scalars_in_yaml_and_model_presets(tmp_path, monkeypatch):
    """``loss: ipo`` / ``model: smollm2`` in YAML expand as the command-line shorthands do; a
    ``model=NAME`` that is no preset (``model=gptj``) and ``train=5`` each name the section and
    what to write instead."""
    from dpo_megatron.utils import cache

    monkeypatch.setattr(cache, "asset_path", lambda name: f"/assets/{name}")  # no asset built here
    f = tmp_path / "c.yaml"
    f.write_text("loss: ipo\nmodel: smollm2\ndata:\n  path: d.json\n")
    cfg = load_config(str(f), ["loss.beta=0.3"])
    assert cfg.loss == {"name": "ipo", "beta": 0.3}
    assert (cfg.model.hf_path, cfg.model.pad_attention_heads) == ("/assets/smollm2", True)
    with pytest.raises(
        ValueError,
        match=r"model=gptj \(from command line\): 'gptj' is not a model preset\. .*preset name "
        r"\(.*smollm2, smollm3\).*model.hf_path=",
    ):
        load_config(None, BASE + ["model=gptj"])
    with pytest.raises(ValueError, match=r"model= \(from command line\): model is a section"):
        load_config(None, BASE + ["model="])
    with pytest.raises(
        ValueError, match=r"train=5 \(from command line\): train is a section, not a value"
    ):
        load_config(None, BASE + ["train=5"])


def test_empty_value_clears_a_string_list_or_optional_key(tmp_path):
    """``key=`` clears a string, list or optional key (``data.chat_template=`` included)."""
    f = tmp_path / "c.yaml"
    f.write_text(
        "data:\n  path: d.json\n  tokenizer: t\n  chat_template: chatml\n  datasets: []\n"
        "parallel:\n  data_parallel_size: 1\n"
    )
    cfg = load_config(str(f), ["data.chat_template=", "parallel.data_parallel_size="])
    assert cfg.data.chat_template == "" and cfg.parallel.data_parallel_size is None
    assert load_config(None, BASE + ["data.weights="]).data.weights == []


def test_interleaved_pipeline_micro_batches_must_be_a_multiple_of_pp():
    """An interleaved pipeline whose micro-batches per step are not a multiple of PP is refused
    at validation, before megatron-core's interleaved schedule would fail at step 1."""
    layout = [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        "parallel.data_parallel_size=1",
        "train.micro_batch_size=1",
    ]
    with pytest.raises(
        ValueError,
        match=r"micro-batches per step.*= 3, to be a multiple of "
        r"parallel.pipeline_model_parallel_size=2",
    ):
        load_config(None, BASE + layout + ["train.global_batch_size=3"])
    load_config(None, BASE + layout + ["train.global_batch_size=4"])


def test_list_keys_and_print_config(capsys, tmp_path):
    """``--list-keys`` lists every key with its type, default and range, and
    ``--print-config`` prints the resolved config."""
    text = list_keys()
    assert (
        "train.log_interval (int, default 1)\n"
        "    Steps between log lines / TensorBoard points (>= 1)." in text
    )
    assert "parallel.data_parallel_size (int | None, default None)" in text
    main(["--list-keys"])
    assert "checkpoint.save_interval (int, default 0)" in capsys.readouterr().out
    main(["--print-config", "loss=ipo"] + BASE)
    out = capsys.readouterr().out
    assert "loss:\n  name: ipo\n" in out and "run_dir: runs/dpo" in out


@pytest.mark.parametrize(
    "overrides, loss, export_hf",
    [
        (["loss=dpo"], {"name": "sigmoid"}, "none"),
        (
            ["loss.name=[dpo,sft]", "loss.beta=0.2"],
            {"name": ["sigmoid", "sft"], "beta": 0.2},
            "none",
        ),
        (["checkpoint.export_hf=true"], {"name": "sigmoid", "beta": 0.1}, "merged"),
        (["checkpoint.export_hf=false"], {"name": "sigmoid", "beta": 0.1}, "none"),
        (["checkpoint.export_hf=MERGED"], {"name": "sigmoid", "beta": 0.1}, "merged"),
    ],
)
def test_a_config_is_built_normalized_and_validation_only_checks(overrides, loss, export_hf):
    """A loss's other name (``dpo``) and a boolean or any-case ``checkpoint.export_hf`` are
    their canonical values in the config as loaded, before any check; validating a frozen copy
    (``utils.frozen``) raises nothing and changes nothing (a loss section is a plain dict even
    in a frozen tree: it is compared too); ``--print-config`` shows the canonical values."""
    from dpo_megatron.config import validate
    from dpo_megatron.utils.frozen import freeze, thaw

    cfg = freeze(load_config(None, BASE + overrides, check=False))
    assert cfg.loss == loss and cfg.checkpoint.export_hf == export_hf
    before = thaw(cfg)
    validate(cfg)
    assert cfg == before and cfg.loss == loss


@pytest.mark.parametrize(
    "value, shown", [("yes", "true"), ("true", "true"), ("on", "true"), ("no", "false")]
)
def test_a_yes_or_no_resume_is_refused_naming_the_valid_values(value, shown):
    """``checkpoint.resume`` is none, auto or a path: a YAML boolean (which the string field
    stores as ``'True'`` / ``'False'``) stops the config with one line naming them, not as a
    checkpoint folder called ``True`` that does not exist."""
    with pytest.raises(ValueError) as error:
        load_config(None, BASE + [f"checkpoint.resume={value}"], check=False)
    assert str(error.value) == (
        f"checkpoint.resume={shown} is a yes/no; it takes none (start fresh), auto (the latest "
        "complete checkpoint in the save folder, else start fresh) or a checkpoint path"
    )


def test_print_config_shows_the_registered_loss_name(capsys):
    """``loss=dpo`` prints as the loss the run trains, ``sigmoid``; ``export_hf=true`` as
    ``merged``."""
    main(["--print-config", "loss=dpo", "checkpoint.export_hf=true"] + BASE)
    out = capsys.readouterr().out
    assert "loss:\n  name: sigmoid\n" in out and "  export_hf: merged\n" in out


def test_config_mistake_is_reported_before_torch_or_megatron_is_imported(tmp_path):
    """The launchers' pre-check reports a range / key / YAML mistake without importing torch or
    megatron-core: ``import dpo_megatron.cli.check`` pulls in neither (dpo_megatron.models is
    imported on first use), so a mistake costs seconds, not those imports."""
    code = (
        "import sys\n"
        "from dpo_megatron.cli.check import main\n"
        "try:\n"
        "    main(['data.path=d.json', 'data.tokenizer=t', 'train.log_interval=0'])\n"
        "except SystemExit as e:\n"
        "    print(e)\n"
        "print(sorted(m for m in ('torch', 'megatron', 'datasets', 'transformers') if m in "
        "sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=120,
    )
    assert out.stdout.splitlines() == [
        "config error: train.log_interval=0 must be >= 1 (train.log_interval set on the "
        "command line)",
        "[]",
    ], out.stderr


def test_pre_check_reports_data_errors_in_one_line(tmp_path, capsys):
    """A missing path or a format that does not fit is one line from the pre-check, before
    launch (not a traceback from every rank)."""
    with pytest.raises(SystemExit) as e:
        main(["data.tokenizer=t", f"data.path={tmp_path}/missing.jsonl"])
    assert str(e.value) == f"error: data file {tmp_path}/missing.jsonl does not exist"
    sharegpt = tmp_path / "sg.jsonl"
    sharegpt.write_text(
        '{"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", '
        '"value": "a"}, "rejected": {"from": "gpt", "value": "b"}}\n'
    )
    with pytest.raises(SystemExit) as e:
        main(["data.tokenizer=t", f"data.path={sharegpt}", "data.format=hh"])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert (
        "look like format 'sharegpt': set data.format=sharegpt" in message
        and "on_error" not in message
    )


def test_a_warm_up_that_outlasts_the_run_is_announced():
    """The reference repo's warmup_steps=150 on a 12-step run: the peak lr is never reached."""
    from dpo_megatron.training.config import TrainConfig

    assert TrainConfig(train_iters=12, lr_warmup_iters=11).warmup_warning() is None
    assert TrainConfig(train_iters=12, lr_warmup_iters=150, lr=5e-7).warmup_warning() == (
        "WARNING: train.lr_warmup_iters=150 >= train.train_iters=12: the run ends 12/150 of the "
        "way through its linear warm-up and never reaches train.lr=5e-07"
    )


def test_print_config_is_the_resolved_config(tmp_path, capsys):
    """With ``model.hf_path`` the architecture shown is the folder's (what the run builds: the
    Trainer's ``resolve_model_config``), not the file's toy fields; the loss shows every
    parameter with its default (what the run's start-up line describes), not tiny_cpu.yaml's
    2 layers, hidden 64 and vocabulary 49152 beside the folder, nor a bare ``loss: {name:
    ipo}``; the speed settings left to the engine are shown decided, as the run decides them,
    and the config loaded is not changed."""
    import dataclasses
    import json

    import yaml

    from dpo_megatron.cli.check import main
    from dpo_megatron.losses import build_loss
    from dpo_megatron.training.auto_settings import resolve_auto_settings
    from dpo_megatron.training.run_models import resolve_model_config
    from tests.models.conversion_helpers import save_tiny_hf_folder

    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"))
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    args = ["--config", "configs/tiny_cpu.yaml", f"model.hf_path={folder}", "loss=ipo"]
    main([*args, "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert (
        model["num_layers"],
        model["hidden_size"],
        model["vocab_size"],
        model["num_attention_heads"],
        model["num_query_groups"],
        model["ffn_hidden_size"],
    ) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["vocab_size"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
        hf["intermediate_size"],
    )
    assert model["num_layers"] != 2 or model["hidden_size"] != 64  # not tiny_cpu.yaml's
    cfg = load_config(args[1], args[2:])
    loss_fn = build_loss(cfg.loss)
    # the run's own resolution (training.auto_settings), the data's count aside
    settings = resolve_auto_settings(cfg, loss_fn, resolve_model_config(cfg))
    run_model = settings.model_config
    assert model == {k: getattr(run_model, k) for k in model}
    assert model["fused_lm_head"] is False  # decided on this CPU, as the run decides it
    for section in ("packing", "reference", "parallel"):
        assert printed[section] == dataclasses.asdict(getattr(settings.config, section))
    assert cfg.model.fused_lm_head is None  # the config loaded is not changed
    assert printed["loss"] == {
        "name": "ipo",
        "beta": 0.1,
        "average_logps": True,
        "reference_free": False,
        "sft_weight": 0.0,
        "use_weighting": False,
        "ld_alpha": None,
    }
    assert (
        build_loss(printed["loss"]).describe()
        == build_loss(cfg.loss).describe()
        == "loss ipo(beta=0.1, average_logps=True)"
    )


def test_model_load_gives_the_architecture_and_refuses_a_conflicting_key(tmp_path):
    """``model.load``: the checkpoint's ``model_config.json`` gives the architecture, the run's
    own keys its settings (dtype, recompute, ...); a ``model.*`` architecture key the YAML file
    or the command line sets to another value is refused by name, the same value is fine, and
    a padding setting counts only where it changes the key/value groups. With ``model.hf_path``
    the checkpoint must hold config.json's architecture. (The checks read only
    ``model_config.json``: a folder holding it stands for the checkpoint here; the launcher's
    refusals over real checkpoints are in tests/training/test_lifecycle.py.)"""
    import dataclasses

    from dpo_megatron.checkpointing.model_checkpoint import write_model_config
    from dpo_megatron.config import check_model_sources, stated_model_keys
    from dpo_megatron.training.run_models import resolve_model_config
    from tests.models.conversion_helpers import save_tiny_hf_folder

    tiny = "configs/tiny_cpu.yaml"
    assert stated_model_keys(tiny, ["model.recompute_granularity=full"]) == {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "vocab_size",
        "max_position_embeddings",
        "recompute_granularity",
    }
    assert {"hf_path", "pad_attention_heads"} <= stated_model_keys(None, ["model=smollm2"])
    base = load_config(tiny, ["model.num_layers=3"]).model
    stored = dataclasses.replace(base, params_dtype="bfloat16", pad_attention_heads=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_model_config(str(ckpt), stored)

    def check(*overrides):
        args = [f"model.load={ckpt}", *overrides]
        cfg = load_config(tiny, args)
        check_model_sources(cfg, tiny, args)
        return resolve_model_config(cfg)

    with pytest.raises(ValueError) as info:
        check()  # tiny_cpu.yaml states num_layers: 2
    assert str(info.value) == (
        f"model.load={ckpt} holds a model with num_layers=3 (its model_config.json), but "
        "model.num_layers=2 is set: the checkpoint gives the architecture; drop "
        "model.num_layers or load a checkpoint of that architecture"
    )
    with pytest.raises(
        ValueError,
        match=r"holds a model with num_layers=3, hidden_size=64 .*but "
        r"model.num_layers=2, model.hidden_size=32 is set",
    ):
        check("model.hidden_size=32")
    # the same value, run settings of the run's own, padding that adds no group (2 stay 2)
    model = check(
        "model.num_layers=3", "model.recompute_granularity=full", "model.pad_attention_heads=false"
    )
    assert (model.num_layers, model.load) == (3, str(ckpt))
    assert (model.recompute_granularity, model.params_dtype) == ("full", "auto")
    assert model.pad_attention_heads  # the checkpoint's tensors' padding
    # padding that does change the groups: 8 heads / 2 groups, padded to 4 in the checkpoint
    padded = dataclasses.replace(
        stored, num_attention_heads=8, num_query_groups=2, pad_attention_heads_multiple=4
    )
    write_model_config(str(ckpt), padded)
    with pytest.raises(ValueError) as info:
        check(
            "model.num_layers=3", "model.num_attention_heads=8", "model.pad_attention_heads=false"
        )
    assert str(info.value).startswith(
        f"model.load={ckpt} holds a model with pad_attention_heads=True (its model_config.json), "
        "but model.pad_attention_heads=False is set"
    )

    # model.hf_path gives the architecture: the checkpoint must hold it
    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"))
    from_hf = resolve_model_config(load_config(tiny, [f"model.hf_path={folder}"]))
    write_model_config(str(ckpt), dataclasses.replace(from_hf, num_layers=2))
    with pytest.raises(ValueError) as info:
        check(f"model.hf_path={folder}")
    assert str(info.value) == (
        f"model.load={ckpt} holds a model with num_layers=2 (its model_config.json), but "
        f"model.hf_path={folder} gives num_layers=4 (its config.json): load a checkpoint of "
        "that model, or drop model.hf_path to take the checkpoint's own architecture"
    )
    write_model_config(str(ckpt), from_hf)
    assert check(f"model.hf_path={folder}").num_layers == 4


def test_model_load_of_a_lora_checkpoint_is_refused_by_the_pre_check(tmp_path):
    """``model.load`` naming a LoRA run's checkpoint (adapters and their optimizer state, no base
    weights) is refused by the launchers' pre-check with one ``config error:`` line naming the
    checkpoint and its base, before any rank starts (not as a traceback from every rank); a
    run's ``checkpoints`` folder resolves to its latest checkpoint first."""
    import json

    tiny = "configs/tiny_cpu.yaml"
    ckpt = tmp_path / "checkpoints" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    (ckpt / "train_state.json").write_text(json.dumps({"lora": {"base": "HF folder X"}}))
    with pytest.raises(SystemExit) as stop:
        main(["--config", tiny, f"model.load={tmp_path / 'checkpoints'}"])
    assert str(stop.value) == (
        f"config error: model.load={ckpt} is a LoRA checkpoint: it holds adapters, not base "
        f"weights (base: HF folder X). Continue it with checkpoint.resume={ckpt}, or export it "
        "merged (checkpoint.export_hf=merged) and start from that folder"
    )


def test_print_config_of_a_preset_without_a_local_copy_and_a_plain_export_hf(monkeypatch, capsys):
    """``model=smollm3`` with no local copy under $DPO_MEGATRON_MODELS (nothing downloaded, no
    config.json): ``--print-config`` shows the architecture the preset states and says where
    the rest comes from, instead of failing on the hub name. ``checkpoint.export_hf: false``
    (a YAML boolean in a string field) reads back as its canonical name."""
    import yaml

    from dpo_megatron.models.presets import MODEL_PRESETS

    monkeypatch.delenv("DPO_MEGATRON_MODELS", raising=False)
    main(["--config", "configs/dpo_smollm2_cpu.yaml", "model=smollm3", "--print-config"])
    out = capsys.readouterr().out
    note, tree = out.split("\n", 1)
    assert note == (
        "# model: preset smollm3 (HuggingFaceTB/SmolLM3-3B) has no local copy here, so the "
        "model section holds the architecture the preset states (num_layers, hidden_size, "
        "num_attention_heads, ffn_hidden_size, vocab_size); the rest is read from its "
        "config.json once a copy is there ($DPO_MEGATRON_MODELS)"
    )
    printed = yaml.safe_load(tree)
    model = printed["model"]
    assert model["hf_path"] == "HuggingFaceTB/SmolLM3-3B"
    assert {k: model[k] for k in MODEL_PRESETS["smollm3"].facts()} == {
        "num_layers": 36,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "ffn_hidden_size": 11008,
        "vocab_size": 128256,
    }
    # what config.json decides is not made up; the run's own settings stay
    assert "num_query_groups" not in model and "rotary_base" not in model
    assert model["pad_attention_heads"] is True and model["params_dtype"] == "auto"
    assert printed["checkpoint"]["export_hf"] == "none"
    assert load_config("configs/rm_smollm2_cpu.yaml").checkpoint.export_hf == "merged"


def test_list_keys_gives_the_defaults_of_the_config_it_is_given():
    """A launcher's --list-keys passes its default config: a key that config sets shows the
    config's value as the default, beside the built-in one; keys it leaves alone read as
    before, and a YAML boolean ``export_hf`` is compared by its meaning."""
    text = list_keys("configs/sft_smollm2_cpu.yaml")
    assert (
        "run_dir (str, default 'runs/sft_smollm2_cpu' in configs/sft_smollm2_cpu.yaml; "
        "'runs/dpo' without a config file)\n" in text
    )
    # an interpolation as written: listing the keys fetches nothing
    assert "model.hf_path (str, default '${asset:smollm2}' in configs/sft_smollm2_cpu.yaml" in text
    assert "train.log_interval (int, default 1)\n" in text
    assert "checkpoint.export_hf (str, default 'none')\n" in list_keys(
        "configs/dpo_smollm2_cpu.yaml"
    )
    assert list_keys().startswith("run_dir (str, default 'runs/dpo')\n")


def test_flex_attention_training_on_the_cpu_is_refused_by_the_pre_check():
    """FlexAttention has no CPU backward: flex with packed rows at CP 1 on a gloo run is one
    line before launch (each rank raised it at its first step); padded rows and CP 2 (whose
    blockwise kernel replaces it) pass the rule."""
    from dpo_megatron.cli.check import _refuse_flex_training_on_the_host

    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/tiny_cpu.yaml", "model.local_attention=flex"])
    assert str(e.value) == (
        "config error: model.local_attention=flex cannot train on the CPU (torch's "
        "FlexAttention has no CPU backward): use sdpa (or auto) there, or packing.enabled=false"
    )
    for overrides in (["packing.enabled=false"], ["parallel.context_parallel_size=2"]):
        cfg = load_config(
            "configs/tiny_cpu.yaml", ["model.local_attention=flex", *overrides], check=False
        )
        _refuse_flex_training_on_the_host(cfg)


def test_a_row_length_under_transformer_engine_is_refused_with_packing_on_or_auto(monkeypatch):
    """transformer-engine takes one THD row per micro-batch: a packing.row_length is refused
    with packing on and with packing left at auto (which packs), not with packing off."""
    from dpo_megatron.config import validate
    from dpo_megatron.models import transformer_config

    monkeypatch.setattr(transformer_config, "use_transformer_engine", lambda impl: True)
    base = BASE + ["model.transformer_impl=auto", "packing.row_length=512"]
    for packing in (["packing.enabled=true"], []):
        with pytest.raises(ValueError, match=r"leave packing.row_length=0 \(got 512\)"):
            validate(load_config(None, base + packing, check=False))
    validate(load_config(None, base + ["packing.enabled=false"], check=False))


def test_the_pre_check_checks_the_layout_against_a_known_world_size(tmp_path, monkeypatch):
    """A SLURM job's pre-check (scripts/slurm/job.sh) runs with ``WORLD_SIZE`` set to the
    allocation's ranks: a pinned data-parallel size that does not fill it is one line there,
    before any rank starts, not a race of the ranks that srun ends with SIGTERM."""
    args = ["--config", "configs/tiny_cpu.yaml", f"run_dir={tmp_path}/run", "--without-weights"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main([*args, "parallel.data_parallel_size=1"])
    assert str(e.value) == (
        "config error: parallel.data_parallel_size=1 x TP x PP x CP = 1 but the job has 2 "
        "ranks: launch 1 ranks or drop parallel.data_parallel_size"
    )
    with pytest.raises(SystemExit) as e:
        main([*args, "parallel.tensor_model_parallel_size=4"])
    assert str(e.value).startswith("config error: world size 2 is not divisible by ")


def test_lora_targets_that_the_model_lacks_are_refused_by_the_pre_check(tmp_path):
    """``lora.target_modules=[linear_qkv]`` on a multi-latent-attention model (DeepSeek-V3: no
    fused query/key/value layer) is refused by the launchers' pre-check in one ``config error:``
    line that names the model's targets, not by a traceback from every rank; the default (all
    four) still passes the check, its ``linear_qkv`` left out as documented."""
    from tests.models.conversion_helpers import save_tiny_hf_folder

    folder = save_tiny_hf_folder("deepseek_v3", str(tmp_path / "hf"))
    args = ["--config", "configs/tiny_cpu.yaml", f"model.hf_path={folder}", "lora.enabled=true"]
    args += [f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "lora.target_modules=[linear_qkv]"])
    assert str(stop.value) == (
        "config error: lora.target_modules=['linear_qkv'] names no layer of this model "
        "(multi-latent attention, model.kv_lora_rank=32, has no linear_qkv); its targets: "
        "linear_proj, linear_fc1, linear_fc2"
    )
    config = load_config("configs/tiny_cpu.yaml", args[2:])
    from dpo_megatron.config import check_model_layout

    check_model_layout(config)  # the default targets: linear_proj, linear_fc1, linear_fc2 exist


def test_a_model_load_that_holds_no_checkpoint_is_refused_by_the_pre_check(tmp_path):
    """``model.load`` / ``reference.load`` naming a folder that holds no checkpoint (a typo, a
    Hugging Face folder) is refused by the launchers' pre-check in one line naming the key,
    before any rank starts: it passed the pre-check, and then either every rank raised a
    traceback or, with no ``model.*`` keys in the config, the line blamed the tokenizer against
    the default vocabulary size."""
    tiny = ["--config", "configs/tiny_cpu.yaml", f"run_dir={tmp_path / 'run'}"]
    missing = tmp_path / "nothing"
    with pytest.raises(SystemExit) as stop:
        main([*tiny, f"model.load={missing}"])
    assert str(stop.value) == (
        f"config error: model.load={missing}: not a megatron-core distributed checkpoint (no "
        "such folder), nor a run's checkpoints folder holding one"
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        main([*tiny, f"reference.load={hf}"])
    assert str(stop.value) == (
        f"config error: reference.load={hf}: not a megatron-core distributed checkpoint (no "
        "metadata.json there; a Hugging Face folder goes in reference.hf_path), nor a run's "
        "checkpoints folder holding one"
    )


# ---------------------------------------------------------------------------------------------
# What a user writing configs by hand meets: several files, interpolations, typos, --list-keys


def test_several_config_files_merge_in_order(tmp_path):
    """``--config base.yaml --config ipo.yaml``: every file counts, a later one's keys over an
    earlier one's (argparse's plain option kept only the last file, silently)."""
    base, ipo = tmp_path / "base.yaml", tmp_path / "ipo.yaml"
    base.write_text("data:\n  tokenizer: tok\n  path: d.json\ntrain:\n  lr: 0.5\n")
    ipo.write_text("loss:\n  name: ipo\n  beta: 0.5\ntrain:\n  lr: 0.25\n")
    args = command.parse(
        command.parser("x", "x"), ["--config", str(base), "--config", str(ipo), "loss.beta=0.3"]
    )
    cfg = load_config(args.config, args.overrides)
    assert (cfg.data.path, cfg.train.lr, cfg.loss) == ("d.json", 0.25, {"name": "ipo", "beta": 0.3})
    assert "train.lr (float, default 0.25 in " in list_keys(args.config)


@pytest.mark.parametrize(
    "value,message",
    [
        ("${train.nope}", "Interpolation key 'train.nope' not found: an interpolation names"),
        ("${div:8,2}", "Unsupported interpolation type div: an interpolation names"),
        ("${oc.env:DPO_MEGATRON_TEST_UNSET_VAR}", "DPO_MEGATRON_TEST_UNSET_VAR' not found"),
    ],
)
def test_an_interpolation_that_does_not_resolve_is_one_line_naming_key_and_file(
    tmp_path, value, message
):
    f = tmp_path / "c.yaml"
    f.write_text(f"reference:\n  micro_batch_size: {value}\n")
    with pytest.raises(ValueError) as error:
        load_config(str(f), BASE)
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith(f"config key 'reference.micro_batch_size' (from {f}): ")
    assert message in text


def test_a_misspelt_section_suggests_the_section():
    with pytest.raises(ValueError, match=r"unknown config key 'trainn' .*Did you mean train\? "):
        load_config(None, BASE + ["trainn.lr=1"])


def test_list_keys_documents_every_key():
    """Every key's block has its documentation, inherited fields included
    (``generation.*`` / ``online.sampling.*`` are ``SamplingConfig``'s)."""
    blocks = re.split(r"\n(?=\S)", list_keys())
    undocumented = [b for b in blocks if "\n    " not in b and not b.startswith("loss.<")]
    assert undocumented == []
    assert "generation.top_p (float, default 1.0)\n    Nucleus sampling mass" in list_keys()


def test_list_keys_gives_each_loss_parameter_its_losses_defaults_and_range():
    """A parameter several losses take with different defaults lists each default with its
    losses (registry order: by name); one without a range says none."""
    text = list_keys().split("loss.<parameter>")[1]
    assert "\n    loss.rpo_alpha (default 1.0: rpo; range [0.0, inf])\n" in text
    assert "\n    loss.simpo_gamma (default 1.0: simpo)\n" in text
    assert "\n    loss.cpo_alpha (default 1.0: cpo; 0.0: simpo; range [0.0, inf])\n" in text
    beta = " ".join(re.search(r"loss\.beta \(.*?\)\n(?=    loss)", text, re.S)[0].split())
    assert beta.startswith("loss.beta (default 0.1: aot, aot_unpaired, apo_down,")
    assert beta.endswith("sppo_hard; 0.001: cal_dpo; 2.0: simpo; range (0.0, inf])")


@pytest.mark.parametrize("loss", ["sigmoid", "simpo", "sft", "bradley_terry"])
def test_print_config_runs_again_as_the_config(tmp_path, capsys, loss):
    """``--print-config``'s YAML, given back as ``--config``, loads and prints the same. With a
    loss that reads no reference the resolved mode used to be 'model', which the reference rule
    (``config._check_reference_used``) then refused."""
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n")
    argv = ["--config", str(f), *BASE, f"loss.name={loss}", "--print-config"]
    main(argv)
    printed = capsys.readouterr().out
    again = tmp_path / "again.yaml"
    again.write_text(printed)
    main(["--config", str(again), "--print-config"])
    assert capsys.readouterr().out == printed


def test_a_value_refused_after_the_merge_names_the_files_that_set_its_keys(tmp_path):
    """Range and cross-key rules run on the merged tree; their line still says where each key
    it names was set (the file, or the command line), so a conflict between two files is found
    without reading both."""
    base, more = tmp_path / "base.yaml", tmp_path / "more.yaml"
    base.write_text("train:\n  global_batch_size: 4\n")
    more.write_text("train:\n  micro_batch_size: 3\nloss:\n  name: sigmoid\n  beta: -0.1\n")
    with pytest.raises(ValueError) as error:
        load_config([str(base), str(more)], BASE)
    assert str(error.value) == (
        "train.global_batch_size=4 must be divisible by train.micro_batch_size=3 "
        f"(train.global_batch_size set in {base}, train.micro_batch_size set in {more})"
    )
    with pytest.raises(ValueError) as error:
        load_config([str(base), str(more)], BASE + ["train.micro_batch_size=2"])
    assert str(error.value) == (
        f"loss.beta=-0.1 is out of range (0.0, inf] for loss 'sigmoid' (loss.beta set in {more})"
    )
    with pytest.raises(ValueError, match=r"\(train.micro_batch_size set on the command line\)$"):
        load_config(None, BASE + ["train.micro_batch_size=3"])
