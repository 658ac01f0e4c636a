"""Several base models on one mesh: this rank's :class:`~ringtune.worker.executor.RankExecutor` per served model.

``ringtune serve --model teacher=A --model student=B`` loads every model on the same DP×CP mesh (one world, one
command channel, one supervisor): each model has its own executor on every rank (its runs, its frozen LoRA base,
its sampler pool and decode jobs), and :class:`ServedModels` sends each command to the executor of the model it
addresses. CP and DP mean what they mean with one model (every command still runs on every rank of the mesh, one
at a time), and a heal restores the runs of every model (the supervisor replays their ``create_run`` commands,
which name their base model).

Which model a command addresses (every rank keeps the same tables: commands are replicated and applied in order):

- ``create_run``: its ``base_model`` argument (rank 0 resolved aliases to the model's name before publishing);
- the other run commands: the model the run was created on (an unknown run goes to the first model, whose
  executor answers "not live" as with one model);
- ``forward_backward_many``: each run's model (the runs of one model share one pass; models run one after the
  other in the order of their first run);
- ``create_sampler``: the source's ``model`` (the gateway names it), else the model of its ``run_id``, else the
  first model; ``sample`` / ``free_sampler``: the session's model; ``sample_more``: the model holding the job;
- ``probe``, ``ping``, ``shutdown``: the first model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ringtune.engine.trainer import Trainer
from ringtune.errors import UserInputError
from ringtune.models.decoder import CausalLM
from ringtune.parallel.control import agreed_call
from ringtune.parallel.mesh import ParallelMesh
from ringtune.worker.commands import Command
from ringtune.worker.executor import ModelSpec, RankExecutor


class ServedModels:
    """This rank's executors, one per served model (``specs`` in ``--model`` order, the first the default), all
    over ``mesh`` (None: one process); ``spares`` maps a model's name to a copy rank 0 already loaded (its
    first run takes it).

    Attributes:
        executors: model name -> its :class:`RankExecutor`.
        default: the first model's name (commands that address no model go to it).
    """

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        mesh: ParallelMesh | None,
        *,
        spares: Mapping[str, CausalLM] | None = None,
    ) -> None:
        names = [s.served_name for s in specs]
        if not names or len(set(names)) != len(names):
            raise UserInputError(f"served model names {names} must be one or more distinct names")
        self.mesh = mesh
        self.executors = {
            s.served_name: RankExecutor(s, mesh, spare=(spares or {}).get(s.served_name), mesh_trainers=self._runs)
            for s in specs
        }
        self.default = names[0]
        self._run_models: dict[str, str] = {}
        self._sampler_models: dict[str, str] = {}

    def _runs(self) -> Iterator[Trainer]:
        """Every live run's trainer, of every model (a group repair marks the FSDP-sharded ones broken)."""
        for executor in self.executors.values():
            yield from executor.trainers.values()

    @property
    def trainers(self) -> dict[str, Trainer]:
        """Every model's live runs (run id -> Trainer), a new dict (read only)."""
        return {run_id: t for e in self.executors.values() for run_id, t in e.trainers.items()}

    @property
    def broken(self) -> str | None:
        """Why a run's trainer can no longer serve (a rank died), or None."""
        return next((e.broken for e in self.executors.values() if e.broken), None)

    def model_of_run(self, run_id: str) -> str | None:
        """The model run ``run_id`` was created on, None for an unknown run."""
        return self._run_models.get(run_id)

    def clear(self) -> None:
        """Drop every model's runs and sampler snapshots (the world is torn down or closed)."""
        for executor in self.executors.values():
            executor.trainers.clear()
            executor.samplers.snapshots.clear()
        self._run_models.clear()
        self._sampler_models.clear()

    def execute(self, command: Command) -> Any:
        """Run ``command`` on its model's executor (module docstring) and agree with the other ranks; its result
        (meaningful on the result rank). Raises the agreed error on every rank, as :meth:`RankExecutor.execute`."""
        return agreed_call(lambda: self._execute(command), self.mesh.control_group if self.mesh else None)

    def _execute(self, command: Command) -> Any:
        if command.op == "forward_backward_many":
            return self._forward_backward_many(command)
        name = self._addressed(command)
        result = self.executors[name].handlers[command.op](command)
        self._note(command, name)
        return result

    def _addressed(self, command: Command) -> str:
        """The name of the model ``command`` addresses (module docstring)."""
        op, args = command.op, command.args
        if op == "create_run":
            base = args["base_model"]
            if base not in self.executors:
                raise UserInputError(f"base_model={base!r} is not served here; choose one of {list(self.executors)}")
            return base
        if op == "create_sampler":
            source = args["source"]
            named = getattr(source, "model", None) or self._run_models.get(source.run_id or "")
            if named is not None and named not in self.executors:
                raise UserInputError(f"base_model={named!r} is not served here; choose one of {list(self.executors)}")
            return named or self.default
        if op in ("sample", "free_sampler"):
            return self._sampler_models.get(args["sampler_id"], self.default)
        if op == "sample_more":
            job_id = args["job_id"]
            return next((n for n, e in self.executors.items() if job_id in e.decode_jobs.jobs), self.default)
        return self._run_models.get(command.run_id or "", self.default)

    def _note(self, command: Command, name: str) -> None:
        """Keep the routing tables after ``command`` succeeded on model ``name``."""
        if command.op == "create_run":
            self._run_models[command.run_id or ""] = name
        elif command.op == "free_run":
            self._run_models.pop(command.run_id or "", None)
        elif command.op == "create_sampler":
            self._sampler_models[command.args["sampler_id"]] = name
        elif command.op == "free_sampler":
            self._sampler_models.pop(command.args["sampler_id"], None)

    def _forward_backward_many(self, command: Command) -> list[Any]:
        """One pass per model over its runs' requests (their order kept in the answer): per run ``(outputs,
        metrics)`` or the message of its UserInputError, as :meth:`RankExecutor._forward_backward_many`."""
        run_ids: list[str] = list(command.args["run_ids"])
        by_model: dict[str, list[int]] = {}
        for i, run_id in enumerate(run_ids):
            by_model.setdefault(self._run_models.get(run_id, self.default), []).append(i)
        answers: list[Any] = [None] * len(run_ids)
        for name, indices in by_model.items():
            args = {
                **command.args,
                "run_ids": [run_ids[i] for i in indices],
                "data": [command.args["data"][i] for i in indices],
            }
            part = self.executors[name].handlers["forward_backward_many"](Command(command.op, command.run_id, args))
            for i, answer in zip(indices, part, strict=True):
                answers[i] = answer
        return answers
