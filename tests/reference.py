"""Single-process reference training, and what "the same parameters" means: the yardstick every
strategy must match, argued from the rounding the CPU actually makes rather than tuned on one.

A strategy and the one-process reference compute the same thing in float32 in another order
(DDP's bucketed all-reduce, FSDP's reduce-scatter, each rank's and micro-batch's mean summed
per rank and then across ranks) and with other kernels (each CPU picks its own: AVX-512, AVX2,
plain C; oneDNN's convolutions by the ISA it finds). Neither is exact. So the test does not ask
how far apart the two float32 results are, a distance that depends on the CPU; it asks how far
each is from the same computation in float64 (53 bits: its own rounding is 2^-29 of float32's,
nothing next to it), and accepts the strategy's distance when it is at most EQUIVALENCE_K
times float32's rounding on this machine, plus a floor.

float32's rounding of a tensor: the float32 reference's distance to float64, or, if larger,
the rate at which the whole model departs from float64 times the tensor's size. A tensor of a
few elements (a bias of 16) can come out nearly exact by chance on one kernel path and not on
another (measured: the seed CNN's conv2.bias, 32 elements, came out 25 times nearer float64 on
this machine's native path than on oneDNN's SSE4.1 one); the model's rate is a steadier measure.

Whose float32. The rounding allowed is the one float32 makes on the kernel path the result was
computed on: workers on another path than this process (tests/test_kernel_paths.py) hand in
the float32 reference computed on one of them (``float32=``). Taken from another path, the
allowance measures the paths rather than the strategy: on an AMD EPYC whose native float32
rounds unusually close to float64, DDP and FSDP on every path with more rounding landed at the
same distance, just outside it, while a path with less rounding than the result's would hide
a strategy's error.

Why EQUIVALENCE_K = 8. A float32 sum of n terms in any order is within (n - 1) eps sum|x| of
the exact sum (eps = 2^-24, round to nearest), and in practice its error is a random walk of
about sqrt(n) eps-sized steps, whatever the order: two runs that make the same roundings of the
same values in other orders are two draws of the same size. Kernels differ in how they block
their sums (8 or 16 lanes, oneDNN's SSE4.1 direct convolution against its AVX-512 one), which
moves the size of the draw by a small factor, and a few steps of momentum carry it on: measured
across the nine kernel paths of an AVX-512 machine, a strategy strayed up to 3.6 times as far
as the float32 reference did. 8 leaves a factor 2 for CPUs not seen here. A floor of half an
ulp of each parameter per step bounds what rounding the parameters themselves adds (a tensor
that no sum touched).

Why this still catches bugs, and why the allowance is no wider than it says. A strategy's real
mistakes move parameters by a fraction of an update (lr times a gradient), orders of magnitude
above rounding. Each equivalence test proves it: the distributed result is held against
references with a bug planted in them (PLANTED_BUGS), as a strategy with that bug would be
held against the true one, and the check must fail on every one that applies.
tests/test_planted_bugs.py plants the same bug in DDP's and FSDP's worker code and finds the
reference with it planted. Those bugs land far outside the allowance (the suite's summary
prints the nearest per kernel path), so they prove a bug is caught, not that the allowance is
tight: an EQUIVALENCE_K ten times too large passed them all. So every check is also held
against a near miss (near_miss): the largest tensor moved NEAR_MISS_ROUNDINGS = 12 times its
float32 rounding, between the allowance at EQUIVALENCE_K (8) and at twice it. The check must
refuse it, and an allowance loosened to 16 roundings takes it, failing every equivalence test.
"""

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from workers.data import SampleOrder, as_features, open_store, rank_epoch_indices
from workers.losses import Criterion
from workers.models import build_model
from workers.optimizers import build_optimizer, build_schedule
from workers.spec.run import RunConfig

Parameters = Mapping[str, torch.Tensor]

# make test's kernel-matrix passes run the equivalence tests again on other kernel paths; the
# planted bugs, which move parameters by 1e3 to 1e6 times the tolerance on every path (measured
# on AVX-512, AVX2 and plain C), are held once, in the main pass.
_PLANTED_ELSEWHERE = os.environ.get("EQUIVALENCE_PLANTED_BUGS") == "main-pass-only"

EQUIVALENCE_K = 8.0
FLOOR_ULPS_PER_STEP = 0.5
# The near miss every check must refuse (near_miss): the largest tensor moved this many times
# its float32 rounding. Between EQUIVALENCE_K and twice it: an allowance loosened to twice its
# width takes it, and the check fails, in every equivalence test.
NEAR_MISS_ROUNDINGS = 12.0
NEAR_MISS = f"the largest tensor moved {NEAR_MISS_ROUNDINGS:g} x its float32 rounding"
_EPS32 = torch.finfo(torch.float32).eps

# A moderate step for few-step equivalence: differences in rounding stay differences in
# rounding (at lr 0.1 and more a max-pool's near-ties can break the other way in one run).
SGD_FEW_STEPS = {"lr": 0.02, "momentum": 0.9}

# The bugs each equivalence test must catch, planted into the reference (the same arithmetic
# as a strategy that made them), with when each applies.
GRADIENTS_SUMMED = "the ranks' gradients summed, not averaged"
MICRO_BATCH_DROPPED = "the last rank's last micro-batch of every step dropped"
STEP_SKIPPED = "the last step's update skipped"
STALE_SHARD = "half of the first parameter stale by one step after resharding"
PLANTED_BUGS = (GRADIENTS_SUMMED, MICRO_BATCH_DROPPED, STEP_SKIPPED, STALE_SHARD)


@dataclass(frozen=True)
class Reference:
    """One process's parameters after the same steps, in float32 and in float64."""

    float32: Parameters
    float64: Parameters
    steps: int

    @classmethod
    def of(cls, train: Callable[[torch.dtype], Parameters], *, steps: int) -> "Reference":
        """``train(dtype)``: the reference computation in that dtype, its parameters returned."""
        return cls(train(torch.float32), train(torch.float64), steps)


def equivalence_problems(
    got: Parameters, reference: Reference, *, target: Parameters | None = None
) -> list[str]:
    """Why ``got`` is not the reference's parameters: a missing or extra name, or a tensor
    farther from the float64 result (``target``: another float64 result, held to this
    reference's tolerance) than EQUIVALENCE_K times float32's rounding plus the floor.

    float32's rounding of a tensor is the float32 reference's own distance to float64, but
    at least the rate at which the model as a whole departs from float64 times the tensor's
    size: a small tensor (a bias of 16) can come out nearly exact by chance on one kernel
    path and not on another. Distances are L2 norms over each tensor, in float64."""
    problems, _ = _measure(got, reference, target, _roundings(reference))
    return problems


@dataclass(frozen=True)
class _Distance:
    """One tensor's distance from its target, and what float32's rounding allows it."""

    distance: float
    rounding: float
    floor: float

    @property
    def allowed(self) -> float:
        return EQUIVALENCE_K * self.rounding + self.floor

    @property
    def fraction(self) -> float:
        """The distance as a fraction of the allowance: over 1 fails."""
        return self.distance / self.allowed if self.allowed > 0 else float("inf")


def _measure(
    got: Parameters,
    reference: Reference,
    target: Parameters | None,
    roundings: Mapping[str, tuple[float, float]],
) -> tuple[list[str], dict[str, _Distance]]:
    """equivalence_problems' problems, and each tensor's distance and allowance (``roundings``:
    the reference's, _roundings)."""
    target = reference.float64 if target is None else target
    if got.keys() != target.keys():
        missing, extra = target.keys() - got.keys(), got.keys() - target.keys()
        return [f"names differ: missing {sorted(missing)}, extra {sorted(extra)}"], {}
    problems, distances = [], {}
    for name, (rounding, floor) in roundings.items():
        exact, value = _wide(target[name]), _wide(got[name])
        if value.shape != exact.shape:
            problems.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(exact.shape)}")
            continue
        measured = distances[name] = _Distance(_norm([value - exact]), rounding, floor)
        if not measured.distance <= measured.allowed:  # NaN fails too
            problems.append(
                f"{name}: {measured.distance:.3g} from float64, allowed {measured.allowed:.3g} "
                f"({EQUIVALENCE_K:g} x float32's rounding {rounding:.3g} + floor {floor:.3g})"
            )
    return problems, distances


def _roundings(reference: Reference) -> dict[str, tuple[float, float]]:
    """Each tensor's float32 rounding and floor, by name (see equivalence_problems). Tensor by
    tensor, float32's widened as each is needed: a model larger than a worker
    (tests/test_larger_than_a_worker.py) is compared too."""
    f64, f32 = reference.float64, reference.float32
    rate = _norm(_wide(f32[name]) - _wide(f64[name]) for name in f64) / _norm(f64.values())
    roundings = {}
    for name, exact in f64.items():
        size = _norm([exact])
        rounding = max(_norm([_wide(f32[name]) - _wide(exact)]), rate * size)
        floor = FLOOR_ULPS_PER_STEP * max(reference.steps, 1) * _EPS32 * size
        roundings[name] = (rounding, floor)
    return roundings


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64 on the CPU (itself when it is already)."""
    return tensor.detach().double().cpu()


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of all of ``tensors`` together, taken one at a time."""
    return float(torch.sqrt(sum(torch.sum(t.double() ** 2) for t in tensors)))


def near_miss(
    reference: Reference, roundings: Mapping[str, tuple[float, float]] | None = None
) -> dict[str, torch.Tensor]:
    """The float64 result with its largest tensor moved NEAR_MISS_ROUNDINGS times its float32
    rounding (plus the floor) in a fixed random direction: a result just outside the allowance
    that every check must refuse, and one that an allowance twice as wide would take.

    The direction is random so that it is all but orthogonal to the result's own rounding
    error (the first 2^16 elements of the tensor: a random direction in that many dimensions
    meets a given one at a cosine of about 1/256), whatever the kernels: the result's
    distance to the near miss is then sqrt(d^2 + e^2) for a move d and an own error e at most
    the allowance, which lies between the allowance at EQUIVALENCE_K and at twice it
    (measured margins: the summary at the end of the suite)."""
    name = max(reference.float64, key=lambda key: reference.float64[key].numel())
    rounding, floor = (roundings or _roundings(reference))[name]
    moved = _wide(reference.float64[name]).clone()
    flat = moved.view(-1)
    n = min(flat.numel(), 1 << 16)
    direction = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat[:n] += direction * ((NEAR_MISS_ROUNDINGS * rounding + floor) / direction.norm())
    return {**reference.float64, name: moved}


@dataclass(frozen=True)
class Margin:
    """How an equivalence check came out, each as a fraction of the allowance: the result's
    worst tensor (at most 1), the near miss (just over 1), and the nearest planted bug that
    applied (over 1: how far outside the allowance it landed; inf where none applied)."""

    test: str
    worst: float
    worst_tensor: str
    near_miss: float
    nearest_bug: str
    nearest_bug_fraction: float


# Every assert_equivalent of this process, for the suite's summary (tests/conftest.py).
MARGINS: list[Margin] = []


def _worst(distances: Mapping[str, _Distance]) -> tuple[str, float]:
    name = max(distances, key=lambda key: distances[key].fraction)
    return name, distances[name].fraction


def assert_equivalent(
    got: Parameters, reference: Reference, *, planted: Mapping[str, Parameters] | None = None
) -> None:
    """``got`` is the reference's parameters within float32's rounding (equivalence_problems);
    and against each of ``planted`` (a bug's name: the float64 parameters with that bug), and
    against the near miss (near_miss: a move just outside the allowance), the same check
    fails, so that the tolerance is proved tight enough for the bugs that matter and no wider
    than EQUIVALENCE_K roundings. The margins are kept in MARGINS."""
    roundings = _roundings(reference)
    problems, distances = _measure(got, reference, None, roundings)
    assert not problems, "not the one-process parameters:\n" + "\n".join(problems)
    fractions = {}
    for bug, buggy in {NEAR_MISS: near_miss(reference, roundings), **(planted or {})}.items():
        bug_problems, bug_distances = _measure(got, reference, buggy, roundings)
        assert bug_problems, f"the check cannot tell the result from one with a planted bug: {bug}"
        fractions[bug] = _worst(bug_distances)[1] if bug_distances else float("inf")
    near = fractions.pop(NEAR_MISS)
    nearest = min(fractions.items(), key=lambda item: item[1], default=("none", float("inf")))
    worst_tensor, worst = _worst(distances)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    MARGINS.append(Margin(test, worst, worst_tensor, near, *nearest))


def assert_same_parameters(got: Parameters, expected: Parameters) -> None:
    """``got`` equals ``expected`` to the last bit, name by name: two runs of the same code on
    the same ranks and kernels, which sum in the same order."""
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, rtol=0, atol=0, msg=lambda d, name=name: f"{name}: {d}"
        )


def train_in_one_process(
    config: RunConfig,
    *,
    world_size: int,
    steps: int,
    device: str = "cpu",
    factory: Callable[..., nn.Module] | None = None,
    then: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    bug: str | None = None,
) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps (the config's optimizer and schedule, as the ranks build
    them) on the full global batches that ``world_size`` ranks would see, on ``device`` in
    ``dtype``; the parameters come back on the CPU. ``then=(world_size, steps)``:
    that many more steps on what another world size's ranks read from the same place in the
    epoch, as a run resumed at that size from a checkpoint continues. ``bug``: one of
    PLANTED_BUGS, made on purpose.

    Each step takes the ranks' batches at that step, and each micro-batch of them (a
    pipeline's, or gradient accumulation's), through the model one by one, and averages their
    mean losses: what DDP optimizes, in the shapes the ranks compute. The model and the loss
    are the config's (``factory``: a model given in Python, as to ``train``); in float64, the
    same initial parameters (float32's, widened exactly).
    """
    assert bug is None or bug in PLANTED_BUGS, bug
    # Tests of several strategies on one config ask for the same reference: computed once.
    key = (config.model_dump_json(), world_size, steps, device, factory, then, dtype, bug)
    if key not in _COMPUTED:
        _COMPUTED[key] = _train(config, world_size, steps, device, factory, then, dtype, bug)
    return {name: value.clone() for name, value in _COMPUTED[key].items()}


_COMPUTED: dict[tuple, dict[str, torch.Tensor]] = {}


def forget_computed() -> None:
    """Drop the references computed so far (each a copy of its model: a benchmark of a large
    model wants the memory back)."""
    _COMPUTED.clear()


def _train(config, world_size, steps, device, factory, then, dtype, bug) -> dict:
    t, d = config.training, config.data.resolved()
    pipelined = t.strategy == "pipeline"  # what each rank's share is cut into
    micro_batches = config.pipeline.n_microbatches if pipelined else t.grad_accum_steps
    store = open_store(d.store_url)
    images = torch.from_numpy(as_features(store.train.images[:], tokens=store.train.tokens))
    images = images.to(device, dtype) if images.is_floating_point() else images.to(device)
    labels = torch.from_numpy(store.train.labels).to(device)
    criterion = Criterion.of(t)
    model = build_model(
        config.model,
        num_classes=criterion.outputs(store.num_classes),
        seed=t.seed,
        input_shape=tuple(images.shape[1:]),
        factory=factory,
    ).to(device, dtype)
    # The worker's own builder (workers/optimizers.py): the same optimizer, groups and rates.
    optimizer = build_optimizer(config=t, parameters=model.parameters())
    total = steps + (then[1] if then else 0)
    before_last_step: dict[str, torch.Tensor] = {}
    done, epoch, batch = 0, 0, 0  # batch: the next one of that epoch
    for phase, (ranks, phase_steps) in enumerate([(world_size, steps), *([then] if then else [])]):
        if phase and bug == STALE_SHARD:
            name, first = next(iter(model.named_parameters()))
            half = first.numel() // 2
            with torch.no_grad():
                first.view(-1)[:half] = before_last_step[name].view(-1)[:half]
        per_rank, goal = t.batch_size // ranks, done + phase_steps
        schedule = None  # each phase's ranks build their own, as a resumed run does
        while done < goal:
            shards = [
                rank_epoch_indices(
                    SampleOrder(
                        len(labels),
                        seed=t.seed,
                        chunk_size=store.train.chunk_size,
                        shuffle_window=d.shuffle_window,
                        drop_last=d.drop_last,
                    ),
                    epoch=epoch,
                    rank=rank,
                    world_size=ranks,
                )
                for rank in range(ranks)
            ]
            n = len(shards[0])
            batches = n // per_rank if d.drop_last else -(-n // per_rank)
            if schedule is None:
                # As each rank builds it at the start of a phase (workers/train.py build):
                # over the run's steps at these ranks' batches per epoch, from the step reached.
                run_steps = t.epochs * batches
                run_steps = run_steps if t.max_steps is None else min(run_steps, t.max_steps)
                schedule = build_schedule(
                    optimizer=optimizer, config=t, total_steps=run_steps, step=done
                )
            while batch < batches and done < goal:
                start = batch * per_rank
                optimizer.zero_grad()
                # Each rank's share, and each micro-batch of it, through the model on its own as
                # the rank computes it: the same mean, and the same tensor shapes, so that the
                # kernels (whose choice and rounding follow the shapes) are the ranks'.
                pieces = [
                    piece
                    for share in shards
                    for piece in torch.from_numpy(share[start : start + per_rank]).chunk(
                        micro_batches
                    )
                ]
                # Each piece's mean loss weighs 1/len(pieces): the ranks' gradients averaged.
                weight = len(pieces) // ranks if bug == GRADIENTS_SUMMED else len(pieces)
                for piece in pieces[:-1] if bug == MICRO_BATCH_DROPPED else pieces:
                    piece = piece.to(device)
                    (criterion(model(images[piece]), labels[piece]) / weight).backward()
                if t.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                if bug == STALE_SHARD:  # only then: a copy of the model, on a large one
                    before_last_step = {k: v.detach().clone() for k, v in model.named_parameters()}
                if not (bug == STEP_SKIPPED and done + 1 == total):
                    optimizer.step()
                schedule.step()
                done, batch = done + 1, batch + 1
            if batch == batches:
                epoch, batch = epoch + 1, 0
    # The model's own tensors (no copy on a CPU), its gradients dropped now rather than when
    # the model is collected.
    optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def bugs_that_apply(
    config: RunConfig, *, world_size: int, then: tuple[int, int] | None = None
) -> tuple[str, ...]:
    """The planted bugs that change a reference of these ranks: summing equals averaging on
    one rank, and under clipping by the norm (which rescales the sum to the same norm); only
    a run resumed at another size reshards."""
    ranks = max(world_size, then[0] if then else 1)
    summing_matters = ranks > 1 and config.training.max_grad_norm is None
    return tuple(
        bug
        for bug in PLANTED_BUGS
        if (bug != GRADIENTS_SUMMED or summing_matters) and (bug != STALE_SHARD or then)
    )


def assert_matches_one_process(
    got: Parameters,
    config: RunConfig,
    *,
    world_size: int,
    steps: int,
    factory: Callable[..., nn.Module] | None = None,
    then: tuple[int, int] | None = None,
    bugs: Iterable[str] | None = None,
    device: str = "cpu",
    float32: Parameters | None = None,
) -> None:
    """``got`` holds the parameters train_in_one_process leaves on these ranks' batches, and
    the check fails on each of ``bugs`` (the ones that apply by default; ``()``: none).

    ``float32``: the float32 reference computed on the kernel path ``got`` was (a worker of
    that path: tests/test_kernel_paths.py), whose rounding is the one to allow; by default
    this process's own, on the path its workers share. The float64 reference is one on every
    path (oneDNN has no float64 kernels, and ATen's round 2^-29 as finely as float32's)."""

    def run(dtype: torch.dtype, bug: str | None = None) -> dict[str, torch.Tensor]:
        return train_in_one_process(
            config,
            world_size=world_size,
            steps=steps,
            device=device,
            factory=factory,
            then=then,
            dtype=dtype,
            bug=bug,
        )

    total = steps + (then[1] if then else 0)
    if float32 is None:
        reference = Reference.of(run, steps=total)
    else:
        reference = Reference(float32, run(torch.float64), total)
    if bugs is None:
        bugs = (
            () if _PLANTED_ELSEWHERE else bugs_that_apply(config, world_size=world_size, then=then)
        )
    assert_equivalent(got, reference, planted={bug: run(torch.float64, bug) for bug in bugs})
