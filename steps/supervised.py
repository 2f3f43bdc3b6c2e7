"""The supervised loop shared by step 1 (SFT), step 2 (reward model) and step 3 by DPO:
epochs of shuffled batches, a loss per batch, an optimizer step per accumulation window
(and an EMA of the weights, where the task keeps one), metrics, checkpoints, then
evaluation and export. A step passes what differs as a `Task`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from engine.checkpoint import Tensors
from engine.data_parallel import DataParallel
from engine.errors import NonFiniteError
from engine.placement import Placement
from engine.tracking import Tracker
from engine.trainer import TrainEngine
from steps.common import (
    StepCheckpoints,
    check_export_fits,
    epoch_batches,
    log,
    num_batches,
    start_step,
    to_device,
)
from steps.config import TrainConfig
from steps.rlhf import ema_update

# (engine, this process's collated rows, the examples its mean is over: the accumulation
# window's) -> (the loss, and statistics to log), each these rows' share: sums over the
# window's batches and the processes give the window's value; the batch holds "weight" too,
# its share's (0 for a stand-in)
LossFn = Callable[[TrainEngine, dict[str, torch.Tensor], list],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]

# the closing line's eval results of a step with no held-out examples: not "nan", which a
# finite run never shows (a model evaluating to NaN is refused, _refuse_non_finite)
NOT_EVALUATED = "not evaluated (no held-out examples: data.eval_fraction)"


class Task(NamedTuple):
    step: int                    # 1, 2 or 3 (DPO)
    name: str                    # what it trains, for the closing line: "SFT", "reward model"
    role: str                    # what the trained model is called: "actor" or "reward"
    family: str                  # its placement family (engine/placement.py): "policy", "scorer"
    section: TrainConfig         # cfg.sft, cfg.rm or cfg.dpo, as its schema object
    examples: list               # tokenized training examples
    collate: Callable[[list], dict[str, torch.Tensor]]
    loss: LossFn
    tokens: Callable[[list], int]                         # tokens in a batch of examples
    evaluate: Callable[[TrainEngine], dict[str, float]]   # held-out metrics (eval mode)
    results: Callable[[dict], str]       # the closing line's eval results, from the summary
    tokenizer: object
    export_dir: Path
    # fields the exported config.json gains, from the summary (step 2: its score statistics)
    export_config: Callable[[dict], dict] = lambda summary: {}
    # the engine placed, before training: the examples to train on (DPO's, given the
    # reference's log-probs); called on resume too, so it must be deterministic
    prepare: Callable[[TrainEngine], list] | None = None
    generates: bool = False      # the model generates in `evaluate` (a HybridEngine)
    # also evaluated before the first update: the summary gains its metrics as <name>_before
    evaluate_first: bool = False
    # export=best: an evaluation's standing (higher is better), None where its policy may
    # not be exported (e.g. past a KL budget); the step exports the best evaluated policy
    standing: Callable[[dict], tuple | None] | None = None
    # an EMA of the weights over the updates, this the old average's share at each (dpo.ema),
    # checkpointed and exported beside the model as <role>_ema; None: none
    ema_beta: float | None = None


class BestKept:
    """The evaluated weights whose metrics rank highest by `standing` (Task.standing), kept
    to export instead of the last ones; `record` (checkpointed with the position) says
    which: its place in the standing, its update and its metrics."""

    def __init__(self, engine: TrainEngine, standing: Callable[[dict], tuple | None]):
        # the start's weights (trainable ones alone: a frozen base never moves)
        self.weights = engine.copy_weights(trainable_only=True)
        self.standing, self.record = standing, None

    def consider(self, engine: TrainEngine, metrics: dict) -> None:
        place = self.standing(metrics) if metrics else None
        if place is not None and (self.record is None or list(place) > self.record["place"]):
            self.weights.load_state_dict(engine.copy_weights(trainable_only=True).tensors)
            self.record = {"place": list(place), "step": engine.steps, "metrics": metrics}

    def exported(self) -> dict[str, float]:
        """The summary's fields of the exported policy: its metrics as <name>_exported."""
        if self.record is None:
            return {}
        return {**{f"{name}_exported": value for name, value in self.record["metrics"].items()},
                "eval/step_exported": self.record["step"]}


def run(cfg: DictConfig, task: Task, model: torch.nn.Module, dp: DataParallel,
        place: Placement, resume: bool) -> dict:
    """Train `model` (loaded with the section's LoRA adapters) on the task's examples, evaluate it
    and export it; returns the summary metrics (also logged)."""
    out = start_step(cfg, task.step, dp, resume=resume)
    section = task.section
    steps_per_epoch = num_batches(len(task.examples), section.batch_size)
    engine = place.trainer(model, section, num_batches(section.epochs * steps_per_epoch,
                                                       section.grad_accum),
                           family=task.family, name=task.role, lr=section.lr,
                           lora_lr=section.lora.learning_rate, grad_accum=section.grad_accum,
                           generates=task.generates)
    bigger = f"train on a machine with more memory (step {task.step} writes whole models)"
    host, disk = engine.merged_size()
    check_export_fits(host, disk * (2 if task.ema_beta is not None else 1), out,
                      f"step {task.step}'s export", bigger, "write it elsewhere (--output-dir)")
    kept = BestKept(engine, task.standing) if task.standing else None
    # the start's weights (trainable ones alone, as BestKept's), then averaged in per update
    ema = engine.copy_weights(trainable_only=True) if task.ema_beta is not None else None
    extra = {**({"best": kept.weights} if kept else {}), **({"ema": ema} if ema else {})}
    ckpt = StepCheckpoints(cfg, task.step, dp.runtime, {task.role: engine},
                           extra=extra or None)
    position, metrics_rows = ckpt.restore(
        {"epoch": 0, "batch": 0, "tokens": 0, "seconds": 0.0, "loss": float("nan")}, resume)
    if kept is not None:
        kept.record = position.get("best")
    if task.prepare is not None:
        task = task._replace(examples=task.prepare(engine))
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=task.step),
                      enabled=dp.reports, keep_rows=metrics_rows,
                      tensorboard=cfg.logging.tensorboard)
    before = position.get("before", {})   # (a checkpoint keeps the start's evaluation)
    if task.evaluate_first and "before" not in position:
        engine.eval()
        start_metrics = task.evaluate(engine)
        engine.train()
        tracker.log(start_metrics, 0)
        before = {f"{name}_before": value for name, value in start_metrics.items()}
        if kept is not None:
            kept.consider(engine, start_metrics)
    position = {**_train(cfg, task, engine, dp, ckpt, tracker, {**position, "before": before},
                         kept, ema), "before": before}

    metrics, averaged = _final_evaluation(task, engine, kept, ema)
    elapsed = position["seconds"]
    summary = {**before, **metrics, **averaged, **(kept.exported() if kept else {}),
               "train/loss": position["loss"], "time/seconds": elapsed,
               "time/tokens_per_s": position["tokens"] / elapsed}
    _refuse_non_finite(task, metrics, tracker, engine.steps, ckpt.checkpointer.latest())
    # the model first: a run killed before the summary row has not finished, on the page
    counted = tracker.read_sources()   # (engine.log_comm: the evaluation's, not the export's)
    _export(task, engine, kept, ema, summary)
    tracker.log(summary, engine.steps, sources=counted)
    tracker.close()
    ckpt.clear()
    log(f"step {task.step} ({task.name}) done: {engine.steps} steps, final loss "
        f"{position['loss']:.4f}, {task.results(summary)}, {elapsed:.1f}s -> {task.export_dir}")
    return summary


def _final_evaluation(task: Task, engine: TrainEngine, kept: BestKept | None,
                      ema: Tensors | None) -> tuple[dict[str, float], dict[str, float]]:
    """The trained model's held-out metrics (`kept` considers them), and the EMA's own, as
    <name>_ema (none without one)."""
    engine.eval()
    metrics = task.evaluate(engine)
    if kept is not None:
        kept.consider(engine, metrics)
    if ema is None:
        return metrics, {}
    with engine.weights_in(ema):
        return metrics, {f"{name}_ema": value for name, value in task.evaluate(engine).items()}


def _export(task: Task, engine: TrainEngine, kept: BestKept | None, ema: Tensors | None,
            summary: dict[str, float]) -> None:
    """The model (export=best: the kept weights, once an evaluation was kept) to
    task.export_dir, and its EMA beside it as <role>_ema."""
    engine.export(task.tokenizer, task.export_dir, config=task.export_config(summary),
                  weights=kept.weights if kept is not None and kept.record else None)
    if ema is not None:
        engine.export(task.tokenizer, task.export_dir.parent / f"{task.role}_ema",
                      config=task.export_config(summary), weights=ema)


def _refuse_non_finite(task: Task, metrics: dict[str, float], tracker: Tracker,
                       steps: int, checkpoint: Path | None) -> None:
    """Stop before the export when the trained model's evaluation is not finite: its weights
    are finite (each update checked them) but overflow on held-out data, e.g. after an
    update at a learning rate far too high; the evaluation is logged first. Where the step
    left a `checkpoint`, running it again would resume from it, with the learning rate it
    saved (the schedule's): a checkpoint of the last update would be refused again at once,
    so the fix says to start afresh."""
    broken = {name: value for name, value in metrics.items() if not math.isfinite(value)}
    if broken:
        tracker.log(metrics, steps)
        tracker.close()
        said = ", ".join(f"{name} {value}" for name, value in broken.items())
        afresh = (f" with resume=false (a resume would go on from {checkpoint.name}, at the "
                  "rate it saved)" if checkpoint else "")
        raise NonFiniteError(f"step {task.step} ({task.name}): the trained model evaluates to "
                             f"{said} on held-out data, so it is not exported; lower the "
                             f"learning rate (or check the data), then run the step again{afresh}")


def _evaluate_during(task: Task, engine: TrainEngine, tracker: Tracker,
                     kept: BestKept | None) -> None:
    """An evaluation between updates (sft/rm.eval_every), logged and said, and `kept` if it
    ranks best; training goes on in train mode. It draws no random numbers, so the run
    trains as it would without it."""
    engine.eval()
    metrics = task.evaluate(engine)
    if kept is not None:
        kept.consider(engine, metrics)
    engine.train()
    if metrics:
        tracker.log(metrics, engine.steps)
        log(f"step {task.step} ({task.name}) after {engine.steps} updates: "
            f"{task.results(metrics)}")


def _windows(cfg: DictConfig, task: Task, position: dict, dp: DataParallel
             ) -> Iterator[tuple[int, int, list[list]]]:
    """The accumulation windows from `position` on: (epoch, number of its last batch in
    that epoch, its batches of examples). A window may span two epochs; the last one holds
    what is left (fewer than grad_accum batches)."""
    section, window = task.section, []
    for epoch in range(position["epoch"], section.epochs):
        for index, examples in epoch_batches(
                task.examples, section.batch_size, seed=cfg.seed + epoch,
                skip=position["batch"] if epoch == position["epoch"] else 0,
                desc=f"step {task.step} epoch {epoch + 1}/{section.epochs}",
                enabled=cfg.logging.progress and dp.reports):
            window.append(examples)
            if len(window) == section.grad_accum:
                yield epoch, index, window
                window = []
    if window:
        yield epoch, index, window


def _train(cfg: DictConfig, task: Task, engine: TrainEngine, dp: DataParallel,
           ckpt: StepCheckpoints, tracker: Tracker, position: dict,
           kept: BestKept | None = None, ema: Tensors | None = None) -> dict:
    """The accumulation windows from `position` on, an optimizer step each (and an update
    of `ema`, at task.ema_beta); returns the final position. Each batch's loss is its share
    of the window's mean (over all of the window's answer tokens or pairs), so k batches of
    b train what one batch of k*b does, whatever their lengths; logged statistics are the
    window's."""
    section = task.section
    steps_per_epoch = num_batches(len(task.examples), section.batch_size)
    start = time.perf_counter() - position["seconds"]
    tokens, loss = position["tokens"], position["loss"]
    for epoch, index, window in _windows(cfg, task, position, dp):
        everything = [example for examples in window for example in examples]
        sums: dict[str, float] = {}   # this process's, over the window's batches
        for number, examples in enumerate(window, start=1):
            share = dp.share(examples)
            # the share's weight rides along, for a loss that sums over processes (KTO's z0)
            batch = to_device(task.collate(share.rows), dp.device) | {
                "weight": torch.tensor(share.weight)}
            batch_loss, stats = task.loss(engine, batch, everything)
            # x grad_accum: the engine divides by it, and the loss is the window's already
            engine.backward(batch_loss * share.weight * section.grad_accum,
                            ends_window=number == len(window))
            tokens += task.tokens(examples)
            for name, value in {"train/loss": batch_loss, **stats}.items():
                sums[name] = sums.get(name, 0.0) + float(value.detach()) * share.weight
        try:
            grad_norm = engine.step()
        except NonFiniteError as err:
            raise NonFiniteError(f"step {task.step} epoch {epoch + 1} batch {index}: "
                                 f"{err}") from None
        if ema is not None:
            ema_update(ema.tensors.values(), engine.trained_parameters(), task.ema_beta)
        means = dict(zip(sums, dp.sum(*sums.values()), strict=True))
        loss = means["train/loss"]
        if engine.steps % section.log_every == 0:
            scale = engine.loss_scale
            tracker.log({**means, "train/lr": engine.applied_lr, "train/grad_norm": grad_norm,
                         "train/skipped_steps": engine.skipped_steps, "epoch": epoch,
                         **({"train/loss_scale": scale.value,
                             "train/scale_overflows": scale.overflows} if scale.enabled else {})},
                        engine.steps)
        if section.eval_every and engine.steps % section.eval_every == 0:
            _evaluate_during(task, engine, tracker, kept)
        epoch_done = index == steps_per_epoch
        ckpt.save_if_due(engine.steps, {
            "epoch": epoch + epoch_done, "batch": 0 if epoch_done else index,
            "tokens": tokens, "loss": loss, "seconds": time.perf_counter() - start,
            "before": position.get("before", {}),
            **({"best": kept.record} if kept is not None else {})}, tracker)
    return {"tokens": tokens, "loss": loss, "seconds": time.perf_counter() - start}
