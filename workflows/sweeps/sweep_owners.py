"""Which sweep client runs which trial of a shared Optuna study.

A sweep resumed after its client died must re-run the trials that client left RUNNING, with
the parameters they hold, and nothing else; two live sweeps sharing a study must never run
the same trial. Optuna's own heartbeat (RDB storages only) fails such trials, and retrying
them makes new trials: the study would end with more trials than asked for. So every trial a
sweep runs carries an owner mark in its system attributes::

    {"client": <Dask client id>, "scheduler": <scheduler id>, "beat": <time>, "token": <hex>}

A RUNNING trial is abandoned, and another sweep may take it over, when its mark says so
(``released``: the sweep was interrupted), when its client is no longer connected to the
scheduler we share with it (Dask drops a client whose connection closes: a SIGKILL shows
at once), or, for a client of another scheduler (or a trial without a mark), when no beat came
for ``STALE_AFTER_S``. Storages offer no compare-and-swap on attributes, so a taker writes its
own mark, waits ``CLAIM_SETTLE_S`` for a rival's mark to land, and goes on only if the mark
read back is still its own: of two takers, the later writer wins, and the other backs off.
"""

import contextlib
import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from distributed import Client

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

logger = logging.getLogger(__name__)

OWNER_ATTR = "dask_train_owner"
BEAT_S = 10.0  # how often a sweep renews the marks of the trials it runs
STALE_AFTER_S = 60.0  # a mark not renewed this long belongs to a client that is gone
CLAIM_SETTLE_S = 1.0  # the wait before a taker reads its claim back


def _connected_clients(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.clients)


class TrialOwners:
    """This sweep's marks: written when it starts or takes over a trial, renewed every
    ``BEAT_S`` by a thread of its own, released when the sweep ends with trials unfinished."""

    def __init__(
        self, study: "Study", client: Client, on_lost: Callable[[int], None] | None = None
    ) -> None:
        """``on_lost(trial_id)``: another sweep took over a trial of ours (our beats stopped
        reaching the storage for ``STALE_AFTER_S``), whose job should stop now."""
        from workflows.compat.optuna_private import study_storage

        self.study, self.client, self.on_lost = study, client, on_lost
        self._storage = study_storage(study)
        self._scheduler_id = client.scheduler_info().get("id", "")
        self._held: dict[int, dict[str, Any]] = {}  # trial id -> its mark
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="dask-train-sweep-beat", daemon=True)

    @contextlib.contextmanager
    def beating(self) -> Iterator["TrialOwners"]:
        self._beats.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._beats.join(timeout=BEAT_S + 30)
            self.release_all()

    def hold(self, trial_id: int) -> None:
        """Mark a trial this sweep just started as its own."""
        mark = self._mark()
        with self._lock:
            self._held[trial_id] = mark
        self._storage.set_trial_system_attr(trial_id, OWNER_ATTR, mark)

    def done(self, trial_id: int) -> None:
        with self._lock:
            self._held.pop(trial_id, None)

    def release_all(self) -> None:
        """Let any sweep take over the trials this one leaves unfinished (it was interrupted):
        a sweep started again in this same process, whose client is still connected, too."""
        with self._lock:
            held, self._held = self._held, {}
        for trial_id, mark in held.items():
            with contextlib.suppress(Exception):  # finished meanwhile, or the storage is gone
                if self._still_mine(trial_id, mark):
                    self._storage.set_trial_system_attr(trial_id, OWNER_ATTR, {"released": True})

    def abandoned(self, trials: list["FrozenTrial"]) -> list["FrozenTrial"]:
        """The RUNNING trials whose owner is gone, oldest first."""
        from optuna.trial import TrialState

        from workflows.compat.optuna_private import trial_id

        with self._lock:
            mine = set(self._held)
        others = [t for t in trials if t.state == TrialState.RUNNING and trial_id(t) not in mine]
        if not others:
            return []
        connected = self._connected()
        return [t for t in others if self._is_abandoned(t, connected)]

    def _connected(self) -> set[str] | None:
        """The clients connected to our scheduler; None where it runs no code of ours
        (``distributed.scheduler.pickle`` off): then only beats tell."""
        try:
            return set(self.client.run_on_scheduler(_connected_clients))
        except Exception as error:
            logger.debug("no client list from the scheduler: %s", error)
            return None

    def _is_abandoned(self, trial: "FrozenTrial", connected: set[str] | None) -> bool:
        mark = trial.system_attrs.get(OWNER_ATTR)
        now = time.time()
        if not isinstance(mark, dict):
            # Started by plain Optuna, or by a sweep killed between creating the trial and
            # marking it: abandoned once it is old enough.
            started = trial.datetime_start or datetime.datetime.now()
            return (datetime.datetime.now() - started).total_seconds() > STALE_AFTER_S
        if mark.get("released"):
            return True
        if connected is not None and mark.get("scheduler") == self._scheduler_id:
            return mark.get("client") not in connected
        return now - float(mark.get("beat", 0)) > STALE_AFTER_S

    def claim(self, trial: "FrozenTrial") -> bool:
        """Take over an abandoned trial; False when a rival sweep took it."""
        from workflows.compat.optuna_private import trial_id

        mark = self._mark()
        self._storage.set_trial_system_attr(trial_id(trial), OWNER_ATTR, mark)
        time.sleep(CLAIM_SETTLE_S)
        if not self._still_mine(trial_id(trial), mark):
            logger.info("trial %d was taken over by another sweep", trial.number)
            return False
        with self._lock:
            self._held[trial_id(trial)] = mark
        return True

    def _mark(self) -> dict[str, Any]:
        return {
            "client": self.client.id,
            "scheduler": self._scheduler_id,
            "beat": time.time(),
            "token": uuid.uuid4().hex,
        }

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            with self._lock:
                held = {trial_id: dict(mark) for trial_id, mark in self._held.items()}
            for trial_id, mark in held.items():
                try:
                    self._renew(trial_id, mark)
                except Exception as error:  # finished meanwhile: nothing to renew
                    logger.debug("no beat for trial %d: %s", trial_id, error)

    def _renew(self, trial_id: int, mark: dict[str, Any]) -> None:
        if not self._still_mine(trial_id, mark):
            # Taken over after our beats stopped reaching the storage: the mark is the taker's
            # now, and overwriting it would make two sweeps run the trial.
            logger.warning("trial id %d was taken over by another sweep", trial_id)
            self.done(trial_id)
            if self.on_lost is not None:
                self.on_lost(trial_id)
            return
        self._storage.set_trial_system_attr(trial_id, OWNER_ATTR, mark | {"beat": time.time()})

    def _still_mine(self, trial_id: int, mark: dict[str, Any]) -> bool:
        held = self._storage.get_trial(trial_id).system_attrs.get(OWNER_ATTR)
        return isinstance(held, dict) and held.get("token") == mark["token"]
