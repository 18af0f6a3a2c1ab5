"""Bad configuration is refused before anything starts, with one message naming the field."""

from pathlib import Path

import pytest

from tests.commands import run_python
from workflows.runs.config import ConfigError, load_config

CONFIGS = Path(__file__).parents[1] / "workflows" / "configs"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"training": {"epohcs": 3}}, r"training\.epohcs: unknown key"),
        ({"trainig": {"epochs": 3}}, r"trainig: unknown key"),
        (
            {"training": {"grad_clip_norm": 1.0}},
            r"training\.grad_clip_norm: now called training\.max_grad_norm \(the same setting\)",
        ),
        ({"training": {"batch_size": "big"}}, r"training\.batch_size: .*integer"),
        ({"training": {"epochs": 0}}, r"training\.epochs: .*greater than or equal to 1"),
        ({"training": {"lr": -1}}, r"training\.lr: .*greater than 0"),
        ({"training": {"strategy": "zero3"}}, r"training\.strategy: must be 'ddp'"),
        ({"model": {"name": "resnet999"}}, r"model\.name: unknown model 'resnet999'"),
        ({"data": {"dataset": "mnist"}}, r"data\.dataset: must be 'digits'"),
        ({"data": {"dataset": "cifar10"}}, r"data\.root: the cifar10 dataset needs a root"),
        (
            {"cluster": {"n_workers": 2}, "launch": {"world_size": 4}},
            r"launch\.world_size: 4 ranks need 4 workers, but cluster\.n_workers is 2",
        ),
        (
            {"launch": {"world_size": 4}, "training": {"batch_size": 2}},
            r"training\.batch_size: 2 is smaller than the world size 4",
        ),
        (
            {"launch": {"world_size": 2}, "training": {"batch_size": 30, "grad_accum_steps": 4}},
            r"training\.batch_size \(30\) must be a multiple of training\.grad_accum_steps",
        ),
        (
            {"launch": {"world_size": 4}, "training": {"batch_size": 6}},
            r"training\.batch_size: 6 must be a multiple of world size",
        ),
        (
            {"launch": {"world_size": 2}, "training": {"strategy": "data_parallel"}},
            r"launch\.world_size: data_parallel runs in one worker",
        ),
        ({"launch": {"init_timeout_s": 0}}, r"launch\.init_timeout_s: .*greater than 0"),
    ],
)
def test_invalid_config_names_the_field(raw, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(raw)
    assert "\n" not in str(info.value)


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: no such config file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nepochs = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(bad)


def test_overrides_are_typed_and_checked():
    config = load_config(
        {}, ["training.epochs=7", "training.precision=bf16", "data.drop_last=true"]
    )
    assert config.training.epochs == 7
    assert config.training.precision == "bf16"
    assert config.data.drop_last is True
    with pytest.raises(ConfigError, match=r"training\.epoch: unknown key"):
        load_config({}, ["training.epoch=7"])
    # Named as the caller wrote it: the keyword from Python, --set on the command line.
    with pytest.raises(ConfigError, match=r"^overrides 'epochs': expected section\.key=value"):
        load_config({}, ["epochs"])


def test_a_name_that_says_its_strategy_follows_a_strategy_set_by_an_override():
    # `--set training.strategy='fsdp'` ran as digits-ddp-<time>.
    demo = CONFIGS / "digits_ddp.toml"
    assert load_config(demo, ["training.strategy='fsdp'"]).name == "digits-fsdp"
    assert load_config(demo, ["training.strategy='ddp'"]).name == "digits-ddp"
    named = load_config(demo, ["training.strategy='fsdp'", "name='mine-ddp'"])
    assert named.name == "mine-ddp"  # a name given with it is the caller's
    raw = {"name": "ddpish-run", "training": {"strategy": "ddp"}}
    assert load_config(raw, ["training.strategy='fsdp'"]).name == "ddpish-run"  # words only


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_example_configs_are_valid(path):
    assert load_config(path).name


def test_validate_never_imports_torch_dcp_or_pipelining():
    # The CLI's own entry, in a fresh interpreter: torch's import alone takes seconds.
    pipeline_dp = str(CONFIGS / "cifar10_pipeline_dp.toml")
    code = (
        "import sys\n"
        "from workflows.cli import main\n"
        f"main(['validate', {pipeline_dp!r}], standalone_mode=False)\n"
        "from workflows.runs.config import load_config\n"
        f"load_config({str(CONFIGS / 'digits_pipeline.toml')!r})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert '"schedule": "1f1b"' in done.stdout  # validate printed the resolved config
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_client_never_imports_dtensor_dcp_or_dynamo():
    # A script's `from workflows import ...`, the CLI's driver: they import the ranks' modules
    # for the functions they send, not what those import on a rank (measured: a script's
    # imports took 3.9 s with them, 2.5 s without).
    code = (
        "import sys, workflows, workflows.runs.driver\n"
        "heavy = ('torch.distributed.tensor', 'torch.distributed.checkpoint', 'torch._dynamo')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_torch_free_model_tables_match_the_models():
    from torch import nn

    from workers.models import MODELS, layer_names
    from workers.spec.names import BUILTIN_MODELS, MODEL_LAYERS

    assert set(BUILTIN_MODELS) == set(MODELS)
    # Every built-in Sequential's cut points are written out; the others cut between blocks.
    sequential = {name for name, model in MODELS.items() if issubclass(model, nn.Sequential)}
    assert set(MODEL_LAYERS) == sequential
    for name in MODEL_LAYERS:
        assert list(MODEL_LAYERS[name]) == layer_names(name), name


def test_an_unreadable_signing_key_file_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^checkpoint\.signing_key_file: .*absent.*cannot read"):
        load_config({"checkpoint": {"signing_key_file": str(tmp_path / "absent")}})
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^checkpoint\.signing_key_file: .*empty: the file is"):
        load_config({"checkpoint": {"signing_key_file": str(tmp_path / "empty")}})
    (tmp_path / "key").write_bytes(b"secret\n")
    config = load_config({"checkpoint": {"signing_key_file": str(tmp_path / "key")}})
    assert config.checkpoint.signing_key_file == str(tmp_path / "key")


def test_train_from_python_refuses_a_missing_data_root_before_it_starts_a_cluster(tmp_path):
    import psutil

    from workflows.runs.driver import train

    config = load_config(
        {"data": {"dataset": "cifar10", "root": str(tmp_path / "absent")}, "training": {}}
    )
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match=r"^data\.root: .*absent") as error:
        train(config, on_event=None)  # no cluster given: it would start one
    assert "\n" not in str(error.value)
    # No worker, nanny or scheduler was started for it.
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"training": {"optimizer": "adamw", "lr_schedule": "cosine", "warmup_steps": 2}},
        {"training": {"lr_schedule": "step", "lr_step_size": 5, "lr_gamma": 0.5}},
        {"launch": {"world_size": "2:4", "elastic_batch": "per_rank"}},
    ],
)
def test_a_config_written_out_whole_loads_back_the_same(sections):
    """A run's config.json holds every field, defaults included: predict and --resume load it."""
    config = load_config(sections)
    assert load_config(config.model_dump(mode="json")) == config
