"""Text as training data and the built-in GPT: real files tokenized by Dask tasks into a store of
windows, and the transformer trained on the standard library's own sources under DDP and
tensor parallelism, matching one process."""

import numpy as np
import pytest
import torch
import zarr

from tests.commands import CONFIGS, run_dask_train
from tests.reference import SGD_FEW_STEPS, assert_matches_one_process, train_in_one_process
from tests.refusals import refusal
from workers.sources import SourceError
from workers.sources.text import list_text, resolve_root
from workflows.data.preprocess import prepare_store
from workflows.runs.config import load_config
from workflows.runs.driver import train

# Small enough that a step is milliseconds; 4 heads split over tp = 2 or 4.
GPT = {"name": "gpt", "kwargs": {"dim": 32, "n_layers": 2, "n_heads": 4}}
# The json package of this Python: five real source files (~48 kB), on every machine.
CORPUS = {"dataset": "text", "root": "python:json", "files": "*.py", "sequence_length": 32}
BASE = SGD_FEW_STEPS | {"batch_size": 16, "epochs": 1, "seed": 5, "max_steps": 4}


@pytest.fixture
def gpt_config(make_config):
    def gpt_config(**sections):
        raw = {"name": "gpt", "data": CORPUS, "model": GPT} | sections
        return make_config(raw, **(BASE | sections.pop("training", {})))

    return gpt_config


def _windows(text: bytes, length: int) -> np.ndarray:
    """The store's samples and targets as the docs define them, cut here by hand."""
    stream = np.frombuffer(text, dtype=np.uint8)
    count = (len(stream) - 1) // length
    return np.stack([stream[i * length : i * length + length + 1] for i in range(count)])


def test_the_store_holds_each_splits_files_as_windows_and_their_next_tokens(
    cluster, make_config, tmp_path
):
    corpus = tmp_path / "corpus"
    (corpus / "more").mkdir(parents=True)
    texts = {
        "a.txt": b"the quick brown fox jumps over the lazy dog\n" * 5,
        "b.txt": b"pack my box with five dozen liquor jugs\n" * 4,
        "more/c.txt": "\u00e9t\u00e9 \u00e0 l'\u00eele\n".encode() * 7,
        "skipped.md": b"not matched by the glob",
    }
    for name, text in texts.items():
        (corpus / name).write_bytes(text)
    raw = {
        "data": {
            "dataset": "text",
            "root": str(corpus),
            "sequence_length": 8,
            "chunk_size": 5,
            "store": str(tmp_path / "store"),
            "val_fraction": 0.3,
        }
    }
    data = make_config(raw).data.resolved()
    listing = list_text(data.root, files=data.files, val_fraction=0.3, seed=0, storage_options={})
    assert len(listing.train) == 2 and len(listing.val) == 1  # split by file, .md left out

    built = prepare_store(cluster.client, data, seed=0)
    assert not built.reused and built.classes == [str(i) for i in range(256)]
    group = zarr.open_group(data.store_url, mode="r")
    for split, records in (("train", listing.train), ("val", listing.val)):
        text = b"".join((corpus / r.split(str(corpus) + "/")[1]).read_bytes() for r in records)
        windows = _windows(text, 8)
        np.testing.assert_array_equal(group[f"{split}/tokens"][:], windows[:, :-1])
        np.testing.assert_array_equal(group[f"{split}/next"][:], windows[:, 1:])
        assert built.counts[split] == len(windows)
    assert prepare_store(cluster.client, data, seed=0).reused

    # Characters: the corpus's own alphabet, multi-byte ones one token each.
    chars = make_config(raw | {"data": raw["data"] | {"tokenizer": "char"}}).data.resolved()
    by_char = prepare_store(cluster.client, chars, seed=0)
    alphabet = sorted(set(b"".join(t for n, t in texts.items() if n.endswith(".txt")).decode()))
    assert by_char.classes == alphabet and "\u00e9" in alphabet
    tokens = zarr.open_group(chars.store_url, mode="r")["train/tokens"][:]
    assert tokens.max() < len(alphabet)


def test_a_corpus_the_files_glob_does_not_match_is_refused_naming_the_field(tmp_path):
    (tmp_path / "one.txt").write_text("only one")
    with pytest.raises(SourceError, match=r"data.files: '\*\*/\*.txt' matches 1 file"):
        list_text(str(tmp_path), files="**/*.txt", val_fraction=0.2, seed=0, storage_options={})
    with pytest.raises(SourceError, match=r"data\.root: python:no_such_package: no installed"):
        resolve_root("python:no_such_package")
    assert "data.root: the text dataset needs a root" in refusal(
        {"data": {"dataset": "text"}}, base={}
    )
    assert "data.augment" in refusal({"data": {"augment": True}}, base={"data": CORPUS})


@pytest.mark.equivalence
def test_the_transformer_under_ddp_matches_one_process(cluster, gpt_config):
    # Byte tokens of the standard library's json package, as token ids; four steps of
    # cross-entropy over every position: the float32 few-steps tolerance (tests/reference.py).
    config = gpt_config()
    result = train(config, cluster=cluster, on_event=None)
    assert result.world_size == 2
    assert 0.0 <= result.history[-1]["val_accuracy"] <= 1.0
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=4)
    untrained = train_in_one_process(config, world_size=2, steps=0)
    assert not torch.equal(result.state_dict["output.weight"], untrained["output.weight"])


@pytest.mark.equivalence
def test_the_transformer_split_by_its_own_tensor_parallel_plan_matches_one_process(
    cluster, gpt_config
):
    # No model.tp_plan: the built-in GPT brings its plan (workers/tensor_plans.py).
    config = gpt_config(training={"strategy": "fsdp"}, parallel={"tp": 2})
    result = train(config, cluster=cluster, on_event=None)
    assert result.world_size == 2
    # Both tp ranks read the same batches: one replica's.
    assert_matches_one_process(result.state_dict, config, world_size=1, steps=4)


def test_the_example_config_trains_the_gpt_on_the_standard_library(cluster, store_dir):
    # The shipped example, on a fifth of its files and for two steps: the stdlib's modules
    # starting with "a" (argparse, ast, ...), tensor parallel over the shared cluster's two
    # workers. Its full run is the README's figure.
    overrides = [f"data.store='{store_dir / 'stdlib-a'}'", "data.files='a*.py'"]
    config = load_config(CONFIGS / "stdlib_gpt.toml", [*overrides, "training.max_steps=2"])
    result = train(config, cluster=cluster, on_event=None)
    assert (result.strategy, result.world_size) == ("fsdp", 2)
    assert result.history[-1]["step"] == 2 and result.history[-1]["val_loss"] > 0
    assert result.store.num_classes == 256  # bytes


def test_the_cli_refuses_a_corpus_glob_matching_nothing_before_any_cluster_starts(tmp_path):
    done = run_dask_train(
        *("run", str(CONFIGS / "stdlib_gpt.toml"), "--output", str(tmp_path / "run")),
        *("--set", "data.files='*.nothing'"),
    )
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "data.files: '*.nothing' matches 0 file(s) under python:stdlib" in line, line
    assert "\n" not in line and not (tmp_path / "run").exists()
