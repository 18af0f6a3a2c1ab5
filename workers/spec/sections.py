"""The config sections of the trainer's components: checkpoint, data, model, training,
parallel, and the strategies' own: fsdp, pipeline (their plans: ``workers/spec/plans/``).

They live here, apart from the code that uses them, because this module must not import torch:
``dask-train validate`` and every config check import it, and torch alone takes seconds to
import. The components re-export their own section (``workers.data.DataConfig`` and so on).
"""

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializationInfo,
    ValidationInfo,
    field_validator,
    model_validator,
)

from workers.spec.locations import checked_location
from workers.spec.names import (
    BUILTIN_MODELS,
    BUILTIN_TP_PLANS,
    COLLECTION_SOURCES,
    IMPORT_PATH,
    SOURCES,
    STRATEGIES,
    check_model_name,
)
from workers.spec.secrets import (
    mask_url,
    redact,
    remember_options,
    remember_url,
    without_secrets,
)

# Context for a dump that keeps the credentials: a config rebuilt in this process from its
# dump (a sweep's trials), never one written out.
KEEP_CREDENTIALS = {"credentials": True}


def _serialized(options: dict[str, Any], info: SerializationInfo) -> dict[str, Any]:
    # Every dump (config.json, the tracker's parameters, a sweep's request) leaves the
    # secrets out; the model itself, which travels to the workers pickled, keeps them.
    if (info.context or {}).get("credentials"):
        return options
    return without_secrets(options)


def _location_serialized(location: str | None, info: SerializationInfo) -> str | None:
    # A URL's password (ftp://user:PASSWORD@host/x) is never written out either.
    if location is None or (info.context or {}).get("credentials"):
        return location
    return mask_url(location)


class Redacted(BaseModel):
    """A section whose ``repr`` masks every secret (workers/spec/secrets.py)."""

    def __repr__(self) -> str:
        return redact(super().__repr__())

    def __str__(self) -> str:
        return redact(super().__str__())


def located(location: str | None) -> str | None:
    """A location's URL password, remembered to be masked wherever it is shown."""
    if location is not None:
        remember_url(location)
    return location


# A location field's type: its password remembered when read, masked when written.
Location = Annotated[str | None, AfterValidator(located), PlainSerializer(_location_serialized)]


def fsspec_options(section: str) -> Any:
    """The type of ``<section>.storage_options``, fsspec's options for a URL: checked to be a
    table, and written out without credentials."""

    def a_table(options: Any) -> Any:
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise ValueError(
                f"{section}.storage_options: a table of fsspec options with string keys (e.g. "
                "{endpoint_url = 'http://host:9000'}), not a " + type(options).__name__
            )
        remember_options(options)
        return options

    return Annotated[dict[str, Any], BeforeValidator(a_table), PlainSerializer(_serialized)]


class CheckpointConfig(Redacted):
    """When to checkpoint, how many to keep, and whether to continue from one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: Location = Field(
        default=None,
        description="a folder every worker can reach, or an fsspec URL (s3://bucket/ckpt, "
        "gs://, abfs://); `dask-train run` uses <run dir>/checkpoints",
    )
    storage_options: fsspec_options("checkpoint") = Field(  # type: ignore[valid-type]
        default_factory=dict,
        description="the options of directory's fsspec filesystem, e.g. {endpoint_url = "
        "'http://minio:9000'} for s3://; credentials may be given here too, but are never "
        "written out (config.json, tracking): better in the environment or fsspec's config",
    )
    every_steps: int = Field(default=0, ge=0, description="0: at epoch ends only")
    at_epoch_end: bool = Field(
        default=True,
        description="checkpoint at each epoch's end (the last step is always checkpointed)",
    )
    keep: int = Field(default=3, ge=1, description="newest checkpoints kept")
    resume: Literal["auto", "never"] = Field(
        default="auto", description="auto: continue from the newest good checkpoint of this run"
    )
    run_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,128}$",
        description="whose checkpoints these are: each manifest names its run, and a run "
        "resumes from, deletes and replaces only its own, so runs sharing a directory leave "
        "each other's alone; none: the run's name (a run started again under the same name "
        "continues from its checkpoints)",
    )
    signing_key_file: str | None = Field(
        default=None,
        description="a secret key file: manifests carry an HMAC-SHA256 made with it, and a "
        "checkpoint without a valid one is refused (every worker must read the same file)",
    )
    async_save: bool = Field(
        default=True,
        description="training waits only while each rank's state is copied into CPU "
        "buffers; a thread serializes and writes it, one checkpoint at a time, and it counts "
        "(gets its manifest) once every rank's files are written: then, or at the latest at "
        "the next save, an elastic resize or the run's end (a stopped run waits for it "
        "within launch.release_timeout_s, else drops it). Every built-in strategy allows it "
        "(each rank stages its own part, DDP's, FSDP's and TP's shards, a pipeline's stages "
        "alike); it costs a copy of that part in CPU memory, kept for the run and reused by "
        "every save (pinned on a GPU), plus its serialized files while they are written. "
        "false: training waits for every byte. ctx.save in launch() is always synchronous",
    )

    @field_validator("directory")
    @classmethod
    def _a_location(cls, value: str | None) -> str | None:
        return None if value is None else checked_location("checkpoint.directory", value)

    @field_validator("signing_key_file")
    @classmethod
    def _key_readable(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser().resolve()
        try:
            key = path.read_bytes()
        except OSError as error:
            raise ValueError(
                f"checkpoint.signing_key_file: {value}: cannot read it ({error.strerror or error})"
            ) from None
        if not key.strip():
            raise ValueError(f"checkpoint.signing_key_file: {value}: the file is empty")
        # Absolute, so workers started elsewhere read the same path.
        return str(path)

    def resolved(self) -> "CheckpointConfig":
        """A copy with the folder made absolute on the client (workers may run elsewhere)."""
        if self.directory is None or "://" in self.directory:
            return self
        return self.model_copy(update={"directory": str(Path(self.directory).absolute())})


class DataConfig(Redacted):
    """Where the images come from, where the preprocessed store lives, how ranks read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Literal[SOURCES] = Field(  # type: ignore[valid-type]
        default="digits",
        description="digits: scikit-learn's, no download; cifar10: the pickled batches; "
        "imagefolder: a class-per-folder tree of images; synthetic: a learnable set of any "
        "size; text: files of text, windows of tokens for a language model; parquet, zarr: "
        "your own files, read as Dask collections (workers/sources/, one module each)",
    )
    root: Location = Field(
        default=None,
        description="cifar10: folder holding cifar-10-batches-py; imagefolder: "
        "class-per-folder tree; text: the folder of the files, or 'python:stdlib' (the "
        "standard library's sources) or 'python:<package>'; parquet: the files; zarr: the "
        "group (local path or fsspec URL)",
    )
    files: str = Field(
        default="**/*.txt", description="text: which files under root (a glob, e.g. '**/*.py')"
    )
    tokenizer: Literal["byte", "char"] = Field(
        default="byte",
        description="text: 'byte' (256 tokens) or 'char' (the corpus's distinct characters)",
    )
    sequence_length: int = Field(
        default=64, ge=2, le=65536, description="text: tokens per sample (its targets: one on)"
    )
    features: tuple[str, ...] | None = Field(
        default=None,
        description="parquet: the feature columns (none: every column but the target); "
        "zarr: the one array of samples",
    )
    target: str | None = Field(
        default=None, description="parquet: the label column; zarr: the array of labels"
    )
    download: bool = Field(default=False, description="cifar10: fetch the archive into root")
    store: Location = Field(
        default=None,
        description="zarr store (path or URL); default data/stores/<dataset>, and for Dask "
        "collections written into a store data/stores/collections-<their fingerprint>",
    )
    collections: Literal["persist", "store"] = Field(
        default="persist",
        description="Dask collections (train(data=...), parquet, zarr): 'persist' them on the "
        "rank workers and read them where they lie, or write them into data.store as Dask "
        "tasks and read its chunks (data larger than the cluster's memory)",
    )
    storage_options: fsspec_options("data") = Field(  # type: ignore[valid-type]
        default_factory=dict,
        description="the options of the store's and root's fsspec filesystem; credentials may "
        "be given here, but are never written out: better in the environment",
    )
    image_size: int = Field(
        default=32, ge=8, le=1024, description="images are resized to this square"
    )
    val_fraction: float = Field(
        default=0.2,
        gt=0.0,
        lt=1.0,
        description="held out for validation where the data has no val split (cifar10 has its "
        "own; imagefolder uses train/ and val/ when both exist); seeded by training.seed",
    )
    synthetic_samples: int = Field(default=4096, ge=16, description="synthetic: total samples")
    on_bad: Literal["fail", "skip"] = Field(
        default="fail", description="a corrupt image or batch file: fail naming it, or skip it"
    )
    chunk_size: int = Field(default=1024, ge=1, description="samples per store chunk")
    shuffle_window: int = Field(default=4, ge=1, description="chunks shuffled together")
    in_memory: bool = Field(
        default=False, description="read the whole training split into memory once per rank"
    )
    prefetch_batches: int = Field(default=4, ge=0, description="batches read ahead in a thread")
    augment: bool = Field(default=False, description="random crop (pad 4) and horizontal flip")
    drop_last: bool = Field(default=False, description="drop the samples that do not fill ranks")

    @field_validator("root", "store")
    @classmethod
    def _a_location(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or value.startswith("python:"):  # text: a package's own sources
            return value
        return checked_location(f"data.{info.field_name}", value)

    @model_validator(mode="after")
    def _root_where_needed(self) -> "DataConfig":
        if self.dataset == "text" and self.augment:
            raise ValueError("data.augment: crops and flips are for images; the text has none")
        if self.dataset in ("cifar10", "imagefolder", "text", "parquet", "zarr") and not self.root:
            raise ValueError(f"data.root: the {self.dataset} dataset needs a root folder or URL")
        if self.dataset in COLLECTION_SOURCES and self.target is None:
            raise ValueError(f"data.target: name the {self.dataset} labels (a column or array)")
        if self.dataset == "zarr" and (self.features is None or len(self.features) != 1):
            raise ValueError("data.features: name the one zarr array of samples, e.g. ['images']")
        return self

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample of the store built from this source: a window of tokens for text, an
        image (workflows/data/preprocess.py) otherwise."""
        if self.dataset == "text":
            return (self.sequence_length,)
        return (3, self.image_size, self.image_size)

    @property
    def tokens(self) -> bool:
        """Whether the store's samples are token ids (an embedding's indices), not values."""
        return self.dataset == "text"

    @property
    def store_url(self) -> str:
        store = self.store or f"data/stores/{self.dataset}"
        # A relative path means the client's working directory, wherever the worker runs.
        return store if "://" in store else str(Path(store).expanduser().resolve())

    def resolved(self) -> "DataConfig":
        """A copy with local paths made absolute on the client, for workers to use."""
        root = self.root
        if root is not None and "://" not in root and not root.startswith("python:"):
            root = str(Path(root).expanduser().resolve())
        return self.model_copy(update={"root": root, "store": self.store_url})


# The losses by name, and the task each implies (workers/losses.py holds the functions).
LOSSES: dict[str, str] = {
    "cross_entropy": "classification",
    "bce_with_logits": "classification",
    "mse": "regression",
    "l1": "regression",
}

# The figures each task reports besides the loss (workers/losses.py computes them; the epoch
# lines, the Training page and /metrics show them).
METRICS: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy",),
    "regression": ("mse", "mae", "r2"),
}

# The optimizers and schedules a config may name, written out so that a config is checked
# without importing torch (workers/optimizers.py builds them; tests/test_optimizers.py compares
# these tables with torch's classes and signatures).
# training.optimizer's short names: the torch.optim class each means.
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
# torch.optim's classes by name. Left out: LBFGS, whose step needs a closure the loop has not.
TORCH_OPTIMIZERS = (
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Muon", "NAdam",
    "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam",
)  # fmt: skip
# The keyword arguments of the short names' classes besides params, lr, weight_decay (and
# SGD's momentum), which are training's own keys.
OPTIMIZER_ARGUMENTS = {
    "SGD": ("dampening", "nesterov", "maximize", "foreach", "differentiable", "fused"),
    "Adam": (
        "betas", "eps", "amsgrad", "foreach", "maximize", "capturable", "differentiable",
        "fused", "decoupled_weight_decay",
    ),
    "AdamW": (
        "betas", "eps", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
        "fused",
    ),
}  # fmt: skip
# The built-in schedules (after training.warmup_steps).
SCHEDULES = ("constant", "cosine", "linear", "step")
# The built-in schedules shaped over the run's steps (down to min_lr): they need the step count
# before the first step.
SCHEDULES_OVER_THE_RUN = ("cosine", "linear")
# torch.optim.lr_scheduler's classes that a config can build from keyword arguments. Left
# out: LambdaLR and MultiplicativeLR (a function), SequentialLR and ChainedScheduler (other
# schedulers), ReduceLROnPlateau (a metric at each step): give such a one in Python.
TORCH_SCHEDULES = (
    "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR",
    "ExponentialLR", "LinearLR", "MultiStepLR", "OneCycleLR", "PolynomialLR", "StepLR",
)  # fmt: skip


def _choice(field: str, value: str, known: list[str], what: str) -> str:
    """The refusal of a name that is none of ``known``: with the nearest as a hint."""
    close = [k for k in known if k.lower() == value.lower()]
    close = close or difflib.get_close_matches(value, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{field}: unknown {what} {value!r}; {hint}choose one of {known} or an import path "


class ModelConfig(Redacted):
    """Which model to train (workers/model_sources/), and the arguments its factory takes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="cifar_cnn",
        description="a built-in name, 'torchvision:<name>', 'timm:<name>' or an import path "
        "'package.module:factory'",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the factory; num_classes, in_channels, image_size "
        "and in_features are filled in from the data where it takes them",
    )
    tp_plan: str | None = Field(
        default=None,
        description="'package.module:plan': plan(model, mesh) returns the model's "
        "tensor-parallel plan for parallelize_module (module name -> ParallelStyle); "
        "needed by parallel.tp > 1 (the built-in gpt has its own)",
    )

    init: Literal["auto", "factory", "reset_parameters"] = Field(
        default="auto",
        description="where the initial values come from: 'reset_parameters' (each module's "
        "reset_parameters(), in the model's order, under training.seed; a strategy that splits "
        "the model builds it on the meta device and each rank draws only its part), 'factory' "
        "(the values the factory gives, pretrained ones too; such a strategy builds the whole "
        "model on every rank first), 'auto' (reset_parameters for the built-in models, whose "
        "own values they are; factory for any other)",
    )

    weights: Location = Field(
        default=None,
        description="a file of the whole model's state dict to start from, on every worker "
        "(torch.save's .pt, or .safetensors): each rank maps it and copies only its own part, "
        "so the model is never loaded whole; or a torch.distributed.checkpoint folder (a run's "
        "checkpoint, or dcp.save(model.state_dict())), on disk or at an fsspec URL "
        "(s3://bucket/runs/x/checkpoints/step-00000100), of which each rank loads its part; "
        "takes the place of model.init's values",
    )
    storage_options: fsspec_options("model") = Field(  # type: ignore[valid-type]
        default_factory=dict,
        description="the options of weights' fsspec filesystem when it is a URL, e.g. "
        "{endpoint_url = 'http://minio:9000'}; credentials may be given here, but are never "
        "written out: better in the environment",
    )

    @field_validator("name")
    @classmethod
    def _known_syntax(cls, name: str) -> str:
        check_model_name(name)
        return name

    @field_validator("weights")
    @classmethod
    def _a_location(cls, value: str | None) -> str | None:
        return None if value is None else checked_location("model.weights", value)

    @field_validator("tp_plan")
    @classmethod
    def _an_import_path(cls, plan: str | None) -> str | None:
        if plan is not None and not IMPORT_PATH.match(plan):
            raise ValueError(f"{plan!r} is not an import path 'package.module:plan'")
        return plan

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_MODELS

    @property
    def in_place_init(self) -> bool:
        """Whether the values are drawn in place (workers/in_place_init.py): each module's
        ``reset_parameters`` (``init`` resolved), or ``weights``."""
        drawn = self.init == "reset_parameters" or (self.init == "auto" and self.builtin)
        return drawn or self.weights is not None

    @property
    def resolved_tp_plan(self) -> str | None:
        """``tp_plan``, or the built-in model's own plan (workers/tensor_plans.py)."""
        return self.tp_plan or BUILTIN_TP_PLANS.get(self.name)


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].default


# training.activation_checkpointing (workers/activation_checkpointing.py)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


class TrainingConfig(BaseModel):
    """How to train: strategy, optimizer, schedule, precision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal[STRATEGIES] = Field(  # type: ignore[valid-type]
        default="ddp",
        description="ddp, data_parallel (nn.DataParallel over one worker's GPUs), "
        "model_parallel, pipeline, fsdp (FSDP2: parameters, gradients and optimizer state "
        "sharded over the ranks) or hsdp (FSDP2 within groups of parallel.dp_shard ranks, "
        "replicated across the groups)",
    )
    epochs: int = Field(default=3, ge=1, description="passes over the training split")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many steps")
    batch_size: int = Field(default=64, ge=1, description="global batch per optimizer step")
    grad_accum_steps: int = Field(
        default=1, ge=1, description="micro-batches per optimizer step (DDP: no_sync between)"
    )
    optimizer: str = Field(
        default="sgd",
        description="sgd, adamw or adam; another torch.optim class by name ('RMSprop', "
        "'NAdam'); or an import path 'package.module:Class', called as Class(params, lr=..., "
        "weight_decay=..., **optimizer_kwargs)",
    )
    optimizer_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="the optimizer's other arguments, e.g. {betas = [0.9, 0.95], eps = 1e-8, "
        "fused = true} for adamw; its learning rate, weight decay and momentum are "
        "training.lr, weight_decay and momentum",
    )
    lr: float = Field(
        default=0.05,
        gt=0,
        description="the peak learning rate: reached after the warm-up, then scaled by lr_schedule",
    )
    momentum: float = Field(
        default=0.9,
        ge=0,
        lt=1,
        description="sgd's momentum (adam and adamw take betas in optimizer_kwargs)",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0,
        description="the optimizer's weight decay (adamw's decoupled, sgd's and adam's added "
        "to the gradient), on parameters of 2 or more dimensions unless "
        "decay_norms_and_biases",
    )
    decay_norms_and_biases: bool = Field(
        default=False,
        description="also decay biases and norms' scales (parameters of fewer than 2 "
        "dimensions), which nanoGPT and torchtitan leave undecayed",
    )
    lr_schedule: str = Field(
        default="constant",
        description="after the warm-up: constant; cosine or linear: decay to min_lr by the "
        "run's end (training.max_steps, else its epochs); step: times lr_gamma every "
        "lr_step_size steps; or a torch.optim.lr_scheduler class by name ('OneCycleLR') or an "
        "import path, called with lr_schedule_kwargs",
    )
    lr_schedule_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="a torch.optim.lr_scheduler class's arguments, e.g. {max_lr = 0.1} for "
        "OneCycleLR (a total_steps argument left out is the run's steps)",
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="steps of linear warm-up from lr / warmup_steps to lr, before the "
        "built-in schedules",
    )
    min_lr: float = Field(
        default=0.0, ge=0, description="cosine and linear: the learning rate they end at (<= lr)"
    )
    lr_step_size: int | None = Field(
        default=None, ge=1, description="step: steps between decays (lr_schedule = 'step' needs it)"
    )
    lr_gamma: float = Field(
        default=0.1, gt=0, description="step: the factor each decay multiplies the rate by"
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="bf16 autocast (CPU or GPU; a CPU without bfloat16 instructions, AVX512-BF16 "
        "or AMX, emulates it several times slower, and rank 0 warns), or fp16 with loss "
        "scaling (GPU)",
    )
    max_grad_norm: float | None = Field(
        default=None,
        gt=0,
        description="clip the whole model's gradient norm to this (under fsdp, hsdp, tp and "
        "pipeline: the norm over every rank's shards and stages)",
    )
    activation_checkpointing: Literal[ACTIVATION_CHECKPOINTING] = Field(  # type: ignore[valid-type]
        default="none",
        description="recompute activations in the backward instead of keeping them from the "
        "forward: full: each block keeps only its input; selective: also the outputs of its "
        "attention and of every other matrix product, and recomputes the rest. The blocks: the "
        "members of the model's top-level ModuleList or ModuleDict (the gpt's layers), else "
        "its top-level children with parameters, or the classes named in "
        "activation_checkpointing_modules. Trains the same parameters as none",
    )
    activation_checkpointing_modules: list[str] = Field(
        default_factory=list,
        description="the class names ('TransformerBlock') or qualified names "
        "('package.module.Block') of the modules to checkpoint, instead of the model's blocks",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each of the model's blocks (as activation checkpointing "
        "names them; the whole model if it has none) before the strategy lays it out, as "
        "torchtitan does: the first steps compile, steady steps run the compiled code",
    )
    compile_backend: str = Field(
        default="inductor",
        description="torch.compile's backend: 'inductor' (generated kernels; needs a C++ "
        "compiler on a CPU), 'aot_eager' (traced, no code generated), or any torch knows",
    )
    seed: int = Field(default=0, description="model initialization, data split and shuffling")
    log_every_steps: int = Field(default=0, ge=0, description="0: log at epoch ends only")
    loss: str = Field(
        default="cross_entropy",
        description=f"one of {list(LOSSES)}, or an import path 'package.module:loss' "
        "(a function or an nn.Module class; the mean over the batch)",
    )
    task: Literal["classification", "regression"] | None = Field(
        default=None,
        description="what the metrics measure; unset: from the loss (mse, l1: regression)",
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, loss: str) -> str:
        if loss in LOSSES or IMPORT_PATH.match(loss):
            return loss
        close = difflib.get_close_matches(loss, list(LOSSES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown loss {loss!r}; {hint}choose one of {list(LOSSES)} or an import path "
            "'package.module:loss'"
        )

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, name: str) -> str:
        if name in OPTIMIZERS or name in TORCH_OPTIMIZERS or IMPORT_PATH.match(name):
            return name
        known = [*OPTIMIZERS, *(n for n in TORCH_OPTIMIZERS if n.lower() not in OPTIMIZERS)]
        raise ValueError(
            _choice("training.optimizer", name, known, "optimizer") + "'package.module:Class'"
        )

    @field_validator("lr_schedule")
    @classmethod
    def _known_schedule(cls, name: str) -> str:
        if name in SCHEDULES or name in TORCH_SCHEDULES or IMPORT_PATH.match(name):
            return name
        known = [*SCHEDULES, *TORCH_SCHEDULES]
        raise ValueError(
            _choice("training.lr_schedule", name, known, "schedule") + "'package.module:Class'"
        )

    @property
    def optimizer_class(self) -> str:
        """The torch.optim class name, or the import path, that ``optimizer`` means."""
        return OPTIMIZERS.get(self.optimizer, self.optimizer)

    @property
    def builtin_schedule(self) -> bool:
        return self.lr_schedule in SCHEDULES

    @property
    def checked_without_torch(self) -> bool:
        """Whether validation has checked all of the optimizer and the schedule; if not, a
        class, an import path or argument values that torch alone can check are left to
        ``workers.optimizers.check`` (the client runs it before launching)."""
        return (
            self.optimizer_class in OPTIMIZER_ARGUMENTS
            and not self.optimizer_kwargs
            and self.builtin_schedule
        )

    @property
    def resolved_task(self) -> str:
        """The task the metrics follow: set, or implied by a named loss."""
        return self.task or LOSSES.get(self.loss, "classification")

    @model_validator(mode="after")
    def _checkpointed_modules_need_a_mode(self) -> "TrainingConfig":
        if self.activation_checkpointing_modules and self.activation_checkpointing == "none":
            raise ValueError(
                "training.activation_checkpointing_modules: set training."
                "activation_checkpointing to 'full' or 'selective' for them, or leave it empty"
            )
        return self

    @model_validator(mode="after")
    def _optimizer_arguments_fit(self) -> "TrainingConfig":
        name, given = self.optimizer_class, set(self.optimizer_kwargs)
        own = {"lr": "training.lr", "weight_decay": "training.weight_decay"}
        if name == "SGD":
            own["momentum"] = "training.momentum"
        clash = sorted(given & set(own))
        if clash:
            raise ValueError(
                f"training.optimizer_kwargs: {clash[0]!r} is {own[clash[0]]}; set it there"
            )
        if name in OPTIMIZER_ARGUMENTS:
            unknown = sorted(given - set(OPTIMIZER_ARGUMENTS[name]))
            if unknown:
                close = difflib.get_close_matches(unknown[0], OPTIMIZER_ARGUMENTS[name], n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"training.optimizer_kwargs: {self.optimizer} takes no argument "
                    f"{unknown[0]!r}; {hint}it takes {list(OPTIMIZER_ARGUMENTS[name])}"
                )
        # Values, not whether a key was given: a config written out whole (a run's
        # config.json) holds every field at its default, and must load back.
        if name != "SGD" and self.momentum != _default(TrainingConfig, "momentum"):
            raise ValueError(
                f"training.momentum is sgd's; {self.optimizer} takes its own in "
                "training.optimizer_kwargs (adam and adamw: betas)"
            )
        return self

    @model_validator(mode="after")
    def _schedule_arguments_fit(self) -> "TrainingConfig":
        schedule = self.lr_schedule
        if self.min_lr > self.lr:
            raise ValueError(
                f"training.min_lr ({self.min_lr:g}) is above training.lr ({self.lr:g})"
            )
        if self.builtin_schedule and self.lr_schedule_kwargs:
            raise ValueError(
                f"training.lr_schedule_kwargs: for a torch.optim.lr_scheduler class; the "
                f"built-in {schedule!r} takes training.warmup_steps, min_lr, lr_step_size, "
                "lr_gamma"
            )
        if not self.builtin_schedule and self.warmup_steps:
            raise ValueError(
                f"training.warmup_steps: for the built-in schedules {list(SCHEDULES)}, not "
                f"{schedule!r} (give the class's own warm-up in lr_schedule_kwargs, if it has "
                "one)"
            )
        if self.min_lr and schedule not in SCHEDULES_OVER_THE_RUN:
            raise ValueError(f"training.min_lr: for cosine and linear, not {schedule!r}")
        if schedule == "step" and self.lr_step_size is None:
            raise ValueError("training.lr_step_size: lr_schedule = 'step' needs it")
        stepping = self.lr_step_size is not None or self.lr_gamma != _default(
            TrainingConfig, "lr_gamma"
        )
        if schedule != "step" and stepping:
            raise ValueError(
                f"training.lr_step_size and lr_gamma: for lr_schedule = 'step', not {schedule!r}"
            )
        return self

    @model_validator(mode="after")
    def _accumulation_fits(self) -> "TrainingConfig":
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(
                f"training.batch_size ({self.batch_size}) must be a multiple of "
                f"training.grad_accum_steps ({self.grad_accum_steps})"
            )
        return self


class ParallelConfig(BaseModel):
    """The degrees of parallelism, whose product is the world size: ``pp`` ranks in a row of
    pipeline stages, ``dp_replicate`` copies of the model (or of each stage), each sharded over
    ``dp_shard`` ranks, each of whose layers ``tp`` ranks split (torchtitan's names).

    ``ddp`` replicates over every rank and ``fsdp`` shards over every rank (the world size /
    ``tp``), so neither needs the data-parallel degrees; ``hsdp`` needs one of the two (the
    other is what the world size leaves). ``pipeline`` and ``model_parallel`` take ``pp`` and
    the stages' replicas: ``dp_shard`` (FSDP2) or ``dp_replicate`` (DDP), the one the world
    size leaves when only ``pp`` is given (``pipeline.dp`` and ``pipeline.dp_mode`` say the
    same in older configs).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pp: int | None = Field(
        default=None,
        ge=1,
        description="pipeline and model_parallel: ranks in a row of stages, each holding its "
        "own (unset: the world size / the stages' replicas)",
    )
    dp_replicate: int | None = Field(
        default=None,
        ge=1,
        description="hsdp: copies of the model (unset: the world size / dp_shard); pipeline: "
        "DDP replicas of every stage",
    )
    dp_shard: int | None = Field(
        default=None,
        ge=1,
        description="hsdp: ranks one copy is sharded over, e.g. the GPUs of one host "
        "(unset: the world size / dp_replicate); pipeline: FSDP2 shards of every stage",
    )

    tp: int = Field(
        default=1,
        ge=1,
        description="fsdp and hsdp: ranks that split each layer (tensor parallelism, by the "
        "model's model.tp_plan); they read the same batches",
    )

    @property
    def given(self) -> bool:
        """Whether a data-parallel degree is set."""
        return self.dp_replicate is not None or self.dp_shard is not None


class FSDPConfig(BaseModel):
    """How ``fsdp`` and ``hsdp`` shard (FSDP2's ``fully_shard``): each top-level module that
    holds parameters is one unit, gathered for its forward and backward, then the root."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reshard_after_forward: bool = Field(
        default=True,
        description="free a unit's gathered parameters after its forward and gather them "
        "again for the backward (false: keep them, more memory, one all-gather less)",
    )
    cpu_offload: bool = Field(
        default=False,
        description="keep the sharded parameters, gradients and optimizer state in host memory "
        "(GPU: the optimizer steps on the CPU)",
    )
    return_freed_memory: bool = Field(
        default=True,
        description="on a CPU: hand each freed block over 1 MiB (a unit's gathered parameters "
        "and gradients) back to the kernel at once, so that a rank's peak stays near its shards "
        "and the plan's estimate; false keeps freed memory for reuse, as a plain script does: "
        "less CPU per step, a peak up to 1.7x the estimate (measured). No effect on a GPU",
    )


class PipelineConfig(BaseModel):
    """How the model is cut into stages and how the stages are scheduled.

    ``model_parallel`` uses the cut (``split_points`` / ``balance``) and ignores the schedule.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        default="1f1b", description="the pipeline schedule (torch.distributed.pipelining)"
    )
    n_microbatches: int = Field(
        default=8, ge=1, description="micro-batches per step (model_parallel: 1)"
    )
    stages_per_rank: int = Field(default=1, ge=1, description="more than 1: interleaved only")
    split_points: tuple[str, ...] | None = Field(
        default=None,
        description="where stage 2, 3, … begin: top-level module names, blocks of a model that "
        "names them (gpt: 'layers.2'), or module paths of a traced model; unset: planned",
    )
    balance: Literal["profile", "layers"] = Field(
        default="profile",
        description="without split_points: profile each layer on a worker and balance time, "
        "or give each stage an equal number of layers",
    )
    dp: int = Field(default=1, ge=1, description="data-parallel replicas of every stage")
    dp_mode: Literal["fsdp", "ddp"] = Field(
        default="fsdp",
        description="how a stage's replicas average gradients: FSDP2, or DDP (1f1b only)",
    )

    @model_validator(mode="after")
    def _schedule_fits(self) -> "PipelineConfig":
        interleaved = self.schedule == "interleaved_1f1b"
        if interleaved and self.stages_per_rank < 2:
            raise ValueError(
                "pipeline.stages_per_rank: interleaved_1f1b runs several stages per rank; "
                "set stages_per_rank = 2 or more, or use schedule = '1f1b'"
            )
        if not interleaved and self.stages_per_rank > 1:
            raise ValueError(
                f"pipeline.stages_per_rank: {self.schedule} runs one stage per rank; "
                "set stages_per_rank = 1, or use schedule = 'interleaved_1f1b'"
            )
        if self.dp > 1 and self.dp_mode == "ddp":
            self.check_ddp_stages("pipeline.dp_mode", "use dp_mode = 'fsdp'")
        if self.split_points is not None and len(set(self.split_points)) != len(self.split_points):
            raise ValueError(f"pipeline.split_points: names repeat in {list(self.split_points)}")
        return self

    def check_ddp_stages(self, field: str, instead: str) -> None:
        """DDP-wrapped stages (replicas of each stage that average gradients by DDP) need the
        1f1b schedule. Measured with torch 2.14 on gloo: GPipe over DDP-wrapped stages trips
        the reducer's "rebuilt params size" assert on the second step, because every
        micro-batch's backward runs before DDP's bucket rebuild; 1F1B interleaves them and
        stays correct."""
        if self.schedule != "1f1b":
            raise ValueError(
                f"{field}: DDP-wrapped stages only work with the 1f1b schedule (with "
                f"{self.schedule} DDP's reducer fails); {instead}, or schedule = '1f1b'"
            )
