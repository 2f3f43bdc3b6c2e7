"""What the three steps share: step directories, config snapshots, progress bars,
batching, checkpoint settings, model placement, and the demo's ground-truth evaluation."""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from engine.chat_format import HH_TEMPLATE, uses_hh, with_variables
from engine.checkpoint import Checkpointer
from engine.data_parallel import DataParallel
from engine.errors import UserError
from engine.export import host_memory_bytes
from engine.placement import Placement
from engine.runtime import Runtime
from engine.tracking import Tracker
from engine.trainer import TrainEngine
from steps import demo
from steps.config import FINISHED, step_dir
from steps.data import DataError, PreferencePair, permutation, train_eval_split
from steps.tokenize import TokenizeStats, apply_chat_template


def start_step(cfg: DictConfig, step: int, dp: DataParallel, *, resume: bool) -> Path:
    """The step's directory with its config snapshot; a fresh start also drops the metrics
    and checkpoints of an earlier attempt."""
    directory = step_dir(cfg, step)
    if not resume:
        checkpointer(cfg, step, dp.runtime).clear()

    def write() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if not resume:
            (directory / "metrics.jsonl").unlink(missing_ok=True)
        (directory / FINISHED).unlink(missing_ok=True)   # train.py marks it at the end
        (directory / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    dp.write_once(write)
    return directory


def checkpointer(cfg: DictConfig, step: int, rt: Runtime) -> Checkpointer:
    return Checkpointer(step_dir(cfg, step), rt, every=cfg.engine.checkpoint_every,
                        keep=cfg.engine.keep_checkpoints)


class StepCheckpoints:
    """A step's checkpoints: its engines (and other stateful objects, e.g. EMA weights),
    their counters and schedules, the data `position` and the metrics rows so far."""

    def __init__(self, cfg: DictConfig, step: int, rt: Runtime, engines: dict[str, TrainEngine],
                 extra: dict | None = None):
        self.step, self.engines = step, engines
        self.stateful = {**engines, **(extra or {})}
        self.checkpointer = checkpointer(cfg, step, rt)

    def restore(self, position: dict, resume: bool) -> tuple[dict, int | None]:
        """Load the latest checkpoint when resuming. Returns the position to continue from
        (`position` when starting afresh) and how many metrics rows to keep (None: none)."""
        saved = self.checkpointer.load(self.stateful) if resume else None
        if not saved:
            return position, None
        for name, engine in self.engines.items():
            engine.load_progress_state(saved[name])
        where = ", ".join(f"{k} {v}" for k, v in saved["position"].items()
                          if k in ("epoch", "batch", "round", "iteration"))
        log(f"step {self.step}: resumed from {self.checkpointer.latest()} ({where}, optimizer "
            f"step {next(iter(self.engines.values())).steps})")
        return saved["position"], saved["metrics_rows"]

    def save_if_due(self, count: int, position: dict, tracker: Tracker) -> None:
        if self.checkpointer.due(count):
            self.checkpointer.save(count, self.stateful, {
                **{name: engine.progress_state() for name, engine in self.engines.items()},
                "metrics_rows": tracker.rows, "position": position})

    def clear(self) -> None:
        self.checkpointer.clear()


def placement(cfg: DictConfig, rt: Runtime) -> Placement:
    """Where this run's models live: the engine takes its own config group (as its schema
    object), and the two ZeRO-stage flags as its families' (engine/placement.py): the
    policies' (steps 1 and 3's actor) and the scorers' (step 2's reward model, the critic)."""
    return Placement(rt, OmegaConf.to_object(cfg.engine),
                     {"policy": cfg.actor_zero_stage, "scorer": cfg.reward_zero_stage})


def log(message: str) -> None:
    tqdm.write(message)   # to stdout, which train.py silences on ranks other than 0


def in_chat_format(cfg: DictConfig, what: str, pairs: list[PreferencePair], tokenizer,
                   owner: str) -> list[PreferencePair]:
    """`pairs` in the format the run trains in: hh-rlhf text as read, or with
    data.apply_chat_template as `tokenizer`'s chat template writes them (`owner` names the
    model it is from); the dialogues the template refuses are counted."""
    if not cfg.data.apply_chat_template:
        return pairs
    rendered, refused = apply_chat_template(pairs, tokenizer, owner)
    if refused:
        log(f"{what}: {refused} of {len(pairs)} dialogues skipped (the chat template of "
            f"{owner} refuses them)")
    return rendered


def saving_chat_format(cfg: DictConfig, tokenizer):
    """`tokenizer`, an actor's, made to render and save the format the run trains it in:
    with data.apply_chat_template its own chat template, given data.chat_template_kwargs
    when they are set ({} clears those a step before set), else the hh-rlhf one
    (engine.chat_format: chat.py and other tools then talk to the model as it was
    trained)."""
    variables = cfg.data.chat_template_kwargs
    if not cfg.data.apply_chat_template:
        tokenizer.chat_template = HH_TEMPLATE
    # unset: as the template is, with any variables a step before set in it
    elif variables is not None and tokenizer.chat_template and not uses_hh(tokenizer):
        variables = OmegaConf.to_container(variables, resolve=True)
        templates = tokenizer.chat_template   # a template, or several by name
        tokenizer.chat_template = (
            with_variables(templates, variables) if isinstance(templates, str)
            else {name: with_variables(t, variables) for name, t in templates.items()})
    return tokenizer


def require_trained_format(cfg: DictConfig, tokenizer, actor: str, what: str) -> None:
    """Refuse `what` (step 2 or 3) in the hh-rlhf format for step 1's actor (`actor`, its
    directory; `tokenizer`, its saved one) that step 1 trained in its chat template: the
    reward model and PPO would train on text the actor never read, and step 3 would save
    it with the hh template."""
    if (cfg.data.apply_chat_template or uses_hh(tokenizer)
            or Path(actor).resolve() != (Path(cfg.output_dir) / "actor").resolve()):
        return
    raise UserError(f"{what}: step 1 trained the actor {actor} in its chat template "
                    "(data.apply_chat_template=true); pass --apply-chat-template to this run "
                    "too, or run step 1 again without it")


def report_tokenized(what: str, stats: TokenizeStats, max_prompt_len: int,
                     max_answer_len: int | None = None) -> None:
    """Say how many examples were kept, dropped and truncated: nothing vanishes silently."""
    parts = [f"{what}: {stats.kept} examples"]
    if stats.dropped_long_prompt:
        parts.append(f"{stats.dropped_long_prompt} dropped (prompt > data.max_prompt_len="
                     f"{max_prompt_len} tokens)")
    if stats.dropped_empty_prompt:
        parts.append(f"{stats.dropped_empty_prompt} dropped (empty prompt: 0 tokens)")
    if stats.truncated_answer:
        parts.append(f"{stats.truncated_answer} answers cut to data.max_answer_len="
                     f"{max_answer_len} tokens")
    if stats.dropped_tied:
        parts.append(f"{stats.dropped_tied} dropped (chosen and rejected the same tokens, up to "
                     f"data.max_answer_len={max_answer_len}: no preference to learn)")
    if stats.earlier_replies or stats.unplaced_replies:
        parts.append(f"{stats.earlier_replies} earlier assistant replies trained on too "
                     "(sft.multiturn)")
    if stats.unplaced_replies:
        parts.append(f"{stats.unplaced_replies} not (the prompt does not hold them as written "
                     "alone: the chat template rewrites them, or their tokens merge with the "
                     "text around them)")
    log(", ".join(parts))


def require_examples(step: int, what: str, stats: TokenizeStats, max_prompt_len: int,
                     or_else: str = "") -> None:
    """Stop a step that filtering left with nothing to train on, saying why (`or_else`: a
    further way out, e.g. turning off what needs the examples)."""
    total = stats.dropped_long_prompt + stats.dropped_empty_prompt + stats.dropped_tied
    if stats.kept == 0 and total == 0:   # train.py's require_shares says more, up front
        raise DataError(f"step {step} has no {what}: its share of data.split holds no pairs; "
                        "add data or raise its weight in data.split")
    if stats.kept == 0:
        why = [f"{stats.dropped_long_prompt} of {total} prompts are longer than "
               f"data.max_prompt_len={max_prompt_len} tokens"] if stats.dropped_long_prompt else []
        if stats.dropped_empty_prompt:
            why.append(f"{stats.dropped_empty_prompt} of {total} prompts are empty (0 tokens)")
        if stats.dropped_tied:
            why.append(f"{stats.dropped_tied} of {total} pairs have the same chosen and rejected "
                       f"tokens up to data.max_answer_len")
        fixes = ["add data",
                 *(["raise data.max_prompt_len"] if stats.dropped_long_prompt else []),
                 *(["raise data.max_answer_len where answers part past it"]
                   if stats.dropped_tied else []),
                 *([or_else] if or_else else [])]
        said = f"{', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
        raise DataError(f"step {step} has no {what} after filtering: {', '.join(why)}; {said}")


def train_eval_examples(cfg: DictConfig, step: int, what: str, pairs: list, tokenizer,
                        tokenize: Callable, held_out: list | None = None) -> tuple[list, list]:
    """`pairs` split by data.eval_fraction (or all of them trained on, `held_out` given:
    data.eval_path's pairs), then tokenized by `tokenize` (tokenize_sft or tokenize_pairs):
    (train, eval) examples, both reported and checked (an empty eval set only where the
    user gave none)."""
    data = cfg.data
    train_pairs, eval_pairs = ((pairs, held_out) if held_out is not None
                               else train_eval_split(pairs, data.eval_fraction, cfg.seed))
    if held_out is not None:
        report_overlap(f"step {step}", "pairs (data.eval_path)", train_pairs, held_out,
                       lambda pair: (pair.prompt, pair.chosen, pair.rejected))
    train, stats = tokenize(train_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    report_tokenized(f"step {step} train", stats, data.max_prompt_len, data.max_answer_len)
    evals, eval_stats = tokenize(eval_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    report_tokenized(f"step {step} eval", eval_stats, data.max_prompt_len, data.max_answer_len)
    require_examples(step, what, stats, data.max_prompt_len)
    if held_out is not None:
        require_examples(step, "held-out examples (data.eval_path)", eval_stats,
                         data.max_prompt_len, or_else="drop data.eval_path")
    return at_most(train, data.max_samples, f"step {step} train", cfg.seed), evals


def report_overlap(step: str, what: str, train: list, held_out: list, key: Callable) -> None:
    """Say how many `held_out` items (by `key`) are among the training ones: an evaluation on
    them measures memory, not what the model learned."""
    seen = {key(item) for item in train}
    shared = sum(key(item) in seen for item in held_out)
    if shared:
        log(f"{step}: {shared} of the {len(held_out)} held-out {what} are training data too; "
            "evaluate on data kept out of training")


def at_most(examples: list, limit: int, what: str, seed: int) -> list:
    """`limit` of `examples` (data.max_samples; 0: all) chosen by a seeded permutation, in
    their order; the cut said in the log."""
    if not limit or len(examples) <= limit:
        return examples
    log(f"{what}: trains on {limit} of its {len(examples)} examples (data.max_samples={limit})")
    return [examples[i] for i in sorted(permutation(len(examples), seed)[:limit])]


def batches(items: Sequence, batch_size: int, *, shuffle: bool, seed: int) -> Iterator[list]:
    """Consecutive batches of `items`, in a seeded order when shuffling."""
    order = permutation(len(items), seed) if shuffle else list(range(len(items)))
    for start in range(0, len(order), batch_size):
        yield [items[i] for i in order[start:start + batch_size]]


def epoch_batches(items: Sequence, batch_size: int, *, seed: int, skip: int, desc: str,
                  enabled: bool) -> Iterator[tuple[int, list]]:
    """(number, batch) of one epoch's shuffled batches, numbered from 1, after the first
    `skip` (those a resumed run had done), with a progress bar."""
    rest = itertools.islice(batches(items, batch_size, shuffle=True, seed=seed), skip, None)
    bar = tqdm(rest, desc=desc, total=num_batches(len(items), batch_size) - skip,
               disable=not enabled, leave=False, dynamic_ncols=True)
    return enumerate(bar, start=skip + 1)


class Draws:
    """An epoch's batches (epoch_batches) drawn one at a time, None after the last: an
    iteration may draw several (ppo.dynamic_sampling). `number` is the last one drawn's."""

    def __init__(self, numbered: Iterator[tuple[int, list]]):
        self._numbered, self.number = numbered, 0

    def __call__(self) -> list | None:
        self.number, batch = next(self._numbered, (self.number, None))
        return batch


def num_batches(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def ground_truth(prompts: Sequence[str], answers: Sequence[str]) -> tuple[float, int] | None:
    """(sum, count) of the demo ground-truth scores over the demo prompts among `prompts`;
    None when there are none."""
    scored = [demo.score(p, a) for p, a in zip(prompts, answers, strict=True)
              if demo.rule_of(p) is not None]
    return (sum(scored), len(scored)) if scored else None


def check_export_fits(host: int, disk: int, output_dir: Path, what: str, host_fix: str,
                      disk_fix: str) -> None:
    """Refuse, before training, an export that cannot be written: `host` bytes (the fp32
    copy it is written from, LoRA merged in) over this machine's memory, or `disk` bytes over
    the free space under `output_dir` (a 70B INT4 probe trained, then its export was
    killed). `what` names the export, the fixes say what to do."""
    where = Path(output_dir)
    while not where.exists():   # a node other than rank 0's may not have made it
        where = where.parent
    have, free, gib = host_memory_bytes(), shutil.disk_usage(where).free, 2 ** 30
    if host > have:
        raise UserError(f"{what}: writing the model takes {host / gib:.0f} GiB of fp32 on the "
                        f"host, which has {have / gib:.0f} GiB; {host_fix}")
    if disk > free:
        raise UserError(f"{what}: the exports take {disk / gib:.0f} GiB, more than the "
                        f"{free / gib:.0f} GiB free under {output_dir}; free some or "
                        f"{disk_fix}")
